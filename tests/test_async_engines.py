"""Async applications with one URL: emit on every async driver, and a relay, CLI and migrations from it.

The relay, ``outbox`` and ``outbox.upgrade`` take an ``AsyncEngine`` or an
async URL and connect through the matching synchronous driver, with the
application engine's own settings: here a schema chosen in ``connect_args``
(``options`` for psycopg, ``server_settings`` for asyncpg), so a relay that
dropped them would find the template database's tables instead of the tenant's.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from relayproc import APPS, relay_command, relay_env
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import ConfigurationError, Outbox, emit
from outbox._urls import sync_engine, sync_url
from outbox.relay import Relay

sys.path.insert(0, str(APPS))
import counting_app  # noqa: E402

m = outbox.outbox_message

PG_DRIVERS = {
    "psycopg_async": ("postgresql+psycopg_async", {"options": "-c search_path=tenant"}),
    "asyncpg": ("postgresql+asyncpg", {"server_settings": {"search_path": "tenant"}}),
}


def _on(url: str, drivername: str) -> str:
    return make_url(url).set(drivername=drivername).render_as_string(hide_password=False)


def _recording_outbox() -> tuple[Outbox, list[int]]:
    ob = Outbox()
    delivered: list[int] = []
    ob.route("tenant.event", lambda message: delivered.append(message.payload["n"]), name="record")
    return ob, delivered


async def _emit_async(ob: Outbox, engine, numbers: range) -> None:
    maker = async_sessionmaker(engine, class_=AsyncSession)
    ob.install(maker)
    try:
        async with maker() as session, session.begin():
            for n in numbers:
                emit(session, "tenant.event", {"n": n})
    finally:
        ob.uninstall(maker)


@pytest.fixture
def tenant(pg_url):
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant"))
    yield admin
    admin.dispose()


def _counts(admin) -> tuple[list[str], int, int]:
    with admin.connect() as conn:
        tenant = conn.execute(text("SELECT status FROM tenant.outbox_message ORDER BY id")).scalars().all()
        history = conn.execute(text("SELECT count(*) FROM tenant.outbox_attempt")).scalar_one()
        public = conn.execute(text("SELECT count(*) FROM public.outbox_message")).scalar_one()
    return list(tenant), history, public


@pytest.mark.parametrize("driver", sorted(PG_DRIVERS))
def test_a_relay_serves_an_async_engine_with_its_connect_args(pg_url, tenant, driver):
    drivername, connect_args = PG_DRIVERS[driver]
    engine = create_async_engine(_on(pg_url, drivername), connect_args=connect_args)
    outbox.upgrade(engine)  # into the tenant schema: the settings reach migrations too
    ob, delivered = _recording_outbox()

    async def scenario() -> None:
        await _emit_async(ob, engine, range(3))
        await engine.dispose()

    asyncio.run(scenario())
    result = Relay(ob, engine).run_until_idle()

    assert sorted(delivered) == [0, 1, 2] and result.delivered == 3
    assert _counts(tenant) == (["delivered"] * 3, 3, 0)


@pytest.mark.parametrize("driver", sorted(PG_DRIVERS))
def test_an_embedded_relay_in_the_apps_loop_is_woken_by_the_commit(pg_url, tenant, driver):
    """relay.serve() as a task beside the application, the FastAPI lifespan shape; NOTIFY wakes it."""
    drivername, connect_args = PG_DRIVERS[driver]
    engine = create_async_engine(_on(pg_url, drivername), connect_args=connect_args)
    outbox.upgrade(engine)
    ob, delivered = _recording_outbox()
    emitter, _ = _recording_outbox()  # another Outbox: no in-process wake-up, only NOTIFY

    async def scenario() -> float:
        relay = Relay(ob, engine, poll_interval=60)
        task = asyncio.create_task(relay.serve())
        for _ in range(200):
            if relay.listener is not None and relay.listener.connected.is_set():
                break
            await asyncio.sleep(0.05)
        await _emit_async(emitter, engine, range(2))
        loop = asyncio.get_running_loop()
        start = loop.time()
        while len(delivered) < 2 and loop.time() - start < 20:
            await asyncio.sleep(0.02)
        waited = loop.time() - start
        relay.stop()
        await task
        await engine.dispose()
        return waited

    waited = asyncio.run(scenario())
    assert sorted(delivered) == [0, 1]
    assert waited < 20  # far below the 60 s poll interval: the commit's NOTIFY woke it
    assert _counts(tenant) == (["delivered"] * 2, 2, 0)


@pytest.mark.parametrize("driver", ["psycopg_async", "asyncpg"])
def test_emit_on_async_postgresql_drivers_commits_and_notifies(pg_url, driver):
    engine = create_async_engine(_on(pg_url, PG_DRIVERS[driver][0]))
    ob, _ = _recording_outbox()
    listener = psycopg.connect(_on(pg_url, "postgresql"), autocommit=True)
    listener.execute("LISTEN outbox")

    async def scenario() -> None:
        await _emit_async(ob, engine, range(2))
        maker = async_sessionmaker(engine)
        ob.install(maker)
        try:  # a rolled-back emit stores nothing
            async with maker() as session:
                async with session.begin():
                    emit(session, "tenant.event", {"n": 99})
                    await session.rollback()
        finally:
            ob.uninstall(maker)
        await engine.dispose()

    asyncio.run(scenario())
    notifies = list(listener.notifies(timeout=5, stop_after=1))
    listener.close()
    assert notifies and notifies[0].channel == "outbox"
    with create_engine(pg_url).connect() as conn:
        rows = conn.execute(select(m.c.payload, m.c.status).order_by(m.c.id)).all()
    assert [(r.payload["n"], r.status) for r in rows] == [(0, "pending"), (1, "pending")]


def test_aiosqlite_engine_emits_migrates_and_is_served(tmp_path):
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", connect_args={"timeout": 7})
    outbox.upgrade(engine)
    ob, delivered = _recording_outbox()

    async def scenario() -> None:
        await _emit_async(ob, engine, range(3))
        await engine.dispose()

    asyncio.run(scenario())
    relay = Relay(ob, engine)
    assert relay.engine.dialect.driver == "pysqlite"
    assert relay.run_until_idle().delivered == 3
    assert sorted(delivered) == [0, 1, 2]


def test_the_sync_engine_connects_with_the_apps_arguments(tmp_path):
    """What is carried over, read back from the derived engine's do_connect."""
    seen: dict[str, object] = {}

    def derived_params(async_engine) -> dict[str, object]:
        engine = sync_engine(async_engine)
        from sqlalchemy import event

        @event.listens_for(engine, "do_connect")
        def grab(dialect, record, cargs, cparams):
            seen.clear()
            seen.update(cparams)
            raise RuntimeError("enough")

        with pytest.raises(Exception, match="enough"):
            engine.connect()
        return dict(seen)

    asyncpg = create_async_engine(
        "postgresql+asyncpg://alice:s3cret@db.internal:6432/shop?ssl=require",
        connect_args={
            "server_settings": {"search_path": "tenant", "application_name": "my app"},
            "timeout": 5,
            "statement_cache_size": 0,
        },
    )
    params = derived_params(asyncpg)
    assert {k: params[k] for k in ("host", "port", "user", "password", "dbname", "sslmode")} == {
        "host": "db.internal",
        "port": 6432,
        "user": "alice",
        "password": "s3cret",
        "dbname": "shop",
        "sslmode": "require",
    }
    assert params["options"] == "-c search_path=tenant -c application_name=my\\ app"
    assert params["connect_timeout"] == 5 and "statement_cache_size" not in params

    lite = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", connect_args={"timeout": 7})
    assert derived_params(lite)["timeout"] == 7


