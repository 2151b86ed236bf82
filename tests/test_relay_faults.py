"""Relay processes under real faults on real PostgreSQL: SIGKILL, competing relays, killed connections,
a server restart, LISTEN wake-ups, SIGTERM with work in flight, a poison message.

Every relay here is a real ``outbox-relay`` subprocess serving ``tests/apps/counting_app.py``,
whose handler records each delivery in ``delivery_log`` in its own transaction, so "nothing lost,
nothing twice" is checked against side effects, not only against the outbox's own bookkeeping.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pgcluster
import pytest
from relayproc import APPS, RelayProcess, wait_until
from sqlalchemy import create_engine, func, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from stamped import as_reported

import outbox
from outbox import emit

sys.path.insert(0, str(APPS))
import counting_app  # noqa: E402  (tests/apps is what the relay subprocesses import it from, too)

m = outbox.outbox_message
a = outbox.outbox_attempt
log_table = counting_app.delivery_log

Spawn = Callable[..., RelayProcess]


class Emitter:
    """Commits ``count.me`` events through the same Outbox the relay processes serve."""

    def __init__(self, engine: Engine) -> None:
        self.factory = sessionmaker(engine)
        counting_app.ob.install(self.factory)

    def __call__(self, count: int, *, event: str = counting_app.EVENT, **payload: Any) -> None:
        with self.factory() as s, s.begin():
            for n in range(count):
                emit(s, event, {"n": n, **payload})

    def close(self) -> None:
        counting_app.ob.uninstall(self.factory)


@pytest.fixture
def emitter(pg_engine: Engine) -> Iterator[Emitter]:
    log_table.create(pg_engine)
    emitter = Emitter(pg_engine)
    yield emitter
    emitter.close()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start relay subprocesses; every one still running at teardown is killed."""
    started: list[RelayProcess] = []

    def start(url: str, *args: str, **env: str) -> RelayProcess:
        relay = RelayProcess(url, args, log_path=tmp_path / f"relay-{len(started)}.log", env=env)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.kill()


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(dict(conn.execute(select(m.c.status, func.count()).group_by(m.c.status)).all()))


def all_delivered(engine: Engine, total: int) -> Callable[[], bool]:
    return lambda: statuses(engine) == Counter(delivered=total)


def deliveries(engine: Engine) -> Counter[int]:
    """Side effects per message id, from the handler's own table."""
    with engine.connect() as conn:
        return Counter(mid for (mid,) in conn.execute(select(log_table.c.message_id)))


def message_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(select(m.c.id)).scalars())


def running_for(engine: Engine, relay_id: str) -> set[int]:
    with engine.connect() as conn:
        query = select(m.c.id).where(m.c.status == "running", m.c.locked_by == relay_id)
        return set(conn.execute(query).scalars())


def history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def listening_backends(engine: Engine) -> set[int]:
    """Backend pids of relay LISTEN connections on this database that have run their LISTEN."""
    query = text(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'outbox-relay listen' AND query LIKE 'LISTEN%'"
    )
    with engine.connect() as conn:
        return set(conn.execute(query).scalars())


def claim_failures(relay: RelayProcess) -> int:
    """The serve loop's consecutive failed claims so far (its back-off counter)."""
    return max(
        (r.get("failures", 0) for r in relay.actions("db_error") if "claim" in r["message"]), default=0
    )


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exactly(count: int, found: set[int]) -> set[int] | None:
    return found if len(found) == count else None


def started_markers(directory: Path) -> set[int]:
    return {int(p.name) for p in directory.iterdir()}


# -- crashes and leases -------------------------------------------------------------------------------


