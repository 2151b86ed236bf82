"""The installed `outbox` console script against real databases holding messages in every status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Outbox, PermanentError, emit
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt
OUTBOX = str(Path(sys.executable).with_name("outbox"))


def cli(url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *args, "--database-url", url], capture_output=True, text=True, timeout=60, input=stdin
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) >= 1
    assert done.stderr.strip().splitlines()[-1].startswith("outbox")


@pytest.fixture
def populated(database_url: str, engine: Engine) -> dict[str, list[int]]:
    """pending, running, delivered and dead messages, made by a real relay; ids by status."""
    ob = Outbox()
    ob.route("ok", lambda msg: None, name="good", queue="mail")

    def refuse(msg: Any) -> None:
        raise PermanentError("address rejected")

    ob.route("bad", refuse, name="broken")
    ob.route("later", lambda msg: None, name="waiting")
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        for n in range(3):
            emit(s, "ok", {"n": n}, key=f"ok:{n}", group_key="g1")
            emit(s, "bad", {"n": n, "password": "hunter2"})
    Relay(ob, engine).run_until_idle()
    with factory() as s, s.begin():
        emit(s, "later", {"n": 1}, delay=3600)
        emit(s, "later", {"n": 2})
    Relay(ob, engine).store.claim("default", ["waiting"], 1)  # running
    ob.uninstall(factory)
    with engine.connect() as conn:
        by: dict[str, list[int]] = {}
        for row in conn.execute(select(m.c.id, m.c.status).order_by(m.c.id)):
            by.setdefault(row.status, []).append(row.id)
    assert set(by) == {"pending", "running", "delivered", "dead"}
    return by


def test_stats_counts_match_the_rows(database_url, populated):
    done = cli(database_url, "stats", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["by_status"] == {"delivered": 3, "dead": 3, "pending": 1, "running": 1}
    assert data["by_handler_status"]["broken"] == {"dead": 3}
    assert data["dead"] == 3 and data["delivered_last_hour"] == 3 and data["failed_last_hour"] == 3
    text_out = cli(database_url, "stats")
    assert text_out.returncode == 0 and "dead: 3" in text_out.stdout


def test_list_filters_and_pages_through_every_row_once(database_url, populated):
    assert [
        r["id"] for r in json.loads(cli(database_url, "list", "--status", "dead", "--json").stdout)
    ] == sorted(populated["dead"], reverse=True)
    assert len(json.loads(cli(database_url, "list", "--handler", "good", "--json").stdout)) == 3
    assert len(json.loads(cli(database_url, "list", "--queue", "mail", "--json").stdout)) == 3
    assert len(json.loads(cli(database_url, "list", "--key", "ok:1", "--json").stdout)) == 1
    assert len(json.loads(cli(database_url, "list", "--group-key", "g1", "--json").stdout)) == 3
    assert len(json.loads(cli(database_url, "list", "--event-type", "later", "--json").stdout)) == 2
    assert json.loads(cli(database_url, "list", "--since", "2999-01-01", "--json").stdout) == []
    assert len(json.loads(cli(database_url, "list", "--before", "2999-01-01", "--json").stdout)) == 8
    seen: list[int] = []
    before: list[str] = []
    while True:
        page = json.loads(cli(database_url, "list", "--limit", "3", "--json", *before).stdout)
        if not page:
            break
        seen += [r["id"] for r in page]
        before = ["--before-id", str(page[-1]["id"])]
    assert seen == sorted((i for ids in populated.values() for i in ids), reverse=True)


def test_show_masks_secret_fields_and_lists_attempts(database_url, populated):
    done = cli(database_url, "show", str(populated["dead"][0]), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["message"]["payload"]["password"] == "***" and "hunter2" not in done.stdout
    assert [h["outcome"] for h in data["attempts"]] == ["dead"]
    missing = cli(database_url, "show", "999999")
    assert missing.returncode == 1
    one_line_error(missing)


def row_snapshot(engine: Engine, message_id: int) -> tuple[Any, ...]:
    with engine.connect() as conn:
        row = tuple(conn.execute(select(m).where(m.c.id == message_id)).one())
        if engine.dialect.name == "postgresql":
            row += (
                conn.execute(
                    text(f"SELECT md5(t::text) FROM outbox_message t WHERE id = {message_id}")
                ).scalar(),
            )
    return row


def test_requeue_copies_the_dead_message_and_leaves_it_untouched(database_url, engine, populated):
    old = populated["dead"][0]
    before = row_snapshot(engine, old)
    done = cli(database_url, "requeue", str(old), "--reason", "partner fixed", "--actor", "alice", "--json")
    assert done.returncode == 0, done.stderr
    [pair] = json.loads(done.stdout)
    assert pair["old_id"] == old
    assert row_snapshot(engine, old) == before, "the dead row changed"
    with engine.connect() as conn:
        copy = conn.execute(select(m).where(m.c.id == pair["new_id"])).one()
        history = conn.execute(select(a).where(a.c.message_id == old).order_by(a.c.id)).all()
    assert copy.status == "pending" and copy.requeued_from == old and copy.attempts == 0
    assert (history[-1].outcome, history[-1].actor, history[-1].reason) == (
        "requeued",
        "alice",
        "partner fixed",
    )
    assert history[-1].detail["new_id"] == pair["new_id"]

    ob = Outbox()
    ob.route("bad", lambda msg: None, name="broken")  # the fixed handler
    Relay(ob, engine).run_until_idle()
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status).where(m.c.id == pair["new_id"])).scalar() == "delivered"

    refused = cli(database_url, "requeue", str(populated["delivered"][0]), "--reason", "x")
    assert refused.returncode == 1
    one_line_error(refused)


def test_bulk_requeue_needs_confirmation(database_url, populated):
    asked = cli(database_url, "requeue", "--status", "dead", "--reason", "bulk")
    assert asked.returncode == 1 and "--yes" in asked.stderr
    done = cli(database_url, "requeue", "--status", "dead", "--reason", "bulk", "--yes")
    assert done.returncode == 0 and "3 message(s) requeued" in done.stdout


def test_discard_records_why_and_refuses_finished_messages(database_url, engine, populated):
    target = populated["pending"][0]
    done = cli(database_url, "discard", str(target), "--reason", "customer deleted", "--actor", "bob")
    assert done.returncode == 0, done.stderr
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status).where(m.c.id == target)).scalar() == "discarded"
        last = conn.execute(select(a).where(a.c.message_id == target)).one()
    assert (last.outcome, last.actor, last.reason) == ("discarded", "bob", "customer deleted")
    refused = cli(database_url, "discard", str(populated["delivered"][0]), "--reason", "x")
    assert refused.returncode == 1
    one_line_error(refused)


def test_purge_deletes_finished_rows_records_itself_and_history_stays_append_only(
    database_url, engine, populated
):
    done = cli(database_url, "purge", "--delivered-older-than", "0s", "--history-older-than", "0s", "--json")
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert counts["messages"] == 3 and counts["attempts"] >= 6
    with engine.connect() as conn:
        left = {r.status for r in conn.execute(select(m.c.status))}
        run = conn.execute(select(outbox.outbox_retention_run)).one()
    assert left == {"pending", "running", "dead"}
    assert (run.messages_deleted, run.attempts_deleted) == (counts["messages"], counts["attempts"])
    # History written after the purge is as protected as before it.
    discarded = cli(database_url, "discard", str(populated["pending"][0]), "--reason", "after purge")
    assert discarded.returncode == 0, discarded.stderr
    for statement in ("DELETE FROM outbox_attempt", "UPDATE outbox_attempt SET reason = 'rewritten'"):
        with pytest.raises(DatabaseError), engine.begin() as conn:
            conn.execute(text(statement))
    bad = cli(database_url, "purge", "--delivered-older-than", "3x")
    assert bad.returncode == 2
    one_line_error(bad)


@pytest.mark.parametrize(
    "args",
    [
        ["nosuchcommand"],
        ["stats", "--database-url", "not a url"],
        ["stats", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:1/x"],
    ],
)
def test_bad_input_is_one_line_and_non_zero(args):
    done = subprocess.run([OUTBOX, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    one_line_error(done)
