"""Report runs as a dashboard lists them: progress, outcome, and the chunk messages that died.

``outbox`` must not import its integrations, so the two report tables are
declared here again, by name and only with the columns read (as
``_migrations`` names them); a test checks these against
``integrations/_report_tables.py``. A run's chunk messages are found the way
the report integration writes them: routed to :func:`report_handler` of the
report's name, with the run's id at ``payload.run_id``. The handler narrows the
search to ``ix_outbox_message_status_handler``; the payload condition is the
one ``outbox list --where payload.run_id=...`` uses.

The report integration finds a run's discarded chunks here too
(:func:`discarded_chunks`), so how chunk messages are recognised is written
once; it reads, and the integration alone writes the run's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sqlalchemy import ColumnElement, Integer, Select, String, Text, and_, column, func, or_, select, table
from sqlalchemy.engine import Connection, Engine, Row

from .._types import UTCDateTime
from ._base import NotFound, OpsError, _has_copy, a, m
from ._where import PayloadEquals

__all__ = [
    "MAX_REPORT_RUNS",
    "DeadChunk",
    "DiscardedChunk",
    "ReportChunk",
    "ReportRunDetail",
    "ReportRunView",
    "discarded_chunks",
    "report_handler",
    "report_run",
    "report_runs",
]

#: Runs per page at most: each run on the page adds a subquery counting its dead chunks.
MAX_REPORT_RUNS: Final = 500

report_run_table = table(
    "outbox_report_run",
    column("id", String(32)),
    column("report", String(255)),
    column("status", String(16)),
    column("total_chunks", Integer),
    column("done_chunks", Integer),
    column("row_count", Integer),
    column("created_at", UTCDateTime),
    column("finished_at", UTCDateTime),
    column("location", Text),
    column("error", Text),
)
report_chunk_table = table(
    "outbox_report_chunk",
    column("run_id", String(32)),
    column("chunk", Integer),
    column("row_count", Integer),
    column("finished_at", UTCDateTime),
)
r, c = report_run_table, report_chunk_table


def report_handler(report: str) -> str:
    """The route name a report's chunk messages are delivered to (``ReportJob`` names its route so)."""
    return f"report.{report}"


@dataclass(frozen=True, slots=True)
class ReportRunView:
    """One ``outbox_report_run`` row, plus ``failed_chunks``: its chunk messages that are dead.

    Dead messages are counted as stored: a chunk requeued and dead again is two.
    """

    id: str
    report: str
    status: str  # running, assembling, complete or failed
    total_chunks: int
    done_chunks: int
    row_count: int
    created_at: datetime
    finished_at: datetime | None
    location: str | None
    error: str | None
    failed_chunks: int


@dataclass(frozen=True, slots=True)
class ReportChunk:
    """A chunk that finished (``outbox_report_chunk``); chunks still to run have no row."""

    chunk: int
    row_count: int
    finished_at: datetime


@dataclass(frozen=True, slots=True)
class DeadChunk:
    """A dead chunk message. ``requeued``: an operator made a copy of it (``ops.requeue``)."""

    id: int
    status: str
    last_error: str | None
    chunk: int | None  # from its payload; None if the payload lacks it
    requeued: bool


@dataclass(frozen=True, slots=True)
class DiscardedChunk:
    """A chunk message an operator discarded, with who did it and why (its ``discarded`` history row)."""

    id: int
    chunk: int | None  # from its payload; None if the payload lacks it
    actor: str | None  # None only if that history row is gone (purged)
    reason: str | None


@dataclass(frozen=True, slots=True)
class ReportRunDetail:
    run: ReportRunView
    chunks: list[ReportChunk] = field(default_factory=list)  # by chunk number
    dead_chunks: list[DeadChunk] = field(default_factory=list)  # by message id


def _chunks_of(run_id: str, report: str, status: str) -> list[ColumnElement[bool]]:
    return [
        m.c.status == status,
        m.c.handler == report_handler(report),
        PayloadEquals(("run_id",), run_id).condition(),
    ]


