"""Operations beyond the basics of test_ops_cli.py: the dead count operators alert on, purge under
interruption and at scale, the purge actor, and the command's answers to awkward input.

CLI behaviour is tested through the installed ``outbox`` console script in a subprocess, on real
databases, with the helpers (and the seeded messages in every status) of test_ops_cli.py.
"""

from __future__ import annotations

import getpass
import itertools
import os
import pty
import re
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import test_ops_cli
from aging import age_history
from sqlalchemy import Text, cast, event, func, insert, select, text, type_coerce, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from test_ops_cli import FAST, assert_one_line_error, ok, ok_json, outbox_cmd, run, snapshot

import outbox
from outbox import Outbox, RetryLater, emit, ops
from outbox.relay import Relay

m, a, runs = outbox.outbox_message, outbox.outbox_attempt, outbox.outbox_retention_run

#: Seven messages in every status (test_ops_cli.py's fixture), on SQLite and PostgreSQL.
seeded = test_ops_cli.seeded


def retention_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(runs).order_by(runs.c.id)))


# -- the dead count goes down when an operator acts ------------------------------------------------


def test_dead_counts_only_messages_nobody_has_requeued(seeded):
    engine, url = seeded.engine, seeded.url
    first, second = seeded.id("order:7"), seeded.id("order:8")
    assert ok_json(run("stats", "--json", database_url=url))["dead"] == 2

    ok(run("requeue", str(first), "--reason", "billing fixed", database_url=url))
    stats = ok_json(run("stats", "--json", database_url=url))
    assert stats["by_status"]["dead"] == 2, "the original stays dead: rows are counted as stored"
    assert (stats["dead"], stats["dead_requeued"]) == (1, 1)
    assert ops.stats(engine).dead == 1
    assert ok(run("stats", database_url=url)).splitlines()[-1] == "dead: 1 needing a decision, 1 requeued"

    # The copy dies too: it is the one waiting for a decision now; the original is still settled.
    Relay(seeded.ob, engine, queues=["billing"]).run_until_idle()
    stats = ok_json(run("stats", "--json", database_url=url))
    assert (stats["by_status"]["dead"], stats["dead"], stats["dead_requeued"]) == (3, 2, 1)

    with engine.connect() as conn:
        copy = conn.execute(select(m.c.id).where(m.c.requeued_from == first)).scalar_one()
    ops.discard(engine, ops.MessageFilter(ids=(second, copy)), reason="refunded", actor="t")
    stats = ok_json(run("stats", "--json", database_url=url))
    assert (stats["dead"], stats["dead_requeued"]) == (0, 1)
    assert ok(run("stats", database_url=url)).splitlines()[-1] == "dead: 0 needing a decision, 1 requeued"

    # The guide's plain SQL for the same figure agrees (it runs on both databases).
    with engine.connect() as conn:
        assert conn.execute(text(UNRESOLVED_DEAD_SQL)).scalar_one() == 0


