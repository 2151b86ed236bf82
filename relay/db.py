"""Connections: the relay's engine, and the dedicated LISTEN connection on PostgreSQL.

NOTIFY is only a wake-up hint; polling is what guarantees delivery. The LISTEN
connection is therefore never pooled and never trusted blindly: it waits for
notifications with a timeout, checks the socket with a query when nothing
arrived, and on any error reconnects with capped backoff. After every
(re)LISTEN it asks the relay for a catch-up claim, because anything committed
while it was not listening sent its NOTIFY to nobody.

The relay's own claim and write connections (:class:`LoopConnection`) decode
JSON with ``documents.load_document``, which never raises on a document it
cannot decode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from outbox._first_line import first_line
from outbox._urls import sync_engine

from .documents import load_document
from .sql_postgresql import PINNED_PATH

__all__ = ["CHANNEL", "HOT_PATH", "Listener", "LoopConnection", "make_engine", "supports_listen"]

CHANNEL = "outbox"

log = logging.getLogger("outbox.relay")


def make_engine(target: Any) -> Engine:
    """A synchronous engine for an Engine, an AsyncEngine or a URL (see ``outbox._urls``).

    A synchronous Engine is used as it is; otherwise the relay owns the engine
    it gets. No pre-ping: it would cost a round trip per statement on the hot
    path. After a server restart the first statement fails as a disconnect,
    SQLAlchemy invalidates the whole pool, and the relay retries.
    """
    return sync_engine(target)


def supports_listen(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"


def _connect_kwargs(engine: Engine, application_name: str) -> dict[str, Any]:
    """Settings for a psycopg connection of the relay's own: those of one the engine made.

    Read off a live connection, they include what the engine knows beyond its
    URL: ``connect_args`` (SSL files, ``options`` such as a search_path), a
    ``creator``, ``do_connect`` listeners. The URL alone would send the claim
    and LISTEN connections to another schema or server, or fail where the
    server demands a client certificate. Blocking: call it from a thread.
    """
    with engine.connect() as conn:  # from the pool, once it holds one
        raw: Any = conn.connection.dbapi_connection
        info = raw.info
        kwargs: dict[str, Any] = dict(info.get_parameters())
        if info.password:  # get_parameters() leaves it out on purpose
            kwargs["password"] = info.password
    # Keep-alives make the kernel notice a dead peer on an idle LISTEN socket.
    kwargs.setdefault("keepalives", 1)
    kwargs.setdefault("keepalives_idle", 30)
    kwargs.setdefault("keepalives_interval", 10)
    kwargs.setdefault("keepalives_count", 3)
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("application_name", application_name)
    return kwargs


async def _connect(engine: Engine, application_name: str, **options: Any) -> Any:
    """A new psycopg AsyncConnection with the engine's settings; failures raise ``psycopg.Error``."""
    import psycopg

    try:
        kwargs = await asyncio.to_thread(_connect_kwargs, engine, application_name)
    except DBAPIError as exc:  # the engine could not connect either: report what psycopg said
        if isinstance(exc.orig, psycopg.Error):
            raise exc.orig from None
        raise
    return await psycopg.AsyncConnection.connect(**kwargs, **options)


#: The hot path's statements take milliseconds: JIT compilation, which PostgreSQL
#: switches on by cost estimate alone, would cost more than running them.
SHORT_STATEMENTS = "SET jit = off"

#: The claim's and the outcome writer's connections: they run only the relay's database functions,
#: named with their schema, on the search path those functions pin (``sql_postgresql.PINNED_PATH``).
HOT_PATH = f"{SHORT_STATEMENTS}; {PINNED_PATH}"


