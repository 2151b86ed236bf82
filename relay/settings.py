"""A relay's settings, checked when the Relay is built, so bad configuration fails at start-up.

The CLI parses the same settings from flags and environment variables; both
end here, so a value refused by one is refused by the other with the same words.
What a Relay checked is handed to each of its runs as one :class:`RelaySettings`,
so a run reads its settings without ever reading (or importing) the Relay.
"""

from __future__ import annotations

import math
import os
import random
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine

from outbox import ConfigurationError, Outbox, Route
from outbox._redact import Redactor
from outbox._routes import check_name

from .metrics import RelayMetrics
from .store import Store

__all__ = [
    "DEFAULT_CONCURRENCY",
    "RelaySettings",
    "default_relay_id",
    "positive",
    "queue_caps",
    "queue_names",
]

#: Deliveries in flight per relay by default. A relay is one event loop, so the figure does not
#: grow with the machine's cores. Below about 100 a drain waits on round trips (10 in flight:
#: 6,200 msg/s against 17,700 at 100); 200 drained 16-25 % faster than 100 on two 2-core hosts
#: (bench/RESULTS.md, run V; "Choosing the concurrency" in docs/relay.md). The webhook
#: handler's connection pool sets no lower limit of its own. A receiver that cannot take this
#: many at once gets a per-queue cap (``queue_concurrency``).
DEFAULT_CONCURRENCY = 200


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """Everything one serve or drain reads of its Relay, already checked; the Relay builds it once.

    Frozen because every run of a relay starts from the same settings: a run
    keeps what it makes for itself (its listener, its tasks) and never writes
    back into the Relay. The engine, the store, the random source and the
    metrics are shared objects, not copies: they outlive each run.
    """

    id: str
    outbox: Outbox
    engine: Engine
    store: Store
    routes: dict[str, Route]
    redactor: Redactor
    rng: random.Random
    metrics: RelayMetrics | None
    queues: tuple[str, ...] | None
    concurrency: int
    queue_concurrency: dict[str, int]
    batch_size: int
    poll_interval: float
    lease: float
    grace_period: float
    listen: bool
    metrics_interval: float
    registry_interval: float


def positive(what: str, value: object, *, integer: bool = False, zero: bool = False) -> Any:
    """``value`` if it is a finite number above zero (or zero, with ``zero``); else ConfigurationError."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    ok = (
        not isinstance(value, bool)
        and isinstance(value, kinds)
        and math.isfinite(float(value))  # type: ignore[arg-type]
        and (value >= 0 if zero else value > 0)  # type: ignore[operator]
    )
    if not ok:
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if zero else "> 0"
        raise ConfigurationError(f"{what} must be {kind} {bound}, got {value!r}")
    return value


def queue_names(queues: Iterable[str] | None) -> tuple[str, ...] | None:
    """The queues to serve, each once, in order; None serves every queue."""
    if queues is None:
        return None
    names = tuple(dict.fromkeys(check_name("queue", q) for q in queues))
    if not names:
        raise ConfigurationError("queues must name at least one queue (or be None for every queue)")
    return names


def queue_caps(queue_concurrency: Mapping[str, int] | None) -> dict[str, int]:
    """Per-queue limits on deliveries in flight."""
    return {
        check_name("queue", q): positive(f"queue_concurrency[{q!r}]", n, integer=True)
        for q, n in (queue_concurrency or {}).items()
    }


def default_relay_id() -> str:
    """Host, process and a random tail: unique among relays, and telling operators where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
