"""The commit's outbox INSERT rides with the COMMIT on psycopg: what users can rely on.

The write made by the commit's own flush is sent in psycopg pipeline mode and
its reply is read with the COMMIT's (outbox/_write/pipeline.py). These tests pin the
promises that must survive that: the event is stored if and only if the
transaction commits; a failure of the INSERT, of the COMMIT or of the
connection is raised from ``commit()`` as SQLAlchemy's own exception and stores
nothing; statements SQLAlchemy runs after the write see its row; and the
connection goes back to the pool ready for ordinary use.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
from invoices import Base, Invoice, Line, add_refuse_bad, m, make_outbox, stored, take_row_lock
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, InvalidRequestError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from outbox import ConfigurationError, InvalidEmitOption, Outbox, emit
from outbox._write import pipeline as _pipeline


@pytest.fixture
def engine(pg_engine: Engine) -> Iterator[Engine]:
    Base.metadata.create_all(pg_engine)
    yield pg_engine


@pytest.fixture(params=["first commit", "prepared"])
def maker(engine: Engine, request: pytest.FixtureRequest) -> Iterator[sessionmaker[Session]]:
    """Sessions whose emitting commits go through psycopg's Pipeline, or on a prepared connection.

    Once psycopg has prepared the INSERT on a connection, emitting commits
    send that statement straight through libpq. Each test runs on both.
    """
    ob = make_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    if request.param == "prepared":
        prepare_on_the_pool(factory, engine)
    yield factory
    ob.uninstall(factory)


#: psycopg prepares a statement on its sixth run (``prepare_threshold`` is 5 by default).
PREPARED_AFTER = 6


def prepare_on_the_pool(factory: sessionmaker[Session], engine: Engine) -> None:
    """Emitting commits on the pool's connection until psycopg has prepared the INSERT, then no rows.

    Both shapes the tests emit: without a key, and with one (a text parameter
    where the other has NULL, so psycopg prepares it as a statement of its own).
    """
    for keyed in (False, True):
        for number in range(PREPARED_AFTER):
            with factory() as s, s.begin():
                s.add(Invoice(number=f"warm-up {keyed} {number}"))
                emit(s, "invoice.issued", {"number": number}, key=f"warm-up {number}" if keyed else None)
    with engine.begin() as conn:
        conn.execute(m.delete())
        conn.execute(text("DELETE FROM invoices"))


@pytest.fixture
def direct_sends(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The prepared statements the commits sent straight through libpq, by name."""
    sent: list[bytes] = []
    real = _pipeline.DirectBatch

    def spy(raw: object, statement: tuple[bytes, object, object]) -> object:
        sent.append(statement[0])
        return real(raw, statement)  # type: ignore[arg-type]

    monkeypatch.setattr(_pipeline, "DirectBatch", spy)
    return sent


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


def test_later_commits_send_psycopgs_prepared_insert_through_libpq(engine, direct_sends):
    """Once psycopg has prepared the INSERT on a connection, the next commits send it directly."""
    ob = make_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    for number in range(PREPARED_AFTER + 2):
        with factory() as s, s.begin():
            s.add(Invoice(number=f"P-{number}"))
            emit(s, "invoice.issued", {"number": number})
    ob.uninstall(factory)
    assert len(direct_sends) == 2 and len(set(direct_sends)) == 1
    # Asked before anything rolls back on the pool's one connection: psycopg
    # deallocates its statements at every ROLLBACK.
    with engine.connect() as conn:
        runs = conn.execute(
            text("SELECT generic_plans + custom_plans FROM pg_prepared_statements WHERE name = :name"),
            {"name": direct_sends[0].decode()},
        ).scalar_one()
    assert runs == 3  # psycopg's run that prepared it, and the two sent directly
    assert stored(engine) == (PREPARED_AFTER + 2, PREPARED_AFTER + 2)


def test_each_direct_commit_stores_its_own_values(engine, direct_sends):
    """Commits sent through libpq on one connection each store their own payload, key and headers.

    The statement is converted once per connection and only its parameters are
    dumped again at each commit: no commit may send another's values.
    """
    ob = make_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    prepare_on_the_pool(factory, engine)
    for number in range(4):
        with factory() as s, s.begin():
            s.add(Invoice(number=f"V-{number}"))
            key = f"key {number}" if number % 2 else None
            emit(s, "invoice.issued", {"number": number}, key=key, headers={"n": str(number)})
    ob.uninstall(factory)
    assert len(direct_sends) == 4
    with engine.connect() as conn:
        rows = conn.execute(select(m.c.payload, m.c.idempotency_key, m.c.headers).order_by(m.c.id)).all()
    assert [tuple(row) for row in rows] == [
        ({"number": number}, f"key {number}" if number % 2 else None, {"n": str(number)})
        for number in range(4)
    ]


