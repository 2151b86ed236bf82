"""The README's example is what newcomers paste first: it must run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_example_runs_and_delivers(tmp_path: Path) -> None:
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "[('welcome_email', 'pending')]",
        "welcome a@example.com from User 1",
    ]
