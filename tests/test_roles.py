"""The least-privilege roles of docs/operations.md, created from the guide's own SQL, doing their jobs.

The GRANT block is read out of docs/operations.md, so the guide and this test cannot drift.
Role names are made unique per test (roles are cluster-wide); everything else runs as written.
Each role then does its job over its own login (the application emits, the relay drains with
an email handler and a report job, the operator runs the ``outbox`` command) and is refused
what it must not do.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aging import age_history
from relayproc import wait_until
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, func, insert, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from test_email import start_server
from test_ops_cli import assert_one_line_error, ok, ok_json, run

import outbox
from outbox import Backoff, Message, Outbox, PermanentError, emit, ops, signals
from outbox.integrations.email import EmailHandler, outbox_email_sent
from outbox.integrations.report import ReportJob, outbox_report_chunk
from outbox.ops import relays
from outbox.relay import Relay

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
ROLES = ("outbox_app", "outbox_relay", "outbox_operator", "outbox_consumer")
m, a = outbox.outbox_message, outbox.outbox_attempt

sales = Table("sales", MetaData(), Column("id", Integer, primary_key=True), Column("region", String(20)))


def roles_sql() -> str:
    """The fenced block of the guide that starts with the least-privilege comment."""
    blocks = re.findall(r"```sql\n(.*?)```", GUIDE.read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith("-- Least-privilege roles")]
    return block


@dataclass
class Roles:
    names: dict[str, str]
    urls: dict[str, str]
    engines: dict[str, Engine]

    def engine(self, role: str) -> Engine:
        if role not in self.engines:
            self.engines[role] = create_engine(self.urls[role])
        return self.engines[role]


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    yield from guide_roles(pg_url)


def guide_roles(pg_url: str) -> Iterator[Roles]:
    """The guide's roles in ``pg_url``'s database, with unique names; dropped again afterwards."""
    suffix = uuid.uuid4().hex[:10]
    names = {role: f"{role}_{suffix}" for role in ROLES}
    pattern = r"\b(outbox_app|outbox_relay|outbox_operator|outbox_consumer)\b"
    sql = re.sub(pattern, lambda r: names[r.group(1)], roles_sql())
    assert sql.count("CREATE ROLE") == len(ROLES)
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(sql)  # the guide's block, as one script
        # The application's own table, which its reports read: granted by the application, not the guide.
        sales.create(conn)
        conn.execute(insert(sales), [{"id": i, "region": f"r{i % 3}"} for i in range(1, 31)])
        conn.exec_driver_sql(f"GRANT SELECT ON sales TO {names['outbox_app']}, {names['outbox_relay']}")
    urls = {role: make_url(pg_url).set(username=name).render_as_string(False) for role, name in names.items()}
    found = Roles(names, urls, {})
    try:
        yield found
    finally:
        for engine in found.engines.values():
            engine.dispose()
        with admin.begin() as conn:
            for name in names.values():
                conn.exec_driver_sql(
                    f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"
                )
                conn.exec_driver_sql(f'DROP OWNED BY "{name}"')  # the grants in this database
                conn.exec_driver_sql(f'DROP ROLE "{name}"')
        admin.dispose()


def refused(engine: Engine, statement: str, why: str = "permission denied") -> None:
    with pytest.raises(DBAPIError, match=why), engine.begin() as conn:
        conn.execute(text(statement))


class Shop:
    """One Outbox for both sides: an email route, a ledger that fails order 2, a sales report."""

    def __init__(self, relay_engine: Engine, smtp_port: int, output: Path) -> None:
        self.ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
        self.ledger_fixed = False
        self.ob.route(
            "user.signed_up",
            EmailHandler("127.0.0.1", smtp_port, sender="shop@example.com", sent_log=relay_engine),
            name="welcome_email",
            queue="mail",
        )

        @self.ob.handler("order.paid", name="ledger", max_attempts=2)
        def ledger(msg: Message) -> None:
            if msg.payload["order_id"] == 2 and not self.ledger_fixed:
                raise PermanentError("unknown currency XYZ")

        self.report = ReportJob(
            self.ob,
            "sales",
            engine=relay_engine,
            header=["id", "region"],
            count=lambda s, params: s.scalar(select(func.count()).select_from(sales)) or 0,
            rows=lambda s, params, offset, limit: s.execute(
                select(sales.c.id, sales.c.region).order_by(sales.c.id).offset(offset).limit(limit)
            ),
            output_dir=output,
            chunk_size=10,
        )


def statuses(engine: Engine) -> dict[tuple[str, str | None], str]:
    with engine.connect() as conn:
        return {(r.handler, r.idempotency_key): r.status for r in conn.execute(select(m))}


def test_the_guides_roles_do_their_jobs_and_nothing_more(roles, pg_engine, request, tmp_path):
    smtp = start_server(request)
    app, relay_engine = roles.engine("outbox_app"), roles.engine("outbox_relay")
    shop = Shop(relay_engine, smtp.port, tmp_path)
    maker: sessionmaker[Session] = sessionmaker(app)
    shop.ob.install(maker)
    request.addfinalizer(lambda: shop.ob.uninstall(maker))

    # -- the application emits, idempotently, and starts a report -----------------------------
    with maker.begin() as s:
        emit(
            s, "user.signed_up", {"to": "ada@example.com", "subject": "Hi", "text": "Welcome"}, key="signup:1"
        )
        for order in (1, 2):
            emit(s, "order.paid", {"order_id": order}, key=f"order:{order}")
        run_id = shop.report.start(s)
    duplicates: list[dict[str, Any]] = []
    signals.event_deduplicated.connect(lambda sender, **kw: duplicates.append(kw), sender=shop.ob, weak=False)
    with maker.begin() as s:  # the retried request: ON CONFLICT on the key, no error, nothing stored
        emit(s, "order.paid", {"order_id": 1, "again": True}, key="order:1")
    # ... and announced, naming the message that holds the key: the guide's grant lets it read the id.
    with pg_engine.connect() as conn:
        holder = conn.execute(select(m.c.id).where(m.c.idempotency_key == "order:1")).scalar_one()
    assert [(kw["key"], kw["existing_id"]) for kw in duplicates] == [("order:1", holder)]
    with maker.begin() as s:  # due in an hour: the operator discards it below
        emit(s, "order.paid", {"order_id": 3}, key="order:3", delay=3600)
    assert len(statuses(pg_engine)) == 1 + 3 + 3  # mail, three orders, three report chunks
    assert shop.report.progress(run_id).status == "running"

    for statement in (
        "UPDATE outbox_message SET status = 'delivered'",
        "DELETE FROM outbox_message",
        "SELECT payload FROM outbox_message",
        "SELECT id FROM outbox_attempt",
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at)"
        " VALUES (1, 1, 'delivered', now())",
        "DELETE FROM outbox_attempt",
        "SELECT id FROM outbox_retention_run",
        "SELECT message_id FROM outbox_email_sent",
        "UPDATE outbox_report_run SET status = 'complete'",
    ):
        refused(app, statement)

    # -- the relay drains: email with its sent-log, the ledger, the report's chunks ------------
    # One claim first whose relay "crashes": the drain recovers its lease (a lease_expired row).
    crashed = Relay(shop.ob, relay_engine, lease=0.05).store.claim("default", ["ledger"], 1)
    assert len(crashed) == 1
    time.sleep(0.1)
    result = Relay(shop.ob, relay_engine).run_until_idle()
    assert (result.delivered, result.dead, result.recovered) == (5, 1, 1)
    assert statuses(pg_engine) == {
        ("welcome_email", "signup:1"): "delivered",
        ("ledger", "order:1"): "delivered",
        ("ledger", "order:2"): "dead",
        ("ledger", "order:3"): "pending",
        **{("report.sales", f"report:{run_id}:{chunk}"): "delivered" for chunk in range(3)},
    }
    assert [r.rcpt_tos for r in smtp.script.received] == [["ada@example.com"]]
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox_email_sent)).scalar_one() == 1
        assert conn.execute(select(func.count()).select_from(outbox_report_chunk)).scalar_one() == 3
    progress = shop.report.progress(run_id)
    assert progress.status == "complete" and progress.row_count == 30

    for statement in (
        "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
        " max_attempts, available_at, created_at, updated_at)"
        " VALUES (gen_random_uuid(), 'e', 'h', 'q', 0, '{}', '{}', 1, now(), now(), now())",
        "DELETE FROM outbox_message",
        "UPDATE outbox_attempt SET reason = 'rewritten'",
        "DELETE FROM outbox_attempt",
        "TRUNCATE outbox_attempt",
        "SELECT id FROM outbox_retention_run",
        "DELETE FROM outbox_email_sent",
        "DELETE FROM outbox_report_run",
    ):
        refused(relay_engine, statement)

    # -- the operator runs the outbox command over its own login --------------------------------
    url = roles.urls["outbox_operator"]
    ids = {key: i for (_, key), i in _ids(pg_engine).items()}
    dead, later, mail = ids["order:2"], ids["order:3"], ids["signup:1"]

    stats = ok_json(run("stats", "--json", database_url=url))
    assert stats["dead"] == 1 and stats["by_status"]["delivered"] == 5
    shown = ok_json(run("show", str(dead), "--json", database_url=url))
    assert [h["outcome"] for h in shown["attempts"]] == ["dead"]
    assert str(dead) in ok(run("list", "--status", "dead", database_url=url))

    out = ok(run("requeue", str(dead), "--reason", "XYZ added", "--actor", "alice", database_url=url))
    (copy,) = map(int, re.findall(rf"^requeued {dead} as (\d+)$", out, re.M))
    # retry-now: an UPDATE of the message, an appended history row and a NOTIFY, nothing more.
    rushed = ok_json(
        run("retry-now", str(later), "--include-delayed", "--reason", "rush", "--json", database_url=url)
    )
    assert rushed == {"retried_now": [later]}
    (followed,) = ok(run("tail", "--last", "1", "--count", "1", "--json", database_url=url)).splitlines()
    assert '"outcome": "retried_now"' in followed
    where = ["--where", "payload.order_id=3", "--json"]
    assert [r["id"] for r in ok_json(run("list", *where, database_url=url))] == [later]
    ok(run("discard", str(later), "--reason", "order cancelled", "--actor", "alice", database_url=url))
    assert ok_json(run("stats", "--json", database_url=url))["dead"] == 0

    shop.ledger_fixed = True
    assert Relay(shop.ob, relay_engine).run_until_idle().delivered == 1
    with pg_engine.connect() as conn:
        assert conn.execute(select(m.c.status).where(m.c.id == copy)).scalar_one() == "delivered"
        history_rows = conn.execute(select(func.count()).select_from(a)).scalar_one()

    # The operator purges through the purge functions: it writes neither history nor their record.
    for statement in (
        "UPDATE outbox_attempt SET reason = 'rewritten'",
        "TRUNCATE outbox_attempt",
        "DELETE FROM outbox_attempt",
        "DELETE FROM outbox_message",
        "INSERT INTO outbox_retention_run (started_at, actor, delivered_before) VALUES (now(), 'x', now())",
        "UPDATE outbox_retention_run SET attempts_deleted = 0",
    ):
        refused(roles.engine("outbox_operator"), statement)

    age_history(pg_engine)  # the history is from today; a purge takes nothing younger than a day
    purged = ok_json(
        run(
            "purge",
            "--delivered-older-than",
            "0s",
            "--history-older-than",
            "1d",
            "--json",
            "--actor",
            "retention-job",
            database_url=url,
        )
    )
    # Every delivered or discarded message except the requeued original (dead, kept for the record).
    assert purged == {"messages": 7, "attempts": history_rows, "markers": 0, "batches": 2}
    assert set(_ids(pg_engine).values()) == {dead}
    with pg_engine.connect() as conn:
        (retention,) = conn.execute(select(outbox.outbox_retention_run)).all()
    assert (retention.actor, retention.db_user, retention.messages_deleted, retention.attempts_deleted) == (
        "retention-job",
        roles.names["outbox_operator"],
        7,
        history_rows,
    )
    assert retention.finished_at is not None
    assert mail not in _ids(pg_engine).values()

    # The operator's grants end at the outbox tables: the application's own data is not theirs.
    assert_one_line_error(run("show", "999999", database_url=url), 1, "no message with id 999999")
    refused(roles.engine("outbox_operator"), "SELECT id FROM sales")
    refused(roles.engine("outbox_operator"), "UPDATE outbox_report_run SET status = 'failed'")


def test_the_operator_pauses_and_resumes_and_the_relay_honours_it(roles, pg_engine, request):
    app, relay_engine = roles.engine("outbox_app"), roles.engine("outbox_relay")
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="ledger", queue="billing")
    maker: sessionmaker[Session] = sessionmaker(app)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": 1}, key="order:1")
    url = roles.urls["outbox_operator"]

    ok(run("pause", "--queue", "billing", "--reason", "ledger upgrade", "--actor", "alice", database_url=url))
    assert Relay(ob, relay_engine).run_until_idle().delivered == 0
    assert ok_json(run("stats", "--json", database_url=url))["paused"][0]["held_back"] == 1
    ok(run("resume", "--queue", "billing", "--reason", "upgraded", "--actor", "alice", database_url=url))
    assert Relay(ob, relay_engine).run_until_idle().delivered == 1
    (span,) = ok_json(run("show", str(_ids(pg_engine)["ledger", "order:1"]), "--json", database_url=url))[
        "pauses"
    ]
    assert (span["paused_by"], span["resumed_by"]) == ("alice", "alice")

    operator = roles.engine("outbox_operator")
    for statement in (
        "UPDATE outbox_pause_log SET reason = 'rewritten'",
        "DELETE FROM outbox_pause_log",
        "TRUNCATE outbox_pause_log",
        "UPDATE outbox_pause SET actor = 'someone else'",
        # A pause or resume with no log row, or a log row with any time and actor: only the
        # functions write either, stamped by the database's clock.
        "INSERT INTO outbox_pause (kind, name, reason, actor, paused_at)"
        " VALUES ('queue', 'q', 'r', 'a', now())",
        "DELETE FROM outbox_pause",
        "INSERT INTO outbox_pause_log (event, kind, name, at, actor, reason)"
        " VALUES ('resumed', 'queue', 'billing', now() - interval '1 year', 'someone else', 'r')",
    ):
        refused(operator, statement)
    with pg_engine.connect() as conn:
        logged = conn.execute(
            text("SELECT event, actor, at <= now() FROM outbox_pause_log ORDER BY id")
        ).all()
    assert [tuple(row) for row in logged] == [("paused", "alice", True), ("resumed", "alice", True)]
    for statement in (
        "INSERT INTO outbox_pause (kind, name, reason, actor, paused_at)"
        " VALUES ('queue', 'q', 'r', 'a', now())",
        "DELETE FROM outbox_pause",
        "SELECT id FROM outbox_pause_log",
    ):
        refused(relay_engine, statement)
    refused(app, "SELECT kind FROM outbox_pause")


def test_a_relay_keeps_its_registry_row_and_the_operator_reads_it(roles, pg_engine):
    """Serving under the relay role: the upsert at start, the refreshes, the stop; nothing else."""
    relay_engine, operator = roles.engine("outbox_relay"), roles.engine("outbox_operator")
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="ledger")
    relay = Relay(ob, relay_engine, relay_id="registered", registry_interval=0.1, listen=False)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        first = wait_until(lambda: relays(operator, period=0.1), "the relay's row, read by the operator")
        wait_until(lambda: relays(operator, period=0.1)[0].seen_at > first[0].seen_at, "a refresh")
    finally:
        relay.stop()
        thread.join(20)
    assert not thread.is_alive()
    (row,) = relays(operator, period=0.1)
    assert (row.relay_id, row.alive) == ("registered", False) and row.stopped_at is not None

    refused(roles.engine("outbox_app"), "SELECT relay_id FROM outbox_relay_registry")
    refused(relay_engine, "DELETE FROM outbox_relay_registry")
    for statement in (
        "UPDATE outbox_relay_registry SET stopped_at = now()",
        "DELETE FROM outbox_relay_registry",
        "INSERT INTO outbox_relay_registry (relay_id, host, pid, started_at, seen_at, queues, handlers)"
        " VALUES ('fake', 'h', 1, now(), now(), '[]', '{}')",
    ):
        refused(operator, statement)


def test_the_operator_resends_over_its_own_login_and_the_database_stamps_it(
    roles, pg_engine, request, monkeypatch
):
    """``outbox resend``, ``ops.resend`` and the dashboard's Resend, with the guide's grants only."""
    from test_dashboard import SAME_SITE, Client

    import outbox.ops._resend as resending
    from outbox.dashboard import create_app

    app, relay_engine, operator = (roles.engine(r) for r in ROLES[:3])
    received: list[Message] = []
    ob = Outbox()
    ob.route("order.paid", received.append, name="partner_webhook")
    maker: sessionmaker[Session] = sessionmaker(app)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": 42}, key="order:42")
    assert Relay(ob, relay_engine).run_until_idle().delivered == 1
    delivered = _ids(pg_engine)["partner_webhook", "order:42"]
    url = roles.urls["outbox_operator"]

    out = ok(
        run("resend", str(delivered), "--reason", "partner lost it", "--actor", "alice", database_url=url)
    )
    (copy,) = map(int, re.findall(rf"^resent {delivered} as (\d+)$", out, re.M))
    # The operator's host clock is an hour fast: the database stamps the copy and the history row.
    fast = datetime.now(UTC) + timedelta(hours=1)
    monkeypatch.setattr(resending, "_now", lambda: fast)
    ((_, again),) = ops.resend(
        operator, ops.MessageFilter(ids=(delivered,)), reason="lost again", actor="ops"
    )
    with Client(create_app(operator, allow_actions=True)) as dashboard:
        landed = dashboard.post(
            f"/messages/{delivered}/resend", data={"reason": "and again"}, headers=SAME_SITE
        )
        assert landed.status_code == 200 and "Resent from" in landed.text
    assert Relay(ob, relay_engine).run_until_idle().delivered == 3
    assert [msg.event_id for msg in received[1:]] == [received[0].event_id] * 3
    with pg_engine.connect() as conn:
        database_now = conn.execute(select(func.now())).scalar_one()
        rows = {r.id: r for r in conn.execute(select(m).where(m.c.requeued_from == delivered))}
        resent = conn.execute(select(a).where(a.c.message_id == delivered, a.c.outcome == "resent")).all()
    assert copy in rows and again in rows and len(rows) == 3
    assert [(h.actor, h.detail["db_user"]) for h in resent] == [
        ("alice", roles.names["outbox_operator"]),
        ("ops", roles.names["outbox_operator"]),
        ("dashboard", roles.names["outbox_operator"]),
    ]
    for stamp in (rows[again].created_at, rows[again].available_at, resent[1].started_at):
        assert stamp <= database_now < fast - timedelta(minutes=50)

    # What the function does, plain SQL over the operator's login cannot: no copy, no history row.
    refused(
        operator,
        "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
        " max_attempts, available_at, created_at, updated_at)"
        f" SELECT event_id, event_type, handler, queue, priority, payload, headers, max_attempts,"
        f" now(), now(), now() FROM outbox_message WHERE id = {delivered}",
    )
    refused(
        operator,
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at)"
        f" VALUES ({delivered}, 1, 'resent', now())",
    )
    # A login that may read messages but was not granted the function is told so, in one line.
    assert_one_line_error(
        run("resend", str(delivered), "--reason", "r", database_url=roles.urls["outbox_relay"]),
        1,
        "may not run the outbox action functions",
    )


def test_relays_share_breakers_and_the_operator_resets_them_over_their_own_logins(roles, pg_engine, request):
    """The relay opens and closes shared breakers through its functions, the operator resets them."""
    from test_webhook import LOCAL, SECRET, Receiver, Reply, serve

    from outbox.integrations.webhook import WebhookHandler

    app, relay_engine, operator = (roles.engine(r) for r in ROLES[:3])
    receiver = Receiver()
    receiver.default = Reply(500)
    serving = serve(receiver)
    next(serving)
    request.addfinalizer(lambda: next(serving, None))
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    handler = WebhookHandler(
        receiver.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=1, breaker_cooldown=60
    )
    ob.route("order.paid", handler, name="partner", max_attempts=20)
    maker: sessionmaker[Session] = sessionmaker(app)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    for order in (1, 2):
        with maker.begin() as s:
            emit(s, "order.paid", {"order_id": order}, key=f"order:{order}")
    Relay(ob, relay_engine, relay_id="relay-1").run_until_idle()
    destination = f"127.0.0.1:{receiver.port}"
    url = roles.urls["outbox_operator"]
    (listed,) = ok_json(run("breaker", "list", "--json", database_url=url))
    assert (listed["destination"], listed["route"], listed["opened_by"]) == (
        destination,
        "partner",
        "relay-1",
    )

    # Reset over the operator's login: every relay sends again; a successful delivery is no news.
    ok(
        run(
            "breaker",
            "reset",
            destination,
            "--reason",
            "partner is back",
            "--actor",
            "alice",
            database_url=url,
        )
    )
    receiver.default = Reply(200)
    # The reset released what the breaker parked; retry-now sends the rest (the delivery that waited for
    # the next trial request, or retried a counted failure) now too.
    done = ops.retry_now(operator, ops.MessageFilter(handler="partner"), reason="send them", actor="alice")
    assert 1 <= len(done) <= 2
    assert Relay(ob, relay_engine, relay_id="relay-1").run_until_idle().delivered == 2
    # Down again: the relay opens it; a retry-now over the operator's login clears it.
    receiver.default = Reply(500)
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": 3}, key="order:3")
    Relay(ob, relay_engine, relay_id="relay-1").run_until_idle()
    assert len(ops.breakers(operator)) == 1
    retried = ["retry-now", "--handler", "partner", "--reason", "back", "--actor", "alice", "--yes"]
    ok(run(*retried, database_url=url))
    assert ops.breakers(operator) == []
    with pg_engine.connect() as conn:
        logged = conn.execute(select(outbox.outbox_breaker_log).order_by(text("id"))).all()
    relay_login, operator_login = roles.names["outbox_relay"], roles.names["outbox_operator"]
    assert [(r.event, r.relay_id, r.actor, r.db_user) for r in logged] == [
        ("opened", "relay-1", None, relay_login),
        ("reset", None, "alice", operator_login),
        ("opened", "relay-1", None, relay_login),
        ("retried_now", None, "alice", operator_login),
    ]

    # Only the functions write: neither login can open, close or log a breaker with plain SQL.
    fake = (
        "INSERT INTO outbox_breaker (destination, handler, failures, opened_at, reopen_at, opened_by,"
        " updated_at) VALUES ('x:1', 'partner', 1, now(), now() + interval '1 day', 'r', now())"
    )
    for login in (relay_engine, operator):
        for statement in (
            fake,
            "DELETE FROM outbox_breaker",
            "UPDATE outbox_breaker SET reopen_at = now()",
            "INSERT INTO outbox_breaker_log (event, destination, handler, at)"
            " VALUES ('reset', 'x:1', 'partner', now())",
        ):
            refused(login, statement)
    refused(relay_engine, "SELECT id FROM outbox_breaker_log")
    refused(app, "SELECT destination FROM outbox_breaker")
    assert_one_line_error(
        run("breaker", "reset", destination, "--reason", "r", database_url=roles.urls["outbox_relay"]),
        1,
        "may not run the outbox action functions",
    )


def test_the_operator_releases_what_a_breaker_parked_over_its_own_login(roles, pg_engine, request):
    """Parked by the relay's login, listed, shown and released by the operator's: each through its grants."""
    from test_webhook import LOCAL, SECRET, Receiver, Reply, serve

    from outbox.integrations.webhook import WebhookHandler

    app, relay_engine, operator = (roles.engine(r) for r in ROLES[:3])
    receiver = Receiver()
    receiver.default = Reply(503)
    serving = serve(receiver)
    next(serving)
    request.addfinalizer(lambda: next(serving, None))
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    handler = WebhookHandler(
        receiver.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=1, breaker_cooldown=60
    )
    ob.route("order.paid", handler, name="partner")
    maker: sessionmaker[Session] = sessionmaker(app)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    with maker.begin() as s:
        for order in (1, 2, 3):
            emit(s, "order.paid", {"order_id": order}, key=f"order:{order}")
    Relay(ob, relay_engine, relay_id="relay-1", concurrency=1).run_until_idle()
    destination = f"127.0.0.1:{receiver.port}"
    ids = _ids(pg_engine)
    first, second, third = (ids["partner", f"order:{n}"] for n in (1, 2, 3))
    # The 503 that opened the breaker parks its message; of the others, one comes back for the next
    # trial (in a minute), the rest wait for the destination. None used an attempt.
    assert ops.stats(operator).parked == {destination: 2}
    with pg_engine.connect() as conn:
        waiting = dict(conn.execute(select(m.c.id, m.c.parked_on)).all())
        assert set(conn.scalars(select(m.c.attempts))) == {0}
    assert waiting == {first: destination, second: None, third: destination}
    url = roles.urls["outbox_operator"]
    assert f"waiting for {destination} to recover" in ok(run("show", str(third), database_url=url))

    ok(run("breaker", "reset", destination, "--reason", "partner is back", database_url=url))
    with pg_engine.connect() as conn:
        released = {r.id: r for r in conn.execute(select(m.c.id, m.c.parked_on, m.c.available_at))}
        now = conn.scalar(select(func.now()))
    assert all(released[i].parked_on is None and released[i].available_at <= now for i in (first, third))
    assert released[second].available_at > now  # not parked: it waits for its trial
    receiver.default = Reply(200)
    assert Relay(ob, relay_engine, relay_id="relay-1").run_until_idle().delivered == 2


def _ids(engine: Engine) -> dict[tuple[str, str | None], int]:
    with engine.connect() as conn:
        return {(r.handler, r.idempotency_key): r.id for r in conn.execute(select(m))}


def test_the_guides_block_is_the_one_this_test_runs():
    """A guard for the extraction itself: four roles, only GRANT/CREATE ROLE, and no superpowers."""
    sql = roles_sql()
    statements = [s.strip() for s in re.sub(r"--[^\n]*", "", sql).split(";") if s.strip()]
    assert all(s.startswith(("CREATE ROLE", "GRANT")) for s in statements), statements
    assert not re.search(r"SUPERUSER|BYPASSRLS|CREATEROLE|ALL PRIVILEGES|TRUNCATE|OWNER", sql)
    for role in ROLES:
        assert f"CREATE ROLE {role} LOGIN;" in sql


def test_the_dashboard_runs_as_the_operator(roles, pg_engine, request):
    """Every page reads and every action writes with the operator's grants and nothing more."""
    from test_dashboard import SAME_SITE, Client

    from outbox.dashboard import create_app

    app = roles.engine("outbox_app")
    ob = Outbox()

    def refuse(msg: object) -> None:
        raise PermanentError("ledger refused it")

    ob.route("order.paid", refuse, name="ledger", queue="billing")
    maker: sessionmaker[Session] = sessionmaker(app)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": 1}, key="order:1")
    assert Relay(ob, roles.engine("outbox_relay")).run_until_idle().dead == 1
    dead = _ids(pg_engine)["ledger", "order:1"]

    with Client(create_app(roles.engine("outbox_operator"), allow_actions=True)) as dashboard:
        for path in ("/", "/messages?status=dead", f"/messages/{dead}", "/dead", "/queues", "/reports"):
            assert dashboard.get(path).status_code == 200, path
        paused = dashboard.post(
            "/queues/pause", data={"kind": "queue", "name": "billing", "reason": "r"}, headers=SAME_SITE
        )
        assert paused.status_code == 200
        copy = dashboard.post(f"/messages/{dead}/requeue", data={"reason": "retry it"}, headers=SAME_SITE)
        assert copy.status_code == 200 and "Requeued from" in copy.text
