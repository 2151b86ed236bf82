"""How one attempt's result is classified, through a real relay on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from stamped import as_reported

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


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_handlers_own_cancelled_error_is_a_failure_retried_with_backoff_not_a_relay_stop(
    engine: Engine, kind: str
):
    """A library's cancelled future inside the handler is its error; "Cancelled" means a relay stop."""
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    calls: list[int] = []

    def give_up_once(msg):
        calls.append(msg.attempt)
        if msg.attempt == 1:
            raise asyncio.CancelledError("the client's connection pool was closed")

    if kind == "async":

        @ob.handler("e", name="h", max_attempts=3)
        async def handler(msg):
            await asyncio.sleep(0)
            give_up_once(msg)

    else:
        ob.route("e", give_up_once, name="h", max_attempts=3)

    _deliver_once(engine, ob)
    with engine.connect() as conn:
        rows = conn.execute(select(a).order_by(a.c.id))
        got = [(h.attempt, h.outcome, h.error_type, h.error) for h in rows]
    assert got == [
        (1, "failed", "asyncio.exceptions.CancelledError", "the client's connection pool was closed"),
        (2, "delivered", None, None),
    ]
    assert calls == [1, 2]


def test_a_plain_handler_raising_stop_iteration_fails_at_once_not_after_its_timeout(engine: Engine):
    """An asyncio future cannot carry StopIteration: it is recorded as a coroutine's is, a RuntimeError."""
    ob = Outbox()

    @ob.handler("e", name="h", timeout=30, max_attempts=1)
    def handler(msg):
        return next(iter(()))

    started = time.monotonic()
    _deliver_once(engine, ob)
    assert time.monotonic() - started < 15, "the attempt must not wait for the route's 30 s timeout"
    with engine.connect() as conn:
        got = [(h.outcome, h.error_type, h.error) for h in conn.execute(select(a))]
    assert got == [("dead", "RuntimeError", "handler raised StopIteration")]


class ExitsWhenPrinted(Exception):
    """An exception whose str() ends the program: the relay prints it, so that must not end the relay."""

    def __str__(self) -> str:
        raise SystemExit("printed")


def test_an_exception_whose_str_raises_system_exit_is_recorded_as_unprintable(engine: Engine):
    ob = Outbox()

    @ob.handler("e", name="h", max_attempts=1)
    async def handler(msg):
        raise ExitsWhenPrinted()

    _deliver_once(engine, ob)
    with engine.connect() as conn:
        got = [(h.outcome, h.error_type, h.error) for h in conn.execute(select(a))]
    assert got == [("dead", f"{__name__}.ExitsWhenPrinted", "<unprintable ExitsWhenPrinted>")]


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
    assert as_reported(detail) == {"unstorable_detail": "<unprintable dict>"}


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
        details = [
            as_reported(d) for d in conn.execute(select(a.c.detail).order_by(a.c.message_id)).scalars()
        ]
    assert details == [
        {"status": 202, "ok": True, "id": "abc", "none": None, "ms": 1.5, "tags": ["a", {"b": 2}]},
        {"at": str(when), "ref": str(ref), "ratio": "NaN", "text": "a\\x00b"},
        {"text": "a\\x00b", "codes": [250, 251]},
    ]
    assert returned[0]["tags"][1] == {"b": 2}  # the handler's own objects are left as they were


class Upstream(Exception):
    """A client library's error quoting the reply it got, and keeping it as the detail."""

    def __init__(self, reply: Any, detail: Any) -> None:
        super().__init__(reply)
        self.detail = detail


def _chain(levels: int) -> dict[str, Any]:
    """An object ``levels`` deep, with a secret-named key at every level."""
    doc: dict[str, Any] = {"end": True}
    for _ in range(levels - 1):
        doc = {"next": doc, "token": "hunter2"}
    return doc


