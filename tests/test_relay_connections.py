"""The relay's own psycopg connections (claims, outcomes, LISTEN) reach the engine's database.

They are opened outside SQLAlchemy's pool, so they must take everything the
engine connects with, not only its URL: here a schema chosen in
``connect_args``, the way a multi-tenant deployment puts each tenant's outbox
in its own schema.
"""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Outbox, emit
from outbox.relay import Relay


@pytest.mark.parametrize("via", ["connect_args", "creator"])
def test_a_relay_serves_the_schema_its_engine_connects_to(pg_url, via):
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant"))
    options = "-c search_path=tenant"
    if via == "connect_args":
        engine = create_engine(pg_url, connect_args={"options": options})
    else:
        import psycopg

        conninfo = admin.url.set(drivername="postgresql").render_as_string(hide_password=False)

        def connect() -> psycopg.Connection:
            return psycopg.connect(conninfo, options=options)

        engine = create_engine("postgresql+psycopg://", creator=connect)
    outbox.upgrade(engine)

    ob = Outbox()
    delivered: list[int] = []
    ob.route("tenant.event", lambda message: delivered.append(message.payload["n"]), name="record")
    maker = sessionmaker(engine)
    ob.install(maker)
    with maker.begin() as session:
        for n in range(3):
            emit(session, "tenant.event", {"n": n})

    Relay(ob, engine).run_until_idle()

    assert sorted(delivered) == [0, 1, 2]
    with admin.connect() as conn:
        tenant = conn.execute(text("SELECT status FROM tenant.outbox_message")).scalars().all()
        history = conn.execute(text("SELECT count(*) FROM tenant.outbox_attempt")).scalar_one()
        public = conn.execute(text("SELECT count(*) FROM public.outbox_message")).scalar_one()
    assert tenant == ["delivered"] * 3 and history == 3
    assert public == 0  # the template database's own outbox tables were never touched
    ob.uninstall(maker)
    engine.dispose()
    admin.dispose()