def test_needs_decision_lists_the_dead_the_count_counts_and_every_row_names_its_copy(seeded):
    engine = seeded.engine
    first, second = seeded.id("order:7"), seeded.id("order:8")

    def needing(**filters: Any) -> list[int]:
        return [r.id for r in ops.list_messages(engine, ops.MessageFilter(needs_decision=True, **filters))]

    assert needing() == [second, first]
    ((_, copy),) = ops.requeue(engine, ops.MessageFilter(ids=(first,)), reason="billing fixed", actor="t")
    rows = {r.id: r for r in ops.list_messages(engine)}
    assert (rows[first].status, rows[first].requeued_to) == ("dead", copy), "stays dead, names its copy"
    assert [i for i, r in rows.items() if r.requeued_to is not None] == [first]
    assert needing() == [second]
    assert ops.count_messages(engine, ops.MessageFilter(needs_decision=True)).count == ops.stats(engine).dead
    assert ops.show(engine, first).message["requeued_to"] == copy
    assert ops.show(engine, copy).message["requeued_to"] is None

    # It narrows the other filters, and what an action by filter would touch.
    assert needing(status="dead", queue="billing") == [second]
    assert needing(handler="welcome_email") == []
    assert needing(payload=(ops.parse_where("payload.order_id=7"),)) == []
    assert ops.candidate_ids(engine, ops.MessageFilter(needs_decision=True), "discard") == [second]
    assert not ops.MessageFilter(needs_decision=True).empty, "a filter of its own: never 'every message'"

    # The copy dies too: it needs a decision now, its original still does not.
    Relay(seeded.ob, engine, queues=["billing"]).run_until_idle()
    assert needing() == [copy, second]
    ops.discard(engine, ops.MessageFilter(ids=(second,)), reason="refunded", actor="t")
    assert needing() == [copy] and ops.stats(engine).dead == 1

    for status in ("pending", "running", "delivered", "discarded"):
        with pytest.raises(ops.OpsError, match=f"only dead messages need a decision.*{status}"):
            needing(status=status)


UNRESOLVED_DEAD_SQL = """
SELECT count(*) FROM outbox_message m
 WHERE m.status = 'dead'
   AND NOT EXISTS (SELECT 1 FROM outbox_message c WHERE c.requeued_from = m.id)
"""


def test_oldest_unfinished_age_sees_a_message_stuck_in_retries(engine):
    ob = Outbox(default_backoff=FAST)
    maker = sessionmaker(engine)
    ob.install(maker)

    @ob.handler("sync.requested", name="crm_sync", queue="crm", max_attempts=50)
    def crm_sync(msg: outbox.Message) -> None:
        raise RetryLater("CRM says 503", delay=3600)

    try:
        with maker.begin() as s:
            emit(s, "sync.requested", {"account": 1})
        Relay(ob, engine, queues=["crm"]).run_until_idle()
        with engine.begin() as conn:  # as if it had been retrying for two hours
            created = conn.execute(select(m.c.created_at)).scalar_one()
            conn.execute(update(m).values(created_at=created - timedelta(hours=2)))
        stats = ops.stats(engine)
        assert stats.by_status == {"pending": 1}
        assert stats.oldest_pending_age_s == {}, "not due: the due-age figure cannot see it"
        assert 7200 <= stats.oldest_unfinished_age_s["crm"] < 7200 + 600
        assert ok_json(run("stats", "--json", database_url=str(engine.url.render_as_string(False))))[
            "oldest_unfinished_age_s"
        ].keys() == {"crm"}
    finally:
        ob.uninstall(maker)


# -- purge: counts after every batch, the actor, the index ------------------------------------------


def deliver_many(engine: Engine, count: int) -> None:
    ob = Outbox(default_backoff=FAST)
    maker = sessionmaker(engine)
    ob.install(maker)

    @ob.handler("ping", name="pong")
    def pong(msg: outbox.Message) -> None:
        pass

    try:
        with maker.begin() as s:
            for n in range(count):
                emit(s, "ping", {"n": n})
        assert Relay(ob, engine).run_until_idle().delivered == count
    finally:
        ob.uninstall(maker)


class Stop(Exception):
    pass