def test_sigkilled_relays_claims_come_back_after_the_lease_and_a_second_relay_delivers_all(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    started = tmp_path / "started"
    started.mkdir()
    emitter(20)
    victim = spawn(
        pg_url,
        *("--relay-id", "victim", "--concurrency", "5", "--lease", "1", "--poll-interval", "0.2"),
        COUNTING_SLEEP="60",
        COUNTING_STARTED_DIR=str(started),
    )
    held = wait_until(
        lambda: exactly(5, running_for(pg_engine, "victim")),
        "the victim to hold 5 running messages",
        relays=[victim],
    )
    wait_until(lambda: started_markers(started) == held, "their handlers to start", relays=[victim])

    victim.signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    assert running_for(pg_engine, "victim") == held, "a killed relay cannot release anything"

    rescuer = spawn(pg_url, "--relay-id", "rescuer", "--lease", "1", "--poll-interval", "0.2")
    wait_until(all_delivered(pg_engine, 20), "every message delivered", relays=[rescuer])

    assert deliveries(pg_engine) == Counter(dict.fromkeys(message_ids(pg_engine), 1))
    expired = [h for h in history(pg_engine) if h.outcome == "lease_expired"]
    assert {h.message_id for h in expired} == held
    assert {(h.relay_id, h.attempt, h.error_type) for h in expired} == {("victim", 1, "LeaseExpired")}
    assert all("victim" in h.error and h.detail["recovered_by"] == "rescuer" for h in expired)
    with pg_engine.connect() as conn:
        attempts = dict(conn.execute(select(m.c.id, m.c.attempts)).all())
    assert {attempts[i] for i in held} == {2} and set(attempts.values()) == {1, 2}
    assert {r["message_id"] for r in rescuer.actions("lease_expired")} == held


def test_live_relays_renew_their_leases_so_nothing_is_recovered(pg_engine, pg_url, emitter, spawn, tmp_path):
    """The control for the SIGKILL test: same setup, handlers outlast the lease, nobody is killed."""
    started = tmp_path / "started"
    started.mkdir()
    emitter(10)
    slow = spawn(
        pg_url,
        *("--relay-id", "slow", "--concurrency", "5", "--lease", "1", "--poll-interval", "0.2"),
        COUNTING_SLEEP="2.5",
        COUNTING_STARTED_DIR=str(started),
    )
    held = wait_until(
        lambda: exactly(5, running_for(pg_engine, "slow")),
        "the slow relay to hold 5 running messages",
        relays=[slow],
    )
    wait_until(lambda: started_markers(started) == held, "their handlers to start", relays=[slow])
    other = spawn(pg_url, "--relay-id", "other", "--lease", "1", "--poll-interval", "0.2")
    wait_until(all_delivered(pg_engine, 10), "every message delivered", relays=[slow, other])

    assert [h for h in history(pg_engine) if h.outcome != "delivered"] == []
    assert deliveries(pg_engine) == Counter(dict.fromkeys(message_ids(pg_engine), 1))
    with pg_engine.connect() as conn:
        by_slow = {
            r.message_id for r in conn.execute(select(log_table).where(log_table.c.relay_pid == slow.pid))
        }
    # The slow relay may take more once its first five are done, if the other one is slow to start.
    assert held <= by_slow, "2.5 s handlers under a 1 s lease: only renewals kept the claims"
    assert slow.actions("lease_expired") == other.actions("lease_expired") == []


def test_a_crashed_once_run_is_not_refunded_by_the_next_run_with_the_same_relay_id(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    """A stable --relay-id must not let a later run erase the attempt a killed run made.

    The killed run's claim leaves only through lease expiry, charged and recorded as lease_expired.
    """
    started = tmp_path / "started"
    started.mkdir()
    emitter(1)
    once = ("--once", "--relay-id", "nightly", "--lease", "8")
    crashed = spawn(pg_url, *once, COUNTING_SLEEP="60", COUNTING_STARTED_DIR=str(started))
    (held,) = wait_until(lambda: started_markers(started), "the handler to start", relays=[crashed])
    crashed.signal(signal.SIGKILL)
    assert crashed.wait(10) == -signal.SIGKILL

    again = spawn(pg_url, *once)  # well within the killed run's lease
    assert again.wait(30) == 0, again.tail()
    with pg_engine.connect() as conn:
        row = conn.execute(select(m)).one()
    assert (row.id, row.status, row.attempts, row.locked_by) == (held, "running", 1, "nightly"), (
        "the attempt the killed run made stays counted"
    )
    assert history(pg_engine) == [] and again.actions("release") == []

    wait_until(lambda: all_leases_lapsed(pg_engine), "the killed run's lease to run out")
    # Serving, not --once: the recovered message is due again only after its retry back-off.
    last = spawn(pg_url, "--relay-id", "nightly", "--lease", "8", "--poll-interval", "0.2")
    wait_until(
        lambda: statuses(pg_engine) == Counter(delivered=1), "the recovered message delivered", relays=[last]
    )
    last.signal(signal.SIGTERM)
    assert last.wait(15) == 0, last.tail()
    assert [(h.attempt, h.outcome, h.relay_id) for h in history(pg_engine)] == [
        (1, "lease_expired", "nightly"),
        (2, "delivered", "nightly"),
    ]
    assert deliveries(pg_engine) == Counter({held: 1})


def all_leases_lapsed(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                select(func.count()).where(m.c.status == "running", m.c.locked_until >= func.now())
            ).scalar_one()
            == 0
        )


# -- competing relays -------------------------------------------------------------------------------------


def test_three_relays_drain_5000_messages_each_delivered_exactly_once(pg_engine, pg_url, emitter, spawn):
    total = 5000
    # Each delivery of the counting app holds a connection of its own: at 6 in flight the three
    # relays need about 36 connections in all, leaving the server's 100 for tests running beside
    # this one (at 20 in flight they took 83).
    options = (
        "--concurrency",
        "6",
        "--batch-size",
        "100",
        "--poll-interval",
        "0.2",
        "--log-level",
        "WARNING",
    )
    relays = [spawn(pg_url, *options) for _ in range(3)]
    # All three listening first, so one commit wakes them together and they race for the same rows.
    wait_until(lambda: len(listening_backends(pg_engine)) == 3, "three LISTEN connections", relays=relays)
    emitter(total)
    wait_until(all_delivered(pg_engine, total), f"{total} messages delivered", timeout=90, relays=relays)

    with pg_engine.connect() as conn:
        per_message = Counter(
            dict(
                conn.execute(
                    select(log_table.c.message_id, func.count()).group_by(log_table.c.message_id)
                ).all()
            )
        )
        per_relay = dict(
            conn.execute(select(log_table.c.relay_pid, func.count()).group_by(log_table.c.relay_pid)).all()
        )
        outcomes = dict(conn.execute(select(a.c.outcome, func.count()).group_by(a.c.outcome)).all())
    assert len(per_message) == total and set(per_message.values()) == {1}
    assert per_message.keys() == message_ids(pg_engine)
    assert set(per_relay) == {r.pid for r in relays}, f"every relay should have taken a share: {per_relay}"
    assert outcomes == {"delivered": total}


# -- lost connections and server restarts --------------------------------------------------------------


def test_relay_recovers_when_all_its_connections_are_terminated(pg_engine, pg_url, emitter, spawn):
    # A 30 s poll: only the LISTEN reconnect (and its catch-up claim) can deliver within the test's waits.
    relay = spawn(pg_url, "--poll-interval", "30", "--lease", "5")
    first = wait_until(lambda: listening_backends(pg_engine), "the LISTEN connection", relays=[relay])
    emitter(10)
    wait_until(all_delivered(pg_engine, 10), "the first batch delivered", relays=[relay])

    pg_engine.dispose()  # the test's own pooled connections must not be among the victims
    with pg_engine.connect() as conn:
        killed = conn.execute(
            text(
                "SELECT application_name, pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).all()
        conn.commit()
    assert ("outbox-relay listen", True) in killed and len(killed) >= 3, killed
    emitter(10, batch="while reconnecting")  # its NOTIFY may reach nobody: the catch-up claim must find it

    wait_until(
        lambda: exactly(1, listening_backends(pg_engine) - first),
        "a new LISTEN connection",
        relays=[relay],
    )
    assert not listening_backends(pg_engine) & first
    emitter(10, batch="after reconnecting")
    wait_until(all_delivered(pg_engine, 30), "all 30 delivered", timeout=15, relays=[relay])

    assert relay.alive()
    assert deliveries(pg_engine) == Counter(dict.fromkeys(message_ids(pg_engine), 1))
    assert relay.actions("listen_retry"), relay.tail()
    assert any("listening again" in r["message"] for r in relay.actions("listen")), relay.tail()
    relay.signal(signal.SIGTERM)
    assert relay.wait(15) == 0


@pytest.mark.skipif(
    not pgcluster.available() or not Path("/proc/self/stat").exists(),
    reason="needs pg_ctl and initdb for a throwaway server, and /proc to measure CPU time",
)
def test_relay_rides_out_a_server_restart_without_exiting_or_spinning(spawn):
    cluster = pgcluster.Cluster()
    engine: Engine | None = None
    emitter: Emitter | None = None
    try:
        cluster.start()
        url = cluster.url
        outbox.upgrade(url)
        engine = create_engine(url, pool_pre_ping=True)
        log_table.create(engine)
        emitter = Emitter(engine)
        relay = spawn(url, "--poll-interval", "0.5", "--lease", "2")
        emitter(5)
        wait_until(all_delivered(engine, 5), "delivery before the outage", relays=[relay])

        engine.dispose()
        cpu_before = cpu_seconds(relay.pid)
        cluster.stop("fast")
        outage = time.monotonic()
        # Evidence, not a fixed sleep: four failed claims, backing off 0.25, 0.5, 1 s between them.
        wait_until(
            lambda: claim_failures(relay) >= 4 and relay.actions("listen_retry"),
            "the relay to notice the outage and back off",
            relays=[relay],
        )
        cluster.start()
        outage = time.monotonic() - outage
        cpu = cpu_seconds(relay.pid) - cpu_before

        emitter(5, batch="after restart")
        wait_until(all_delivered(engine, 10), "delivery after the restart", timeout=45, relays=[relay])
        assert relay.alive()
        assert deliveries(engine) == Counter(dict.fromkeys(message_ids(engine), 1))
        errors = relay.actions("db_error")
        # Backoff, not a busy loop: a handful of failures per second of outage at most.
        assert len(errors) < 50, f"{len(errors)} db_error lines over a {outage:.1f}s outage"
        assert cpu < 0.5 * outage, f"{cpu:.2f} CPU seconds over a {outage:.1f}s outage"
        relay.signal(signal.SIGTERM)
        assert relay.wait(15) == 0
    finally:
        if emitter is not None:
            emitter.close()
        if engine is not None:
            engine.dispose()
        cluster.destroy()


# -- wake-ups ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "no-listen"])
def test_a_commit_wakes_a_listening_relay_long_before_its_poll(pg_engine, pg_url, emitter, spawn, listen):
    emitter(1)  # delivered by the first claim round; after it the relay sleeps for its 30 s poll
    relay = spawn(pg_url, "--poll-interval", "30", *(() if listen else ("--no-listen",)))
    wait_until(all_delivered(pg_engine, 1), "the first claim round", relays=[relay])
    if listen:
        wait_until(lambda: listening_backends(pg_engine), "the LISTEN connection", relays=[relay])
    else:
        assert listening_backends(pg_engine) == set()

    committed = time.monotonic()
    emitter(1)
    if listen:
        wait_until(all_delivered(pg_engine, 2), "the NOTIFY wake-up", timeout=5, relays=[relay])
        assert time.monotonic() - committed < 5
    else:
        time.sleep(3)  # the assertion is that nothing happens for a while
        assert statuses(pg_engine) == Counter(delivered=1, pending=1)
    assert relay.alive()


# -- shutdown ------------------------------------------------------------------------------------------

_SLOW_CLAIM = """
CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(1.5);
    RETURN NEW;
END $$;
CREATE TRIGGER slow_claim BEFORE UPDATE ON outbox_message FOR EACH ROW
    WHEN (OLD.status = 'pending' AND NEW.status = 'running' AND NEW.payload ->> 'slow_claim' = 'yes')
    EXECUTE FUNCTION slow_claim();
"""


def test_sigterm_finishes_in_flight_work_and_releases_what_it_claimed_but_never_started(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    started = tmp_path / "started"
    started.mkdir()
    with pg_engine.begin() as conn:  # a slow claim query: the window between claiming and starting
        conn.execute(text(_SLOW_CLAIM))
    emitter(1)
    relay = spawn(
        pg_url,
        *("--concurrency", "3", "--grace-period", "20", "--relay-id", "graceful"),
        COUNTING_SLEEP="2.5",
        COUNTING_STARTED_DIR=str(started),
    )
    (in_flight,) = wait_until(lambda: started_markers(started), "the first handler to start", relays=[relay])
    emitter(2, slow_claim="yes")
    wait_until(
        lambda: running_for(pg_engine, "graceful") == {in_flight} and _claim_sleeping(pg_engine),
        "the relay's claim of the next two to be under way",
        relays=[relay],
    )

    relay.signal(signal.SIGTERM)
    assert relay.wait(20) == 0, relay.tail()

    with pg_engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(m))}
    assert rows[in_flight].status == "delivered"
    assert deliveries(pg_engine) == Counter({in_flight: 1})
    released = {
        (r.status, r.attempts, r.locked_by, r.locked_until) for i, r in rows.items() if i != in_flight
    }
    assert released == {("pending", 0, None, None)}, "claimed but unstarted: back, no attempt used"
    assert [(h.message_id, h.outcome) for h in history(pg_engine)] == [(in_flight, "delivered")]
    assert started_markers(started) == {in_flight}
    assert "released 2 unstarted message(s)" in [r["message"] for r in relay.actions("release")]


def _claim_sleeping(engine: Engine) -> bool:
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event = 'PgSleep' AND strpos(query, 'outbox_claim(') > 0"
    )
    with engine.connect() as conn:
        return bool(conn.execute(query).scalar())


def test_a_second_sigterm_during_the_grace_period_cancels_and_exits_promptly(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    started = tmp_path / "started"
    started.mkdir()
    emitter(1)
    relay = spawn(pg_url, "--grace-period", "60", COUNTING_SLEEP="25", COUNTING_STARTED_DIR=str(started))
    (in_flight,) = wait_until(lambda: started_markers(started), "the handler to start", relays=[relay])

    relay.signal(signal.SIGTERM)
    wait_until(lambda: relay.actions("drain"), "the relay to wait for its in-flight delivery", relays=[relay])
    assert relay.alive()
    second = time.monotonic()
    relay.signal(signal.SIGTERM)
    assert relay.wait(10) == 0, relay.tail()
    assert time.monotonic() - second < 5

    with pg_engine.connect() as conn:
        row = conn.execute(select(m)).one()
    assert (row.id, row.status, row.attempts, row.locked_by) == (in_flight, "pending", 1, None)
    assert [(h.outcome, h.error_type) for h in history(pg_engine)] == [("failed", "Cancelled")]
    assert deliveries(pg_engine) == Counter()
    assert relay.actions("cancel")


def test_shutdown_hands_back_unstarted_claims_at_once_and_a_rival_delivers_them_without_a_lost_attempt(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    """A lease shorter than the grace period: unstarted claims must not wait for the grace period to end.

    Held until then (and not renewed), they would expire under a rival relay, which would record
    ``lease_expired`` and charge an attempt for work that never ran.
    """
    started = tmp_path / "started"
    started.mkdir()
    gate = tmp_path / "gate"  # the in-flight delivery finishes only when the test creates it
    with pg_engine.begin() as conn:
        conn.execute(text(_SLOW_CLAIM))
    emitter(1)
    graceful = spawn(
        pg_url,
        # The lease outlasts the deliberately slow claim (2 x 1.5 s) and is far shorter than the grace.
        *("--concurrency", "3", "--lease", "5", "--grace-period", "30", "--relay-id", "graceful"),
        COUNTING_GATE=str(gate),
        COUNTING_STARTED_DIR=str(started),
    )
    (in_flight,) = wait_until(lambda: started_markers(started), "a handler to start", relays=[graceful])
    emitter(2, slow_claim="yes")
    wait_until(
        lambda: running_for(pg_engine, "graceful") == {in_flight} and _claim_sleeping(pg_engine),
        "the relay's claim of the next two to be under way",
        relays=[graceful],
    )

    graceful.signal(signal.SIGTERM)
    wait_until(lambda: graceful.actions("release"), "the unstarted claims handed back", relays=[graceful])
    assert "released 2 unstarted message(s)" in [r["message"] for r in graceful.actions("release")]
    with pg_engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(m))}
    released = set(rows) - {in_flight}
    assert {(rows[i].status, rows[i].attempts, rows[i].locked_by) for i in released} == {("pending", 0, None)}
    assert (rows[in_flight].status, rows[in_flight].locked_by) == ("running", "graceful")

    with pg_engine.begin() as conn:  # its work is done; a rival's 1 s lease must not start out lapsed
        conn.execute(text("DROP TRIGGER slow_claim ON outbox_message"))
    rival = spawn(pg_url, "--lease", "1", "--poll-interval", "0.2", "--relay-id", "rival")
    wait_until(
        lambda: released <= set(deliveries(pg_engine)), "the rival to deliver them", relays=[graceful, rival]
    )
    # Still shutting down, its delivery held at the gate: the hand-back did not wait for it.
    assert graceful.alive() and started_markers(started) == {in_flight}
    gate.touch()
    assert graceful.wait(30) == 0, graceful.tail()
    wait_until(all_delivered(pg_engine, 3), "the in-flight delivery recorded", relays=[rival])

    with pg_engine.connect() as conn:
        by_pid = dict(conn.execute(select(log_table.c.message_id, log_table.c.relay_pid)).all())
    assert by_pid == {in_flight: graceful.pid, **dict.fromkeys(released, rival.pid)}
    attempts = sorted((h.message_id, h.attempt, h.outcome, h.relay_id) for h in history(pg_engine))
    assert attempts == sorted(
        [(in_flight, 1, "delivered", "graceful"), *((i, 1, "delivered", "rival") for i in released)]
    ), "a released message's only history row is its delivery: no lease_expired, no attempt charged"
    assert rival.actions("lease_expired") == []


def test_a_forced_stop_on_the_last_attempt_makes_the_message_dead(
    pg_engine, pg_url, emitter, spawn, tmp_path
):
    started = tmp_path / "started"
    started.mkdir()
    emitter(2)
    with pg_engine.begin() as conn:
        last, spare = sorted(conn.execute(select(m.c.id)).scalars())
        # Two failures behind it already: the claim makes this its last attempt.
        conn.execute(update(m).where(m.c.id == last).values(attempts=counting_app.MAX_ATTEMPTS - 1))
    relay = spawn(
        pg_url,
        *("--concurrency", "2", "--grace-period", "60"),
        COUNTING_GATE=str(tmp_path / "never"),
        COUNTING_STARTED_DIR=str(started),
    )
    wait_until(lambda: started_markers(started) == {last, spare}, "both handlers to start", relays=[relay])

    relay.signal(signal.SIGTERM)
    wait_until(lambda: relay.actions("drain"), "the relay to wait for its deliveries", relays=[relay])
    relay.signal(signal.SIGTERM)
    assert relay.wait(15) == 0, relay.tail()

    with pg_engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(m))}
    tried = {h.message_id: h for h in history(pg_engine)}
    assert (rows[last].status, rows[last].attempts, rows[last].locked_by) == ("dead", 3, None)
    assert (tried[last].attempt, tried[last].outcome, tried[last].error_type) == (3, "dead", "Cancelled")
    assert tried[last].detail["exhausted"] is True
    # The control: cancelled with attempts to spare, a message is due again.
    assert (rows[spare].status, rows[spare].attempts, rows[spare].locked_by) == ("pending", 1, None)
    assert (tried[spare].attempt, tried[spare].outcome, tried[spare].error_type) == (1, "failed", "Cancelled")
    assert len(history(pg_engine)) == 2
    assert [r["message_id"] for r in relay.actions("dead")] == [last]
    assert deliveries(pg_engine) == Counter()


