"""The pressure modes' outside reference: the raw SKIP LOCKED queue serving under the same pressure.

Whether a target of issue 34 item 1 is within reach on a host is a question
about the host as much as about the relay: four readers scanning back to back
take both cores of a small machine from everything else. So the same phases
(:func:`bench.pressure.run_phase`) run again with the simplest correct
serving queue in place of the relay, under the same pressure, at the same
offered load: ``bench/rawqueue.py``'s table and its ``lease`` claim (a lease
commit, the work outside any transaction, a done commit: the shape any
relay whose handlers call the network must have), with one NOTIFY per
insert from a statement trigger, and one worker process that claims until a
claim finds nothing, then waits on LISTEN. No history, no retry, no
priority, no per-route anything.

``pressure-xid-raw`` and ``pressure-rr-raw`` report the same figures as the
relay's modes. The check: every row done exactly once, each with one recorded
start, and the worker's own count agrees.

``python -m bench.pressure_raw DSN SAMPLES`` is the worker itself; it serves
until SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .gate import gated, wait_for_go, wait_ready
from .harness import Scratch, conninfo
from .pressure import PRESSURES, PressureSizes, Producer, front_scan_facts, reduce_phases, run_phase
from .rawqueue import BATCH, DONE, LEASE, SCHEMA, check_rawqueue, reported
from .verify import Unverified, read_handler_starts

__all__ = ["RAW_MODES", "raw_pressure"]

#: What ``--only`` accepts for this module: the reference beside each relay mode.
RAW_MODES = ("pressure-xid-raw", "pressure-rr-raw")

_NOTIFY = """
CREATE FUNCTION raw_queue_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('raw_queue', '');
    RETURN NULL;
END $$;
CREATE TRIGGER raw_queue_notify AFTER INSERT ON raw_queue
    FOR EACH STATEMENT EXECUTE FUNCTION raw_queue_notify();
"""
_INSERT = "INSERT INTO raw_queue (payload) VALUES (jsonb_build_object('n', %(n)s::int))"
#: What a reader scans in ``pressure-rr-raw``: the queue's one table, whole.
_READER_SCANS = ("SELECT count(*), max(length(payload::text)) FROM raw_queue",)
#: The claim's scan (:data:`bench.rawqueue.LEASE`'s inner SELECT), without its lock.
_FRONT_SCAN = """
EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
SELECT id FROM raw_queue WHERE NOT done AND (locked_until IS NULL OR locked_until < now())
 ORDER BY id LIMIT %(batch)s
"""
_DEAD = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'raw_queue'"
_DONE_COUNT = "SELECT count(*) FILTER (WHERE done) FROM raw_queue"


def raw_pressure(scratch: Scratch, *, kind: str, sizes: PressureSizes) -> dict[str, Any]:
    """The raw queue through the clean phase, then ``kind``'s pressure phase; figures per phase, verified."""
    if kind not in RAW_MODES:
        raise ValueError(f"kind must be one of {RAW_MODES}, not {kind!r}")
    pressure = kind.removesuffix("-raw")
    purpose = kind.replace("-", "_")
    url = scratch.postgres(purpose, migrate=False)
    workdir = scratch.subdir(purpose)
    samples = workdir / "handler-starts.txt"
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(_NOTIFY)
    producer = Producer(url, _INSERT, {})
    phases: dict[str, dict[str, Any]] = {}
    held: dict[str, Any] = {}
    command = [sys.executable, "-m", "bench.pressure_raw", conninfo(url), str(samples)]
    try:
        with gated([command], workdir=workdir, envs=[{}]) as (worker,):
            wait_ready([worker])
            worker.go()

            def drained(count: int, timeout: float) -> None:
                _wait_done(url, count, worker, timeout)

            def phase(seconds: float) -> dict[str, Any]:
                return run_phase(producer, sizes, seconds, drained=drained, facts=lambda: _server_facts(url))

            phases["clean"] = phase(sizes.clean_seconds)
            with PRESSURES[pressure](url, _READER_SCANS) as still_held:
                phases["pressure"] = phase(sizes.pressure_seconds)
                held = still_held()
            worker.proc.terminate()
            if worker.proc.wait(30) != 0:
                raise Unverified(f"the raw worker exited {worker.proc.returncode}\n{worker.tail()}")
            delivered = reported(worker.log_path)
    finally:
        producer.close()
    committed = producer.committed
    check_rawqueue(url, len(committed), [delivered])
    return {"kind": kind, **held, **reduce_phases(phases, committed, read_handler_starts(samples, committed))}


def _wait_done(url: URL, count: int, worker: Any, timeout: float) -> None:
    """Until ``count`` rows are done; polls slowly, as ``harness.wait_drained`` does, to leave the CPU."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        while True:
            row = conn.execute(_DONE_COUNT).fetchone()
            if row is not None and row[0] == count:
                return
            if worker.proc.poll() is not None or time.monotonic() > deadline:
                raise Unverified(f"{row} of {count} rows done\n{worker.tail()}")
            time.sleep(0.1)


def _server_facts(url: URL) -> dict[str, Any]:
    time.sleep(1.0)  # backends report their counts to the statistics at most once a second
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        dead = conn.execute(_DEAD).fetchone()
        row = conn.execute(_FRONT_SCAN, {"batch": BATCH}).fetchone()
    assert dead is not None and row is not None
    return {"dead_message": int(dead[0]), "dead_attempt": 0, **front_scan_facts(row[0])}  # no history table


def serve(dsn: str, samples: str) -> int:
    """The worker: claim under a lease, record each start, mark done; wait on LISTEN when empty."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    delivered = 0
    fd = os.open(samples, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        with psycopg.connect(dsn, autocommit=True) as listen, psycopg.connect(dsn, autocommit=True) as work:
            listen.execute("LISTEN raw_queue")
            wait_for_go()
            while not stopping:
                rows = work.execute(LEASE, {"batch": BATCH}, prepare=True).fetchall()
                if not rows:
                    for _ in listen.notifies(timeout=1.0, stop_after=1):
                        pass
                    continue
                started = time.time()
                os.write(fd, "".join(f"{payload['n']} {started!r}\n" for _, payload in rows).encode())
                work.execute(DONE, {"ids": [row[0] for row in rows]}, prepare=True)
                delivered += len(rows)
    finally:
        os.close(fd)
    return delivered


if __name__ == "__main__":
    print("delivered", serve(sys.argv[1], sys.argv[2]), flush=True)