def test_an_interrupted_purge_leaves_counts_that_say_what_it_deleted(engine):
    deliver_many(engine, 10)
    age_history(engine)
    seen: list[tuple[int, int, int, int]] = []

    def after_batch(progress: ops.PurgeResult) -> None:
        # What any other session can read at this moment: the row and the tables agree.
        with engine.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.id == progress.run_id)).one()
            left = conn.execute(select(func.count()).select_from(m)).scalar_one()
            history = conn.execute(select(func.count()).select_from(a)).scalar_one()
        assert row.finished_at is None
        seen.append((row.messages_deleted, 10 - left, row.attempts_deleted, 10 - history))
        if progress.attempts >= 4:
            raise Stop  # the process dies here, between two batches

    with pytest.raises(Stop):
        ops.purge(
            engine,
            delivered_older_than=timedelta(0),
            history_older_than=timedelta(days=1),
            batch_size=4,
            actor="cron",
            on_batch=after_batch,
        )
    assert seen == [(4, 4, 0, 0), (8, 8, 0, 0), (10, 10, 0, 0), (10, 10, 4, 4)]
    (row,) = retention_rows(engine)
    assert (row.actor, row.messages_deleted, row.attempts_deleted, row.finished_at) == ("cron", 10, 4, None)

    # The next run finishes the job and records only its own share.
    result = ops.purge(engine, delivered_older_than=timedelta(0), history_older_than=timedelta(days=1))
    assert (result.messages, result.attempts, result.batches) == (0, 6, 1)
    last = retention_rows(engine)[-1]
    assert (last.id, last.actor, last.messages_deleted, last.attempts_deleted) == (
        result.run_id,
        "outbox purge",
        0,
        6,
    )
    assert last.finished_at is not None


def test_purge_records_the_actor_given_or_the_login_name(seeded):
    url = seeded.url
    ok(run("purge", "--delivered-older-than", "0s", "--actor", "retention-cronjob", database_url=url))
    ok(run("purge", "--delivered-older-than", "0s", database_url=url))
    assert [r.actor for r in retention_rows(seeded.engine)] == ["retention-cronjob", getpass.getuser()]
    with pytest.raises(ops.OpsError, match="actor"):
        ops.purge(seeded.engine, delivered_older_than=timedelta(days=1), actor=" ")


def test_an_actor_longer_than_the_history_holds_is_refused_by_every_action(seeded):
    """PostgreSQL would refuse the history row mid-action and SQLite keep it: both refuse it up front."""
    too_long = "x" * 256
    before = snapshot(seeded.engine)
    for act, label in ((ops.requeue, "order:7"), (ops.discard, "order:8"), (ops.retry_now, "report:2026-10")):
        named = ops.MessageFilter(ids=(seeded.id(label),))
        with pytest.raises(ops.OpsError, match="the actor is longer than 255 characters"):
            act(seeded.engine, named, reason="r", actor=too_long)
    said = run(
        "requeue", str(seeded.id("order:7")), "--reason", "r", "--actor", too_long, database_url=seeded.url
    )
    assert_one_line_error(said, 1, "the actor is longer than 255 characters; give a shorter name")
    assert snapshot(seeded.engine) == before


def nameless(tmp_path: Path) -> dict[str, str]:
    """An environment where the user has no name: no USER/LOGNAME, and no passwd entry for the uid.

    A container running as an arbitrary uid is like that. Running as such a uid needs root and an
    interpreter that uid may execute, so the passwd lookup is made to fail the way it does there.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LOGNAME", "USER", "LNAME", "USERNAME")}
    env = {k: v for k, v in env.items() if not k.startswith("OUTBOX_")}
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import pwd

            def _unknown(uid):
                raise KeyError(f"getpwuid(): uid not found: {uid}")

            pwd.getpwuid = _unknown
            """
        )
    )
    env["PYTHONPATH"] = str(tmp_path)
    return env


def test_a_user_without_a_name_is_recorded_by_uid(database_url, engine, tmp_path):
    """getpass.getuser() fails for a uid with no passwd entry: the audit trail gets uid:<n>, no traceback."""
    deliver_many(engine, 1)
    env = nameless(tmp_path)
    check = subprocess.run(
        [sys.executable, "-c", "import getpass; getpass.getuser()"], env=env, capture_output=True, text=True
    )
    assert "KeyError" in check.stderr, "the environment must really hide the user's name"

    def nameless_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            outbox_cmd(*args, database_url=database_url),
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env=env,
        )

    purged = nameless_run("purge", "--delivered-older-than", "0s")
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == "purged 1 message(s) and 0 history row(s)"
    assert [r.actor for r in retention_rows(engine)] == [f"uid:{os.getuid()}"]

    ob = Outbox()
    ob.route("ping", lambda msg: None, name="later")
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            emit(s, "ping", {}, delay=3600)
    finally:
        ob.uninstall(maker)
    (pending,) = [r.id for r in ops.list_messages(engine, ops.MessageFilter(status="pending"))]
    discarded = nameless_run("discard", str(pending), "--reason", "not needed")
    assert discarded.returncode == 0, discarded.stderr
    assert ops.show(engine, pending).attempts[-1]["actor"] == f"uid:{os.getuid()}"


