"""The ``outbox`` command as operators run it: the installed console script, a subprocess, real databases.

Every test starts from messages in every status, produced the honest way: emitted through an
installed :class:`~outbox.Outbox`, delivered or failed by a real :class:`~outbox.relay.Relay`,
one left claimed (running) and one discarded by the ``outbox discard`` command. Exit codes: 0
success, 1 refused or failed, 2 bad usage; user mistakes get one line on stderr, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aging import age_history
from sqlalchemy import Text, cast, func, insert, literal, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, Message, Outbox, PermanentError, RetryLater, emit, ops
from outbox._redact import DEPTH_SHOWN, TOO_DEEP
from outbox.cli import main as outbox_main
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt

FAST = Backoff(base=0.001, cap=0.002)
SCRIPT = Path(sys.executable).with_name("outbox")
T = TypeVar("T")
UNREACHABLE_PG = "postgresql+psycopg://postgres:s3cret-pw@127.0.0.1:1/x"


# -- running the command --------------------------------------------------------------------------


def outbox_cmd(*args: str, database_url: str | None = None) -> list[str]:
    assert SCRIPT.exists(), f"the console script is not installed next to {sys.executable}"
    url = [] if database_url is None else ["--database-url", database_url]
    return [str(SCRIPT), *args, *url]


def run(
    *args: str, database_url: str | None = None, env_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if env_url is not None:
        env["OUTBOX_DATABASE_URL"] = env_url
    return subprocess.run(
        outbox_cmd(*args, database_url=database_url),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,  # never a tty: bulk actions must not wait for an answer
    )


def parallel(*calls: Callable[[], T]) -> list[T]:
    """Independent commands, a few at a time: each one pays the interpreter's start-up."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda call: call(), calls))


def run_all(
    commands: Sequence[Sequence[str]], database_url: str | None
) -> list[subprocess.CompletedProcess[str]]:
    return parallel(*(functools.partial(run, *args, database_url=database_url) for args in commands))


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(result))


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The exit code, no traceback, nothing on stdout, and stderr exactly one line saying what is wrong.

    A usage error keeps argparse's ``prog: error: ...`` form but not its usage block: it points at
    that command's ``--help`` instead.
    """
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    (said,) = lines
    assert said.startswith("outbox"), result.stderr
    prog, usage_error, _ = said.partition(": error: ")
    if usage_error:
        assert said.endswith(f"(see {prog} --help)"), said
    for needle in needles:
        assert needle in said, said
    return said


# -- the messages ---------------------------------------------------------------------------------


@dataclass
class Seeded:
    url: str
    engine: Engine
    ob: Outbox
    ids: dict[str, int]
    billing_fixed: list[bool] = field(default_factory=lambda: [False])
    maker: Any = None  # the outbox-installed sessionmaker, to emit more

    def id(self, label: str) -> int:
        return self.ids[label]

    def deliver(self, *queues: str) -> None:
        """Run a relay on ``queues`` until nothing there is pending (backoff waits are tiny but real)."""
        for _ in range(100):
            Relay(self.ob, self.engine, queues=queues).run_until_idle()
            with self.engine.connect() as conn:
                left = conn.execute(
                    select(func.count()).where(m.c.status == "pending", m.c.queue.in_(queues))
                ).scalar_one()
            if not left:
                return
            time.sleep(0.01)
        raise AssertionError(f"messages still pending in {queues}")


@pytest.fixture
def seeded(database_url: str, engine: Engine) -> Iterator[Seeded]:
    """Seven messages: 2 delivered, 2 dead, 1 running, 1 pending, 1 discarded.

    ``signup:1`` and ``order:7`` carry secrets in their payloads; ``order:8`` is grouped; the two
    batches are separate transactions, so their ``created_at`` differ.
    """
    ob = Outbox(default_backoff=FAST)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    seeded = Seeded(database_url, engine, ob, {}, maker=maker)

    @ob.handler("user.signed_up", name="welcome_email", queue="mail")
    def welcome(msg: outbox.Message) -> None:
        pass

    @ob.handler("order.paid", name="invoice", queue="billing", max_attempts=3)
    def invoice(msg: outbox.Message) -> None:
        if seeded.billing_fixed[0]:
            return
        if msg.attempt == 1:
            raise ConnectionError("billing API unreachable")
        raise PermanentError(f"order {msg.payload['order_id']} is unknown to billing")

    @ob.handler("report.requested", name="monthly_report", queue="reports")
    def report(msg: outbox.Message) -> None:
        pass

    with maker() as s, s.begin():
        emit(s, "user.signed_up", {"user_id": 1, "password": "hunter2"}, key="signup:1", group_key="user:1")
        emit(s, "user.signed_up", {"user_id": 2}, key="signup:2")
        emit(s, "order.paid", {"order_id": 7, "card": {"api_key": "sk_live_42"}}, key="order:7")
        emit(s, "order.paid", {"order_id": 8}, key="order:8", group_key="customer:4")
    seeded.deliver("mail", "billing")
    with maker() as s, s.begin():
        for month in ("2026-09", "2026-10", "2026-11"):
            emit(s, "report.requested", {"month": month}, key=f"report:{month}")
    with engine.connect() as conn:
        seeded.ids = dict(conn.execute(select(m.c.idempotency_key, m.c.id)).all())
    claimed = Relay(ob, engine, queues=["reports"]).store.claim("reports", ["monthly_report"], 1)
    assert [r.id for r in claimed] == [seeded.id("report:2026-09")]
    # The command's own code path, in-process: the subprocess is exercised by the discard test.
    assert (
        outbox_main(
            ["discard", str(seeded.id("report:2026-11")), "--reason", "superseded by the December run"]
            + ["--actor", "seed", "--database-url", database_url]
        )
        == 0
    )
    assert statuses(engine) == {
        "signup:1": "delivered",
        "signup:2": "delivered",
        "order:7": "dead",
        "order:8": "dead",
        "report:2026-09": "running",
        "report:2026-10": "pending",
        "report:2026-11": "discarded",
    }
    yield seeded
    ob.uninstall(maker)


def delivered_after_a_failure(seeded: Seeded) -> int:
    """A message whose first attempt failed and whose second delivered it; its last_error stays."""

    @seeded.ob.handler("sms.requested", name="sms", queue="sms", max_attempts=3)
    def sms(msg: outbox.Message) -> None:
        if msg.attempt == 1:
            raise ConnectionError("SMS gateway timed out")

    with seeded.maker() as s, s.begin():
        emit(s, "sms.requested", {"to": "+15550100"}, key="sms:1")
    seeded.deliver("sms")
    with seeded.engine.connect() as conn:
        row = conn.execute(select(m.c.id, m.c.status, m.c.last_error).where(m.c.queue == "sms")).one()
    assert (row.status, row.last_error) == ("delivered", "SMS gateway timed out")
    return int(row.id)


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(m.c.idempotency_key, m.c.status)).all())


def ids_where(engine: Engine, *conditions: Any) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.id).where(*conditions).order_by(m.c.id.desc())).scalars())


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Both tables as the driver returns them, untouched by SQLAlchemy's type processing."""
    with engine.connect() as conn:
        return {
            table: [tuple(r) for r in conn.execute(text(f"SELECT * FROM {table} ORDER BY id"))]
            for table in ("outbox_message", "outbox_attempt")
        }


