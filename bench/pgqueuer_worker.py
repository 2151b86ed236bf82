"""The pgqueuer worker the pgqueuer mode runs: ``python -m bench.pgqueuer_worker``.

pgqueuer's documented consumer: a factory opening an asyncpg connection,
``PgQueuer`` over it, one entrypoint, run by ``pgqueuer.run(factory,
mode=drain)`` on uvloop, which is what ``pgq run FACTORY --mode drain`` does
(the 1.6.0 CLI itself stops at start-up with typer 0.29, so it is not used)
and with the same defaults. The entrypoint does no work but counts, per job, the
sequence number its payload carries, and the counts are written to a file
when the worker stops, so the mode can check that every job ran exactly
once. The factory connects, then holds at the benchmark's barrier: the clock
starts at GO, not at process start.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pgqueuer
from pgqueuer import PgQueuer
from pgqueuer.models import Job
from pgqueuer.types import QueueExecutionMode

from .gate import wait_for_go

__all__ = ["DSN_ENV", "ENTRYPOINT", "SIZE_ENV", "TRACE_ENV", "main", "serve"]

DSN_ENV = "BENCH_PGQ_DSN"
TRACE_ENV = "BENCH_PGQ_TRACE"
SIZE_ENV = "BENCH_PGQ_JOBS"
ENTRYPOINT = "noop"


@asynccontextmanager
async def main() -> AsyncIterator[PgQueuer]:
    calls = bytearray(int(os.environ[SIZE_ENV]))
    connection = await asyncpg.connect(os.environ[DSN_ENV])
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        n = int(job.payload or b"")  # a job without its number fails, and the check then fails too
        calls[n] = min(calls[n] + 1, 255)

    wait_for_go()  # blocking on purpose: nothing else runs in this process before GO
    try:
        yield pgq
    finally:
        Path(os.environ[TRACE_ENV]).write_bytes(bytes(calls))
        await connection.close()


def serve() -> None:
    """``pgq run``'s body: the supervisor on uvloop where it is installed, as the CLI chooses."""
    worker = pgqueuer.run(main, mode=QueueExecutionMode.drain)
    try:
        import uvloop
    except ImportError:
        asyncio.run(worker)
    else:
        uvloop.run(worker)


if __name__ == "__main__":
    serve()
