"""``KafkaConsumer``: an inbox source that keeps its partition offsets in the database, with the effects.

::

    from outbox import Inbox
    from outbox.integrations.kafka import KafkaConsumer

    inbox = Inbox("shipping")
    inbox.consume(KafkaConsumer("kafka-1:9092,kafka-2:9092", ["orders"], group_id="shipping"))

A consumer that commits its offsets to Kafka after its database transaction
reads records again after a crash between the two; one that commits before
loses records. This one stores each record's next offset in
``outbox_inbox_offset`` in the transaction of the record's effects
(``before_commit``), and on every assignment starts each partition at the
offset stored there: no gap and no repeated effect, across restarts, crashes
and rebalances. The offsets it also commits to Kafka, after the database,
are for lag monitoring only and never read back.

How it runs: one thread owns the blocking ``confluent_kafka.Consumer``
(``_kafka_poller``) and answers rebalances (``_kafka_assignment``); the event
loop takes each partition's records in order, one at a time, partitions in
parallel up to the runtime's concurrency (``_kafka_partitions``). A record that fails is taken again
after the runtime's retry delay, its partition paused meanwhile, never
skipped; at the inbox's ``max_failures`` it becomes a dead letter, committed
with its offset like any other outcome.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

from outbox import ConfigurationError
from outbox._inbox.source import SourceContext
from outbox._redact import Redactor

from ._kafka_config import secret_values
from ._kafka_consumer_config import (
    check_topics,
    consumer_config,
    is_cooperative,
    start_offset,
    validate_consumer,
)
from ._kafka_partitions import Partitions
from ._kafka_poller import Poller

__all__ = ["KafkaConsumer"]


class KafkaConsumer:
    """Feed an inbox from Kafka ``topics`` as consumer group ``group_id``; attach with ``inbox.consume``.

    ``config`` is extra librdkafka consumer configuration (security settings,
    ``session.timeout.ms``, ``group.instance.id``...), checked here: settings
    that would keep a position outside the database (``enable.auto.commit``,
    ``enable.auto.offset.store``) or apply aborted transactions
    (``isolation.level=read_uncommitted``) are refused. ``auto.offset.reset``
    (``earliest`` by default) is where a partition starts that has no offset
    stored in the database yet.

    ``name`` (default ``kafka:<group_id>``) names the source in logs, metrics
    and each message's ``source``. ``poll_timeout`` bounds how long the
    consumer thread waits for records before it looks at pauses, lag commits
    and a stop again. ``commit_to_kafka`` also commits each partition's
    committed offset to Kafka, asynchronously after the database, so lag
    tools see progress; the source never reads it back.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topics: str | Sequence[str],
        group_id: str,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        poll_timeout: float = 0.2,
        commit_to_kafka: bool = True,
    ) -> None:
        self.topics = check_topics(topics)
        self._config = consumer_config(bootstrap_servers, group_id, config)
        self.group_id = group_id
        if name is None:
            name = f"kafka:{group_id}"
        if not isinstance(name, str) or not name.strip() or len(name) > 255:
            raise ConfigurationError("name must be a non-empty string of at most 255 characters")
        self._name = name
        if (
            isinstance(poll_timeout, bool)
            or not isinstance(poll_timeout, int | float)
            or not math.isfinite(poll_timeout)
            or not 0.01 <= poll_timeout <= 5
        ):
            raise ConfigurationError(f"poll_timeout must be seconds from 0.01 to 5, got {poll_timeout!r}")
        self.poll_timeout = float(poll_timeout)
        if not isinstance(commit_to_kafka, bool):
            raise ConfigurationError(f"commit_to_kafka must be True or False, got {commit_to_kafka!r}")
        self.commit_to_kafka = commit_to_kafka
        self._redactor = Redactor(secret_values(self._config))
        validate_consumer(self._config, self._redactor)

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        servers = self._config["bootstrap.servers"]
        return f"<KafkaConsumer {servers} topics={list(self.topics)!r} group={self.group_id!r}>"

    def _check_alone(self, context: SourceContext) -> None:
        """Offsets are kept per inbox, topic and partition: one inbox reads a topic through one group."""
        for other in getattr(context.inbox, "sources", ()):
            if other is self or not isinstance(other, KafkaConsumer) or other.group_id == self.group_id:
                continue
            shared = sorted(set(self.topics) & set(other.topics))
            if shared:
                raise ConfigurationError(
                    f"inbox {context.inbox.name!r}: sources {self.name!r} and {other.name!r} both read "
                    f"topic {shared[0]!r} in different groups; the inbox keeps one offset per partition, "
                    "so give them one group_id or separate inboxes"
                )

    async def consume(self, context: SourceContext) -> None:
        """Run until ``context.stopping``: take records in order per partition, hand them back at the end."""
        self._check_alone(context)
        partitions = Partitions(self.name, context)
        poller = Poller(
            name=self.name,
            config=self._config,
            topics=self.topics,
            cooperative=is_cooperative(self._config),
            start=start_offset(self._config),
            context=context,
            partitions=partitions,
            redactor=self._redactor,
            poll_timeout=self.poll_timeout,
            commit_to_kafka=self.commit_to_kafka,
            loop=asyncio.get_running_loop(),
        )
        stopping: asyncio.Future[Any] = asyncio.ensure_future(context.stopping.wait())
        finished: asyncio.Future[Any] = poller.finished
        poller.start()
        try:
            await asyncio.wait([stopping, finished], return_when=asyncio.FIRST_COMPLETED)
            if not poller.finished.done():
                poller.stop()  # fetch nothing more; closing revokes, which waits for the records in hand
            else:  # the consumer failed: finish what is in hand before the runtime starts it again
                await partitions.revoke(partitions.keys())
            await asyncio.wait([poller.finished])
            await partitions.finish()
            poller.finished.result()
        except asyncio.CancelledError:
            poller.abandon()
            partitions.abandon()
            raise
        finally:
            stopping.cancel()
