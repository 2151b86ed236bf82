"""Mode 1: what one ``emit()`` adds to an ORM transaction that inserts one domain row.

Three kinds of transaction alternate in one loop (ABC, then CBA, so drift and
cache effects fall evenly on all three), each timed on its own:

- ``plain``: a session the Outbox is not installed on, one ``INSERT``;
- ``installed``: a session the Outbox is installed on, no emit (the hooks' cost);
- ``emit``: installed, the same insert plus one ``emit()`` to one route.

The headline ratio is plain rate / emit rate: the whole cost of adopting the
outbox for a transaction that emits. The check: every ``emit`` transaction's
event is stored exactly once, with its route, and no other transaction stored one.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import String, create_engine, func, select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from outbox import emit, outbox_message

from .app import EVENTS, ob
from .verify import Unverified

__all__ = ["Order", "emit_overhead", "outbox_sessions"]

KINDS = ("plain", "installed", "emit")
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


def emit_overhead(url: URL, *, transactions: int) -> dict[str, Any]:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    plain = sessionmaker(engine, expire_on_commit=False)
    installed = outbox_sessions()
    installed.configure(bind=engine)

    def once(kind: str, n: int) -> float:
        began = time.perf_counter()
        with (plain if kind == "plain" else installed)() as session, session.begin():
            session.add(Order(n=n, kind=kind, note=f"order {n}"))
            if kind == "emit":
                emit(session, EVENTS["noop"], {"n": n, "order": f"order {n}"})
        return time.perf_counter() - began

    spent = dict.fromkeys(KINDS, 0.0)
    n = 0
    for i in range(WARMUP + transactions):
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
            elapsed = once(kind, n)
            n += 1
            if i >= WARMUP:
                spent[kind] += elapsed
    try:
        _verify(engine, WARMUP + transactions)
    finally:
        engine.dispose()
    rates = {kind: transactions / seconds for kind, seconds in spent.items()}
    return {
        "ratio": rates["plain"] / rates["emit"],
        "ratio_installed": rates["installed"] / rates["emit"],
        "rate_without": rates["plain"],
        "rate_installed": rates["installed"],
        "rate_with": rates["emit"],
    }


def _verify(engine: Engine, per_kind: int) -> None:
    m = outbox_message
    with engine.connect() as conn:
        by_kind = dict(conn.execute(select(Order.kind, func.count()).group_by(Order.kind)).all())
        stored = conn.execute(select(m.c.handler, m.c.payload)).all()
        emitted = set(conn.execute(select(Order.n).where(Order.kind == "emit")).scalars())
    if by_kind != dict.fromkeys(KINDS, per_kind):
        raise Unverified(f"domain rows per kind: {by_kind}, expected {per_kind} each")
    numbers = [row.payload["n"] if isinstance(row.payload, dict) else None for row in stored]
    if len(stored) != per_kind or set(numbers) != emitted or len(set(numbers)) != len(numbers):
        raise Unverified(f"{len(stored)} stored events for {per_kind} emitting transactions")
    if {row.handler for row in stored} != {"noop"}:
        raise Unverified("an event was stored for an unexpected route")
