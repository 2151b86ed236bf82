"""An inbox for ``outbox-consumer`` subprocess tests, fed by a spool directory instead of a broker.

Each file in ``SPOOL_DIR`` is one delivery (``{"headers": {...}, "body": "..."}``),
taken in name order; acknowledging it deletes the file, so a delivery that is
not acknowledged is simply read again, as a broker would redeliver it. The
broker sources are tested against their real servers elsewhere: this one keeps
the command's own surface (exit codes, metrics, readiness, shutdown) apart from
any broker.

The handler records each message in ``effects`` on the consumer's own
session. ``slow.*`` events first touch ``SPOOL_STARTED`` (when set) and sleep
``SPOOL_SLEEP`` seconds, so a test can stop the consumer while one is in hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from sqlalchemy import Column, MetaData, String, Table, insert
from sqlalchemy.orm import Session

from outbox import Inbox, InboxMessage
from outbox._inbox.cloudevents import from_cloudevent
from outbox._inbox.source import SourceContext

effects = Table("effects", MetaData(), Column("message_id", String(255)), Column("event_type", String(255)))


class SpoolSource:
    name = "spool:test"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    async def consume(self, context: SourceContext) -> None:
        context.connected(True)
        in_hand: set[Path] = set()
        tasks: set[asyncio.Task[None]] = set()
        while not context.stopping.is_set():
            for path in sorted(self.folder.glob("*.json")):
                if path in in_hand or len(in_hand) >= context.concurrency:
                    continue
                in_hand.add(path)
                task = asyncio.create_task(self._take(context, path, in_hand))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)

    async def _take(self, context: SourceContext, path: Path, in_hand: set[Path]) -> None:
        try:
            data = json.loads(path.read_text())
            message, problem = from_cloudevent(data["headers"], data["body"].encode(), source=self.name)

            def ack() -> None:
                path.unlink()

            if problem is not None:
                await context.refuse(message, problem, ack=ack)
            elif await context.take(message, ack=ack) is None:
                await asyncio.sleep(context.retry_delay(message.attempt))
        finally:
            in_hand.discard(path)


inbox = Inbox("spool")


@inbox.handler("#", name="record")
def record(session: Session, message: InboxMessage) -> None:
    if message.event_type.startswith("slow."):
        started = os.environ.get("SPOOL_STARTED")
        if started:
            Path(started).touch()
        time.sleep(float(os.environ.get("SPOOL_SLEEP", "2")))
    session.execute(insert(effects).values(message_id=message.id, event_type=message.event_type))


inbox.consume(SpoolSource(Path(os.environ.get("SPOOL_DIR", "spool"))))