def fingerprint(engine: Engine, message_id: int) -> tuple[Any, ...]:
    """Every column of one row as stored; on PostgreSQL also its text form's md5 and its row version."""
    with engine.connect() as conn:
        raw = conn.execute(text("SELECT * FROM outbox_message WHERE id = :id"), {"id": message_id}).one()
        if engine.dialect.name != "postgresql":
            return tuple(raw)
        # xmin and ctid change on any UPDATE, even one that writes identical values.
        stored = conn.execute(
            text("SELECT md5(o::text), o::text, xmin::text, ctid::text FROM outbox_message o WHERE id = :id"),
            {"id": message_id},
        ).one()
        return (*raw, *stored)


def login_of(engine: Engine) -> dict[str, str]:
    """What an operator's history row names besides the actor: on PostgreSQL, the login that acted."""
    return {"db_user": str(engine.url.username)} if engine.dialect.name == "postgresql" else {}


def history_of(engine: Engine, message_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).where(a.c.message_id == message_id).order_by(a.c.id)))


def table_ids(stdout: str) -> list[int]:
    """The id column of ``outbox list``'s table."""
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["id", "status", "handler"], stdout
    return [int(line.split()[0]) for line in lines[1:] if line and line[0].isdigit()]


# -- stats ----------------------------------------------------------------------------------------


