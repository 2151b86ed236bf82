"""Migration ``outbox_0026``: running messages move from the status index to a lease index, and back.

On PostgreSQL the status index stops holding running rows and the lease
index (``locked_until`` of running rows) comes back, so lease recovery can
read a range of leases (relay/recovery.py). Tested on a database with
messages in every state, and on one whose indexes an operator built
beforehand with ``CREATE INDEX CONCURRENTLY``, as the migration's docstring
shows: the migration then changes nothing.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Connection, Engine

import outbox
from outbox.relay import Relay
from outbox.relay.recovery import recover_expired

pytestmark = pytest.mark.postgres

m = outbox.outbox_message

_PREDICATES = """
SELECT c.relname, pg_get_expr(i.indpred, i.indrelid)
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
 WHERE i.indrelid = 'outbox_message'::regclass
   AND c.relname IN ('ix_outbox_message_status_handler', 'ix_outbox_message_lease')
"""
#: The statements the migration's docstring gives for a big table, run at outbox_0025.
_BUILT_BEFOREHAND = (
    "CREATE INDEX CONCURRENTLY ix_outbox_message_lease ON outbox_message (locked_until)"
    " WHERE status = 'running'",
    "CREATE INDEX CONCURRENTLY ix_outbox_message_status_handler_new ON outbox_message (status, handler)"
    " WHERE status = 'pending' OR status = 'dead' OR status = 'discarded'",
    "DROP INDEX CONCURRENTLY ix_outbox_message_status_handler",
    "ALTER INDEX ix_outbox_message_status_handler_new RENAME TO ix_outbox_message_status_handler",
)


def _predicates(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {name: where for name, where in conn.execute(text(_PREDICATES))}


def _messages(engine: Engine) -> dict[str, int]:
    """One message in each state, the running one with a lease that ran out a minute ago; ids by state."""
    now = datetime.now(UTC)
    ids = {}
    with engine.begin() as conn:
        for status in ("pending", "running", "delivered", "dead", "discarded"):
            running = status == "running"
            ids[status] = conn.execute(
                insert(m)
                .values(
                    event_id=uuid.uuid4(),
                    event_type="e",
                    handler="r",
                    queue="default",
                    payload={},
                    headers={},
                    status=status,
                    priority=0,
                    attempts=1 if running else 0,
                    max_attempts=5,
                    locked_by="gone" if running else None,
                    locked_until=now - timedelta(minutes=1) if running else None,
                    available_at=now,
                    created_at=now,
                    updated_at=now,
                )
                .returning(m.c.id)
            ).scalar_one()
    return ids


def _index_oids(conn: Connection) -> dict[str, int]:
    found = conn.execute(text("SELECT relname, oid FROM pg_class WHERE relname LIKE 'ix_outbox_message_%'"))
    return {name: oid for name, oid in found}


def _status_predicate_names(predicate: str) -> set[str]:
    return {s for s in ("pending", "running", "dead", "discarded", "delivered") if f"'{s}'" in predicate}


def test_the_upgrade_moves_running_rows_to_the_lease_index_and_the_downgrade_moves_them_back(empty_pg_url):
    outbox.upgrade(empty_pg_url, "outbox_0025")
    engine = create_engine(empty_pg_url)
    try:
        ids = _messages(engine)
        before = _predicates(engine)
        assert "ix_outbox_message_lease" not in before
        assert _status_predicate_names(before["ix_outbox_message_status_handler"]) == {
            "pending",
            "running",
            "dead",
            "discarded",
        }

        outbox.upgrade(empty_pg_url)

        after = _predicates(engine)
        assert _status_predicate_names(after["ix_outbox_message_status_handler"]) == {
            "pending",
            "dead",
            "discarded",
        }
        assert _status_predicate_names(after["ix_outbox_message_lease"]) == {"running"}
        app = outbox.Outbox()
        app.route("e", lambda msg: None, name="r")
        look = recover_expired(Relay(app, engine, relay_id="rescuer").store, {}, random.Random(1))
        assert [item.row.id for item in look.recovered] == [ids["running"]]

        outbox.downgrade(empty_pg_url, "outbox_0025")

        assert _predicates(engine) == before
    finally:
        engine.dispose()


def test_indexes_built_beforehand_concurrently_are_kept_as_they_are(empty_pg_url):
    outbox.upgrade(empty_pg_url, "outbox_0025")
    engine = create_engine(empty_pg_url, isolation_level="AUTOCOMMIT")
    try:
        _messages(engine)
        with engine.connect() as conn:
            for statement in _BUILT_BEFOREHAND:
                conn.execute(text(statement))
            built = _index_oids(conn)
        expected = _predicates(engine)

        outbox.upgrade(empty_pg_url)

        assert _predicates(engine) == expected
        with engine.connect() as conn:
            now = dict(
                conn.execute(
                    text("SELECT relname, oid FROM pg_class WHERE relname LIKE 'ix_outbox_message_%'")
                ).all()
            )
        assert now == built, "an index was rebuilt"
    finally:
        engine.dispose()
