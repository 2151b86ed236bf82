"""The relay's own psycopg connections (claims, outcomes, LISTEN) reach the engine's database.

They are opened outside SQLAlchemy's pool, so they must take everything the
engine connects with, not only its URL: here a schema chosen in
``connect_args``, the way a multi-tenant deployment puts each tenant's outbox
in its own schema.
"""

from __future__ import annotations

import logging
import threading

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


def test_listening_is_restored_after_a_non_database_error_and_readyz_says_when_it_is_down(pg_url, caplog):
    """A reconnect that fails outside psycopg (here SQLAlchemy's pool timing out) must not end LISTEN."""
    from relayproc import wait_until

    from outbox.relay.metrics import RelayMetrics

    caplog.set_level(logging.WARNING, logger="outbox.relay")
    # One pooled connection, and the test holds it while the LISTEN connection is lost: the
    # listener's reconnect needs the pool to read the connection settings, and times out.
    engine = create_engine(pg_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    ob = Outbox()
    ob.route("e", lambda message: None, name="r")
    metrics = RelayMetrics()
    relay = Relay(ob, engine, poll_interval=0.1, metrics=metrics, metrics_interval=0.1)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: metrics.ready()[0], "the relay ready, listening")
        first = relay.listener.backend_pid if relay.listener else None
        assert first is not None
        held = engine.connect()
        try:
            with admin.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
            wait_until(lambda: metrics.ready() == (False, "LISTEN connection down"), "readyz to say so")
            wait_until(
                lambda: len([r for r in caplog.records if getattr(r, "action", "") == "listen_retry"]) >= 2,
                "reconnects failing on the pool, logged",
            )
        finally:
            held.close()
        wait_until(
            lambda: relay.listener is not None and relay.listener.backend_pid not in (None, first),
            "a new LISTEN connection",
            timeout=15,
        )
        wait_until(lambda: metrics.ready()[0], "the relay ready again")
    finally:
        relay.stop()
        thread.join(10)
        engine.dispose()
        admin.dispose()


def test_the_relays_hot_path_connections_never_jit_compile(pg_url):
    """PostgreSQL turns JIT on by cost estimate alone; on a claim that runs in milliseconds,
    compiling costs far more than the statement (it did on a million pending rows)."""
    import asyncio

    from outbox.relay.db import LoopConnection

    async def setting() -> str:
        conn = LoopConnection(create_engine(pg_url))
        try:
            rows = await conn.fetch("SELECT current_setting('jit') AS jit", {})
        finally:
            await conn.close()
        return str(rows[0].jit)

    assert asyncio.run(setting()) == "off"


def test_a_relay_holds_three_connections_of_its_own_and_borrows_the_rest_from_its_pool(pg_url):
    """What docs/frameworks.md counts per relay: LISTEN, claims and outcomes, plus its engine's pool."""
    from relayproc import wait_until

    pool_size = 5  # SQLAlchemy's default, made strict: no overflow
    engine = create_engine(pg_url, pool_size=pool_size, max_overflow=0)
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        own_pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    delivered: list[int] = []
    ob = Outbox()
    ob.route("e", lambda message: delivered.append(message.id), name="r")
    maker = sessionmaker(engine)
    ob.install(maker)
    relay = Relay(ob, engine, poll_interval=0.1)
    thread = threading.Thread(target=relay.run)
    seen: dict[int, str] = {}

    def sample() -> None:
        with admin.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT pid, application_name FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> :own"
                ),
                {"own": own_pid},
            ).all()
        assert len(rows) <= 3 + pool_size, rows  # the test's own emits share the pool
        seen.update(dict(rows))  # type: ignore[arg-type]

    def all_delivered_and_sampled() -> bool:
        # the outcome connection opens on the first write, which may come after the last emit
        sample()
        return len(delivered) == 100 and "outbox-relay write" in seen.values()

    thread.start()
    try:
        for batch in range(20):
            with maker.begin() as s:
                for number in range(5):
                    emit(s, "e", {"n": batch * 5 + number})
            sample()
        wait_until(all_delivered_and_sampled, "every message delivered, its outcome connection seen")
    finally:
        relay.stop()
        thread.join(10)
        ob.uninstall(maker)
        engine.dispose()
        admin.dispose()
    own = sorted(name for name in seen.values() if name.startswith("outbox-relay"))
    assert own == ["outbox-relay claim", "outbox-relay listen", "outbox-relay write"]