# -- poison --------------------------------------------------------------------------------------------


def test_a_poison_message_goes_dead_after_max_attempts_and_the_rest_are_delivered(
    pg_engine, pg_url, emitter, spawn
):
    emitter(10)
    emitter(1, poison=True)
    emitter(10)
    relay = spawn(pg_url, "--poll-interval", "0.2")
    wait_until(
        lambda: statuses(pg_engine) == Counter(delivered=20, dead=1),
        "20 delivered and 1 dead",
        relays=[relay],
    )

    with pg_engine.connect() as conn:
        (poison,) = conn.execute(select(m).where(m.c.status == "dead")).all()
    assert poison.payload["poison"] is True
    assert poison.attempts == counting_app.MAX_ATTEMPTS and "can never be delivered" in poison.last_error
    attempts = [h for h in history(pg_engine) if h.message_id == poison.id]
    assert [(h.attempt, h.outcome) for h in attempts] == [(1, "failed"), (2, "failed"), (3, "dead")]
    assert {h.error_type for h in attempts} == {"counting_app.Poisoned"}
    delivered = deliveries(pg_engine)
    assert poison.id not in delivered and len(delivered) == 20 and set(delivered.values()) == {1}
    assert [r["message_id"] for r in relay.actions("dead")] == [poison.id]
    assert relay.alive()


