"""Pausing and resuming a queue or a handler: relays hold its messages back, nothing is lost, all is recorded.

A real serving relay (``Relay.run()`` in a thread) must notice a pause without a restart while
other queues keep flowing, let a delivery already running finish, leave the held messages
exactly as they were, and claim them as soon as they are resumed (on PostgreSQL a NOTIFY wakes
it: its poll interval there is far longer than the test). The ``outbox`` command is run as a
subprocess, like an operator runs it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from relayproc import wait_until
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_ops_cli import assert_one_line_error, ok, ok_json, run

import outbox
from outbox import Message, Outbox, emit, ops
from outbox.relay import Relay

m = outbox.outbox_message
log = outbox.outbox_pause_log


@pytest.fixture
def ob() -> Outbox:
    return Outbox()


def emit_some(maker: sessionmaker[Session], event_type: str, *numbers: int) -> None:
    with maker() as s, s.begin():
        for n in numbers:
            emit(s, event_type, {"n": n})


def rows(engine: Engine, handler: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(m.c.id, m.c.status, m.c.attempts, m.c.available_at, m.c.payload)
                .where(m.c.handler == handler)
                .order_by(m.c.id)
            )
        )


def logged(engine: Engine) -> list[tuple[str, str, str, str, str]]:
    with engine.connect() as conn:
        return [
            (r.event, r.kind, r.name, r.actor, r.reason) for r in conn.execute(select(log).order_by(log.c.id))
        ]


def test_a_serving_relay_holds_a_paused_queue_back_while_others_flow_and_resume_delivers(engine, ob, maker):
    release_first = threading.Event()
    first_started = threading.Event()
    mailed: list[int] = []
    hooked: list[int] = []

    @ob.handler("mail", name="mailer", queue="mail")
    def mailer(msg: Message) -> None:
        if msg.payload["n"] == 0:
            first_started.set()
            assert release_first.wait(20)
        mailed.append(msg.payload["n"])

    @ob.handler("hook", name="hooker", queue="hooks")
    def hooker(msg: Message) -> None:
        hooked.append(msg.payload["n"])

    # No LISTEN on SQLite: it polls. On PostgreSQL only wake-ups can make it claim in time.
    poll = 600.0 if engine.dialect.name == "postgresql" else 0.2
    relay = Relay(ob, engine, poll_interval=poll)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        emit_some(maker, "mail", 0)
        assert first_started.wait(20), "the relay never started the first mail"
        paused = ops.pause(engine, queue="mail", reason="SMTP provider migration", actor="ana")
        assert paused.changed and paused.known
        release_first.set()  # a delivery running when the pause came finishes normally
        wait_until(lambda: mailed == [0], "the running delivery to finish")

        emit_some(maker, "mail", 1, 2, 3)
        held = rows(engine, "mailer")[1:]
        emit_some(maker, "hook", 1, 2)
        wait_until(lambda: sorted(hooked) == [1, 2], "the other queue to keep flowing")
        emit_some(maker, "hook", 3)  # a claim round after the mail was emitted, as evidence
        wait_until(lambda: sorted(hooked) == [1, 2, 3], "the other queue to keep flowing")
        assert mailed == [0]
        assert rows(engine, "mailer")[1:] == held  # pending, never attempted, schedule untouched
        assert {r.status for r in held} == {"pending"} and {r.attempts for r in held} == {0}
        assert ops.paused(engine)[0].held_back == 3

        lifted = ops.resume(engine, queue="mail", reason="migration done", actor="ben")
        assert (lifted.kind, lifted.name, lifted.actor, lifted.held_back) == ("queue", "mail", "ana", 3)
        wait_until(lambda: sorted(mailed) == [0, 1, 2, 3], "the resumed queue to be delivered")
    finally:
        release_first.set()
        relay.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert {r.attempts for r in rows(engine, "mailer")} == {1}
    assert logged(engine) == [
        ("paused", "queue", "mail", "ana", "SMTP provider migration"),
        ("resumed", "queue", "mail", "ben", "migration done"),
    ]
    # The messages it held back show the pause in their own history; the first one was already
    # running when it began, so it overlaps that one too.
    for row in rows(engine, "mailer"):
        (span,) = ops.show(engine, row.id).pauses
        assert (span.kind, span.name, span.paused_by, span.resumed_by) == ("queue", "mail", "ana", "ben")
    assert ops.show(engine, rows(engine, "hooker")[0].id).pauses == []


def test_a_paused_handler_is_held_back_by_drains_too_and_shows_in_stats_and_show(engine, ob, maker):
    ob.route("order.paid", lambda msg: None, name="ledger", queue="billing")
    ob.route("order.paid", lambda msg: None, name="receipt", queue="billing")
    emit_some(maker, "order.paid", 1)
    done = ops.pause(engine, handler="ledger", reason="ledger API read-only tonight", actor="ana")
    assert done.known and done.pause.held_back == 1

    Relay(ob, engine).run_until_idle()
    assert [r.status for r in rows(engine, "receipt")] == ["delivered"]
    (held,) = rows(engine, "ledger")
    assert (held.status, held.attempts) == ("pending", 0)

    (pause,) = ops.stats(engine).paused
    assert (pause.kind, pause.name, pause.actor, pause.held_back) == ("handler", "ledger", "ana", 1)
    (span,) = ops.show(engine, held.id).pauses
    assert (span.kind, span.name, span.pause_reason, span.resumed_at) == (
        "handler",
        "ledger",
        "ledger API read-only tonight",
        None,
    )

    ops.resume(engine, handler="ledger", reason="ledger writable again", actor="ana")
    Relay(ob, engine).run_until_idle()
    assert [r.status for r in rows(engine, "ledger")] == ["delivered"]
    (span,) = ops.show(engine, held.id).pauses
    assert span.resume_reason == "ledger writable again" and span.resumed_at is not None
    assert ops.stats(engine).paused == []


def test_pause_and_resume_say_what_they_did_and_refuse_what_they_cannot(engine):
    first = ops.pause(engine, queue="reports", reason="month-end freeze", actor="ana")
    assert first.changed and not first.known  # no message has used it: held back all the same
    again = ops.pause(engine, queue="reports", reason="another reason", actor="ben")
    assert not again.changed and (again.pause.actor, again.pause.reason) == ("ana", "month-end freeze")
    assert logged(engine) == [("paused", "queue", "reports", "ana", "month-end freeze")]

    with pytest.raises(ops.NotPaused, match=r"handler 'reports' is not paused.*paused now: queue reports"):
        ops.resume(engine, handler="reports", reason="r", actor="ana")
    for kwargs, refusal in (
        ({"queue": "a", "handler": "b"}, "exactly one"),
        ({}, "exactly one"),
        ({"queue": "has space"}, "whitespace"),
        ({"queue": "q", "reason": " "}, "a reason is required"),
        ({"queue": "q", "actor": "x" * 256}, "longer than 255"),
    ):
        with pytest.raises(ops.OpsError, match=refusal):
            ops.pause(engine, **{"reason": "why", "actor": "ana", **kwargs})
    ops.resume(engine, queue="reports", reason="freeze over", actor="ana")
    with pytest.raises(ops.NotPaused, match="nothing is paused"):
        ops.resume(engine, queue="reports", reason="again", actor="ana")
    assert [e[0] for e in logged(engine)] == ["paused", "resumed"]


def test_the_outbox_command_pauses_resumes_and_shows_it(database_url, engine, ob, maker):
    ob.route("user.signed_up", lambda msg: None, name="welcome_email", queue="mail")
    emit_some(maker, "user.signed_up", 1)
    with engine.connect() as conn:
        message_id = conn.execute(select(func.max(m.c.id))).scalar_one()

    said = ok(
        run("pause", "--queue", "mail", "--reason", "SMTP move", "--actor", "ana", database_url=database_url)
    )
    assert said.startswith("paused queue mail:") and "1 pending message(s) held back" in said
    again = run("pause", "--queue", "mail", "--reason", "x", database_url=database_url)
    assert "was already paused since" in ok(again) and "by ana (SMTP move); nothing changed" in again.stdout
    typo = run("pause", "--handler", "welcome_emial", "--reason", "x", "--json", database_url=database_url)
    assert ok_json(typo)["known"] is False
    assert "no message has used handler 'welcome_emial' yet; paused anyway" in typo.stderr

    stats = ok(run("stats", database_url=database_url))
    assert "paused: queue mail since " in stats and "by ana (SMTP move), holding back 1 pending" in stats
    paused = {
        (p["kind"], p["name"]): p
        for p in ok_json(run("stats", "--json", database_url=database_url))["paused"]
    }
    assert paused["queue", "mail"]["held_back"] == 1 and paused["handler", "welcome_emial"]["held_back"] == 0

    shown = ok(run("show", str(message_id), database_url=database_url))
    assert any(line.split()[:2] == ["-", "paused"] and "SMTP move" in line for line in shown.splitlines())
    (span,) = ok_json(run("show", str(message_id), "--json", database_url=database_url))["pauses"]
    assert (span["kind"], span["name"], span["paused_by"], span["resumed_at"]) == (
        "queue",
        "mail",
        "ana",
        None,
    )

    resumed = ok(
        run("resume", "--queue", "mail", "--reason", "done", "--actor", "ben", database_url=database_url)
    )
    assert resumed.startswith("resumed queue mail (paused since ") and "1 pending message(s)" in resumed
    assert_one_line_error(
        run("resume", "--queue", "mail", "--reason", "done", database_url=database_url),
        1,
        "queue 'mail' is not paused; nothing to resume",
        "paused now: handler welcome_emial",
    )
    assert_one_line_error(
        run("resume", "--reason", "r", database_url=database_url), 2, "--queue", "--handler"
    )
    assert_one_line_error(run("pause", "--queue", "mail", database_url=database_url), 2, "--reason")
    shown = ok(run("show", str(message_id), database_url=database_url))
    assert any(line.split()[:2] == ["-", "resumed"] and "done" in line for line in shown.splitlines())


def test_the_relays_metrics_show_what_is_paused(engine):
    pytest.importorskip("prometheus_client")
    from outbox.relay.metrics import RelayMetrics

    metrics = RelayMetrics()

    def gauge(kind: str, name: str) -> float | None:
        return metrics.registry.get_sample_value("outbox_paused", {"kind": kind, "name": name})

    ops.pause(engine, queue="mail", reason="r", actor="ana")
    metrics.refresh(engine)
    assert gauge("queue", "mail") == 1
    ops.resume(engine, queue="mail", reason="r", actor="ana")
    metrics.refresh(engine)
    assert gauge("queue", "mail") == 0


def test_commands_before_migrating_say_to_migrate(empty_url):
    for args in (["stats"], ["list"], ["show", "1"], ["pause", "--queue", "q", "--reason", "r"]):
        assert_one_line_error(
            run(*args, database_url=empty_url),
            1,
            "the outbox tables are missing in",
            "run `outbox migrate --database-url ...` first",
        )


def test_a_relay_on_a_database_not_migrated_this_far_says_to_migrate(empty_url, ob):
    outbox.upgrade(empty_url, "outbox_0009")
    ob.route("e", lambda msg: None, name="r")
    with pytest.raises(outbox.OutboxError, match=r"tables are missing .*\(no outbox_pause\).*outbox migrate"):
        Relay(ob, empty_url).run_until_idle()
