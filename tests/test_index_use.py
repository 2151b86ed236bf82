"""The partial indexes of ``outbox_message`` still serve the statements that read them, on both databases.

``ix_outbox_message_status_handler`` leaves delivered rows out, and on
PostgreSQL running rows too; ``ix_outbox_message_lease`` holds the running
ones, for lease recovery;
``ix_outbox_message_aggregate`` holds only messages with an
aggregate. A partial index is usable only where the database can prove that the
query's WHERE implies the predicate (SQLite by matching terms), so each test
captures the statement the library itself sends and asks the database for its
plan, with the same parameters. PostgreSQL runs it with sequential scans
disabled: on a nearly empty table the planner would rather read the table, and
the question is whether the index can serve at all.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Engine

import outbox
from outbox import ops
from outbox.ops import MessageFilter
from outbox.ops._dashboard import breakdown, count_messages
from outbox.relay import Relay
from outbox.relay.recovery import recover_expired

Statement = tuple[str, Any]


@contextmanager
def sent(engine: Engine) -> Iterator[list[Statement]]:
    """The statements (and their parameters) ``engine`` sends while the block runs."""
    seen: list[Statement] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def plan(engine: Engine, statement: str, parameters: Any) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            return "\n".join(str(r[-1]) for r in rows)
        conn.exec_driver_sql("SET enable_seqscan = off")
        rows = conn.exec_driver_sql("EXPLAIN " + statement, parameters)
        return "\n".join(r[0] for r in rows)


def reading(seen: list[Statement], pattern: str) -> Statement:
    """The one captured statement that matches ``pattern``."""
    found = [s for s in seen if re.search(pattern, s[0], re.IGNORECASE | re.DOTALL)]
    assert len(found) == 1, [s[0] for s in seen]
    return found[0]


def planned(engine: Engine, pattern: str, call: Callable[[], Any]) -> str:
    with sent(engine) as seen:
        call()
    return plan(engine, *reading(seen, pattern))


def test_lease_recovery_reads_the_running_rows_through_the_lease_index(engine: Engine) -> None:
    app = outbox.Outbox()
    app.route("invoice.issued", handler=lambda message: None, name="invoice")
    store = Relay(app, engine, relay_id="r").store
    found = planned(engine, r"locked_until <", lambda: recover_expired(store, {}, random.Random()))
    if engine.dialect.name == "sqlite":  # it holds running rows in both; no dead entries to step over
        assert re.search(r"ix_outbox_message_(lease|status_handler)", found), found
    else:
        assert "ix_outbox_message_lease" in found, found


@pytest.mark.parametrize(
    ("statuses", "indexes"),
    [
        (("pending", "running", "dead", "discarded"), ("status_handler", "lease")),
        (("dead",), ("status_handler",)),
        (("running",), ("lease",)),
    ],
    ids=["unfinished", "dead", "running"],
)
def test_counts_of_statuses_other_than_delivered_read_the_status_and_lease_indexes(
    engine: Engine, statuses: tuple[str, ...], indexes: tuple[str, ...]
) -> None:
    found = planned(engine, r"GROUP BY", lambda: breakdown(engine, statuses=statuses))
    if engine.dialect.name == "sqlite":  # running rows are in the status index there
        indexes = ("status_handler",)
    for index in indexes:
        assert f"ix_outbox_message_{index}" in found, found


def test_a_dead_letter_listing_of_one_handler_reads_the_status_index(engine: Engine) -> None:
    where = MessageFilter(status="dead", handler="invoice")
    found = planned(engine, r"count", lambda: count_messages(engine, where))
    assert "ix_outbox_message_status_handler" in found, found


def test_the_history_of_one_aggregate_reads_the_aggregate_index(engine: Engine) -> None:
    where = MessageFilter(aggregate_type="Order", aggregate_id="42")
    found = planned(engine, r"outbox_message", lambda: ops.list_messages(engine, where))
    assert "ix_outbox_message_aggregate" in found, found


def _documented_prebuild() -> list[str]:
    """The statements outbox_0012's docstring gives for building its indexes beforehand."""
    versions = Path(outbox.__file__).parent / "migrations" / "versions"
    source = versions / "0012_fewer_index_entries_per_delivery.py"
    block = source.read_text().split("only\ndrops the lease index::", 1)[1].split('"""', 1)[0]
    return [s.strip() for s in block.split(";") if s.strip()]


def test_indexes_built_beforehand_as_documented_are_kept_by_the_migration(pg_base_url: str) -> None:
    """The docstring's CONCURRENTLY recipe, then the upgrade: same schema as a plain upgrade, rows kept."""
    from test_migrations import _schema_facts  # the exact index definitions, as PostgreSQL prints them

    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    names = [f"outbox_prebuilt_{random.randrange(16**8):08x}", f"outbox_plain_{random.randrange(16**8):08x}"]
    urls = [admin.url.set(database=n).render_as_string(hide_password=False) for n in names]
    with admin.connect() as conn:
        for name in names:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        prebuilt_url, plain_url = urls
        outbox.upgrade(prebuilt_url, "outbox_0011")
        prebuilt = create_engine(prebuilt_url, isolation_level="AUTOCOMMIT")
        with prebuilt.connect() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority,"
                    " payload, headers, aggregate_type, aggregate_id, max_attempts, created_at,"
                    " updated_at, available_at) VALUES (gen_random_uuid(), 'order.placed', 'mail',"
                    " 'default', 0, '{}', '{}', 'Order', '42', 3, now(), now(), now())"
                )
            )
            recipe = _documented_prebuild()
            assert len(recipe) == 6, recipe
            for statement in recipe:  # CONCURRENTLY: each outside a transaction, as an operator runs it
                conn.execute(text(statement))
        assert outbox.upgrade(prebuilt_url, "outbox_0012") == ["outbox_0012"]
        outbox.upgrade(plain_url, "outbox_0012")  # the same revision, without the recipe
        assert _schema_facts(prebuilt_url) == _schema_facts(plain_url)
        indexes = {i["name"] for i in inspect(prebuilt).get_indexes("outbox_message")}
        assert "ix_outbox_message_lease" not in indexes
        with prebuilt.connect() as conn:
            assert conn.execute(text("SELECT aggregate_id FROM outbox_message")).scalar_one() == "42"
        prebuilt.dispose()
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
