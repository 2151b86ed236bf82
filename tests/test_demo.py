"""The README's first command: examples/demo.py as a subprocess, on SQLite and (twice) on PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def run_demo(tmp_path: Path, *args: str) -> str:
    """Run the demo with its temporary folder under ``tmp_path``; returns stdout after checking it."""
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TMPDIR": str(temp)},
        cwd=DEMO.parents[1],
    )
    assert done.returncode == 0, f"demo failed:\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "demo finished: everything delivered" in out
    assert "emails received by the SMTP sink: 3" in out
    # The history: three welcome mails, three CRM webhooks that were retried after a 503, the report.
    assert len(re.findall(r"-> welcome_email +delivered attempts=1", out)) == 3, out
    assert len(re.findall(r"-> crm_webhook +delivered attempts=2", out)) == 3, out
    assert len(re.findall(r"attempt 1: retry", out)) == 3, out
    assert "error:  outbox.RetryLater: HTTP 503 from 127.0.0.1:" in out
    assert '"smtp_code": 250' in out and '"smtp_message": "Message accepted for delivery"' in out
    assert "report: complete, 3 rows" in out and "3,linus@example.com,Linus" in out
    assert "mallory" not in out.split("Every message")[1], "a rolled-back signup emitted something"
    assert list(temp.iterdir()) == [], "the demo left its temporary folder behind"
    return out


def test_demo_on_sqlite(tmp_path):
    out = run_demo(tmp_path)
    assert out.startswith(f"database: sqlite:///{tmp_path / 'tmp'}")


def test_demo_on_postgresql_twice_against_the_same_database(tmp_path, empty_pg_url):
    first = run_demo(tmp_path, "--database-url", empty_pg_url)
    second = run_demo(tmp_path, "--database-url", empty_pg_url)
    nonces = [re.findall(r"signups \(run (\w+)\)", out) for out in (first, second)]
    assert len(nonces[0]) == len(nonces[1]) == 1 and nonces[0] != nonces[1]
    # The second run lists its own messages only, numbered after the first run's.
    first_ids = [int(i) for i in re.findall(r"^  #(\d+) ", first, re.M)]
    second_ids = [int(i) for i in re.findall(r"^  #(\d+) ", second, re.M)]
    assert len(first_ids) == len(second_ids) == 8 and min(second_ids) > max(first_ids)