def test_the_requeued_from_index_serves_purges_anti_join_and_the_foreign_key_check(pg_engine):
    with pg_engine.connect() as conn:
        definition = conn.execute(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_outbox_message_requeued_from'")
        ).scalar_one()
    assert definition.endswith("(requeued_from) WHERE (requeued_from IS NOT NULL)"), definition

    # A big table: 50,000 finished messages (a tenth dead) and 500 requeued copies.
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload,
                    headers, status, attempts, max_attempts, available_at, created_at, updated_at)
                SELECT gen_random_uuid(), 'e', 'h', 'default', 0, '{}', '{}',
                       CASE WHEN g % 10 = 0 THEN 'dead' ELSE 'delivered' END, 1, 1,
                       now() - interval '40 days', now() - interval '40 days', now() - interval '40 days'
                  FROM generate_series(1, 50000) g;
                INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload,
                    headers, status, attempts, max_attempts, available_at, created_at, updated_at,
                    requeued_from)
                SELECT gen_random_uuid(), 'e', 'h', 'default', 0, '{}', '{}', 'delivered', 1, 1,
                       now(), now(), now(), g * 10
                  FROM generate_series(1, 500) g;
                ANALYZE outbox_message;
                """
            )
        )

    # The statements purge really runs, planned inside outbox_purge_step as PostgreSQL plans them
    # there: auto_explain reports nested statements' plans to the client.
    plans: list[str] = []
    with pg_engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_nested_statements = on",
            "SET client_min_messages = log",
        ):
            conn.execute(text(setting))
        run_id = conn.execute(text("SELECT outbox_purge_start('t', interval '30 days')")).scalar_one()
        step = conn.execute(text("SELECT * FROM outbox_purge_step(:r, 1000)"), {"r": run_id}).one()
        assert tuple(step) == (1000, 0)
        conn.rollback()
    (plan,) = [p for p in plans if "Delete on outbox_message" in p]
    assert "ix_outbox_message_requeued_from" in plan, plan
    assert not re.search(r"Seq Scan on outbox_message c\b", plan), plan

    with pg_engine.connect() as conn:
        # The check PostgreSQL runs for the foreign key on every deleted row (ri_triggers.c's query),
        # planned generically, as the trigger's cached plan is.
        conn.execute(text("SET plan_cache_mode = force_generic_plan"))
        conn.execute(
            text(
                'PREPARE fk_check(bigint) AS SELECT 1 FROM ONLY "public"."outbox_message" x'
                ' WHERE "requeued_from" OPERATOR(pg_catalog.=) $1 FOR KEY SHARE OF x'
            )
        )
        fk_plan = "\n".join(conn.execute(text("EXPLAIN EXECUTE fk_check(5)")).scalars())
    assert "Index Scan using ix_outbox_message_requeued_from" in fk_plan, fk_plan


# -- one line, not a traceback ------------------------------------------------------------------------


def test_ages_too_long_for_a_date_are_usage_errors(migrated_sqlite):
    cases = [
        (["--delivered-older-than", "99999999999d"], ["too long", "999999999d"]),
        (["--delivered-older-than", "1" + "0" * 400 + "s"], ["too long"]),
        (["--delivered-older-than", "1000000d"], ["before year 1"]),
        (["--delivered-older-than", "1d", "--history-older-than", "1000000d"], ["before year 1"]),
    ]
    for args, needles in cases:
        line = assert_one_line_error(run("purge", *args, database_url=migrated_sqlite), 2, *needles)
        assert line.startswith("outbox purge: error: argument"), line
    assert retention_rows_of(migrated_sqlite) == 0, "nothing was recorded: the purge never started"
    with pytest.raises(ops.OpsError, match="before year 1"):
        ops.purge(create(migrated_sqlite), delivered_older_than=timedelta(days=999_999_999))


def create(url: str) -> Engine:
    from sqlalchemy import create_engine

    return create_engine(url)


def retention_rows_of(url: str) -> int:
    engine = create(url)
    try:
        return len(retention_rows(engine))
    finally:
        engine.dispose()


@pytest.fixture
def migrated_sqlite(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "outbox.db"
    path.write_bytes(sqlite_template.read_bytes())
    return f"sqlite:///{path}"


def run_on_a_terminal(*args: str, database_url: str, keys: bytes) -> subprocess.CompletedProcess[str]:
    """The console script with a pseudo-terminal as stdin, typing ``keys`` (b"\\x04" is Ctrl-D)."""
    controller, terminal = pty.openpty()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        proc = subprocess.Popen(
            outbox_cmd(*args, database_url=database_url),
            stdin=terminal,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        os.close(terminal)
        terminal = -1
        # A line-discipline EOF waits in the terminal until the prompt reads it.
        os.write(controller, keys)
        stdout, stderr = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        os.close(controller)
        if terminal != -1:
            os.close(terminal)


def test_ctrl_d_at_the_confirmation_is_no(seeded):
    before = snapshot(seeded.engine)
    done = run_on_a_terminal(
        "discard", "--handler", "monthly_report", "--reason", "r", database_url=seeded.url, keys=b"\x04"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "Traceback" not in done.stdout
    assert done.stdout.startswith("discard 1 message(s)? [y/N] ")
    assert done.stdout.splitlines()[-1] == "nothing done"
    assert snapshot(seeded.engine) == before

    yes = run_on_a_terminal(
        "discard", "--handler", "monthly_report", "--reason", "r", database_url=seeded.url, keys=b"y\n"
    )
    assert yes.returncode == 0, yes.stderr
    # What is typed is echoed on the terminal, not into stdout: the answer follows the prompt.
    assert (
        yes.stdout == f"discard 1 message(s)? [y/N] 1 message(s) discarded: {seeded.id('report:2026-10')}\n"
    )


def test_a_filter_that_matches_nothing_says_so_without_asking(seeded):
    url = seeded.url
    before = snapshot(seeded.engine)
    nothing_dead = ["--handler", "welcome_email", "--status", "dead"]
    text_out = ok(run("requeue", *nothing_dead, "--reason", "r", database_url=url))
    assert text_out == "no message matched the filter; nothing to requeue\n"
    assert ok_json(run("requeue", *nothing_dead, "--reason", "r", "--json", database_url=url)) == []
    assert ok(run("discard", "--handler", "no_such_route", "--reason", "r", database_url=url)) == (
        "no message matched the filter; nothing to discard\n"
    )
    assert ok_json(run("discard", "--queue", "mail", "--reason", "r", "--json", database_url=url)) == {
        "discarded": []
    }
    # On a terminal too: no question about zero messages.
    done = run_on_a_terminal("discard", "--queue", "mail", "--reason", "r", database_url=url, keys=b"y\n")
    assert (done.returncode, done.stdout) == (0, "no message matched the filter; nothing to discard\n")
    assert snapshot(seeded.engine) == before
    # Something to do, no terminal, no --yes: still refused (exit 1), as before.
    assert_one_line_error(
        run("discard", "--handler", "monthly_report", "--reason", "r", database_url=url), 1, "--yes"
    )


# -- the operations guide runs as written ------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def guide_commands() -> list[list[str]]:
    """Every ``outbox``/``outbox-relay`` command in the guide: shell lines, cron lines, YAML command lists."""
    import json
    import shlex

    found: list[list[str]] = []
    for kind, block in re.findall(r"```(sh|yaml)\n(.*?)```", GUIDE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            listed = re.match(r"\s*command:\s*(\[.*\])\s*$", line)
            if listed:
                found.append(json.loads(listed.group(1)))
            if kind == "yaml":
                continue
            words = shlex.split(line, comments=True)
            starts = [i for i, w in enumerate(words) if w in ("outbox", "outbox-relay")]
            if starts:
                found.append(words[starts[0] :])
    return found


def test_every_command_in_the_guide_parses():
    from outbox.cli._args import build_parser as outbox_parser
    from outbox.relay.cli import _parser as relay_parser

    commands = guide_commands()
    assert len(commands) > 20, commands
    assert any(c[:2] == ["outbox", "purge"] for c in commands)
    assert any("--queue-concurrency" in c for c in commands)
    for words in commands:
        parser = relay_parser() if words[0] == "outbox-relay" else outbox_parser()
        try:
            parser.parse_args(words[1:])
        except SystemExit:
            raise AssertionError(f"the guide's command does not parse: {' '.join(words)}") from None


def guide_sql(dialect: str) -> list[str]:
    """Statements of the guide's SQL blocks marked for ``dialect`` by their first comment line."""
    statements: list[str] = []
    for block in re.findall(r"```sql\n(.*?)```", GUIDE.read_text(), re.S):
        first = block.splitlines()[0]
        if first.startswith("-- Least-privilege roles"):
            continue  # tests/test_roles.py runs that one
        if ("PostgreSQL" if dialect == "postgresql" else "SQLite") not in first:
            continue
        statements += [s.strip() for s in block.split(";") if re.sub(r"--[^\n]*", "", s).strip()]
    return statements


