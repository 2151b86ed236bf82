"""The Kafka source's assignment, on the consumer thread: rebalances, pauses, lag commits.

librdkafka calls the rebalance callbacks inside ``poll()``, on the consumer
thread, and each one needs the loop: an assignment needs the offsets stored
in the database, a revocation needs the records in hand of its partitions
finished. So the callback waits for the loop's answer right there
(``ask``): librdkafka fetches nothing for a partition until the callback has
assigned it, with the stored offset as its start, and hands a revoked
partition on only once the callback returns. Before either, the records
already fetched are handed to the loop (``flush``), so each reaches the
assignment it was fetched for.

A callback never lets an exception out: confluent-kafka would then assign
the partitions itself, at the position Kafka holds, not the database's. It
assigns them idle (paused, unknown to the loop) and reports the failure; the
consumer is then closed and started again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from outbox._first_line import first_line
from outbox._inbox.source import SourceContext

from ._kafka_partitions import Key, Partitions

__all__ = ["Assignment"]

log = logging.getLogger("outbox.integrations.kafka")
T = TypeVar("T")

#: Longest pause between two reads of the stored offsets that failed during an assignment.
STORED_RETRY_MAX = 5.0


def _keys(partitions: Iterable[TopicPartition]) -> list[Key]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _shown(positions: dict[Key, int | None]) -> str:
    return ", ".join(
        f"{topic}[{number}] at {'the reset position' if offset is None else offset}"
        for (topic, number), offset in sorted(positions.items())
    )


class Assignment:
    """What the consumer thread knows of its partitions: which are paused, what Kafka was told."""

    def __init__(
        self,
        *,
        name: str,
        context: SourceContext,
        partitions: Partitions,
        cooperative: bool,
        start: int,
        commit_to_kafka: bool,
        ask: Callable[[Callable[[], Awaitable[Any]]], Any],
        flush: Callable[[], None],
        stop: threading.Event,
        fail: Callable[[BaseException], None],
    ) -> None:
        self._name = name
        self._context = context
        self._partitions = partitions
        self._cooperative = cooperative
        self._start = start
        self._commit_to_kafka = commit_to_kafka
        self._ask = ask
        self._flush = flush
        self._stop = stop
        self._fail = fail
        self._paused: set[Key] = set()
        self._sent: dict[Key, int] = {}  # the offsets Kafka was last told (or started at)

    # -- rebalances -------------------------------------------------------------------------------

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        try:
            self._flush()
            self._assign(consumer, partitions)
        except Exception as exc:  # never let librdkafka assign by itself: it would start elsewhere
            self._fail(exc)
            self._assign_idle(consumer, partitions)

    def _assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        stored = self._stored_offsets({tp.topic for tp in partitions})
        if stored is None:  # stopping before the database answered
            self._assign_idle(consumer, partitions)
            return
        positions = {key: stored[key[0]].get(key[1]) for key in _keys(partitions)}
        self._ask(lambda: self._partitions.assign(positions))
        starts = [
            TopicPartition(topic, number, self._start if offset is None else offset)
            for (topic, number), offset in positions.items()
        ]
        if self._cooperative:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        consumer.resume(starts)  # a partition paused under an earlier assignment starts afresh
        self._paused.difference_update(positions)
        self._sent.update({key: offset for key, offset in positions.items() if offset is not None})
        if positions:  # a cooperative rebalance calls with nothing new for this member
            log.info(
                "source %s assigned %s",
                self._name,
                _shown(positions),
                extra={"action": "kafka_assigned", "source": self._name},
            )

    def _assign_idle(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Assign, as librdkafka requires, but fetch nothing: the loop does not know these partitions."""
        idle = [TopicPartition(tp.topic, tp.partition, OFFSET_END) for tp in partitions]
        try:
            if self._cooperative:
                consumer.incremental_assign(idle)
            else:
                consumer.assign(idle)
            consumer.pause(idle)
            self._paused.update(_keys(idle))
        except Exception as exc:
            self._fail(exc)

    def _stored_offsets(self, topics: set[str]) -> dict[str, dict[int, int]] | None:
        """``{topic: {partition: next offset}}`` from the database, retried until it answers."""
        found: dict[str, dict[int, int]] = {}
        for topic in sorted(topics):
            delay = 0.5
            while topic not in found:
                if self._stop.is_set():
                    return None
                try:
                    offsets = self._ask(lambda topic=topic: self._context.stored_offsets(topic))  # type: ignore[misc]
                except Exception as exc:
                    log.warning(
                        "source %s: cannot read the stored offsets of %s: %s; trying again in %.1fs",
                        self._name,
                        topic,
                        first_line(exc),
                        delay,
                        extra={"action": "kafka_offsets_unread", "source": self._name},
                    )
                    self._stop.wait(delay)
                    delay = min(delay * 2, STORED_RETRY_MAX)
                    continue
                if offsets is None:
                    return None
                found[topic] = offsets
        return found

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=False)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=True)

    def _give_up(self, consumer: Consumer, partitions: list[TopicPartition], *, lost: bool) -> None:
        keys = _keys(partitions)
        try:
            self._flush()
            committed = self._ask(lambda: self._partitions.revoke(keys)) or {}
            if not lost:  # a lost partition has another owner already: Kafka would refuse
                self.commit(consumer, committed)
        except Exception as exc:
            self._fail(exc)
        finally:
            try:
                if self._cooperative:
                    consumer.incremental_unassign(partitions)
                else:
                    consumer.unassign()
            except Exception as exc:
                self._fail(exc)
            self._paused.difference_update(keys)
            for key in keys:
                self._sent.pop(key, None)
        if not keys:
            return
        log.info(
            "source %s %s %s",
            self._name,
            "lost" if lost else "handed back",
            ", ".join(f"{topic}[{number}]" for topic, number in sorted(keys)),
            extra={"action": "kafka_lost" if lost else "kafka_revoked", "source": self._name},
        )

    # -- pauses and lag commits -------------------------------------------------------------------

    def apply_pauses(self, consumer: Consumer) -> None:
        """Pause and resume fetching as the loop's partitions want it."""
        self._partitions.changed.clear()
        wanted = self._partitions.pauses()
        pause = [key for key, want in wanted.items() if want and key not in self._paused]
        resume = [key for key, want in wanted.items() if not want and key in self._paused]
        if pause:
            consumer.pause([TopicPartition(topic, number) for topic, number in pause])
            self._paused.update(pause)
        if resume:
            consumer.resume([TopicPartition(topic, number) for topic, number in resume])
            self._paused.difference_update(resume)

    def commit(self, consumer: Consumer, committed: dict[Key, int]) -> None:
        """Tell Kafka how far the database is, for lag tools; never read back (the database is the truth)."""
        if not self._commit_to_kafka:
            return
        ahead = {key: offset for key, offset in committed.items() if offset > self._sent.get(key, -1)}
        if not ahead:
            return
        try:
            consumer.commit(
                offsets=[TopicPartition(topic, number, offset) for (topic, number), offset in ahead.items()],
                asynchronous=True,
            )
        except KafkaException as exc:
            log.debug("source %s: lag commit to Kafka failed: %s", self._name, exc)
            return
        self._sent.update(ahead)

    def on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is not None:
            log.debug("source %s: lag commit to Kafka failed: %s", self._name, error.str())
