"""The audit trail holds against the roles that touch it: docs/operations.md's threat model, tested.

"The attempt history is append-only, enforced by the database, and leaves only through a recorded
retention run." Each test connects as the role a line of the threat model is about (the guide's
own least-privilege roles, a role still holding an older guide's grants, the tables' owner, a
superuser) and tries what that line says it cannot do. Roles are cluster-wide: names are unique
per test.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import test_roles
from aging import age_history
from sqlalchemy import create_engine, func, insert, select, text, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker
from test_ops_cli import assert_one_line_error, run
from test_roles import refused

import outbox
from outbox import Backoff, Message, Outbox, PermanentError, emit, ops
from outbox.relay import Relay

m, a, runs = outbox.outbox_message, outbox.outbox_attempt, outbox.outbox_retention_run

#: The guide's application, relay and operator roles, created from its GRANT block.
roles = test_roles.roles

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
APPEND_ONLY = "outbox_attempt is append-only"
TEN_DAYS_AGO = datetime.now(UTC) - timedelta(days=10)


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


_SEEDED = itertools.count()


def seed_history(engine: Engine, message_ids: list[int], started_at: datetime = TEN_DAYS_AGO) -> None:
    """History rows at ``started_at``, each a microsecond apart: a row's key is never repeated."""
    with engine.begin() as conn:
        conn.execute(
            insert(a),
            [
                {
                    "message_id": i,
                    "attempt": 1,
                    "outcome": "retry",
                    "started_at": started_at + timedelta(microseconds=next(_SEEDED)),
                }
                for i in message_ids
            ],
        )


def emit_messages(engine: Engine, count_: int) -> list[int]:
    ob = Outbox()
    ob.route("audit.test", lambda msg: None, name="audited")
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            for n in range(count_):
                emit(s, "audit.test", {"n": n})
    finally:
        ob.uninstall(maker)
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.id).order_by(m.c.id)).scalars())


class Logins:
    """Extra roles for one test, dropped at the end."""

    def __init__(self, pg_url: str) -> None:
        self.pg_url = pg_url
        self.admin = create_engine(pg_url)
        self.names: list[str] = []
        self.engines: list[Engine] = []

    def role(self, label: str, grants: str = "") -> tuple[str, Engine]:
        name = f"{label}_{uuid.uuid4().hex[:10]}"
        with self.admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN; GRANT USAGE ON SCHEMA public TO {name};")
            if grants:
                conn.exec_driver_sql(grants.format(role=name))
        self.names.append(name)
        engine = create_engine(make_url(self.pg_url).set(username=name).render_as_string(False))
        self.engines.append(engine)
        return name, engine

    def drop(self) -> None:
        for engine in self.engines:
            engine.dispose()
        with self.admin.begin() as conn:
            for name in self.names:
                conn.exec_driver_sql(
                    f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'"
                )
                conn.exec_driver_sql(f'DROP OWNED BY "{name}"')
                conn.exec_driver_sql(f'DROP ROLE "{name}"')
        self.admin.dispose()


@pytest.fixture
def logins(pg_url: str) -> Iterator[Logins]:
    made = Logins(pg_url)
    try:
        yield made
    finally:
        made.drop()


#: What an operator was granted before outbox_0007 (the guide's block of that time).
LEGACY_OPERATOR = """
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_message TO {role};
GRANT SELECT, INSERT, DELETE ON outbox_attempt TO {role};
GRANT SELECT, INSERT, UPDATE ON outbox_retention_run TO {role};
"""


