"""The bench's pressure modes (issue 34 item 1), run for real for a few seconds each.

One relay serves a steady load through a clean phase, then through a phase in
which a transaction holds an xid (``pressure-xid``) or REPEATABLE READ readers
scan the outbox tables (``pressure-rr``); and the raw SKIP LOCKED queue through
the same phases, as the outside reference (``pressure-*-raw``). The assertions are on the report's
shape and on the checks behind it (every message delivered exactly once, the
pressure still held at the end of its phase), never on timings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import URL, make_url

from bench.__main__ import _parser
from bench.drain import RelaySettings
from bench.harness import Scratch, conninfo
from bench.pressure import PHASES, PRESSURE_MODES, PressureSizes, _server_facts, sizes_from
from bench.pressure_raw import RAW_MODES
from bench.pressure_report import ALL_PRESSURE_MODES, pressure_rows, run_pressure
from bench.rawqueue import check_rawqueue
from bench.verify import Expected, Unverified, check_delivered

pytestmark = pytest.mark.postgres

SIZES = PressureSizes(rate=100.0, clean_seconds=2.0, pressure_seconds=2.0, wake_seconds=1.0)
SETTINGS = RelaySettings(concurrency=40, batch_size=20)
FIGURES = (
    "offered_per_s",
    "completed_per_s",
    "completion",
    "claim_ms_p50",
    "claim_ms_p99",
    "wake_ms_p50",
    "wake_ms_p99",
    "backlog_max",
    "slowest_10s_per_s",
    "dead_message",
    "dead_attempt",
    "front_scan_buffers",
)


def _run_modes(names: list[str]) -> Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]:
    """Stands in for the bench's ``Run.mode``, minus its error handling: a failure fails the test."""

    def mode(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        names.append(name)
        return fn()

    return mode


def _reported_both_phases(scratch: Scratch, kind: str) -> tuple[dict[str, Any], str, int, URL]:
    """Runs ``kind`` alone and checks what every pressure mode reports; the flat figures, their prefix,
    the message count and the run's database."""
    names: list[str] = []
    out: dict[str, Any] = {}

    run_pressure(_run_modes(names), out, scratch, sizes=SIZES, settings=SETTINGS, want=kind.__eq__)

    assert len(names) == 1 and names[0].startswith(kind)
    prefix = kind.replace("-", "_")
    # Two loads of 200 and two wake samples of 20, numbered in one sequence.
    messages = out[f"{prefix}_messages"]
    assert messages == 2 * (200 + 20)
    for phase in PHASES:
        for figure in FIGURES:
            assert out[f"{prefix}_{phase}_{figure}"] is not None, (phase, figure)
        assert out[f"{prefix}_{phase}_offered_per_s"] > 0
        assert 0 < out[f"{prefix}_{phase}_completion"]
        assert out[f"{prefix}_{phase}_claim_ms_p50"] <= out[f"{prefix}_{phase}_claim_ms_p99"]
        assert out[f"{prefix}_{phase}_front_scan_buffers"] >= 1
        assert 1 <= out[f"{prefix}_{phase}_backlog_max"] <= 200  # one message at least is in flight
    # Every claim leaves a dead version of its row; nothing removes it while the horizon is held.
    assert out[f"{prefix}_pressure_dead_message"] > 0
    assert out[f"{prefix}_completion_vs_clean"] > 0 and out[f"{prefix}_claim_p99_vs_clean"] > 0
    assert [r[0] for r in pressure_rows(out)] == [
        f"34 {kind}, clean",
        f"34 {kind}, pressure",
        f"34 {kind}, completion / clean",
        f"34 {kind}, claim p99 / clean",
        f"34 {kind}, wake p99 under pressure",
    ]
    return out, prefix, messages, scratch.server.set(database=f"{scratch.tag}_{prefix}")


@pytest.mark.parametrize("kind", PRESSURE_MODES)
def test_a_pressure_mode_reports_both_phases_of_a_load_delivered_exactly_once(
    scratch: Scratch, kind: str
) -> None:
    out, prefix, messages, url = _reported_both_phases(scratch, kind)
    assert all(r[3] in ("PASS", "FAIL") for r in pressure_rows(out)[2:])
    # The figures came from a run the bench's own check accepted, and that check refuses a duplicate.
    facts = check_delivered(url, Expected(messages, relays=["relay1"]))
    assert facts["history_rows"] == messages
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
            " max_attempts, available_at, created_at, updated_at)"
            " SELECT gen_random_uuid(), event_type, handler, queue, priority, payload, headers,"
            " max_attempts, now(), now(), now() FROM outbox_message ORDER BY id LIMIT 1"
        )
    with pytest.raises(Unverified):
        check_delivered(url, Expected(messages, relays=["relay1"]))


@pytest.mark.parametrize("kind", RAW_MODES)
def test_the_raw_queue_reference_serves_the_same_phases_exactly_once_and_judges_nothing(
    scratch: Scratch, kind: str
) -> None:
    out, prefix, messages, url = _reported_both_phases(scratch, kind)
    assert out[f"{prefix}_pressure_dead_attempt"] == 0  # no history table
    assert all(r[3] == "ref" for r in pressure_rows(out)[2:])
    # The worker's count and the table agree; a row done twice is refused.
    check_rawqueue(url, messages, [messages])
    with pytest.raises(Unverified, match="the workers report"):
        check_rawqueue(url, messages, [messages - 1])
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("UPDATE raw_queue SET deliveries = 2 WHERE id = (SELECT min(id) FROM raw_queue)")
    with pytest.raises(Unverified, match="exactly once"):
        check_rawqueue(url, messages, [messages])


def test_a_pressure_mode_runs_only_when_asked_for() -> None:
    from bench.__main__ import DEFAULT_MODES, MODES

    assert set(ALL_PRESSURE_MODES) <= set(MODES)
    assert not set(ALL_PRESSURE_MODES) & set(DEFAULT_MODES)
    assert pressure_rows({}) == []


def test_the_phase_lengths_come_from_flags_and_must_be_positive() -> None:
    args = _parser().parse_args(["--pressure-seconds", "120", "--pressure-clean-seconds", "60"])
    sizes = sizes_from(args)
    assert (sizes.rate, sizes.clean_seconds, sizes.pressure_seconds) == (1000.0, 60.0, 120.0)
    assert sizes_from(_parser().parse_args([])).pressure_seconds == 600.0
    with pytest.raises(SystemExit, match="--pressure-seconds must be positive"):
        sizes_from(_parser().parse_args(["--pressure-seconds", "0"]))


def test_dead_tuples_of_history_are_its_partitions_sum(pg_url: str) -> None:
    """History is partitioned by day: its dead tuples are counted in its partitions, which the phase's
    figure adds up, beside the messages' own."""
    url = make_url(pg_url)
    with psycopg.connect(conninfo(url)) as conn:
        conn.execute(
            "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,"
            " relay_id) SELECT g, 1, 'delivered', now(), now(), 0, 'test' FROM generate_series(1, 30) AS g"
        )
        conn.rollback()  # 30 aborted insertions: dead tuples of today's partition
        conn.execute(
            "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
            " max_attempts, available_at, created_at, updated_at) SELECT gen_random_uuid(), 'e', 'latency',"
            " 'default', 0, '{}', '{}', 1, now(), now(), now() FROM generate_series(1, 7)"
        )
        conn.rollback()
        conn.execute("SELECT pg_stat_force_next_flush()")
    facts = _server_facts(url, "default")
    assert (facts["dead_attempt"], facts["dead_message"]) == (30, 7)
