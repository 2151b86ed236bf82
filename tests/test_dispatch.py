"""How one attempt's result is classified, through a real relay on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Backoff, Outbox, emit
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_handlers_own_timeout_error_is_a_failure_not_the_relays_timeout(engine: Engine, kind: str):
    """A socket timing out inside the handler is its error; "timeout" means the route's limit expired."""
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    if kind == "async":

        @ob.handler("e", name="h", timeout=30, max_attempts=2)
        async def handler(msg):
            raise TimeoutError("upstream read timed out after 2s")

    else:

        @ob.handler("e", name="h", timeout=30, max_attempts=2)
        def handler(msg):
            raise TimeoutError("upstream read timed out after 2s")

    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker() as s, s.begin():
            emit(s, "e", {"n": 1})
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(maker)
    with engine.connect() as conn:
        got = [(h.outcome, h.error_type, h.error) for h in conn.execute(select(a).order_by(a.c.id))]
        status = conn.execute(select(m.c.status)).scalar_one()
    assert got == [
        ("failed", "TimeoutError", "upstream read timed out after 2s"),
        ("dead", "TimeoutError", "upstream read timed out after 2s"),
    ]
    assert status == "dead"
