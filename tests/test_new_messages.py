"""A message inserted by anyone but the tables' owner starts pending (migration outbox_0016).

Over the guide's own roles (``test_roles``), with the application role given more than the
guide grants (a table-wide INSERT, as an older guide said): it still cannot insert a message
that is settled, locked, attempted or a "copy" of another, which would hide a dead message
from the dead count, the alerts, ``requeue`` and the purge.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import sessionmaker
from test_roles import Roles, guide_roles, refused

import outbox
from outbox import Outbox, emit, ops

m = outbox.outbox_message

_INSERT = (
    "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
    " max_attempts, available_at, created_at, updated_at{columns})"
    " VALUES (gen_random_uuid(), 'e', 'r', 'default', 0, '{{}}', '{{}}', 3, now(), now(), now(){values})"
)


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    yield from guide_roles(pg_url)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("status", "'delivered'"),
        ("requeued_from", "{dead}"),
        ("attempts", "3"),
        ("locked_by", "'someone'"),
        ("locked_until", "now() + interval '1 hour'"),
        ("delivered_at", "now()"),
        ("last_error", "'fake'"),
    ],
)
def test_a_table_wide_insert_still_cannot_bury_a_dead_message(roles: Roles, pg_engine, column, value):
    ob = Outbox()
    ob.route("e", lambda msg: None, name="r")
    app_role = roles.names["outbox_app"]
    with pg_engine.begin() as conn:
        conn.execute(text(f'GRANT INSERT ON outbox_message TO "{app_role}"'))
        conn.execute(text(_INSERT.format(columns="", values="")))
        conn.execute(m.update().values(status="dead", attempts=3))
        dead = conn.execute(select(m.c.id)).scalar_one()
    statement = _INSERT.format(columns=f", {column}", values=f", {value.format(dead=dead)}")
    refused(roles.engine("outbox_app"), statement, "row-level security")

    # What emit() writes still goes in, under the guide's grants and under the wider one.
    maker = sessionmaker(roles.engine("outbox_app"))
    ob.install(maker)
    try:
        with maker.begin() as session:
            emit(session, "e", {"n": 1})
    finally:
        ob.uninstall(maker)
    with pg_engine.connect() as conn:
        assert sorted(conn.execute(select(m.c.status)).scalars()) == ["dead", "pending"]


def test_the_owner_still_writes_lineage_through_requeue(roles: Roles, pg_engine):
    """Requeue runs as the tables' owner: the policy does not stand in its way."""
    with pg_engine.begin() as conn:
        conn.execute(text(_INSERT.format(columns="", values="")))
        conn.execute(m.update().values(status="dead", attempts=3))
        dead = conn.execute(select(m.c.id)).scalar_one()
    pairs = ops.requeue(
        roles.engine("outbox_operator"), ops.MessageFilter(ids=[dead]), reason="fixed", actor="ana"
    )
    with pg_engine.connect() as conn:
        copy = conn.execute(select(m.c.id, m.c.status).where(m.c.requeued_from == dead)).one()
    assert copy.status == "pending" and pairs == [(dead, copy.id)]


def test_pause_log_rows_name_the_login_and_the_database_clock(roles: Roles, pg_engine):
    operator = roles.engine("outbox_operator")
    ops.pause(operator, queue="mail", reason="provider incident", actor="ana")
    ops.resume(operator, queue="mail", reason="provider back", actor="ana")
    with pg_engine.connect() as conn:
        rows = conn.execute(
            text("SELECT event, actor, db_user, at <= now() AS stamped FROM outbox_pause_log ORDER BY id")
        ).all()
    login = roles.names["outbox_operator"]
    assert [tuple(r) for r in rows] == [("paused", "ana", login, True), ("resumed", "ana", login, True)]