def test_every_query_in_the_guide_runs(seeded):
    engine = seeded.engine
    statements = guide_sql(engine.dialect.name)
    assert len(statements) >= (8 if engine.dialect.name == "postgresql" else 5), statements
    ops.requeue(engine, ops.MessageFilter(ids=(seeded.id("order:7"),)), reason="r", actor="t")
    ops.purge(engine, delivered_older_than=timedelta(days=30), actor="guide")
    results = {}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in statements:
            results[statement] = conn.exec_driver_sql(statement).all() if "SELECT" in statement else None
    dead = [rows for statement, rows in results.items() if "AS dead_unresolved" in statement]
    assert dead and all(rows == [(1,)] for rows in dead), dead  # order:8; order:7 has a copy
    (retention,) = [rows for statement, rows in results.items() if "FROM outbox_retention_run" in statement]
    assert [r.actor for r in retention] == ["guide"]


# -- requeue: keys of any valid length, copies of copies ------------------------------------------


def refused_forever(engine: Engine) -> tuple[Outbox, sessionmaker[Any]]:
    """An outbox whose only route fails permanently: every message, and every copy, ends dead."""
    ob = Outbox(default_backoff=FAST)
    maker = sessionmaker(engine)
    ob.install(maker)

    @ob.handler("order.paid", name="invoice", queue="billing")
    def invoice(msg: outbox.Message) -> None:
        raise outbox.PermanentError("billing refuses every order")

    return ob, maker


