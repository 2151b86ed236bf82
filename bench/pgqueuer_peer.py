"""The nearest peer: pgqueuer, run as its documentation says, at its defaults, in drain mode.

pgqueuer (extra ``[bench]``) is a PostgreSQL job queue for asyncio: workers
claim with ``FOR UPDATE SKIP LOCKED``, wake on LISTEN/NOTIFY, delete a
finished job and write a row to ``pgqueuer_log`` per step (queued, picked,
successful). Its schema is installed with ``Queries.install()`` (what ``pgq
install`` runs) in a database of its own. The jobs are enqueued with its own
batch ``Queries.enqueue()`` before the workers start; each worker is
``python -m bench.pgqueuer_worker``, which runs ``pgqueuer.run(factory,
mode=drain)`` as ``pgq run FACTORY --mode drain`` does and passes nothing
else, so batch size (10), dequeue timeout, heartbeat and concurrency are
pgqueuer's own defaults. Drain mode exits once the queue is empty and the
worker's tasks have finished. 1 or 2 workers are told GO together and timed
from GO to the last exit.

Verified: the queue table is empty, ``pgqueuer_log`` holds exactly one
``queued``, one ``picked`` and one ``successful`` row per job and nothing
else, and the workers' own per-job call counts are exactly 1 for every job.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .gate import gated, run_gated
from .harness import Scratch, conninfo
from .pgqueuer_worker import DSN_ENV, ENTRYPOINT, SIZE_ENV, TRACE_ENV
from .verify import Unverified

__all__ = ["check_calls", "check_pgqueuer_log", "pgqueuer_drain"]


async def _install_and_enqueue(dsn: str, count: int) -> None:
    import asyncpg  # type: ignore[import-untyped]
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    connection = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(connection))
        await queries.install()
        await queries.enqueue([ENTRYPOINT] * count, [str(n).encode() for n in range(count)], [0] * count)
        await connection.execute("ANALYZE")
    finally:
        await connection.close()


def pgqueuer_drain(scratch: Scratch, *, workers: int, count: int) -> dict[str, Any]:
    url = scratch.postgres(f"pgqueuer{workers}", migrate=False)
    workdir = scratch.subdir(f"pgqueuer{workers}")
    dsn = conninfo(url)
    asyncio.run(_install_and_enqueue(dsn, count))
    command = [sys.executable, "-m", "bench.pgqueuer_worker"]
    traces = [workdir / f"calls{i + 1}.bin" for i in range(workers)]
    envs = [{DSN_ENV: dsn, SIZE_ENV: str(count), TRACE_ENV: str(trace)} for trace in traces]
    with gated([command] * workers, workdir=workdir, envs=envs) as procs:
        seconds = run_gated(procs, timeout=60.0 + count / 100)
    by_worker = check_calls(traces, count)
    check_pgqueuer_log(url, count)
    return {"per_s": count / seconds, "seconds": seconds, "by_worker": by_worker, "database": url.database}


def check_calls(traces: Sequence[Path], count: int) -> list[int]:
    """Every job's entrypoint ran exactly once over all workers; returns each worker's share."""
    totals = [0] * count
    shares = []
    for path in traces:
        if not path.exists():
            raise Unverified(f"no call counts in {path.name}: did the worker stop cleanly?")
        calls = path.read_bytes()
        if len(calls) != count:
            raise Unverified(f"{path.name} counts {len(calls)} jobs, expected {count}")
        for n, c in enumerate(calls):
            totals[n] += c
        shares.append(sum(calls))
    missing = sum(1 for t in totals if t == 0)
    repeated = sum(1 for t in totals if t > 1)
    if missing or repeated:
        raise Unverified(f"of {count} jobs, {missing} never ran and {repeated} ran more than once")
    return shares


def check_pgqueuer_log(url: URL, count: int) -> None:
    """The queue is empty and each job was picked once and succeeded once, by pgqueuer's own log."""
    with psycopg.connect(conninfo(url)) as conn:
        left = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        rows = conn.execute(
            "SELECT status::text, count(*), count(DISTINCT job_id) FROM pgqueuer_log GROUP BY status"
        ).fetchall()
    if left is None or left[0] != 0:
        raise Unverified(f"{left and left[0]} jobs left in the queue")
    # (rows, distinct jobs) per status: each job queued, picked and successful exactly once.
    by_status = {status: (n, distinct) for status, n, distinct in rows}
    want = dict.fromkeys(("queued", "picked", "successful"), (count, count))
    if by_status != want:
        raise Unverified(f"pgqueuer_log (rows, jobs) by status: {by_status}, expected {want}")