def test_stats_counts_every_status_and_the_last_hour(seeded):
    text_out, json_out = parallel(
        lambda: run("stats", database_url=seeded.url),
        lambda: run("stats", "--json", env_url=seeded.url),  # the URL from OUTBOX_DATABASE_URL
    )
    with seeded.engine.connect() as conn:
        by_status = dict(conn.execute(select(m.c.status, func.count()).group_by(m.c.status)).all())
        outcomes = dict(conn.execute(select(a.c.outcome, func.count()).group_by(a.c.outcome)).all())
    assert by_status == {"delivered": 2, "dead": 2, "running": 1, "pending": 1, "discarded": 1}
    assert outcomes == {"delivered": 2, "failed": 2, "dead": 2, "discarded": 1}

    stats = ok_json(json_out)
    assert stats["by_status"] == by_status
    assert stats["by_handler_status"] == {
        "welcome_email": {"delivered": 2},
        "invoice": {"dead": 2},
        "monthly_report": {"running": 1, "pending": 1, "discarded": 1},
    }
    assert stats["dead"] == 2
    # Every attempt above happened within the hour; requeue/discard rows are not deliveries or failures.
    assert stats["delivered_last_hour"] == outcomes["delivered"] == 2
    assert stats["failed_last_hour"] == outcomes["failed"] + outcomes["dead"] == 4
    assert stats["expired_last_hour"] == 0
    assert list(stats["oldest_pending_age_s"]) == ["reports"]
    assert 0 <= stats["oldest_pending_age_s"]["reports"] < 600

    out = ok(text_out)
    lines = out.splitlines()
    assert lines[0] == "messages by status: dead 2, delivered 2, discarded 1, pending 1, running 1"
    assert lines[1].split() == ["handler", "pending", "running", "delivered", "dead", "discarded"]
    assert {line.split()[0]: line.split()[1:] for line in lines[2:5]} == {
        "invoice": ["0", "0", "0", "2", "0"],
        "monthly_report": ["1", "1", "0", "0", "1"],
        "welcome_email": ["0", "0", "2", "0", "0"],
    }
    assert re.fullmatch(r"oldest due message in queue reports: \d+\.\ds", lines[5]), out
    assert re.fullmatch(r"oldest unfinished message in queue reports: \d+\.\ds", lines[6]), out
    assert lines[7:] == [
        "last hour: 2 delivered, 4 failed attempts, 0 expired",
        "dead: 2 needing a decision, 0 requeued",
    ]


# -- list -----------------------------------------------------------------------------------------


def test_list_filters_newest_first(seeded):
    engine = seeded.engine
    with engine.connect() as conn:
        created = dict(conn.execute(select(m.c.idempotency_key, m.c.created_at)).all())
    first_batch, second_batch = created["signup:1"], created["report:2026-09"]
    assert first_batch < second_batch
    reports = ids_where(engine, m.c.queue == "reports")
    assert len(reports) == 3 and len(ids_where(engine)) == 7

    cases: list[tuple[list[str], list[int]]] = [
        (["--handler", "monthly_report"], reports),
        (["--event-type", "user.signed_up"], [seeded.id("signup:2"), seeded.id("signup:1")]),
        (["--queue", "billing"], [seeded.id("order:8"), seeded.id("order:7")]),
        (["--key", "report:2026-10"], [seeded.id("report:2026-10")]),
        (["--group-key", "customer:4"], [seeded.id("order:8")]),
        (["--since", second_batch.isoformat()], reports),
        (
            ["--before", second_batch.isoformat(), "--status", "delivered"],
            ids_where(engine, m.c.queue == "mail"),
        ),
    ]
    text_dead, *results = run_all(
        [["list", "--status", "dead"], *(["list", "--json", *args] for args, _ in cases)], seeded.url
    )
    for (args, expected), result in zip(cases, results, strict=True):
        assert [r["id"] for r in ok_json(result)] == expected, args

    listing = ok(text_dead)
    assert table_ids(listing) == [seeded.id("order:8"), seeded.id("order:7")], "newest first"
    for line, order in zip(listing.splitlines()[1:], (8, 7), strict=True):
        assert line.split()[1:5] == ["dead", "invoice", "order.paid", "2/3"]
        assert line.endswith(f"order {order} is unknown to billing")

    (row,) = ok_json(results[4])
    assert row["status"] == "dead" and row["handler"] == "invoice" and row["idempotency_key"] == "order:8"
    assert row["attempts"] == 2 and row["max_attempts"] == 3 and row["requeued_from"] is None
    assert datetime.fromisoformat(row["created_at"]) == first_batch


def test_list_pages_cover_every_row_exactly_once(seeded):
    first = ok(run("list", "--limit", "4", database_url=seeded.url))
    page = table_ids(first)
    assert len(page) == 4
    hint = re.search(r"^\(more: --before-id (\d+)\)$", first, re.M)
    assert hint and int(hint.group(1)) == page[-1], first
    rest = ok_json(
        run("list", "--json", "--limit", "4", "--before-id", hint.group(1), database_url=seeded.url)
    )
    seen = page + [r["id"] for r in rest]
    assert seen == ids_where(seeded.engine), "newest first, each row once"
    assert len(set(seen)) == len(seen) == 7


def test_list_needs_decision_leaves_requeued_originals_out_and_every_listing_names_copies(seeded):
    first, second = seeded.id("order:7"), seeded.id("order:8")
    ((_, copy),) = ops.requeue(seeded.engine, ops.MessageFilter(ids=(first,)), reason="fixed", actor="t")
    needing, needing_json, combined, elsewhere, dead_text, every_row = run_all(
        [
            ["list", "--needs-decision"],
            ["list", "--needs-decision", "--json"],
            ["list", "--needs-decision", "--status", "dead", "--queue", "billing", "--json"],
            ["list", "--needs-decision", "--handler", "welcome_email", "--json"],
            ["list", "--status", "dead"],
            ["list", "--json"],
        ],
        seeded.url,
    )
    assert table_ids(ok(needing)) == [second]
    assert [(r["id"], r["requeued_to"]) for r in ok_json(needing_json)] == [(second, None)]
    assert [r["id"] for r in ok_json(combined)] == [second]
    assert ok_json(elsewhere) == []

    # Without the flag a requeued original is still listed, and says what became of it.
    listing = ok(dead_text)
    assert table_ids(listing) == [second, first]
    marked = {int(line.split()[0]): line for line in listing.splitlines()[1:]}
    assert f" dead, requeued as {copy} " in marked[first]
    assert "requeued" not in marked[second]
    rows = ok_json(every_row)
    assert len(rows) == 8 and all("requeued_to" in r for r in rows), "the key is on every row"
    assert {r["id"]: r["requeued_to"] for r in rows if r["requeued_to"] is not None} == {first: copy}
    assert [r["requeued_from"] for r in rows if r["id"] == copy] == [first]


