"""An application for relay subprocess tests of batches: one route whose handler takes a claim at once.

The handler (``outbox_deliver_batch``) leaves its evidence in files, so a test
can count side effects per message and per relay process on SQLite as on
PostgreSQL without writing to the database the relay uses:

- ``COUNTING_STARTED_DIR``: each batch, once started, touches a file named
  after each of its message ids there;
- ``COUNTING_SLEEP``: seconds each batch then takes before it records anything
  (keeps a batch in flight while a test kills the relay);
- ``COUNTING_DONE_DIR``: each delivered message leaves a file
  ``<message id>-<relay pid>`` there.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from outbox import Backoff, Message, Outbox

EVENT = "batch.me"
ROUTE = "batched"

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.2))


class Batched:
    def __call__(self, message: Message) -> None:
        raise AssertionError("the relay hands this route's messages to outbox_deliver_batch")

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[None]:
        started = os.environ.get("COUNTING_STARTED_DIR")
        if started:
            for message in messages:
                Path(started, str(message.id)).touch()
        await asyncio.sleep(float(os.environ.get("COUNTING_SLEEP") or 0))
        for message in messages:
            Path(os.environ["COUNTING_DONE_DIR"], f"{message.id}-{os.getpid()}").touch()
        return [None] * len(messages)


ob.route(EVENT, Batched(), name=ROUTE, max_attempts=3)
