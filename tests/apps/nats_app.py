"""An application for the NATS crash test: a JetStream publisher that can hang after its publish is acked.

Configured from the environment of the relay process: ``NATS_APP_SERVERS``,
``NATS_APP_SUBJECT`` and ``NATS_APP_STREAM``. With ``NATS_APP_HANG_DIR`` set,
each delivery, once JetStream has acked it, touches a file named after the
message id there and then waits (at most a minute), so the test can SIGKILL the
relay between the publish and the recording of its outcome.
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
    async def __call__(self, message: Message) -> dict[str, Any]:
        detail = await super().__call__(message)
        hang = os.environ.get("NATS_APP_HANG_DIR")
        if hang:
            (Path(hang) / str(message.id)).touch()
            await asyncio.sleep(60)
        return detail


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
