from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

import pytest
from sqlalchemy import String, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import (
    ConfigurationError,
    EmitError,
    InvalidEmitOption,
    Outbox,
    OutboxMixin,
    PayloadError,
    UnroutedEvent,
    emit,
)
from outbox.relay import Relay

m = outbox.outbox_message


def nested(levels: int) -> dict[str, Any]:
    """A payload ``levels`` deep, objects and arrays taking turns; the payload itself is level 1."""
    inner: Any = "bottom"
    for level in range(levels, 1, -1):
        inner = [inner] if level % 2 == 0 else {"next": inner}
    return {"next": inner}


def _containing_itself() -> dict[str, Any]:
    payload: dict[str, Any] = {"ok": 1, "items": []}
    payload["items"].append(payload)
    return payload


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


def _history_row(engine: Engine, started_at: object) -> None:
    with engine.begin() as conn:
        conn.execute(
            outbox.outbox_attempt.insert().values(
                message_id=1, attempt=1, outcome="delivered", started_at=started_at
            )
        )


def _purge_record(engine: Engine, history_before: datetime, *, finished: bool = False) -> int:
    run = outbox.outbox_retention_run
    now = datetime.now(UTC)
    with engine.begin() as conn:
        return conn.execute(
            run.insert()
            .values(
                started_at=now,
                finished_at=now if finished else None,
                actor="test",
                delivered_before=now,
                history_before=history_before,
            )
            .returning(run.c.id)
        ).scalar_one()


def test_history_is_append_only(maker, engine):
    _history_row(engine, func.now())
    for statement in ("UPDATE outbox_attempt SET attempt = 2", "DELETE FROM outbox_attempt"):
        refused = r"append-only|outbox_purge_in_progress"
        with pytest.raises(DatabaseError, match=refused), engine.begin() as conn:
            conn.execute(text(statement))
    from outbox.ops._retention import history_purge_allowed

    run_id = _purge_record(engine, datetime.now(UTC) + timedelta(days=1))
    with engine.begin() as conn, history_purge_allowed(conn, run_id):
        conn.execute(text("DELETE FROM outbox_attempt"))
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox.outbox_attempt)).scalar() == 0


def test_postgresql_history_leaves_only_through_a_recorded_purge_and_only_below_its_cutoff(pg_engine):
    from outbox.ops._retention import history_purge_allowed

    old, recent = datetime.now(UTC) - timedelta(days=100), datetime.now(UTC)
    _history_row(pg_engine, old)
    _history_row(pg_engine, recent)
    count = text("SELECT count(*) FROM outbox_attempt")

    def refused(setting: str) -> None:
        with pytest.raises(DatabaseError, match="append-only"), pg_engine.begin() as conn:
            conn.execute(text("SELECT set_config('outbox.retention', :v, true)"), {"v": setting})
            conn.execute(text("DELETE FROM outbox_attempt"))

    refused("on")  # the old switch: any session could flip it, and nothing recorded it
    refused("999999")  # no such purge
    refused(str(_purge_record(pg_engine, recent + timedelta(days=1), finished=True)))  # a finished purge
    cutoff = _purge_record(pg_engine, old + timedelta(days=1))
    refused(str(cutoff))  # the recent row is newer than this purge's cutoff: the whole DELETE fails
    with pg_engine.begin() as conn, history_purge_allowed(conn, cutoff):
        older = {"c": old + timedelta(days=1)}
        deleted = conn.execute(text("DELETE FROM outbox_attempt WHERE started_at < :c"), older)
        assert deleted.rowcount == 1
    with pg_engine.connect() as conn:
        assert conn.execute(count).scalar() == 1


def test_thousands_of_events_in_one_commit_are_all_stored(maker, engine):
    """PostgreSQL binds at most 65,535 parameters a statement: a big commit must still store everything."""
    with maker() as s, s.begin():
        for n in range(3000):  # 6,000 messages: two routes each
            emit(s, "user.signed_up", {"n": n})
    with engine.connect() as conn:
        stored = conn.execute(select(m.c.handler, func.count()).group_by(m.c.handler)).all()
    assert dict(stored) == {"crm": 3000, "welcome_email": 3000}


