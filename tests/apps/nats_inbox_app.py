"""An inbox fed by a NatsConsumer, for ``outbox-consumer`` run as a subprocess (tests/test_inbox_nats.py).

Configured from the environment: ``NATS_INBOX_SERVERS``, ``NATS_INBOX_STREAM``,
``NATS_INBOX_DURABLE``, ``NATS_INBOX_ACK_WAIT``. Every message, whatever its
type, inserts one row into the test's ``effects`` table (no unique
constraint: a second effect would show as a second row).

Faults, each off unless set:

- ``NATS_INBOX_KILL_BEFORE_ACK`` (a probability): the ack the runtime calls
  after a message's commit first appends the message's id to
  ``NATS_INBOX_KILL_LOG``, then SIGKILLs this process, so the commit is made
  and the acknowledgement never sent;
- ``NATS_INBOX_FAIL_FIRST`` (a probability): the handler raises on a
  message's first delivery, so JetStream delivers it again after a nak;
- ``NATS_INBOX_SLOW_DIR``: a message of type ``slow`` touches a file named
  after its id there, then takes ``NATS_INBOX_SLOW_SECONDS`` (default 3) to
  finish, so a test can stop the process while it is in hand.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage
from outbox.integrations.nats import NatsConsumer

KILL_BEFORE_ACK = float(os.environ.get("NATS_INBOX_KILL_BEFORE_ACK") or 0)
KILL_LOG = os.environ.get("NATS_INBOX_KILL_LOG")
FAIL_FIRST = float(os.environ.get("NATS_INBOX_FAIL_FIRST") or 0)
SLOW_DIR = os.environ.get("NATS_INBOX_SLOW_DIR")
SLOW_SECONDS = float(os.environ.get("NATS_INBOX_SLOW_SECONDS") or 3)

inbox = Inbox("nats-app")


@inbox.handler("#", name="apply")
def apply(session: Session, message: InboxMessage) -> None:
    if FAIL_FIRST and message.attempt == 1 and random.random() < FAIL_FIRST:
        raise RuntimeError("failing a first delivery on purpose")
    if SLOW_DIR and message.event_type == "slow":
        (Path(SLOW_DIR) / message.id).touch()
        time.sleep(SLOW_SECONDS)
    session.execute(
        text("INSERT INTO effects (message_id, attempt, pid) VALUES (:m, :a, :p)"),
        {"m": message.id, "a": message.attempt, "p": os.getpid()},
    )


def _kill_instead(message_id: str) -> Any:
    def ack() -> None:
        if KILL_LOG:
            with open(KILL_LOG, "a") as log:
                log.write(message_id + "\n")
                log.flush()
                os.fsync(log.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    return ack


class KillingContext:
    """The runtime's context, except that some acks kill the process after the commit instead."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def take(self, message: InboxMessage, *, ack: Any = None, before_commit: Any = None) -> Any:
        if ack is not None and random.random() < KILL_BEFORE_ACK:
            ack = _kill_instead(message.id)
        return await self._inner.take(message, ack=ack, before_commit=before_commit)


class KillingSource:
    def __init__(self, inner: NatsConsumer) -> None:
        self._inner = inner

    @property
    def name(self) -> str:
        return self._inner.name

    async def consume(self, context: Any) -> None:
        await self._inner.consume(KillingContext(context) if KILL_BEFORE_ACK else context)


inbox.consume(
    KillingSource(
        NatsConsumer(
            os.environ.get("NATS_INBOX_SERVERS", "nats://127.0.0.1:4222"),
            os.environ.get("NATS_INBOX_STREAM", "ORDERS"),
            os.environ.get("NATS_INBOX_DURABLE", "nats-app"),
            ack_wait=float(os.environ.get("NATS_INBOX_ACK_WAIT") or 30),
        )
    )
)
