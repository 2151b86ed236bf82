"""The relay's login writes outbox state only through the database's functions (migration outbox_0015).

Each test runs over the relay role exactly as docs/operations.md creates it (``test_roles``'s
fixture reads the guide's block), and names what it protects: a relay login can move a message
only from the state its own claim left it in, can append history only for attempts it made,
and never chooses the timestamps the purge floor and the audit trail rely on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker
from test_roles import Roles, guide_roles, refused

import outbox
from outbox import Outbox, emit
from outbox.relay import Relay
from outbox.relay.outcomes import Completion
from outbox.relay.recovery import recover_expired

m, a = outbox.outbox_message, outbox.outbox_attempt


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    yield from guide_roles(pg_url)


def _emitted(pg_engine: Engine, ob: Outbox, count: int = 1) -> list[int]:
    maker = sessionmaker(pg_engine)
    ob.install(maker)
    try:
        with maker.begin() as session:
            for n in range(count):
                emit(session, "e", {"n": n})
    finally:
        ob.uninstall(maker)
    with pg_engine.connect() as conn:
        return list(conn.execute(select(m.c.id).order_by(m.c.id)).scalars())


def _history(pg_engine: Engine) -> list:
    with pg_engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def _relay_ob() -> Outbox:
    ob = Outbox()
    ob.route("e", lambda msg: None, name="r")
    return ob


def _done(
    message_id: int, attempt: int, *, outcome: str = "delivered", status: str = "delivered", **kw
) -> Completion:
    now = datetime.now(UTC)
    return Completion(message_id, attempt, outcome, status, started_at=now, finished_at=now, **kw)


def test_the_relay_login_cannot_write_messages_or_history_with_plain_sql(roles: Roles, pg_engine):
    ob = _relay_ob()
    (mid,) = _emitted(pg_engine, ob)
    relay_engine = roles.engine("outbox_relay")
    for statement in (
        f"UPDATE outbox_message SET status = 'delivered' WHERE id = {mid}",
        f"UPDATE outbox_message SET requeued_from = NULL WHERE id = {mid}",
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at)"
        f" VALUES ({mid}, 1, 'requeued', now() - interval '2 days')",
        f"SELECT id FROM outbox_message WHERE id = {mid} FOR UPDATE",
        "SELECT id FROM outbox_attempt",
    ):
        refused(relay_engine, statement)
    assert Relay(ob, relay_engine).run_until_idle().delivered == 1


def test_history_timestamps_are_held_to_what_the_database_saw(roles: Roles, pg_engine):
    """A relay host whose clock is a day off cannot make fresh history look purgeable, or date it ahead."""
    ob = _relay_ob()
    slow, fast = _emitted(pg_engine, ob, 2)
    relay = Relay(ob, roles.engine("outbox_relay"), relay_id="skewed")
    assert len(relay.store.claim("default", ["r"], 2)) == 2
    with pg_engine.connect() as conn:
        claimed_at = conn.execute(select(m.c.updated_at).where(m.c.id == slow)).scalar_one()
    day = timedelta(days=1)
    day_ago, day_ahead = datetime.now(UTC) - day, datetime.now(UTC) + day
    relay.store.complete(
        [
            Completion(slow, 1, "delivered", "delivered", started_at=day_ago, finished_at=day_ago),
            Completion(fast, 1, "delivered", "delivered", started_at=day_ahead, finished_at=day_ahead),
        ]
    )
    with pg_engine.connect() as conn:
        now = conn.execute(select(func.now())).scalar_one()
    rows = {row.message_id: row for row in _history(pg_engine)}
    assert rows[slow].started_at == rows[slow].finished_at == claimed_at
    assert claimed_at <= rows[fast].started_at <= rows[fast].finished_at <= now
    assert {(r.relay_id, r.detail["db_user"]) for r in rows.values()} == {
        ("skewed", roles.names["outbox_relay"])
    }


def test_a_relay_cannot_record_an_outcome_for_a_message_it_never_claimed(roles: Roles, pg_engine):
    ob = _relay_ob()
    held, never = _emitted(pg_engine, ob, 2)
    relay = Relay(ob, roles.engine("outbox_relay"), relay_id="mine")
    (claim,) = relay.store.claim("default", ["r"], 1)
    assert claim.id == held
    other = Relay(ob, roles.engine("outbox_relay"), relay_id="other")
    # Another relay id, a message nobody claimed, a wrong attempt number: nothing moves, nothing is written.
    other.store.complete([_done(held, 1)])
    relay.store.complete([_done(never, 1), _done(never, 0), _done(held, 2)])
    with pg_engine.connect() as conn:
        states = dict(conn.execute(select(m.c.id, m.c.status)).all())
    assert states == {held: "running", never: "pending"}
    assert _history(pg_engine) == []
    relay.store.complete([_done(held, 1)])
    assert [(h.message_id, h.outcome) for h in _history(pg_engine)] == [(held, "delivered")]


@pytest.mark.parametrize(
    "completion",
    [
        {"outcome": "requeued", "status": "pending"},
        {"outcome": "discarded", "status": "dead"},
        {"outcome": "delivered", "status": "dead"},
        {"outcome": "failed", "status": "discarded"},
        {"outcome": "retry", "status": "pending", "refund": 2},
        {"outcome": "expired", "status": "dead"},
        {"outcome": "expired", "status": "pending", "refund": 1},
        {"outcome": "retry", "status": "pending", "parked_on": "amqp://b:5672/"},
        {"outcome": "dead", "status": "dead", "refund": 0, "parked_on": "amqp://b:5672/"},
        {"outcome": "retry", "status": "pending", "refund": 1, "parked_on": " "},
        {"outcome": "retry", "status": "pending", "refund": 1, "parked_on": "x" * 1001},
    ],
    ids=[
        "requeued",
        "discarded",
        "delivered-but-dead",
        "discarded-status",
        "refund-of-two",
        "expired-but-dead",
        "expired-but-pending",
        "parked-but-counted",
        "parked-but-dead",
        "parked-on-nothing",
        "parked-on-too-long-a-name",
    ],
)
def test_a_relay_records_only_its_own_kinds_of_outcome(roles: Roles, pg_engine, completion):
    """No forged requeue or discard (they hide a dead message from alerts and the purge), no large refund."""
    ob = _relay_ob()
    (mid,) = _emitted(pg_engine, ob)
    relay_engine = roles.engine("outbox_relay")
    Relay(ob, relay_engine, relay_id="r1").store.claim("default", ["r"], 1)
    batch = {"id": mid, "attempt": 1, "error": "x", "delay": 0, "refund": 0, "duration_ms": 1} | completion
    with (
        pytest.raises(DBAPIError, match="an outcome the relay cannot record"),
        relay_engine.connect() as conn,
    ):
        conn.execute(text("SELECT outbox_complete('r1', CAST(:b AS jsonb))"), {"b": json.dumps([batch])})
    with pg_engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.attempts).where(m.c.id == mid)).one() == ("running", 1)
    assert _history(pg_engine) == []


def test_a_late_outcome_is_recorded_once_and_a_resent_batch_appends_nothing(roles: Roles, pg_engine):
    """The attempt a recovered lease cut short did happen; a batch sent again after a lost reply did not."""
    ob = _relay_ob()
    first, second = _emitted(pg_engine, ob, 2)
    relay_engine = roles.engine("outbox_relay")
    slow = Relay(ob, relay_engine, relay_id="slow", lease=0.05)
    assert len(slow.store.claim("default", ["r"], 2)) == 2
    slow.store.complete([_done(second, 1)])
    slow.store.complete([_done(second, 1)])  # the reply was lost: sent again
    with pg_engine.connect() as conn:
        conn.execute(text("SELECT pg_sleep(0.1)"))
    rescuer = Relay(ob, relay_engine, relay_id="rescuer")
    (recovered,) = recover_expired(rescuer.store, {}, random.Random(1)).recovered
    assert recovered.row.id == first and not recovered.dead
    slow.store.complete([_done(first, 1)])  # late: recorded, but the message stays with its recovery
    slow.store.complete([_done(first, 1)])
    rows = [(h.message_id, h.attempt, h.outcome, h.relay_id) for h in _history(pg_engine)]
    assert rows == [
        (second, 1, "delivered", "slow"),
        (first, 1, "lease_expired", "slow"),
        (first, 1, "delivered", "slow"),
    ]
    late, expired = _history(pg_engine)[2], _history(pg_engine)[1]
    assert expired.started_at <= late.started_at <= late.finished_at  # held to the claim it reports on
    with pg_engine.connect() as conn:
        assert conn.execute(select(m.c.status).where(m.c.id == first)).scalar_one() == "pending"


def test_recovery_takes_back_only_expired_leases_and_the_last_attempt_goes_dead(roles: Roles, pg_engine):
    ob = Outbox()
    ob.route("e", lambda msg: None, name="r", max_attempts=1)
    (mid,) = _emitted(pg_engine, ob)
    relay_engine = roles.engine("outbox_relay")
    Relay(ob, relay_engine, relay_id="holder", lease=30).store.claim("default", ["r"], 1)
    decisions = json.dumps([{"id": mid, "attempt": 1, "dead": False, "delay": 0, "note": None}])
    with relay_engine.connect() as conn:  # the lease has 30 s to run: nothing is taken back
        assert (
            conn.execute(text("SELECT * FROM outbox_recover('x', CAST(:d AS jsonb))"), {"d": decisions}).all()
            == []
        )
    with pg_engine.begin() as conn:
        conn.execute(m.update().values(locked_until=func.now() - timedelta(seconds=1)))
    with relay_engine.begin() as conn:  # "not dead", says the caller; it was the last attempt
        (row,) = conn.execute(
            text("SELECT * FROM outbox_recover('x', CAST(:d AS jsonb))"), {"d": decisions}
        ).all()
    assert row.dead
    with pg_engine.connect() as conn:
        assert conn.execute(select(m.c.status).where(m.c.id == mid)).scalar_one() == "dead"
    (history,) = _history(pg_engine)
    assert (history.outcome, history.relay_id, history.detail["recovered_by"]) == (
        "lease_expired",
        "holder",
        "x",
    )


def test_a_relay_on_a_database_before_outbox_0015_says_to_migrate(pg_engine):
    with pg_engine.begin() as conn:
        for function in (
            "outbox_claim",
            "outbox_complete",
            "outbox_extend",
            "outbox_release",
            "outbox_recover",
        ):
            conn.execute(text(f"DROP FUNCTION {function}"))
    with pytest.raises(
        outbox.OutboxError, match=r"older than this relay \(no outbox_claim\).*outbox migrate"
    ):
        Relay(_relay_ob(), pg_engine).run_until_idle()


def test_a_relay_login_without_the_grants_is_refused_at_start_naming_them(roles: Roles, pg_engine):
    with pg_engine.begin() as conn:
        relay = roles.names["outbox_relay"]
        conn.execute(text(f'REVOKE EXECUTE ON FUNCTION outbox_complete(text, jsonb) FROM "{relay}"'))
    with pytest.raises(
        outbox.OutboxError, match=r"may not execute outbox_complete: run the GRANT statements"
    ):
        Relay(_relay_ob(), roles.engine("outbox_relay")).run_until_idle()


def _expiring_emitted(app_engine: Engine, ob: Outbox, *expiries: datetime | None) -> None:
    """One message per expiry, emitted over ``app_engine`` (None: the route's expires_after alone)."""
    maker = sessionmaker(app_engine)
    ob.install(maker)
    try:
        with maker.begin() as session:
            for n, expires_at in enumerate(expiries):
                emit(session, "e", {"n": n}, expires_at=expires_at)
    finally:
        ob.uninstall(maker)


def test_the_relay_login_records_an_expiry_only_for_a_message_the_database_sees_expired(
    roles: Roles, pg_engine
):
    """``expired`` discards a message: the relay's word is not enough for one that is still due."""
    ob = Outbox()
    ob.route("e", lambda msg: None, name="r", expires_after=timedelta(hours=1))
    plain = Outbox()
    plain.route("e", lambda msg: None, name="r")
    _expiring_emitted(roles.engine("outbox_app"), ob, None)  # expires in an hour
    _expiring_emitted(roles.engine("outbox_app"), plain, None)  # never expires
    due, never = (r.id for r in _messages(pg_engine))
    relay_engine = roles.engine("outbox_relay")
    relay = Relay(ob, relay_engine, relay_id="r1")
    assert len(relay.store.claim("default", ["r"], 2)) == 2
    for mid in (due, never):
        batch = [{"id": mid, "attempt": 1, "status": "discarded", "outcome": "expired", "refund": 0}]
        with (
            pytest.raises(DBAPIError, match=f"message {mid} has not expired"),
            relay_engine.connect() as conn,
        ):
            conn.execute(text("SELECT outbox_complete('r1', CAST(:b AS jsonb))"), {"b": json.dumps(batch)})
    with pg_engine.connect() as conn:
        assert set(conn.execute(select(m.c.status)).scalars()) == {"running"}
    assert _history(pg_engine) == []

    with pg_engine.begin() as conn:  # its hour is up
        conn.execute(m.update().where(m.c.id == due).values(expires_at=func.now() - timedelta(seconds=1)))
    relay.store.complete([_done(due, 1, outcome="expired", status="discarded", error="too late")])
    with pg_engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.last_error).where(m.c.id == due)).one() == (
            "discarded",
            "too late",
        )
    (row,) = _history(pg_engine)
    assert (row.message_id, row.outcome, row.relay_id, row.detail["db_user"]) == (
        due,
        "expired",
        "r1",
        roles.names["outbox_relay"],
    )


