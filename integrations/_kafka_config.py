"""The Kafka publisher's producer configuration: what it forces, what it refuses, what it keeps secret.

Checked when the publisher is built, so a bad setting fails where the route
is defined, not at the first message after a deploy.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox import ConfigurationError
from outbox._redact import _SECRET_KEY, Redactor

from ._envelope import RoutingTemplate

__all__ = [
    "TOPIC_NAME",
    "check_topic_template",
    "producer_config",
    "secret_values",
    "validate_with_librdkafka",
]

TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's legal topic names
_SECRET_NAMES = frozenset({"sasl.oauthbearer.config", "ssl.key.pem", "ssl_key"})
# Set by the publisher: a user's value would break the delivered-only-after-ack promise or the redaction.
_OWNED = {
    "on_delivery": "the publisher awaits each message's own delivery report",
    "dr_cb": "the publisher awaits each message's own delivery report",
    "dr_msg_cb": "the publisher awaits each message's own delivery report",
    "delivery.report.only.error": "the publisher awaits a delivery report for every message, "
    "successful ones included",
    "error_cb": "the publisher handles client errors itself (a fatal one replaces the producer)",
    "logger": "librdkafka's logs go to the 'outbox.integrations.kafka.librdkafka' logger with secrets masked",
    "transactional.id": "each message is its own idempotent write; a transactional producer would need "
    "a transaction around every send and adds nothing for one message",
}


def _is_true(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def check_topic_template(template: str) -> RoutingTemplate:
    """The topic template, its fixed text already checked against Kafka's topic name rules."""
    routing = RoutingTemplate(template, "topic")
    literal = "".join(text for text, _, _, _ in string.Formatter().parse(template))
    bad = sorted({c for c in literal if not TOPIC_NAME.match(c)})
    if bad:
        raise ConfigurationError(
            f"topic {template!r}: Kafka topic names allow only letters, digits, '.', '_' and '-', "
            f"not {''.join(bad)!r}"
        )
    return routing


def producer_config(given: Mapping[str, Any], delivery_timeout: float) -> dict[str, Any]:
    """``given`` checked, with the settings the publisher's guarantees rest on forced."""
    if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
        raise ConfigurationError("config must be a mapping of confluent-kafka property names to values")
    config = dict(given)
    for name, why in _OWNED.items():
        if name in config:
            raise ConfigurationError(f"config {name!r} cannot be set: {why}")
    if not config.get("bootstrap.servers") and not config.get("test.mock.num.brokers"):
        raise ConfigurationError("config needs 'bootstrap.servers' (host:port of one or more brokers)")
    if "enable.idempotence" in config and not _is_true(config["enable.idempotence"]):
        raise ConfigurationError(
            "config 'enable.idempotence' must stay true: without it a librdkafka retry after a lost "
            "acknowledgement writes the message twice and can reorder a key's messages"
        )
    for name in ("acks", "request.required.acks"):
        if name in config and str(config[name]).strip().lower() not in ("all", "-1"):
            raise ConfigurationError(
                f"config {name!r} must be 'all' (got {config[name]!r}): with fewer acknowledgements "
                "a message recorded as delivered is lost if the partition leader fails"
            )
    limit = round(delivery_timeout * 1000)
    for name in ("message.timeout.ms", "delivery.timeout.ms"):  # one property, two names
        if name in config:
            value = config.pop(name)
            text = str(value).strip()
            if isinstance(value, bool) or not text.isdigit() or not 0 < int(text) <= limit:
                # 0 would be librdkafka's "forever".
                raise ConfigurationError(
                    f"config {name!r} must be a whole number of milliseconds from 1 to delivery_timeout "
                    f"({limit}), got {value!r}: librdkafka would otherwise keep sending a message "
                    "after its attempt timed out and was scheduled for retry"
                )
            limit = int(text)
    config.pop("request.required.acks", None)
    defaults: dict[str, Any] = {"partitioner": "murmur2_random"}  # Java's: a key lands where Java's do
    if "reconnect.backoff.ms" not in config:
        # librdkafka's default backs off to 10 s between reconnects: a cluster back after an outage
        # would wait that long for messages that are already in the producer.
        defaults["reconnect.backoff.max.ms"] = 1000
    return {
        **defaults,
        **config,
        "enable.idempotence": True,
        "acks": "all",
        "message.timeout.ms": limit,
    }


def validate_with_librdkafka(config: Mapping[str, Any], redactor: Redactor) -> None:
    """Let librdkafka check every property now: a typo fails at construction, not at the first send.

    Without ``bootstrap.servers`` the throwaway producer connects nowhere.
    """
    probe = {k: v for k, v in config.items() if k not in ("bootstrap.servers", "test.mock.num.brokers")}
    try:
        Producer({**probe, "log_level": 0}).close()
    except (KafkaException, TypeError, ValueError) as exc:
        reason = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
        raise ConfigurationError(f"invalid Kafka producer config: {redactor.text(reason)}") from None


def secret_values(config: Mapping[str, Any]) -> list[str]:
    """Values of the properties that hold credentials: passwords, private keys, OAuth settings."""
    return [
        str(value)
        for name, value in config.items()
        if (_SECRET_KEY.search(name) or name in _SECRET_NAMES or name.endswith("key.pem"))
        and str(value).strip()
    ]
