"""An application for the chaos test: every delivery leaves a line in an append-only file.

The delivery log lives outside the database on purpose: the chaos test restarts
the server and kills relays, and the evidence of what the handler did must
survive both and stay independent of the outbox's own bookkeeping. Each
successful delivery appends one line, ``message_id attempt relay_id pid``, with
a single ``O_APPEND`` write followed by ``fsync``, *before* the handler
returns: a relay killed after the write and before its outcome is recorded
leaves a genuine duplicate delivery, which the history must explain.

Knobs, read from the relay process's environment:

- ``CHAOS_DELIVERY_LOG``: the file (required);
- ``CHAOS_RELAY_ID``: written in each line (the ``--relay-id`` the test gave);
- ``CHAOS_SLEEP_MS``: each delivery takes up to this many milliseconds (uniformly
  at random) before it records anything, so faults find work in flight.

A payload with ``"fail_once": true`` fails (a transient error) on its first
attempt, so retries are part of the mix.
"""

from __future__ import annotations

import os
import random
import time

from outbox import Backoff, Message, Outbox

EVENT = "chaos.deliver"
HANDLER = "chaos"
#: High enough that nothing legitimately dies: a message fails at most once on purpose, and a
#: chaos run crashes a given message's attempts only a handful of times.
MAX_ATTEMPTS = 50

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.5))


class FirstAttemptFails(Exception):
    pass


def _record(msg: Message) -> None:
    line = f"{msg.id} {msg.attempt} {os.environ.get('CHAOS_RELAY_ID', '-')} {os.getpid()}\n".encode()
    fd = os.open(os.environ["CHAOS_DELIVERY_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)  # one write of a short line: never interleaved with another's
        if written != len(line):
            raise OSError(f"short write to the delivery log: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


@ob.handler(EVENT, name=HANDLER, max_attempts=MAX_ATTEMPTS)
def deliver(msg: Message) -> None:
    pause = float(os.environ.get("CHAOS_SLEEP_MS") or 0) / 1000
    if pause:
        time.sleep(random.uniform(0, pause))
    if msg.payload.get("fail_once") and msg.attempt == 1:
        raise FirstAttemptFails(f"message {msg.id} fails its first attempt on purpose")
    _record(msg)