def _messages(pg_engine: Engine) -> list:
    with pg_engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def test_expiry_over_the_guides_logins_end_to_end(roles: Roles, pg_engine):
    """The application writes expires_at with its column grant; the relay expires what is due."""
    delivered: list[int] = []
    ob = Outbox()
    ob.route("e", lambda msg: delivered.append(msg.payload["n"]), name="r")
    soon = datetime.now(UTC) + timedelta(milliseconds=300)
    _expiring_emitted(roles.engine("outbox_app"), ob, soon, datetime.now(UTC) + timedelta(hours=1), None)
    with pg_engine.connect() as conn:
        while conn.execute(select(func.now())).scalar_one() <= soon:
            conn.execute(text("SELECT pg_sleep(0.05)"))
            conn.rollback()
    result = Relay(ob, roles.engine("outbox_relay")).run_until_idle()
    assert (result.delivered, result.expired) == (2, 1)
    assert sorted(delivered) == [1, 2]
    with pg_engine.connect() as conn:
        states = conn.execute(select(m.c.status, m.c.expires_at).order_by(m.c.id)).all()
    assert [s for s, _ in states] == ["discarded", "delivered", "delivered"]
    assert states[0][1] == soon and states[2][1] is None


def test_the_relay_login_parks_messages_and_releases_them_through_outbox_unpark(roles: Roles, pg_engine):
    """A parked deferral is recorded on the message; ``outbox_unpark`` makes every one on it due at once."""
    from outbox._parking import unpark

    ob = _relay_ob()
    first, second, other = _emitted(pg_engine, ob, 3)
    relay_engine = roles.engine("outbox_relay")
    relay = Relay(ob, relay_engine, relay_id="r1")
    assert len(relay.store.claim("default", ["r"], 3)) == 3
    broker = "amqp://rabbit:5672/"

    def parked(mid: int, destination: str) -> Completion:
        return _done(
            mid, 1, outcome="retry", status="pending", retry_in=60, refund=True, parked_on=destination
        )

    relay.store.complete([parked(first, broker), parked(second, broker), parked(other, "nats://n:4222")])
    with pg_engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(m.c.id, m.c.parked_on, m.c.attempts, m.c.available_at))}
        now = conn.scalar(select(func.now()))
    assert {i: (r.parked_on, r.attempts) for i, r in rows.items()} == {
        first: (broker, 0),
        second: (broker, 0),
        other: ("nats://n:4222", 0),
    }
    assert all(r.available_at > now + timedelta(seconds=50) for r in rows.values())

    with relay_engine.begin() as conn:
        assert unpark(conn, broker) == 2
        assert unpark(conn, broker) == 0  # nothing is parked on it any more
    with pg_engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(m.c.id, m.c.parked_on, m.c.available_at))}
        now = conn.scalar(select(func.now()))
    assert rows[first].parked_on is None and rows[first].available_at <= now
    assert rows[second].parked_on is None and rows[second].available_at <= now
    assert rows[other].parked_on == "nats://n:4222" and rows[other].available_at > now  # another destination

    # Claimed again and delivered, the message keeps no trace of the parking but its history.
    assert {r.id for r in relay.store.claim("default", ["r"], 3)} == {first, second}
    relay.store.complete([_done(first, 1), parked(second, broker)])
    with pg_engine.connect() as conn:
        states = {
            r.id: (r.status, r.parked_on) for r in conn.execute(select(m.c.id, m.c.status, m.c.parked_on))
        }
    assert states[first] == ("delivered", None) and states[second] == ("pending", broker)
    refused(roles.engine("outbox_app"), "SELECT outbox_unpark('amqp://rabbit:5672/')")
    with (
        pytest.raises(DBAPIError, match="a destination of 1 to 1000 characters"),
        relay_engine.begin() as conn,
    ):
        unpark(conn, "")