@pytest.mark.parametrize(
    "connect_args, needle",
    [
        ({"ssl": ssl.create_default_context()}, "sslrootcert"),
        ({"password": lambda: "x"}, "password callable"),
        ({"direct_tls": True}, "direct_tls"),
    ],
)
def test_asyncpg_settings_psycopg_cannot_express_are_refused(connect_args, needle):
    engine = create_async_engine("postgresql+asyncpg://u@127.0.0.1/db", connect_args=connect_args)
    with pytest.raises(ConfigurationError, match=needle):
        sync_engine(engine)


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")
def test_an_engine_that_hides_its_arguments_is_refused():
    async def connect():  # pragma: no cover - never called
        raise AssertionError

    engine = create_async_engine("postgresql+asyncpg://", async_creator=connect)
    with pytest.raises(ConfigurationError, match="async_creator"):
        sync_engine(engine)
    memory = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(ConfigurationError, match="in-memory"):
        sync_engine(memory)


def test_async_urls_map_to_sync_drivers():
    assert sync_url(
        "postgresql+asyncpg://u@h/d?ssl=true&prepared_statement_cache_size=0"
    ).render_as_string() == ("postgresql+psycopg://u@h/d?sslmode=verify-full")
    assert sync_url("postgresql+psycopg_async://u@h/d").drivername == "postgresql+psycopg"
    assert sync_url("sqlite+aiosqlite:///a.db").render_as_string() == "sqlite:///a.db"
    assert sync_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"


def _one_line_error(result: subprocess.CompletedProcess[str], prog: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"{prog}: "), lines
    return lines[0]


def _outbox_command() -> list[str]:
    script = Path(sys.executable).with_name("outbox")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox"]


def test_postgres_scheme_gets_the_hint_in_one_line(tmp_path):
    url = "postgres://u:p@127.0.0.1/db"
    for cmd, prog in (
        ([*relay_command(), "--app", "counting_app:ob", "--database-url", url, "--once"], "outbox-relay"),
        ([*_outbox_command(), "stats", "--database-url", url], "outbox"),
    ):
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=relay_env(),
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 2
        assert "postgresql+psycopg://" in _one_line_error(result, prog)
    ob, _ = _recording_outbox()
    with pytest.raises(ConfigurationError, match=r"postgresql\+psycopg://") as caught:
        Relay(ob, url)
    assert "\n" not in str(caught.value)


def test_outbox_relay_serves_an_asyncpg_url(pg_url, pg_engine, tmp_path):
    counting_app.delivery_log.create(pg_engine)
    factory = sessionmaker(pg_engine)
    counting_app.ob.install(factory)
    try:
        with factory.begin() as session:
            for n in range(3):
                emit(session, counting_app.EVENT, {"n": n})
    finally:
        counting_app.ob.uninstall(factory)
    result = subprocess.run(
        [
            *relay_command(),
            "--app",
            "counting_app:ob",
            "--database-url",
            _on(pg_url, "postgresql+asyncpg"),
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=relay_env(
            pg_url
        ),  # the handler's own engine reads OUTBOX_DATABASE_URL; the flag wins for the relay
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "outbox-relay: delivered 3, retrying 0, dead 0"
    with pg_engine.connect() as conn:
        assert len(conn.execute(select(counting_app.delivery_log)).all()) == 3


def test_outbox_command_takes_an_aiosqlite_url(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    for args in (["migrate"], ["stats", "--json"]):
        result = subprocess.run(
            [*_outbox_command(), *args, "--database-url", url],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=relay_env(),
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 0, result.stderr
    assert '"pending"' in result.stdout or "pending" in result.stdout
