from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import String, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import InvalidEmitOption, Outbox, OutboxMixin, PayloadError, UnroutedEvent, emit

m = outbox.outbox_message


class Base(DeclarativeBase):
    pass


class User(OutboxMixin, Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(100))


@pytest.fixture
def maker(engine: Engine) -> Iterator[sessionmaker[Session]]:
    Base.metadata.create_all(engine)
    ob = Outbox()
    ob.route("user.signed_up", lambda msg: None, name="welcome_email", max_attempts=5)
    ob.route("user.signed_up", lambda msg: None, name="crm")
    factory = sessionmaker(engine)
    ob.install(factory)
    ob.install(factory)  # harmless
    yield factory
    ob.uninstall(factory)


def rows(engine: Engine) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def test_mixin_emit_stores_one_row_per_route_with_aggregate(maker, engine):
    with maker() as s, s.begin():
        u = User(email="a@example.com")
        s.add(u)
        u.emit("user.signed_up", {"email": u.email}, key="signup:a@example.com")
        s.flush()
        user_id = u.id
    stored = rows(engine)
    assert sorted(r.handler for r in stored) == ["crm", "welcome_email"]
    assert {(r.aggregate_type, r.aggregate_id) for r in stored} == {("User", str(user_id))}
    assert {r.max_attempts for r in stored if r.handler == "welcome_email"} == {5}
    assert all(r.status == "pending" for r in stored)


def test_rollback_stores_nothing(maker, engine):
    with maker() as s:
        s.begin()
        emit(s, "user.signed_up", {"x": 1})
        s.flush()
        s.rollback()
        with s.begin():
            emit(s, "user.signed_up", {"after": 1})
    assert [r.payload for r in rows(engine)] == [{"after": 1}] * 2


def test_savepoint_rollback_keeps_outer_events_even_when_flushed_inside(maker, engine):
    with maker() as s, s.begin():
        emit(s, "user.signed_up", {"outer": 1})
        with pytest.raises(ValueError), s.begin_nested():
            s.add(User(email="b"))
            emit(s, "user.signed_up", {"inner": 1})
            s.flush()
            raise ValueError
    assert [r.payload for r in rows(engine)] == [{"outer": 1}] * 2


def test_idempotency_key_across_transactions(maker, engine):
    ids = []
    for _ in range(2):
        with maker() as s, s.begin():
            ids.append(emit(s, "user.signed_up", {}, key="k1"))
    assert ids[0] == ids[1]
    assert len(rows(engine)) == 2


def test_bad_input_raises_at_emit_and_transaction_stays_usable(maker, engine):
    with maker() as s, s.begin():
        with pytest.raises(UnroutedEvent):
            emit(s, "nobody.listens", {})
        with pytest.raises(PayloadError, match="datetime"):
            emit(s, "user.signed_up", {"when": __import__("datetime").datetime.now()})
        with pytest.raises(PayloadError, match="limit"):
            emit(s, "user.signed_up", {"blob": "x" * 70_000})
        with pytest.raises(InvalidEmitOption):
            emit(s, "user.signed_up", {}, delay=-1)
        with pytest.raises(InvalidEmitOption):
            emit(s, "user.signed_up", {}, key="")
        emit(s, "user.signed_up", {"ok": True})
    assert len(rows(engine)) == 2


def test_history_is_append_only(maker, engine):
    with engine.begin() as conn:
        conn.execute(
            outbox.outbox_attempt.insert().values(
                message_id=1, attempt=1, outcome="delivered", started_at=func.now()
            )
        )
    for statement in ("UPDATE outbox_attempt SET attempt = 2", "DELETE FROM outbox_attempt"):
        refused = r"append-only|outbox_purge_in_progress"
        with pytest.raises(DatabaseError, match=refused), engine.begin() as conn:
            conn.execute(text(statement))
    from outbox._retention import history_purge_allowed

    with engine.begin() as conn, history_purge_allowed(conn):
        conn.execute(text("DELETE FROM outbox_attempt"))
