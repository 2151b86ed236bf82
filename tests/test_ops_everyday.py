"""Day-to-day operations: ``outbox retry-now``, ``outbox list --where payload.PATH=VALUE``, ``outbox tail``.

As in test_ops_cli.py, the installed console script runs as a subprocess against real SQLite and
PostgreSQL databases, and history is written the honest way: a real :class:`~outbox.relay.Relay`
delivers and fails the messages.
"""

from __future__ import annotations

import json
import os
import select as select_io
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from stamped import as_reported
from test_ops_cli import assert_one_line_error, history_of, login_of, ok, ok_json, outbox_cmd, run, snapshot

import outbox
from outbox import Backoff, Outbox, emit, ops
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt

#: Retries an hour away: a failed message waits out a backoff for the whole test.
HOUR = Backoff(base=3600, cap=3600)


@dataclass
class Billing:
    """An outbox whose billing route fails until ``fixed``; mail always delivers."""

    url: str
    engine: Engine
    ob: Outbox
    maker: sessionmaker[Session]
    fixed: bool = False

    def emit(self, event_type: str, payload: dict[str, Any], **kw: Any) -> None:
        with self.maker.begin() as s:
            emit(s, event_type, payload, **kw)

    def relay(self, **kw: Any) -> Any:
        return Relay(self.ob, self.engine, **kw).run_until_idle()

    def ids(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return dict(conn.execute(select(m.c.idempotency_key, m.c.id)).all())

    def row(self, message_id: int) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(select(m).where(m.c.id == message_id)).one()


@pytest.fixture
def billing(database_url: str, engine: Engine) -> Iterator[Billing]:
    ob = Outbox(default_backoff=HOUR)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    found = Billing(database_url, engine, ob, maker)

    @ob.handler("order.paid", name="invoice", queue="billing")
    def invoice(msg: outbox.Message) -> None:
        if not found.fixed:
            raise ConnectionError(f"billing API unreachable for order {msg.payload['order_id']}\nsecond line")

    @ob.handler("user.signed_up", name="welcome_email", queue="mail")
    def welcome(msg: outbox.Message) -> None:
        pass

    yield found
    ob.uninstall(maker)


# -- retry-now --------------------------------------------------------------------------------------


def test_retry_now_makes_waiting_retries_due_and_records_who_and_why(billing):
    url, engine = billing.url, billing.engine
    for order in (1, 2):
        billing.emit("order.paid", {"order_id": order}, key=f"order:{order}")
    billing.emit("order.paid", {"order_id": 3}, key="order:3", delay=3600)  # scheduled, never tried
    billing.emit("user.signed_up", {"user_id": 1}, key="signup:1")
    assert billing.relay().delivered == 1
    ids = billing.ids()
    waiting = [ids["order:1"], ids["order:2"]]
    before = {i: billing.row(i) for i in waiting}
    assert all(r.status == "pending" and r.attempts == 1 for r in before.values())
    assert billing.relay().delivered == 0, "an hour's backoff: nothing is due"
    scheduled = snapshot(engine)["outbox_message"]

    # A filter asks first; without a terminal it refuses unless --yes; nothing changed.
    assert_one_line_error(
        run("retry-now", "--queue", "billing", "--reason", "r", database_url=url), 1, "--yes"
    )
    assert snapshot(engine)["outbox_message"] == scheduled
    done = ok_json(
        run(
            "retry-now",
            "--queue",
            "billing",
            "--reason",
            "billing is back",
            "--actor",
            "alice",
            "--yes",
            "--json",
            database_url=url,
        )
    )
    assert done == {"retried_now": waiting}, "the delayed order:3 is not a retry"
    for message_id in waiting:
        now = billing.row(message_id)
        assert now.available_at <= datetime.now(UTC) < before[message_id].available_at
        assert (now.status, now.attempts, now.priority) == ("pending", 1, before[message_id].priority)
        *_, last = history_of(engine, message_id)
        assert (last.outcome, last.actor, last.reason, last.attempt) == (
            "retried_now",
            "alice",
            "billing is back",
            1,
        )
        assert datetime.fromisoformat(last.detail.pop("was_due_at")) == before[message_id].available_at
        assert last.detail == {"previous_status": "pending", **login_of(engine)}
    assert billing.row(ids["order:3"]).available_at > datetime.now(UTC) + timedelta(minutes=59)

    # Due now: the relay delivers them without waiting out the hour.
    billing.fixed = True
    assert billing.relay().delivered == 2
    assert [h.outcome for h in history_of(engine, ids["order:1"])] == ["failed", "retried_now", "delivered"]
    # Nothing is waiting any more: a repeat says so and changes nothing.
    again = ok(run("retry-now", "--queue", "billing", "--reason", "r", database_url=url))
    assert again == "no message matched the filter; nothing to retry-now\n"


def test_show_prints_a_long_detail_whole_never_cut_mid_string(billing):
    billing.emit("order.paid", {"order_id": 1}, key="order:1")
    billing.relay()
    message_id = billing.ids()["order:1"]
    ops.retry_now(
        billing.engine, ops.MessageFilter(ids=(message_id,)), reason="billing is back", actor="alice"
    )
    *_, last = history_of(billing.engine, message_id)
    assert len(json.dumps(last.detail)) > 60  # wider than the table's cells

    shown = ok(run("show", str(message_id), database_url=billing.url))
    row = next(line for line in shown.splitlines() if "retried_now" in line)
    assert "(below:" in row and "was_due_at" not in row
    below = shown.split("detail of attempt 1 (retried_now):\n", 1)[1]
    # The login the database stamps goes in the "by" column, not below with the facts.
    assert json.loads(below) == as_reported(json.loads(json.dumps(last.detail)))
    whole = ok_json(run("show", str(message_id), "--json", database_url=billing.url))
    assert whole["attempts"][-1]["detail"] == last.detail


def test_retry_now_by_id_is_all_or_none_and_delayed_messages_need_asking(billing):
    url, engine = billing.url, billing.engine
    billing.emit("order.paid", {"order_id": 1}, key="order:1")
    billing.emit("order.paid", {"order_id": 2}, key="order:2", delay=3600)
    billing.emit("user.signed_up", {"user_id": 1}, key="signup:1")
    billing.relay()
    billing.emit("user.signed_up", {"user_id": 2}, key="signup:2")  # due already
    ids = billing.ids()
    retry, delayed, delivered, due = ids["order:1"], ids["order:2"], ids["signup:1"], ids["signup:2"]
    before = snapshot(engine)

    for named, needle in (
        ([retry, delayed], f"{delayed} (delayed at emit, never attempted)"),
        ([retry, delivered], f"{delivered} (delivered)"),
        ([retry, due], f"{due} (due already)"),
    ):
        refused = run("retry-now", *map(str, named), "--reason", "r", database_url=url)
        assert_one_line_error(refused, 1, "can only retry-now pending messages waiting", needle)
    assert_one_line_error(run("retry-now", "999999", "--reason", "r", database_url=url), 1, "no message")
    assert_one_line_error(
        run("retry-now", "--reason", "r", database_url=url), 1, "give message ids or a filter"
    )
    assert snapshot(engine) == before, "a refused id refuses the whole command"

    out = ok(
        run("retry-now", str(retry), str(delayed), "--include-delayed", "--reason", "rush", database_url=url)
    )
    assert out.strip() == f"2 message(s) due now: {retry}, {delayed}"
    assert [h.outcome for h in history_of(engine, delayed)] == ["retried_now"]
    assert history_of(engine, delayed)[0].attempt == 0
    billing.fixed = True
    assert billing.relay().delivered == 3


def test_retry_now_never_locks_or_touches_a_running_message(billing):
    engine = billing.engine
    for order in (1, 2):
        billing.emit("order.paid", {"order_id": order}, key=f"order:{order}")
    billing.relay()
    running_id = billing.ids()["order:1"]
    with engine.begin() as conn:  # as a relay's claim leaves it: running under a lease, still "not due"
        conn.execute(
            m.update()
            .where(m.c.id == running_id)
            .values(
                status="running", locked_by="relay-1", locked_until=datetime.now(UTC) + timedelta(hours=2)
            )
        )
    with engine.connect() as conn:
        raw_before = conn.execute(text("SELECT * FROM outbox_message WHERE id = :i"), {"i": running_id}).one()
    done = ops.retry_now(engine, ops.MessageFilter(handler="invoice"), reason="r", actor="t", batch_size=1)
    assert done == [billing.ids()["order:2"]]
    with engine.connect() as conn:
        assert (
            conn.execute(text("SELECT * FROM outbox_message WHERE id = :i"), {"i": running_id}).one()
            == raw_before
        )
    assert [h.outcome for h in history_of(engine, running_id)] == ["failed"]
    with pytest.raises(ops.OpsError, match=rf"{running_id} \(running\)"):
        ops.retry_now(engine, ops.MessageFilter(ids=(running_id,)), reason="r", actor="t")


def test_retry_now_wakes_listening_relays_on_postgresql(pg_engine):
    engine = pg_engine
    ob = Outbox(default_backoff=HOUR)
    maker = sessionmaker(engine)
    ob.install(maker)

    @ob.handler("order.paid", name="invoice")
    def invoice(msg: outbox.Message) -> None:
        raise ConnectionError("down")

    try:
        with maker.begin() as s:
            emit(s, "order.paid", {"order_id": 1})
        Relay(ob, engine).run_until_idle()
        listener = psycopg.connect(
            engine.url.set(drivername="postgresql").render_as_string(False), autocommit=True
        )
        try:
            listener.execute("LISTEN outbox")
            assert ops.retry_now(engine, ops.MessageFilter(handler="invoice"), reason="r", actor="t")
            heard = list(listener.notifies(timeout=10, stop_after=1))
        finally:
            listener.close()
        assert [(n.channel, n.payload) for n in heard] == [("outbox", "public")]
    finally:
        ob.uninstall(maker)


# -- list --where payload.PATH=VALUE ----------------------------------------------------------------

DOCUMENTS: dict[str, Any] = {
    "int": {"n": 42},
    "float": {"n": 42.0},
    "text": {"n": "42"},
    "true": {"n": True},
    "one": {"n": 1},
    "null": {"n": None},
    "missing": {},
    "array": {"n": [42]},
    "object": {"n": {"v": 42}},
    "false": {"n": False},
    "zero": {"n": 0},
    "word": {"n": "paid"},
    "items": {"items": [{"sku": "A1"}, {"sku": "B2"}], "customer": {"id": 7, "tier": "gold"}},
    "keyed": {"items": {"0": {"sku": "A1"}}},
}


def payload_rows(engine: Engine) -> None:
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(m),
            [
                {
                    "event_id": uuid.uuid4(),
                    "event_type": "doc",
                    "handler": "h",
                    "queue": "q",
                    "priority": 0,
                    "payload": payload,
                    "headers": {},
                    "idempotency_key": key,
                    "max_attempts": 1,
                    "available_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for key, payload in DOCUMENTS.items()
            ],
        )


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (["payload.n=42"], {"int", "float"}),
        (["payload.n=42.0"], {"int", "float"}),
        (['payload.n="42"'], {"text"}),
        (["payload.n=true"], {"true"}),
        (["payload.n=1"], {"one"}),
        (["payload.n=false"], {"false"}),
        (["payload.n=0"], {"zero"}),
        (["payload.n=null"], {"null"}),
        (["payload.n=paid"], {"word"}),
        (["payload.items.0.sku=A1"], {"items"}),
        (["payload.items.1.sku=A1"], set()),
        (["payload.items.1.sku=B2"], {"items"}),
        (["payload.customer.id=7", "payload.customer.tier=gold"], {"items"}),
        (["payload.customer.id=7", "payload.customer.tier=silver"], set()),
    ],
)
def test_where_means_the_same_on_both_databases(engine, where, expected):
    """Same JSON type and value: 42 is not "42", true is not 1, null is not missing, 0 indexes arrays."""
    payload_rows(engine)
    conditions = tuple(ops.parse_where(w) for w in where)
    rows = ops.list_messages(engine, ops.MessageFilter(payload=conditions))
    assert {r.idempotency_key for r in rows} == expected


