"""JetStream acks for many publishes at once: one reply subscription, one future per publish.

``js.publish`` is a request: a reply inbox, a timer and a wait for each
message, one after the other unless each runs in a task of its own. A batch
publishes every message with its own reply subject under one wildcard
subscription, then waits for all the acks together, under one timer. This
uses only nats-py's public client API (``new_inbox``, ``subscribe``,
``publish``), so it works alike on every nats-py the extra allows; the
subscription is made again by nats-py after a reconnection.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

__all__ = ["Ack", "AckInbox", "read_ack"]

_STATUS = "Status"
_NO_RESPONDERS = "503"


@dataclass(frozen=True, slots=True)
class Ack:
    stream: str
    seq: int
    duplicate: bool


class AckInbox:
    """The reply subscription of one connection; :meth:`expect` gives each publish its subject and future."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._prefix: str | None = None
        self._lock = asyncio.Lock()
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[Msg]] = {}

    async def ready(self) -> None:
        """Subscribe once, on first use (concurrent first batches share the one subscription)."""
        if self._prefix is not None:
            return
        async with self._lock:
            if self._prefix is None:
                inbox = self._client.new_inbox()
                await self._client.subscribe(f"{inbox}.*", cb=self._on_reply)
                self._prefix = f"{inbox}."

    def expect(self) -> tuple[str, asyncio.Future[Msg]]:
        """A reply subject for one publish, and the future its reply will settle."""
        assert self._prefix is not None, "ready() first"
        token = str(next(self._tokens))
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        return self._prefix + token, future

    def forget(self, reply: str) -> None:
        """The publish's wait is over (acked, or given up): a late reply is dropped."""
        if self._prefix is not None:
            self._waiting.pop(reply[len(self._prefix) :], None)

    async def _on_reply(self, msg: Msg) -> None:
        assert self._prefix is not None
        future = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if future is not None and not future.done():
            future.set_result(msg)


def read_ack(reply: Msg) -> Ack:
    """The ack JetStream sent, or the error it stands for (as ``js.publish`` raises it)."""
    headers: dict[str, Any] = reply.headers or {}
    if headers.get(_STATUS) == _NO_RESPONDERS:  # nothing listens on the subject: no stream captures it
        raise nats.js.errors.NoStreamResponseError
    answer = json.loads(reply.data)
    if "error" in answer:
        raise nats.js.errors.APIError.from_error(answer["error"])
    return Ack(str(answer["stream"]), int(answer["seq"]), bool(answer.get("duplicate")))
