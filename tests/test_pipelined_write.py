"""The commit's outbox INSERT rides with the COMMIT on psycopg: what users can rely on.

The write made by the commit's own flush is sent in psycopg pipeline mode and
its reply is read with the COMMIT's (outbox/_pipeline.py). These tests pin the
promises that must survive that: the event is stored if and only if the
transaction commits; a failure of the INSERT, of the COMMIT or of the
connection is raised from ``commit()`` as SQLAlchemy's own exception and stores
nothing; statements SQLAlchemy runs after the write see its row; and the
connection goes back to the pool ready for ordinary use.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import ForeignKey, create_engine, event, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import ConfigurationError, Outbox, emit

m = outbox.outbox_message


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    number: Mapped[str]


class Line(Base):
    """Its foreign key is checked at COMMIT, so a bad line fails the COMMIT itself."""

    __tablename__ = "invoice_lines"
    id: Mapped[int] = mapped_column(primary_key=True)
    invoice_id: Mapped[int] = mapped_column(ForeignKey("invoices.id", deferrable=True, initially="DEFERRED"))


def make_outbox(**options: bool) -> Outbox:
    ob = Outbox(**options)
    ob.route("invoice.issued", lambda message: None, name="mail")
    return ob


@pytest.fixture
def engine(pg_engine: Engine) -> Iterator[Engine]:
    Base.metadata.create_all(pg_engine)
    yield pg_engine


@pytest.fixture
def maker(engine: Engine) -> Iterator[sessionmaker[Session]]:
    ob = make_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def stored(engine: Engine) -> tuple[int, int]:
    """(invoices, outbox rows), read on a connection of its own."""
    with engine.connect() as conn:
        invoices = conn.execute(select(func.count()).select_from(Invoice)).scalar_one()
        messages = conn.execute(select(func.count()).select_from(m)).scalar_one()
    return invoices, messages


def outbox_statements(engine: Engine) -> list[str]:
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "outbox_message" in statement:
            seen.append(statement)

    return seen


def test_the_commits_write_rides_with_the_commit_and_the_connection_is_reusable(maker, engine):
    seen = outbox_statements(engine)
    for number in range(3):
        with maker() as s, s.begin():
            s.add(Invoice(number=f"A-{number}"))
            emit(s, "invoice.issued", {"number": number})
    # SQLAlchemy never saw the INSERT: it went down the pipeline with the COMMIT.
    assert seen == []
    assert stored(engine) == (3, 3)
    # The pooled connection left pipeline mode: ordinary statements return rows.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 41 + 1")).scalar_one() == 42
        raw = conn.connection.dbapi_connection
        assert raw is not None and raw.pgconn.pipeline_status == 0  # type: ignore[attr-defined]


def test_pipeline_writes_false_keeps_an_ordinary_statement(engine):
    ob = make_outbox(pipeline_writes=False)
    factory = sessionmaker(engine)
    ob.install(factory)
    seen = outbox_statements(engine)
    with factory() as s, s.begin():
        s.add(Invoice(number="B-1"))
        emit(s, "invoice.issued", {"number": 1})
    assert len(seen) == 1 and seen[0].startswith("INSERT INTO outbox_message")
    assert stored(engine) == (1, 1)


def test_pipeline_writes_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="pipeline_writes must be True or False"):
        Outbox(pipeline_writes="yes")  # type: ignore[arg-type]


def test_a_flush_in_the_middle_of_a_transaction_writes_at_once(maker, engine):
    seen = outbox_statements(engine)
    with maker() as s, s.begin():
        s.add(Invoice(number="C-1"))
        emit(s, "invoice.issued", {"number": 1})
        s.flush()
        assert len(seen) == 1  # written by the flush, visible to the application's own queries
        assert s.execute(select(func.count()).select_from(m)).scalar_one() == 1
    assert stored(engine) == (1, 1)


def test_a_statement_run_after_the_write_sees_its_row(maker, engine):
    counted: list[int] = []

    @event.listens_for(maker, "before_commit")
    def count_outbox_rows(session: Session) -> None:  # registered after the Outbox's listener
        counted.append(session.execute(select(func.count()).select_from(m)).scalar_one())

    with maker() as s, s.begin():
        s.add(Invoice(number="D-1"))
        emit(s, "invoice.issued", {"number": 1})
    assert counted == [1]
    assert stored(engine) == (1, 1)


@pytest.fixture
def refuse_bad(engine: Engine) -> None:
    """A real constraint the outbox INSERT of ``{"number": "bad"}`` violates."""
    with engine.begin() as conn:
        conn.execute(
            text("ALTER TABLE outbox_message ADD CONSTRAINT refuse_bad CHECK (payload->>'number' <> 'bad')")
        )


def commit_refused_event(maker: sessionmaker[Session]) -> None:
    """Commit an invoice with an event ``refuse_bad`` rejects: commit() must raise, blaming the INSERT."""
    s = maker()
    s.add(Invoice(number="refused"))
    emit(s, "invoice.issued", {"number": "bad"})
    with pytest.raises(IntegrityError, match="refuse_bad") as caught:
        s.commit()
    # Reported against the statement that failed, not the COMMIT or a later query.
    assert caught.value.statement is not None
    assert caught.value.statement.startswith("INSERT INTO outbox_message")
    s.rollback()
    s.close()


def test_a_failed_insert_is_raised_by_commit_and_stores_nothing(maker, engine, refuse_bad):
    commit_refused_event(maker)
    assert stored(engine) == (0, 0)
    # The pool hands out a healthy connection afterwards, and the next commit stores both rows.
    with maker() as s2, s2.begin():
        s2.add(Invoice(number="E-2"))
        emit(s2, "invoice.issued", {"number": "good"})
    assert stored(engine) == (1, 1)


def test_a_failed_insert_is_raised_by_the_next_statement_not_hidden(maker, engine, refuse_bad):
    @event.listens_for(maker, "before_commit")
    def audit(session: Session) -> None:
        session.execute(text("SELECT 1"))

    commit_refused_event(maker)
    assert stored(engine) == (0, 0)


def test_a_failed_commit_is_raised_and_stores_nothing(maker, engine):
    s = maker()
    s.add(Line(invoice_id=999_999))  # no such invoice: the deferred check fails the COMMIT
    emit(s, "invoice.issued", {"number": 1})
    with pytest.raises(IntegrityError, match="invoice_lines"):
        s.commit()
    s.rollback()
    s.close()
    assert stored(engine) == (0, 0)


def test_an_error_after_the_write_rolls_it_back(maker, engine):
    @event.listens_for(maker, "before_commit")
    def veto(session: Session) -> None:
        raise RuntimeError("vetoed by a later listener")

    s = maker()
    s.add(Invoice(number="G-1"))
    emit(s, "invoice.issued", {"number": 1})
    with pytest.raises(RuntimeError, match="vetoed"):
        s.commit()
    s.close()
    event.remove(maker, "before_commit", veto)
    assert stored(engine) == (0, 0)
    with maker() as s2, s2.begin():
        s2.add(Invoice(number="G-2"))
        emit(s2, "invoice.issued", {"number": 2})
    assert stored(engine) == (1, 1)


def test_a_connection_killed_before_the_commit_raises_and_stores_nothing(maker, engine, pg_url):
    admin = create_engine(pg_url)

    @event.listens_for(maker, "before_commit")
    def kill_own_backend(session: Session) -> None:
        pid = session.connection().connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            conn.commit()

    s = maker()
    s.add(Invoice(number="H-1"))
    emit(s, "invoice.issued", {"number": 1})
    with pytest.raises(OperationalError) as caught:
        s.commit()
    assert caught.value.connection_invalidated
    s.close()
    event.remove(maker, "before_commit", kill_own_backend)
    admin.dispose()
    assert stored(engine) == (0, 0)
    with maker() as s2, s2.begin():
        s2.add(Invoice(number="H-2"))
        emit(s2, "invoice.issued", {"number": 2})
    assert stored(engine) == (1, 1)


def test_a_session_joined_to_an_outer_transaction_follows_it(engine):
    ob = make_outbox()
    factory = sessionmaker(join_transaction_mode="create_savepoint")
    ob.install(factory)
    for outer_commits, expected in ((False, (0, 0)), (True, (1, 1))):
        with engine.connect() as conn:
            conn.begin()
            with factory(bind=conn) as s:
                s.add(Invoice(number="J-1"))
                emit(s, "invoice.issued", {"number": 1})
                s.commit()  # releases the session's savepoint only
            assert conn.execute(select(func.count()).select_from(m)).scalar_one() == 1
            if outer_commits:
                conn.commit()
            else:
                conn.rollback()
        assert stored(engine) == expected


def test_an_engine_with_execution_options_shares_the_hooks(engine):
    ob = make_outbox()
    factory = sessionmaker()
    ob.install(factory)
    for number in range(3):
        bound = engine.execution_options(logging_token=f"request-{number}")
        with factory(bind=bound) as s, s.begin():
            s.add(Invoice(number=f"K-{number}"))
            emit(s, "invoice.issued", {"number": number})
    assert stored(engine) == (3, 3)


def test_threads_committing_at_once_each_store_exactly_their_events(maker, engine):
    from concurrent.futures import ThreadPoolExecutor

    def work(worker: int) -> None:
        for number in range(40):
            with maker() as s, s.begin():
                s.add(Invoice(number=f"T{worker}-{number}"))
                emit(s, "invoice.issued", {"number": f"{worker}-{number}"})

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(work, range(6)))
    assert stored(engine) == (240, 240)
    with engine.connect() as conn:
        numbers = conn.execute(select(m.c.payload["number"].as_string())).scalars().all()
    assert sorted(numbers) == sorted(f"{w}-{n}" for w in range(6) for n in range(40))