def test_list_where_on_the_command_line(billing):
    url = billing.url
    for order, customer in ((1, 7), (2, 8), (3, 7)):
        billing.emit("order.paid", {"order_id": order, "customer": {"id": customer}}, key=f"order:{order}")
    billing.relay()
    ids = billing.ids()
    listed = ok_json(run("list", "--where", "payload.customer.id=7", "--json", database_url=url))
    assert [r["id"] for r in listed] == [ids["order:3"], ids["order:1"]]
    both = ["--where", "payload.customer.id=7", "--where", "payload.order_id=3"]
    assert [r["id"] for r in ok_json(run("list", *both, "--json", database_url=url))] == [ids["order:3"]]
    # The shared filter: --where narrows an action too.
    done = ok_json(run("retry-now", *both, "--reason", "r", "--yes", "--json", database_url=url))
    assert done == {"retried_now": [ids["order:3"]]}
    discarded = ok_json(
        run("discard", "--where", "payload.order_id=2", "--reason", "r", "--yes", "--json", database_url=url)
    )
    assert discarded == {"discarded": [ids["order:2"]]}


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("payload.order-id=1", "bad path 'order-id'"),
        ("payload..x=1", "bad path"),
        ("payload.x", "expected payload.PATH=VALUE"),
        ("headers.x=1", "expected payload.PATH=VALUE"),
        ("payload=1", "expected payload.PATH=VALUE"),
        ("payload.x='1' OR 1=1", None),  # not an error: a string, compared as a parameter
        ("payload.x=[1]", "is a JSON array"),
        ('payload.x={"a":1}', "is a JSON object"),
        ("payload.x=1e999", "is not a JSON number"),
        ("payload.x=99999999999999999999", "out of range"),
        # Past Python's int-string limit (4,300 digits) int() raises ValueError: not a reason to compare text.
        (
            "payload.x=" + "9" * 5000,
            "a 5000-digit integer is out of range: integers are compared up to 64 bits",
        ),
        ("payload.x=-" + "9" * 5000, "a 5000-digit integer is out of range"),
        ('payload.x="\\u0000"', "the value contains a NUL character"),
        ('payload.x="\\ud800"', "the value contains a lone surrogate"),
        ("payload.a\n.b=1", "bad path"),
    ],
)
def test_a_bad_where_is_a_usage_error_at_parse_time(tmp_path, value, needle):
    url = f"sqlite:///{tmp_path / 'never-created.db'}"
    result = run("list", "--where", value, database_url=url)
    if needle is None:
        assert result.returncode != 2, result.stderr
        return
    assert_one_line_error(result, 2, "argument --where", needle)
    assert not (tmp_path / "never-created.db").exists(), "refused before connecting"