@pytest.mark.parametrize("length", [255, 254, 246, 200])
def test_requeue_works_for_any_key_length_and_for_copies_of_copies(engine, length):
    ob, maker = refused_forever(engine)
    key = "k" * (length - 4) + "ключ"  # not only ASCII: the limit counts characters
    try:
        with maker.begin() as s:
            emit(s, "order.paid", {"order_id": 1}, key=key)
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            original = conn.execute(select(m.c.id).where(m.c.status == "dead")).scalar_one()
        url = engine.url.render_as_string(hide_password=False)
        out = ok(run("requeue", str(original), "--reason", "billing fixed", database_url=url))
        copy = int(re.findall(r"^requeued \d+ as (\d+)$", out, re.M)[0])
        chain = [original, copy]
        for _ in range(3):  # the copy dies too, and its copy, ...
            Relay(ob, engine).run_until_idle()
            again = ops.MessageFilter(ids=(chain[-1],))
            ((_, newest),) = ops.requeue(engine, again, reason="again", actor="t")
            chain.append(newest)
        with engine.connect() as conn:
            keys = dict(conn.execute(select(m.c.id, m.c.idempotency_key).where(m.c.id.in_(chain))).all())
    finally:
        ob.uninstall(maker)
    assert keys[original] == key
    assert len(set(keys.values())) == len(chain), "every copy has a key of its own"
    for old, new in itertools.pairwise(chain):
        assert keys[new] == ops.requeued_key(keys[old], old), "derivable from the copied row"
        assert keys[new].endswith(f"~requeue:{old}") and len(keys[new]) <= 255
    # What handlers derive identities from (the email Message-ID) is the original's in every copy.
    assert {ops.root_key(k) for k in keys.values()} == {ops.root_key(key)}
    assert len(ops.root_key(key)) == min(length, ops.ROOT_KEY_LIMIT)
    short = "order:7"
    assert ops.requeued_key(short, 5) == "order:7~requeue:5", "short keys keep the whole key"
    assert ops.root_key("order:7~requeue:5~requeue:9") == short
    longest = ops.requeued_key("k" * ops.ROOT_KEY_LIMIT, 2**63 - 1)
    assert longest is not None and len(longest) == 255 and longest.startswith("k" * ops.ROOT_KEY_LIMIT + "~")