def shadow_and_delete(engine: Engine) -> None:
    """A temporary outbox_retention_run that names an open run with a cutoff at infinity, then DELETE."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TEMP TABLE outbox_retention_run"
                " (id bigint, finished_at timestamptz, history_before timestamptz)"
            )
        )
        conn.execute(text("INSERT INTO outbox_retention_run VALUES (1, NULL, 'infinity')"))
        conn.execute(text("SET search_path = pg_temp, public"))
        conn.execute(text("SELECT set_config('outbox.retention', '1', true)"))
        conn.execute(text("DELETE FROM outbox_attempt"))


@pytest.mark.parametrize("reads_runs", [True, False], ids=["can-read-runs", "cannot-read-runs"])
def test_a_temporary_table_cannot_stand_in_for_the_purge_record(logins, pg_engine, reads_runs):
    """A role with DELETE on history (an older guide's grant) shadows outbox_retention_run: refused
    with the append-only error, whether or not it may read the real table, and nothing is deleted."""
    seed_history(pg_engine, [1, 2, 3])
    grants = LEGACY_OPERATOR if reads_runs else "GRANT INSERT, DELETE ON outbox_attempt TO {role};"
    name, legacy = logins.role("outbox_legacy", grants)
    with pytest.raises(DBAPIError, match=APPEND_ONLY):
        shadow_and_delete(legacy)
    with pytest.raises(DBAPIError, match=APPEND_ONLY), legacy.begin() as conn:
        conn.execute(text("DELETE FROM outbox_attempt"))
    assert count(pg_engine, a) == 3
    assert count(pg_engine, runs) == 0

    # The guide's upgrade note takes the old grants back: then the privilege system refuses first.
    (block,) = [b for b in re.findall(r"```sql\n(.*?)```", GUIDE.read_text(), re.S) if "taken back" in b]
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(block.replace("outbox_operator", name))
    refused(legacy, "DELETE FROM outbox_attempt")


def test_a_role_still_holding_write_grants_cannot_forge_a_purge_record(logins, pg_engine):
    """The forgery: a run with its cutoff a century ahead, the newest history deleted under it, the
    cutoff then put back. Every write to outbox_retention_run is refused to anyone but the owner."""
    seed_history(pg_engine, [1], started_at=datetime.now(UTC))
    name, legacy = logins.role("outbox_legacy", LEGACY_OPERATOR)
    written_by_purge = "outbox_retention_run is written only by the outbox purge functions"
    with pytest.raises(DBAPIError, match=written_by_purge), legacy.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_retention_run (started_at, actor, delivered_before, history_before)"
                " VALUES (now(), 'forger', now(), now() + interval '100 years')"
            )
        )
    # Upgraded: the new EXECUTE granted, the old write grants not yet taken back. A genuine run,
    # started through the function by the same login, cannot be rewritten either.
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(f"GRANT EXECUTE ON FUNCTION outbox_purge_start TO {name}")
    with legacy.begin() as conn:
        run_id = conn.execute(text("SELECT outbox_purge_start('honest', interval '0', interval '90 days')"))
        run_id = run_id.scalar_one()
    for statement in (
        f"UPDATE outbox_retention_run SET history_before = now() + interval '100 years' WHERE id = {run_id}",
        f"UPDATE outbox_retention_run SET attempts_deleted = 0 WHERE id = {run_id}",
    ):
        refused(legacy, statement, written_by_purge)
    for statement in (
        f"DELETE FROM outbox_retention_run WHERE id = {run_id}",
        "TRUNCATE outbox_retention_run",
    ):
        refused(legacy, statement)  # never granted, by any version of the guide
    with legacy.begin() as conn:
        conn.execute(text("SELECT set_config('outbox.retention', :r, true)"), {"r": str(run_id)})
        with pytest.raises(DBAPIError, match=APPEND_ONLY):
            conn.execute(text("DELETE FROM outbox_attempt"))
    assert count(pg_engine, a) == 1


def test_the_operator_changes_history_only_through_the_purge_functions(roles, pg_engine):
    operator = roles.engine("outbox_operator")
    seed_history(pg_engine, [1])
    for statement in (
        "DELETE FROM outbox_attempt",
        "UPDATE outbox_attempt SET reason = 'rewritten'",
        "TRUNCATE outbox_attempt",
        "DELETE FROM outbox_message",
        "INSERT INTO outbox_retention_run (started_at, actor, delivered_before, history_before)"
        " VALUES (now(), 'forger', now(), now() + interval '100 years')",
        "UPDATE outbox_retention_run SET attempts_deleted = 0",
        "DELETE FROM outbox_retention_run",
    ):
        refused(operator, statement)
    # Nor, since outbox_0014, append a history row or change a message with plain SQL: its actions
    # go through functions that write their own history rows.
    refused(operator, "UPDATE outbox_message SET status = status")
    refused(
        operator,
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at) VALUES (1, 1, 'retry', now())",
    )
    with operator.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox_attempt")).scalar_one() == 1


def test_an_operator_hosts_clock_stamps_none_of_its_actions(roles, pg_engine, monkeypatch):
    """A host an hour fast once scheduled a requeued copy an hour late and stamped history with its
    own time; the action functions stamp both with the database's clock."""
    import outbox.ops._actions as actions
    import outbox.ops._pause as pauses

    fast = datetime.now(UTC) + timedelta(hours=1)
    monkeypatch.setattr(actions, "_now", lambda: fast)
    monkeypatch.setattr(pauses, "_now", lambda: fast)
    (dead_id,) = emit_messages(pg_engine, 1)
    with pg_engine.begin() as conn:
        conn.execute(update(m).where(m.c.id == dead_id).values(status="dead"))
    operator = roles.engine("outbox_operator")
    ((_, copy_id),) = ops.requeue(operator, ops.MessageFilter(ids=[dead_id]), reason="fixed", actor="ops")
    ops.pause(operator, queue="default", reason="maintenance", actor="ops")
    with pg_engine.connect() as conn:
        database_now = conn.execute(select(func.now())).scalar_one()
        copy = conn.execute(select(m).where(m.c.id == copy_id)).one()
        (requeued,) = conn.execute(select(a).where(a.c.message_id == dead_id)).all()
        (paused_at,) = conn.execute(text("SELECT at FROM outbox_pause_log")).scalars()
    for stamp in (copy.available_at, copy.created_at, requeued.started_at, paused_at):
        assert stamp <= database_now < fast - timedelta(minutes=50)
    assert requeued.detail["db_user"] == roles.names["outbox_operator"]


def test_planted_history_ids_cannot_swallow_real_attempts(roles, pg_engine):
    """Ids ahead of the sequence, taken by a relay or operator login, once made the relay's history
    INSERT skip real attempts (a clash ignored like a re-sent row) and the operator's requeue fail."""
    planted = "INSERT INTO outbox_attempt (id, message_id, attempt, outcome, started_at)"
    for role in ("outbox_relay", "outbox_operator"):
        engine = roles.engine(role)
        refused(engine, f"{planted} SELECT g, 1, 1, 'retry', now() FROM generate_series(1, 1000) g")
        refused(
            engine, f"{planted} OVERRIDING SYSTEM VALUE VALUES (9223372036854775807, 1, 1, 'retry', now())"
        )
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    ob.route("audit.good", lambda msg: None, name="good")

    def refuse(msg: Message) -> None:
        raise PermanentError("refused")

    ob.route("audit.bad", refuse, name="bad")
    app = roles.engine("outbox_app")
    maker = sessionmaker(app)
    ob.install(maker)
    try:
        with maker.begin() as s:
            for n in range(3):
                emit(s, "audit.good", {"n": n})
                emit(s, "audit.bad", {"n": n})
    finally:
        ob.uninstall(maker)
    Relay(ob, roles.engine("outbox_relay"), listen=False).run_until_idle()
    with pg_engine.connect() as conn:
        recorded = conn.execute(select(a.c.outcome, func.count()).group_by(a.c.outcome)).all()
    assert dict(recorded) == {"delivered": 3, "dead": 3}
    operator = roles.engine("outbox_operator")
    dead = [row.id for row in ops.list_messages(operator, ops.MessageFilter(status="dead"))]
    assert len(ops.requeue(operator, ops.MessageFilter(ids=dead), actor="ops", reason="fixed")) == 3


def test_the_application_cannot_bury_a_dead_message_under_a_fake_copy(roles, pg_engine):
    """The application inserts only what emit() writes: no status, attempts, lock, lineage or id."""
    (dead_id,) = emit_messages(pg_engine, 1)
    with pg_engine.begin() as conn:
        conn.execute(update(m).where(m.c.id == dead_id).values(status="dead", last_error="gone"))
    columns = (
        "event_id, event_type, handler, queue, priority, payload, headers, max_attempts,"
        " available_at, created_at, updated_at"
    )
    values = "gen_random_uuid(), 'audit.test', 'audited', 'default', 0, '{}', '{}', 3, now(), now(), now()"
    app = roles.engine("outbox_app")
    for extra, value in (
        ("status", "'delivered'"),
        ("requeued_from", str(dead_id)),
        ("attempts", "3"),
        ("locked_by", "'relay-x'"),
        ("delivered_at", "now()"),
        ("id", "9223372036854775807"),
    ):
        refused(app, f"INSERT INTO outbox_message ({columns}, {extra}) VALUES ({values}, {value})")
    with app.begin() as conn:  # what emit() writes still goes in, as a pending message
        conn.execute(text(f"INSERT INTO outbox_message ({columns}) VALUES ({values})"))
    operator = roles.engine("outbox_operator")
    assert ops.stats(operator).dead == 1
    assert [row.id for row in ops.list_messages(operator, ops.MessageFilter(status="dead"))] == [dead_id]


def test_the_app_and_the_relay_cannot_run_a_purge_nor_write_its_record(roles):
    for role in ("outbox_app", "outbox_relay"):
        engine = roles.engine(role)
        refused(
            engine,
            "INSERT INTO outbox_retention_run (started_at, actor, delivered_before)"
            " VALUES (now(), 'x', now())",
        )
        refused(engine, "UPDATE outbox_retention_run SET attempts_deleted = 0")
        refused(engine, "SELECT outbox_purge_start('x', interval '0', interval '90 days')")
        refused(engine, "SELECT * FROM outbox_purge_step(1, 10)")
        refused(engine, "SELECT outbox_purge_finish(1)")
        with pytest.raises(ops.OpsError, match="grant it EXECUTE"):
            ops.purge(engine, delivered_older_than=timedelta(days=30))


def test_a_runs_counts_are_what_it_deleted_and_name_the_login(roles, pg_engine):
    ids = emit_messages(pg_engine, 6)
    with pg_engine.begin() as conn:
        conn.execute(update(m).where(m.c.id.in_(ids[:4])).values(status="delivered"))
    seed_history(pg_engine, ids[:5] * 3)  # ids[4] stays pending: its history is kept
    operator = roles.engine("outbox_operator")
    result = ops.purge(
        operator,
        delivered_older_than=timedelta(0),
        history_older_than=timedelta(days=1),
        batch_size=2,
        actor="nightly",
    )
    assert (result.messages, result.attempts) == (4, 12)
    assert count(pg_engine, m) == 2 and count(pg_engine, a) == 3
    with pg_engine.connect() as conn:
        (record,) = conn.execute(select(runs)).all()
    assert (record.actor, record.db_user) == ("nightly", roles.names["outbox_operator"])
    assert (record.messages_deleted, record.attempts_deleted) == (4, 12)
    assert record.finished_at is not None and record.history_of_unresolved is False
    # Cutoffs from the server's clock: history_before is a day before the run started, to the microsecond.
    assert record.started_at - record.history_before == timedelta(days=1)


def test_each_purge_function_refuses_what_a_caller_could_abuse(roles, pg_engine):
    operator = roles.engine("outbox_operator")

    def call(statement: str, **params: Any) -> Any:
        with operator.begin() as conn:
            return conn.execute(text(statement), params).one()[0]

    for statement, why in (
        ("SELECT outbox_purge_start('x', interval '-1 day')", "puts the cutoff after now"),
        ("SELECT outbox_purge_start('x', NULL)", "delivered_older_than is required"),
        ("SELECT outbox_purge_start('x', interval '0', interval '23 hours')", "less than 24 hours ago"),
        ("SELECT outbox_purge_start('x', interval '0', interval '-1 year')", "less than 24 hours ago"),
        ("SELECT outbox_purge_start(' ', interval '0')", "actor"),
        ("SELECT outbox_purge_start(repeat('x', 256), interval '0')", "actor"),
        ("SELECT outbox_purge_start(NULL, interval '0')", "actor"),
        ("SELECT outbox_purge_start('x', interval '0', interval '2 days', NULL)", "true or false"),
        ("SELECT * FROM outbox_purge_step(999999, 10)", "no purge run 999999"),
        ("SELECT outbox_purge_finish(999999)", "no purge run 999999"),
    ):
        refused(operator, statement, why)

    own = call("SELECT outbox_purge_start('me', interval '0', interval '2 days')")
    for size in (0, -1, 10001, None):
        refused(
            operator,
            f"SELECT * FROM outbox_purge_step({own}, {'NULL' if size is None else size})",
            "batch_size",
        )
    with pg_engine.begin() as conn:  # another login's run (the superuser's)
        theirs = conn.execute(text("SELECT outbox_purge_start('them', interval '0')")).scalar_one()
    refused(operator, f"SELECT * FROM outbox_purge_step({theirs}, 10)", "belongs to another login")
    refused(operator, f"SELECT outbox_purge_finish({theirs})", "belongs to another login")
    call("SELECT outbox_purge_finish(:r)", r=own)
    refused(operator, f"SELECT * FROM outbox_purge_step({own}, 10)", f"purge run {own} is finished")
    refused(operator, f"SELECT outbox_purge_finish({own})", f"purge run {own} is finished")


def test_an_interval_that_counts_months_cannot_pass_the_purge_floors(roles, pg_engine):
    """'-12 mon 361 days' is more than a day as an interval (a month counts 30 days), yet
    ``now()`` minus it lands days ahead: the floors hold on the cutoffs the run would record."""
    seed_history(pg_engine, [1], started_at=datetime.now(UTC) - timedelta(seconds=5))
    operator = roles.engine("outbox_operator")
    for statement in (
        "SELECT outbox_purge_start('nightly', interval '0', interval '-12 mon 361 days', true)",
        "SELECT outbox_purge_start('nightly', interval '-12 mon 361 days')",
    ):
        refused(operator, statement, "puts the cutoff")
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(runs)).scalar_one() == 0
    assert count(pg_engine, a) == 1


