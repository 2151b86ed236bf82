"""PostgreSQL wake-ups: a commit that added messages sends exactly one NOTIFY, a rollback none."""

from __future__ import annotations

import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from outbox import Outbox, emit


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
    conn = listener(pg_url)
    try:
        with factory() as s, s.begin():
            for n in range(5):
                emit(s, "e", {"n": n})
                s.flush()  # several INSERT statements in one transaction
        with factory() as s, s.begin():
            emit(s, "e", {"n": 99})
            s.rollback()
        got = list(conn.notifies(timeout=1.0))
    finally:
        conn.close()
        ob.uninstall(factory)
    assert [(n.channel, n.payload) for n in got] == [("outbox", "public")]
