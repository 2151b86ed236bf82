"""Operations: stats, list, show, requeue, resend, discard, retry-now, pause and resume, retention,
relays, circuit breakers, the inbox's dead letters (and requeueing them), dashboard reads.

The ``outbox`` command and any dashboard call these. Every action that changes
what will happen to a message appends a history row naming the actor and the
reason; a dead or delivered message is never edited (requeue and resend make a
new message that points back at it), so the audit trail stays complete.
"""

from __future__ import annotations

from ._actions import discard, requeue, retry_now
from ._base import InvalidRequest, NotFound, OpsError, parse_duration
from ._breakers import Breaker, BreakerNotOpen, breakers, reset_breaker
from ._dashboard import (
    ACTIVITY_RETRIED,
    MAX_ACTIVITY_MINUTES,
    CappedCount,
    Lineage,
    LineageCopy,
    MinuteActivity,
    QueueHandlerCount,
    activity,
    breakdown,
    count_messages,
    lineage,
)
from ._filters import MessageFilter, candidate_ids, count_candidates, requeue_candidates
from ._inbox import (
    MAX_DEAD_LETTERS,
    InboxDeadLetter,
    count_inbox_dead_letters,
    inbox_dead_letter,
    inbox_dead_letters,
)
from ._inbox_actions import requeue_inbox_dead_letter, requeue_inbox_dead_letters
from ._keys import ROOT_KEY_LIMIT, requeued_key, resent_key, root_key
from ._live import change_marker
from ._pause import NotPaused, Pause, PauseResult, PauseSpan, pause, paused, resume
from ._purge import MAX_PURGE_BATCH, MIN_HISTORY_AGE, PurgeResult, purge
from ._read import MessageHistory, Stats, list_messages, login_apart, show, stats
from ._relays import REGISTRY_PERIOD, HandlerSeen, RelaySeen, relays
from ._reports import (
    MAX_REPORT_RUNS,
    DeadChunk,
    ReportChunk,
    ReportRunDetail,
    ReportRunView,
    report_handler,
    report_run,
    report_runs,
)
from ._resend import resend
from ._tail import HistoryEntry, HistoryFilter, follow_history
from ._where import PayloadEquals, WhereError, parse_where

__all__ = [
    "ACTIVITY_RETRIED",
    "MAX_DEAD_LETTERS",
    "MAX_ACTIVITY_MINUTES",
    "MAX_PURGE_BATCH",
    "MAX_REPORT_RUNS",
    "MIN_HISTORY_AGE",
    "REGISTRY_PERIOD",
    "ROOT_KEY_LIMIT",
    "HandlerSeen",
    "Breaker",
    "BreakerNotOpen",
    "CappedCount",
    "DeadChunk",
    "HistoryEntry",
    "HistoryFilter",
    "InboxDeadLetter",
    "Lineage",
    "LineageCopy",
    "MessageFilter",
    "MessageHistory",
    "MinuteActivity",
    "InvalidRequest",
    "NotFound",
    "NotPaused",
    "OpsError",
    "Pause",
    "PauseResult",
    "PauseSpan",
    "PayloadEquals",
    "PurgeResult",
    "RelaySeen",
    "QueueHandlerCount",
    "ReportChunk",
    "ReportRunDetail",
    "ReportRunView",
    "Stats",
    "WhereError",
    "activity",
    "breakdown",
    "breakers",
    "candidate_ids",
    "change_marker",
    "count_candidates",
    "count_inbox_dead_letters",
    "count_messages",
    "discard",
    "follow_history",
    "inbox_dead_letter",
    "inbox_dead_letters",
    "lineage",
    "list_messages",
    "login_apart",
    "parse_duration",
    "parse_where",
    "pause",
    "paused",
    "purge",
    "relays",
    "report_handler",
    "report_run",
    "report_runs",
    "requeue",
    "requeue_candidates",
    "requeue_inbox_dead_letter",
    "requeue_inbox_dead_letters",
    "requeued_key",
    "resend",
    "reset_breaker",
    "resent_key",
    "resume",
    "retry_now",
    "root_key",
    "show",
    "stats",
]
