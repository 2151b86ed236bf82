"""An application for the NATS crash test: a JetStream publisher that can hang after its publish is acked.

Configured from the environment of the relay process: ``NATS_APP_SERVERS``,
``NATS_APP_SUBJECT`` and ``NATS_APP_STREAM``. With ``NATS_APP_HANG_DIR`` set,
each batch (``outbox_deliver_batch``), once JetStream has acked its messages,
touches a file named after each acked message's id there and then waits (at
most a minute), so the test can SIGKILL the relay between the publishes and
the recording of their outcomes.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from outbox import Backoff, Message, Outbox
from outbox.integrations.nats import NatsPublisher

EVENT = "nats.crash"
ROUTE = "crash_nats"

ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))


class HangingPublisher(NatsPublisher):
    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        outcomes = await super().outbox_deliver_batch(messages)
        hang = os.environ.get("NATS_APP_HANG_DIR")
        acked = [m for m, got in zip(messages, outcomes, strict=True) if not isinstance(got, Exception)]
        if hang and acked:
            for message in acked:
                (Path(hang) / str(message.id)).touch()
            await asyncio.sleep(60)
        return outcomes


ob.route(
    EVENT,
    HangingPublisher(
        os.environ.get("NATS_APP_SERVERS", "nats://127.0.0.1:4222"),
        subject=os.environ.get("NATS_APP_SUBJECT", "crash.{event_type}"),
        stream=os.environ.get("NATS_APP_STREAM") or None,
    ),
    name=ROUTE,
    max_attempts=5,
    timeout=120,
)
