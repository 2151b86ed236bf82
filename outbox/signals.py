"""Blinker signals: hooks for metrics, tracing and embedded relays.

Connect with ``outbox.signals.event_emitted.connect(fn)``. Every signal is sent
with the :class:`~outbox.Outbox` as sender, so ``connect(fn, sender=ob)`` listens
to one outbox only. Receivers run synchronously in the sending thread; keep them
quick. What a receiver that raises does depends on who sends:

- the write-side signals are sent with blinker's own ``send``: an exception
  propagates into the caller (``emit()`` for ``event_emitted``, the session's
  commit for ``messages_committed``, where it surfaces after the commit) and
  later receivers of that signal are not called;
- the relay's signals are sent through ``outbox.relay.announce.send``: each
  receiver is called on its own, one that raises is logged (action
  ``signal_error``) and the relay carries on, later receivers included. Async
  receivers are refused the same way: the relay sends synchronously.

Write side (sent by ``outbox``):

``event_emitted``
    emit() accepted an event. Keyword arguments: ``session``, ``event_id``,
    ``event_type``, ``routes`` (the route names it fans out to). The event is not
    yet stored: it is stored only if the transaction commits.
``messages_committed``
    a transaction that wrote outbox rows committed. Keyword arguments:
    ``session``, ``queues`` (the set of queue names written). An embedded relay
    listens to this to wake without waiting for its poll interval.
``event_deduplicated``
    a committed transaction's event was not stored for one route because a
    message of that route already holds its idempotency key. Sent once per
    dropped message, after the commit. Keyword arguments: ``session``,
    ``event_id`` (the dropped event's), ``event_type``, ``route``, ``key``,
    ``existing_id`` (the ``outbox_message`` id holding the key; None if it
    could not be read).

Relay side (sent by ``outbox.relay``, from the relay's event-loop thread):

``relay_started`` / ``relay_stopped``
    keyword argument ``relay`` (the :class:`~outbox.relay.Relay`). ``relay_started``
    is sent once the database answered and the background tasks are started,
    before the first claim; the relay is not necessarily listening yet.
``relay_listening``
    ``relay``. Sent each time the relay's LISTEN connection is established or
    re-established (after a lost connection), once the ``LISTEN`` statement has
    completed: from then on a commit's NOTIFY wakes it. A catch-up claim follows
    each one. Never sent by a relay that does not listen (SQLite,
    ``listen=False`` / ``--no-listen``). ``/readyz`` counts the relay as
    listening from this moment until the connection is lost.
``message_claimed``
    ``relay``, ``messages`` (the claimed :class:`~outbox.Message` objects).
``message_delivered``
    ``relay``, ``message``, ``duration`` (seconds the handler took).
``retry_scheduled``
    ``relay``, ``message``, ``outcome`` (``retry``, ``failed``, ``timeout`` or
    ``lease_expired``), ``delay`` (seconds until the next attempt), ``error``.
``message_dead``
    ``relay``, ``message``, ``error`` (the redacted reason).
``message_expired``
    ``relay``, ``message`` (its ``expires_at`` says when). The message was
    claimed past its ``expires_at``: its handler was not called, and it is
    now ``discarded``.
"""

from __future__ import annotations

from blinker import Namespace

__all__ = [
    "event_deduplicated",
    "event_emitted",
    "message_claimed",
    "message_dead",
    "message_delivered",
    "message_expired",
    "messages_committed",
    "namespace",
    "relay_listening",
    "relay_started",
    "relay_stopped",
    "retry_scheduled",
]

namespace = Namespace()

event_emitted = namespace.signal("event-emitted", doc="emit() accepted an event (not yet committed)")
messages_committed = namespace.signal(
    "messages-committed", doc="a transaction that wrote outbox rows committed"
)
event_deduplicated = namespace.signal(
    "event-deduplicated", doc="a committed event was not stored for a route: its key was already there"
)

relay_started = namespace.signal("relay-started", doc="a relay began claiming")
relay_listening = namespace.signal(
    "relay-listening", doc="a relay's LISTEN connection is (re-)established: NOTIFY now wakes it"
)
relay_stopped = namespace.signal("relay-stopped", doc="a relay finished shutting down")
message_claimed = namespace.signal("message-claimed", doc="a relay claimed a batch of messages")
message_delivered = namespace.signal("message-delivered", doc="a handler returned normally")
retry_scheduled = namespace.signal("retry-scheduled", doc="a failed attempt was rescheduled")
message_dead = namespace.signal("message-dead", doc="a message went dead")
message_expired = namespace.signal(
    "message-expired", doc="a message claimed past its expires_at was discarded, its handler not called"
)