def test_a_gin_index_serves_where_on_postgresql(pg_engine):
    """The index docs/operations.md advises, and the plan that uses it."""
    now = datetime.now(UTC)
    with pg_engine.begin() as conn:
        conn.execute(
            insert(m),
            [
                {
                    "event_id": uuid.uuid4(),
                    "event_type": "order.paid",
                    "handler": "invoice",
                    "queue": "billing",
                    "priority": 0,
                    "payload": {"order_id": n, "customer": {"id": n % 500}},
                    "headers": {},
                    "max_attempts": 1,
                    "available_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for n in range(5000)
            ],
        )
        conn.execute(text(GIN_INDEX))
        conn.execute(text("ANALYZE outbox_message"))
    where = ops.MessageFilter(payload=(ops.parse_where("payload.order_id=4242"),))
    assert [r.id for r in ops.list_messages(pg_engine, where)] != []
    statement = where.apply(select(m.c.id)).order_by(m.c.id.desc()).limit(50)
    with pg_engine.connect() as conn:
        compiled = statement.compile(conn)
        plan = "\n".join(
            r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params).all()
        )
    assert "ix_outbox_message_payload" in plan, plan


GIN_INDEX = "CREATE INDEX ix_outbox_message_payload ON outbox_message USING gin (payload jsonb_path_ops)"


