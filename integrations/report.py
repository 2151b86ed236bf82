"""Reports fanned out into chunk jobs, assembled exactly once.

A report request becomes one ``outbox_report_run`` row plus one outbox message
per chunk, all in the caller's transaction: either the run and every chunk
exist, or none do. Each chunk writes its own part file (overwriting on a
retry, so re-running a chunk never duplicates rows) and records itself; the
chunk that completes the set wins a conditional update and assembles the CSV.

Chunks page by ``offset``/``limit`` fixed at ``start()``, so ``rows()`` must
return the same, explicitly ordered set every time it is called (order by a
unique key, bound the set by a high-water mark taken at start); otherwise rows
inserted or deleted meanwhile shift the pages and rows are duplicated or lost.

A run that can no longer complete is failed, so nobody waits for it: when a
chunk goes dead (the relay's ``message_dead`` signal), and when an operator
discards one (see :meth:`ReportJob.outbox_start` for how that is noticed).

Chunks go to the ``reports`` queue, but a queue is not a reservation: a relay
serving every queue gives report chunks every free slot. A relay that serves
reports and urgent mail must cap the queue (``queue_concurrency={"reports": 2}``)
or leave reports to relays of their own (``--queue reports``).

::

    signups = ReportJob(
        ob, "signups", engine=engine, output_dir="reports",
        header=["id", "email"],
        count=lambda s, params: s.scalar(
            select(func.count()).select_from(User).where(User.id <= params["max_id"])),
        rows=lambda s, params, offset, limit: s.execute(
            select(User.id, User.email).where(User.id <= params["max_id"])
            .order_by(User.id).offset(offset).limit(limit)),
    )
    with Session(engine) as s, s.begin():
        max_id = s.scalar(select(func.max(User.id))) or 0
        run_id = signups.start(s, {"max_id": max_id})
"""

from __future__ import annotations

import asyncio
import csv
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Engine, Row
from sqlalchemy.orm import Session

from outbox import ConfigurationError, Message, Outbox, PermanentError, Route, emit, signals
from outbox._first_line import first_line
from outbox._routes import check_name
from outbox.ops._reports import DiscardedChunk, discarded_chunks, report_handler

from ._report_tables import RUN_STATUSES, outbox_report_chunk, outbox_report_run, report_metadata

__all__ = [
    "RUN_STATUSES",
    "ReportJob",
    "ReportProgress",
    "outbox_report_chunk",
    "outbox_report_run",
    "report_metadata",
]

log = logging.getLogger("outbox.integrations.report")

#: A run in one of these statuses may still complete; a dead or discarded chunk fails it.
UNFINISHED = ("running", "assembling")

CountRows = Callable[[Session, Mapping[str, Any]], int]
FetchRows = Callable[[Session, Mapping[str, Any], int, int], Iterable[Sequence[Any]]]


