"""An application for RabbitMQ relay subprocess tests: one route publishing to ``$RABBIT_EXCHANGE``.

The publisher is the real one, its batches (``outbox_deliver_batch``) wrapped
to leave evidence and to stop where a fault test needs it:

- ``RABBIT_PUBLISHED_DIR``: a directory where each confirmed publish touches a
  file named after the message id;
- ``RABBIT_HANG_AFTER_PUBLISH``: when set, a batch of which the broker
  confirmed any message then waits an hour before returning, so the relay
  never records it: the window between publish and record that a crash can
  fall into;
- ``RABBIT_DELAY``: seconds each batch waits before publishing (keeps a run
  going while a test closes the connection under it).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from outbox import Backoff, Message, Outbox
from outbox.integrations.rabbitmq import RabbitMQPublisher

EVENT = "order.paid"

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.2))


class Probe(RabbitMQPublisher):
    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        delay = float(os.environ.get("RABBIT_DELAY") or 0)
        if delay:
            await asyncio.sleep(delay)
        outcomes = await super().outbox_deliver_batch(messages)
        confirmed = [
            m for m, outcome in zip(messages, outcomes, strict=True) if not isinstance(outcome, Exception)
        ]
        published = os.environ.get("RABBIT_PUBLISHED_DIR")
        if published:
            for message in confirmed:
                Path(published, str(message.id)).touch()
        if confirmed and os.environ.get("RABBIT_HANG_AFTER_PUBLISH"):
            await asyncio.sleep(3600)
        return outcomes


ob.route(
    EVENT,
    Probe(os.environ["RABBIT_URL"], os.environ["RABBIT_EXCHANGE"], publish_timeout=2.0),
    name="rabbit",
    max_attempts=50,
)
