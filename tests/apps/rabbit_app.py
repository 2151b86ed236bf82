"""An application for RabbitMQ relay subprocess tests: one route publishing to ``$RABBIT_EXCHANGE``.

The publisher is the real one, wrapped to leave evidence and to stop where a
fault test needs it:

- ``RABBIT_PUBLISHED_DIR``: a directory where each confirmed publish touches a
  file named after the message id;
- ``RABBIT_HANG_AFTER_PUBLISH``: when set, a delivery that the broker has
  confirmed then waits an hour before returning, so the relay never records
  it: the window between publish and record that a crash can fall into;
- ``RABBIT_DELAY``: seconds each delivery waits before publishing (keeps a
  run going while a test closes the connection under it).
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
    async def __call__(self, message: Message) -> dict[str, Any]:
        delay = float(os.environ.get("RABBIT_DELAY") or 0)
        if delay:
            await asyncio.sleep(delay)
        detail = await super().__call__(message)
        published = os.environ.get("RABBIT_PUBLISHED_DIR")
        if published:
            Path(published, str(message.id)).touch()
        if os.environ.get("RABBIT_HANG_AFTER_PUBLISH"):
            await asyncio.sleep(3600)
        return detail


ob.route(
    EVENT,
    Probe(os.environ["RABBIT_URL"], os.environ["RABBIT_EXCHANGE"], publish_timeout=2.0),
    name="rabbit",
    max_attempts=50,
)
