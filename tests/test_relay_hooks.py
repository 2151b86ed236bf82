"""Handlers' start and stop hooks cannot take the relay down by raising what ends a Python program.

``outbox_start`` and ``outbox_shutdown`` failures are logged (naming the hook
and the exception's type) and the relay starts, or stops, as usual; a failing
``outbox_bind`` stops start-up with one clear line. ``SystemExit``,
``KeyboardInterrupt`` and other ``BaseException`` subclasses take those paths
too, like any ``Exception``; only the relay's own cancellation passes through.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relayproc import APPS, RelayProcess, relay_command, relay_env, wait_until
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import ConfigurationError, Message, Outbox, Route, emit
from outbox.relay import Relay

sys.path.insert(0, str(APPS))
import hook_app  # noqa: E402  (the module the relay subprocesses serve)

m = outbox.outbox_message


class Fatal(BaseException):
    """A library's own "stop everything", not an Exception."""


RAISED: list[BaseException] = [
    SystemExit(3),
    KeyboardInterrupt(),
    Fatal("the library gives up"),
    asyncio.CancelledError("a future of the hook's own was cancelled"),
    RuntimeError("an ordinary failure"),
]
RAISED_NAMES = [
    "SystemExit",
    "KeyboardInterrupt",
    f"{__name__}.Fatal",
    "asyncio.exceptions.CancelledError",
    "RuntimeError",
]


class Hooked:
    """A handler whose start and stop hooks raise ``raised``, plain or async."""

    def __init__(self, raised: BaseException, *, is_async: bool, on: tuple[str, ...]) -> None:
        self.raised = raised
        self.is_async = is_async
        self.on = on
        self.delivered: list[int] = []

    def __call__(self, msg: Message) -> None:
        self.delivered.append(msg.id)

    def _hook(self, name: str) -> Any:
        if name not in self.on:
            return None
        raised = self.raised
        if not self.is_async:
            raise raised

        async def hook() -> None:
            await asyncio.sleep(0)
            raise raised

        return hook()

    def outbox_start(self, route: Route, *, longest_retry_gap: float) -> Any:
        return self._hook("outbox_start")

    def outbox_shutdown(self) -> Any:
        return self._hook("outbox_shutdown")


def _outbox(*on: str) -> tuple[Outbox, dict[str, Hooked]]:
    ob = Outbox()
    handlers: dict[str, Hooked] = {}
    for n, raised in enumerate(RAISED):
        for style in ("sync", "async"):
            name = f"h{n}_{style}"
            handlers[name] = Hooked(raised, is_async=style == "async", on=on)
            ob.route("e", handlers[name], name=name)
    return ob, handlers


def _emit(engine: Engine, ob: Outbox, event: str = "e") -> None:
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory.begin() as s:
            emit(s, event, {"n": 1})
    finally:
        ob.uninstall(factory)


def _failures(caplog: pytest.LogCaptureFixture, action: str) -> dict[str, str]:
    return {r.handler: r.error_type for r in caplog.records if getattr(r, "action", None) == action}


@pytest.mark.parametrize("hook", ["outbox_start", "outbox_shutdown"])
def test_a_hook_raising_system_exit_or_any_base_exception_is_logged_and_the_drain_delivers(
    engine: Engine, caplog: pytest.LogCaptureFixture, hook: str
):
    ob, handlers = _outbox(hook)
    _emit(engine, ob)
    caplog.set_level(logging.WARNING, logger="outbox.relay")

    result = Relay(ob, engine).run_until_idle()

    assert result.delivered == len(handlers)
    assert all(len(h.delivered) == 1 for h in handlers.values())
    action = "handler_start" if hook == "outbox_start" else "handler_shutdown"
    expected = {name: RAISED_NAMES[int(name[1])] for name in handlers}
    assert _failures(caplog, action) == expected
    lines = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == action]
    assert f"route h0_sync: {hook} raised SystemExit: 3" in lines[0]


def test_a_serving_relay_logs_failing_hooks_serves_and_stops_as_asked(
    engine: Engine, caplog: pytest.LogCaptureFixture
):
    ob, handlers = _outbox("outbox_start", "outbox_shutdown")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    relay = Relay(ob, engine, poll_interval=0.05, listen=False)
    serving = threading.Thread(target=relay.run)
    serving.start()
    try:
        _emit(engine, ob)
        wait_until(lambda: all(h.delivered for h in handlers.values()), "every route to deliver")
    finally:
        relay.stop()
        serving.join(30)
    assert not serving.is_alive(), "the relay stopped although every shutdown hook raised"
    assert (
        set(_failures(caplog, "handler_start")) == set(_failures(caplog, "handler_shutdown")) == set(handlers)
    )


