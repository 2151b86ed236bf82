"""The relay's outcome, renewal and release find their rows through the primary key alone.

Revision ID: outbox_0025
Revises: outbox_0024
Create Date: 2026-12-07

``outbox_complete``, ``outbox_extend`` and ``outbox_release`` are given the ids
of the rows they change, and check that each is still ``running`` under this
relay. The planner read ``status = 'running'`` as a way in: the partial index
``ix_outbox_message_status_handler`` holds running rows, and by the live rows
the statistics count (a few hundred) a bitmap scan of it looked cheaper than
a hundred primary-key lookups. While a transaction holds back the xmin horizon
that index keeps an entry for every row that was ever running, and the relay's
outcome write read them all: in a pressure run at 1,000 messages a second it
took 200 ms a batch two minutes into the hold and 300 ms five minutes in, one
batch after another, which is what the relay waited for (a bitmap scan of
339,569 entries and 15,145 heap pages to update nothing).

``IS NOT DISTINCT FROM`` is the same test on a ``NOT NULL`` column, and no
index answers it. Complete and release also name their batch's ids as one
array (``m.id = ANY(ARRAY(...))``) in each statement that reads the table: an
index condition on the primary key, whatever plan PL/pgSQL keeps for the
session. Without it a relay's first outcomes, which meet a small table, left
a kept plan that hashed a full scan of the key, every version the table
keeps, for each batch (300 ms a batch three minutes into a hold). The three
run with ``enable_seqscan = off``, as the claim does since ``outbox_0023``;
that setting alone, without the changes above, made it worse: the status
index was then the cheapest way in. The functions are otherwise those of
``outbox_0021`` (complete) and ``outbox_0015`` (extend, release); CREATE OR
REPLACE keeps their owner and grants. The downgrade restores those bodies
and settings.

SQLite has no functions: nothing changes there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.revisions import earlier

revision = "outbox_0025"
down_revision = "outbox_0024"
branch_labels = None
depends_on = None

#: The ids of complete's batch, as one array: an index condition on the primary key.
_BATCH_IDS = "m.id = ANY(ARRAY(SELECT x.id FROM outcome x))"
#: Each function's edits, (as it was, as it becomes), every one found exactly once.
_EDITS: dict[str, tuple[tuple[str, str], ...]] = {
    "outbox_complete": (
        (  # the batch's expired outcomes, checked against the database's clock
            "LEFT JOIN {s}.outbox_message m ON m.id = o.id\n     WHERE o.outcome = 'expired'",
            "LEFT JOIN {s}.outbox_message m ON m.id = o.id\n"
            "       AND m.id = ANY(ARRAY(SELECT (e->>'id')::bigint FROM jsonb_array_elements(batch) e\n"
            "                             WHERE e->>'outcome' = 'expired'))\n"
            "     WHERE o.outcome = 'expired'",
        ),
        (  # the rows as the claim left them
            "FROM outcome o LEFT JOIN {s}.outbox_message m ON m.id = o.id\n",
            f"FROM outcome o LEFT JOIN {{s}}.outbox_message m ON m.id = o.id AND {_BATCH_IDS}\n",
        ),
        (
            "WHERE m.id = o.id AND m.locked_by = me AND m.status = 'running' AND m.attempts = o.attempt",
            f"WHERE {_BATCH_IDS} AND m.id = o.id AND m.locked_by = me\n"
            "           AND m.status IS NOT DISTINCT FROM 'running' AND m.attempts = o.attempt",
        ),
    ),
    "outbox_extend": (
        (
            "AND c.locked_by = me AND c.status = 'running'",
            "AND c.locked_by = me AND c.status IS NOT DISTINCT FROM 'running'",
        ),
        (
            "AND m.locked_by = me AND m.status = 'running';",
            "AND m.locked_by = me AND m.status IS NOT DISTINCT FROM 'running';",
        ),
    ),
    "outbox_release": (
        (
            "WHERE m.id = c.id AND m.attempts = c.attempt AND m.locked_by = me AND m.status = 'running';",
            "WHERE m.id = ANY(ids) AND m.id = c.id AND m.attempts = c.attempt AND m.locked_by = me\n"
            "       AND m.status IS NOT DISTINCT FROM 'running';",
        ),
    ),
}
#: The functions' signatures, for ALTER FUNCTION.
_SIGNATURES = {
    "outbox_complete": "outbox_complete(text, jsonb)",
    "outbox_extend": "outbox_extend(text, bigint[], double precision)",
    "outbox_release": "outbox_release(text, bigint[], integer[])",
}


def _schema() -> str:
    bind = op.get_bind()
    name = str(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    return bind.dialect.identifier_preparer.quote_identifier(name)


def _bodies(s: str) -> dict[str, str]:
    """The three functions as ``outbox_0021`` and ``outbox_0015`` left them, as CREATE OR REPLACE."""
    bodies = {"outbox_complete": earlier("0021")._complete(s, parking=True)}
    for body in earlier("0015")._sql(s):
        for name in ("outbox_extend", "outbox_release"):
            if f"FUNCTION {s}.{name}(" in body:
                bodies[name] = body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    assert set(bodies) == set(_EDITS), sorted(bodies)
    return bodies


def _by_id(s: str, name: str, body: str) -> str:
    for was, becomes in _EDITS[name]:
        was, becomes = was.replace("{s}", s), becomes.replace("{s}", s)
        assert body.count(was) == 1, (name, was)
        body = body.replace(was, becomes)
    return body


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = _schema()
    for name, body in _bodies(s).items():
        op.execute(_by_id(s, name, body))
        # ALTER FUNCTION ... SET keeps the function's owner, grants and search_path.
        op.execute(f"ALTER FUNCTION {s}.{_SIGNATURES[name]} SET enable_seqscan = off")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = _schema()
    for name, body in _bodies(s).items():
        op.execute(body)
        op.execute(f"ALTER FUNCTION {s}.{_SIGNATURES[name]} RESET enable_seqscan")
