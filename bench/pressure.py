"""Issue 34 item 1: a serving relay at a steady offered load while something pins the xmin horizon.

A transaction that holds a transaction id, or a snapshot that stays open,
stops every vacuum in the cluster from removing a row version newer than it.
Each claim changes a row from ``pending`` to ``running``, which leaves the old
version's entry in the claim index (``pending`` rows only) pointing at a
version nothing may remove yet. Two modes put that pressure on one relay:

- ``pressure-xid``: one session runs ``BEGIN; SELECT txid_current();`` and stays
  idle in that transaction for the whole pressure phase (an application that
  forgot to commit, a stuck migration);
- ``pressure-rr``: :data:`READERS` sessions each scan ``outbox_message`` and
  ``outbox_attempt`` in a ``REPEATABLE READ`` transaction, one scan after
  another (reports, exports, an analyst's query).

Each run serves one relay (``--poll-interval 30``, so every delivery is woken
by NOTIFY) through two phases, ``clean`` then the pressure phase, each made of:

1. load: the benchmark commits one message of the ``latency`` route at a time,
   on a fixed schedule at the offered rate (one raw ``INSERT`` of the row
   ``emit()`` writes, autocommit, on one open connection with
   ``synchronous_commit = off``, so the producer keeps up with 1,000 a second
   on a small machine; the report says the rate it reached), and takes ``time.time()``
   when the commit returns; the handler takes ``time.time()`` first thing;
2. wake: once the load is delivered, :data:`WAKE_RATE` messages a second for a
   few seconds to the then idle relay: mode 4's wake-up latency, under the
   same pressure;
3. the dead tuples of ``outbox_message`` and ``outbox_attempt``
   (``pg_stat_user_tables.n_dead_tup``) and the buffers a claim from the
   front of the queue reads (its ``SELECT`` under ``EXPLAIN (ANALYZE,
   BUFFERS)``, locking nothing), still under the phase's pressure.

Per phase: offered and completed rates over the load window (handler starts
inside the window / its length), completion = completed / offered, claim
latency (commit -> handler start) p50/p99 of the load's messages, wake
p50/p99, and whether the relay kept up all along (the largest backlog, and the
rate of handler starts in the slowest 10 s of the window). Targets:
completion under pressure >= 95 % of clean, claim p99 <= 2x clean, wake p99
<= 5 ms. The check: every message delivered exactly once with
one history row, one handler start per commit, the relay exits 0, and the
pressure still held at the end of its phase.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .app import EVENTS, ob
from .drain import RelaySettings
from .harness import Scratch, conninfo, relays, wait_drained, wait_listening
from .verify import Expected, Unverified, check_delivered, percentile, read_handler_starts, read_traces

__all__ = ["PHASES", "PRESSURE_MODES", "PressureSizes", "add_arguments", "pressure", "sizes_from"]

#: What ``--only`` accepts for this module; neither runs by default (each takes many minutes).
PRESSURE_MODES = ("pressure-xid", "pressure-rr")
PHASES = ("clean", "pressure")
#: Concurrent REPEATABLE READ readers in ``pressure-rr``.
READERS = 4
#: What each reader scans per transaction in ``pressure-rr``: both outbox tables, whole.
READER_SCANS = (
    "SELECT count(*), max(length(payload::text)) FROM outbox_message",
    "SELECT count(*), max(finished_at) FROM outbox_attempt",
)
#: Messages a second while the wake-up latency is measured (mode 4's rate).
WAKE_RATE = 20.0
#: The targets (issue 34 item 1).
COMPLETION_MIN = 0.95
CLAIM_P99_MAX_RATIO = 2.0
WAKE_P99_MAX_MS = 5.0

_INSERT = """
INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,
                            max_attempts, available_at, created_at, updated_at)
VALUES (gen_random_uuid(), %(event_type)s, 'latency', %(queue)s, %(priority)s,
        jsonb_build_object('n', %(n)s::int), '{}'::jsonb, %(max_attempts)s, now(), now(), now())
"""
#: Dead tuples per outbox table. History is partitioned by day (``outbox_0024``): the statistics
#: count its partitions, not the parent, so its figure is their sum.
_DEAD = """
SELECT 'outbox_message', coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
 WHERE relid = 'outbox_message'::regclass
UNION ALL
SELECT 'outbox_attempt', coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
 WHERE relid = 'outbox_attempt'::regclass
    OR relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox_attempt'::regclass)