# -- tail -------------------------------------------------------------------------------------------


class Tail:
    """``outbox tail`` running as a subprocess; ready once it says it is following."""

    def __init__(self, *args: str, database_url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        self.process = subprocess.Popen(
            outbox_cmd("tail", *args, database_url=database_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.process.stderr is not None
        ready, _, _ = select_io.select([self.process.stderr], [], [], 30)
        assert ready, "outbox tail never said it was following"
        self.first_stderr = self.process.stderr.readline()
        assert self.first_stderr.startswith("outbox tail: following the history of"), self.first_stderr

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, self.first_stderr + err

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture
def tails() -> Iterator[list[Tail]]:
    started: list[Tail] = []
    yield started
    for tail in started:
        tail.kill()


JSON_KEYS = {
    "id",
    "time",
    "message_id",
    "handler",
    "event_type",
    "queue",
    "attempt",
    "outcome",
    "duration_ms",
    "started_at",
    "finished_at",
    "relay_id",
    "actor",
    "error_type",
    "error",
    "reason",
    "detail",
}


def test_tail_json_prints_each_new_history_row_as_the_relay_writes_it(billing, tails):
    billing.emit("user.signed_up", {"user_id": 0}, key="signup:0")
    billing.relay()  # history from before the tail started: not shown
    tail = Tail("--json", "--count", "4", "--interval", "0.05", database_url=billing.url)
    tails.append(tail)
    billing.emit("user.signed_up", {"user_id": 1}, key="signup:1")
    billing.emit("order.paid", {"order_id": 1}, key="order:1")
    billing.relay(relay_id="relay-a")
    ok(
        run(
            "retry-now",
            "--handler",
            "invoice",
            "--reason",
            "back up",
            "--actor",
            "ops",
            "--yes",
            database_url=billing.url,
        )
    )
    billing.fixed = True
    billing.relay(relay_id="relay-b")
    code, out, err = tail.finish()
    assert code == 0 and "Traceback" not in err and err.count("\n") == 1, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert all(set(r) == JSON_KEYS for r in rows)
    ids = billing.ids()
    by_message = sorted((r["message_id"], r["outcome"]) for r in rows)
    assert by_message == sorted(
        [
            (ids["signup:1"], "delivered"),
            (ids["order:1"], "failed"),
            (ids["order:1"], "retried_now"),
            (ids["order:1"], "delivered"),
        ]
    )
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    failed = next(r for r in rows if r["outcome"] == "failed")
    assert (
        failed["handler"] == "invoice"
        and failed["event_type"] == "order.paid"
        and failed["queue"] == "billing"
    )
    assert (failed["attempt"], failed["relay_id"], failed["error_type"]) == (1, "relay-a", "ConnectionError")
    assert failed["error"].startswith("billing API unreachable for order 1")
    assert datetime.fromisoformat(failed["time"]) == datetime.fromisoformat(failed["finished_at"])
    retried = next(r for r in rows if r["outcome"] == "retried_now")
    assert (retried["actor"], retried["reason"], retried["relay_id"]) == ("ops", "back up", None)


def test_tail_text_filters_and_stops_on_ctrl_c(billing, tails):
    tail = Tail("--handler", "invoice", "--interval", "0.05", database_url=billing.url)
    tails.append(tail)
    billing.emit("user.signed_up", {"user_id": 1}, key="signup:1")
    billing.emit("order.paid", {"order_id": 5}, key="order:5")
    billing.relay()
    order = billing.ids()["order:5"]
    assert tail.process.stdout is not None
    ready, _, _ = select_io.select([tail.process.stdout], [], [], 30)
    assert ready, "the failure was never printed"
    line = tail.process.stdout.readline()
    fields = line.rstrip("\n").split("  ")
    assert fields[1:6] == [f"#{order}", "invoice", "order.paid", "attempt 1", "failed"], line
    assert fields[6].endswith("ms") and fields[7] == "ConnectionError: billing API unreachable for order 5"
    datetime.fromisoformat(fields[0].replace("Z", "+00:00"))
    tail.process.send_signal(signal.SIGINT)
    code, out, err = tail.finish()
    assert (code, out) == (0, ""), (code, out, err)
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_tail_starts_from_last_or_since_and_a_closed_pipe_ends_it_quietly(billing, tails):
    for order in (1, 2, 3):
        billing.emit("order.paid", {"order_id": order}, key=f"order:{order}")
    billing.relay()
    ids = billing.ids()
    last_two = ok(run("tail", "--last", "2", "--count", "2", "--json", database_url=billing.url))
    assert [json.loads(r)["message_id"] for r in last_two.splitlines()] == [ids["order:2"], ids["order:3"]]
    with billing.engine.connect() as conn:
        started = conn.execute(select(a.c.started_at).order_by(a.c.id)).scalars().all()
    since = ok(
        run("tail", "--since", started[1].isoformat(), "--count", "2", "--json", database_url=billing.url)
    )
    assert [json.loads(r)["message_id"] for r in since.splitlines()] == [ids["order:2"], ids["order:3"]]
    assert_one_line_error(run("tail", "--last", "2", "--since", "2026-01-01", database_url=billing.url), 2)
    assert_one_line_error(run("tail", "--interval", "0", database_url=billing.url), 2, "--interval")

    # The reader goes away (`outbox tail | head -1`): the next row ends the command, quietly.
    tail = Tail("--last", "1", "--interval", "0.05", database_url=billing.url)
    tails.append(tail)
    assert tail.process.stdout is not None
    assert tail.process.stdout.readline().split("  ")[1] == f"#{ids['order:3']}"
    tail.process.stdout.close()
    ok(run("retry-now", "--handler", "invoice", "--reason", "r", "--yes", database_url=billing.url))
    assert tail.process.stderr is not None
    assert tail.process.wait(timeout=30) == 1
    err = tail.first_stderr + tail.process.stderr.read()
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_follow_history_shows_a_row_that_commits_after_a_later_one_on_postgresql(pg_engine):
    """Ids are taken at insert and seen at commit: a row that commits late is still shown."""

    def attempt_row(outcome: str) -> dict[str, Any]:
        return {"message_id": 1, "attempt": 1, "outcome": outcome, "started_at": datetime.now(UTC)}

    with pg_engine.begin() as conn:
        conn.execute(insert(a).values(attempt_row("dead")))
    ready: list[bool] = []
    rows = ops.follow_history(pg_engine, last=1, interval=0.02, ready=lambda: ready.append(True))
    assert next(rows).outcome == "dead" and ready == [True]
    with pg_engine.connect() as slow:
        slow.execute(insert(a).values(attempt_row("retry")))  # takes the lower id, commits last
        with pg_engine.begin() as conn:
            conn.execute(insert(a).values(attempt_row("delivered")))
        assert next(rows).outcome == "delivered"
        slow.commit()
    assert next(rows).outcome == "retry"


def test_follow_history_masks_secret_looking_detail_keys(engine):
    with engine.begin() as conn:
        conn.execute(
            insert(a).values(
                message_id=1,
                attempt=1,
                outcome="failed",
                started_at=datetime.now(UTC),
                error="token leaked",
                detail={"status": 401, "authorization": "Bearer abc"},
            )
        )
    entry = next(ops.follow_history(engine, last=1, secrets=["leaked"]))
    assert entry.detail == {"status": 401, "authorization": "***"}
    assert entry.error == "token ***"
    assert (entry.handler, entry.event_type) == (None, None), "its message is gone (purged): still shown"
