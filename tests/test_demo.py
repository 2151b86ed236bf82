"""The README's first command: examples/demo.py as a subprocess, on SQLite and (twice) on PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

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


@pytest.fixture
def fresh_pg_database(pg_base_url: str) -> Iterator[str]:
    """An empty database the demo migrates itself, as a user's would be."""
    name = f"outbox_demo_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(pg_base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_demo_on_postgresql_twice_against_the_same_database(tmp_path, fresh_pg_database):
    first = run_demo(tmp_path, "--database-url", fresh_pg_database)
    second = run_demo(tmp_path, "--database-url", fresh_pg_database)
    nonces = [re.findall(r"signups \(run (\w+)\)", out) for out in (first, second)]
    assert len(nonces[0]) == len(nonces[1]) == 1 and nonces[0] != nonces[1]
    # The second run lists its own messages only, numbered after the first run's.
    first_ids = [int(i) for i in re.findall(r"^  #(\d+) ", first, re.M)]
    second_ids = [int(i) for i in re.findall(r"^  #(\d+) ", second, re.M)]
    assert len(first_ids) == len(second_ids) == 8 and min(second_ids) > max(first_ids)
