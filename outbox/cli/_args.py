"""The ``outbox`` command's arguments: each flag's value is checked when it is parsed, in one line."""

from __future__ import annotations

import argparse
import getpass
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .. import ops
from .._argparse import OneLineParser, shown
from .._exceptions import ConfigurationError
from .._migrations import BRANCH
from .._tables import ATTEMPT_OUTCOMES, INBOX_DEAD_STATUSES
from .._urls import check_url
from .._write.payload import text_problem
from ..ops._base import MAX_ID, utc_time
from ._dashboard import add_dashboard

ENV_DATABASE_URL = "OUTBOX_DATABASE_URL"
PROG = "outbox"


class Failed(Exception):
    """An operation failed in a way the user should read as one line (exit 1)."""


def _text(value: str) -> str:
    """Text as given on the command line; bytes that are not UTF-8 are refused here, not by the driver."""
    problem = text_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(
            f"{shown(value)} " + ("is not valid UTF-8 text" if "surrogate" in problem else problem)
        )
    return value


def _timestamp(value: str) -> datetime:
    try:
        return utc_time(value)
    except OverflowError:  # stored times are UTC: 0001-01-01T00:00+01:00 has no UTC equivalent
        raise argparse.ArgumentTypeError(f"{value!r} is out of range once converted to UTC") from None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO date or time (2026-12-01T10:00), got {shown(value)}"
        ) from None


def _age(value: str) -> timedelta:
    """A duration that can be subtracted from now (a cutoff before year 1 is a usage error)."""
    try:
        age = ops.parse_duration(value)
        _ = datetime.now(UTC) - age  # the cutoff purge will compute
    except ops.OpsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OverflowError:
        raise argparse.ArgumentTypeError(f"age {value!r} reaches back before year 1") from None
    return age


def _history_age(value: str) -> timedelta:
    """An age for history: at least ops.MIN_HISTORY_AGE, since younger history is never purged."""
    age = _age(value)
    if age < ops.MIN_HISTORY_AGE:
        raise argparse.ArgumentTypeError(
            f"{value!r} is too young: history is kept at least {ops.MIN_HISTORY_AGE.days}d (e.g. 90d)"
        )
    return age


def login_name() -> str:
    """Who runs the command, for the audit trail; never fails."""
    try:
        return getpass.getuser()
    except Exception:  # KeyError or OSError: no USER/LOGNAME and no passwd entry for the uid
        getuid = getattr(os, "getuid", None)
        return f"uid:{getuid()}" if getuid is not None else "unknown"


def _whole(value: str, expected: str) -> int:
    digits = value.strip().lstrip("+-")
    if len(digits) > len(str(MAX_ID)):  # before int(): 5,000 digits would hit Python's own limit
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ID}, got {shown(value)}")
    try:
        if not value.isascii():  # int() takes any script's digits ("٣"); an id is ASCII
            raise ValueError
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {shown(value)}") from None
    if number > MAX_ID:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ID}, got {shown(value)}")
    return number


def _message_id(value: str) -> int:
    number = _whole(value, "message ids are integers")
    if number < 1:
        raise argparse.ArgumentTypeError(f"message ids are positive, got {value!r}")
    return number


def _dead_letter_id(value: str) -> int:
    number = _whole(value, "dead letter ids are integers (the id column of `outbox inbox dead`)")
    if number < 1:
        raise argparse.ArgumentTypeError(f"dead letter ids are positive, got {value!r}")
    return number


def _count(value: str) -> int:
    number = _whole(value, "expected a whole number")
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value!r}")
    return number


def _batch_size(value: str) -> int:
    number = _count(value)
    if number > ops.MAX_PURGE_BATCH:
        raise argparse.ArgumentTypeError(f"at most {ops.MAX_PURGE_BATCH}, got {value!r}")
    return number


def _limit(value: str) -> int:
    number = _count(value)
    if number > ops.MAX_DEAD_LETTERS:
        raise argparse.ArgumentTypeError(f"at most {ops.MAX_DEAD_LETTERS}, got {value!r}")
    return number


def _where(value: str) -> ops.PayloadEquals:
    try:
        return ops.parse_where(_text(value))
    except ops.WhereError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0.01 <= seconds <= 3600:  # nan fails too
        raise argparse.ArgumentTypeError(f"expected seconds from 0.01 to 3600, got {shown(value)}")
    return seconds


def _add_database(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        default=os.environ.get(ENV_DATABASE_URL),
        help=f"SQLAlchemy URL of the database (default: ${ENV_DATABASE_URL})",
    )


def _add_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--status", choices=("pending", "running", "delivered", "dead", "discarded"))
    p.add_argument("--handler", type=_text, help="route name")
    p.add_argument("--event-type", type=_text)
    p.add_argument("--queue", type=_text)
    p.add_argument("--key", type=_text, help="idempotency key")
    p.add_argument("--group-key", type=_text)
    p.add_argument("--aggregate-type", type=_text, help="e.g. Order (the emitting model's type)")
    p.add_argument("--aggregate-id", type=_text, help="the emitting row's primary key, as text")
    p.add_argument("--since", type=_timestamp, help="created at or after (ISO time, UTC if no zone)")
    p.add_argument("--before", type=_timestamp, help="created before (ISO time, UTC if no zone)")
    p.add_argument(
        "--where",
        type=_where,
        action="append",
        default=[],
        metavar="payload.PATH=VALUE",
        help="payload value equals VALUE (JSON scalar, else text); repeatable, all must hold",
    )