def test_outcomes_that_are_not_plain_json_or_text_are_stored_and_do_not_jam_the_writer(
    pg_engine, pg_url, emitter, spawn
):
    """Outcomes are written in batches: one unstorable detail or error must not hold back the rest."""
    relay = spawn(pg_url, "--poll-interval", "0.2", "--lease", "2")
    emitter(1, event=counting_app.AWKWARD_EVENT)
    emitter(1, event=counting_app.AWKWARD_EVENT, fail=True)
    emitter(1, event=counting_app.AWKWARD_EVENT, retry_never=True)
    emitter(5)
    wait_until(
        lambda: statuses(pg_engine) == Counter(delivered=6, dead=1, pending=1),
        "6 delivered, 1 dead, 1 waiting for its retry",
        relays=[relay],
    )
    emitter(5, batch="later")
    wait_until(
        lambda: statuses(pg_engine) == Counter(delivered=11, dead=1, pending=1),
        "the next batch too",
        relays=[relay],
    )

    with pg_engine.connect() as conn:
        rows = {(r.handler, r.status): r for r in conn.execute(select(m).where(m.c.handler == "awkward"))}
    attempts = {h.message_id: h for h in history(pg_engine)}
    assert [h.outcome for h in history(pg_engine)].count("lease_expired") == 0
    detail = attempts[rows["awkward", "delivered"].id].detail
    assert set(as_reported(detail) or {}) == {"accepted_at", "receipt", "score"}
    assert all(isinstance(v, str) for v in detail.values()), detail
    dead = rows["awkward", "dead"]
    assert "b'\\x00\x01\xff'" in dead.last_error and "\x00" not in attempts[dead.id].error
    later = rows["awkward", "pending"]
    assert attempts[later.id].outcome == "retry"
    assert later.available_at - later.updated_at > timedelta(days=300), "retry 'never': far off, not an error"
    assert relay.alive() and relay.actions("db_error") == []