# -- requeue and discard by filter: running messages are a relay's, and batches bound the work ------


@pytest.mark.parametrize("verb", ["requeue", "discard"])
def test_a_filtered_action_never_locks_or_touches_a_running_message(seeded, verb):
    """``--handler monthly_report`` matches a running, a pending and a discarded message."""
    engine, running = seeded.engine, seeded.id("report:2026-09")
    before = test_ops_cli.fingerprint(engine, running)
    history_before = test_ops_cli.history_of(engine, running)
    probes: list[str] = []

    def probe(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # While the action's transaction holds its locks: can a relay still update its running row?
        acting = "outbox_requeue(" in statement or "outbox_discard(" in statement
        if engine.dialect.name != "postgresql" or not acting or probes:
            return
        relay_side = create(seeded.url)
        try:
            with relay_side.connect() as other:
                other.execute(text("SET lock_timeout = '2s'"))
                other.execute(update(m).where(m.c.id == running).values(last_error=m.c.last_error))
                other.rollback()  # the probe leaves the row as it was
            probes.append("updated")
        except Exception as error:
            probes.append(type(getattr(error, "orig", error)).__name__)
        finally:
            relay_side.dispose()

    event.listen(engine, "after_cursor_execute", probe)
    try:
        where = ops.MessageFilter(handler="monthly_report")
        if verb == "requeue":
            acted = [old for old, _ in ops.requeue(engine, where, reason="rerun", actor="t")]
            expected = [seeded.id("report:2026-11")]
        else:
            acted = ops.discard(engine, where, reason="not wanted", actor="t")
            expected = [seeded.id("report:2026-10")]
    finally:
        event.remove(engine, "after_cursor_execute", probe)
    assert acted == expected
    if engine.dialect.name == "postgresql":
        assert probes == ["updated"], "the relay's running row must not wait for an operator"
    assert test_ops_cli.fingerprint(engine, running) == before
    assert test_ops_cli.history_of(engine, running) == history_before


def dead_rows(engine: Engine, count: int) -> list[int]:
    """``count`` dead messages of one route, as a relay would have left them."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(m),
            [
                {
                    "event_id": uuid.uuid4(),
                    "event_type": "order.paid",
                    "handler": "invoice",
                    "queue": "billing",
                    "priority": 0,
                    "payload": {"order_id": n, "lines": ["x" * 100] * 5},
                    "headers": {},
                    "idempotency_key": f"order:{n}",
                    "status": "dead",
                    "attempts": 1,
                    "max_attempts": 1,
                    "available_at": now,
                    "created_at": now,
                    "updated_at": now,
                    "last_error": "billing refused it",
                }
                for n in range(count)
            ],
        )
        return list(conn.execute(select(m.c.id).order_by(m.c.id)).scalars())


def test_a_large_filtered_requeue_and_discard_work_in_batches(engine):
    originals = dead_rows(engine, 1200)
    batches: list[int] = []

    def count_batches(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if statement.lstrip().startswith("SELECT") and "LIMIT" in statement and "outbox_message" in statement:
            batches.append(1)

    event.listen(engine, "after_cursor_execute", count_batches)
    try:
        pairs = ops.requeue(
            engine, ops.MessageFilter(handler="invoice"), reason="billing fixed", actor="t", batch_size=500
        )
        requeue_batches, batches[:] = len(batches), []
        discarded = ops.discard(
            engine, ops.MessageFilter(status="pending"), reason="refunded", actor="t", batch_size=500
        )
    finally:
        event.remove(engine, "after_cursor_execute", count_batches)
    assert [old for old, _ in pairs] == originals, "each dead message copied once, in id order"
    assert requeue_batches == 4, "500, 500, 200, then an empty read"
    assert sorted(discarded) == sorted(new for _, new in pairs) and len(batches) == 4
    with engine.connect() as conn:
        by_status = dict(conn.execute(select(m.c.status, func.count()).group_by(m.c.status)).all())
        history = dict(conn.execute(select(a.c.outcome, func.count()).group_by(a.c.outcome)).all())
    assert by_status == {"dead": 1200, "discarded": 1200}
    assert history == {"requeued": 1200, "discarded": 1200}
    # Repeating the bulk requeue copies no original twice, batch after batch.
    dead = ops.MessageFilter(handler="invoice", status="dead")
    assert ops.requeue(engine, dead, reason="again", actor="t", batch_size=7) == []
    url = engine.url.render_as_string(hide_password=False)
    again = run("requeue", "--status", "dead", "--reason", "r", "--yes", "--json", database_url=url)
    assert ok_json(again) == []


def test_a_dead_message_too_deep_for_pythons_json_decoder_is_requeued_whole(engine):
    """Stored before emit capped nesting: requeue copies its documents inside the database."""
    deep = "[" * 1500 + "]" * 1500
    payload = "CAST(:payload AS jsonb)" if engine.dialect.name == "postgresql" else ":payload"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload,"
                " headers, idempotency_key, status, attempts, max_attempts, available_at, created_at,"
                " updated_at)"
                f" VALUES (:event_id, 'e', 'r', 'default', 0, {payload}, '{{}}', 'k', 'dead', 3, 3,"
                " :now, :now, :now)"
            ),
            {"event_id": str(uuid.uuid4()), "payload": deep, "now": datetime.now(UTC)},
        )
        (old,) = conn.execute(select(m.c.id)).scalars()
    ((requeued, copy),) = ops.requeue(engine, ops.MessageFilter(ids=[old]), reason="fixed", actor="ana")
    assert requeued == old
    # Read back as text: Python's decoder could not take it either.
    as_text = (
        cast(m.c.payload, Text) if engine.dialect.name == "postgresql" else type_coerce(m.c.payload, Text)
    )
    with engine.connect() as conn:
        row = conn.execute(select(m.c.status, m.c.idempotency_key, as_text).where(m.c.id == copy)).one()
    assert (row[0], row[1]) == ("pending", f"k~requeue:{old}")
    assert row[2].replace(" ", "") == deep
