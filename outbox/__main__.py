from outbox._cli import main
import sys

sys.exit(main())
