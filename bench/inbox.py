"""The inbox mode: what taking a message through an ``outbox.Inbox`` adds to a consumer's transaction.

Each timed message is one consumer transaction that inserts one domain row
(the message's effect) and commits; the kinds alternate in one loop (ABCD...,
then ...DCBA, so drift and cache effects fall evenly on all), each timed per
message:

- ``plain``: the transaction without an inbox: open a session, insert, commit;
- ``receive``: the same with ``inbox.receive(session, id)`` before the insert
  (the marker alone, as an application that writes its own consumer loop uses it);
- ``process``: ``inbox.process(sessions, message)`` with a handler that inserts
  the row: checks, handler lookup, marker, handler, flush and commit, what a
  broker source runs per message;
- ``duplicate``: ``inbox.process`` of a message taken before: the marker's
  conflict and a commit, no handler.

The cost is the difference of percentiles of the same run: ``process`` p50
minus ``plain`` p50 (the target: at most 300 µs on PostgreSQL), and the same
at p99; likewise for ``receive``. Beside it, the benchmark process's own CPU
per message (mean), which moves less with the host's other load than the
wall-clock figures do. The check: every domain row is there once,
every marker once, and the duplicates added nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from sqlalchemy import String, create_engine, func, select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from outbox import Inbox, InboxMessage, outbox_inbox

from .harness import Scratch
from .verdicts import verdict
from .verify import Unverified

__all__ = ["INBOX_TARGET_US", "inbox_cost", "inbox_rows", "run_inbox"]

KINDS: Final = ("plain", "receive", "process", "duplicate")
WARMUP: Final = 100
#: The target for the inbox's added p50 per message on PostgreSQL.
INBOX_TARGET_US: Final = 300.0

Mode = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]


class Base(DeclarativeBase):
    pass


class Shipment(Base):
    """The domain row each consumer transaction inserts: the message's effect."""

    __tablename__ = "bench_shipment"

    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))


def _percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def inbox_cost(url: URL, *, transactions: int) -> dict[str, Any]:
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine)
    inbox = Inbox("bench")

    @inbox.handler("order.shipped", name="ship")
    def ship(session: Session, message: InboxMessage) -> None:
        session.add(Shipment(message_id=message.id, kind="process"))

    def once(kind: str, n: int) -> tuple[float, float]:
        message_id = f"{kind}-{n}"
        cpu, began = time.process_time(), time.perf_counter()
        if kind == "process":
            inbox.process(sessions, InboxMessage(message_id, "order.shipped", {"n": n}))
        elif kind == "duplicate":  # the previous round's message: on odd rounds this one's comes later
            seen = f"process-{max(n - 1, 0)}"
            if not inbox.process(sessions, InboxMessage(seen, "order.shipped", {"n": n})).duplicate:
                raise Unverified(f"{seen} was not answered as a duplicate")
        else:
            with sessions() as session, session.begin():
                if kind == "plain" or inbox.receive(session, message_id):
                    session.add(Shipment(message_id=message_id, kind=kind))
        return time.perf_counter() - began, time.process_time() - cpu

    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpu_spent = dict.fromkeys(KINDS, 0.0)
    try:
        for i in range(WARMUP + transactions):
            for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                elapsed, cpu = once(kind, i)
                if i >= WARMUP:
                    samples[kind].append(elapsed * 1e6)
                    cpu_spent[kind] += cpu
        _verify(engine, WARMUP + transactions)
    finally:
        engine.dispose()
    figures: dict[str, Any] = {}
    for kind in KINDS:
        figures[f"{kind}_us_p50"] = _percentile(samples[kind], 0.50)
        figures[f"{kind}_us_p99"] = _percentile(samples[kind], 0.99)
        figures[f"{kind}_cpu_us"] = cpu_spent[kind] / transactions * 1e6
    for kind in ("receive", "process"):
        for stat in ("p50", "p99"):
            figures[f"{kind}_added_us_{stat}"] = figures[f"{kind}_us_{stat}"] - figures[f"plain_us_{stat}"]
        figures[f"{kind}_added_cpu_us"] = figures[f"{kind}_cpu_us"] - figures["plain_cpu_us"]
    return figures


def _verify(engine: Engine, per_kind: int) -> None:
    with engine.connect() as conn:
        by_kind = dict(conn.execute(select(Shipment.kind, func.count()).group_by(Shipment.kind)).all())
        distinct = conn.execute(select(func.count(func.distinct(Shipment.message_id)))).scalar_one()
        markers = conn.execute(select(func.count()).select_from(outbox_inbox)).scalar_one()
    expected = {"plain": per_kind, "receive": per_kind, "process": per_kind}
    if by_kind != expected or distinct != 3 * per_kind:
        raise Unverified(f"domain rows per kind: {by_kind} ({distinct} distinct), expected {per_kind} each")
    if markers != 2 * per_kind:
        raise Unverified(f"{markers} markers for {2 * per_kind} received messages")


def run_inbox(mode: Mode, out: dict[str, Any], scratch: Scratch, *, transactions: int, sqlite: bool) -> None:
    """The inbox mode on PostgreSQL (and SQLite unless skipped), figures into ``out``."""
    for backend in ("postgresql", "sqlite") if sqlite else ("postgresql",):
        url = scratch.postgres("inbox") if backend == "postgresql" else scratch.sqlite("inbox")
        figures = mode(f"inbox ({backend})", partial(inbox_cost, url, transactions=transactions))
        prefix = "inbox" if backend == "postgresql" else "sqlite_inbox"
        out[f"{prefix}_transactions"] = transactions
        if figures:
            out.update({f"{prefix}_{key}": round(value, 1) for key, value in figures.items()})


def inbox_rows(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The table's rows for the inbox mode: the added p50 / p99, on the plain transaction's."""
    rows = []
    for prefix, label in (("inbox", "pg"), ("sqlite_inbox", "sqlite")):
        if f"{prefix}_transactions" not in out:
            continue

        def us(key: str, prefix: str = prefix) -> str:
            return _fmt(out.get(f"{prefix}_{key}"))

        figure = (
            f"+{us('process_added_us_p50')} / +{us('process_added_us_p99')} us (p50 / p99) "
            f"on {us('plain_us_p50')} / {us('plain_us_p99')}; marker alone +{us('receive_added_us_p50')}; "
            f"duplicate {us('duplicate_us_p50')}; client CPU +{us('process_added_cpu_us')}"
        )
        added = out.get(f"{prefix}_process_added_us_p50")
        if label == "pg":
            target, ok = (
                f"p50 <= {INBOX_TARGET_US:.0f} us",
                None if added is None else added <= INBOX_TARGET_US,
            )
            rows.append((f"inbox cost per message ({label})", figure, target, verdict(ok)))
        else:
            rows.append((f"inbox cost per message ({label})", figure, "", "-"))
    return rows


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.0f}"
