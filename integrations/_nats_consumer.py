"""Feed an inbox from a JetStream durable pull consumer: ack after the commit, nak with the retry delay.

::

    from outbox.integrations.nats import NatsConsumer

    inbox.consume(NatsConsumer("nats://127.0.0.1:4222", stream="ORDERS", durable="shipping"))

Each fetched message becomes an :class:`~outbox.InboxMessage` through the
CloudEvents headers our publisher sends (``from_cloudevent``), with
``attempt`` = JetStream's delivery count. The runtime commits its outcome,
then calls the ``msg.ack`` handed to it; a handler that failed (or a database
that did not answer) leaves it unacknowledged, and it is ``nak``'d with
``retry_delay(attempt)`` so JetStream sends it again no sooner.

Why a pull consumer: each process fetches only as many messages as it has
free slots (``batch``), so a slow process never holds messages another could
take, and any number of processes may share one durable.

While a message is in hand, ``in_progress`` is sent every third of the
consumer's ``ack_wait``, so a long transaction keeps it. If the ack wait
expires all the same (a process stalled, a connection cut), JetStream
delivers it again, to this process or another: the inbox answers that
delivery as a duplicate once the first commits, or takes it if the first
rolled back. An acknowledgement lost on the way costs the same: one
duplicate delivery, never a second effect.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from outbox import ConfigurationError
from outbox._inbox.cloudevents import from_cloudevent
from outbox._inbox.source import SourceContext
from outbox._redact import Redactor

from ._nats_answers import RECONNECT_WAIT
from ._nats_config import BAD_STREAM, RESERVED_OPTIONS, check_servers, hosts, secrets
from ._nats_durable import CHECK_EVERY, Durable, heartbeat_interval, pause

__all__ = ["NatsConsumer"]

log = logging.getLogger("outbox.integrations.nats")

#: Longest wait of one fetch: how soon a stop is noticed while idle.
FETCH_WAIT: Final = 1.0
#: Bound on the first connection and on each JetStream API call.
API_TIMEOUT: Final = 5.0
_BAD_FILTER_TOKEN = re.compile(r"\s")


def _check_filter(subject: object) -> str | None:
    """A filter subject may use ``*`` for a token and ``>`` for the rest, never inside a token."""
    if subject is None:
        return None
    tokens = subject.split(".") if isinstance(subject, str) and subject else [""]
    for position, token in enumerate(tokens):
        wild_ok = token == "*" or (token == ">" and position == len(tokens) - 1)
        if not token or _BAD_FILTER_TOKEN.search(token) or (("*" in token or ">" in token) and not wild_ok):
            raise ConfigurationError(
                f"subject must be a NATS filter subject such as orders.> or orders.*.paid, got {subject!r}"
            )
    assert isinstance(subject, str)
    return subject


def _positive_int(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{what} must be an int of at least 1, got {value!r}")
    return value


class NatsConsumer:
    """Consume ``stream`` through the durable pull consumer ``durable``, making it if it is missing.

    ``subject`` filters the stream (a consumer made here gets it as its
    filter; an existing one must have the same). ``batch`` is how many
    messages this process holds at once (default: the consumer's
    concurrency). ``ack_wait`` (seconds) and ``max_ack_pending`` (default
    ``max(1000, 10 * batch)``) apply to a consumer made here; one that exists
    is used as it is. ``connect_options`` go to ``nats.connect``, as the
    publisher's do. ``name`` names the source in logs and metrics (default
    ``nats:<stream>/<durable>``).
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        stream: str,
        durable: str,
        *,
        subject: str | None = None,
        name: str | None = None,
        batch: int | None = None,
        ack_wait: float = 30.0,
        max_ack_pending: int | None = None,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.servers = check_servers(servers)
        for value, what in ((stream, "stream"), (durable, "durable")):
            if not isinstance(value, str) or not value or BAD_STREAM.search(value):
                raise ConfigurationError(
                    f"{what} must be a JetStream {what} name (no spaces, dots, wildcards or slashes), "
                    f"got {value!r}"
                )
        self.stream = stream
        self.durable = durable
        self.subject = _check_filter(subject)
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ConfigurationError(f"name must be a non-empty string, got {name!r}")
        self._name = name or f"nats:{stream}/{durable}"
        self.batch = _positive_int(batch, "batch")
        if (
            isinstance(ack_wait, bool)
            or not isinstance(ack_wait, int | float)
            or not math.isfinite(ack_wait)
            or ack_wait < 1
        ):
            raise ConfigurationError(f"ack_wait must be seconds, at least 1, got {ack_wait!r}")
        self.ack_wait = float(ack_wait)
        self.max_ack_pending = _positive_int(max_ack_pending, "max_ack_pending")
        options = dict(connect_options or {})
        reserved = sorted(RESERVED_OPTIONS & set(options))
        if reserved:
            raise ConfigurationError(f"connect_options may not set {', '.join(reserved)}: NatsConsumer does")
        self._options = options
        self._redactor = Redactor(secrets(self.servers, options))
        self._hosts = hosts(self.servers)
        self._durable = Durable(
            stream,
            durable,
            subject=self.subject,
            ack_wait=self.ack_wait,
            max_ack_pending=self.max_ack_pending,
            source=self._name,
            text=self._text,
        )

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<NatsConsumer {self._hosts} stream={self.stream!r} durable={self.durable!r}>"

    def outbox_secrets(self) -> list[str]:
        """Passwords and tokens from the server URLs and ``connect_options``: never written anywhere."""
        return secrets(self.servers, self._options)

    # -- the source -------------------------------------------------------------------------------

    async def consume(self, context: SourceContext) -> None:
        """Fetch, take, ack or nak until ``context.stopping``; reconnects through outages by itself."""
        client = await self._connect(context)
        if client is None:
            return
        try:
            js = client.jetstream(timeout=API_TIMEOUT)
            batch = self.batch or context.concurrency
            info = await self._durable.ready(js, context.stopping, batch)
            if info is not None:
                context.connected(client.is_connected)
                await self._serve(client, js, context, batch, info)
        finally:
            await _close(client)

    async def _serve(
        self, client: Client, js: JetStreamContext, context: SourceContext, batch: int, info: ConsumerInfo
    ) -> None:
        sub = await js.pull_subscribe_bind(consumer=self.durable, stream=self.stream)
        beat = heartbeat_interval(info)
        in_hand: set[asyncio.Task[None]] = set()
        checked = time.monotonic()
        try:
            while not context.stopping.is_set():
                free = batch - len(in_hand)
                if free <= 0:
                    await asyncio.wait(in_hand, return_when=asyncio.FIRST_COMPLETED)
                    continue
                if client.is_closed:  # nats-py gave up: the runtime starts this source again
                    raise ConnectionError(f"the connection to NATS at {self._hosts} was closed")
                if not client.is_connected:  # no pull requests piled up while nats-py reconnects
                    await pause(context.stopping, 0.2)
                    continue
                try:
                    fetched = await sub.fetch(free, timeout=FETCH_WAIT)
                except TimeoutError:  # nothing to fetch (nats.errors.TimeoutError is one too)
                    if time.monotonic() - checked >= CHECK_EVERY:
                        checked = time.monotonic()
                        found = await self._durable.recheck(js, context.stopping, batch)
                        beat = heartbeat_interval(found) if found is not None else beat
                    continue
                except (OSError, nats.errors.Error) as exc:
                    log.debug("NATS fetch failed: %s", self._text(exc), extra={"action": "nats_fetch_error"})
                    await pause(context.stopping, RECONNECT_WAIT)
                    continue
                for msg in fetched:
                    task = asyncio.create_task(self._handle(msg, context, beat))
                    in_hand.add(task)
                    task.add_done_callback(in_hand.discard)
            if in_hand:  # stopping: the messages in hand finish, and are acked
                await asyncio.gather(*in_hand, return_exceptions=True)
        except BaseException:  # cancelled (a forced stop) or failed: what is in hand comes again
            for task in in_hand:
                task.cancel()
            await asyncio.gather(*in_hand, return_exceptions=True)
            raise

    async def _handle(self, msg: Msg, context: SourceContext, beat: float) -> None:
        try:
            attempt = msg.metadata.num_delivered
        except Exception:  # not a JetStream reply subject: nothing says how often it came
            attempt = 1
        headers = msg.headers or {}
        message, problem = from_cloudevent(
            headers, msg.data, source=self._name, attempt=attempt, fallback_id=headers.get("Nats-Msg-Id")
        )
        keeping = asyncio.create_task(_keep_in_progress(msg, beat))

        async def ack() -> None:
            keeping.cancel()
            await msg.ack()

        try:
            if problem is not None:
                done = await context.refuse(message, problem, ack=ack)
            else:
                done = await context.take(message, ack=ack) is not None
        finally:
            keeping.cancel()
        if not done:
            try:
                await msg.nak(delay=context.retry_delay(attempt))
            except Exception as exc:  # the connection is down: the ack wait brings it back instead
                log.debug("NATS nak failed: %s", self._text(exc), extra={"action": "nats_nak_failed"})

    # -- connection and consumer ------------------------------------------------------------------

    async def _connect(self, context: SourceContext) -> Client | None:
        """A connection nats-py keeps reconnecting; the first one is retried here until it is made."""
        told = False
        while not context.stopping.is_set():
            client = Client()

            async def disconnected(client: Client = client) -> None:
                if not client.is_closed:
                    context.connected(False)

            async def reconnected() -> None:
                context.connected(True)

            options: dict[str, Any] = {
                "name": f"sqlalchemy-outbox {self._name}",
                "reconnect_time_wait": RECONNECT_WAIT,
            }
            try:
                async with asyncio.timeout(API_TIMEOUT):
                    await client.connect(
                        servers=self.servers,
                        allow_reconnect=True,
                        max_reconnect_attempts=-1,
                        error_cb=self._on_error,
                        disconnected_cb=disconnected,
                        reconnected_cb=reconnected,
                        **(options | self._options),
                    )
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                await _close(client)
                context.connected(False)
                if not told:
                    told = True
                    log.warning(
                        "cannot connect to NATS at %s: %s: %s; trying every %.0fs",
                        self._hosts,
                        type(exc).__name__,
                        self._text(exc),
                        RECONNECT_WAIT,
                        extra={"action": "nats_unreachable", "source": self._name},
                    )
                await pause(context.stopping, RECONNECT_WAIT)
                continue
            return client
        return None

    def _text(self, exc: BaseException) -> str:
        try:
            return self._redactor.text(str(exc) or type(exc).__name__)
        except Exception:
            return f"<unprintable {type(exc).__name__}>"

    async def _on_error(self, exc: Exception) -> None:
        log.debug("NATS client error: %s", self._text(exc), extra={"action": "nats_error"})


async def _keep_in_progress(msg: Msg, every: float) -> None:
    """Tell JetStream the message is still being worked on, so its ack wait starts over."""
    while True:
        await asyncio.sleep(every)
        try:
            await msg.in_progress()
        except Exception:  # the connection is down: if the ack wait runs out, the redelivery is a duplicate
            pass


async def _close(client: Client) -> None:
    """Flush what was acked, then close; a connection already gone is left as it is."""
    if client.is_closed:
        return
    if client.is_connected:
        try:
            await client.flush(timeout=2)
        except Exception:
            pass
    try:
        await client.close()
    except Exception:
        pass
