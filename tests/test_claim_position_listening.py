"""A listening relay keeps its claim positions, and hears of everything that lands behind them.

While a transaction holds back vacuum, a claim from the front of a queue steps
over the index entry of every row claimed since the hold began. A listening
relay therefore claims from its positions (relay/claim_position.py) and moves
them back on what it hears (the NOTIFY of migration outbox_0023, an operator's
action) and on what it does (a retry it wrote coming due, a grouped message it
finished). The relay tests below turn the periodic claim from the front off,
so each row they deliver was found through one of those, or never.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from invoices import Base, Invoice
from relayproc import wait_until
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_claim_position import Clock, rows

import outbox
from outbox import RetryLater, emit, ops
from outbox.relay import Relay
from outbox.relay.claim_position import (
    END,
    FRONT_SCAN_EVERY,
    FRONT_SCAN_MAX,
    ClaimPositions,
    named_position,
    of_schema,
)

m = outbox.outbox_message
NEVER = 3600.0


def held_positions() -> tuple[ClaimPositions, Clock]:
    clock = Clock()
    positions = ClaimPositions(clock)
    positions.hold(True)
    positions.claimed("q", None, rows((0, 10), (0, 11)), limit=5, seconds=0.001)  # the first: from the front
    return positions, clock


def test_a_listening_relay_keeps_its_position_after_a_short_claim_and_waits_at_the_end_after_an_empty_one():
    positions, _ = held_positions()
    assert positions.start("q") == (0, 10)
    positions.claimed("q", (0, 10), rows((0, 12)), limit=5, seconds=0.001)
    assert positions.start("q") == (0, 12)
    positions.claimed("q", (0, 12), [], limit=5, seconds=0.001)
    assert positions.start("q") == END  # nothing to claim until something is heard


def test_what_is_heard_or_done_moves_a_held_position_back_and_never_forward():
    positions, clock = held_positions()
    positions.claimed("q", (0, 10), [], limit=5, seconds=0.001)
    positions.lower("q", (0, 40))  # a commit's NOTIFY
    assert positions.start("q") == (0, 40)
    positions.lower("q", (0, 50))  # sorts after: no change
    assert positions.start("q") == (0, 40)
    positions.lower("q", (-3, 99))  # a higher priority sorts first
    assert positions.start("q") == (-3, 99)
    positions.claimed("q", (-3, 99), rows((0, 41)), limit=5, seconds=0.001)
    positions.due_at("q", (0, 7), 0.5)  # a retry this relay wrote
    assert positions.start("q") == (0, 41)
    clock.now += 0.5
    assert positions.start("q") == (0, 7)
    positions.rewind()  # an operator's action, a release, a recovered lease
    assert positions.start("q") is None


def test_what_is_heard_while_a_claim_runs_outlasts_that_claims_result():
    """A claim's snapshot may predate a commit heard meanwhile: it must not wait at the end past it."""
    positions, _ = held_positions()
    start = positions.start("q")
    positions.lower("q", (0, 30))  # heard while the claim ran; sorts after its start
    positions.claimed("q", start, [], limit=5, seconds=0.001)  # found nothing: its snapshot missed it
    assert positions.start("q") == (0, 30)
    start = positions.start("q")
    positions.lower("q", (0, 25))  # an id taken early, heard while a claim takes later rows
    positions.claimed("q", start, rows((0, 30), (0, 31)), limit=5, seconds=0.001)
    assert positions.start("q") == (0, 25)
    start = positions.start("q")
    positions.rewind()  # an operator's action, heard while the claim ran
    positions.claimed("q", start, rows((0, 32)), limit=5, seconds=0.001)
    assert positions.start("q") is None
    positions.claimed("q", None, rows((0, 40)), limit=5, seconds=0.001)
    assert positions.start("q") == (0, 40)  # heard before the claim began: already in its start


def test_a_relay_that_stops_listening_forgets_its_positions_and_its_retries():
    positions, clock = held_positions()
    positions.due_at("q", (0, 3), 0.1)
    positions.hold(False)
    assert positions.start("q") is None
    positions.claimed("q", None, rows((0, 20)), limit=5, seconds=0.001)  # short, not listening
    clock.now += 1
    assert positions.start("q") is None  # the forgotten retry moved nothing