"""
#: The claim's scan from the front (relay/sql_postgresql.py), without its lock or its update.
_FRONT_SCAN = """
EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
SELECT c.id FROM outbox_message c
 WHERE c.status = 'pending' AND c.queue = %(queue)s AND c.handler = 'latency'
   AND (c.priority, c.id) >= (-2147483648, 0) AND c.available_at <= now()
 ORDER BY c.priority, c.id LIMIT 250
"""


@dataclass(frozen=True, slots=True)
class PressureSizes:
    rate: float = 1000.0
    clean_seconds: float = 120.0
    pressure_seconds: float = 600.0
    #: 1,200 wake-ups at 20 a second: a p99 of 200 was their second slowest, one hiccup's figure
    wake_seconds: float = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pressure-rate", type=float, default=1000.0, help="pressure modes: offered msg/s (default: 1000)"
    )
    p.add_argument(
        "--pressure-seconds",
        type=float,
        default=600.0,
        help="pressure modes: length of the pressure phase's load (default: 600, the issue's 10 minutes)",
    )
    p.add_argument(
        "--pressure-clean-seconds",
        type=float,
        default=120.0,
        help="pressure modes: length of the clean phase's load (default: 120)",
    )
    p.add_argument(
        "--pressure-wake-seconds",
        type=float,
        default=60.0,
        help=f"pressure modes: seconds of wake-up samples per phase, at {WAKE_RATE:g}/s (default: 60)",
    )


def sizes_from(args: argparse.Namespace) -> PressureSizes:
    for flag in ("pressure_rate", "pressure_seconds", "pressure_clean_seconds", "pressure_wake_seconds"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"bench: --{flag.replace('_', '-')} must be positive")
    return PressureSizes(
        rate=args.pressure_rate,
        clean_seconds=args.pressure_clean_seconds,
        pressure_seconds=args.pressure_seconds,
        wake_seconds=args.pressure_wake_seconds,
    )


# -- the pressure ------------------------------------------------------------------------------


@contextmanager
def held_xid(url: URL, scans: Sequence[str] = ()) -> Iterator[Callable[[], dict[str, Any]]]:
    """A session idle in a transaction that holds an xid, for the block; yields its final check."""
    conn = psycopg.connect(conninfo(url))
    try:
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None

        def check() -> dict[str, Any]:
            try:  # the same transaction, still open: the horizon was held all along
                again = conn.execute("SELECT txid_current()").fetchone()
            except psycopg.Error as exc:
                raise Unverified(f"the held transaction ended early: {exc}") from exc
            if again is None or again[0] != row[0]:
                raise Unverified("the held transaction changed under the phase")
            return {"held_xid": row[0]}

        yield check
    finally:
        conn.close()  # rolls back


@contextmanager
def readers(url: URL, scans: Sequence[str] = READER_SCANS) -> Iterator[Callable[[], dict[str, Any]]]:
    """:data:`READERS` sessions running ``scans`` in REPEATABLE READ, back to back, for the block."""
    stop = threading.Event()
    rounds = [0] * READERS
    errors: list[BaseException] = []

    def read(slot: int) -> None:
        try:
            with psycopg.connect(conninfo(url)) as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                while not stop.is_set():
                    with conn.transaction():
                        for scan in scans:
                            conn.execute(scan)
                    rounds[slot] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(READERS)]
    for t in threads:
        t.start()

    def check() -> dict[str, Any]:
        if errors:
            raise Unverified(f"a reader failed: {errors[0]!r}")
        if min(rounds) == 0:
            raise Unverified(f"a reader never finished a scan: {rounds}")
        return {"reader_scans": sum(rounds)}

    try:
        yield check
    finally:
        stop.set()
        for t in threads:
            t.join(120)


#: Each pressure by mode: called with the database and what a reader scans there.
PRESSURES: dict[str, Callable[[URL, Sequence[str]], AbstractContextManager[Callable[[], dict[str, Any]]]]] = {
    "pressure-xid": held_xid,
    "pressure-rr": readers,
}


# -- the load ----------------------------------------------------------------------------------


class Producer:
    """Commits one message at a time on a fixed schedule; remembers each commit's time.

    ``insert`` writes one message numbered ``%(n)s``, with ``params`` for the rest.
    """

    def __init__(self, url: URL, insert: str, params: dict[str, Any]) -> None:
        self._insert = insert
        self._params = params
        self._conn = psycopg.connect(conninfo(url), autocommit=True)
        # Visible to every session at once, as any commit; only the wait for the disk is left out,
        # which would hold one connection to a few hundred commits a second.
        self._conn.execute("SET synchronous_commit = off")
        self.committed: dict[int, float] = {}

    def offer(self, rate: float, seconds: float) -> tuple[range, float, float]:
        """``rate`` messages a second for ``seconds``; returns their numbers and the window."""
        first = len(self.committed)
        count = max(1, round(rate * seconds))
        began = time.monotonic()
        window_start = time.time()
        for i in range(count):
            pause = began + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            self._conn.execute(self._insert, {**self._params, "n": first + i}, prepare=True)
            self.committed[first + i] = time.time()
        return range(first, first + count), window_start, time.time()

    def close(self) -> None:
        self._conn.close()


def _server_facts(url: URL, queue: str) -> dict[str, Any]:
    time.sleep(1.0)  # backends report their counts to the statistics at most once a second
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        dead: dict[str, int] = dict(conn.execute(_DEAD).fetchall())
        row = conn.execute(_FRONT_SCAN, {"queue": queue}).fetchone()
    assert row is not None
    return {
        "dead_message": int(dead.get("outbox_message", 0)),
        "dead_attempt": int(dead.get("outbox_attempt", 0)),
        **front_scan_facts(row[0]),
    }


def front_scan_facts(explained: Any) -> dict[str, Any]:
    """Buffers and milliseconds of a claim's front scan, from its EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)."""
    plan = explained[0]
    top = plan["Plan"]
    return {
        "front_scan_buffers": int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)),
        "front_scan_ms": float(plan["Execution Time"]),
    }