def test_the_history_floor_counts_24_hours_not_a_calendar_day(roles, pg_engine):
    """In a session time zone with daylight saving, "1 day" back is 23 hours on the day the clocks
    change; the floor and the recorded cutoff count hours, whatever the zone."""
    operator = roles.engine("outbox_operator")
    with operator.begin() as conn:
        conn.execute(text("SET LOCAL TIME ZONE 'Europe/Berlin'"))
        with pytest.raises(DBAPIError, match="less than 24 hours ago"):
            conn.execute(text("SELECT outbox_purge_start('x', interval '0', interval '23 hours 59 minutes')"))
    with operator.begin() as conn:
        run_id = conn.execute(
            text("SELECT outbox_purge_start('x', interval '0', interval '24 hours')")
        ).scalar_one()
        conn.execute(text("SELECT outbox_purge_finish(:r)"), {"r": run_id})
    with pg_engine.connect() as conn:
        record = conn.execute(select(runs)).one()
    assert record.started_at - record.history_before == timedelta(hours=24)


def test_history_younger_than_a_day_is_never_purged(database_url, engine):
    seed_history(engine, [1], started_at=datetime.now(UTC) - timedelta(hours=23))
    with pytest.raises(ops.OpsError, match="at least 1d"):
        ops.purge(engine, delivered_older_than=timedelta(0), history_older_than=timedelta(hours=23))
    assert_one_line_error(
        run(
            "purge", "--delivered-older-than", "0s", "--history-older-than", "23h", database_url=database_url
        ),
        2,
        "--history-older-than",
        "at least 1d",
    )
    assert count(engine, runs) == 0, "refused before anything was recorded"
    assert (
        ops.purge(engine, delivered_older_than=timedelta(0), history_older_than=timedelta(days=1)).attempts
        == 0
    )
    assert count(engine, a) == 1