@pytest.mark.parametrize(
    "raised", [SystemExit(1), KeyboardInterrupt(), Fatal("no"), ValueError("bad engine")]
)
def test_a_failing_outbox_bind_stops_start_up_with_one_line_naming_the_route_hook_and_type(
    engine: Engine, raised: BaseException
):
    ob = Outbox()

    class Binding:
        def __call__(self, msg: Message) -> None:
            raise AssertionError("nothing is claimed when a handler could not be bound")

        def outbox_bind(self, bound: Engine) -> None:
            raise raised

    ob.route("e", Binding(), name="mailer")
    _emit(engine, ob)
    with pytest.raises(ConfigurationError) as refused:
        Relay(ob, engine).run_until_idle()
    name = f"{__name__}.Fatal" if isinstance(raised, Fatal) else type(raised).__name__
    assert str(refused.value).startswith(f"route mailer: outbox_bind raised {name}: ")
    assert "\n" not in str(refused.value)
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.attempts)).all() == [("pending", 0)]


def test_cancelling_the_relay_while_a_start_hook_awaits_cancels_the_relay(engine: Engine):
    """The relay's own cancellation is not a hook's failure: it is raised on, and nothing is claimed."""
    ob = Outbox()
    waiting = asyncio.Event()

    class Slow:
        def __call__(self, msg: Message) -> None:
            raise AssertionError("a cancelled relay claims nothing")

        async def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
            waiting.set()
            await asyncio.sleep(60)

    ob.route("e", Slow(), name="slow")
    _emit(engine, ob)

    async def main() -> None:
        task = asyncio.create_task(Relay(ob, engine, listen=False).serve())
        await asyncio.wait_for(waiting.wait(), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)

    asyncio.run(main())
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status)).scalars().all() == ["pending"]


# -- outbox-relay ------------------------------------------------------------------------------------


@pytest.fixture
def hook_messages(engine: Engine) -> Iterator[None]:
    _emit(engine, hook_app.ob, hook_app.EVENT)
    yield


def _serve(database_url: str, tmp_path: Path, raises: str) -> RelayProcess:
    return RelayProcess(
        database_url,
        ["--app", "hook_app:ob", "--poll-interval", "0.1"],
        log_path=tmp_path / "relay.log",
        env={"HOOK_RAISES": raises},
    )


@pytest.mark.parametrize(
    ("raises", "start_type", "shutdown_type"),
    [
        ("start=system_exit,shutdown=keyboard_interrupt", "SystemExit", "KeyboardInterrupt"),
        ("start=custom,shutdown=system_exit", "hook_app.Fatal", "SystemExit"),
    ],
)
def test_outbox_relay_serves_and_exits_0_when_its_start_and_stop_hooks_raise_base_exceptions(
    engine: Engine,
    database_url: str,
    tmp_path: Path,
    hook_messages: None,
    raises: str,
    start_type: str,
    shutdown_type: str,
):
    relay = _serve(database_url, tmp_path, raises)
    try:
        wait_until(lambda: _statuses(engine) == ["delivered"], "the message delivered", relays=[relay])
        relay.signal(signal.SIGTERM)
        assert relay.wait(20) == 0, relay.tail()
    finally:
        relay.kill()
    [started] = relay.actions("handler_start")
    [stopped] = relay.actions("handler_shutdown")
    assert (started["hook"], started["error_type"], started["handler"]) == (
        "outbox_start",
        start_type,
        "hooked",
    )
    assert (stopped["hook"], stopped["error_type"]) == ("outbox_shutdown", shutdown_type)
    assert relay.actions("stopped"), relay.tail()
    assert "Traceback" not in relay.text()


def test_outbox_relay_exits_2_with_one_line_when_outbox_bind_raises_system_exit(
    engine: Engine, database_url: str, tmp_path: Path, hook_messages: None
):
    import subprocess

    done = subprocess.run(
        [*relay_command(), "--app", "hook_app:ob", "--database-url", database_url, "--once"],
        env=relay_env(database_url, HOOK_RAISES="bind=system_exit"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "outbox-relay: route hooked: outbox_bind raised SystemExit: outbox_bind gives up; "
        "the relay cannot start with a handler it could not bind\n"
    )
    assert _statuses(engine) == ["pending"]


def _statuses(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.status).order_by(m.c.id)).scalars())
