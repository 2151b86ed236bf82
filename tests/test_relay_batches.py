"""Batches on SQLite and PostgreSQL: a handler with ``outbox_deliver_batch`` gets a claim in one call.

Each message still has its own attempt, outcome and history row, decided by
its own element of the returned list (or by what the whole call did), and a
group's messages still go one at a time, in order.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from relayproc import RelayProcess, wait_until
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from stamped import as_reported

import outbox
from outbox import Backoff, Message, Outbox, PermanentError, RetryLater, emit, signals
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt
#: Retries that do not fall due again within the test: one attempt per message and drain.
SLOW = Backoff(base=3600, cap=3600)

Decide = Callable[[Message], Any]


class Batches:
    """A batch handler: each call's payload numbers in ``calls``; each message's outcome from ``decide``."""

    def __init__(self, decide: Decide = lambda msg: None) -> None:
        self.decide = decide
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()

    def __call__(self, msg: Message) -> None:
        raise AssertionError("a batch route's messages go to outbox_deliver_batch")

    def record(self, messages: list[Message]) -> list[Any]:
        self.calls.append([msg.payload["n"] for msg in messages])
        self.threads.add(threading.current_thread().name)
        return [self.decide(msg) for msg in messages]


class AsyncBatches(Batches):
    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        await asyncio.sleep(0)
        return self.record(messages)


class PlainBatches(Batches):
    def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        return self.record(messages)


class Whole(AsyncBatches):
    """Returns (or raises) whatever ``result(messages)`` gives for the whole call."""

    def __init__(self, result: Callable[[list[Message]], Any]) -> None:
        super().__init__()
        self.result = result

    async def outbox_deliver_batch(self, messages: list[Message]) -> Any:
        self.record(messages)
        return self.result(messages)


@pytest.fixture
def slow_ob() -> Outbox:
    return Outbox(default_backoff=SLOW)


def emit_n(ob: Outbox, engine: Engine, count: int, event: str = "e", **options: Any) -> None:
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory.begin() as s:
            for n in range(count):
                emit(s, event, {"n": n}, **options)
    finally:
        ob.uninstall(factory)


def rows(engine: Engine) -> dict[int, Any]:
    """Message rows by payload number."""
    with engine.connect() as conn:
        return {r.payload["n"]: r for r in conn.execute(select(m).order_by(m.c.id))}


def history(engine: Engine) -> dict[int, list[Any]]:
    """History rows by payload number, oldest first."""
    with engine.connect() as conn:
        numbers = {r.id: r.payload["n"] for r in conn.execute(select(m.c.id, m.c.payload))}
        found: dict[int, list[Any]] = {}
        for h in conn.execute(select(a).order_by(a.c.id)):
            found.setdefault(numbers[h.message_id], []).append(h)
    return found


@pytest.mark.parametrize("kind", [AsyncBatches, PlainBatches])
def test_a_claim_goes_to_the_handler_in_one_call_and_each_message_keeps_its_own_history(engine, ob, kind):
    handler = kind(lambda msg: {"n": msg.payload["n"]} if msg.payload["n"] % 2 == 0 else None)
    ob.route("e", handler, name="batched")
    emit_n(ob, engine, 12)

    result = Relay(ob, engine, relay_id="r1").run_until_idle()

    assert handler.calls == [list(range(12))], "one claim, one call, in claim order"
    if kind is PlainBatches:  # a plain batch method runs on a handler thread, as a plain handler does
        assert all(name.startswith("outbox-handler") for name in handler.threads)
    assert (result.delivered, result.attempts) == (12, 12)
    assert {r.status for r in rows(engine).values()} == {"delivered"}
    attempts = history(engine)
    assert {n: [(h.attempt, h.outcome, h.relay_id) for h in hs] for n, hs in attempts.items()} == {
        n: [(1, "delivered", "r1")] for n in range(12)
    }
    assert {n: as_reported(hs[0].detail) for n, hs in attempts.items()} == {
        n: {"n": n} if n % 2 == 0 else None for n in range(12)
    }


def test_each_message_gets_the_outcome_of_its_own_element(engine, slow_ob):
    secret = "tok_live_batch"

    class Handler(AsyncBatches):
        def outbox_secrets(self) -> list[str]:
            return [secret]

    outcomes: dict[int, Any] = {
        0: None,
        1: {"status": 202, "token": secret},
        2: RetryLater("busy", delay=3600, detail={"status": 429}),
        3: RetryLater("broker away", delay=3600, counts_as_attempt=False),
        4: PermanentError(f"refused with {secret}", detail={"status": 400}),
        5: ConnectionError("reset by peer"),
        6: "yes",  # neither None, a Mapping nor an exception
        7: RetryLater,  # the class, not an instance
    }
    handler = Handler(lambda msg: outcomes[msg.payload["n"]])
    slow_ob.route("e", handler, name="mixed", max_attempts=3)
    emit_n(slow_ob, engine, len(outcomes))

    result = Relay(slow_ob, engine).run_until_idle()

    assert handler.calls == [list(range(len(outcomes)))]
    assert (result.delivered, result.retried, result.dead) == (2, 5, 1)
    got = {
        n: [(h.outcome, h.error_type, h.error, as_reported(h.detail)) for h in hs]
        for n, hs in history(engine).items()
    }
    not_an_outcome = "outbox_deliver_batch gave {} as this message's outcome: expected None or a Mapping"
    assert got[0] == [("delivered", None, None, None)]
    assert got[1] == [("delivered", None, None, {"status": 202, "token": "***"})]
    assert got[2] == [("retry", "outbox.RetryLater", "busy", {"status": 429})]
    assert got[3] == [("retry", "outbox.RetryLater", "broker away", {"counted": False})]
    assert got[4] == [("dead", "outbox.PermanentError", "refused with ***", {"status": 400})]
    assert got[5] == [("failed", "ConnectionError", "reset by peer", None)]
    assert got[6][0][:2] == got[7][0][:2] == ("failed", "TypeError")
    assert got[6][0][2].startswith(not_an_outcome.format("str"))
    assert got[7][0][2].startswith(not_an_outcome.format("type"))
    state = {n: (r.status, r.attempts) for n, r in rows(engine).items()}
    assert state == {
        0: ("delivered", 1),
        1: ("delivered", 1),
        2: ("pending", 1),
        3: ("pending", 0),  # not counted
        4: ("dead", 1),
        5: ("pending", 1),
        6: ("pending", 1),
        7: ("pending", 1),
    }


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (lambda msgs: [None] * (len(msgs) - 1), "returned 2 outcome(s) for 3 message(s)"),
        (lambda msgs: [None] * (len(msgs) + 1), "returned 4 outcome(s) for 3 message(s)"),
        (lambda msgs: None, "returned NoneType, not a list of one outcome per message"),
        (lambda msgs: tuple(None for _ in msgs), "returned tuple, not a list of one outcome per message"),
    ],
    ids=["short", "long", "none", "tuple"],
)
def test_a_result_that_is_not_one_outcome_per_message_fails_every_message_counted(
    engine, slow_ob, result, problem
):
    slow_ob.route("e", Whole(result), name="buggy", max_attempts=2)
    slow_ob.route("last", Whole(result), name="buggy_last", max_attempts=1)
    emit_n(slow_ob, engine, 3)
    emit_n(slow_ob, engine, 3, event="last")

    Relay(slow_ob, engine).run_until_idle()

    with engine.connect() as conn:
        found = list(conn.execute(select(m.c.handler, m.c.status, m.c.attempts, m.c.last_error)))
        tried = [
            (o, t, as_reported(d))
            for o, t, d in conn.execute(select(a.c.outcome, a.c.error_type, a.c.detail))
        ]
    assert sorted((h, s, n) for h, s, n, _ in found) == [
        *[("buggy", "pending", 1)] * 3,
        *[("buggy_last", "dead", 1)] * 3,
    ]
    assert all(problem in error and "no message of the batch is known" in error for *_, error in found)
    assert Counter((o, t) for o, t, _ in tried) == Counter(
        {("failed", "TypeError"): 3, ("dead", "TypeError"): 3}
    )
    assert [d for o, _, d in tried if o == "dead"] == [{"exhausted": True, "last_outcome": "failed"}] * 3


def _raise(exc: BaseException) -> Callable[[list[Message]], Any]:
    def result(messages: list[Message]) -> Any:
        raise exc

    return result


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionError("broker gone"), ("failed", "pending", 1, "ConnectionError")),
        (PermanentError("bad credentials"), ("dead", "dead", 1, "outbox.PermanentError")),
        (RetryLater("outage", counts_as_attempt=False), ("retry", "pending", 0, "outbox.RetryLater")),
        (SystemExit(3), ("failed", "pending", 1, "SystemExit")),
    ],
    ids=["failed", "permanent", "uncounted", "systemexit"],
)
def test_a_raising_batch_call_is_every_messages_outcome(engine, slow_ob, exc, expected):
    slow_ob.route("e", Whole(_raise(exc)), name="raising", max_attempts=3)
    emit_n(slow_ob, engine, 4)

    Relay(slow_ob, engine).run_until_idle()

    outcome, status, attempts, error_type = expected
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {(status, attempts)}
    got = history(engine)
    assert len(got) == 4 and {len(hs) for hs in got.values()} == {1}
    assert {(hs[0].outcome, hs[0].error_type) for hs in got.values()} == {(outcome, error_type)}


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_the_routes_timeout_bounds_the_batch_call(engine, slow_ob, plain):
    release = threading.Event()

    class Hangs(AsyncBatches):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            self.record(messages)
            await asyncio.sleep(60)
            return [None] * len(messages)

    class HangsPlain(PlainBatches):
        def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            self.record(messages)
            release.wait(10)
            return [None] * len(messages)

    handler = HangsPlain() if plain else Hangs()
    slow_ob.route("e", handler, name="slow", timeout=0.3)
    emit_n(slow_ob, engine, 3)
    began = time.monotonic()
    try:
        Relay(slow_ob, engine).run_until_idle()
    finally:
        release.set()
    assert time.monotonic() - began < 9, "the batch was waited for, not cut off"

    assert handler.calls == [[0, 1, 2]]
    got = history(engine)
    assert {(hs[0].outcome, hs[0].error_type, hs[0].error) for hs in got.values()} == {
        ("timeout", "TimeoutError", "handler did not finish within 0.3s")
    }
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {("pending", 1)}


def test_a_group_is_delivered_one_at_a_time_in_order_under_batches(engine, ob):
    delivered: list[tuple[str, int]] = []
    failed_once: set[int] = set()

    def decide(msg: Message) -> Any:
        group, seq = msg.payload["group"], msg.payload["seq"]
        if seq == 0 and group in ("g1", "g3") and msg.id not in failed_once:
            failed_once.add(msg.id)  # a retrying head must hold its group back
            return RetryLater("not yet", delay=0)
        delivered.append((group, seq))
        return None

    class Groups(AsyncBatches):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            groups = [msg.group_key for msg in messages]
            assert len(groups) == len(set(groups)), f"two messages of one group in one batch: {groups}"
            self.calls.append([msg.id for msg in messages])
            return [decide(msg) for msg in messages]

    handler = Groups()
    ob.route("e", handler, name="ordered")
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory.begin() as s:
            for seq in range(5):
                for group in ("g0", "g1", "g2", "g3"):
                    emit(s, "e", {"n": 0, "group": group, "seq": seq}, group_key=group)
    finally:
        ob.uninstall(factory)

    for _ in range(100):
        Relay(ob, engine).run_until_idle()
        if len(delivered) == 20:
            break
    assert len(delivered) == 20
    assert len(handler.calls) >= 5 and max(len(c) for c in handler.calls) == 4, "the groups went in batches"
    for group in ("g0", "g1", "g2", "g3"):
        assert [seq for g, seq in delivered if g == group] == list(range(5))


def test_rows_past_their_expiry_or_undecodable_never_reach_the_batch_handler(engine, slow_ob):
    handler = AsyncBatches()
    slow_ob.route("e", handler, name="batched")
    emit_n(slow_ob, engine, 4)
    ids = {n: r.id for n, r in rows(engine).items()}
    with engine.begin() as conn:
        conn.execute(
            update(m).where(m.c.id == ids[1]).values(expires_at=datetime.now(UTC) - timedelta(hours=1))
        )
        document = "[" * 2000 + "]" * 2000  # deeper than Python's JSON decoder goes
        value = "CAST(:doc AS jsonb)" if engine.dialect.name == "postgresql" else ":doc"
        conn.execute(
            text(f"UPDATE outbox_message SET payload = {value} WHERE id = :id"),
            {"doc": document, "id": ids[2]},
        )

    result = Relay(slow_ob, engine).run_until_idle()

    assert handler.calls == [[0, 3]]
    assert (result.delivered, result.expired, result.dead) == (2, 1, 1)
    with engine.connect() as conn:
        got = {h.message_id: (h.outcome, h.error_type) for h in conn.execute(select(a))}
    assert got == {
        ids[0]: ("delivered", None),
        ids[1]: ("expired", "Expired"),
        ids[2]: ("dead", "UndecodableMessage"),
        ids[3]: ("delivered", None),
    }


def test_a_forced_stop_cuts_off_every_message_of_the_running_batch(engine, slow_ob):
    started = threading.Event()

    class Hangs(AsyncBatches):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            self.record(messages)
            started.set()
            await asyncio.sleep(60)
            return [None] * len(messages)

    slow_ob.route("e", Hangs(), name="hangs", max_attempts=2)
    emit_n(slow_ob, engine, 3)
    relay = Relay(slow_ob, engine, grace_period=60, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        assert started.wait(20), "the batch never started"
    finally:
        relay.stop(graceful=False)
        thread.join(20)
    assert not thread.is_alive()

    got = history(engine)
    assert {n: [(h.outcome, h.error_type) for h in hs] for n, hs in got.items()} == {
        n: [("failed", "Cancelled")] for n in range(3)
    }
    assert {(r.status, r.attempts, r.locked_by) for r in rows(engine).values()} == {("pending", 1, None)}


def test_a_graceful_stop_lets_the_running_batch_finish(engine, slow_ob):
    started, finish = threading.Event(), threading.Event()

    class Waits(PlainBatches):
        def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            self.record(messages)
            started.set()
            finish.wait(20)
            return [None] * len(messages)

    slow_ob.route("e", Waits(), name="waits")
    emit_n(slow_ob, engine, 3)
    relay = Relay(slow_ob, engine, grace_period=60, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        assert started.wait(20), "the batch never started"
        relay.stop()
        finish.set()
    finally:
        thread.join(20)
    assert not thread.is_alive()
    assert {(r.status, r.attempts) for r in rows(engine).values()} == {("delivered", 1)}


def test_signals_go_per_message_and_a_route_without_the_hook_is_unchanged(engine, slow_ob):
    batched = AsyncBatches(lambda msg: ConnectionError("down") if msg.payload["n"] == 1 else None)
    single: list[int] = []
    slow_ob.route("e", batched, name="batched")
    slow_ob.route("e", lambda msg: single.append(msg.payload["n"]), name="single")
    emit_n(slow_ob, engine, 3)
    got: list[tuple[str, Any]] = []

    def claimed(sender: Any, **kw: Any) -> None:
        got.append(("claimed", sorted((msg.handler, msg.payload["n"]) for msg in kw["messages"])))

    def delivered(sender: Any, **kw: Any) -> None:
        got.append(("delivered", (kw["message"].handler, kw["message"].payload["n"])))

    def retry(sender: Any, **kw: Any) -> None:
        got.append(("retry", (kw["message"].handler, kw["message"].payload["n"])))

    signals.message_claimed.connect(claimed, sender=slow_ob)
    signals.message_delivered.connect(delivered, sender=slow_ob)
    signals.retry_scheduled.connect(retry, sender=slow_ob)
    try:
        Relay(slow_ob, engine).run_until_idle()
    finally:
        signals.message_claimed.disconnect(claimed, sender=slow_ob)
        signals.message_delivered.disconnect(delivered, sender=slow_ob)
        signals.retry_scheduled.disconnect(retry, sender=slow_ob)

    assert batched.calls == [[0, 1, 2]] and sorted(single) == [0, 1, 2]
    assert got[0] == ("claimed", sorted((h, n) for h in ("batched", "single") for n in range(3)))
    assert Counter(kind for kind, _ in got) == Counter(claimed=1, delivered=5, retry=1)
    assert ("retry", ("batched", 1)) in got


def test_each_message_of_a_batch_gets_its_own_span_and_none_is_current(engine):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from opentelemetry import trace

    seen: list[bool] = []

    class Looks(AsyncBatches):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            seen.append(trace.get_current_span().get_span_context().is_valid)
            return [None if msg.payload["n"] else RetryLater("later", delay=3600) for msg in messages]

    ob = Outbox(default_backoff=SLOW, tracer_provider=provider)
    ob.route("e", Looks(), name="traced")
    emit_n(ob, engine, 3)
    try:
        Relay(ob, engine).run_until_idle()
    finally:
        provider.shutdown()

    spans = [s for s in exporter.get_finished_spans() if s.name == "process traced"]
    assert seen == [False]
    assert len(spans) == 3
    assert {s.attributes["messaging.batch.message_count"] for s in spans} == {3}
    assert sorted(s.attributes["outbox.outcome"] for s in spans) == ["delivered", "delivered", "retry"]


def test_a_subclass_that_wraps_call_alone_keeps_one_call_per_message(engine, slow_ob, caplog):
    class Wrapped(AsyncBatches):
        """Overrides __call__ to wrap each delivery: its author expects it to run for every message."""

        def __init__(self) -> None:
            super().__init__()
            self.wrapped: list[int] = []

        async def __call__(self, msg: Message) -> None:
            self.wrapped.append(msg.payload["n"])

    class WrappedBoth(Wrapped):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            return self.record(messages)

    class TurnedOff(WrappedBoth):
        outbox_deliver_batch = None  # type: ignore[assignment]

    wrapped, both, off = Wrapped(), WrappedBoth(), TurnedOff()
    slow_ob.route("e", wrapped, name="wrapped")
    slow_ob.route("e", both, name="both")
    slow_ob.route("e", off, name="off")
    emit_n(slow_ob, engine, 3)

    with caplog.at_level("INFO", logger="outbox.relay"):
        result = Relay(slow_ob, engine).run_until_idle()

    assert result.delivered == 9
    assert (sorted(wrapped.wrapped), wrapped.calls) == ([0, 1, 2], [])
    assert (both.wrapped, both.calls) == ([], [[0, 1, 2]])
    assert (sorted(off.wrapped), off.calls) == ([0, 1, 2], [])
    (skipped,) = [r for r in caplog.records if getattr(r, "action", None) == "batch_skipped"]
    assert skipped.getMessage() == (
        "route wrapped: test_a_subclass_that_wraps_call_alone_keeps_one_call_per_message.<locals>.Wrapped "
        "overrides __call__ but inherits outbox_deliver_batch; delivering one message per call, as its "
        "__call__ expects (override outbox_deliver_batch too for batches)"
    )


def test_a_relay_killed_mid_batch_leaves_its_messages_to_lease_recovery(database_url, tmp_path):
    """Every message of the killed relay's batch comes back after its lease, once, as on the single path."""
    engine = create_engine(database_url)
    started, done = tmp_path / "started", tmp_path / "done"
    started.mkdir()
    done.mkdir()
    try:
        batch_app = Outbox()
        batch_app.route("batch.me", lambda msg: None, name="batched")  # the app's route, for emit
        emit_n(batch_app, engine, 8, event="batch.me")

        def spawn(name: str, **env: str) -> RelayProcess:
            args = ["--app", "batch_app:ob", "--relay-id", name, "--lease", "1", "--poll-interval", "0.2"]
            env = {"COUNTING_DONE_DIR": str(done), **env}
            return RelayProcess(database_url, args, log_path=tmp_path / f"{name}.log", env=env)

        victim = spawn("victim", COUNTING_STARTED_DIR=str(started), COUNTING_SLEEP="60")
        try:
            wait_until(lambda: len(list(started.iterdir())) == 8, "the batch to start", relays=[victim])
            victim.signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
        finally:
            victim.kill()
        held = {int(p.name) for p in started.iterdir()}
        assert {r.id for r in rows(engine).values() if r.locked_by == "victim"} == held

        rescuer = spawn("rescuer")
        try:
            wait_until(
                lambda: {r.status for r in rows(engine).values()} == {"delivered"},
                "every message delivered",
                relays=[rescuer],
            )
        finally:
            rescuer.kill()
        assert sorted(int(p.name.split("-")[0]) for p in done.iterdir()) == sorted(held)
        assert {p.name.split("-")[1] for p in done.iterdir()} == {str(rescuer.pid)}
        got = history(engine)
        assert {n: [(h.attempt, h.outcome, h.relay_id) for h in hs] for n, hs in got.items()} == {
            n: [(1, "lease_expired", "victim"), (2, "delivered", "rescuer")] for n in range(8)
        }
    finally:
        engine.dispose()


def test_the_batch_handler_example_of_the_relay_guide_runs_as_written(tmp_path):
    """docs/relay.md, Batches: the script prints what its closing comments say."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "relay.md").read_text()
    section = guide[guide.index("\n## Batches\n") :]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None
    script = tmp_path / "batches.py"
    script.write_text(block.group(1))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    promised = [line[2:] for line in block.group(1).splitlines() if line.startswith("# ")]
    assert run.stdout.splitlines() == promised


def test_a_handler_that_empties_the_list_it_was_given_still_has_each_outcome_recorded(engine, slow_ob):
    class Consumes(AsyncBatches):
        async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
            outcomes = self.record(messages)
            messages.clear()  # the handler's own list to do with as it likes
            return outcomes

    slow_ob.route("e", Consumes(lambda msg: None if msg.payload["n"] else RetryLater("later")), name="r")
    emit_n(slow_ob, engine, 3)

    Relay(slow_ob, engine).run_until_idle()

    assert {n: r.status for n, r in rows(engine).items()} == {0: "pending", 1: "delivered", 2: "delivered"}