def test_a_listening_relay_looks_behind_its_position_spaced_by_the_looks_cost():
    positions, clock = held_positions()
    assert positions.sweep_due("q") is None  # the claim from the front just ran
    clock.now += FRONT_SCAN_EVERY
    assert positions.start("q") == (0, 10)  # the claims keep their position...
    assert positions.sweep_due("q") == (0, 10)  # ...and a look behind it is due
    positions.swept("q", seconds=0.03)  # a held transaction: 30 ms
    clock.now += 2.9
    assert positions.sweep_due("q") is None  # a hundred times its cost apart
    clock.now += 0.1
    assert positions.sweep_due("q") == (0, 10)
    positions.swept("q", seconds=5.0)
    clock.now += FRONT_SCAN_MAX - 0.01
    assert positions.sweep_due("q") is None
    clock.now += 0.01
    assert positions.sweep_due("q") == (0, 10)  # never longer apart than FRONT_SCAN_MAX
    positions.rewind()
    assert positions.sweep_due("q") is None  # the next claim is from the front anyway
    assert positions.start("q") is None


def test_a_relay_that_does_not_listen_claims_from_the_front_instead_of_looking_behind():
    clock = Clock()
    positions = ClaimPositions(clock)
    positions.claimed("q", None, rows((0, 1), (0, 2)), limit=2, seconds=0.03)  # a backlog
    clock.now += 2.9
    assert positions.start("q") == (0, 1)
    assert positions.sweep_due("q") is None
    clock.now += 0.1
    assert positions.start("q") is None


def test_a_payload_counts_only_for_the_schema_it_names():
    """Outboxes in several schemas of one database share the NOTIFY channel."""
    assert of_schema("public 0 12 default", "public") == "0 12 default"
    assert of_schema("public", "public") == ""  # an operator's action: from the front
    assert of_schema("public released", "public") == "released"
    assert of_schema("released", "public") == ""  # from a relay before the schema was named
    assert of_schema("tenant_b 0 12 default", "public") is None
    assert of_schema("tenant_b", "public") is None
    assert of_schema("tenant_b released", "public") is None
    assert of_schema("public two 0 12 default", "public two") == "0 12 default"  # a name with a space
    assert of_schema("public 0 12 default", "public two") is None
    assert of_schema("tenant_b 0 12 default", None) == "0 12 default"  # schema not known: taken as ours
    assert named_position("0 12 default") == ("default", (0, 12))
    assert named_position("-5 12 a queue with spaces") == ("a queue with spaces", (-5, 12))
    assert named_position("released") is None
    assert named_position("") is None


# -- against PostgreSQL ----------------------------------------------------------------------


@pytest.fixture
def no_front_scans(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first claim from the front, the relay finds rows only through its positions.

    The relays below also never poll (``poll_interval=3600``): each claim round follows a
    wake-up, a NOTIFY, a written outcome or a retry's timer.
    """
    monkeypatch.setattr("outbox.relay.claim_position.FRONT_SCAN_EVERY", 3600.0)
    monkeypatch.setattr("outbox.relay.claim_position.FRONT_SCAN_MAX", 3600.0)


@pytest.fixture
def pg_maker(pg_engine: Engine, ob: outbox.Outbox) -> Iterator[sessionmaker[Session]]:
    factory = sessionmaker(pg_engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


class Serving:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.thread = threading.Thread(target=relay.run)

    def __enter__(self) -> Relay:
        self.thread.start()
        wait_until(lambda: self.relay.listening, "the relay to listen")
        return self.relay

    def __exit__(self, *exc: object) -> None:
        self.relay.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


def record_work(ob: outbox.Outbox, *, retry: tuple[str, float] | None = None) -> list[str]:
    """Route ``work``, which records each delivered message's ``n`` in the list it returns.

    ``retry`` (a name, a delay): that message asks for a retry after the delay on its first attempt.
    """
    delivered: list[str] = []

    @ob.handler("work", name="work")
    def work(msg):
        if retry is not None and msg.payload["n"] == retry[0] and msg.attempt == 1:
            raise RetryLater("not yet", delay=retry[1])
        delivered.append(msg.payload["n"])

    return delivered


def small_relay(ob: outbox.Outbox, engine: Engine, poll_interval: float) -> Relay:
    """A relay of a few delivery slots, so each test's handful of rows spans several claims."""
    return Relay(ob, engine, concurrency=4, batch_size=4, poll_interval=poll_interval)


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {
            name: status for name, status in conn.execute(select(m.c.payload["n"].as_string(), m.c.status))
        }


def test_a_transaction_that_took_its_id_early_is_claimed_when_its_commit_is_heard(
    pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session], no_front_scans: None
) -> None:
    delivered = record_work(ob)
    Base.metadata.create_all(pg_engine)
    late = pg_maker()
    late.begin()
    emit(late, "work", {"n": "late"})
    late.add(Invoice(number="1"))
    late.flush()  # writes the event too, as any flush of an emitting session does: its id now
    relay = small_relay(ob, pg_engine, NEVER)
    try:
        with Serving(relay):
            with pg_maker() as s, s.begin():
                for n in range(10):
                    emit(s, "work", {"n": str(n)})
            wait_until(lambda: len(delivered) == 10, "the committed rows to be delivered")
            late.commit()  # sorts before the relay's position
            wait_until(lambda: "late" in delivered, "the late commit to be claimed from its NOTIFY")
    finally:
        late.close()
    assert sorted(delivered) == sorted({*map(str, range(10)), "late"})
    with pg_engine.connect() as conn:
        ids = dict(conn.execute(select(m.c.payload["n"].as_string(), m.c.id)).all())
    assert ids["late"] < ids["0"]