@pytest.mark.parametrize("status", ["pending", "running", "delivered", "discarded"])
def test_needs_decision_with_another_status_is_a_usage_error(status):
    refused = run("list", "--needs-decision", "--status", status, database_url="sqlite://")
    assert_one_line_error(refused, 2, "outbox list: error: --needs-decision", f"--status {status}")


def test_a_delivered_messages_last_error_reads_as_history(seeded):
    delivered = delivered_after_a_failure(seeded)
    listing, shown, shown_json = run_all(
        [["list", "--queue", "sms"], ["show", str(delivered)], ["show", str(delivered), "--json"]], seeded.url
    )
    (line,) = ok(listing).splitlines()[1:]
    assert line.split()[1] == "delivered" and line.endswith("earlier error: SMS gateway timed out")
    assert re.search(r"^\s+last_error: earlier error: SMS gateway timed out$", ok(shown), re.M)
    assert re.search(r"^\s+requeued_to: None$", ok(shown), re.M)
    message = ok_json(shown_json)["message"]
    assert (message["last_error"], message["requeued_to"]) == ("SMS gateway timed out", None)
    # A dead message's error is its failure, said as it is.
    dead = ok(run("list", "--status", "dead", database_url=seeded.url))
    assert "earlier error" not in dead and "order 7 is unknown to billing" in dead


# -- show -----------------------------------------------------------------------------------------


def test_show_masks_secrets_and_lists_history_in_order(seeded):
    signup, order = seeded.id("signup:1"), seeded.id("order:7")
    with seeded.engine.connect() as conn:
        stored = dict(conn.execute(select(m.c.id, m.c.payload).where(m.c.id.in_([signup, order]))).all())
    assert stored[signup]["password"] == "hunter2" and stored[order]["card"]["api_key"] == "sk_live_42"

    text_order, json_signup, unknown = run_all(
        [["show", str(order)], ["show", str(signup), "--json"], ["show", "999999"]], seeded.url
    )
    assert "hunter2" not in ok(json_signup)
    shown = ok_json(json_signup)
    assert shown["message"]["payload"] == {"user_id": 1, "password": "***"}
    assert shown["message"]["status"] == "delivered" and shown["message"]["idempotency_key"] == "signup:1"
    assert [(h["attempt"], h["outcome"]) for h in shown["attempts"]] == [(1, "delivered")]
    assert shown["attempts"][0]["relay_id"] and shown["attempts"][0]["finished_at"]

    out = ok(text_order)
    assert "sk_live_42" not in out
    payload = re.search(r"^\s+payload: (.*)$", out, re.M)
    assert payload and json.loads(payload.group(1)) == {"order_id": 7, "card": {"api_key": "***"}}, out
    assert re.search(r"^\s+status: dead$", out, re.M) and re.search(r"^\s+attempts: 2$", out, re.M)
    assert re.search(r"^\s+last_error: order 7 is unknown to billing$", out, re.M)
    message_part, history_part = out.split("\n\n")
    header, *attempts = history_part.splitlines()
    assert header.split() == ["attempt", "outcome", "started_at", "ms", "by", "error/reason", "detail"]
    assert [line.split()[:2] for line in attempts] == [["1", "failed"], ["2", "dead"]], "in order"
    assert attempts[0].rstrip().endswith("billing API unreachable")
    assert attempts[1].rstrip().endswith("order 7 is unknown to billing")

    assert_one_line_error(unknown, 1, "no message with id 999999")


def nested_json(levels: int) -> str:
    """JSON text ``levels`` objects deep, a secret-named key at every level but the last."""
    return '{"token":"hunter2","next":' * (levels - 1) + '{"end":true}' + "}" * (levels - 1)


