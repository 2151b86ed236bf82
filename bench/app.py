"""The Outbox that ``outbox-relay --app bench.app:ob`` serves during a benchmark.

Three routes, one per kind of run, each with an async handler that does no real
work but leaves evidence the benchmark checks afterwards:

- ``noop`` (event ``bench.noop``): counts its calls per message;
- ``flaky`` (event ``bench.flaky``): like ``noop``, but a message whose payload
  has ``"fail": true`` raises a transient error on its first attempt;
- ``latency`` (event ``bench.latency``): takes ``time.time()`` as its very first
  step and appends ``"<n> <time>"`` to ``$BENCH_LATENCY_FILE``.

Payloads carry ``n``, the message's sequence number in its run. When
``$BENCH_TRACE_DIR`` is set, each handler keeps one byte per ``n`` (how often it
ran for that message) and writes it to ``<dir>/<route>-<pid>.bin`` when the relay
shuts down, through the ``outbox_shutdown`` hook; without it a handler only
counts its calls (the memory run, where per-message state would be measured as
the relay's). The call count always goes to ``<dir or $BENCH_COUNT_DIR>``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from outbox import Backoff, Message, Outbox

__all__ = ["EVENTS", "FlakyFailure", "ob"]

#: event type per route name
EVENTS = {"noop": "bench.noop", "flaky": "bench.flaky", "latency": "bench.latency"}

#: Retries come back fast: the failure mix measures the relay, not the backoff.
ob = Outbox(default_backoff=Backoff(base=0.01, cap=0.05))


class FlakyFailure(Exception):
    """The transient error a ``flaky`` message raises on its first attempt."""


class _Tracked:
    """An async handler that records how often it ran, per message when asked to."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.calls = 0
        self._trace: bytearray | None = None
        self._dir: str | None = None

    def _configure(self) -> None:
        # Read at first call, in the relay process, not at import in the benchmark process.
        trace_dir = os.environ.get("BENCH_TRACE_DIR")
        self._dir = trace_dir or os.environ.get("BENCH_COUNT_DIR")
        self._trace = bytearray() if trace_dir else None

    def record(self, n: int) -> None:
        if self.calls == 0:
            self._configure()
        self.calls += 1
        trace = self._trace
        if trace is not None:
            if n >= len(trace):
                trace.extend(bytes(n + 1 - len(trace) + 4096))
            trace[n] += 1

    async def __call__(self, message: Message) -> None:
        self.record(message.payload["n"])

    def outbox_shutdown(self) -> None:
        if self._dir is None:
            return
        base = Path(self._dir) / f"{self.route}-{os.getpid()}"
        if self._trace is not None:
            base.with_suffix(".bin").write_bytes(bytes(self._trace))
        base.with_suffix(".json").write_text(json.dumps({"calls": self.calls}))


class _Flaky(_Tracked):
    async def __call__(self, message: Message) -> None:
        payload = message.payload
        self.record(payload["n"])
        if message.attempt == 1 and payload.get("fail"):
            raise FlakyFailure(f"transient failure of message {payload['n']} (first attempt)")


class _Latency(_Tracked):
    def __init__(self, route: str) -> None:
        super().__init__(route)
        self._fd: int | None = None

    async def __call__(self, message: Message) -> None:
        started = time.time()
        n = message.payload["n"]
        self.record(n)
        if self._fd is None:
            self._fd = os.open(os.environ["BENCH_LATENCY_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(self._fd, f"{n} {started!r}\n".encode())

    def outbox_shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        super().outbox_shutdown()


ob.route(EVENTS["noop"], _Tracked("noop"), name="noop")
ob.route(EVENTS["flaky"], _Flaky("flaky"), name="flaky")
ob.route(EVENTS["latency"], _Latency("latency"), name="latency")
