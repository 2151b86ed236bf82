"""Emits and failures while a session commits, on SQLite and PostgreSQL.

An event is stored if and only if its transaction commits, whatever runs
during the commit: listeners that emit (before_flush, before_commit, from
aggregates not yet flushed, after a vetoed attempt, with a savepoint still
open), listeners that veto the COMMIT or use the raw connection, timeouts
that interrupt the wait, and refusals read by a later statement. An emit that
raised is not stored; an emit after the transaction ended is refused, not
dropped.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest
from invoices import Base, Invoice, add_refuse_bad, make_outbox, stored, take_row_lock
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from outbox import InvalidEmitOption, OutboxError, emit


@pytest.fixture
def db(engine: Engine) -> Iterator[Engine]:
    """SQLite and PostgreSQL (the parametrised ``engine`` fixture), with the invoice table."""
    Base.metadata.create_all(engine)
    yield engine


@pytest.fixture
def pg(pg_engine: Engine) -> Iterator[Engine]:
    Base.metadata.create_all(pg_engine)
    yield pg_engine


@pytest.fixture
def refuse_bad(pg: Engine) -> None:
    add_refuse_bad(pg)


def installed(engine: Engine) -> sessionmaker[Session]:
    ob = make_outbox()
    maker = sessionmaker(engine)
    ob.install(maker)
    return maker


@pytest.mark.parametrize("hook", ["before_flush", "before_commit"])
def test_a_listener_may_announce_new_aggregates_while_the_session_commits(db, hook):
    """Domain events for rows that have no id yet, emitted by a before_flush listener (with
    no earlier emit in the transaction) or by a before_commit listener after the Outbox's."""
    maker = installed(db)

    def announce(session: Session, *args: object) -> None:
        for obj in list(session.new):
            if isinstance(obj, Invoice):
                obj.emit("invoice.created", {"number": obj.number})

    event.listen(maker, hook, announce)
    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
    assert stored(db) == (1, 1)


def test_an_emit_that_raised_is_not_stored(db):
    """emit() raised, so the caller believes the event was refused; it must not be stored."""
    maker = installed(db)
    raised: list[Exception] = []

    @event.listens_for(maker, "before_commit")
    def announce(session):  # type: ignore[no-untyped-def]
        for obj in list(session.new):
            try:
                obj.emit("invoice.created", {"number": obj.number})
            except OutboxError as exc:
                raised.append(exc)

    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
    _, messages = stored(db)
    assert (raised and messages == 0) or (not raised and messages == 1), (raised, messages)


def test_emits_after_a_vetoed_commit_attempt_are_stored_by_the_next_commit(db):
    """A later before_commit listener vetoes the first commit(); the transaction stays active and
    the application goes on in it and commits again."""
    maker = installed(db)
    vetoes = [RuntimeError("fix something first")]

    @event.listens_for(maker, "before_commit")
    def validate(session):  # type: ignore[no-untyped-def]
        if vetoes:
            raise vetoes.pop()

    s = maker()
    s.add(Invoice(number="first"))
    with pytest.raises(RuntimeError):
        s.commit()
    assert s.get_transaction() is not None and s.get_transaction().is_active  # type: ignore[union-attr]
    second = Invoice(number="second")
    s.add(second)
    second.emit("invoice.created", {"number": "second"})
    s.commit()
    s.close()
    assert stored(db) == (2, 1)


def _commit_root_with_open_savepoint(maker: sessionmaker[Session]) -> None:
    with maker() as s:
        with s.begin():  # exiting commits the ROOT transaction while the savepoint is open
            s.add(Invoice(number="x"))
            emit(s, "invoice.issued", {"number": "body"})
            s.begin_nested()


def test_late_emits_are_stored_when_the_root_commits_with_a_savepoint_open(db):
    maker = installed(db)
    emitted: list[int] = []

    @event.listens_for(maker, "before_commit")
    def follow_up(session):  # type: ignore[no-untyped-def]
        emitted.append(1)
        emit(session, "invoice.issued", {"number": f"late-{len(emitted)}"})

    _commit_root_with_open_savepoint(maker)
    # 1 from the body + one per before_commit call (root, then the savepoint): all committed
    assert stored(db) == (1, 1 + len(emitted))


def test_an_emit_in_after_commit_is_refused_even_with_a_savepoint_open(db):
    maker = installed(db)
    outcome: list[str] = []

    @event.listens_for(maker, "after_commit")
    def too_late(session):  # type: ignore[no-untyped-def]
        if session.get_nested_transaction() is None:
            try:
                emit(session, "invoice.issued", {"number": "after-commit"})
                outcome.append("accepted")
            except InvalidEmitOption:
                outcome.append("refused")

    _commit_root_with_open_savepoint(maker)
    _, messages = stored(db)
    # either refused (as without the open savepoint) or stored; never accepted and then dropped
    assert outcome == ["refused"] or messages == 2, (outcome, messages)