def depth(document: Any) -> int:
    """Levels of objects and arrays, counted without recursion."""
    deepest, todo = 0, [(document, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            todo.extend((item, level + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def insert_nested_message(engine: Engine, levels: int) -> int:
    """A dead message whose payload, headers and history detail nest ``levels`` deep.

    Written as the table's owner would, straight into the table: emit() refuses
    such payloads now, but rows from before it did, or from other writers, remain.
    """

    def document(levels: int) -> Any:
        stored = literal(nested_json(levels), Text())
        return cast(stored, JSONB) if engine.dialect.name == "postgresql" else stored

    now = datetime.now(UTC)
    with engine.begin() as conn:
        message_id: int = conn.execute(
            insert(m)
            .values(
                event_id=uuid.uuid4(),
                event_type="order.paid",
                handler="invoice",
                queue="billing",
                priority=0,
                payload=document(levels),
                headers=document(levels),
                status="dead",
                attempts=1,
                max_attempts=1,
                available_at=now,
                created_at=now,
                updated_at=now,
            )
            .returning(m.c.id)
        ).scalar_one()
        conn.execute(
            insert(a).values(
                message_id=message_id, attempt=1, outcome="dead", started_at=now, detail=document(levels)
            )
        )
    return message_id


def assert_cut_at_depth_shown(document: Any, levels: int) -> None:
    """What a reader shows of ``nested_json(levels)``: the top levels, secrets masked, then the marker."""
    if levels > 900:  # too deep for the json module to decode at all: the marker stands in for all of it
        assert document == TOO_DEEP
        return
    assert depth(document) == DEPTH_SHOWN
    while isinstance(document, dict):
        assert document["token"] == "***"
        document = document["next"]
    assert document == TOO_DEEP


@pytest.mark.parametrize("levels", [600, 5000])
def test_show_and_tail_print_a_stored_message_however_deeply_it_nests(database_url, engine, levels):
    """600 levels was the review's case (a RecursionError traceback); 5000 is past what the driver decodes."""
    mid = insert_nested_message(engine, levels)
    human, as_json, tail = run_all(
        [["show", str(mid)], ["show", str(mid), "--json"], ["tail", "--last", "1", "--count", "1", "--json"]],
        database_url,
    )
    for result in (human, as_json, tail):
        assert "hunter2" not in ok(result)
    line = re.search(r"^\s+payload: (.*)$", ok(human), re.M)
    assert line, ok(human)
    assert_cut_at_depth_shown(json.loads(line[1]) if line[1].startswith("{") else line[1], levels)
    shown = ok_json(as_json)
    assert_cut_at_depth_shown(shown["message"]["payload"], levels)
    assert_cut_at_depth_shown(shown["message"]["headers"], levels)
    assert_cut_at_depth_shown(shown["attempts"][0]["detail"], levels)
    followed = json.loads(ok(tail))
    assert followed["message_id"] == mid
    assert_cut_at_depth_shown(followed["detail"], levels)


# -- requeue --------------------------------------------------------------------------------------


def test_requeue_makes_a_new_message_and_leaves_the_old_row_untouched(seeded):
    engine, old = seeded.engine, seeded.id("order:7")
    before_row = fingerprint(engine, old)
    before_history = [tuple(h) for h in history_of(engine, old)]

    out = ok(
        run("requeue", str(old), "--reason", "billing API fixed", "--actor", "alice", database_url=seeded.url)
    )
    match = re.search(rf"^requeued {old} as (\d+)$", out, re.M)
    assert match and "1 message(s) requeued" in out, out
    new = int(match.group(1))

    assert fingerprint(engine, old) == before_row, "a requeue must never modify the old row"
    with engine.connect() as conn:
        copy = conn.execute(select(m).where(m.c.id == new)).one()
        original = conn.execute(select(m).where(m.c.id == old)).one()
    assert copy.requeued_from == old and copy.status == "pending" and copy.attempts == 0
    assert copy.last_error is None and copy.delivered_at is None and copy.locked_by is None
    assert copy.idempotency_key == f"order:7~requeue:{old}"
    for column in ("event_id", "event_type", "handler", "queue", "priority", "payload", "headers"):
        assert getattr(copy, column) == getattr(original, column), column
    assert original.status == "dead"

    history = history_of(engine, old)
    assert [tuple(h) for h in history[:-1]] == before_history, "earlier history is untouched"
    requeued = history[-1]
    assert (requeued.outcome, requeued.actor, requeued.reason) == ("requeued", "alice", "billing API fixed")
    assert requeued.detail == {"new_id": new, "previous_status": "dead", **login_of(engine)}
    assert history_of(engine, new) == []

    shown_json, shown_text = run_all([["show", str(old), "--json"], ["show", str(old)]], seeded.url)
    shown = ok_json(shown_json)
    assert [h["outcome"] for h in shown["attempts"]] == ["failed", "dead", "requeued"]
    assert shown["attempts"][-1]["detail"]["new_id"] == new
    assert (shown["message"]["status"], shown["message"]["requeued_to"]) == ("dead", new)
    assert re.search(rf"^\s+requeued_to: {new}$", ok(shown_text), re.M)

    seeded.billing_fixed[0] = True
    seeded.deliver("billing")
    assert statuses(engine)[f"order:7~requeue:{old}"] == "delivered"
    assert [h.outcome for h in history_of(engine, new)] == ["delivered"]
    assert fingerprint(engine, old) == before_row, "delivering the copy leaves the original alone too"


def test_requeue_refuses_what_it_must_not_copy(seeded):
    engine, delivered, dead = seeded.engine, seeded.id("signup:1"), seeded.id("order:7")
    assert ops.requeue(engine, ops.MessageFilter(ids=(dead,)), reason="first try", actor="alice")
    before = snapshot(engine)

    wrong_status, twice = run_all(
        [["requeue", str(delivered), "--reason", "again"], ["requeue", str(dead), "--reason", "again"]],
        seeded.url,
    )
    assert_one_line_error(wrong_status, 1, f"not {delivered} (delivered)")
    # The old row stays dead, so a second copy would deliver the event twice.
    assert_one_line_error(twice, 1, "already requeued", str(dead))
    assert snapshot(engine) == before, "a refused requeue changes nothing"


def test_bulk_requeue_asks_for_yes_and_reports_counts(seeded):
    engine = seeded.engine
    dead = sorted(ids_where(engine, m.c.status == "dead"))
    before = snapshot(engine)

    refused = run("requeue", "--handler", "invoice", "--reason", "billing API fixed", database_url=seeded.url)
    assert_one_line_error(refused, 1, "2 message(s)", "--yes")
    assert snapshot(engine) == before, "no answer, no action"

    out = ok(
        run(
            "requeue",
            "--handler",
            "invoice",
            "--reason",
            "billing API fixed",
            "--actor",
            "ops-bot",
            "--yes",
            database_url=seeded.url,
        )
    )
    pairs = [tuple(map(int, p)) for p in re.findall(r"^requeued (\d+) as (\d+)$", out, re.M)]
    assert [old for old, _ in pairs] == dead and out.rstrip().endswith("2 message(s) requeued"), out
    with engine.connect() as conn:
        copies = dict(
            conn.execute(select(m.c.id, m.c.requeued_from).where(m.c.requeued_from.is_not(None))).all()
        )
    assert copies == {new: old for old, new in pairs}
    for old, new in pairs:
        (requeued,) = [h for h in history_of(engine, old) if h.outcome == "requeued"]
        assert (requeued.actor, requeued.detail["new_id"]) == ("ops-bot", new)
    assert snapshot(engine)["outbox_message"][: len(before["outbox_message"])] == before["outbox_message"]

    # The originals are still dead; running the same bulk requeue again must not copy them twice.
    again = run(
        "requeue", "--status", "dead", "--reason", "again", "--json", "--yes", database_url=seeded.url
    )
    assert ok_json(again) == []


def test_a_grouped_copy_waits_for_its_dead_original_to_be_discarded(seeded):
    """The runbook for ordered groups (docs/relay.md): requeue the dead head, then discard it."""
    engine, head = seeded.engine, seeded.id("order:8")
    ((_, copy),) = ops.requeue(engine, ops.MessageFilter(ids=(head,)), reason="billing fixed", actor="t")
    seeded.billing_fixed[0] = True
    Relay(seeded.ob, engine, queues=["billing"]).run_until_idle()
    assert statuses(engine)[f"order:8~requeue:{head}"] == "pending", "held by its dead original"

    out = ok(run("discard", str(head), "--reason", "requeued as the copy", database_url=seeded.url))
    assert out.strip() == f"1 message(s) discarded: {head}"
    seeded.deliver("billing")
    assert statuses(engine)[f"order:8~requeue:{head}"] == "delivered"
    assert [h.outcome for h in history_of(engine, copy)] == ["delivered"]
    assert [h.outcome for h in history_of(engine, head)] == ["failed", "dead", "requeued", "discarded"]


# -- discard --------------------------------------------------------------------------------------


def test_discard_records_who_and_why_and_refuses_finished_messages(seeded):
    engine = seeded.engine
    pending, dead = seeded.id("report:2026-10"), seeded.id("order:8")
    delivered, running = seeded.id("signup:2"), seeded.id("report:2026-09")

    out = ok(
        run(
            "discard",
            str(pending),
            str(dead),
            "--reason",
            "customer cancelled",
            "--actor",
            "bob",
            database_url=seeded.url,
        )
    )
    assert out.strip() == f"2 message(s) discarded: {min(pending, dead)}, {max(pending, dead)}"
    now = statuses(engine)
    assert now["report:2026-10"] == now["order:8"] == "discarded"
    for message_id, previous in ((pending, "pending"), (dead, "dead")):
        last = history_of(engine, message_id)[-1]
        assert (last.outcome, last.actor, last.reason) == ("discarded", "bob", "customer cancelled")
        assert last.detail == {"previous_status": previous, **login_of(engine)}

    before = snapshot(engine)
    refused = run("discard", str(delivered), str(running), "--reason", "oops", database_url=seeded.url)
    assert_one_line_error(refused, 1, f"{delivered} (delivered)", f"{running} (running)")
    assert snapshot(engine) == before, "a refused discard changes nothing"


# -- purge ----------------------------------------------------------------------------------------


def test_purge_deletes_finished_messages_then_history_and_nothing_else(seeded):
    engine = seeded.engine
    # A discarded original with a pending requeued copy, and a discarded message nobody points at.
    original = seeded.id("report:2026-11")
    ((_, copy),) = ops.requeue(
        engine, ops.MessageFilter(ids=(original,)), reason="wanted after all", actor="t"
    )
    ops.discard(engine, ops.MessageFilter(ids=(seeded.id("report:2026-10"),)), reason="dup", actor="t")
    with engine.connect() as conn:
        attempts_before = conn.execute(select(func.count()).select_from(a)).scalar_one()

    first = ok_json(
        run("purge", "--delivered-older-than", "0s", "--batch-size", "1", "--json", database_url=seeded.url)
    )
    assert first == {"messages": 3, "attempts": 0, "markers": 0, "batches": 3}
    assert statuses(engine) == {
        "order:7": "dead",
        "order:8": "dead",
        "report:2026-09": "running",
        "report:2026-11": "discarded",  # a requeued copy still points at it
        f"report:2026-11~requeue:{original}": "pending",
    }
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(a)).scalar_one() == attempts_before, (
            "history outlives its messages unless --history-older-than says otherwise"
        )

    # Once the copy is delivered it goes, and then its original may too (copy first: the foreign key).
    # The history of the dead orders stays: nobody has decided about them yet.
    seeded.deliver("reports")
    age_history(engine)
    dead = [seeded.id("order:7"), seeded.id("order:8")]
    with engine.connect() as conn:
        attempts_before = conn.execute(select(func.count()).select_from(a)).scalar_one()
        of_dead = select(a.c.id).where(a.c.message_id.in_(dead)).order_by(a.c.id)
        undecided = conn.execute(of_dead).scalars().all()
    assert len(undecided) == 4  # a failure and a death each
    out = ok(
        run("purge", "--delivered-older-than", "0s", "--history-older-than", "1d", database_url=seeded.url)
    )
    purged = attempts_before - len(undecided)
    assert out.strip() == f"purged 2 message(s) and {purged} history row(s)"
    assert statuses(engine) == {"order:7": "dead", "order:8": "dead", "report:2026-09": "running"}
    assert copy not in ids_where(engine)
    with engine.connect() as conn:
        assert conn.execute(select(a.c.id).order_by(a.c.id)).scalars().all() == undecided
        runs = conn.execute(select(outbox.outbox_retention_run).order_by(outbox.outbox_retention_run.c.id))
        assert [(r.messages_deleted, r.attempts_deleted) for r in runs] == [(3, 0), (2, purged)]

    # Outside purge, history is as append-only as before it.
    ops.discard(engine, ops.MessageFilter(ids=(seeded.id("order:8"),)), reason="after the purge", actor="t")
    with engine.connect() as conn:
        kept = conn.execute(select(a).order_by(a.c.id)).all()
    statements = ["UPDATE outbox_attempt SET reason = 'rewritten'", "DELETE FROM outbox_attempt"]
    if engine.dialect.name == "postgresql":
        statements.append("TRUNCATE outbox_attempt")
    for statement in statements:
        # SQLite refuses DELETE before it runs: the permission function exists only inside purge.
        with pytest.raises(DBAPIError, match="append-only|outbox_purge_in_progress"), engine.begin() as conn:
            conn.execute(text(statement))
    with engine.connect() as conn:
        assert conn.execute(select(a).order_by(a.c.id)).all() == kept


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def migrated_sqlite(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "outbox.db"
    path.write_bytes(sqlite_template.read_bytes())
    return f"sqlite:///{path}"


BAD_INPUT: list[tuple[str, list[str], int, list[str]]] = [
    ("unknown command", ["frobnicate"], 2, ["invalid choice: 'frobnicate'"]),
    ("no URL", ["stats"], 2, ["--database-url is required", "OUTBOX_DATABASE_URL"]),
    ("not a URL", ["stats", "--database-url", "no-such-scheme"], 2, ["not a SQLAlchemy database URL"]),
    (
        "no such driver",
        ["stats", "--database-url", "postgresql+nodriver://x/y"],
        2,
        ["cannot use", "nodriver"],
    ),
    (
        "unreachable PostgreSQL",
        ["requeue", "1", "--reason", "r", "--database-url", UNREACHABLE_PG],
        1,
        ["outbox requeue:", "127.0.0.1", "port 1"],
    ),
    (
        "not migrated",
        ["stats", "--database-url", "sqlite://"],
        1,
        ["the outbox tables are missing in sqlite://", "run `outbox migrate --database-url ...` first"],
    ),
    (
        "bad filter",
        ["list", "--since", "yesterday", "--database-url", "sqlite://"],
        2,
        ["--since", "'yesterday'"],
    ),
    ("zero page size", ["list", "--limit", "0", "--database-url", "sqlite://"], 2, ["--limit", "at least 1"]),
    ("bad id", ["show", "abc", "--database-url", "sqlite://"], 2, ["integers", "'abc'"]),
    (
        "bad duration",
        ["purge", "--delivered-older-than", "3x", "--database-url", "sqlite://"],
        2,
        ["bad duration '3x'", "s, m, h, d, w"],
    ),
    ("id past bigint", ["show", "9" * 20, "--database-url", "sqlite://"], 2, ["at most 9223372036854775807"]),
    ("5,000-digit id", ["discard", "9" * 5000, "--reason", "r"], 2, ["argument ID: must be at most"]),
    ("id in Arabic-Indic digits", ["show", "\u0663", "--database-url", "sqlite://"], 2, ["integers"]),
    ("page past bigint", ["list", "--limit", "9" * 20], 2, ["--limit: must be at most"]),
    (
        "batch past bigint",
        ["purge", "--delivered-older-than", "1d", "--batch-size", "9" * 20],
        2,
        ["--batch-size"],
    ),
    (
        "time before year 1 in UTC",
        ["list", "--since", "0001-01-01T00:00+01:00"],
        2,
        ["--since", "out of range"],
    ),
    (
        "time past 9999 in UTC",
        ["list", "--before", "9999-12-31T23:00-05:00"],
        2,
        ["--before", "out of range"],
    ),
    ("non-UTF-8 handler", ["list", "--handler", "\udcff"], 2, ["--handler: '\\xff' is not valid UTF-8"]),
    ("non-UTF-8 reason", ["requeue", "--queue", "q", "--reason", "r\udcff", "--yes"], 2, ["--reason"]),
    ("non-UTF-8 actor", ["purge", "--delivered-older-than", "1d", "--actor", "\udcff"], 2, ["--actor"]),
    ("non-UTF-8 revision", ["migrate", "--revision", "\udcff"], 2, ["--revision"]),
    (
        "non-UTF-8 URL",
        ["stats", "--database-url", "sqlite:///\udcff"],
        2,
        ["--database-url is not valid UTF-8"],
    ),
]


def test_bad_input_gets_one_line_and_a_non_zero_exit():
    results = run_all([args for _, args, _, _ in BAD_INPUT], None)
    for (case, _, code, needles), result in zip(BAD_INPUT, results, strict=True):
        try:
            line = assert_one_line_error(result, code, *needles)
        except AssertionError as failure:
            raise AssertionError(f"{case}: {failure}") from None
        assert "s3cret-pw" not in line, "passwords in URLs are never echoed"


def test_refusals_on_an_empty_database_name_the_problem(migrated_sqlite):
    unknown, everything = run_all(
        [["requeue", "42", "--reason", "r"], ["discard", "--reason", "r", "--yes"]], migrated_sqlite
    )
    assert_one_line_error(unknown, 1, "no message with id 42")
    assert_one_line_error(everything, 1, "never acts on everything")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["show", "99999999999999999999"], "argument id: must be at most 9223372036854775807"),
        (["list", "--before-id", "99999999999999999999"], "--before-id: must be at most"),
        (["list", "--handler", "\udcff"], "--handler: '\\xff' is not valid UTF-8 text"),
        (["discard", "--event-type", "\udcff", "--reason", "r", "--yes"], "--event-type"),
    ],
    ids=["show-past-bigint", "before-id-past-bigint", "handler-not-utf8", "event-type-not-utf8"],
)
def test_ids_past_bigint_and_text_that_is_not_utf_8_are_usage_errors_on_either_database(
    database_url, args, needle
):
    """SQLite raised OverflowError for the ids and the driver UnicodeEncodeError for the text."""
    assert_one_line_error(run(*args, database_url=database_url), 2, needle)


def test_a_reader_that_stops_early_gets_no_traceback(migrated_sqlite):
    """``outbox stats | head -1``: the pipe closes before the command writes; it exits 1, quietly."""
    for args in (["stats"], ["list", "--json"]):
        proc = subprocess.Popen(
            outbox_cmd(*args, database_url=migrated_sqlite),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the interpreter has even started
        stderr = proc.stderr.read()
        assert proc.wait(timeout=60) == 1, stderr
        assert stderr == "", stderr


def test_show_labels_a_deferral_that_used_no_attempt(database_url, engine):
    """An unavailable destination defers without using an attempt; show must not number it as one."""
    ob = Outbox(default_backoff=FAST)
    calls: list[int] = []

    def flaky(msg: Message) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RetryLater("receiver unavailable", delay=0, counts_as_attempt=False)

    ob.route("e", flaky, name="partner")
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            emit(s, "e", {"n": 1})
    finally:
        ob.uninstall(maker)
    for _ in range(3):
        Relay(ob, engine).run_until_idle()
    with engine.connect() as conn:
        mid = conn.execute(select(m.c.id)).scalar_one()
    out = ok(run("show", str(mid), database_url=database_url))
    lines = [line.split() for line in out.splitlines() if line.startswith("1 ")]
    assert len(lines) == 2
    assert lines[0][:4] == ["1", "not", "counted", "deferred"]
    assert lines[1][:2] == ["1", "delivered"]