def test_a_retry_coming_due_and_a_groups_next_message_are_claimed_by_the_relay_that_wrote_them(
    pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session], no_front_scans: None
) -> None:
    order = record_work(ob, retry=("retried", 0.3))
    relay = small_relay(ob, pg_engine, NEVER)
    with Serving(relay):
        with pg_maker() as s, s.begin():
            emit(s, "work", {"n": "retried"})
            for n in range(5):
                emit(s, "work", {"n": f"g{n}"}, group_key="g")
        with pg_maker() as s, s.begin():
            emit(s, "work", {"n": "after"})  # moves the position past all of them
        wait_until(lambda: len(order) == 7, "every message, the retry and the group's members included")
    assert [n for n in order if n.startswith("g")] == [f"g{n}" for n in range(5)]
    assert set(statuses(pg_engine).values()) == {"delivered"}


def test_a_row_the_claims_stepped_over_is_found_by_looking_behind_the_position(
    pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session]
) -> None:
    """A delayed message sorts before the position once a later row is claimed; no NOTIFY says it is due."""
    delivered = record_work(ob)
    relay = small_relay(ob, pg_engine, 0.2)
    with Serving(relay):
        with pg_maker() as s, s.begin():
            emit(s, "work", {"n": "delayed"}, delay=0.5)
        with pg_maker() as s, s.begin():
            emit(s, "work", {"n": "after"})
        wait_until(lambda: "delayed" in delivered, "the delayed message, found behind the position")
    assert delivered == ["after", "delayed"]
    assert statuses(pg_engine) == {"delayed": "delivered", "after": "delivered"}


def test_a_listening_relay_finds_a_queue_it_never_heard_of_beside_its_claims(
    pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session]
) -> None:
    """A queue named at emit time whose NOTIFY never came (triggers off, as a replica applies rows)."""
    delivered = record_work(ob)
    relay = small_relay(ob, pg_engine, 0.2)
    with Serving(relay):
        with pg_maker() as s, s.begin():
            s.execute(text("SET LOCAL session_replication_role = replica"))  # no trigger, no NOTIFY
            emit(s, "work", {"n": "unheard"}, queue="unheard")
        wait_until(lambda: delivered == ["unheard"], "the message of a queue found by discovery")
    assert statuses(pg_engine) == {"unheard": "delivered"}


class RetryBehind:
    """A listening relay, and a retry it wrote an hour away: behind its position once due.

    The route's handler asks for a retry of "waiting" in an hour on its first
    attempt; "after" is delivered next, so the relay's position moves past
    "waiting". ``pending()`` answers the retry's id while it waits.
    """

    def __init__(self, engine: Engine, ob: outbox.Outbox, maker: sessionmaker[Session]) -> None:
        self.engine = engine
        self.delivered = record_work(ob, retry=("waiting", 3600))
        self.maker = maker
        self.serving = Serving(small_relay(ob, engine, NEVER))

    def __enter__(self) -> int:
        self.serving.__enter__()
        for name in ("waiting", "after"):
            self.emit(name)
        wait_until(lambda: self.delivered == ["after"], "the second message")
        return wait_until(self.pending, "the first attempt's retry to be written")

    def __exit__(self, *exc: object) -> None:
        self.serving.__exit__(*exc)

    def emit(self, name: str) -> None:
        with self.maker() as s, s.begin():
            emit(s, "work", {"n": name})

    def pending(self) -> int | None:
        with self.engine.connect() as conn:
            named = m.c.payload["n"].as_string() == "waiting"
            row = conn.execute(select(m.c.id, m.c.status).where(named)).one()
        return row.id if row.status == "pending" else None


