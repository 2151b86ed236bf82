"""The synchronous engine the relay, the ``outbox`` command and migrations use, from any engine or URL.

Those parts run blocking SQLAlchemy statements on threads, so an asyncio
driver is no use to them. An application with one async URL or one
``AsyncEngine`` gets the matching synchronous driver instead:

=============================  ==========================
the application's driver        what the outbox connects with
=============================  ==========================
``postgresql+asyncpg``          ``postgresql+psycopg``
``postgresql+psycopg_async``    ``postgresql+psycopg``
``sqlite+aiosqlite``            ``sqlite`` (pysqlite)
=============================  ==========================

For an ``AsyncEngine`` the derived engine also connects with the
application's connection settings (``connect_args`` and what the URL says).
They are learnt through two documented SQLAlchemy APIs: ``Pool.recreate()``
gives an empty pool sharing the engine's connection function, and a
``do_connect`` listener on the engine receives the exact arguments that
function is about to pass to the driver, URL and ``connect_args`` merged and
changed by any ``do_connect`` listener registered before ours. The listener
then stops the connection attempt, so learning them costs no round trip and
never touches the application's pool or event loop. They are learnt afresh for
every connection the derived engine opens, so a listener that puts a fresh
token in the password keeps working.

Limits: an engine made with ``creator=``/``async_creator=``, or whose own
``do_connect`` listener opens the connection itself, never shows its
arguments, and is refused with a :class:`ConfigurationError`; so are asyncpg
settings libpq has no equivalent for (an ``ssl.SSLContext``, a password
callable, ``direct_tls``). asyncpg's client-side knobs (statement caches,
``command_timeout``) are dropped: they change nothing about where or as whom
the outbox connects. Engine options other than connection arguments (pool
size, echo, execution options) are not copied.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

from ._exceptions import ConfigurationError
from ._tables import outbox_message

__all__ = ["check_url", "engine_of", "sync_engine", "sync_url"]

#: Async drivers and the synchronous driver the outbox uses in their place.
SYNC_DRIVERS = {
    "postgresql+asyncpg": "postgresql+psycopg",
    "postgresql+psycopg_async": "postgresql+psycopg",
    "sqlite+aiosqlite": "sqlite",
}

_POSTGRES_HINT = "write postgresql+psycopg://user:password@host/dbname (psycopg 3 ships with the outbox)"

#: asyncpg settings that are about the client alone: where and as whom it connects stays the same.
_ASYNCPG_CLIENT_ONLY = frozenset(
    {
        "statement_cache_size",
        "max_cached_statement_lifetime",
        "max_cacheable_statement_size",
        "command_timeout",
        "prepared_statement_cache_size",
        "prepared_statement_name_func",
        "record_class",
        "connection_class",
        "loop",
    }
)
#: asyncpg parameters with the same name and meaning in libpq.
_ASYNCPG_SAME = frozenset({"user", "password", "passfile", "target_session_attrs", "krbsrvname", "gsslib"})
_SSLMODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})


def check_url(target: str | URL) -> URL:
    """Parse a database URL, refusing the spellings SQLAlchemy cannot load with a hint instead."""
    try:
        url = make_url(target)
    except ArgumentError as exc:
        raise ConfigurationError(f"invalid database URL: {exc}") from None
    backend, _, _driver = url.drivername.partition("+")
    if backend == "postgres":
        # SQLAlchemy dropped this alias on purpose; rewriting it here would hide which driver runs.
        raise ConfigurationError(f"SQLAlchemy does not accept postgres:// URLs: {_POSTGRES_HINT}")
    return url


def sync_url(target: str | URL) -> URL:
    """The URL with an async driver replaced by the synchronous one the outbox uses."""
    url = check_url(target)
    sync = SYNC_DRIVERS.get(url.drivername)
    if sync is None:
        return url
    if url.drivername == "postgresql+asyncpg":
        query = dict(url.query)
        ssl = query.pop("ssl", None)
        for key in _ASYNCPG_CLIENT_ONLY:
            query.pop(key, None)
        if ssl is not None:
            query.setdefault("sslmode", _sslmode(ssl))
        url = url.set(query=query)
    return url.set(drivername=sync)


def sync_engine(target: Any, **engine_options: Any) -> Engine:
    """A synchronous Engine for ``target``: an Engine, an AsyncEngine, or a URL (sync or async).

    A synchronous Engine comes back as it is. Anything else gets a new Engine,
    which the caller owns (and disposes); ``engine_options`` go to
    ``create_engine`` for it.
    """
    # Duck-typed: importing sqlalchemy.ext.asyncio needs greenlet, which sync apps may not have.
    inner = getattr(target, "sync_engine", None)
    if isinstance(inner, Engine):
        target = inner
    if isinstance(target, Engine):
        if not target.dialect.is_async:
            return target
        return _engine_like(target, engine_options)
    if not isinstance(target, str | URL):
        raise ConfigurationError(
            f"expected a database URL, an Engine or an AsyncEngine, got {type(target).__name__}"
        )
    return _create(sync_url(target), engine_options)


def engine_of(bind: Any) -> Any:
    """The engine behind a Session, an AsyncSession, a Connection or an AsyncConnection; anything else as is.

    What it returns goes to :func:`sync_engine`, the one place that turns an
    engine or URL into what the outbox connects with, so helpers that take "a
    bind" accept everything the relay does plus the sessions and connections a
    test holds. A session's bind for the outbox's own table is used, so
    ``sessionmaker(binds={...})`` finds the right database.
    """
    for attribute in ("sync_session", "sync_connection"):  # an AsyncSession, an AsyncConnection
        inner = getattr(bind, attribute, None)
        if isinstance(inner, Session | Connection):
            bind = inner
            break
    if isinstance(bind, Session):
        bind = bind.get_bind(clause=outbox_message)
    if isinstance(bind, Connection):
        return bind.engine
    return bind


def _create(url: URL, engine_options: dict[str, Any]) -> Engine:
    try:
        return create_engine(url, **engine_options)
    except ModuleNotFoundError as exc:
        if url.drivername == "postgresql":
            raise ConfigurationError(
                f"postgresql:// without a driver means psycopg2, which is not installed ({exc}): "
                + _POSTGRES_HINT
            ) from None
        raise ConfigurationError(f"cannot use database URL {url.render_as_string()}: {exc}") from None
    except Exception as exc:  # NoSuchModuleError, ArgumentError, ...: one line, what SQLAlchemy said
        raise ConfigurationError(f"cannot use database URL {url.render_as_string()}: {exc}") from None


def _engine_like(app_engine: Engine, engine_options: dict[str, Any]) -> Engine:
    """A synchronous Engine connecting with the async ``app_engine``'s driver arguments."""
    driver = app_engine.url.drivername
    if driver not in SYNC_DRIVERS:
        raise ConfigurationError(
            f"the outbox has no synchronous driver for {driver!r}: "
            f"use one of {', '.join(sorted(SYNC_DRIVERS))}, or pass a synchronous URL"
        )
    connect_params(app_engine)  # refuse now what cannot be translated, not at the first connection
    engine = _create(sync_url(app_engine.url), engine_options)

    @event.listens_for(engine, "do_connect")
    def connect_like_the_app(dialect: Any, record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
        app_cargs, app_cparams = connect_params(app_engine)
        own_context = cparams.get("context")  # psycopg's type adapters belong to this dialect
        cargs[:] = app_cargs
        cparams.clear()
        cparams.update(app_cparams)
        if own_context is not None:
            cparams["context"] = own_context

    return engine


class _Learnt(Exception):
    """Carries the driver arguments out of the connection attempt it stops."""


_learning = threading.local()


def _learn(dialect: Any, record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
    # Registered once per application engine and idle there, except during connect_params() on this thread.
    if getattr(_learning, "active", False):
        raise _Learnt(list(cargs), dict(cparams))


def connect_params(app_engine: Engine) -> tuple[list[Any], dict[str, Any]]:
    """The synchronous driver's arguments equivalent to those the async ``app_engine`` connects with."""
    if not event.contains(app_engine, "do_connect", _learn):
        event.listen(app_engine, "do_connect", _learn)
    pool = app_engine.pool.recreate()
    _learning.active = True
    try:
        connection = pool.connect()
    except _Learnt as learnt:
        cargs, cparams = learnt.args
    except Exception as exc:
        raise _unlearnable(app_engine, f"{type(exc).__name__}: {exc}") from None
    else:  # a creator or a listener connected without showing us the arguments
        connection.invalidate()
        raise _unlearnable(app_engine, "it connected without passing them through do_connect")
    finally:
        _learning.active = False
        pool.dispose()
    return _translate(app_engine.url.drivername, cargs, cparams)


def _unlearnable(app_engine: Engine, why: str) -> ConfigurationError:
    url = app_engine.url.render_as_string(hide_password=True)
    return ConfigurationError(
        f"cannot learn how the engine for {url} connects ({why}); an engine made with creator= or "
        "async_creator= hides its connection arguments: give the outbox a synchronous URL or Engine instead"
    )


def _translate(driver: str, cargs: list[Any], cparams: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    if driver == "postgresql+psycopg_async":
        return cargs, {k: v for k, v in cparams.items() if k != "context"}
    if driver == "sqlite+aiosqlite":
        database = cargs[0] if cargs else cparams.get("database", "")
        if _in_memory(str(database)):
            raise ConfigurationError(
                "an in-memory SQLite database lives inside one connection, so the outbox cannot open "
                "it a second time: use a file (sqlite+aiosqlite:///app.db)"
            )
        return cargs, {k: v for k, v in cparams.items() if k not in ("iter_chunk_size", "loop")}
    return [], _libpq_params(cargs, cparams)


def _libpq_params(cargs: list[Any], cparams: dict[str, Any]) -> dict[str, Any]:
    """asyncpg's ``connect()`` arguments as libpq (psycopg) connection parameters."""
    if cargs:
        cparams = {"dsn": cargs[0], **cparams}
    params: dict[str, Any] = {}
    for key, value in cparams.items():
        if key in _ASYNCPG_CLIENT_ONLY or value is None:
            continue
        if key == "password" and callable(value):
            raise ConfigurationError(
                "asyncpg's password callable has no psycopg equivalent: set the password in the URL, "
                "or give the outbox a synchronous URL or Engine (a do_connect listener can set a fresh one)"
            )
        if key in _ASYNCPG_SAME:
            params[key] = value
        elif key in ("host", "port"):
            params[key] = ",".join(map(str, value)) if isinstance(value, list | tuple) else value
        elif key == "database":
            params["dbname"] = value
        elif key == "dsn":
            params["conninfo"] = value
        elif key == "timeout":
            params["connect_timeout"] = max(1, round(float(value)))
        elif key == "ssl":
            params["sslmode"] = _sslmode(value)
        elif key == "server_settings":
            options = " ".join(f"-c {_option(k, v)}" for k, v in dict(value).items())
            if options:
                params["options"] = options
        else:
            raise ConfigurationError(
                f"asyncpg's connect argument {key}={value!r} has no psycopg equivalent the outbox knows: "
                "give the outbox a synchronous URL or Engine (postgresql+psycopg://...) that says the same"
            )
    return params


def _sslmode(value: Any) -> str:
    if value is True or (isinstance(value, str) and value.lower() == "true"):
        return "verify-full"  # asyncpg's ssl=True: a default SSLContext, which checks cert and host name
    if value is False or (isinstance(value, str) and value.lower() == "false"):
        return "disable"
    if isinstance(value, str) and value in _SSLMODES:
        return value
    raise ConfigurationError(
        f"asyncpg's ssl={value!r} cannot be carried over to psycopg: give the outbox a synchronous "
        "URL with sslmode, sslrootcert, sslcert and sslkey (postgresql+psycopg://...?sslmode=verify-full"
        "&sslrootcert=ca.pem) that says the same"
    )


def _option(key: str, value: Any) -> str:
    """One ``-c name=value`` of libpq's ``options``: spaces and backslashes escaped as libpq wants."""
    text = f"{key}={value}"
    return text.replace("\\", "\\\\").replace(" ", "\\ ")


def _in_memory(database: str | None) -> bool:
    return not database or database == ":memory:" or "mode=memory" in database