def test_the_payload_is_captured_at_emit_time(maker, engine):
    payload = {"email": "a@example.com", "tags": ["new"]}
    with maker() as s, s.begin():
        emit(s, "user.signed_up", payload)
        # Changing the dict afterwards neither changes what is stored nor escapes the checks.
        payload["email"] = "changed@example.com"
        payload["tags"].append("x" * 70_000)
        payload["when"] = __import__("datetime").datetime.now()
    assert [r.payload for r in rows(engine)] == [{"email": "a@example.com", "tags": ["new"]}] * 2


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"payload": {"note": "a\x00b"}}, PayloadError, r"payload\['note'\] contains a NUL"),
        ({"payload": {"a\x00": 1}}, PayloadError, "NUL"),
        ({"payload": {"deep": [{"x": "\ud800"}]}}, PayloadError, r"payload\['deep'\]\[0\]\['x'\].*surrogate"),
        ({"key": "k\x00"}, InvalidEmitOption, "key contains a NUL"),
        ({"group_key": "g\ud800"}, InvalidEmitOption, "group_key contains a lone surrogate"),
        ({"headers": {"x-trace": "\x00"}}, InvalidEmitOption, "NUL"),
        ({"delay": 3651 * 24 * 3600}, InvalidEmitOption, "at most 3650 days"),
        ({"delay": float("inf")}, InvalidEmitOption, "zero or more"),
        ({"queue": "bulk jobs"}, InvalidEmitOption, "whitespace"),
        ({"queue": ""}, InvalidEmitOption, "non-empty"),
        ({"priority": 1.5}, InvalidEmitOption, "priority"),
        # json.dumps would raise ValueError (Python's int-to-text digit limit) or TypeError (not a dict).
        ({"payload": {"n": [10**5000]}}, PayloadError, r"payload\['n'\]\[0\] is an integer of more than"),
        ({"payload": MappingProxyType({"a": 1})}, PayloadError, "got mappingproxy; pass dict"),
        (
            {"payload": {"a": MappingProxyType({})}},
            PayloadError,
            r"payload\['a'\] is a mappingproxy.*dict\(value\)",
        ),
        (
            {"payload": _containing_itself()},
            PayloadError,
            r"^payload\['items'\]\[0\] is an object or array that contains itself",
        ),
    ],
)
def test_what_the_database_cannot_store_is_refused_at_emit(maker, engine, kwargs, error, needle):
    kwargs = dict(kwargs)  # parameters are shared between the sqlite and postgresql runs
    payload = kwargs.pop("payload", {"ok": True})
    with maker() as s, s.begin():
        with pytest.raises(error, match=needle):
            emit(s, "user.signed_up", payload, **kwargs)
        emit(s, "user.signed_up", {"after": True})  # the transaction is still usable
    assert [r.payload for r in rows(engine)] == [{"after": True}] * 2


def test_every_emit_option_is_stored_as_given(maker, engine):
    with maker() as s, s.begin():
        emit(
            s,
            "user.signed_up",
            {"n": 1},
            key="signup:1",
            group_key="user:1",
            delay=3600,
            headers={"traceparent": "00-abc-01"},
            priority=-5,
            queue="urgent",
        )
        emit(s, "user.signed_up", {"n": 2})
    first, second = [r for r in rows(engine) if r.handler == "crm"]
    assert (first.idempotency_key, first.group_key) == ("signup:1", "user:1")
    assert first.headers == {"traceparent": "00-abc-01"}
    assert (first.priority, first.queue) == (-5, "urgent")
    assert 3590 <= (first.available_at - first.created_at).total_seconds() <= 3610
    assert (second.idempotency_key, second.group_key, second.headers) == (None, None, {})
    assert (second.priority, second.queue) == (0, "default")
    assert abs((second.available_at - second.created_at).total_seconds()) < 1


def test_payload_limit_is_configurable_and_counts_utf8_bytes(engine):
    Base.metadata.create_all(engine)
    ob = Outbox(payload_limit=100)
    ob.route("e", lambda msg: None, name="r")
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        overhead = len('{"s":""}')
        with factory() as s, s.begin():
            emit(s, "e", {"s": "x" * (100 - overhead)})  # exactly at the limit
            with pytest.raises(PayloadError, match="101 bytes as JSON, over the limit of 100"):
                emit(s, "e", {"s": "x" * (101 - overhead)})
            with pytest.raises(PayloadError, match="over the limit"):
                emit(s, "e", {"s": "é" * 50})  # 50 characters, 100 bytes of UTF-8
    finally:
        ob.uninstall(factory)
    assert len(rows(engine)) == 1


