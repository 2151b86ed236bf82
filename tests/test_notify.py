"""PostgreSQL wake-ups: a commit that added messages sends one NOTIFY per queue, a rollback none.

The payload names where the commit's first row sorts in its queue (migration outbox_0023):
``<schema> <priority> <id> <queue>``, which a listening relay claims from.
"""

from __future__ import annotations

import psycopg
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from outbox import Outbox, emit, outbox_message


class Base(DeclarativeBase):
    pass


class Note(Base):
    __tablename__ = "notes"
    id: Mapped[int] = mapped_column(primary_key=True)


def listener(url: str) -> psycopg.Connection:
    u = make_url(url)
    conn = psycopg.connect(
        host=u.host, port=u.port or 5432, user=u.username, dbname=u.database, autocommit=True
    )
    conn.execute("LISTEN outbox")
    return conn


def test_one_notify_per_committed_transaction_not_per_row(pg_url, pg_engine):
    ob = Outbox()
    ob.route("e", lambda msg: None, name="a")
    ob.route("e", lambda msg: None, name="b")
    factory = sessionmaker(pg_engine)
    ob.install(factory)
    Base.metadata.create_all(pg_engine)
    conn = listener(pg_url)
    statements = []
    try:
        with factory() as s, s.begin():
            for n in range(5):
                emit(s, "e", {"n": n})
                s.add(Note())  # an ORM change, so the flush runs and writes the event now
                s.flush()
                statements.append(s.scalar(select(func.count()).select_from(outbox_message)))
        with factory() as s, s.begin():
            emit(s, "e", {"n": 99})
            s.rollback()
        got = list(conn.notifies(timeout=1.0))
    finally:
        conn.close()
        ob.uninstall(factory)
    assert statements == [2, 4, 6, 8, 10], "each flush wrote its event in an INSERT of its own"
    with pg_engine.connect() as conn:
        first = conn.scalar(select(func.min(outbox_message.c.id)))
    assert [(n.channel, n.payload) for n in got] == [("outbox", f"public 0 {first} default")]
