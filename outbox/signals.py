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

Relay side (sent by ``outbox.relay``, from the relay's event-loop thread):

``relay_started`` / ``relay_stopped``
    keyword argument ``relay`` (the :class:`~outbox.relay.Relay`).
``message_claimed``
    ``relay``, ``messages`` (the claimed :class:`~outbox.Message` objects).
``message_delivered``
    ``relay``, ``message``, ``duration`` (seconds the handler took).
``retry_scheduled``
    ``relay``, ``message``, ``outcome`` (``retry``, ``failed``, ``timeout`` or
    ``lease_expired``), ``delay`` (seconds until the next attempt), ``error``.
``message_dead``
    ``relay``, ``message``, ``error`` (the redacted reason).
"""

from __future__ import annotations

from blinker import Namespace

__all__ = [
    "event_emitted",
    "message_claimed",
    "message_dead",
    "message_delivered",
    "messages_committed",
    "namespace",
    "relay_started",
    "relay_stopped",
    "retry_scheduled",
]

namespace = Namespace()

event_emitted = namespace.signal("event-emitted", doc="emit() accepted an event (not yet committed)")
messages_committed = namespace.signal(
    "messages-committed", doc="a transaction that wrote outbox rows committed"
)

relay_started = namespace.signal("relay-started", doc="a relay began claiming")
relay_stopped = namespace.signal("relay-stopped", doc="a relay finished shutting down")
message_claimed = namespace.signal("message-claimed", doc="a relay claimed a batch of messages")
message_delivered = namespace.signal("message-delivered", doc="a handler returned normally")
retry_scheduled = namespace.signal("retry-scheduled", doc="a failed attempt was rescheduled")
message_dead = namespace.signal("message-dead", doc="a message went dead")
