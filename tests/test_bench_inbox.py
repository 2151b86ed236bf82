"""The benchmark's inbox mode at a tiny size: it runs, verifies its rows, and reports every figure.

Behaviour only: the figures are timings, so the test checks that they exist
and are consistent, never how large they are.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from sqlalchemy.engine import make_url

from bench.inbox import INBOX_TARGET_US, inbox_cost, inbox_rows


def test_inbox_mode_reports_percentiles_and_their_differences(pg_url: str) -> None:
    figures = inbox_cost(make_url(pg_url), transactions=5)
    for kind in ("plain", "receive", "process", "duplicate"):
        for stat in ("p50", "p99"):
            value = figures[f"{kind}_us_{stat}"]
            assert math.isfinite(value) and value > 0, (kind, stat)
    assert figures["process_added_us_p50"] == figures["process_us_p50"] - figures["plain_us_p50"]
    out = {"inbox_transactions": 5, **{f"inbox_{k}": v for k, v in figures.items()}}
    ((mode, _, target, result),) = inbox_rows(out)
    assert mode == "inbox cost per message (pg)" and target == f"p50 <= {INBOX_TARGET_US:.0f} us"
    assert result in ("PASS", "FAIL")


def test_inbox_mode_on_sqlite(sqlite_template: Path, tmp_path: Path) -> None:
    path = tmp_path / "inbox.db"
    shutil.copy(sqlite_template, path)
    figures = inbox_cost(make_url(f"sqlite:///{path}"), transactions=3)
    assert figures["duplicate_us_p50"] > 0
