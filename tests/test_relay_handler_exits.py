"""A handler raising SystemExit, KeyboardInterrupt or another BaseException fails its attempt, not the relay.

A real ``outbox-relay`` subprocess serves ``tests/apps/fatal_app.py`` on SQLite and PostgreSQL:
while ordinary deliveries are held in flight, plain and async handlers raise what would end a
Python program. The process must stay up, record those attempts like any failure, deliver its
neighbours once each, and still stop cleanly on a real SIGINT.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable
from pathlib import Path

from relayproc import APPS, RelayProcess, wait_until
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import emit

sys.path.insert(0, str(APPS))
import fatal_app  # noqa: E402  (the module the relay subprocess serves)

m = outbox.outbox_message
a = outbox.outbox_attempt


def _emit(engine: Engine, event: str, count: int = 1) -> None:
    factory = sessionmaker(engine)
    fatal_app.ob.install(factory)
    try:
        with factory() as s, s.begin():
            for n in range(count):
                emit(s, event, {"n": n})
    finally:
        fatal_app.ob.uninstall(factory)


def _messages(engine: Engine, handlers: Iterable[str]) -> dict[int, tuple[str, str, int]]:
    with engine.connect() as conn:
        query = select(m.c.id, m.c.handler, m.c.status, m.c.attempts).where(m.c.handler.in_(handlers))
        rows = conn.execute(query)
        return {r.id: (r.handler, r.status, r.attempts) for r in rows}


def _history(engine: Engine) -> dict[int, list[tuple[int, str, str | None]]]:
    found: dict[int, list[tuple[int, str, str | None]]] = {}
    with engine.connect() as conn:
        for h in conn.execute(select(a).order_by(a.c.id)):
            found.setdefault(h.message_id, []).append((h.attempt, h.outcome, h.error_type))
    return found


def test_a_handler_raising_system_exit_or_keyboard_interrupt_fails_its_attempt_and_the_relay_serves_on(
    engine: Engine, database_url: str, tmp_path: Path
):
    neighbours_dir = tmp_path / "neighbours"
    neighbours_dir.mkdir()
    for event in fatal_app.NEIGHBOURS:
        _emit(engine, event, 3)
    relay = RelayProcess(
        database_url,
        # The last --app given wins over relayproc's default one.
        ["--app", "fatal_app:ob", "--concurrency", "20", "--poll-interval", "0.1"],
        log_path=tmp_path / "relay.log",
        env={"FATAL_NEIGHBOUR_DIR": str(neighbours_dir)},
    )
    try:
        wait_until(
            lambda: len(list(neighbours_dir.glob("started-*"))) == 6,
            "six neighbours in flight",
            relays=[relay],
        )
        for event in fatal_app.FATAL_ROUTES:
            _emit(engine, event)
        wait_until(
            lambda: {s for _, s, _ in _messages(engine, fatal_app.FATAL_ROUTES).values()} == {"dead"},
            "every fatal message to go dead",
            relays=[relay],
        )
        held = _messages(engine, fatal_app.NEIGHBOURS)
        assert {(s, n) for _, s, n in held.values()} == {("running", 1)}, "the neighbours are still in flight"

        (neighbours_dir / "go").touch()
        _emit(engine, "neighbour")  # and the relay still claims new work afterwards
        wait_until(
            lambda: {s for _, s, _ in _messages(engine, fatal_app.NEIGHBOURS).values()} == {"delivered"},
            "every neighbour to be delivered",
            relays=[relay],
        )
        assert relay.alive()
        relay.signal(signal.SIGINT)  # a real Ctrl-C still stops it, gracefully
        assert relay.wait(20) == 0, relay.tail()
    finally:
        relay.kill()

    history = _history(engine)
    fatal = _messages(engine, fatal_app.FATAL_ROUTES)
    assert len(fatal) == len(fatal_app.FATAL_ROUTES) == 6
    for message_id, (route, status, attempts) in fatal.items():
        raised = fatal_app.FATAL_ROUTES[route]
        assert (status, attempts) == ("dead", fatal_app.MAX_ATTEMPTS), route
        expected = [(1, "failed", raised), (2, "failed", raised), (3, "dead", raised)]
        assert history[message_id] == expected, route
    neighbours = _messages(engine, fatal_app.NEIGHBOURS)
    assert len(neighbours) == 7
    for message_id, (route, status, attempts) in neighbours.items():
        assert (status, attempts) == ("delivered", 1), route
        assert history[message_id] == [(1, "delivered", None)], "one attempt, no lease_expired"
    assert "Traceback" not in relay.text()