def run_phase(
    producer: Producer,
    sizes: PressureSizes,
    seconds: float,
    *,
    drained: Callable[[int, float], None],
    facts: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The load for ``seconds``, the wake-up samples, then the server's facts: one phase, unreduced.

    ``drained(count, timeout)`` returns once ``count`` messages are delivered.
    """
    load, start, end = producer.offer(sizes.rate, seconds)
    drained(len(producer.committed), 120.0 + len(producer.committed) / 100)
    wake, _, _ = producer.offer(WAKE_RATE, sizes.wake_seconds)
    drained(len(producer.committed), 60.0)
    return {"load": load, "window": (start, end), "wake": wake, **facts()}


def pressure(scratch: Scratch, *, kind: str, sizes: PressureSizes, settings: RelaySettings) -> dict[str, Any]:
    """One relay through the clean phase, then ``kind``'s pressure phase; figures per phase, verified."""
    if kind not in PRESSURES:
        raise ValueError(f"kind must be one of {tuple(PRESSURES)}, not {kind!r}")
    purpose = kind.replace("-", "_")
    url = scratch.postgres(purpose)
    workdir = scratch.subdir(purpose)
    samples = workdir / "handler-starts.txt"
    env = {"BENCH_TRACE_DIR": str(workdir), "BENCH_LATENCY_FILE": str(samples)}
    spec = ob.get_route("latency")
    params = {
        "event_type": EVENTS["latency"],
        "queue": spec.queue,
        "priority": spec.priority,
        "max_attempts": spec.max_attempts,
    }
    producer = Producer(url, _INSERT, params)
    phases: dict[str, dict[str, Any]] = {}
    held: dict[str, Any] = {}
    try:
        with relays(url, 1, settings.args(poll_interval=30.0), workdir=workdir, env=env) as procs:
            wait_listening(url, procs)

            def phase(seconds: float) -> dict[str, Any]:
                return run_phase(
                    producer,
                    sizes,
                    seconds,
                    drained=lambda count, timeout: wait_drained(url, count, procs, timeout),
                    facts=lambda: _server_facts(url, spec.queue),
                )

            phases["clean"] = phase(sizes.clean_seconds)
            with PRESSURES[kind](url, READER_SCANS) as still_held:
                phases["pressure"] = phase(sizes.pressure_seconds)
                held = still_held()
            procs[0].stop()
    finally:
        producer.close()
    committed = producer.committed
    expected = Expected(len(committed), relays=[procs[0].name])
    check_delivered(url, expected)
    read_traces(workdir, "latency", expected)
    return {"kind": kind, **held, **reduce_phases(phases, committed, read_handler_starts(samples, committed))}


def reduce_phases(
    phases: dict[str, dict[str, Any]], committed: dict[int, float], started: dict[int, float]
) -> dict[str, Any]:
    """Each phase's figures from the commit and handler-start times, and the message count."""
    figures = {name: _figures(phase, committed, started) for name, phase in phases.items()}
    return {"messages": len(committed), **figures}


def _figures(phase: dict[str, Any], committed: dict[int, float], started: dict[int, float]) -> dict[str, Any]:
    start, end = phase["window"]
    span = end - start
    load: range = phase["load"]
    completed = sum(1 for at in started.values() if start <= at <= end)
    claim = [(started[n] - committed[n]) * 1000 for n in load]
    wake = [(started[n] - committed[n]) * 1000 for n in phase["wake"]]
    offered = len(load) / span
    return {
        **_lag(load, committed, started),
        "seconds": round(span, 1),
        "offered_per_s": round(offered, 1),
        "completed_per_s": round(completed / span, 1),
        "completion": round(completed / span / offered, 4),
        "claim_ms_p50": round(percentile(claim, 50), 2),
        "claim_ms_p99": round(percentile(claim, 99), 2),
        "claim_ms_max": round(max(claim), 2),
        "wake_ms_p50": round(percentile(wake, 50), 2),
        "wake_ms_p99": round(percentile(wake, 99), 2),
        "wake_slowest": _slowest(phase["wake"], committed, started),
        "dead_message": phase["dead_message"],
        "dead_attempt": phase["dead_attempt"],
        "front_scan_buffers": phase["front_scan_buffers"],
        "front_scan_ms": round(phase["front_scan_ms"], 2),
    }


def _lag(load: range, committed: dict[int, float], started: dict[int, float]) -> dict[str, Any]:
    """Whether the relay kept up all along: the largest backlog, and the slowest 10 s of handler starts.

    A claim p99 far above the clean phase's is either every claim a little
    slower (a cost per claim) or a backlog that built up and drained again (the
    relay fell behind for a while, host contention included); these two tell
    which.
    """
    commits = sorted(committed[n] for n in load)
    starts = sorted(started[n] for n in load)
    backlog, done = 0, 0
    for i, at in enumerate(commits, start=1):
        while done < len(starts) and starts[done] <= at:
            done += 1
        backlog = max(backlog, i - done)
    first = commits[0]
    buckets = [0] * max(1, int((commits[-1] - first) // _LAG_WINDOW))
    for at in starts:
        slot = int((at - first) // _LAG_WINDOW)
        if 0 <= slot < len(buckets):
            buckets[slot] += 1
    return {
        "backlog_max": backlog,
        "slowest_10s_per_s": round(min(buckets) / _LAG_WINDOW, 1),
        "stalls": _stalls(load, committed, started),
    }


def _stalls(load: range, committed: dict[int, float], started: dict[int, float]) -> list[str]:
    """The worst seconds of the window by claim latency, as UTC commit times, to look up in the server log.

    A stall of a second shows as a run of seconds whose commits all waited; the
    server's log (statements over ``log_min_duration_statement``, autovacuum,
    checkpoints) at those times says what the relay was waiting behind.
    """
    worst: dict[int, float] = {}
    for n in load:
        second = int(committed[n])
        worst[second] = max(worst.get(second, 0.0), started[n] - committed[n])
    slow = sorted((lag, second) for second, lag in worst.items() if lag >= _STALL)
    return [
        f"{time.strftime('%H:%M:%S', time.gmtime(second))} {lag * 1000:.0f} ms"
        for lag, second in sorted(slow[-_STALLS_LISTED:], key=lambda item: item[1])
    ]


def _slowest(wake: range, committed: dict[int, float], started: dict[int, float]) -> list[str]:
    """The slowest wake-ups, each at its commit's UTC time to the millisecond: what ran beside them."""
    slow = sorted(wake, key=lambda n: started[n] - committed[n])[-_WAKES_LISTED:]
    return [
        f"{time.strftime('%H:%M:%S', time.gmtime(committed[n]))}.{int(committed[n] % 1 * 1000):03d}"
        f" {(started[n] - committed[n]) * 1000:.1f} ms"
        for n in sorted(slow, key=lambda n: committed[n])
    ]


#: Seconds per bucket of :func:`_lag`'s slowest-window rate.
_LAG_WINDOW = 10.0
#: A claim latency (seconds) that :func:`_stalls` lists its second for, and how many it lists at most.
_STALL = 0.1
_STALLS_LISTED = 30
#: Wake-ups :func:`_slowest` lists.
_WAKES_LISTED = 5