def test_purge_keeps_the_history_of_unresolved_messages_unless_asked(engine):
    ids = emit_messages(engine, 6)
    pending, running, dead, requeued_dead, delivered, discarded = ids
    with engine.begin() as conn:
        for message_id, status in (
            (running, "running"),
            (dead, "dead"),
            (requeued_dead, "dead"),
            (delivered, "delivered"),
            (discarded, "discarded"),
        ):
            conn.execute(update(m).where(m.c.id == message_id).values(status=status))
    seed_history(engine, ids)
    ops.requeue(engine, ops.MessageFilter(ids=(requeued_dead,)), reason="fixed", actor="t")

    def old_history() -> set[int]:
        with engine.connect() as conn:
            rows = conn.execute(
                select(a.c.message_id).where(a.c.started_at < datetime.now(UTC) - timedelta(days=1))
            )
            return set(rows.scalars())

    kept = ops.purge(engine, delivered_older_than=timedelta(days=365), history_older_than=timedelta(days=1))
    assert kept.attempts == 3
    assert old_history() == {pending, running, dead}
    everything = ops.purge(
        engine,
        delivered_older_than=timedelta(days=365),
        history_older_than=timedelta(days=1),
        history_of_unresolved=True,
    )
    assert everything.attempts == 3 and old_history() == set()
    with engine.connect() as conn:
        assert [r.history_of_unresolved for r in conn.execute(select(runs).order_by(runs.c.id))] == [
            False,
            True,
        ]