def _depth(document: Any) -> int:
    """Levels of objects and arrays, counted without recursion."""
    deepest, level = 0, [(document, 1)]
    while level:
        value, depth = level.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            level.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def test_deeply_nested_errors_and_details_are_recorded_cut_to_what_readers_show(engine: Engine):
    """A handler's exception or result may hold anything; its outcome is still written, and the
    stored detail stops at DEPTH_SHOWN levels, where ``outbox show`` and the dashboard stop too."""
    from outbox._redact import DEPTH_SHOWN, TOO_DEEP

    ob = Outbox()

    @ob.handler("e", name="h", max_attempts=1)
    def handler(msg):
        n = msg.payload["n"]
        if n == 0:  # far past the recursion limit in the args, past what is shown in the detail
            raise Upstream(_chain(5000), _chain(300))
        if n == 1:
            raise outbox.RetryLater("busy", detail=_chain(600))
        if n == 2:
            return _chain(DEPTH_SHOWN + 1)
        return {"status": 200}

    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker() as s, s.begin():
            for n in range(4):
                emit(s, "e", {"n": n})
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(maker)
    with engine.connect() as conn:
        statuses = conn.execute(select(m.c.status).order_by(m.c.id)).scalars().all()
        history = conn.execute(select(a.c.outcome, a.c.error_type, a.c.detail).order_by(a.c.message_id)).all()
    assert statuses == ["dead", "dead", "delivered", "delivered"]
    assert [(h.outcome, h.error_type) for h in history] == [
        ("dead", f"{__name__}.Upstream"),
        ("dead", "outbox.RetryLater"),
        ("delivered", None),
        ("delivered", None),
    ]
    for detail in [h.detail for h in history[:3]]:
        assert _depth(detail) == DEPTH_SHOWN
        deepest = detail
        while isinstance(deepest, dict) and "next" in deepest:
            assert deepest["token"] == "***"
            deepest = deepest["next"]
        assert deepest == TOO_DEEP
    assert as_reported(history[3].detail) == {"status": 200}


def test_one_claim_times_out_its_slow_deliveries_and_keeps_the_quick_and_stubborn_ones(engine: Engine):
    """The deliveries a claim starts share one timer per route timeout; each still gets its own verdict.

    One claim brings: quick messages that finish before the limit, slow ones
    that outlive it, one whose handler swallows the cancellation and returns
    (delivered, as with asyncio.timeout), and a route with a longer limit that
    its slow message meets.
    """
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))

    @ob.handler("e", name="short", timeout=0.3, max_attempts=1)
    async def short(msg):
        kind = msg.payload["kind"]
        if kind == "slow":
            await asyncio.sleep(30)
        elif kind == "stubborn":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return {"swallowed": True}

    @ob.handler("e", name="long", timeout=5, max_attempts=1)
    async def long(msg):
        if msg.payload["kind"] == "slow":
            await asyncio.sleep(0.6)  # past the short route's limit, within its own

    maker = sessionmaker(engine)
    ob.install(maker)
    kinds = ["quick", "slow", "quick", "stubborn", "slow", "quick"]
    try:
        with maker() as s, s.begin():
            for n, kind in enumerate(kinds):
                emit(s, "e", {"n": n, "kind": kind})
        started = time.monotonic()
        result = Relay(ob, engine).run_until_idle()
        took = time.monotonic() - started
    finally:
        ob.uninstall(maker)
    with engine.connect() as conn:
        rows = conn.execute(select(m.c.handler, m.c.payload, m.c.status)).all()
        outcomes = {(h.message_id, h.outcome) for h in conn.execute(select(a))}
    got = sorted((r.handler, r.payload["kind"], r.status) for r in rows)
    assert got == sorted(
        [("short", kind, "dead" if kind == "slow" else "delivered") for kind in kinds]
        + [("long", kind, "delivered") for kind in kinds]
    )
    assert len(outcomes) == 12 and result.delivered == 10 and result.dead == 2
    assert took < 10, "the slow deliveries must be cut off at the route's limit"


def test_each_delivery_under_a_shared_deadline_keeps_its_own_full_window():
    """Deliveries that start later than their claim's first still get the route's whole timeout."""
    from outbox.relay.deadline import Deadline

    async def scenario() -> dict[str, tuple[str, float]]:
        loop = asyncio.get_running_loop()
        deadline = Deadline(loop, 0.3, 3)
        results: dict[str, tuple[str, float]] = {}

        async def delivery(name: str, start_after: float, runs_for: float) -> None:
            await asyncio.sleep(start_after)
            task = asyncio.current_task()
            assert task is not None
            deadline.enter(task)
            began = loop.time()
            try:
                try:
                    await asyncio.sleep(runs_for)
                finally:
                    timed_out = deadline.leave(task)
            except asyncio.CancelledError:
                results[name] = ("timed out" if timed_out else "cancelled", loop.time() - began)
                if not timed_out:
                    raise
                return
            results[name] = ("finished", loop.time() - began)

        await asyncio.gather(
            delivery("first, hangs", 0.0, 10),
            delivery("late, within its own window", 0.2, 0.2),  # ends 0.4 s in: after the first's window
            delivery("late, hangs", 0.2, 10),
        )
        return results

    results = asyncio.run(scenario())
    verdicts = {name: verdict for name, (verdict, _) in results.items()}
    assert verdicts == {
        "first, hangs": "timed out",
        "late, within its own window": "finished",
        "late, hangs": "timed out",
    }
    # Each hung delivery was cut off no sooner than its own 0.3 s after it began (a loaded
    # machine may make it later, never earlier).
    assert all(elapsed >= 0.3 for verdict, elapsed in results.values() if verdict == "timed out")