@pytest.mark.parametrize("levels", [65, 990])
def test_a_payload_nested_past_the_depth_limit_is_refused_at_emit_and_the_callers_rows_commit(
    maker, engine, levels
):
    """990 levels once passed emit() and then broke the commit on SQLite, rolling back the caller's rows."""
    with maker() as s, s.begin():
        s.add(User(email="kept@example.com"))
        with pytest.raises(PayloadError) as refused:
            emit(s, "user.signed_up", nested(levels))
        emit(s, "user.signed_up", {"after": True})  # nothing was buffered, and the transaction is usable
    said = str(refused.value)
    assert said.startswith(f"payload is nested {levels} levels deep, over the limit of 64 (level 65 starts ")
    assert "store it flatter, or raise the limit with Outbox(payload_depth_limit=...)" in said
    assert "\n" not in said and len(said) < 300
    assert [r.payload for r in rows(engine)] == [{"after": True}] * 2
    with engine.connect() as conn:
        assert conn.execute(select(User.email)).scalars().all() == ["kept@example.com"]


def test_a_payload_as_deep_as_the_limit_is_stored_and_delivered_and_one_level_more_is_not(engine):
    ob = Outbox()
    delivered: list[Any] = []
    ob.route("deep", lambda msg: delivered.append(msg.payload), name="deep")
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory() as s, s.begin():
            emit(s, "deep", nested(64))
            with pytest.raises(PayloadError, match="nested 65 levels deep"):
                emit(s, "deep", nested(65))
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(factory)
    assert delivered == [nested(64)]
    assert [(r.status, r.payload) for r in rows(engine)] == [("delivered", nested(64))]


def test_the_depth_limit_is_configurable_within_what_readers_and_encoders_can_take(engine):
    ob = Outbox(payload_depth_limit=3)
    ob.route("e", lambda msg: None, name="r")
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory() as s, s.begin():
            emit(s, "e", {"a": [{"b": 1}]})  # three levels
            with pytest.raises(PayloadError, match=r"nested 4 levels deep, over the limit of 3 \(level 4 "):
                emit(s, "e", {"a": [{"b": [1]}]})
    finally:
        ob.uninstall(factory)
    assert [r.payload for r in rows(engine)] == [{"a": [{"b": 1}]}]
    assert Outbox(payload_depth_limit=256).payload_depth_limit == 256
    refused = "payload_depth_limit must be a number of levels from 1 to 256"
    for bad in (0, 257, True, 64.0, "64"):
        with pytest.raises(ConfigurationError, match=refused):
            Outbox(payload_depth_limit=bad)  # type: ignore[arg-type]


def test_a_mixin_instance_outside_any_session_cannot_emit(maker, engine):
    from outbox import EmitError

    with pytest.raises(EmitError, match="not in a session.*session.add"):
        User(email="lost@example.com").emit("user.signed_up", {})
    assert rows(engine) == []


class Account(OutboxMixin, Base):
    __tablename__ = "accounts"
    __outbox_aggregate_type__ = "billing.Account"
    id: Mapped[int] = mapped_column(primary_key=True)


def test_a_custom_aggregate_type_and_an_id_known_only_after_flush(maker, engine):
    with maker() as s, s.begin():
        account = Account()
        s.add(account)
        account.emit("user.signed_up", {})  # no id yet: it is read when the event is written
    with maker() as s:
        (account_id,) = s.execute(select(Account.id)).one()
    stored = {(r.aggregate_type, r.aggregate_id) for r in rows(engine)}
    assert stored == {("billing.Account", str(account_id))}


class Coupon(OutboxMixin, Base):
    __tablename__ = "coupons"
    code: Mapped[str] = mapped_column(String(400), primary_key=True)


class Oversized(OutboxMixin, Base):
    __tablename__ = "oversized"
    __outbox_aggregate_type__ = "x" * 256
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.mark.parametrize(
    ("aggregate", "needle"),
    [
        (lambda: Coupon(code="c" * 256), "primary key of this Coupon .* is 256 characters"),
        (lambda: Coupon(code="c\x00"), "primary key of this Coupon .* contains a NUL"),
        (lambda: Oversized(id=1), "__outbox_aggregate_type__ of Oversized must be a string of at most 255"),
    ],
)
def test_an_aggregate_the_columns_cannot_hold_is_refused_at_emit_and_the_business_change_commits(
    maker, engine, aggregate, needle
):
    with maker() as s, s.begin():
        refused = aggregate()
        s.add(refused)
        with pytest.raises(EmitError, match=needle):
            refused.emit("user.signed_up", {})
        s.expunge(refused)
        kept = Coupon(code="c" * 255)  # the longest id that fits
        s.add(kept)
        kept.emit("user.signed_up", {})
    with maker() as s:
        assert s.scalars(select(Coupon.code)).all() == ["c" * 255]
    assert {r.aggregate_id for r in rows(engine)} == {"c" * 255}