def test_sqlite_replace_and_upsert_cannot_rewrite_a_history_row(database_url, engine):
    seed_history(engine, [1])
    with engine.connect() as conn:
        (before,) = conn.execute(select(a)).all()
    columns = "(id, message_id, attempt, outcome, started_at, reason)"
    values = f"({before.id}, 1, 1, 'delivered', '2026-01-01 00:00:00', 'rewritten')"
    statements = [
        f"INSERT INTO outbox_attempt {columns} VALUES {values} ON CONFLICT (id) DO UPDATE SET reason = 'x'"
    ]
    if engine.dialect.name == "postgresql":
        # History is partitioned by started_at there (outbox_0024): its key is (id, started_at).
        statements = [
            f"INSERT INTO outbox_attempt {columns} SELECT id, message_id, attempt, outcome, started_at,"
            " 'rewritten' FROM outbox_attempt ON CONFLICT (id, started_at) DO UPDATE SET reason = 'x'"
        ]
    if engine.dialect.name == "sqlite":
        statements += [
            f"INSERT OR REPLACE INTO outbox_attempt {columns} VALUES {values}",
            f"REPLACE INTO outbox_attempt {columns} VALUES {values}",
        ]
    for statement in statements:
        with pytest.raises(DBAPIError, match=APPEND_ONLY), engine.begin() as conn:
            conn.execute(text(statement))
    with engine.connect() as conn:
        assert conn.execute(select(a)).all() == [before]
    if engine.dialect.name == "sqlite":
        # A new id with the key of the existing row (message, attempt, outcome, started_at):
        # REPLACE would delete the old row on that unique key; it is skipped instead.
        with engine.begin() as conn:
            stamp = conn.execute(text("SELECT started_at FROM outbox_attempt")).scalar_one()
            conn.execute(
                text(
                    "INSERT OR REPLACE INTO outbox_attempt (message_id, attempt, outcome, started_at, reason)"
                    " VALUES (:m, :n, :o, :s, 'rewritten')"
                ),
                {"m": before.message_id, "n": before.attempt, "o": before.outcome, "s": stamp},
            )
        with engine.connect() as conn:
            assert conn.execute(select(a)).all() == [before]
    seed_history(engine, [2])  # new rows still go in
    assert count(engine, a) == 2


