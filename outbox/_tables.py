"""The documented tables. Operators query these with plain SQL; keep names stable.

The migrations in the ``outbox`` Alembic branch create exactly this schema (a
test compares the two); database-side rules that SQLAlchemy metadata cannot
express (the append-only trigger on ``outbox_attempt``, the NOTIFY trigger on
``outbox_message``) live in the migrations.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ColumnElement,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    false,
    func,
    literal_column,
    or_,
    text,
)

from ._types import JSONDocument, RowId, UTCDateTime

__all__ = [
    "ATTEMPT_OUTCOMES",
    "BREAKER_EVENTS",
    "INBOX_DEAD_STATUSES",
    "INBOX_OUTCOMES",
    "MESSAGE_STATUSES",
    "PAUSE_EVENTS",
    "PAUSE_KINDS",
    "metadata",
    "outbox_attempt",
    "outbox_breaker",
    "outbox_breaker_log",
    "outbox_inbox",
    "outbox_inbox_dead",
    "outbox_inbox_offset",
    "outbox_message",
    "outbox_pause",
    "outbox_pause_log",
    "outbox_relay_registry",
    "outbox_retention_run",
    "status_is_one_of",
]

MESSAGE_STATUSES: Final = ("pending", "running", "delivered", "dead", "discarded")
ATTEMPT_OUTCOMES: Final = (
    "delivered",
    "retry",
    "failed",
    "dead",
    "timeout",
    "lease_expired",
    "requeued",
    "discarded",
    "retried_now",
    "resent",
    "expired",
)
PAUSE_KINDS: Final = ("queue", "handler")
PAUSE_EVENTS: Final = ("paused", "resumed")
#: A circuit breaker opened by a relay, closed by a relay's successful trial, reset by an operator
#: (``outbox breaker reset``) or cleared by ``outbox retry-now`` of a message it held back.
BREAKER_EVENTS: Final = ("opened", "closed", "reset", "retried_now")
#: What an inbox decided about a message when it wrote the marker: ``received`` by a plain
#: ``Inbox.receive()`` (the caller acts on it), ``handled`` by its handlers, ``unhandled`` (no handler,
#: an inbox told to skip those), ``dead`` (recorded as a dead letter in ``outbox_inbox_dead``).
INBOX_OUTCOMES: Final = ("received", "handled", "unhandled", "dead")
#: A dead letter waits (``dead``), is requeued by an operator (``requeued``), then handled by its
#: consumer (``handled``) or recorded ``dead`` again.
INBOX_DEAD_STATUSES: Final = ("dead", "requeued", "handled")

#: Deterministic constraint names, so migrations and autogenerate agree on them.
NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


_PENDING = text("status = 'pending'")
# Spelled as equalities joined by OR, not "status <> 'delivered'": SQLite uses a partial index
# only when a term of the query's WHERE appears among the predicate's terms (PostgreSQL proves
# the implication either way, "status IN (...)" included).
_NOT_DELIVERED = text(" OR ".join(f"status = '{s}'" for s in MESSAGE_STATUSES if s != "delivered"))
_WAITING_OR_DEAD = text(
    " OR ".join(f"status = '{s}'" for s in MESSAGE_STATUSES if s not in ("delivered", "running"))
)
_RUNNING = text("status = 'running'")
_AGGREGATED = text("aggregate_type IS NOT NULL")
_PARKED = text("parked_on IS NOT NULL")

outbox_message = Table(
    "outbox_message",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    Column("event_id", Uuid(), nullable=False),
    Column("event_type", String(255), nullable=False),
    Column("handler", String(255), nullable=False),
    Column("queue", String(255), nullable=False),
    Column("priority", Integer, nullable=False),
    Column("payload", JSONDocument, nullable=False),
    Column("headers", JSONDocument, nullable=False),
    Column("aggregate_type", String(255)),
    Column("aggregate_id", String(255)),
    Column("idempotency_key", String(255)),
    Column("group_key", String(255)),
    Column("status", String(16), nullable=False, server_default=literal_column("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=literal_column("0")),
    Column("max_attempts", Integer, nullable=False),
    Column("available_at", UTCDateTime, nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("locked_by", String(255)),
    Column("locked_until", UTCDateTime),
    Column("delivered_at", UTCDateTime),
    Column("last_error", Text),
    Column("requeued_from", RowId, ForeignKey("outbox_message.id")),
    #: Not to be handed to a handler from this moment on (outbox_0018); NULL: never expires.
    Column("expires_at", UTCDateTime),
    #: The destination a pending message waits for (outbox_0021): set by a deferral that parked it
    #: (``RetryLater(until_recovered=...)``), cleared when it recovers; NULL for every other message.
    Column("parked_on", Text),
    UniqueConstraint("handler", "idempotency_key"),
    CheckConstraint(_one_of("status", MESSAGE_STATUSES), name="status"),
    CheckConstraint("attempts >= 0", name="attempts"),
    CheckConstraint("max_attempts >= 1", name="max_attempts"),
    # The relay's claim: due pending rows of its queues, lowest priority first, then oldest.
    Index(
        "ix_outbox_message_claim",
        "queue",
        "priority",
        "id",
        postgresql_where=_PENDING,
        sqlite_where=_PENDING,
    ),
    # Per-group ordering: is an earlier message of this group still unfinished?
    Index(
        "ix_outbox_message_group",
        "handler",
        "group_key",
        "id",
        postgresql_where=text("group_key IS NOT NULL"),
        sqlite_where=text("group_key IS NOT NULL"),
    ),
    # Requeued copies of a row: the foreign key check on every delete (purge), and
    # "was this requeued already?" (requeue, stats). Partial: only copies have it.
    Index(
        "ix_outbox_message_requeued_from",
        "requeued_from",
        postgresql_where=text("requeued_from IS NOT NULL"),
        sqlite_where=text("requeued_from IS NOT NULL"),
    ),
    # Counts and listings by status, for every status but "delivered" (most of the table), and on
    # PostgreSQL but "running" (the lease index below). Partial, because each status change writes a
    # new entry into every index the row is in: a delivery would add one more, to an index nothing
    # reads it by. SQLite keeps running rows here as well: its planner reads a count of several
    # statuses through one partial index only, and it has no dead versions to step over.
    Index(
        "ix_outbox_message_status_handler",
        "status",
        "handler",
        postgresql_where=_WAITING_OR_DEAD,
        sqlite_where=_NOT_DELIVERED,
    ),
    # Running messages by when their lease runs out. Lease recovery reads the leases that ran out
    # since its last look (relay/recovery.py), where under a held transaction the status index made
    # it walk every row ever claimed; counts of running rows read it too. On PostgreSQL a claim adds
    # its entry here instead of to the status index: one entry, as before.
    Index(
        "ix_outbox_message_lease",
        "locked_until",
        postgresql_where=_RUNNING,
        sqlite_where=_RUNNING,
    ),
    Index("ix_outbox_message_event_id", "event_id"),
    # Partial for the same reason: messages emitted without an aggregate never need an entry.
    Index(
        "ix_outbox_message_aggregate",
        "aggregate_type",
        "aggregate_id",
        postgresql_where=_AGGREGATED,
        sqlite_where=_AGGREGATED,
    ),
    # What waits for a destination to recover: the release when it does. Partial: only parked
    # messages have an entry, so every other write leaves this index alone.
    Index(
        "ix_outbox_message_parked_on",
        "parked_on",
        postgresql_where=_PARKED,
        sqlite_where=_PARKED,
    ),
    sqlite_autoincrement=True,
)


def status_is_one_of(*statuses: str) -> ColumnElement[bool]:
    """``outbox_message.status`` is one of ``statuses``, written so SQLite can read the status index.

    ``status IN (...)`` is what one would write, and PostgreSQL reads the partial
    ``ix_outbox_message_status_handler`` for it; SQLite only for equalities joined by
    OR, the way the index's predicate is spelled. A table scan instead would read
    every delivered message, on every metrics refresh.
    """
    return or_(*(outbox_message.c.status == s for s in statuses))


outbox_attempt = Table(
    "outbox_attempt",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    # No foreign key on purpose: retention may purge old messages while their
    # history is kept for longer, and history must never block or cascade.
    Column("message_id", RowId, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime),
    Column("duration_ms", Integer),
    Column("relay_id", String(255)),
    Column("error_type", String(255)),
    Column("error", Text),
    Column("detail", JSONDocument),
    Column("actor", String(255)),
    Column("reason", Text),
    CheckConstraint(_one_of("outcome", ATTEMPT_OUTCOMES), name="outcome"),
    # Also what makes a re-sent outcome batch harmless: history is inserted ON CONFLICT DO NOTHING.
    Index("ux_outbox_attempt_once", "message_id", "attempt", "outcome", "started_at", unique=True),
    Index("ix_outbox_attempt_started_at", "started_at"),
    sqlite_autoincrement=True,
)

#: Every purge records itself here: who ran it, with which cutoffs, what it deleted.
#: History rows are the evidence; this is the evidence of their expiry. On PostgreSQL
#: only the purge functions write it (migration outbox_0007): ``db_user`` is the login
#: that really ran the purge, ``actor`` the label it gave.
outbox_retention_run = Table(
    "outbox_retention_run",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    Column("started_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime),
    Column("actor", String(255), nullable=False),
    Column("delivered_before", UTCDateTime, nullable=False),
    Column("history_before", UTCDateTime),
    Column("messages_deleted", Integer, nullable=False, server_default=literal_column("0")),
    Column("attempts_deleted", Integer, nullable=False, server_default=literal_column("0")),
    Column("db_user", String(255)),
    # True when the run also deleted the history of unresolved (pending, running, dead) messages.
    Column("history_of_unresolved", Boolean, nullable=False, server_default=false()),
    #: Inbox markers past their ``kept_until`` that the run deleted (outbox_0020).
    Column("markers_deleted", Integer, nullable=False, server_default=literal_column("0")),
    sqlite_autoincrement=True,
)

#: What relays must not claim now: one row per paused queue or handler (``outbox pause``),
#: deleted by ``outbox resume``. Every claim reads it (a handful of rows, usually none), so
#: a pause takes effect at the next claim of every relay, without a restart.
outbox_pause = Table(
    "outbox_pause",
    metadata,
    Column("kind", String(16), primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("reason", Text, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("paused_at", UTCDateTime, nullable=False),
    CheckConstraint(_one_of("kind", PAUSE_KINDS), name="kind"),
)

#: Every pause and resume, append-only (migration outbox_0010 refuses UPDATE, DELETE and
#: TRUNCATE): who, why, when. ``outbox show`` reads a message's pauses from here, so a big
#: queue held back gets no per-message rows.
outbox_pause_log = Table(
    "outbox_pause_log",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    Column("event", String(16), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("name", String(255), nullable=False),
    Column("at", UTCDateTime, nullable=False),
    Column("actor", String(255), nullable=False),
    Column("reason", Text, nullable=False),
    #: PostgreSQL: the login that paused or resumed, stamped by the database (outbox_0016); else NULL
    Column("db_user", String(255), nullable=True),
    CheckConstraint(_one_of("event", PAUSE_EVENTS), name="event"),
    CheckConstraint(_one_of("kind", PAUSE_KINDS), name="kind"),
    # A queue's or handler's pauses in order: what `outbox show` pairs up.
    Index("ix_outbox_pause_log_kind_name", "kind", "name", "id"),
    sqlite_autoincrement=True,
)

#: One row per relay id, written by that relay (migration outbox_0011): upserted when it
#: starts, refreshed every few seconds, ``stopped_at`` set when it stops cleanly. Never
#: deleted by a relay, so a crashed relay stays visible with the time it was last seen.
#: ``queues`` is ``[]`` for a relay that claims every queue (a relay refuses an empty list);
#: ``handlers`` maps each route to ``{"breakers": {destination: open}, "rate_limit": per_s}``.
outbox_relay_registry = Table(
    "outbox_relay_registry",
    metadata,
    Column("relay_id", String(255), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("seen_at", UTCDateTime, nullable=False),
    Column("stopped_at", UTCDateTime),
    Column("queues", JSONDocument, nullable=False),
    Column("in_flight", Integer, nullable=False, server_default=literal_column("0")),
    Column("handlers", JSONDocument, nullable=False),
)

#: The circuit breakers every relay honours (migration outbox_0019): one row per destination while
#: its breaker is open or half-open, deleted when a trial succeeds or an operator resets it. Open
#: until ``reopen_at``, half-open after it (each relay may send one trial request). ``handler`` is
#: the route whose deliveries opened it, ``opened_by`` that relay's id, ``failures`` the consecutive
#: failures that opened it (plus one per failed trial). On PostgreSQL relays write it only through
#: ``outbox_breaker_open`` and ``outbox_breaker_close``, operators through ``outbox_breaker_reset``.
outbox_breaker = Table(
    "outbox_breaker",
    metadata,
    Column("destination", Text, primary_key=True),
    Column("handler", String(255), nullable=False),
    Column("failures", Integer, nullable=False),
    Column("opened_at", UTCDateTime, nullable=False),
    Column("reopen_at", UTCDateTime, nullable=False),
    Column("opened_by", String(255), nullable=False),
    #: the last change (open or reopen): a relay tells a breaker reopened since it looked by this
    Column("updated_at", UTCDateTime, nullable=False),
    CheckConstraint("failures >= 1", name="failures"),
)

#: Every opening, closing and reset of a shared breaker, append-only (migration outbox_0019 refuses
#: UPDATE, DELETE and TRUNCATE): which relay or operator, why, when, and on PostgreSQL the login.
#: A breaker that a failed trial reopens is still the same opening: one row per outage, not per
#: cool-down.
outbox_breaker_log = Table(
    "outbox_breaker_log",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    Column("event", String(16), nullable=False),
    Column("destination", Text, nullable=False),
    Column("handler", String(255), nullable=False),
    Column("at", UTCDateTime, nullable=False),
    Column("relay_id", String(255)),  # opened, closed
    Column("actor", String(255)),  # reset, retried_now
    Column("reason", Text),  # reset, retried_now
    Column("failures", Integer),  # opened
    #: PostgreSQL: the login that wrote the row, stamped by the database; NULL on SQLite
    Column("db_user", String(255)),
    CheckConstraint(_one_of("event", BREAKER_EVENTS), name="event"),
    Index("ix_outbox_breaker_log_destination", "destination", "id"),
    sqlite_autoincrement=True,
)

#: The inbox's markers (migration outbox_0020): one row per message id each consumer (an
#: ``outbox.Inbox``, by its name) has taken, written in the same transaction as the message's
#: effects, so a redelivery finds it and is answered as a duplicate. ``received_at`` is the
#: database's clock (PostgreSQL: the column's default, which the consumer's login cannot set);
#: ``kept_until`` is ``received_at`` plus the inbox's ``keep``, and only a purge (``outbox purge``)
#: deletes a marker, once that time has passed. Markers are never updated.
outbox_inbox = Table(
    "outbox_inbox",
    metadata,
    Column("consumer", String(255), primary_key=True),
    Column("message_id", String(255), primary_key=True),
    Column("received_at", UTCDateTime, nullable=False, server_default=func.now()),
    Column("kept_until", UTCDateTime, nullable=False),
    Column("event_type", String(255)),
    #: Where it came from, as the source names it: ``rabbitmq:orders``, ``kafka:orders/3``, ...
    Column("source", String(255)),
    Column("outcome", String(16), nullable=False),
    CheckConstraint(_one_of("outcome", INBOX_OUTCOMES), name="outcome"),
    CheckConstraint("kept_until > received_at", name="kept_until"),
    # Retention: the purge deletes markers whose kept_until has passed, oldest first.
    Index("ix_outbox_inbox_kept_until", "kept_until"),
)

#: Where a partitioned log's consumer (Kafka) is, per consumer, topic and partition: the offset
#: of the next record to read, written in the same transaction as the effects of the record
#: before it, and read when a partition is assigned. Never moves backwards.
outbox_inbox_offset = Table(
    "outbox_inbox_offset",
    metadata,
    Column("consumer", String(255), primary_key=True),
    Column("topic", String(255), primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False, server_default=func.now()),
    CheckConstraint("partition >= 0", name="partition"),
    CheckConstraint("next_offset >= 0", name="next_offset"),
)

#: An inbox's dead letters: messages it could not take and will not retry on its own (a handler
#: failed ``Inbox(max_failures=...)`` times or raised ``PermanentError``, no handler matched, or it
#: came too late: ``error_type`` says which). Written together with the message's marker (outcome
#: ``dead``), so redeliveries of it are duplicates, and before the source is acknowledged.
#: ``attempts`` is how many times a handler ran it (0: never). One row per consumer and message id.
#: An operator requeues it (``requeued``: ``requeued_at``, ``actor``, ``reason``, ``db_user``), and its
#: consumer then marks it ``handled`` (``handled_at``) or ``dead`` again (the new error, one more
#: attempt, a new ``dead_at``); its marker keeps saying ``dead`` (markers are never changed).
outbox_inbox_dead = Table(
    "outbox_inbox_dead",
    metadata,
    Column("id", RowId, Identity(), primary_key=True),
    Column("consumer", String(255), nullable=False),
    Column("message_id", String(255), nullable=False),
    Column("event_type", String(255), nullable=False),
    Column("source", String(255)),
    Column("payload", JSONDocument, nullable=False),
    Column("headers", JSONDocument, nullable=False),
    Column("sent_at", UTCDateTime),
    Column("attempts", Integer, nullable=False),
    Column("error_type", String(255), nullable=False),
    Column("error", Text, nullable=False),
    Column("dead_at", UTCDateTime, nullable=False, server_default=func.now()),
    Column("status", String(16), nullable=False, server_default=literal_column("'dead'")),
    Column("requeued_at", UTCDateTime),
    Column("actor", String(255)),
    Column("reason", Text),
    Column("handled_at", UTCDateTime),
    # The login that requeued it (PostgreSQL, written by the database; migration outbox_0022).
    Column("db_user", String(255)),
    CheckConstraint(_one_of("status", INBOX_DEAD_STATUSES), name="status"),
    CheckConstraint("attempts >= 0", name="attempts"),
    # Also the consumer's index: dead letters are few, and every query names the consumer.
    UniqueConstraint("consumer", "message_id"),
    sqlite_autoincrement=True,
)