class LoopConnection:
    """An autocommit psycopg connection used from the event loop itself, for the hot path.

    A statement through the thread pool and SQLAlchemy's pool costs two thread
    hops and SQLAlchemy's execution machinery, more than its own round trip;
    claims (on the commit-to-handler path) and batches of outcomes (on the
    throughput path) run here, each on a connection of its own.
    A failed statement drops the connection (the next use opens a new one) and
    is raised as SQLAlchemy's ``DBAPIError``, so the relay handles one family
    of database errors whichever connection failed.
    """

    def __init__(
        self,
        engine: Engine,
        application_name: str = "outbox-relay claim",
        *,
        settings: str = SHORT_STATEMENTS,
    ) -> None:
        self._engine = engine
        self._application_name = application_name
        self._settings = settings
        self._conn: Any = None

    async def fetch(self, sql: str, params: dict[str, Any]) -> list[Any]:
        """Rows of one statement, with attribute access like SQLAlchemy's rows."""
        rows: list[Any] = await self._run(sql, params, fetch=True)
        return rows

    async def execute(self, sql: str, params: dict[str, Any]) -> None:
        await self._run(sql, params, fetch=False)

    async def _run(self, sql: str, params: dict[str, Any], *, fetch: bool) -> Any:
        import psycopg
        from psycopg.rows import namedtuple_row
        from psycopg.types.json import set_json_loads

        try:
            if self._conn is None:
                conn = await _connect(
                    self._engine, self._application_name, autocommit=True, row_factory=namedtuple_row
                )
                set_json_loads(load_document, conn)  # never raises: see documents.py
                if self._settings:
                    await conn.execute(self._settings)
                self._conn = conn
            cursor = await self._conn.execute(sql, params)
            return await cursor.fetchall() if fetch else None
        except psycopg.Error as exc:
            await self.close()
            raise DBAPIError.instance(sql, None, exc, psycopg.Error, hide_parameters=True) from None
        except BaseException:
            # Cancelled mid-statement: what the server did is unknown; never reuse the connection.
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except Exception:  # closing a broken connection: nothing left to save
                pass


class Listener:
    """Runs until cancelled: LISTEN, call ``on_notify`` with every wake-up's payload, reconnect on failure."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_notify: Callable[[str], None],
        on_listening: Callable[[], None],
        check_interval: float = 10.0,
        max_backoff: float = 30.0,
    ) -> None:
        self._engine = engine
        self._on_notify = on_notify
        self._on_listening = on_listening
        self._check_interval = check_interval
        self._max_backoff = max_backoff
        self.connected = asyncio.Event()
        self.backend_pid: int | None = None

    async def run(self) -> None:
        """LISTEN until cancelled. Every error, not only psycopg's, ends in a reconnect.

        Reading the engine's settings can fail in SQLAlchemy's pool (a pool
        timeout, say), and a LISTEN connection lost for good would leave the
        relay polling without anyone noticing; ``connected`` is clear whenever
        nothing is listening, which is what ``/readyz`` reports.
        """
        failures = 0
        try:
            while True:
                try:
                    conn = await _connect(self._engine, "outbox-relay listen", autocommit=True)
                except Exception as exc:
                    failures += 1
                    await self._pause(failures, "connect", exc)
                    continue
                try:
                    async with conn:
                        await conn.execute(f"LISTEN {CHANNEL}")
                        self.backend_pid = conn.info.backend_pid
                        if failures:
                            log.info(
                                "listening again after %d failure(s)", failures, extra={"action": "listen"}
                            )
                        failures = 0
                        self.connected.set()
                        self._on_listening()
                        while True:
                            async for notify in conn.notifies(timeout=self._check_interval):
                                self._on_notify(notify.payload)
                            # Quiet for a while: prove the socket is alive, or fail into a reconnect.
                            await conn.execute("SELECT 1")
                except Exception as exc:
                    self._not_listening()
                    failures += 1
                    await self._pause(failures, "lost", exc)
        finally:
            self._not_listening()

    def _not_listening(self) -> None:
        self.connected.clear()
        self.backend_pid = None

    async def _pause(self, failures: int, what: str, exc: Exception) -> None:
        delay = min(self._max_backoff, 0.25 * 2 ** min(failures - 1, 10))
        reason = first_line(exc)
        log.warning(
            "LISTEN connection %s (%s: %s); retrying in %.1fs, polling meanwhile",
            "failed" if what == "connect" else "lost",
            type(exc).__name__,
            reason,
            delay,
            extra={"action": "listen_retry", "failures": failures},
        )
        await asyncio.sleep(delay)
