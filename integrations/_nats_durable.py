"""The JetStream durable a ``NatsConsumer`` reads: found, or made, and checked before the first fetch.

A missing stream at start is configuration (``ConfigurationError``, naming
it): waiting will not create it. Once the stream has been seen, a stream that
answers "not found" is waited for instead, since a restarting server, or an
operator recreating it, should not end a consumer that was working.

A durable made here gets explicit acks (each message acknowledged on its own,
after its commit), ``max_deliver`` unlimited (a message that keeps failing
becomes the inbox's dead letter, recorded, rather than one JetStream stops
sending), and ``max_ack_pending`` room for every process's batch and for the
messages waiting out a retry delay, which JetStream counts as pending too.
One that exists is used with its own settings, except those that would break
the promise (a push consumer, acks other than explicit, another filter),
which are refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from outbox import ConfigurationError

from ._nats_answers import RECONNECT_WAIT

__all__ = ["CHECK_EVERY", "Durable", "heartbeat_interval", "pause"]

log = logging.getLogger("outbox.integrations.nats")

#: How often an idle source asks whether its durable still exists, and waits for a vanished stream.
CHECK_EVERY: Final = 10.0
#: The smallest ``max_ack_pending`` a durable made here gets (JetStream's own default).
MIN_ACK_PENDING: Final = 1000
#: ``max_ack_pending`` of a durable made here, per message of one process's batch.
ACK_PENDING_PER_SLOT: Final = 10


async def pause(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` unless stopping first; True when stopping."""
    try:
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


def heartbeat_interval(info: ConsumerInfo) -> float:
    """A third of the shortest ack wait the durable applies (its own, which may not be ours)."""
    waits: list[float] = [info.config.ack_wait or 30.0, *(info.config.backoff or ())]
    return max(min(waits) / 3, 0.1)


class Durable:
    """One durable pull consumer on one stream, as a source wants it."""

    def __init__(
        self,
        stream: str,
        durable: str,
        *,
        subject: str | None,
        ack_wait: float,
        max_ack_pending: int | None,
        source: str,
        text: Callable[[BaseException], str],
    ) -> None:
        self.stream = stream
        self.durable = durable
        self.subject = subject
        self.ack_wait = ack_wait
        self.max_ack_pending = max_ack_pending
        self._source = source
        self._text = text
        self._stream_seen = False

    async def ready(self, js: JetStreamContext, stopping: asyncio.Event, batch: int) -> ConsumerInfo | None:
        """The durable's info, once the stream answers; made first if missing. None when stopping."""
        while not stopping.is_set():
            try:
                await js.stream_info(self.stream)
                try:
                    info: ConsumerInfo = await js.consumer_info(self.stream, self.durable)
                except nats.js.errors.NotFoundError:
                    info = await self._create(js, batch)
            except nats.js.errors.NotFoundError:
                missing = f"JetStream stream {self.stream!r} does not exist"
                if not self._stream_seen:
                    raise ConfigurationError(f"{missing}: create it, or correct stream=") from None
                log.error(
                    "%s any more; waiting for it",
                    missing,
                    extra={"action": "nats_stream_missing", "source": self._source},
                )
                await pause(stopping, CHECK_EVERY)
                continue
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                log.warning(
                    "JetStream did not answer for stream %r: %s: %s; trying again",
                    self.stream,
                    type(exc).__name__,
                    self._text(exc),
                    extra={"action": "nats_jetstream_unavailable", "source": self._source},
                )
                await pause(stopping, RECONNECT_WAIT)
                continue
            self._stream_seen = True
            self._check(info, batch)
            return info
        return None

    async def recheck(self, js: JetStreamContext, stopping: asyncio.Event, batch: int) -> ConsumerInfo | None:
        """While idle: is the durable still there? A deleted one is made again (its fetches only time out)."""
        try:
            info: ConsumerInfo = await js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            log.warning(
                "JetStream consumer %r of stream %r is gone; making it again",
                self.durable,
                self.stream,
                extra={"action": "nats_consumer_gone", "source": self._source},
            )
            return await self.ready(js, stopping, batch)
        except (OSError, TimeoutError, nats.errors.Error):
            return None  # the connection's own trouble: the fetch loop waits for it
        return info

    async def _create(self, js: JetStreamContext, batch: int) -> ConsumerInfo:
        config = ConsumerConfig(
            durable_name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending or max(MIN_ACK_PENDING, ACK_PENDING_PER_SLOT * batch),
            filter_subject=self.subject,
        )
        try:
            info: ConsumerInfo = await js.add_consumer(self.stream, config)
        except nats.js.errors.BadRequestError as exc:
            try:  # another process made it first, with settings of its own
                found: ConsumerInfo = await js.consumer_info(self.stream, self.durable)
            except nats.js.errors.NotFoundError:
                raise ConfigurationError(
                    f"JetStream refused to make consumer {self.durable!r} on stream {self.stream!r}: "
                    f"{exc.description}"
                ) from None
            return found
        log.info(
            "made JetStream consumer %r on stream %r (ack_wait %gs, max_ack_pending %d)",
            self.durable,
            self.stream,
            self.ack_wait,
            config.max_ack_pending,
            extra={"action": "nats_consumer_created", "source": self._source},
        )
        return info

    def _check(self, info: ConsumerInfo, batch: int) -> None:
        """Refuse a durable the source cannot keep its promise with; warn about risky settings."""
        config = info.config
        where = f"JetStream consumer {self.durable!r} of stream {self.stream!r}"
        if config.deliver_subject:
            raise ConfigurationError(f"{where} is a push consumer: NatsConsumer needs a pull consumer")
        if config.ack_policy not in (AckPolicy.EXPLICIT, None):
            # "all" would acknowledge earlier messages whose transactions have not committed.
            raise ConfigurationError(
                f"{where} has ack policy {config.ack_policy}: NatsConsumer needs explicit acks"
            )
        filters = [config.filter_subject] if config.filter_subject else list(config.filter_subjects or [])
        if self.subject is not None and filters != [self.subject]:
            raise ConfigurationError(
                f"{where} filters {', '.join(filters) or 'nothing'}, not {self.subject!r}: "
                "delete the consumer or change subject="
            )
        for risky, why in (
            (
                config.max_deliver is not None and config.max_deliver > 0,
                f"max_deliver {config.max_deliver}: JetStream stops delivering a message after that "
                "many tries, without a dead letter in the inbox",
            ),
            (
                config.max_ack_pending is not None and 0 < config.max_ack_pending < batch,
                f"max_ack_pending {config.max_ack_pending}, below this source's batch of {batch}",
            ),
        ):
            if risky:
                log.warning(
                    "%s has %s",
                    where,
                    why,
                    extra={"action": "nats_consumer_settings", "source": self._source},
                )
