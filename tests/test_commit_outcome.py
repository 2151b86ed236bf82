"""What ``commit()`` says is what PostgreSQL did, when the connection dies around the COMMIT.

An application that retries a request whose commit raised must be able to
trust that exception: a commit that raised after PostgreSQL had committed
would make it repeat its business change and emit its events twice. So the
backend of an emitting session is terminated (``pg_terminate_backend`` from a
second connection) at a random moment around its COMMIT, round after round,
and what each ``commit()`` said is compared with what was stored: the business
row and the event row, both or neither, and stored exactly when ``commit()``
returned.

``pg_terminate_backend`` leaves no case unknown here: PostgreSQL holds the
signal while it commits and sends the COMMIT's answer before it exits, so an
answer always arrives for a COMMIT the server ran. (The one case that stays
unknown, a COMMIT whose answer never arrives, is pinned in
``test_commit_connection_cut.py``.)

Each write path is run: the commit's INSERT sent through psycopg's pipeline
(the first commits on a connection), the same sent straight through libpq once
psycopg has prepared it, and ``pipeline_writes=False``, where psycopg's own
``commit()`` sends the COMMIT. Async engines never pipeline (their path is the
last one). ``OUTBOX_COMMIT_FAULT_ROUNDS`` sets the rounds per path (100 by
default, a few seconds).
"""

from __future__ import annotations

import logging
import os
import random
import select as io_select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from invoices import Base, Invoice, m
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, emit
from outbox._write import pipeline as _pipeline

ROUNDS = int(os.environ.get("OUTBOX_COMMIT_FAULT_ROUNDS", "100"))

PATHS = ["pipelined, first commit", "pipelined, prepared", "plain"]


#: The killer: a process of its own, so that it never waits for this one's GIL to strike.
KILLER = """
import sys, time
import psycopg

conn = psycopg.connect(sys.argv[1], autocommit=True)
for line in sys.stdin:
    pid, delay = line.split()
    time.sleep(float(delay))
    conn.execute("SELECT pg_terminate_backend(%s)", (int(pid),))
    while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (int(pid),)).fetchone():
        time.sleep(0.0005)
    print("gone", flush=True)
"""


class Killer:
    """Terminates a given backend after a given delay, from a process and a connection of its own."""

    def __init__(self, url: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", KILLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def kill(self, pid: int, delay: float) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(f"{pid} {delay:.6f}\n")
        self._process.stdin.flush()

    def wait(self) -> None:
        """Until the backend of the last ``kill`` has exited."""
        assert self._process.stdout is not None
        ready, _, _ = io_select.select([self._process.stdout], [], [], 30)
        assert ready and self._process.stdout.readline() == "gone\n", "the killer process failed"

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=30)


@dataclass
class Run:
    said: dict[int, str] = field(default_factory=dict)
    #: Connections the pool handed out although the client knew they were lost.
    dead_checkouts: int = 0
    #: Rounds whose connection died idle after a commit had returned (their next use fails: retried).
    killed_idle: int = 0
    #: How each commit's INSERT went out: psycopg's Pipeline or straight through libpq.
    sent: Counter[str] = field(default_factory=Counter)
    sent_by_round: Counter[str] = field(default_factory=Counter)


@pytest.fixture
def killer(pg_url: str) -> Iterator[Killer]:
    k = Killer(make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False))
    yield k
    k.close()


def backend_pid(session: Session) -> int:
    """Asked of the server: a connection killed while idle in the pool fails here, not in the commit."""
    return session.execute(text("SELECT pg_backend_pid()")).scalar_one()


def counting(cls: type, name: str, counter: Counter[str]) -> object:
    def make(*args: object) -> object:
        counter[name] += 1
        return cls(*args)

    return make


