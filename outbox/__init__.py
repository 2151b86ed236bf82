"""sqlalchemy-outbox: a transactional outbox for SQLAlchemy 2.x.

Events emitted in a transaction are stored if and only if it commits; a relay
process (``outbox.relay``) delivers them afterwards, with retries, dead letters
and an append-only audit of every attempt.
"""

from . import signals
from ._backoff import Backoff
from ._exceptions import (
    AckFailed,
    ConfigurationError,
    EmitError,
    HandlerFailed,
    InboxError,
    InvalidEmitOption,
    InvalidInboxMessage,
    MessageTooOld,
    NoInboxHandler,
    NotInstalled,
    OutboxError,
    PayloadError,
    PermanentError,
    RetryLater,
    UnroutedEvent,
)
from ._inbox.handlers import InboxHandler
from ._inbox.inbox import Inbox
from ._inbox.message import InboxMessage, Processed
from ._inbox.source import InboxSource, SourceContext
from ._json import json_default
from ._message import Handler, Message
from ._migrations import VERSION_TABLE, downgrade, include_name, include_object, upgrade
from ._outbox import Outbox
from ._routes import Route
from ._sqlite import enable_sqlite_savepoints
from ._tables import (
    ATTEMPT_OUTCOMES,
    INBOX_DEAD_STATUSES,
    INBOX_OUTCOMES,
    MESSAGE_STATUSES,
    metadata,
    outbox_attempt,
    outbox_breaker,
    outbox_breaker_log,
    outbox_inbox,
    outbox_inbox_dead,
    outbox_inbox_offset,
    outbox_message,
    outbox_pause,
    outbox_pause_log,
    outbox_relay_registry,
    outbox_retention_run,
)
from ._write.emit import emit
from ._write.mixin import OutboxMixin

__all__ = [
    "AckFailed",
    "Backoff",
    "ATTEMPT_OUTCOMES",
    "INBOX_DEAD_STATUSES",
    "INBOX_OUTCOMES",
    "MESSAGE_STATUSES",
    "ConfigurationError",
    "EmitError",
    "Handler",
    "HandlerFailed",
    "Inbox",
    "InboxError",
    "InboxHandler",
    "InboxMessage",
    "InboxSource",
    "InvalidEmitOption",
    "InvalidInboxMessage",
    "Message",
    "MessageTooOld",
    "NoInboxHandler",
    "NotInstalled",
    "Outbox",
    "OutboxError",
    "OutboxMixin",
    "PayloadError",
    "PermanentError",
    "Processed",
    "SourceContext",
    "RetryLater",
    "Route",
    "UnroutedEvent",
    "downgrade",
    "emit",
    "enable_sqlite_savepoints",
    "VERSION_TABLE",
    "include_name",
    "include_object",
    "json_default",
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
    "signals",
    "upgrade",
]

__version__ = "0.1.0"