def _dead_chunks_of(run_id: str, report: str) -> list[ColumnElement[bool]]:
    return _chunks_of(run_id, report, "dead")


def discarded_chunks(conn: Connection, run_id: str, report: str) -> list[DiscardedChunk]:
    """The run's chunk messages an operator discarded, by message id: outputs the run will never get.

    Who discarded each and why come from its latest ``discarded`` history row.
    """
    found = conn.execute(
        select(m.c.id, m.c.payload).where(*_chunks_of(run_id, report, "discarded")).order_by(m.c.id)
    ).all()
    if not found:
        return []
    why = {
        row.message_id: (row.actor, row.reason)
        for row in conn.execute(
            select(a.c.message_id, a.c.actor, a.c.reason)
            .where(a.c.message_id.in_([row.id for row in found]), a.c.outcome == "discarded")
            .order_by(a.c.id)
        )
    }
    return [
        DiscardedChunk(row.id, _chunk_number(row.payload), *why.get(row.id, (None, None))) for row in found
    ]


def _runs() -> Select[Any]:
    return select(
        r.c.id,
        r.c.report,
        r.c.status,
        r.c.total_chunks,
        r.c.done_chunks,
        r.c.row_count,
        r.c.created_at,
        r.c.finished_at,
        r.c.location,
        r.c.error,
    )


def _view(row: Row[Any], failed: int) -> ReportRunView:
    return ReportRunView(**row._asdict(), failed_chunks=int(failed))


def report_runs(engine: Engine, *, limit: int = 50, before: str | None = None) -> list[ReportRunView]:
    """Runs newest first (by ``created_at``, then id); ``before``: the last id of the previous page.

    Ordering by creation sorts the run table, which has no index on it: one row
    per report request keeps that cheap. The dead chunks of the whole page are
    counted in one statement, one subquery per run.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_REPORT_RUNS:
        raise OpsError(f"limit must be a whole number from 1 to {MAX_REPORT_RUNS}, got {limit!r}")
    stmt = _runs().order_by(r.c.created_at.desc(), r.c.id.desc()).limit(limit)
    with engine.connect() as conn:
        if before is not None:
            anchor = conn.execute(select(r.c.created_at).where(r.c.id == before)).scalar()
            if anchor is None:
                raise NotFound(f"no report run {before!r}")
            stmt = stmt.where(or_(r.c.created_at < anchor, and_(r.c.created_at == anchor, r.c.id < before)))
        runs = conn.execute(stmt).all()
        if not runs:
            return []
        failed: Sequence[Any] = conn.execute(
            select(
                *(
                    select(func.count()).where(*_dead_chunks_of(run.id, run.report)).scalar_subquery()
                    for run in runs
                )
            )
        ).one()
    return [_view(run, n) for run, n in zip(runs, failed, strict=True)]


def report_run(engine: Engine, run_id: str) -> ReportRunDetail:
    """A run with its finished chunks and its dead chunk messages (what to requeue or explain)."""
    with engine.connect() as conn:
        run = conn.execute(_runs().where(r.c.id == run_id)).first()
        if run is None:
            raise NotFound(f"no report run {run_id!r}")
        chunks = [
            ReportChunk(row.chunk, row.row_count, row.finished_at)
            for row in conn.execute(
                select(c.c.chunk, c.c.row_count, c.c.finished_at)
                .where(c.c.run_id == run_id)
                .order_by(c.c.chunk)
            )
        ]
        dead = [
            DeadChunk(
                id=row.id,
                status=row.status,
                last_error=row.last_error,
                chunk=_chunk_number(row.payload),
                requeued=bool(row.requeued),
            )
            for row in conn.execute(
                select(m.c.id, m.c.status, m.c.last_error, m.c.payload, _has_copy().label("requeued"))
                .where(*_dead_chunks_of(run_id, run.report))
                .order_by(m.c.id)
            )
        ]
    return ReportRunDetail(run=_view(run, len(dead)), chunks=chunks, dead_chunks=dead)


def _chunk_number(payload: Any) -> int | None:
    chunk = payload.get("chunk") if isinstance(payload, dict) else None
    return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else None