@dataclass(frozen=True, slots=True)
class ReportProgress:
    """A run as a progress bar sees it."""

    id: str
    report: str
    status: str
    total_chunks: int
    done_chunks: int
    row_count: int
    location: str | None
    error: str | None

    @property
    def fraction(self) -> float:
        return self.done_chunks / self.total_chunks if self.total_chunks else 1.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ReportJob:
    """One kind of report: how to count and fetch its rows, where its CSV goes, how it is routed.

    ``count(session, params)`` is called once, by ``start()``, to size the
    chunks; ``rows(session, params, offset, limit)`` once per chunk attempt, in
    a fresh session on the relay. Both must see the same stable, explicitly
    ordered set, because chunk boundaries are offsets fixed at start (see the
    module docstring); a chunk that gets a different number of rows than the
    count promised logs ``action=report_rows_shifted``.

    Chunks are routed to ``queue`` (default ``reports``) at ``priority``
    (default 100). Priority orders messages only within one queue, so these
    defaults alone do not keep reports from taking every relay slot: cap the
    queue with ``Relay(..., queue_concurrency={"reports": 2})`` (CLI
    ``--queue-concurrency reports=2``) or serve it with its own relay
    (``--queue reports``), so mail always finds a free slot.

    Every ``discard_check_interval`` seconds (default 10), each relay serving
    the outbox looks for runs left unfinished by a discarded chunk
    (:meth:`outbox_start`).
    """

    def __init__(
        self,
        outbox: Outbox,
        name: str,
        *,
        engine: Engine,
        count: CountRows,
        rows: FetchRows,
        header: Sequence[str],
        output_dir: str | os.PathLike[str],
        chunk_size: int = 1000,
        queue: str = "reports",
        priority: int = 100,
        max_attempts: int = 5,
        timeout: float = 300.0,
        discard_check_interval: float = 10.0,
    ) -> None:
        self.name = check_name("report name", name)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigurationError(
                f"report {name!r}: chunk_size must be a positive integer, got {chunk_size!r}"
            )
        if (
            isinstance(discard_check_interval, bool)
            or not isinstance(discard_check_interval, int | float)
            or not 0 < discard_check_interval < math.inf
        ):
            raise ConfigurationError(
                f"report {name!r}: discard_check_interval must be a positive number of seconds,"
                f" got {discard_check_interval!r}"
            )
        if not header:
            raise ConfigurationError(f"report {name!r}: header must name at least one column")
        self.outbox = outbox
        self.engine = engine
        self.count = count
        self.rows = rows
        self.header = list(header)
        self.output_dir = Path(output_dir)
        self.chunk_size = chunk_size
        self.event_type = f"report.{name}.chunk"
        self.route = outbox.route(
            self.event_type,
            self,
            name=report_handler(name),  # what ops.report_runs looks for dead chunks under
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
        )
        self.discard_check_interval = float(discard_check_interval)
        # A chunk that goes dead fails its run, so the UI stops waiting for it.
        signals.message_dead.connect(self._on_dead, sender=outbox, weak=False)
        # Each relay's look for discarded chunks, by the event loop it serves on.
        self._discard_checks: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"<ReportJob {self.name}>"

    # -- request side (the caller's transaction) ----------------------------------------

    def start(self, session: Session, params: Mapping[str, Any] | None = None) -> str:
        """Record a run and emit its chunks in ``session``'s transaction; returns the run id."""
        params = dict(params or {})
        total_rows = int(self.count(session, params))
        chunks = max(1, math.ceil(total_rows / self.chunk_size))
        run_id = uuid.uuid4().hex
        session.execute(
            insert(outbox_report_run).values(
                id=run_id, report=self.name, params=params, total_chunks=chunks, created_at=_utcnow()
            )
        )
        for chunk in range(chunks):
            offset = chunk * self.chunk_size
            emit(
                session,
                self.event_type,
                {
                    "run_id": run_id,
                    "chunk": chunk,
                    "offset": offset,
                    "limit": self.chunk_size,
                    "expected": max(0, min(self.chunk_size, total_rows - offset)),
                },
                key=f"report:{run_id}:{chunk}",
            )
        return run_id

    def progress(self, run_id: str) -> ReportProgress:
        with self.engine.connect() as conn:
            row = conn.execute(select(outbox_report_run).where(outbox_report_run.c.id == run_id)).first()
        if row is None:
            raise LookupError(f"no report run {run_id!r}")
        return _progress(row)

    # -- relay side (one chunk per message) ----------------------------------------------

    def __call__(self, message: Message) -> dict[str, Any]:
        payload = message.payload
        run_id, chunk = str(payload["run_id"]), int(payload["chunk"])
        with self.engine.connect() as conn:
            run = conn.execute(select(outbox_report_run).where(outbox_report_run.c.id == run_id)).first()
        if run is None:
            raise PermanentError(f"report run {run_id} does not exist")
        if run.status in ("complete", "failed"):
            return {"run_id": run_id, "chunk": chunk, "skipped": run.status}
        with Session(self.engine) as session:
            fetched = [
                list(r) for r in self.rows(session, run.params, int(payload["offset"]), int(payload["limit"]))
            ]
        self._write_part(run_id, chunk, fetched)
        done = self._record_chunk(run_id, chunk, len(fetched))
        detail: dict[str, Any] = {"run_id": run_id, "chunk": chunk, "rows": len(fetched), "done": done}
        expected = payload.get("expected")  # absent in chunks emitted before it existed
        if isinstance(expected, int) and expected != len(fetched):
            # Offsets were fixed at start: a changed row set means rows duplicated or lost.
            detail["expected_rows"] = expected
            log.warning(
                "report %s run %s chunk %d got %d rows where count() promised %d: the row set "
                "changed since start(), so the report may duplicate or miss rows",
                self.name,
                run_id,
                chunk,
                len(fetched),
                expected,
                extra={"action": "report_rows_shifted", "message_id": message.id},
            )
        # Before the last chunk assembles, and after any other: a chunk discarded meanwhile means
        # the run cannot complete, and no chunk of it may be left to notice later.
        discarded = self._fail_if_discarded(run_id)
        if discarded is not None:
            detail["discarded_chunk"] = discarded.chunk
        elif done == run.total_chunks and self._claim_assembly(run_id, message.id):
            detail["location"] = self._assemble(run_id, run.total_chunks)
        return detail

    def _run_dir(self, run_id: str) -> Path:
        return self.output_dir / f"{self.name}-{run_id}.parts"

    def _write_part(self, run_id: str, chunk: int, rows: list[list[Any]]) -> None:
        """Atomically (re)write this chunk's part: a retry replaces, never appends."""
        folder = self._run_dir(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{chunk}.", suffix=".tmp")
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as out:
            csv.writer(out).writerows(rows)
        os.replace(tmp, folder / f"part-{chunk:06d}.csv")

    def _record_chunk(self, run_id: str, chunk: int, row_count: int) -> int:
        """Upsert this chunk's row and recompute the run's progress from all chunk rows, atomically."""
        c = outbox_report_chunk
        with self.engine.begin() as conn:
            updated = conn.execute(
                update(c)
                .where(c.c.run_id == run_id, c.c.chunk == chunk)
                .values(row_count=row_count, finished_at=_utcnow())
            ).rowcount
            if not updated:
                conn.execute(
                    insert(c).values(run_id=run_id, chunk=chunk, row_count=row_count, finished_at=_utcnow())
                )
            # Lock the run row so concurrent chunks serialise their progress updates.
            conn.execute(
                update(outbox_report_run)
                .where(outbox_report_run.c.id == run_id)
                .values(done_chunks=outbox_report_run.c.done_chunks)
            )
            done, rows = conn.execute(
                select(func.count(), func.coalesce(func.sum(c.c.row_count), 0)).where(c.c.run_id == run_id)
            ).one()
            conn.execute(
                update(outbox_report_run)
                .where(outbox_report_run.c.id == run_id)
                .values(done_chunks=done, row_count=rows)
            )
        return int(done)

    def _claim_assembly(self, run_id: str, message_id: int) -> bool:
        """Exactly one chunk message assembles: the first to move the run to ``assembling``.

        The winner's own retry (it crashed mid-assembly) may assemble again; it
        rewrites the same file from the same parts.
        """
        r = outbox_report_run
        with self.engine.begin() as conn:
            won = conn.execute(
                update(r)
                .where(r.c.id == run_id, r.c.status == "running")
                .values(status="assembling", assembled_by=message_id)
            ).rowcount
            if won:
                return True
            owner = conn.execute(select(r.c.status, r.c.assembled_by).where(r.c.id == run_id)).one()
        return bool(owner.status == "assembling" and owner.assembled_by == message_id)

    def _assemble(self, run_id: str, total_chunks: int) -> str:
        folder = self._run_dir(run_id)
        target = self.output_dir / f"{self.name}-{run_id}.csv"
        fd, tmp = tempfile.mkstemp(dir=self.output_dir, prefix=f".{self.name}-{run_id}.", suffix=".tmp")
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as out:
            csv.writer(out).writerow(self.header)
            for chunk in range(total_chunks):
                with (folder / f"part-{chunk:06d}.csv").open(encoding="utf-8", newline="") as part:
                    shutil.copyfileobj(part, out)
        os.replace(tmp, target)
        r = outbox_report_run
        with self.engine.begin() as conn:
            conn.execute(
                update(r)
                .where(r.c.id == run_id, r.c.status == "assembling")
                .values(status="complete", finished_at=_utcnow(), location=str(target))
            )
        shutil.rmtree(folder, ignore_errors=True)
        log.info(
            "report %s run %s complete: %s", self.name, run_id, target, extra={"action": "report_complete"}
        )
        return str(target)

    def _on_dead(self, sender: Any, **kwargs: Any) -> None:
        message = kwargs.get("message")
        if not isinstance(message, Message) or message.handler != self.route.name:
            return
        run_id = str(message.payload.get("run_id"))
        self._fail(run_id, f"chunk {message.payload.get('chunk')} is dead: {kwargs.get('error')}")

    def _fail(self, run_id: str, error: str) -> bool:
        """Fail the run unless it already ended; True if this call failed it."""
        r = outbox_report_run
        with self.engine.begin() as conn:
            failed = conn.execute(
                update(r)
                .where(r.c.id == run_id, r.c.status.in_(UNFINISHED))
                .values(status="failed", finished_at=_utcnow(), error=error)
            ).rowcount
        return bool(failed)

    # -- discarded chunks ------------------------------------------------------------------

    def _fail_if_discarded(self, run_id: str) -> DiscardedChunk | None:
        """Fail the run if an operator discarded one of its chunks; returns the first such chunk.

        A discarded chunk is a chunk finished without output, as a dead one is:
        the run can never have all its parts, so it fails the same way, naming
        the chunk and the operator's reason (unless it already ended).
        """
        with self.engine.connect() as conn:
            discarded = discarded_chunks(conn, run_id, self.name)
        if not discarded:
            return None
        error = _discarded_error(discarded[0])
        if self._fail(run_id, error):
            log.warning(
                "report %s run %s failed: %s",
                self.name,
                run_id,
                error,
                extra={"action": "report_failed", "message_id": discarded[0].id},
            )
        return discarded[0]

    def _fail_runs_with_discarded_chunks(self) -> None:
        """Every unfinished run of this report with a discarded chunk fails; a database error is logged."""
        r = outbox_report_run
        try:
            with self.engine.connect() as conn:
                unfinished = conn.execute(
                    select(r.c.id).where(r.c.report == self.name, r.c.status.in_(UNFINISHED))
                ).scalars()
                run_ids = list(unfinished)
            for run_id in run_ids:
                self._fail_if_discarded(run_id)
        except Exception as exc:
            log.warning(
                "report %s: could not look for discarded chunks (%s); trying again in %gs",
                self.name,
                first_line(exc),
                self.discard_check_interval,
                extra={"action": "report_check_failed"},
            )

    async def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
        """The relay starts: fail the runs a discarded chunk left unfinished, now and periodically.

        Why the job notices, rather than the discard telling it: ``outbox
        discard`` and the dashboard run in processes that need not import the
        application, so a callback this job registered would not be there to
        be called, and under the operator role of docs/operations.md, which may
        not write report runs. So ``outbox`` keeps knowing nothing of reports
        (a discard stays one UPDATE and its history row), and the job that owns
        the run's state finishes the run, on the relay, whose role writes runs
        anyway. It looks in two places: each chunk, as it finishes, for
        discarded chunks of its own run; and here, for a run with no chunk left
        to finish (the discarded one was the last outstanding), over the
        report's unfinished runs: once as the relay starts, so a drain or
        ``--once`` catches up too, then every ``discard_check_interval``
        seconds while it serves. The looks run on a thread, off the relay's
        loop. Which messages are a run's chunks is read through
        :func:`outbox.ops._reports.discarded_chunks`, where the dashboard's
        reads find them too.
        """
        await asyncio.to_thread(self._fail_runs_with_discarded_chunks)
        loop = asyncio.get_running_loop()
        self._discard_checks[loop] = loop.create_task(
            self._check_discards_periodically(), name=f"outbox-report-{self.name}-discards"
        )

    async def outbox_shutdown(self) -> None:
        check = self._discard_checks.pop(asyncio.get_running_loop(), None)
        if check is not None:
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)

    async def _check_discards_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.discard_check_interval)
            await asyncio.to_thread(self._fail_runs_with_discarded_chunks)


def _discarded_error(chunk: DiscardedChunk) -> str:
    which = f"chunk {chunk.chunk}" if chunk.chunk is not None else f"chunk message {chunk.id}"
    if chunk.actor is None:
        return f"{which} was discarded"
    return f"{which} was discarded by {chunk.actor}: {chunk.reason}"


def _progress(row: Row[Any]) -> ReportProgress:
    return ReportProgress(
        id=row.id,
        report=row.report,
        status=row.status,
        total_chunks=row.total_chunks,
        done_chunks=row.done_chunks,
        row_count=row.row_count,
        location=row.location,
        error=row.error,
    )
