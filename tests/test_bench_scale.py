"""The bench's scale mode at a tiny size, against a real PostgreSQL: its result is checked, not its speed.

The mode verifies its own drain (it raises ``Unverified`` otherwise); these
tests also read the databases it filled before they are dropped, so a mode
that checked the wrong thing would still fail here.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from bench.__main__ import DEFAULT_MODES, MODES, main
from bench.drain import RelaySettings
from bench.harness import Scratch, conninfo
from bench.scale import scale

pytestmark = pytest.mark.postgres

PENDING = 2_000
HISTORY = 5_000
SMALL = 500


def test_scale_mode_delivers_every_message_once_over_the_prefilled_history(pg_base_url: str) -> None:
    scratch = Scratch(pg_base_url)
    try:
        result = scale(
            scratch,
            pending=PENDING,
            history=HISTORY,
            small=SMALL,
            settings=RelaySettings(concurrency=50, batch_size=50),
        )
        small_db, big_db = (name for name in scratch.databases if name.endswith(("scale_small", "scale_big")))
        facts = {name: _facts(scratch, name) for name in (small_db, big_db)}
    finally:
        scratch.close()
    assert facts[small_db] == {
        "messages": SMALL,
        "delivered_once": SMALL,
        "history": SMALL,
        "history_of_purged": 0,
        "distinct_n": SMALL,
    }
    assert facts[big_db] == {
        "messages": PENDING,
        "delivered_once": PENDING,
        "history": HISTORY + PENDING,
        "history_of_purged": HISTORY,
        "distinct_n": PENDING,
    }
    assert result["big_run"].history_rows == HISTORY + PENDING
    assert result["small_run"].history_rows == SMALL
    late = (result["big_run"].late_claim, result["big_run"].late_front_claim)
    # the late claims are timed in a pair, or not at all when the drain ends between two of the mode's polls
    assert late == (None, None) or None not in late
    assert len(result["plans"]) == 3 + sum(plan is not None for plan in late)
    for plan in result["plans"]:
        assert any(line.startswith("Update on outbox_message") for line in plan.plan)
        assert len(plan.runs) in (3, 5)


def _facts(scratch: Scratch, name: str) -> dict[str, int]:
    """What a drained scale database holds, counted independently of the mode's own check."""
    with psycopg.connect(conninfo(scratch.server.set(database=name))) as conn:
        row = conn.execute(
            """
            SELECT (SELECT count(*) FROM outbox_message),
                   (SELECT count(*) FROM outbox_message m
                     WHERE m.status = 'delivered' AND m.attempts = 1
                       AND (SELECT count(*) FROM outbox_attempt a WHERE a.message_id = m.id) = 1),
                   (SELECT count(*) FROM outbox_attempt),
                   (SELECT count(*) FROM outbox_attempt a
                     WHERE NOT EXISTS (SELECT 1 FROM outbox_message m WHERE m.id = a.message_id)),
                   (SELECT count(DISTINCT payload ->> 'n') FROM outbox_message)
            """
        ).fetchone()
    assert row is not None
    keys = ("messages", "delivered_once", "history", "history_of_purged", "distinct_n")
    return dict(zip(keys, (int(v) for v in row), strict=True))


def test_scale_runs_only_when_asked_for(pg_base_url: str, tmp_path: Path) -> None:
    assert "scale" in MODES
    assert "scale" not in DEFAULT_MODES
    out = tmp_path / "bench.json"
    explain = tmp_path / "plans.txt"
    code = main(
        [
            "--database-url",
            pg_base_url,
            "--quick",
            "--only",
            "scale",
            "--scale-pending",
            str(PENDING),
            "--scale-history",
            str(HISTORY),
            "--json",
            str(out),
            "--explain",
            str(explain),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["failed_modes"] is None
    assert result["scale_pending"] == PENDING
    assert result["scale_history_rows_after"] == HISTORY + PENDING
    for key in (
        "scale_vs_small",
        "scale_claim_ms_small",
        "scale_claim_ms_big",
        "scale_rss_mb_start",
        "scale_rss_mb_end",
    ):
        assert result[key] > 0
    # the late pair (from the position, from the front) only if a poll caught the tiny drain before its end
    assert explain.read_text().count("Update on outbox_message") in (3, 5)
    assert len(result["scale_drain_per_s_big_by_tenth"].split(", ")) == 10
