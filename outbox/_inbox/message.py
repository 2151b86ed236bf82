"""What a source hands the inbox, and what the inbox hands back. Plain data: imports nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, TypeAlias

__all__ = ["PROCESS_OUTCOMES", "InboxMessage", "Processed", "ProcessOutcome"]

#: What became of one incoming message (``Processed.outcome``).
ProcessOutcome: TypeAlias = Literal["handled", "duplicate", "unhandled", "dead"]
PROCESS_OUTCOMES: Final = ("handled", "duplicate", "unhandled", "dead")


@dataclass(frozen=True, slots=True)
class InboxMessage:
    """One delivery of one message, as a source (a broker consumer, a webhook receiver) hands it in.

    ``id`` is the message's id as its producer gave it, the same on every
    redelivery: an outbox event's ``event_id``, a CloudEvents ``id``, a
    ``webhook-id``. A UUID or an int is taken as its text. ``payload`` is the
    decoded body, ``headers`` the transport's headers, ``source`` a short name
    for where it came from (``rabbitmq:orders``). ``sent_at``, when the
    producer says, is when it was sent: one sent longer ago than the inbox's
    ``keep`` is refused. ``attempt`` is how many times the source has
    delivered it, this time included; the inbox records a dead letter when a
    handler fails the ``max_failures``-th time.
    """

    id: str
    event_type: str
    payload: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None
    sent_at: datetime | None = None
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class Processed:
    """What :meth:`Inbox.process` did with one message; everything it says is committed.

    ``outcome``:

    - ``handled``: a first delivery; every matching handler ran, in one
      transaction with the marker;
    - ``duplicate``: the marker was there already; no handler ran;
    - ``unhandled``: no handler matches and the inbox skips such messages
      (``Inbox(unhandled="skip")``); the marker records it;
    - ``dead``: recorded as a dead letter (``dead_letter_id``) with the
      marker, because a handler failed for the last time or raised
      ``PermanentError``, no handler matches, or the message came too late;
      ``error`` says which.

    ``handlers`` names the handlers that ran (or, for ``dead``, would have).

    :meth:`Inbox.process_requeued` answers one per requeued dead letter, its
    ``dead_letter_id`` set for every outcome: ``handled``, ``dead`` (again),
    or ``duplicate`` (another process took it, or holds it now).
    """

    message_id: str
    outcome: ProcessOutcome
    handlers: tuple[str, ...] = ()
    error: BaseException | None = None
    dead_letter_id: int | None = None

    @property
    def duplicate(self) -> bool:
        """Was the message taken before (so this delivery changed nothing)?"""
        return self.outcome == "duplicate"