def test_an_emit_after_the_prepared_statements_are_deallocated_still_commits(maker, engine):
    """psycopg's record of its statements is followed: DEALLOCATE ALL cannot fail a later commit."""
    with maker() as s, s.begin():
        s.execute(text("DEALLOCATE ALL"))
        s.add(Invoice(number="after-deallocate"))
        emit(s, "invoice.issued", {"number": 1})
    with maker() as s, s.begin():
        s.add(Invoice(number="next"))
        emit(s, "invoice.issued", {"number": 2})
    assert stored(engine) == (2, 2)


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
    add_refuse_bad(engine)


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


# -- where the write must not ride with the COMMIT --------------------------------------------
# In each case below something other than SQLAlchemy's commit could meet the
# pending reply (a savepoint's caller, an outer transaction's owner, a later
# listener), so the write is an ordinary statement and behaves as one.


def test_a_refused_emit_inside_a_savepoint_leaves_the_outer_transaction_whole(maker, engine, refuse_bad):
    s = maker()
    s.add(Invoice(number="outer"))
    emit(s, "invoice.issued", {"number": "outer"})
    with pytest.raises(IntegrityError), s.begin_nested():
        emit(s, "invoice.issued", {"number": "bad"})
    s.commit()
    s.close()
    assert stored(engine) == (1, 1)


JOIN_MODES = ["conditional_savepoint", "create_savepoint", "rollback_only", "control_fully"]


@pytest.mark.parametrize("mode", JOIN_MODES)
def test_a_session_on_a_callers_connection_raises_and_leaves_it_usable(engine, refuse_bad, mode):
    ob = make_outbox()
    factory = sessionmaker(join_transaction_mode=mode)
    ob.install(factory)
    with engine.connect() as conn:
        conn.begin()
        conn.execute(text("INSERT INTO invoices (number) VALUES ('outer')"))
        s = factory(bind=conn)
        s.add(Invoice(number="inner"))
        emit(s, "invoice.issued", {"number": "bad"})
        with pytest.raises(IntegrityError, match="refuse_bad"):
            s.commit()
        s.rollback()
        s.close()
        if conn.in_transaction() and conn.get_transaction().is_active:  # type: ignore[union-attr]
            conn.rollback()
        conn.execute(text("INSERT INTO invoices (number) VALUES ('next')"))
        conn.commit()
    invoices, messages = stored(engine)
    assert messages == 0 and invoices >= 1


def test_a_later_listener_swallowing_errors_cannot_hide_a_refused_event(maker, engine, refuse_bad):
    @event.listens_for(maker, "before_commit")
    def best_effort(session: Session) -> None:
        try:
            with session.begin_nested():
                session.execute(text("SELECT 1"))
        except DBAPIError:
            pass

    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": "bad"})
    with pytest.raises(IntegrityError):
        s.commit()
    s.rollback()
    s.close()
    assert stored(engine) == (0, 0)


def test_a_later_listener_may_use_the_raw_connection(maker, engine):
    @event.listens_for(maker, "before_commit")
    def bulk_audit(session: Session) -> None:
        raw = session.connection().connection.dbapi_connection
        with raw.cursor() as cur, cur.copy("COPY invoices (number) FROM STDIN") as copy:  # type: ignore[union-attr]
            copy.write_row(("copied",))

    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert stored(engine) == (2, 1)


def test_an_event_emitted_by_a_later_before_commit_listener_is_stored(maker, engine):
    @event.listens_for(maker, "before_commit")
    def follow_up(session: Session) -> None:
        emit(session, "invoice.issued", {"number": "follow-up"})

    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert stored(engine) == (1, 2)


def test_an_emit_after_the_commit_is_refused_not_dropped(maker, engine):
    refused: list[Exception] = []

    @event.listens_for(maker, "after_commit")
    def too_late(session: Session) -> None:
        try:
            emit(session, "invoice.issued", {"number": "late"})
        except InvalidEmitOption as exc:
            refused.append(exc)

    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert len(refused) == 1 and "has ended or failed" in str(refused[0])
    assert stored(engine) == (1, 1)


def test_a_two_phase_session_is_refused_at_emit(engine):
    ob = make_outbox()
    factory = sessionmaker(engine, twophase=True)
    ob.install(factory)
    with factory() as s, pytest.raises(ConfigurationError, match="two-phase"):
        emit(s, "invoice.issued", {"number": 1})


def test_the_outbox_table_may_have_a_bind_of_its_own(engine):
    ob = make_outbox()
    factory = sessionmaker(binds={Invoice: engine, m: engine})
    ob.install(factory)
    with factory() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert stored(engine) == (1, 1)


# -- failures on the pipelined path ------------------------------------------------------------


def test_a_refused_insert_leaves_a_callers_connection_usable(engine, refuse_bad):
    ob = make_outbox()
    factory = sessionmaker()
    ob.install(factory)
    with engine.connect() as conn:
        # A Connection with no transaction yet: the session begins and commits it itself.
        s = factory(bind=conn, join_transaction_mode="control_fully")
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": "bad"})
        with pytest.raises(IntegrityError) as caught:
            s.commit()
        s.rollback()
        s.close()
        assert conn.execute(text("SELECT 42")).scalar_one() == 42
        conn.commit()
    assert caught.value is not None  # the exception outlived the commit, as error reporters keep it
    assert stored(engine) == (0, 0)