def commit_duration(factory: sessionmaker[Session], rounds: int = 15) -> float:
    """The median time an undisturbed emitting commit takes here."""
    times = []
    for number in range(rounds):
        with factory() as s:
            s.add(Invoice(number=f"timing {number}"))
            emit(s, "invoice.issued", {"number": -1})
            started = time.perf_counter()
            s.commit()
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def run_rounds(
    run: Run,
    factory: sessionmaker[Session],
    engine: Engine,
    killer: Killer,
    *,
    path: str,
    rounds: int,
    seed: int,
) -> None:
    """Commit ``rounds`` emitting transactions, each with a kill sent as its ``commit()`` starts.

    The kill's delay follows the COMMIT: it grows after a kill that came too
    early (the commit raised) and shrinks after one that came too late (the
    connection died idle, after the commit returned), so the kills keep
    landing around the COMMIT whatever this machine's speed; each delay is
    spread at random around that point.
    """

    @event.listens_for(engine, "checkout")
    def never_a_known_dead_one(dbapi_connection, record, proxy):  # type: ignore[no-untyped-def]
        if dbapi_connection.closed:
            run.dead_checkouts += 1

    rng = random.Random(seed)
    aim = commit_duration(factory)
    engine.dispose()  # the rounds start on fresh connections
    warmed: set[int] = set()
    number = 0
    try:
        while number < rounds:
            s = factory()
            try:
                pid = backend_pid(s)
                if path == "pipelined, prepared" and pid not in warmed:
                    # With prepare_threshold=0, psycopg prepares the INSERT at its first run:
                    # the next emitting commit on this connection is sent straight through libpq.
                    s.add(Invoice(number=f"warm-up {number}"))
                    emit(s, "invoice.issued", {"number": -1})
                    s.commit()
                    warmed.add(pid)
                s.add(Invoice(number=str(number)))
                if rng.random() < 0.5:
                    s.flush()  # else the commit's own flush writes the business row
                emit(s, "invoice.issued", {"number": number})
            except DBAPIError as exc:
                # Killed idle after the last round's commit had returned: the aim was late.
                assert exc.connection_invalidated
                run.killed_idle += 1
                aim /= 1.1
                s.close()
                continue
            run.sent.clear()  # the warm-up's does not count
            killer.kill(pid, aim * rng.uniform(0.5, 1.5))
            try:
                s.commit()
                run.said[number] = "committed"
            except DBAPIError:
                run.said[number] = "raised"
                aim *= 1.1
            finally:
                s.close()
            killer.wait()
            run.sent_by_round.update(run.sent.keys())
            number += 1
    finally:
        event.remove(engine, "checkout", never_a_known_dead_one)


@pytest.mark.parametrize("path", PATHS)
def test_commit_says_what_was_stored_when_the_backend_is_killed_around_the_commit(
    pg_url, killer, path, caplog, monkeypatch
):
    run = Run()
    for name in ("DirectBatch", "_PsycopgBatch"):
        monkeypatch.setattr(_pipeline, name, counting(getattr(_pipeline, name), name, run.sent))
    connect_args = {"prepare_threshold": 0} if path == "pipelined, prepared" else {}
    # No pool_pre_ping: a connection the commit found dead must be replaced by the pool itself.
    engine = create_engine(pg_url, connect_args=connect_args)
    Base.metadata.create_all(engine)
    ob = Outbox(pipeline_writes=path != "plain")
    ob.route("invoice.issued", lambda message: None, name="mail")
    factory = sessionmaker(engine)
    ob.install(factory)
    seed = random.randrange(2**32)
    caplog.set_level(logging.WARNING)
    try:
        run_rounds(run, factory, engine, killer, path=path, rounds=ROUNDS, seed=seed)
    finally:
        ob.uninstall(factory)
    engine.dispose()  # the last round's connection may have been killed idle
    with engine.connect() as conn:
        invoices = {
            int(n)
            for n in conn.execute(text("SELECT number FROM invoices WHERE number ~ '^[0-9]+$'")).scalars()
        }
        events = {
            n
            for n in conn.execute(select(m.c.payload["number"].as_integer())).scalars()
            if n is not None and n >= 0
        }
    engine.dispose()

    outcomes = Counter((said, n in invoices, n in events) for n, said in run.said.items())
    lost_after_commit = [r for r in caplog.records if getattr(r, "action", None) == "commit_connection_lost"]
    print(
        f"{path}, seed {seed}: {dict(outcomes)}; the connection lost after a confirmed COMMIT: "
        f"{len(lost_after_commit)}; killed idle after a commit: {run.killed_idle}"
    )
    assert set(outcomes) <= {("committed", True, True), ("raised", False, False)}, (seed, outcomes)
    assert outcomes[("committed", True, True)] > 0 and outcomes[("raised", False, False)] > 0, (
        seed,
        outcomes,
    )
    assert run.dead_checkouts == 0
    # The pool never had to reset a dead connection (that logs an error with a traceback).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], seed
    expected_sends = {"plain": set(), "pipelined, first commit": {"_PsycopgBatch"}}
    assert set(run.sent_by_round) == expected_sends.get(path, {"DirectBatch"})
    if path == "plain":
        assert lost_after_commit == []
