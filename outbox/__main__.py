import sys

from outbox._cli import main

sys.exit(main())