def test_upgrading_from_0006_keeps_history_and_purge_records(empty_url: str) -> None:
    outbox.upgrade(empty_url, "outbox_0006")
    kept = [column for column in m.c if column.name not in ("expires_at", "parked_on")]
    engine = create_engine(empty_url)
    try:
        ids = emit_messages(engine, 2)
        seed_history(engine, ids)
        now = datetime.now(UTC)
        earlier = {"started_at": now, "finished_at": now, "delivered_before": now, "messages_deleted": 5}
        with engine.begin() as conn:
            conn.execute(
                insert(runs),
                [
                    {
                        **earlier,
                        "actor": "old cron",
                        "history_before": now - timedelta(days=90),
                        "attempts_deleted": 7,
                    },
                    {**earlier, "actor": "no history", "history_before": None, "attempts_deleted": 0},
                ],
            )
        with engine.connect() as conn:
            history = conn.execute(select(a).order_by(a.c.id)).all()
            # The columns outbox_0006 has: expires_at came with outbox_0018, parked_on with outbox_0021.
            messages = conn.execute(select(*kept).order_by(m.c.id)).all()
        engine.dispose()

        outbox.upgrade(empty_url)
        with engine.connect() as conn:
            assert conn.execute(select(a).order_by(a.c.id)).all() == history
            assert conn.execute(select(*kept).order_by(m.c.id)).all() == messages
            old = conn.execute(select(runs).order_by(runs.c.id)).all()
        assert [(r.actor, r.messages_deleted, r.attempts_deleted, r.db_user) for r in old] == [
            ("old cron", 5, 7, None),
            ("no history", 5, 0, None),
        ]
        # Those purges deleted history whatever its message's state; the record says so now.
        assert [r.history_of_unresolved for r in old] == [True, False]
        age_history(engine)
        result = ops.purge(
            engine, delivered_older_than=timedelta(days=30), history_older_than=timedelta(days=1)
        )
        assert result.attempts == 0, "both messages are pending: their history stays"

        outbox.downgrade(empty_url, "outbox_0006")
        with engine.connect() as conn:
            assert len(conn.execute(select(a.c.id)).all()) == len(history)
        outbox.upgrade(empty_url)
    finally:
        engine.dispose()


