"""What the write path reads from the Outbox whose events it writes, and the one thing it counts there.

The :class:`~outbox.Outbox` sits above this package: its ``install()`` attaches
the session listeners defined here. The write path therefore names the Outbox
by this protocol, not by its class, so the dependency runs one way only; any
``Outbox`` satisfies it (mypy checks that where ``Outbox.install`` hands itself
over).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol

from .._routes import Route
from .payload import JsonDefault

__all__ = ["DedupeCounter", "EmitSettings"]


class DedupeCounter:
    """Dropped duplicates per route since the process started; read by ``Outbox.deduplicated``."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, route: str) -> None:
        with self._lock:
            self._counts[route] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class EmitSettings(Protocol):
    payload_limit: int
    payload_depth_limit: int
    #: Send the commit's INSERT with the COMMIT on psycopg (``pipeline``).
    pipeline_writes: bool
    json_default: JsonDefault | None
    #: Duplicates dropped per route (``dedupe``), read through ``Outbox.deduplicated``.
    _dedupe_counter: DedupeCounter
    trace_context: bool
    trace_baggage: bool

    @property
    def event_types(self) -> tuple[str, ...]: ...

    def routes_for(self, event_type: str) -> tuple[Route, ...]: ...
