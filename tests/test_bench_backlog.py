"""The bench's backlog mode (issue 16 targets 3 and 7), run for real at a tiny size.

``outbox-relay`` starts, as a subprocess, on messages stored before it
existed: serving, and with ``--once``, at its default flags and at the
bench's. The assertions are on what was delivered and that a CPU figure was
read, never on speed. The checks behind every figure are then shown to fail
on a duplicate and on a missing delivery, so no rate can come from a run that
lost or repeated work.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import URL

from bench.backlog import backlog_ratios, backlog_rows, flag_sets, run_backlog
from bench.drain import RelaySettings
from bench.harness import Scratch, conninfo, prefill
from bench.verify import Expected, Unverified, check_delivered, read_traces

pytestmark = pytest.mark.postgres

COUNT = 200
#: Small sizes, so "tuned" differs from the relay's defaults and takes several claims.
SETTINGS = RelaySettings(concurrency=40, batch_size=20)


def _execute(url: URL, sql: str) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(sql)


def _run_modes(names: list[str]) -> Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]:
    """Stands in for the bench's ``Run.mode``, minus its error handling: a failure fails the test."""

    def mode(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        names.append(name)
        return fn()

    return mode


def test_default_flags_leave_the_sizes_to_the_relay() -> None:
    flags = flag_sets(SETTINGS)
    assert "--concurrency" not in flags["default"] and "--batch-size" not in flags["default"]
    tuned = flags["tuned"]
    assert tuned[tuned.index("--concurrency") + 1] == "40"
    assert tuned[tuned.index("--batch-size") + 1] == "20"


def test_serve_and_once_on_a_backlog_deliver_every_message_once(scratch: Scratch) -> None:
    names: list[str] = []
    out: dict[str, Any] = {}

    run_backlog(_run_modes(names), out, scratch, count=COUNT, settings=SETTINGS, want=lambda m: True, runs=2)

    assert len(names) == 8
    # Serve and --once alternate within a flag set, so their ratio compares neighbouring runs.
    assert [n.split(", ")[1] for n in names[:4]] == ["serve", "outbox-relay --once"] * 2
    assert out["messages_backlog"] == COUNT and out["backlog_runs"] == 2
    for flags in ("default", "tuned"):
        for how in ("serve", "once"):
            assert out[f"backlog_{how}_per_s_{flags}"] > 0
            assert out[f"backlog_{how}_wall_per_s_{flags}"] > 0
            # Spawn to the end includes start-up, so it is never shorter than the history's span.
            assert out[f"backlog_{how}_wall_per_s_{flags}"] < out[f"backlog_{how}_per_s_{flags}"]
            assert out[f"backlog_{how}_start_seconds_{flags}"] > 0
            assert out[f"backlog_{how}_relay_cpu_us_per_msg_{flags}"] > 0
            assert len(out[f"backlog_{how}_runs_per_s_{flags}"].split(", ")) == 2
            for run in (1, 2):
                url = scratch.server.set(database=f"{scratch.tag}_backlog_{how}_{flags}_{run}")
                facts = check_delivered(url, Expected(COUNT, relays=["relay1"]))
                assert facts["history_rows"] == COUNT and facts["by_relay"] == {"relay1": COUNT}
        assert out[f"backlog_once_vs_serve_{flags}"] > 0
        assert out[f"backlog_once_vs_serve_wall_{flags}"] > 0
    verdicts = [row[3] for row in backlog_rows(out) if row[0].startswith("3 --once / serve")]
    assert len(verdicts) == 2 and set(verdicts) <= {"PASS", "FAIL"}


def test_the_mode_runs_only_when_asked_for(scratch: Scratch) -> None:
    names: list[str] = []
    out: dict[str, Any] = {}
    run_backlog(_run_modes(names), out, scratch, count=COUNT, settings=SETTINGS, want=lambda m: m == "drain")
    assert names == [] and out == {} and backlog_rows(out) == []


def test_the_delivery_check_rejects_a_duplicate_and_a_missing_delivery(scratch: Scratch) -> None:
    url = scratch.postgres("verify")
    prefill(url, "noop", 3)
    with pytest.raises(Unverified, match="one delivery per message"):
        check_delivered(url, Expected(3))  # stored, never delivered

    _execute(
        url,
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, relay_id) "
        "SELECT id, 1, 'delivered', now(), now(), 'relay1' FROM outbox_message",
    )
    _execute(url, "UPDATE outbox_message SET status = 'delivered', attempts = 1")
    check_delivered(url, Expected(3, relays=["relay1"]))  # what a good run leaves passes

    _execute(
        url,
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, relay_id) "
        "SELECT message_id, attempt, outcome, started_at + interval '1 ms', finished_at, relay_id "
        "FROM outbox_attempt WHERE id = (SELECT min(id) FROM outbox_attempt)",
    )
    with pytest.raises(Unverified, match="one delivery per message"):
        check_delivered(url, Expected(3, relays=["relay1"]))


def test_the_handler_call_check_rejects_a_repeated_or_missing_call(tmp_path: Path) -> None:
    expected = Expected(4)
    trace = tmp_path / "noop-1.bin"
    trace.write_bytes(bytes([1, 1, 1, 1]))
    assert read_traces(tmp_path, "noop", expected) == 4

    trace.write_bytes(bytes([1, 2, 1, 1]))
    with pytest.raises(Unverified):
        read_traces(tmp_path, "noop", expected)
    trace.write_bytes(bytes([1, 0, 1, 1]))
    with pytest.raises(Unverified):
        read_traces(tmp_path, "noop", expected)


def test_ratios_and_verdicts_follow_both_clocks() -> None:
    out: dict[str, Any] = {
        "messages_backlog": 20000,
        "backlog_serve_per_s_default": 10000.0,
        "backlog_once_per_s_default": 9500.0,
        "backlog_serve_wall_per_s_default": 5000.0,
        "backlog_once_wall_per_s_default": 4000.0,
        "backlog_serve_per_s_tuned": 10000.0,
        "backlog_once_per_s_tuned": 9500.0,
        "backlog_serve_wall_per_s_tuned": 5000.0,
        "backlog_once_wall_per_s_tuned": 4600.0,
    }
    ratios = backlog_ratios(out)
    assert ratios == {
        "backlog_once_vs_serve_default": 0.95,
        "backlog_once_vs_serve_wall_default": 0.8,
        "backlog_once_vs_serve_tuned": 0.95,
        "backlog_once_vs_serve_wall_tuned": 0.92,
    }
    verdicts = {row[0]: row[3] for row in backlog_rows({**out, **ratios})}
    assert verdicts["3 --once / serve, default flags"] == "FAIL"
    assert verdicts["3 --once / serve, tuned flags"] == "PASS"
    assert backlog_rows({**out, "backlog_once_vs_serve_default": None})[2][3] == "-"
    assert {row[3] for row in backlog_rows({**out, **ratios, "quick": True})} == {"-"}


def test_a_once_relay_that_fails_is_unverified_and_still_reports_its_cpu(
    scratch: Scratch, tmp_path: Path
) -> None:
    from bench.harness import RelayProcess

    missing = scratch.server.set(database=f"{scratch.tag}_never_created")
    proc = RelayProcess(missing, ["--once"], workdir=tmp_path, name="relay1")
    with pytest.raises(Unverified, match="exited 1"):
        proc.wait_exit(60.0)
    assert not proc.alive()
    assert proc.cpu_seconds() > 0  # from the rusage wait4 returned: /proc no longer has the process
