"""Run ``outbox-relay`` as a real subprocess serving ``tests/apps/counting_app.py``, and wait on evidence.

Fault tests never sleep blindly before injecting a fault: they wait for
something observable (a row's status, a handler's marker file, a log record,
a connection in ``pg_stat_activity``) with :func:`wait_until`, whose failure
message carries the tail of every relay's log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["APPS", "RelayProcess", "relay_command", "relay_env", "wait_until"]

T = TypeVar("T")

APPS = Path(__file__).parent / "apps"
APP = "counting_app:ob"


def relay_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m outbox.relay``."""
    script = Path(sys.executable).with_name("outbox-relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.relay"]


def relay_env(database_url: str | None = None, **extra: str) -> dict[str, str]:
    """A clean environment: no stray ``OUTBOX_*`` settings from the caller, the test apps importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "COUNTING_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APPS), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if database_url is not None:
        env["OUTBOX_DATABASE_URL"] = database_url
    env.update(extra)
    return env


class RelayProcess:
    """One ``outbox-relay --log-format json`` process; its stderr goes to a file the test reads."""

    def __init__(
        self, database_url: str, args: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        cmd = [
            *relay_command(),
            "--app",
            APP,
            "--database-url",
            database_url,
            "--log-format",
            "json",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=relay_env(database_url, **(env or {})),
            cwd=log_path.parent,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        found = []
        for line in self.text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                found.append(record)
        return found

    def actions(self, action: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("action") == action]

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    def tail(self, lines: int = 15) -> str:
        state = "running" if self.alive() else f"exited {self.proc.returncode}"
        body = "\n".join(self.text().splitlines()[-lines:])
        return f"--- relay pid {self.pid} ({state}), {self.log_path.name}:\n{body}"


def wait_until(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = 20.0,
    relays: Iterable[RelayProcess] = (),
    interval: float = 0.05,
) -> T:
    """Poll ``check`` until it returns something truthy; fail early if a relay that should run has exited."""
    watched = list(relays)
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        dead = [r for r in watched if not r.alive()]
        if dead or time.monotonic() > deadline:
            reason = "a relay exited" if dead else f"timed out after {timeout:g}s"
            logs = "\n".join(r.tail() for r in watched)
            raise AssertionError(f"{reason} waiting for {what}\n{logs}")
        time.sleep(interval)
