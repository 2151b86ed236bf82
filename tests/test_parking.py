"""Parked messages through a real relay, on SQLite and PostgreSQL: recorded, shown, released on return.

A handler of the test's own parks its messages while its destination is
"off" (``RetryLater(until_recovered=...)``) and reports the return through
the board the relay hands it, as the docs' example in relay.md does; the
shipped handlers' outages run against real servers in ``test_outages.py``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from relayproc import wait_until
from sqlalchemy import select
from test_ops_cli import ok, ok_json, run
from test_relay_registry import Serving

import outbox
from outbox import Message, RetryLater, emit, ops
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt

DESTINATION = "printer://warehouse-1"


class Printer:
    """Off until switched on; parks what it cannot print and reports its return to the relay's board."""

    def __init__(self) -> None:
        self.online = False
        self.board: Any = None
        self.printed: list[int] = []

    def outbox_share_breakers(self, board: Any) -> None:
        self.board = board

    def switched_on(self) -> None:
        self.online = True
        self.board.recovered(DESTINATION)

    def __call__(self, msg: Message) -> None:
        if not self.online:
            raise RetryLater("the printer is off", until_recovered=DESTINATION)
        self.printed.append(msg.payload["n"])


def rows(engine: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def test_a_parked_message_waits_uncounted_and_goes_the_moment_its_destination_is_back(
    engine, ob, maker, database_url
):
    printer = Printer()
    ob.route("label.due", printer, name="labels", max_attempts=1)  # a counted deferral would kill it
    with maker.begin() as s:
        for n in range(3):
            emit(s, "label.due", {"n": n})
    serving = Serving(Relay(ob, engine, relay_id="parking", poll_interval=30))  # no poll would find them
    try:
        wait_until(lambda: all(r.parked_on == DESTINATION for r in rows(engine)), "three messages parked")
        parked = rows(engine)
        assert {(r.status, r.attempts) for r in parked} == {("pending", 0)}
        # Parked for a minute unless the destination comes back first.
        assert all(r.available_at - r.updated_at >= timedelta(seconds=59) for r in parked)
        with engine.connect() as conn:
            (deferral, *_) = conn.execute(select(a).order_by(a.c.id)).all()
        assert deferral.outcome == "retry"
        assert deferral.detail["parked_on"] == DESTINATION and deferral.detail["counted"] is False

        assert ops.stats(engine).parked == {DESTINATION: 3}
        assert ok_json(run("stats", "--json", database_url=database_url))["parked"] == {DESTINATION: 3}
        assert f"parked: 3 pending waiting for {DESTINATION} to recover" in ok(
            run("stats", database_url=database_url)
        )
        shown = ok(run("show", str(parked[0].id), database_url=database_url))
        assert shown.startswith(f"waiting for {DESTINATION} to recover (due at ")

        printer.switched_on()  # on the test's thread, as a device driver's callback would be
        wait_until(lambda: sorted(printer.printed) == [0, 1, 2], "everything printed", timeout=10)
    finally:
        serving.stop()
    done = rows(engine)
    assert {(r.status, r.attempts, r.parked_on) for r in done} == {("delivered", 1, None)}
    assert ops.stats(engine).parked == {}


def test_outside_a_relay_a_parking_handler_waits_its_delay_and_nothing_is_lost(engine, ob, maker):
    """No board, no news: the safety delay alone brings a parked message back."""
    printer = Printer()
    ob.route("label.due", printer, name="labels")
    with maker.begin() as s:
        emit(s, "label.due", {"n": 7})
    Relay(ob, engine).run_until_idle()
    (row,) = rows(engine)
    assert (row.status, row.attempts, row.parked_on) == ("pending", 0, DESTINATION)
    printer.online = True
    with engine.begin() as conn:  # the minute has passed
        conn.execute(m.update().values(available_at=m.c.updated_at))
    Relay(ob, engine).run_until_idle()
    (row,) = rows(engine)
    assert (row.status, row.parked_on) == ("delivered", None) and printer.printed == [7]


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"until_recovered": ""}, "must name a destination"),
        ({"until_recovered": "x" * 1001}, "at most 1000 characters"),
        ({"until_recovered": "amqp://b/", "counts_as_attempt": True}, "never counts as an attempt"),
    ],
)
def test_a_parking_deferral_is_checked_where_it_is_raised(options, problem):
    with pytest.raises(ValueError, match=problem):
        RetryLater("away", **options)


def test_a_parking_deferral_waits_a_minute_unless_told_otherwise_and_never_counts():
    parked = RetryLater("away", until_recovered="amqp://b:5672/")
    assert (parked.delay, parked.counts_as_attempt, parked.until_recovered) == (60.0, False, "amqp://b:5672/")
    assert RetryLater("away", until_recovered="x", delay=5).delay == 5
    assert RetryLater("flaky").counts_as_attempt is True
    assert RetryLater("busy", counts_as_attempt=False).counts_as_attempt is False
