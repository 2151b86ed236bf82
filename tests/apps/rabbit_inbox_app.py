"""An inbox application for ``outbox-consumer`` subprocess tests: one RabbitMQ queue, one effect per message.

The handler inserts a row into ``effects`` (message id, process id), a table
with no unique constraint: a second effect of one message would show as a
second row. Tests create the table themselves.

Knobs, read from the consumer process's environment:

- ``RABBIT_URL``, ``RABBIT_QUEUE``: the broker and the queue (it must exist);
- ``RABBIT_INBOX_KILL_AT``: the process SIGKILLs itself at its N-th
  acknowledgement, after that message's commit and before the ack goes out,
  touching ``kill-<message id>`` in ``RABBIT_INBOX_DIR`` first: the window a
  crash can fall into between effect and ack;
- ``RABBIT_INBOX_DIR``: with ``RABBIT_INBOX_GATE`` set, each handler touches
  ``started-<message id>`` there, then waits (at most a minute) until the
  file named by ``RABBIT_INBOX_GATE`` exists: a test decides when in-flight
  work ends.
"""

from __future__ import annotations

import inspect
import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage, Processed
from outbox._inbox.source import Ack, BeforeCommit, SourceContext
from outbox.integrations.rabbitmq import RabbitMQConsumer

inbox = Inbox("rabbit-inbox-test")

KILL_AT = int(os.environ.get("RABBIT_INBOX_KILL_AT") or 0)
DIR = os.environ.get("RABBIT_INBOX_DIR")
GATE = os.environ.get("RABBIT_INBOX_GATE")


@inbox.handler("#", name="effect")
def effect(session: Session, message: InboxMessage) -> None:
    if GATE and DIR:
        Path(DIR, f"started-{message.id}").touch()
        end = time.monotonic() + 60
        while not os.path.exists(GATE) and time.monotonic() < end:
            time.sleep(0.02)
    session.execute(
        text("INSERT INTO effects (message_id, pid) VALUES (:m, :p)"), {"m": message.id, "p": os.getpid()}
    )


acks = itertools.count(1)


def _dying(ack: Ack, message_id: str) -> Ack:
    async def ack_or_die() -> None:
        if next(acks) == KILL_AT:
            if DIR:
                Path(DIR, f"kill-{message_id}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        answer = ack()
        if inspect.isawaitable(answer):
            await answer

    return ack_or_die


class DyingContext:
    """The runtime's context, with acknowledgements that count, and kill the process at KILL_AT."""

    def __init__(self, context: SourceContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def take(
        self, message: InboxMessage, *, ack: Ack | None = None, before_commit: BeforeCommit | None = None
    ) -> Processed | None:
        wrapped = None if ack is None else _dying(ack, message.id)
        return await self._context.take(message, ack=wrapped, before_commit=before_commit)


class Dying:
    """A source whose context kills the process between a commit and its acknowledgement."""

    def __init__(self, source: RabbitMQConsumer) -> None:
        self._source = source

    @property
    def name(self) -> str:
        return self._source.name

    async def consume(self, context: SourceContext) -> None:
        await self._source.consume(DyingContext(context))


_source = RabbitMQConsumer(os.environ["RABBIT_URL"], os.environ["RABBIT_QUEUE"])
inbox.consume(Dying(_source) if KILL_AT else _source)
