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


class Garbled(Exception):
    """An exception a library built badly: neither str() nor repr() works."""

    def __str__(self) -> str:
        raise TypeError("__str__ returned non-string (type NoneType)")

    def __repr__(self) -> str:
        raise TypeError("__repr__ returned non-string (type NoneType)")


class Unserialisable:
    def __repr__(self) -> str:
        raise ValueError("no repr either")


def _deliver_once(engine: Engine, ob: Outbox) -> None:
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker() as s, s.begin():
            emit(s, "e", {"n": 1})
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(maker)


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_an_exception_that_cannot_be_printed_is_recorded_as_unprintable_and_classified(
    engine: Engine, max_attempts: int
):
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))

    @ob.handler("e", name="h", max_attempts=max_attempts)
    def handler(msg):
        raise Garbled()

    _deliver_once(engine, ob)
    with engine.connect() as conn:
        rows = conn.execute(select(a).order_by(a.c.id))
        got = [(h.attempt, h.outcome, h.error_type, h.error) for h in rows]
        row = conn.execute(select(m.c.status, m.c.attempts, m.c.last_error)).one()
    name = f"{__name__}.Garbled"
    unprintable = "<unprintable Garbled>"
    if max_attempts == 1:
        assert got == [(1, "dead", name, unprintable)]
    else:
        assert got == [(1, "failed", name, unprintable), (2, "dead", name, unprintable)]
    assert row == ("dead", max_attempts, "<unprintable Garbled>")


def test_an_error_detail_that_can_be_neither_serialised_nor_printed_is_stored_as_unprintable(engine: Engine):
    ob = Outbox()

    class WithDetail(Exception):
        detail = {"reply": Unserialisable(), "status": 502}

    @ob.handler("e", name="h", max_attempts=1)
    def handler(msg):
        raise WithDetail("bad gateway")

    _deliver_once(engine, ob)
    with engine.connect() as conn:
        ((outcome, error, detail),) = conn.execute(select(a.c.outcome, a.c.error, a.c.detail)).all()
    assert (outcome, error) == ("dead", "bad gateway")
    assert detail == {"unstorable_detail": "<unprintable dict>"}


def test_a_returned_detail_is_stored_as_plain_json_whatever_it_holds(engine: Engine):
    """Plain values are kept as they are; datetimes, UUIDs, NaN and NUL become storable text."""
    import math
    import uuid
    from datetime import UTC, datetime

    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    ref = uuid.UUID(int=7)
    ob = Outbox()
    returned = [
        {"status": 202, "ok": True, "id": "abc", "none": None, "ms": 1.5, "tags": ["a", {"b": 2}]},
        {"at": when, "ref": ref, "ratio": math.nan, "text": "a\x00b"},
        {"text": "a\x00b", "codes": [250, 251]},
    ]

    @ob.handler("e", name="h", max_attempts=1)
    def handler(msg):
        return returned[msg.payload["n"]]

    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker() as s, s.begin():
            for n in range(3):
                emit(s, "e", {"n": n})
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(maker)
    with engine.connect() as conn:
        details = conn.execute(select(a.c.detail).order_by(a.c.message_id)).scalars().all()
    assert details == [
        {"status": 202, "ok": True, "id": "abc", "none": None, "ms": 1.5, "tags": ["a", {"b": 2}]},
        {"at": str(when), "ref": str(ref), "ratio": "NaN", "text": "a\\x00b"},
        {"text": "a\\x00b", "codes": [250, 251]},
    ]
    assert returned[0]["tags"][1] == {"b": 2}  # the handler's own objects are left as they were
