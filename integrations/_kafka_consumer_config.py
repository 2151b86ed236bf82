"""The Kafka inbox source's consumer configuration: what it forces, what it refuses, where it starts.

The source's promise (no gap, no repeated effect) rests on the database being
the only place positions are kept: a record's next offset commits in the
transaction of its effects, and the consumer seeks there on every
assignment. A setting that lets librdkafka move or store positions by itself,
or hand over records a producer aborted, would break that quietly, so it is
refused when the source is built, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException

from outbox import ConfigurationError
from outbox._redact import Redactor

from ._kafka_config import TOPIC_NAME

__all__ = ["consumer_config", "check_topics", "is_cooperative", "start_offset", "validate_consumer"]

# Set by the source: a user's value would break the guarantee or the redaction.
_OWNED = {
    "bootstrap.servers": "pass the brokers as bootstrap_servers",
    "metadata.broker.list": "pass the brokers as bootstrap_servers",
    "group.id": "pass the group as group_id",
    "on_commit": "offsets are committed to Kafka by the source, for lag monitoring only",
    "error_cb": "the source handles client errors itself (readiness, reconnection)",
    "logger": "librdkafka's logs go to the 'outbox.integrations.kafka.librdkafka' logger with secrets masked",
}
# Must stay false: each lets librdkafka keep a position the database does not know about.
_MUST_BE_FALSE = {
    "enable.auto.commit": "positions are stored in the database with each record's effects; "
    "an automatic commit would be a second position, ahead of what is committed",
    "auto.commit.enable": "positions are stored in the database with each record's effects; "
    "an automatic commit would be a second position, ahead of what is committed",
    "enable.auto.offset.store": "the source stores each record's offset itself, after its "
    "transaction committed",
}
_EARLIEST = frozenset({"earliest", "smallest", "beginning"})
_LATEST = frozenset({"latest", "largest", "end"})


def _is_false(value: object) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() == "false")


def check_topics(topics: str | Sequence[str]) -> tuple[str, ...]:
    """The topic names, each a legal Kafka topic name, at least one, none twice."""
    names = (topics,) if isinstance(topics, str) else tuple(topics) if isinstance(topics, Sequence) else None
    if not names or not all(isinstance(name, str) for name in names):
        raise ConfigurationError("topics must be a topic name or a non-empty list of topic names")
    for name in names:
        if not TOPIC_NAME.match(name) or name in (".", ".."):
            raise ConfigurationError(
                f"topic {name[:300]!r} is not a Kafka topic name (letters, digits, '.', '_', '-'; "
                "patterns are not supported: offsets are kept per topic)"
            )
    if len(set(names)) != len(names):
        raise ConfigurationError(f"topics {list(names)!r} names a topic twice")
    return names


def consumer_config(bootstrap_servers: str, group_id: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The consumer's configuration: ``given`` checked, the settings the guarantee rests on forced."""
    if not isinstance(bootstrap_servers, str) or not bootstrap_servers.strip():
        raise ConfigurationError(
            "bootstrap_servers must be 'host:port' of one or more brokers, comma-separated"
        )
    if not isinstance(group_id, str) or not group_id.strip():
        raise ConfigurationError("group_id must be a non-empty string (the Kafka consumer group)")
    if given is None:
        given = {}
    if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
        raise ConfigurationError("config must be a mapping of confluent-kafka property names to values")
    config = dict(given)
    for name, why in _OWNED.items():
        if name in config:
            raise ConfigurationError(f"config {name!r} cannot be set: {why}")
    for name, why in _MUST_BE_FALSE.items():
        if name in config and not _is_false(config[name]):
            raise ConfigurationError(f"config {name!r} must stay false (got {config[name]!r}): {why}")
    reset = str(config.get("auto.offset.reset", "earliest")).strip().lower()
    if reset not in _EARLIEST | _LATEST:
        raise ConfigurationError(
            "config 'auto.offset.reset' must be 'earliest' or 'latest' "
            f"(got {config['auto.offset.reset']!r}): it says where a partition with no stored offset starts"
        )
    if str(config.get("isolation.level", "read_committed")).strip().lower() != "read_committed":
        raise ConfigurationError(
            f"config 'isolation.level' must be 'read_committed' (got {config['isolation.level']!r}): "
            "the inbox would otherwise apply records whose producer transaction was aborted"
        )
    defaults: dict[str, Any] = {"auto.offset.reset": "earliest"}
    if "reconnect.backoff.max.ms" not in config:
        defaults["reconnect.backoff.max.ms"] = 1000  # back within a second of the brokers' return
    return {
        **defaults,
        **config,
        "bootstrap.servers": bootstrap_servers,
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
    }


def start_offset(config: Mapping[str, Any]) -> int:
    """Where a partition with no offset in the database starts: its beginning or its end."""
    reset = str(config.get("auto.offset.reset", "earliest")).strip().lower()
    return OFFSET_BEGINNING if reset in _EARLIEST else OFFSET_END


def is_cooperative(config: Mapping[str, Any]) -> bool:
    """Whether rebalances hand over partitions incrementally (assign and revoke only what changes)."""
    if str(config.get("group.protocol", "classic")).strip().lower() == "consumer":
        return True
    return "cooperative-sticky" in str(config.get("partition.assignment.strategy", "")).lower()


def validate_consumer(config: Mapping[str, Any], redactor: Redactor) -> None:
    """Let librdkafka check every property now: a typo fails at construction, not at start-up.

    Without ``bootstrap.servers`` the throwaway consumer connects nowhere.
    """
    probe = {k: v for k, v in config.items() if k != "bootstrap.servers"}
    try:
        Consumer({**probe, "log_level": 0}).close()
    except (KafkaException, TypeError, ValueError) as exc:
        reason = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
        raise ConfigurationError(f"invalid Kafka consumer config: {redactor.text(reason)}") from None