def test_an_operator_action_sends_a_listening_relay_back_to_the_front(
    pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session], no_front_scans: None
) -> None:
    retry = RetryBehind(pg_engine, ob, pg_maker)
    with retry as waiting:
        ops.retry_now(pg_engine, ops.MessageFilter(ids=(waiting,)), reason="partner is back", actor="ops")
        wait_until(lambda: "waiting" in retry.delivered, "the retried-now message, from the front")
    assert statuses(pg_engine) == {"waiting": "delivered", "after": "delivered"}


def test_a_commit_notifies_the_first_row_of_each_queue_it_wrote_once(
    pg_url: str, pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session]
) -> None:
    @ob.handler("work", name="work")
    def work(msg):
        pass

    Base.metadata.create_all(pg_engine)

    def flushed(s: Session, n: int) -> None:
        s.add(Invoice(number=str(n)))
        s.flush()  # the events emitted so far are written by this flush's statement

    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as listener:
        listener.execute("LISTEN outbox")
        with pg_maker() as s, s.begin():
            for n in range(3):  # three statements into one queue, at one priority: said once
                emit(s, "work", {"n": f"a{n}"}, queue="a")
                flushed(s, n)
            emit(s, "work", {"n": "b"}, queue="b")
            flushed(s, 3)
            emit(s, "work", {"n": "a4"}, queue="a")
            emit(s, "work", {"n": "a-urgent"}, queue="a", priority=-5)  # one statement, two priorities
        with pg_maker() as s, s.begin():
            emit(s, "work", {"n": "rolled back"}, queue="a")
            flushed(s, 4)
            s.rollback()
        heard = [n.payload for n in listener.notifies(timeout=1.0)]
    with pg_engine.connect() as conn:
        ids = dict(conn.execute(select(m.c.payload["n"].as_string(), m.c.id)).all())
    assert "rolled back" not in ids
    assert heard == [f"public 0 {ids['a0']} a", f"public 0 {ids['b']} b", f"public -5 {ids['a-urgent']} a"]


def test_a_release_at_shutdown_sends_listening_relays_to_the_front(
    pg_url: str, pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session]
) -> None:
    @ob.handler("work", name="work")
    def work(msg):
        pass

    with pg_maker() as s, s.begin():
        emit(s, "work", {"n": "x"})
    relay = Relay(ob, pg_engine)
    store = relay.store  # the relay's own calls of the database functions
    claimed = store.claim("default", ["work"], 1)
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as listener:
        listener.execute("LISTEN outbox")
        assert store.release([(row.id, row.attempts) for row in claimed]) == 1
        heard = [n.payload for n in listener.notifies(timeout=1.0)]
    assert heard == ["public released"]
    assert statuses(pg_engine) == {"x": "pending"}


def test_a_listening_relay_ignores_what_another_schemas_outbox_announces(
    pg_url: str, pg_engine: Engine, ob: outbox.Outbox, pg_maker: sessionmaker[Session], no_front_scans: None
) -> None:
    retry = RetryBehind(pg_engine, ob, pg_maker)
    with retry as waiting:
        with pg_engine.begin() as conn:  # due now, behind the relay's position, and nothing said
            conn.execute(m.update().where(m.c.id == waiting).values(available_at=m.c.created_at))
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as other:
            for payload in ("tenant_b", f"tenant_b 0 {waiting} default", "tenant_b released"):
                other.execute("SELECT pg_notify('outbox', %s)", (payload,))
        retry.emit("marker")  # heard after those: delivered once they were dealt with
        wait_until(lambda: "marker" in retry.delivered, "a commit of this schema")
        # Taken as this schema's, any of the three would have sent the claim that found "marker"
        # from the front or from "waiting", and claimed "waiting" with it.
        assert retry.pending() == waiting
        with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as ours:
            ours.execute("SELECT pg_notify('outbox', 'public')")  # as an operator's action says it
        wait_until(lambda: "waiting" in retry.delivered, "the due retry, from the front")
    assert statuses(pg_engine) == {"waiting": "delivered", "after": "delivered", "marker": "delivered"}