def test_a_tenant_schema_gets_functions_that_name_its_own_tables(pg_url):
    """The functions name their tables with the schema the migration ran in, not the caller's path."""
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant_a"))
    tenant = create_engine(pg_url, connect_args={"options": "-c search_path=tenant_a"})
    try:
        outbox.upgrade(tenant)
        ids = emit_messages(tenant, 2)
        with tenant.begin() as conn:
            conn.execute(update(m).where(m.c.id == ids[0]).values(status="delivered"))
        seed_history(tenant, ids)
        with admin.connect() as conn:
            bodies = conn.execute(
                text(
                    "SELECT p.proname, p.prosrc, p.proconfig FROM pg_proc p"
                    " WHERE p.pronamespace = 'tenant_a'::regnamespace AND p.proname LIKE 'outbox%'"
                )
            ).all()
        assert {b.proname for b in bodies} >= {
            "outbox_purge_step",
            "outbox_attempt_append_only",
            "outbox_notify",
        }
        for body in bodies:
            # Pinned first; the partition functions (outbox_0024) also read bounds in UTC and ISO, and
            # wait for the history table's lock only so long; the claim plans no sort nor table scan
            # (outbox_0023).
            assert body.proconfig[0] == "search_path=pg_catalog, pg_temp", body.proname
            assert set(body.proconfig[1:]) <= {
                "TimeZone=UTC",
                "DateStyle=ISO, YMD",
                "lock_timeout=2s",
                "enable_sort=off",
                "enable_seqscan=off",
            }
            named = set(re.findall(r"(\S+)\.outbox_(?:message|attempt|retention_run)\b", body.prosrc))
            assert named <= {'"tenant_a"'}, (body.proname, named)
        result = ops.purge(tenant, delivered_older_than=timedelta(0), history_older_than=timedelta(days=1))
        assert (result.messages, result.attempts) == (1, 1)
        assert count(tenant, a) == 1, "the pending message's history stays"
        # outbox_resend takes the copy's id from the tenant's own sequence.
        with tenant.begin() as conn:
            conn.execute(update(m).where(m.c.id == ids[1]).values(status="delivered"))
        ((_, copy),) = ops.resend(tenant, ops.MessageFilter(ids=(ids[1],)), reason="lost", actor="t")
        with tenant.connect() as conn:
            assert conn.execute(select(m.c.requeued_from).where(m.c.id == copy)).scalar_one() == ids[1]
    finally:
        tenant.dispose()
        admin.dispose()


