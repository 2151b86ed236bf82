"""The relay's row in ``outbox_relay_registry``: who it is, that it is alive, what it holds, what it cuts off.

What a relay knows about itself (in-flight deliveries, open circuit breakers,
rate limits) lives in its memory; this row is how an operator or a dashboard
sees every relay at once (``outbox.ops.relays``). It is upserted when serving
starts (a relay restarted under the same id takes its row over), rewritten
every ``registry_interval`` seconds with one small UPDATE, and stamped
``stopped_at`` at a clean stop. Nothing here may stop or slow a delivery: the
row is written from a background task, a failure is logged once per streak of
failures (action ``registry_error``) and the write is simply tried again one
period later. A database not migrated to ``outbox_0011`` costs a log line,
not a relay.

Times come from the same clock as the relay's other statements (``clock``): the
server's ``now()`` on PostgreSQL, this host's UTC clock on SQLite.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import Route, outbox_relay_registry

from .clock import StatementClock
from .run_context import RunContext, first_line, log

__all__ = ["Registry", "handler_states"]

r = outbox_relay_registry


def _rate_limit(handler: object) -> float | None:
    """``rate_limit`` (webhooks: per destination host) or a ``rate_limiter``'s rate (email)."""
    rate = getattr(handler, "rate_limit", None)
    if rate is None:
        rate = getattr(getattr(handler, "rate_limiter", None), "rate", None)
    if isinstance(rate, int | float) and not isinstance(rate, bool) and math.isfinite(rate):
        return float(rate)
    return None


def handler_states(
    routes: Mapping[str, Route], *, warned: set[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``{route: {"breakers": {destination: is_open}, "rate_limit": per_second_or_None}}``.

    A handler's own ``outbox_breaker_states()`` that raises reports no breakers:
    a broken status hook must not cost the relay its row. It is logged once per
    route (``warned`` remembers which), not every period.
    """
    states: dict[str, dict[str, Any]] = {}
    for name, route in sorted(routes.items()):
        breakers: dict[str, bool] = {}
        report = getattr(route.handler, "outbox_breaker_states", None)
        if callable(report):
            try:
                breakers = {str(k): bool(v) for k, v in dict(report()).items()}
            except Exception:
                if warned is not None and name not in warned:
                    warned.add(name)
                    log.warning(
                        "route %r: outbox_breaker_states() raised; its breakers are left out of the registry",
                        name,
                        exc_info=True,
                        extra={"action": "registry_error", "handler": name},
                    )
        states[name] = {"breakers": breakers, "rate_limit": _rate_limit(route.handler)}
    return states


class _Statements:
    """The three writes, synchronous, run on the relay's database threads."""

    def __init__(self, engine: Engine, relay_id: str, queues: Sequence[str] | None) -> None:
        self.engine = engine
        self.relay_id = relay_id
        self.queues = list(queues or ())  # [] means every queue: a relay refuses an empty list
        self.clock = StatementClock(engine)

    def register(self, in_flight: int, handlers: dict[str, Any]) -> None:
        """Take the row over: a relay restarted with the same id is a new start, not a resumption."""
        now = self.clock.now()
        values = {
            "host": socket.gethostname()[:255],
            "pid": os.getpid(),
            "started_at": now,
            "seen_at": now,
            "stopped_at": None,
            "queues": self.queues,
            "in_flight": in_flight,
            "handlers": handlers,
        }
        name = self.engine.dialect.name
        if name == "postgresql":
            statement: Any = pg_insert(r).values(relay_id=self.relay_id, **values)
            statement = statement.on_conflict_do_update(index_elements=[r.c.relay_id], set_=values)
        elif name == "sqlite":
            statement = sqlite_insert(r).values(relay_id=self.relay_id, **values)
            statement = statement.on_conflict_do_update(index_elements=[r.c.relay_id], set_=values)
        else:  # pragma: no cover - only PostgreSQL and SQLite are supported
            statement = insert(r).values(relay_id=self.relay_id, **values)
        with self.engine.begin() as conn:
            conn.execute(statement)

    def refresh(self, in_flight: int, handlers: dict[str, Any]) -> bool:
        """False when the row is gone (deleted by hand): the caller registers again."""
        return self._update({"seen_at": self.clock.now(), "in_flight": in_flight, "handlers": handlers})

    def stop(self, handlers: dict[str, Any]) -> bool:
        now = self.clock.now()
        return self._update({"seen_at": now, "stopped_at": now, "in_flight": 0, "handlers": handlers})

    def _update(self, values: dict[str, Any]) -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(update(r).where(r.c.relay_id == self.relay_id).values(**values))
        return done.rowcount > 0


class Registry:
    """Keeps this relay's row current while it serves; one owner, the ``outbox-registry`` task."""

    def __init__(
        self,
        rt: RunContext,
        *,
        engine: Engine,
        queues: Sequence[str] | None,
        period: float,
        in_flight: Callable[[], int],
    ) -> None:
        self._rt = rt
        self._sql = _Statements(engine, rt.id, queues)
        self._period = period
        self._in_flight = in_flight
        self._registered = False
        self._failing = False
        self._warned: set[str] = set()  # routes whose breaker report raised, logged once

    def _snapshot(self) -> tuple[int, dict[str, Any]]:
        """Read on the event loop, which owns the in-flight tasks; only the write goes to a thread."""
        return self._in_flight(), handler_states(self._rt.routes, warned=self._warned)

    async def write_once(self) -> None:
        in_flight, handlers = self._snapshot()
        try:
            if self._registered:
                self._registered = await self._rt.db(self._sql.refresh, in_flight, handlers)
            if not self._registered:
                await self._rt.db(self._sql.register, in_flight, handlers)
                self._registered = True
        except SQLAlchemyError as exc:
            self._failed(exc)
            return
        if self._failing:
            self._failing = False
            log.info(
                "relay registry written again",
                extra={"action": "registry_ok", "relay_id": self._rt.id},
            )

    def _failed(self, exc: SQLAlchemyError) -> None:
        if self._failing:
            return  # once per streak: a database that is down says so in the claim loop's lines already
        self._failing = True
        log.warning(
            "could not write this relay's row in outbox_relay_registry (%s); retrying every %gs",
            first_line(exc),
            self._period,
            extra={"action": "registry_error", "relay_id": self._rt.id},
        )

    async def run(self) -> None:
        """Register, then refresh once a period, for as long as the relay serves."""
        while True:
            await self.write_once()
            await asyncio.sleep(self._period)

    async def stopped(self, background: list[asyncio.Task[Any]]) -> None:
        """One try at a clean stop's stamp: a relay that cannot write it is later seen as not alive.

        Tried even if no write succeeded yet: a registration cancelled in flight may have landed,
        and without a row the UPDATE changes nothing.
        """
        mine = [task for task in background if task.get_name() == "outbox-registry"]
        for task in mine:
            task.cancel()  # no refresh after the stamp, and none racing it
        await asyncio.gather(*mine, return_exceptions=True)
        try:
            await self._rt.db(self._sql.stop, handler_states(self._rt.routes, warned=self._warned))
        except SQLAlchemyError as exc:
            if not self._failing:
                log.warning(
                    "could not record this relay's stop in outbox_relay_registry (%s)",
                    first_line(exc),
                    extra={"action": "registry_error", "relay_id": self._rt.id},
                )
