"""What the write path reads from the Outbox whose events it writes.

The :class:`~outbox.Outbox` sits above this package: its ``install()`` attaches
the session listeners defined here. The write path therefore names the Outbox
by this protocol, not by its class, so the dependency runs one way only; any
``Outbox`` satisfies it (mypy checks that where ``Outbox.install`` hands itself
over).
"""

from __future__ import annotations

from typing import Protocol

from .._routes import Route
from .dedupe import DedupeCounter
from .payload import JsonDefault

__all__ = ["EmitSettings"]


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
