"""Blinker signals: hooks for metrics, tracing and embedded relays.

Connect with ``outbox.signals.event_emitted.connect(fn)``. Every signal is sent
with the :class:`~outbox.Outbox` as sender, so ``connect(fn, sender=ob)`` listens
to one outbox only. Receivers run synchronously in the sending thread; keep them
quick and never let them raise (an exception propagates into the caller).

Write side (sent by ``outbox``):

``event_emitted``
    emit() accepted an event. Keyword arguments: ``session``, ``event_id``,
    ``event_type``, ``routes`` (the route names it fans out to). The event is not
    yet stored: it is stored only if the transaction commits.
``messages_committed``
    a transaction that wrote outbox rows committed. Keyword arguments:
    ``session``, ``queues`` (the set of queue names written). An embedded relay
    listens to this to wake without waiting for its poll interval.
"""

from __future__ import annotations

from blinker import Namespace

__all__ = ["event_emitted", "messages_committed", "namespace"]

namespace = Namespace()

event_emitted = namespace.signal("event-emitted", doc="emit() accepted an event (not yet committed)")
messages_committed = namespace.signal(
    "messages-committed", doc="a transaction that wrote outbox rows committed"
)