def message_filter(args: argparse.Namespace, ids: Sequence[int] = ()) -> ops.MessageFilter:
    return ops.MessageFilter(
        needs_decision=getattr(args, "needs_decision", False),  # only `list` has the flag
        status=args.status,
        handler=args.handler,
        event_type=args.event_type,
        queue=args.queue,
        key=args.key,
        group_key=args.group_key,
        aggregate_type=args.aggregate_type,
        aggregate_id=args.aggregate_id,
        created_since=args.since,
        created_before=args.before,
        ids=tuple(ids),
        payload=tuple(args.where),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Maintain and audit the outbox tables.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables",
        description="Upgrade the database to the newest outbox schema (Alembic branch 'outbox').",
    )
    _add_database(migrate)
    migrate.add_argument(
        "--revision", type=_text, default=f"{BRANCH}@head", help="target revision (default: %(default)s)"
    )

    stats = commands.add_parser("stats", help="counts by status and handler, oldest pending age, last hour")
    _add_database(stats)
    stats.add_argument("--json", action="store_true", help="machine-readable output")

    listing = commands.add_parser("list", help="messages, newest first, filtered and paginated")
    _add_database(listing)
    _add_filters(listing)
    listing.add_argument(
        "--needs-decision",
        action="store_true",
        help="dead messages nobody has requeued yet (the dead that `outbox stats` counts)",
    )
    listing.set_defaults(command_parser=listing)  # check_list_args: its usage errors name `outbox list`
    listing.add_argument("--limit", type=_count, default=50, help="page size (default: 50)")
    listing.add_argument("--before-id", type=_message_id, help="next page: the last id of the previous one")
    listing.add_argument("--json", action="store_true")

    show = commands.add_parser("show", help="one message and its full attempt history")
    _add_database(show)
    show.add_argument("id", type=_message_id)
    show.add_argument("--json", action="store_true")

    for name, verb in (
        ("requeue", "give dead or discarded messages a fresh start"),
        ("resend", "deliver delivered or discarded messages again, as new copies"),
        ("discard", "drop messages"),
        ("retry-now", "make pending messages that wait out a backoff due now"),
    ):
        sub = commands.add_parser(
            name, help=verb, description=f"{verb[0].upper()}{verb[1:]}, with an audit record."
        )
        _add_database(sub)
        sub.add_argument("ids", nargs="*", type=_message_id, metavar="ID")
        _add_filters(sub)
        sub.add_argument("--reason", type=_text, required=True, help="why: recorded in the message's history")
        sub.add_argument("--actor", type=_text, default=None, help="who (default: the login name)")
        sub.add_argument("--yes", action="store_true", help="act on a filter without asking")
        sub.add_argument("--json", action="store_true")
        if name == "retry-now":
            sub.add_argument(
                "--include-delayed",
                action="store_true",
                help="also messages emitted with a delay and never attempted",
            )

    tail = commands.add_parser(
        "tail",
        help="follow deliveries and failures as they are recorded",
        description="Print each new history row (outbox_attempt) as it is written, until Ctrl-C.",
    )
    _add_database(tail)
    tail.add_argument("--handler", type=_text, help="route name")
    tail.add_argument("--event-type", type=_text)
    tail.add_argument("--queue", type=_text)
    tail.add_argument("--outcome", action="append", default=[], choices=ATTEMPT_OUTCOMES, help="repeatable")
    tail.add_argument("--message-id", type=_message_id, help="one message's history")
    start = tail.add_mutually_exclusive_group()
    start.add_argument("--since", type=_timestamp, help="start with attempts started at or after (ISO time)")
    start.add_argument("--last", type=_count, metavar="N", help="start with the N newest rows")
    tail.add_argument("--count", type=_count, metavar="N", help="stop after N rows")
    tail.add_argument(
        "--interval", type=_interval, default=0.5, metavar="SECONDS", help="poll interval (default: 0.5)"
    )
    tail.add_argument("--json", action="store_true", help="one JSON object per line")

    for name, verb, effect in (
        ("pause", "stop relays claiming a queue's or a handler's messages", "until `outbox resume`"),
        ("resume", "let relays claim a paused queue's or handler's messages again", "at once"),
    ):
        sub = commands.add_parser(
            name,
            help=verb,
            description=f"{verb[0].upper()}{verb[1:]} {effect}; recorded with actor and reason.",
        )
        _add_database(sub)
        target = sub.add_mutually_exclusive_group(required=True)
        target.add_argument("--queue", type=_text)
        target.add_argument("--handler", type=_text, help="route name")
        sub.add_argument("--reason", type=_text, required=True, help="why: recorded in outbox_pause_log")
        sub.add_argument("--actor", type=_text, default=None, help="who (default: the login name)")
        sub.add_argument("--json", action="store_true")

    breaker = commands.add_parser(
        "breaker",
        help="circuit breakers every relay shares: list them, reset one",
        description="Circuit breakers the relays share through the database (outbox_breaker).",
    )
    verbs = breaker.add_subparsers(dest="breaker_command", required=True, metavar="VERB")
    listed = verbs.add_parser("list", help="open and half-open breakers, oldest first")
    _add_database(listed)
    listed.add_argument("--json", action="store_true")
    reset = verbs.add_parser(
        "reset",
        help="close a destination's breaker for every relay",
        description="Close a destination's breaker for every relay, recorded with actor and reason.",
    )
    _add_database(reset)
    reset.add_argument("destination", type=_text, metavar="DEST", help="host:port, as `list` shows it")
    reset.add_argument("--reason", type=_text, required=True, help="why: recorded in outbox_breaker_log")
    reset.add_argument("--actor", type=_text, default=None, help="who (default: the login name)")
    reset.add_argument("--json", action="store_true")

    inbox = commands.add_parser(
        "inbox",
        help="the inbox's dead letters: messages a consumer gave up on",
        description="The inbox's dead letters (outbox_inbox_dead), newest first.",
    )
    inbox_verbs = inbox.add_subparsers(dest="inbox_command", required=True, metavar="VERB")
    dead = inbox_verbs.add_parser("dead", help="dead letters, newest first")
    _add_database(dead)
    dead.add_argument("--consumer", type=_text, help="one inbox's name (default: every consumer)")
    dead.add_argument(
        "--status",
        choices=(*INBOX_DEAD_STATUSES, "any"),
        default="dead",
        help="dead (default: waiting for a decision), requeued (waiting for the consumer), handled, any",
    )
    dead.add_argument(
        "--limit", type=_limit, default=50, help="at most this many (default: 50, at most 1000)"
    )
    dead.add_argument("--json", action="store_true", help="with payload and headers")
    requeue = inbox_verbs.add_parser(
        "requeue",
        help="hand dead letters back to their consumer, which runs its handlers on them once more",
        description="Requeue inbox dead letters (status dead -> requeued), recorded with actor and reason;"
        " the consumer's next Inbox.process_requeued takes them up.",
    )
    _add_database(requeue)
    requeue.add_argument("ids", nargs="*", type=_dead_letter_id, metavar="ID", help="dead letter ids")
    requeue.add_argument("--consumer", type=_text, help="instead of ids: every dead one of this inbox")
    requeue.add_argument("--reason", type=_text, required=True, help="why: recorded on each dead letter")
    requeue.add_argument("--actor", type=_text, default=None, help="who (default: the login name)")
    requeue.add_argument(
        "--yes", action="store_true", help="requeue a consumer's dead letters without asking"
    )
    requeue.add_argument("--json", action="store_true")
    requeue.set_defaults(command_parser=requeue)  # check_inbox_args: its usage errors name the verb

    purge = commands.add_parser(
        "purge", help="retention: delete old finished messages, old history and expired inbox markers"
    )
    _add_database(purge)
    purge.add_argument("--delivered-older-than", type=_age, required=True, metavar="AGE", help="e.g. 30d")
    purge.add_argument("--history-older-than", type=_history_age, metavar="AGE", help="e.g. 90d; at least 1d")
    purge.add_argument(
        "--include-unresolved-history",
        action="store_true",
        help="also purge the history of pending, running and dead messages (kept by default)",
    )
    purge.add_argument("--batch-size", type=_batch_size, default=1000, help="1 to 10000 (default: 1000)")
    purge.add_argument(
        "--actor",
        type=_text,
        default=None,
        help="who, recorded in outbox_retention_run (default: the login name)",
    )
    purge.add_argument("--json", action="store_true")
    add_dashboard(commands, _add_database, _text)
    return parser


def check_list_args(args: argparse.Namespace) -> None:
    """Refuse, before any query, flags that contradict each other: no message could match them."""
    if args.needs_decision and args.status not in (None, "dead"):
        args.command_parser.error(
            f"--needs-decision lists dead messages only; it cannot be combined with --status {args.status}"
        )


def check_inbox_args(args: argparse.Namespace) -> None:
    """``inbox requeue`` acts on named ids or on one consumer's dead letters: both at once contradict."""
    if getattr(args, "inbox_command", None) == "requeue" and args.ids and args.consumer is not None:
        args.command_parser.error("give dead letter ids or --consumer, not both")


def database_url_from(parser: argparse.ArgumentParser, value: str | None) -> str:
    if not value:
        parser.error(f"--database-url is required (or set {ENV_DATABASE_URL})")
    if text_problem(value):
        parser.error("--database-url is not valid UTF-8 text")
    try:
        make_url(value)
    except ArgumentError:
        parser.error(f"--database-url {value!r} is not a SQLAlchemy database URL")
    try:
        check_url(value)
    except ConfigurationError as error:
        parser.error(f"--database-url: {error}")
    return value
