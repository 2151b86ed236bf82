"""Mode 1: what one ``emit()`` adds to an ORM transaction that inserts one domain row.

The kinds of transaction alternate in one loop (ABC..., then ...CBA, so drift
and cache effects fall evenly on all), each timed on its own:

- ``plain``: a session the Outbox is not installed on: add the row, commit;
- ``installed``: a session the Outbox is installed on, no emit (the hooks' cost);
- ``emit``: installed, the same plus one ``emit()`` to one route before the commit;
- ``plain_flush``: as ``plain``, with ``session.flush()`` between add and commit;
- ``emit_flush``: installed: add, ``flush()``, ``emit()``, commit. The flush
  shape is the common one where the handler needs the row's generated id, and
  it is the one where the emit's INSERT cannot ride with the flush's;
- ``raw`` (psycopg only): the outbox row alone, written by raw psycopg 3 and
  committed (``raw_insert``), the floor under what an emit can cost;
- ``raw_plain`` and ``raw_enqueue`` (psycopg only): the domain row written by
  raw psycopg 3 and committed, and the same with the outbox row written by
  hand before the commit: a queue without a library. Their difference is what
  a hand-written enqueue adds to a plain psycopg transaction;
- ``raw_queue`` (psycopg only): the domain row and a row of the raw
  queue's narrow table (``bench/rawqueue.py``), committed: what the simplest
  correct queue's enqueue adds, so the share of an emit's cost that is the
  outbox table's shape reads beside it.

The headline ratios are plain rate / emit rate for each shape: the whole cost
of adopting the outbox for a transaction that emits. Beside them, the time an
emit adds to a transaction in µs, next to what the hand-written enqueue adds
to its own transaction. The check: every emitting transaction's event is
stored exactly once, with its route, every raw row is there, and no other
transaction stored one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import String, create_engine, func, select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from outbox import emit, outbox_message

from .app import EVENTS, ob
from .raw_insert import ENQUEUE_ROUTE, RAW_ROUTE, RawInserter
from .verify import Unverified

__all__ = ["Order", "emit_overhead", "outbox_sessions"]

#: The ORM kinds; the raw ones join them on psycopg.
KINDS = ("plain", "installed", "emit", "plain_flush", "emit_flush")
RAW_KINDS = ("raw", "raw_plain", "raw_enqueue", "raw_queue")
#: The kinds that write a domain row, and so are counted in ``bench_order``.
ORDER_KINDS = (*KINDS, "raw_plain", "raw_enqueue", "raw_queue")
EMITTING = ("emit", "emit_flush")
WARMUP = 100


class Base(DeclarativeBase):
    pass


class Order(Base):
    """The domain row every benchmark transaction inserts."""

    __tablename__ = "bench_order"

    id: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    note: Mapped[str] = mapped_column(String(200))


class OutboxSession(Session):
    """Its own class, so installing the Outbox on it leaves plain ``Session`` untouched."""


def outbox_sessions() -> sessionmaker[OutboxSession]:
    maker = sessionmaker(class_=OutboxSession, expire_on_commit=False)
    ob.install(maker)  # idempotent for the same Outbox and class
    return maker


def interleaved(
    kinds: Sequence[str], transactions: int, once: Callable[[str, int], float]
) -> dict[str, float]:
    """Seconds each kind took over ``transactions`` timed rounds, after ``WARMUP`` untimed ones.

    Every round runs each kind once (``once(kind, n)``, ``n`` counting every
    transaction), in order and then in reverse, so a drift in the host's speed
    during the run weighs on every kind alike.
    """
    spent = dict.fromkeys(kinds, 0.0)
    n = 0
    for i in range(WARMUP + transactions):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            elapsed = once(kind, n)
            n += 1
            if i >= WARMUP:
                spent[kind] += elapsed
    return spent


def emit_overhead(url: URL, *, transactions: int) -> dict[str, Any]:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    plain = sessionmaker(engine, expire_on_commit=False)
    installed = outbox_sessions()
    installed.configure(bind=engine)
    raw = RawInserter(url) if url.get_driver_name() == "psycopg" else None
    kinds = KINDS if raw is None else (*KINDS, *RAW_KINDS)

    def once(kind: str, n: int) -> float:
        began = time.perf_counter()
        if kind.startswith("raw"):
            assert raw is not None
            if kind == "raw":
                raw.insert(n)
            elif kind == "raw_plain":
                raw.order(n, kind)
            elif kind == "raw_queue":
                raw.raw_queue_enqueue(n, kind)
            else:
                raw.enqueue(n, kind)
            return time.perf_counter() - began
        with (plain if kind.startswith("plain") else installed)() as session, session.begin():
            session.add(Order(n=n, kind=kind, note=f"order {n}"))
            if kind.endswith("_flush"):
                session.flush()
            if kind in EMITTING:
                emit(session, EVENTS["noop"], {"n": n, "order": f"order {n}"})
        return time.perf_counter() - began

    try:
        spent = interleaved(kinds, transactions, once)
        _verify(engine, WARMUP + transactions, raw=raw is not None)
    finally:
        if raw is not None:
            raw.close()
        engine.dispose()
    rates = {kind: transactions / seconds for kind, seconds in spent.items()}

    def added_us(kind: str, baseline: str) -> float:
        return (spent[kind] - spent[baseline]) / transactions * 1e6

    return {
        "ratio": rates["plain"] / rates["emit"],
        "ratio_installed": rates["installed"] / rates["emit"],
        "ratio_flush": rates["plain_flush"] / rates["emit_flush"],
        "rate_without": rates["plain"],
        "rate_installed": rates["installed"],
        "rate_with": rates["emit"],
        "rate_without_flush": rates["plain_flush"],
        "rate_with_flush": rates["emit_flush"],
        "added_us": added_us("emit", "plain"),
        "added_us_flush": added_us("emit_flush", "plain_flush"),
        "raw_us": None if raw is None else spent["raw"] / transactions * 1e6,
        "raw_plain_us": None if raw is None else spent["raw_plain"] / transactions * 1e6,
        "raw_enqueue_added_us": None if raw is None else added_us("raw_enqueue", "raw_plain"),
        "raw_queue_enqueue_added_us": None if raw is None else added_us("raw_queue", "raw_plain"),
    }


def _verify(engine: Engine, per_kind: int, *, raw: bool) -> None:
    m = outbox_message
    with engine.connect() as conn:
        by_kind = dict(conn.execute(select(Order.kind, func.count()).group_by(Order.kind)).all())
        stored = conn.execute(select(m.c.handler, m.c.payload)).all()
        emitted = set(conn.execute(select(Order.n).where(Order.kind.in_(EMITTING))).scalars())
        enqueued = set(conn.execute(select(Order.n).where(Order.kind == "raw_enqueue")).scalars())
        raw_queued = set(conn.execute(select(Order.n).where(Order.kind == "raw_queue")).scalars())
        in_raw_queue = (
            conn.exec_driver_sql("SELECT (payload->>'n')::int FROM raw_queue").scalars().all() if raw else []
        )
    if by_kind != dict.fromkeys(ORDER_KINDS if raw else KINDS, per_kind):
        raise Unverified(f"domain rows per kind: {by_kind}, expected {per_kind} each")
    by_route: dict[str, list[Any]] = {}
    for row in stored:
        by_route.setdefault(row.handler, []).append(
            row.payload["n"] if isinstance(row.payload, dict) else None
        )
    numbers = by_route.pop("noop", [])
    expected = per_kind * len(EMITTING)
    if len(numbers) != expected or set(numbers) != emitted or len(set(numbers)) != len(numbers):
        raise Unverified(f"{len(numbers)} stored events for {expected} emitting transactions")
    want = per_kind if raw else 0
    for route in (RAW_ROUTE, ENQUEUE_ROUTE):
        raw_numbers = by_route.pop(route, [])
        if len(raw_numbers) != want or len(set(raw_numbers)) != want or None in raw_numbers:
            raise Unverified(f"{len(raw_numbers)} {route} rows for {want} raw transactions")
        if route == ENQUEUE_ROUTE and set(raw_numbers) != enqueued:
            raise Unverified("hand-enqueued rows do not match their transactions' domain rows")
    if by_route:
        raise Unverified(f"events stored for unexpected routes: {sorted(by_route)}")
    if len(in_raw_queue) != len(set(in_raw_queue)) or set(in_raw_queue) != raw_queued:
        raise Unverified(f"{len(in_raw_queue)} raw queue rows for {len(raw_queued)} raw queue transactions")
