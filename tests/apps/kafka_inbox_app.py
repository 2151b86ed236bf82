"""An inbox for the Kafka source's subprocess tests: ``outbox-consumer --app kafka_inbox_app:inbox``.

Its one handler takes every event type and inserts a row into ``effects``
(the test creates it from ``metadata``): no unique constraint, so a second
effect of one message would show. Configured from the environment:

- ``KAFKA_APP_SERVERS``, ``KAFKA_APP_TOPIC``, ``KAFKA_APP_GROUP``: where to read;
- ``KAFKA_APP_KILL_EFFECT``: the probability that the handler SIGKILLs its own
  process after writing its effect, before the commit, and
  ``KAFKA_APP_KILL_EFFECT_AT``: the handler call (1, 2...) that does so for sure;
- ``KAFKA_APP_KILL_ACK``: the probability that the acknowledgement SIGKILLs its
  own process, after the commit and before the acknowledgement runs, and
  ``KAFKA_APP_KILL_ACK_AT``: the acknowledgement that does so for sure;
- ``KAFKA_APP_SLOW``: seconds the handler sleeps before writing, and
  ``KAFKA_APP_STARTED``: a directory where it touches a file per started message.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage
from outbox._inbox.source import Ack, BeforeCommit, SourceContext
from outbox.integrations.kafka import KafkaConsumer

metadata = MetaData()
effects = Table(
    "effects",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("message_id", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
)

KILL_EFFECT = float(os.environ.get("KAFKA_APP_KILL_EFFECT") or 0)
KILL_EFFECT_AT = int(os.environ.get("KAFKA_APP_KILL_EFFECT_AT") or 0)
KILL_ACK = float(os.environ.get("KAFKA_APP_KILL_ACK") or 0)
KILL_ACK_AT = int(os.environ.get("KAFKA_APP_KILL_ACK_AT") or 0)
_effects = itertools.count(1)  # next() is atomic: handlers run in several threads
_acks = itertools.count(1)
SLOW = float(os.environ.get("KAFKA_APP_SLOW") or 0)
STARTED = os.environ.get("KAFKA_APP_STARTED")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dies(calls: itertools.count[int], probability: float, at: int) -> bool:
    return next(calls) == at or (probability > 0 and random.random() < probability)


inbox = Inbox("kafka-app")


@inbox.handler("#", name="apply")
def apply(session: Session, message: InboxMessage) -> None:
    if STARTED:
        (Path(STARTED) / message.id).touch()
    if SLOW:
        time.sleep(SLOW)
    session.execute(insert(effects).values(message_id=message.id, pid=os.getpid()))
    if _dies(_effects, KILL_EFFECT, KILL_EFFECT_AT):
        session.flush()
        _die()


class _KillingContext:
    """The runtime's context, with an acknowledgement that may kill the process before it runs."""

    def __init__(self, context: SourceContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    @staticmethod
    def _ack(ack: Ack | None) -> Ack | None:
        if ack is None or not (KILL_ACK or KILL_ACK_AT):
            return ack

        def maybe_die() -> object:
            if _dies(_acks, KILL_ACK, KILL_ACK_AT):
                _die()
            return ack()

        return maybe_die

    async def take(
        self, message: Any, *, ack: Ack | None = None, before_commit: BeforeCommit | None = None
    ) -> Any:
        return await self._context.take(message, ack=self._ack(ack), before_commit=before_commit)

    async def refuse(
        self,
        message: Any,
        error: BaseException,
        *,
        ack: Ack | None = None,
        before_commit: BeforeCommit | None = None,
    ) -> bool:
        return await self._context.refuse(message, error, ack=self._ack(ack), before_commit=before_commit)


class Killing:
    """A source whose acknowledgements may kill the process between commit and acknowledgement."""

    def __init__(self, source: KafkaConsumer) -> None:
        self._source = source

    @property
    def name(self) -> str:
        return self._source.name

    async def consume(self, context: SourceContext) -> None:
        await self._source.consume(_KillingContext(context))  # type: ignore[arg-type]


if os.environ.get("KAFKA_APP_SERVERS"):
    inbox.consume(
        Killing(
            KafkaConsumer(
                os.environ["KAFKA_APP_SERVERS"],
                os.environ.get("KAFKA_APP_TOPIC", "orders"),
                os.environ.get("KAFKA_APP_GROUP", "kafka-app"),
                config={
                    "session.timeout.ms": 1200,
                    "heartbeat.interval.ms": 250,
                    "log_level": 3,
                },
            )
        )
    )