def test_the_first_pipelined_commit_does_not_disturb_other_threads(pg_url):
    failures: list[BaseException] = []
    for _ in range(8):
        eng = create_engine(pg_url, pool_size=4)
        Base.metadata.create_all(eng)

        @event.listens_for(eng, "before_cursor_execute")
        def trace(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
            time.sleep(0.0005)  # a tracing/logging integration doing I/O: the GIL is released

        maker = installed(eng)
        stop = threading.Event()
        ready = threading.Barrier(3)

        def reader(eng: Engine = eng, stop: threading.Event = stop, ready: threading.Barrier = ready) -> None:
            ready.wait()
            try:
                with eng.connect() as conn:
                    while not stop.is_set():
                        conn.execute(text("SELECT 1"))
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        ready.wait()
        time.sleep(0.01)
        with maker() as s, s.begin():  # this engine's first pipelined commit
            s.add(Invoice(number="x"))
            emit(s, "invoice.issued", {"number": 1})
        stop.set()
        for t in threads:
            t.join()
        eng.dispose()
    assert failures == [], failures[:1]  # not "deque mutated during iteration"


def test_a_commit_listener_that_vetoes_still_prevents_the_commit(pg):
    maker = installed(pg)
    with maker() as s, s.begin():
        s.add(Invoice(number="warm-up"))
        emit(s, "invoice.issued", {"number": 0})

    class ReadOnlyMode(Exception):
        pass

    @event.listens_for(pg, "commit")
    def read_only_guard(conn):  # type: ignore[no-untyped-def]
        raise ReadOnlyMode("writes are disabled")

    with pytest.raises(ReadOnlyMode), maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    event.remove(pg, "commit", read_only_guard)
    # commit() raised before the COMMIT: nothing of that transaction may be stored
    assert stored(pg) == (1, 1)


def test_a_pending_to_persistent_listener_may_use_the_raw_connection(pg):
    maker = installed(pg)

    @event.listens_for(maker, "pending_to_persistent")
    def bulk_audit(session, instance):  # type: ignore[no-untyped-def]
        raw = session.connection().connection.dbapi_connection
        with raw.cursor() as cur, cur.copy("COPY invoices (number) FROM STDIN") as copy:
            copy.write_row(("audit",))

    with maker() as s, s.begin():
        s.add(Invoice(number="x"))
        emit(s, "invoice.issued", {"number": 1})
    assert stored(pg) == (2, 1)


@pytest.mark.parametrize("statement_during_commit", [False, True])
def test_a_signal_timeout_during_the_commit_surfaces_as_itself(pg, caplog, statement_during_commit):
    """A request timeout (SIGALRM) while the INSERT waits on a row lock: the TimeoutError
    surfaces, nothing is stored, and the connection is given up rather than handed back to
    the pool busy (which would log "Exception during reset or similar"). With a listener
    running a statement during the commit, the wait happens in that statement instead."""
    maker = installed(pg)
    if statement_during_commit:

        @event.listens_for(maker, "pending_to_persistent")
        def lookup(session: Session, instance: object) -> None:
            session.execute(text("SELECT 1"))

    blocker = take_row_lock(pg, "K")

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("request took too long")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": 1}, key="K")
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    caplog.set_level("ERROR", logger="sqlalchemy.pool")
    try:
        with pytest.raises(TimeoutError):
            s.commit()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        s.rollback()
        s.close()
        blocker.rollback()
        blocker.close()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy.pool")] == []
    assert stored(pg) == (0, 0)


def test_handle_error_sees_a_refused_insert_once(pg, refuse_bad):
    maker = installed(pg)
    seen: list[str] = []
    event.listen(pg, "handle_error", lambda ctx: seen.append(type(ctx.original_exception).__name__))

    @event.listens_for(maker, "pending_to_persistent")
    def lookup(session, instance):  # type: ignore[no-untyped-def]
        session.execute(text("SELECT 1"))

    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": "bad"})
    with pytest.raises(IntegrityError):
        s.commit()
    s.rollback()
    s.close()
    assert seen == ["CheckViolation"]


def test_an_emit_after_a_failed_commit_is_refused_without_claiming_it_committed(pg, refuse_bad):
    maker = installed(pg)
    s = maker()
    s.add(Invoice(number="x"))
    emit(s, "invoice.issued", {"number": "bad"})
    with pytest.raises(IntegrityError):
        s.commit()
    try:
        emit(s, "invoice.issued", {"number": "compensation"})
    except InvalidEmitOption as exc:
        assert "committed" not in str(exc).split(";")[0], str(exc)
    finally:
        s.rollback()
        s.close()