def test_only_the_owner_and_a_superuser_can_set_the_guards_aside(pg_base_url):
    """Migrated by a plain (non-superuser) owner: the purge functions run as that owner, a plain
    DELETE is refused to the owner and the superuser too, and only they can disable the trigger."""
    database = f"outbox_owned_{uuid.uuid4().hex[:12]}"
    base = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with base.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{database}"'))
    made = Logins(make_url(pg_base_url).set(database=database).render_as_string(hide_password=False))
    try:
        owner_name, owner = made.role("outbox_owner", "GRANT CREATE ON SCHEMA public TO {role};")
        outbox.upgrade(owner)
        operator_name, operator = made.role("outbox_operator")
        block = test_roles.roles_sql().split("CREATE ROLE outbox_operator LOGIN;", 1)[1]
        with made.admin.begin() as conn:
            conn.exec_driver_sql(block.replace("outbox_operator", operator_name))
        ids = emit_messages(owner, 1)
        seed_history(owner, ids * 2)
        with owner.begin() as conn:
            conn.execute(update(m).values(status="delivered"))
        for engine in (owner, made.admin):  # the owner, then the superuser
            with pytest.raises(DBAPIError, match=APPEND_ONLY), engine.begin() as conn:
                conn.execute(text("DELETE FROM outbox_attempt"))
        refused(operator, "ALTER TABLE outbox_attempt DISABLE TRIGGER outbox_attempt_append_only", "owner")

        result = ops.purge(operator, delivered_older_than=timedelta(0), history_older_than=timedelta(days=1))
        assert (result.messages, result.attempts) == (1, 2)
        with made.admin.connect() as conn:
            owners = conn.execute(
                text(
                    "SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc"
                    " WHERE proname LIKE 'outbox_purge%'"
                )
            ).scalars()
            assert set(owners) == {owner_name}
            (record,) = conn.execute(select(runs)).all()
        assert record.db_user == operator_name

        seed_history(owner, ids)
        for engine in (owner, made.admin):
            with engine.begin() as conn:
                conn.execute(text("ALTER TABLE outbox_attempt DISABLE TRIGGER outbox_attempt_append_only"))
                conn.execute(text("DELETE FROM outbox_attempt"))
                conn.execute(text("ALTER TABLE outbox_attempt ENABLE TRIGGER outbox_attempt_append_only"))
            assert count(owner, a) == 0
            seed_history(owner, ids)
    finally:
        made.drop()
        with base.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        base.dispose()