def test_a_large_refused_commit_names_the_refusal(maker, engine, refuse_bad):
    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": "bad"})
    for number in range(2500):
        emit(s, "invoice.issued", {"number": number})
    with pytest.raises(IntegrityError, match="refuse_bad"):
        s.commit()
    s.rollback()
    s.close()
    assert stored(engine) == (0, 0)


def test_handle_error_listeners_see_a_refused_insert(maker, engine, refuse_bad):
    seen: list[str] = []
    event.listen(engine, "handle_error", lambda ctx: seen.append(type(ctx.original_exception).__name__))
    commit_refused_event(maker)
    assert seen == ["CheckViolation"]


@pytest.mark.parametrize("prepared", [False, True], ids=["first commit", "prepared"])
def test_a_connection_lost_before_the_commit_is_reported_and_the_session_recovers(
    pg_url, prepared, direct_sends
):
    eng = create_engine(pg_url, connect_args={"options": "-c idle_in_transaction_session_timeout=200"})
    Base.metadata.create_all(eng)
    ob = make_outbox()
    factory = sessionmaker(eng)
    ob.install(factory)
    if prepared:
        prepare_on_the_pool(factory, eng)
    direct_sends.clear()
    s = factory()
    s.add(Invoice(number="x"))
    s.flush()
    emit(s, "invoice.issued", {"number": 1})
    time.sleep(0.6)  # the server ends the idle transaction and closes the connection
    with pytest.raises(DBAPIError) as caught:
        s.commit()
    assert caught.value.connection_invalidated
    assert len(direct_sends) == (1 if prepared else 0)
    s.rollback()
    s.close()
    assert stored(eng) == (0, 0)
    eng.dispose()


def test_an_invalidated_connection_is_not_kept_alive(maker, engine):
    raws: list[weakref.ref[object]] = []

    @event.listens_for(maker, "before_commit")
    def drop_connection(session: Session) -> None:
        raw = session.connection().connection.dbapi_connection
        raws.append(weakref.ref(raw))
        session.connection().invalidate()

    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": 1})
    with pytest.raises((DBAPIError, InvalidRequestError)):
        s.commit()
    s.close()
    del s
    gc.collect()
    assert raws and raws[0]() is None


def test_rollbacks_of_lost_connections_work_while_other_threads_commit(maker, engine, pg_url):
    """Other threads' pending writes must not trip SQLAlchemy's rollback of a dead connection."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    stop = threading.Event()

    def commit_forever() -> None:
        number = 0
        while not stop.is_set():
            with maker() as s, s.begin():
                s.add(Invoice(number=f"bg-{number}"))
                emit(s, "invoice.issued", {"number": number})
            number += 1

    workers = [threading.Thread(target=commit_forever) for _ in range(2)]
    for worker in workers:
        worker.start()
    problems: list[Exception] = []
    try:
        for _ in range(25):
            victim = Session(engine)
            victim.execute(text("SELECT 1"))
            pid = victim.connection().connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
            with admin.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            with pytest.raises(OperationalError):
                victim.execute(text("SELECT 1"))
            try:
                victim.rollback()
            except Exception as exc:
                problems.append(exc)
            victim.close()
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        admin.dispose()
    assert problems == []
    invoices, messages = stored(engine)
    assert invoices == messages > 0


def test_an_interrupted_commit_commits_nothing_and_gives_up_its_connection(
    maker, engine, direct_sends, request
):
    """Ctrl-C while the INSERT waits for a lock: the server's work is cancelled, nothing commits."""
    import os
    import signal

    # On a connection of its own, so the session takes the pool's (perhaps prepared) one.
    own = create_engine(engine.url, poolclass=NullPool)
    blocker = take_row_lock(own, "K")  # our INSERT of key K waits on this row lock
    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": 1}, key="K")
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            s.commit()
    finally:
        timer.cancel()
        blocker.rollback()
        blocker.close()
        own.dispose()
    assert len(direct_sends) == (1 if request.node.callspec.params["maker"] == "prepared" else 0)
    s.close()
    assert stored(engine) == (0, 0)
    with maker() as s2, s2.begin():  # the pool's next connection is healthy
        s2.add(Invoice(number="y"))
        emit(s2, "invoice.issued", {"number": 2}, key="K")
    assert stored(engine) == (1, 1)


@pytest.mark.parametrize("hook", ["after_flush", "after_flush_postexec", "pending_to_persistent"])
def test_flush_listeners_after_ours_may_use_the_raw_connection(maker, engine, hook):
    """They run during the commit's flush, so the INSERT must not be pending in pipeline mode then."""

    def bulk_audit(session: Session, *args: object) -> None:
        raw = session.connection().connection.dbapi_connection
        with raw.cursor() as cur, cur.copy("COPY invoices (number) FROM STDIN") as copy:  # type: ignore[union-attr]
            copy.write_row(("copied",))

    event.listen(maker, hook, bulk_audit)
    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert stored(engine) == (2, 1)
