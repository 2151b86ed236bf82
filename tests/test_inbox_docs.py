"""docs/inbox.md's examples run as written and print what the page shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "inbox.md"


def test_the_inbox_guides_examples_print_what_it_shows(tmp_path: Path) -> None:
    text = GUIDE.read_text()
    scripts = dict(re.findall(r"```python\n# file: (\S+)\n(.*?)```", text, re.S))
    outputs = re.findall(r"```console\n\$ python (\S+)\n(.*?)```", text, re.S)
    assert set(scripts) == {"shipping.py", "own_loop.py", "shipping_consumer.py", "requeue.py"}
    assert len(outputs) == 3
    for name, code in scripts.items():
        (tmp_path / name).write_text(code)
    for name, output in outputs:
        run = subprocess.run(
            [sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == output.splitlines(), name
    # The outbox-consumer example builds as written: its source is attached, nothing connects yet.
    built = subprocess.run(
        [sys.executable, "-c", "import shipping_consumer as m; print([s.name for s in m.inbox.sources])"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == "['rabbitmq:shipping']"
