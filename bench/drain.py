"""Modes 2 and 5: drain a backlog through one or two ``outbox-relay`` processes.

The clock starts at a barrier: the relays are started first and left idle on
LISTEN, then the whole backlog is inserted in one transaction; the time right
after that commit is the start. The end is the last outcome the relays wrote
(``max(outbox_message.updated_at)``, the database clock at the start of the
last completion transaction), so the figure includes claiming, dispatching and
the batched status and history writes, and excludes process start-up. Both
clocks are this machine's wall clock. The span of the history itself (first
``started_at`` to last ``finished_at``) is reported alongside as a cross-check.

SQLite has no LISTEN: there the backlog is stored before the single relay
starts, and the window runs from the first attempt's start to the last write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .harness import Scratch, give_up_after, prefill, relays, wait_drained, wait_listening
from .verify import Expected, check_delivered, drain_window, read_traces

__all__ = ["RelaySettings", "drain_postgres", "drain_sqlite"]


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """The flags every throughput run passes to ``outbox-relay``.

    ``default_sizes`` passes neither ``--concurrency`` nor ``--batch-size``,
    so the relay runs at its own defaults, whatever they are in this build.
    """

    concurrency: int = 500
    batch_size: int = 250
    log_level: str = "WARNING"
    poll_interval: float = 1.0
    default_sizes: bool = False

    def args(self, *, poll_interval: float | None = None) -> list[str]:
        sizes = ["--concurrency", str(self.concurrency), "--batch-size", str(self.batch_size)]
        return [
            *([] if self.default_sizes else sizes),
            "--log-level",
            self.log_level,
            "--poll-interval",
            str(self.poll_interval if poll_interval is None else poll_interval),
        ]


def _timeout(count: int) -> float:
    """A relay idle on LISTEN, then handed a backlog: 200 msg/s is far below any rate it has shown."""
    return give_up_after(count, slowest_per_s=200)


def drain_postgres(
    scratch: Scratch,
    *,
    relay_count: int,
    count: int,
    settings: RelaySettings,
    fail_every: int = 0,
    purpose: str | None = None,
) -> dict[str, Any]:
    route = "flaky" if fail_every else "noop"
    purpose = purpose or f"drain{relay_count}"
    url = scratch.postgres(purpose)
    workdir = scratch.subdir(purpose)
    failing = len(range(0, count, fail_every)) if fail_every else 0
    env = {"BENCH_TRACE_DIR": str(workdir)}
    with relays(url, relay_count, settings.args(), workdir=workdir, env=env) as procs:
        wait_listening(url, procs)
        idle_cpu = sum(proc.cpu_seconds() for proc in procs)
        committed = prefill(url, route, count, fail_every=fail_every)
        wait_drained(url, count, procs, _timeout(count))
        # Start-up left out, as in the rate: the CPU the relays spent on this backlog.
        cpu = sum(proc.cpu_seconds() for proc in procs) - idle_cpu
        for proc in procs:
            proc.stop()
    expected = Expected(count, failing, relays=[p.name for p in procs])
    facts = check_delivered(url, expected)
    calls = read_traces(workdir, route, expected)
    first, last, written = drain_window(url)
    seconds = written.timestamp() - committed
    span = (last - first).total_seconds()
    return {
        "per_s": count / seconds,
        "seconds": seconds,
        "history_span_per_s": count / span,
        "relay_cpu_us_per_msg": 1e6 * cpu / count,
        "relay_startup_cpu_seconds": idle_cpu / relay_count,
        "history_rows": facts["history_rows"],
        "handler_calls": calls,
        "failing": failing,
        "by_relay": facts["by_relay"],
        "by_outcome": facts["by_outcome"],
    }


def drain_sqlite(scratch: Scratch, *, count: int, settings: RelaySettings) -> dict[str, Any]:
    url = scratch.sqlite("drain1")
    workdir = scratch.subdir("sqlite-drain1")
    prefill(url, "noop", count)
    env = {"BENCH_TRACE_DIR": str(workdir)}
    with relays(url, 1, settings.args(poll_interval=0.05), workdir=workdir, env=env) as procs:
        wait_drained(url, count, procs, _timeout(count))
        procs[0].stop()
    expected = Expected(count, relays=[procs[0].name])
    facts = check_delivered(url, expected)
    calls = read_traces(workdir, "noop", expected)
    first, _, written = drain_window(url)
    seconds = (written - first).total_seconds()
    return {
        "per_s": count / seconds,
        "seconds": seconds,
        "history_rows": facts["history_rows"],
        "handler_calls": calls,
    }
