"""The ``outbox`` command: migrations, audit, dead letters and live history for the outbox tables.

Exit codes: 0 success, 1 the operation failed (database unreachable, migration
error, unknown id, refused action, or the reader of stdout went away, as in
``outbox stats | head -1``, which ends quietly), 2 bad usage (a flag's value is
checked when parsed: ids and counts up to BIGINT, text valid UTF-8, times
representable in UTC), 130 interrupted (Ctrl-C).
User mistakes get one line on stderr, never a traceback. Every subcommand takes
``--database-url`` (or ``OUTBOX_DATABASE_URL``).

Bulk ``requeue``, ``discard`` and ``retry-now`` by filter ask for confirmation (``--yes``
skips the question; without a terminal they refuse, exit 1). When the filter
matches nothing they say so and exit 0 without asking: an empty dead-letter
queue is not an error for a script. Answering anything but ``y``, or Ctrl-D
(end of input) at the question, does nothing and exits 0.

``tail`` runs until Ctrl-C (exit 0) or ``--count`` rows.

``pause`` of something paused already changes nothing and exits 0 (it says
so); ``resume`` of something not paused exits 1, so a mistyped name is never
taken for a resume. Pausing a queue or handler no message has used yet works,
with a warning on stderr.

``--actor`` defaults to the login name; when the system cannot name the user
(a container running as a uid with no passwd entry), to ``uid:<number>``.
"""

from __future__ import annotations

import argparse
import functools
import getpass
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from . import ops
from ._argparse import OneLineParser
from ._exceptions import ConfigurationError
from ._migrations import BRANCH, missing_outbox_table, upgrade
from ._payload import text_problem
from ._tables import ATTEMPT_OUTCOMES
from ._urls import check_url, sync_engine

__all__ = ["main"]

ENV_DATABASE_URL = "OUTBOX_DATABASE_URL"
PROG = "outbox"


class _Failed(Exception):
    """An operation failed in a way the user should read as one line (exit 1)."""


#: The largest id an outbox table can hold (BIGINT); larger numbers are refused before any query.
MAX_ID = 2**63 - 1


def _text(value: str) -> str:
    """Text as given on the command line; bytes that are not UTF-8 are refused here, not by the driver."""
    problem = text_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(
            f"{_shown(value)} " + ("is not valid UTF-8 text" if "surrogate" in problem else problem)
        )
    return value


def _timestamp(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO date or time (2026-12-01T10:00), got {_shown(value)}"
        ) from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    try:  # stored times are UTC: 0001-01-01T00:00+01:00 has no UTC equivalent
        return parsed.astimezone(UTC)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{value!r} is out of range once converted to UTC") from None


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


def _login_name() -> str:
    """Who runs the command, for the audit trail; never fails."""
    try:
        return getpass.getuser()
    except Exception:  # KeyError or OSError: no USER/LOGNAME and no passwd entry for the uid
        getuid = getattr(os, "getuid", None)
        return f"uid:{getuid()}" if getuid is not None else "unknown"


def _shown(value: str) -> str:
    """A command-line value quoted for an error line: cut short, bytes that are not UTF-8 as ``\\xff``."""
    try:  # argv bytes that are not UTF-8 arrive as lone surrogates: show the bytes themselves
        raw = value[:40].encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = value[:40].encode("utf-8", "backslashreplace")
    return f"'{raw.decode('utf-8', 'backslashreplace')}'" + ("..." if len(value) > 40 else "")


def _whole(value: str, expected: str) -> int:
    digits = value.strip().lstrip("+-")
    if len(digits) > len(str(MAX_ID)):  # before int(): 5,000 digits would hit Python's own limit
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ID}, got {_shown(value)}")
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {_shown(value)}") from None
    if number > MAX_ID:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_ID}, got {_shown(value)}")
    return number


def _message_id(value: str) -> int:
    number = _whole(value, "message ids are integers")
    if number < 1:
        raise argparse.ArgumentTypeError(f"message ids are positive, got {value!r}")
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
        raise argparse.ArgumentTypeError(f"expected seconds from 0.01 to 3600, got {_shown(value)}")
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


def _filter(args: argparse.Namespace, ids: Sequence[int] = ()) -> ops.MessageFilter:
    return ops.MessageFilter(
        status=args.status,
        handler=args.handler,
        event_type=args.event_type,
        queue=args.queue,
        key=args.key,
        group_key=args.group_key,
        created_since=args.since,
        created_before=args.before,
        ids=tuple(ids),
        payload=tuple(args.where),
    )


def _parser() -> argparse.ArgumentParser:
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
    listing.add_argument("--limit", type=_count, default=50, help="page size (default: 50)")
    listing.add_argument("--before-id", type=_message_id, help="next page: the last id of the previous one")
    listing.add_argument("--json", action="store_true")

    show = commands.add_parser("show", help="one message and its full attempt history")
    _add_database(show)
    show.add_argument("id", type=_message_id)
    show.add_argument("--json", action="store_true")

    for name, verb in (
        ("requeue", "give dead or discarded messages a fresh start"),
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

    purge = commands.add_parser("purge", help="retention: delete old finished messages and old history")
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
    return parser


def _database_url(parser: argparse.ArgumentParser, value: str | None) -> str:
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


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str, sort_keys=True))


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[("" if v is None else str(v)).replace("\n", " ")[:60] for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _cmd_stats(engine: Engine, args: argparse.Namespace) -> int:
    result = ops.stats(engine)
    if args.json:
        _print_json(result.as_dict())
        return 0
    print(
        "messages by status: "
        + (", ".join(f"{k} {v}" for k, v in sorted(result.by_status.items())) or "none")
    )
    rows = [
        [handler, *(counts.get(s, 0) for s in ("pending", "running", "delivered", "dead", "discarded"))]
        for handler, counts in sorted(result.by_handler_status.items())
    ]
    if rows:
        _table(rows, ["handler", "pending", "running", "delivered", "dead", "discarded"])
    for queue, age in sorted(result.oldest_pending_age_s.items()):
        print(f"oldest due message in queue {queue}: {age:.1f}s")
    # Counted from created_at: a message stuck in retries shows here, not above.
    for queue, age in sorted(result.oldest_unfinished_age_s.items()):
        print(f"oldest unfinished message in queue {queue}: {age:.1f}s")
    print(f"last hour: {result.delivered_last_hour} delivered, {result.failed_last_hour} failed attempts")
    # Requeued originals stay dead for the record; only the others still need a decision.
    print(f"dead: {result.dead} needing a decision, {result.dead_requeued} requeued")
    for held in result.paused:
        print(
            f"paused: {held.kind} {held.name} since {_when(held.paused_at)} by {held.actor}"
            f" ({_flat(held.reason)}), holding back {held.held_back} pending"
        )
    return 0


def _when(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _flat(text: str) -> str:
    """Free text on one line of output."""
    return " ".join(text.split())


def _cmd_list(engine: Engine, args: argparse.Namespace) -> int:
    rows = ops.list_messages(engine, _filter(args), limit=args.limit, before_id=args.before_id)
    if args.json:
        _print_json([dict(r._mapping) for r in rows])
        return 0
    _table(
        [
            [
                r.id,
                r.status,
                r.handler,
                r.event_type,
                f"{r.attempts}/{r.max_attempts}",
                r.created_at,
                r.last_error,
            ]
            for r in rows
        ],
        ["id", "status", "handler", "event_type", "attempts", "created_at", "last_error"],
    )
    if len(rows) == args.limit:
        print(f"(more: --before-id {rows[-1].id})")
    return 0


def _cmd_show(engine: Engine, args: argparse.Namespace) -> int:
    found = ops.show(engine, args.id)
    if args.json:
        _print_json(
            {
                "message": found.message,
                "attempts": found.attempts,
                "pauses": [span.as_dict() for span in found.pauses],
            }
        )
        return 0
    for key, value in found.message.items():
        print(f"{key:>15}: {json.dumps(value, default=str) if isinstance(value, dict | list) else value}")
    print()
    rows: list[list[Any]] = []
    details: list[tuple[str, str]] = []
    events = _pause_events(found.pauses)
    for h in found.attempts:
        while events and events[0][0] < h["started_at"]:
            rows.append(events.pop(0)[1])
        detail = json.dumps(h["detail"], default=str, ensure_ascii=False) if h["detail"] else ""
        if len(detail) > _DETAIL_WIDTH:  # never cut: the whole document goes below the table
            details.append((f"attempt {h['attempt']} ({h['outcome']})", json.dumps(h["detail"], indent=2)))
            detail = f"(below: {len(detail)} characters)"
        rows.append(
            [
                h["attempt"],
                h["outcome"],
                h["started_at"],
                h["duration_ms"],
                h["relay_id"] or h["actor"],
                h["error"] or h["reason"],
                detail,
            ]
        )
    rows += [row for _, row in events]
    _table(rows, ["attempt", "outcome", "started_at", "ms", "by", "error/reason", "detail"])
    for title, document in details:
        print(f"\ndetail of {title}:\n{document}")
    return 0


#: The widest detail the history table shows inline (the table's cell width).
_DETAIL_WIDTH = 60


def _pause_events(spans: Sequence[ops.PauseSpan]) -> list[tuple[datetime, list[Any]]]:
    """Each pause of the message's queue or handler as table rows: when it began, when it ended."""
    events: list[tuple[datetime, list[Any]]] = []
    for span in spans:
        what = f"{span.kind} {span.name}"
        row = ["-", "paused", span.paused_at, "", span.paused_by, span.pause_reason, what]
        events.append((span.paused_at, row))
        if span.resumed_at is not None:
            row = ["-", "resumed", span.resumed_at, "", span.resumed_by, span.resume_reason, what]
            events.append((span.resumed_at, row))
    return sorted(events, key=lambda event: event[0])


def _confirm(count: int, verb: str, args: argparse.Namespace) -> bool:
    if args.ids or args.yes:
        return True
    if not sys.stdin.isatty():
        raise _Failed(f"{verb} by filter would touch {count} message(s); pass --yes to confirm")
    try:
        answer = input(f"{verb} {count} message(s)? [y/N] ")
    except EOFError:  # Ctrl-D: no answer is no
        print()
        return False
    return answer.strip().lower() in ("y", "yes")


def _print_acted(args: argparse.Namespace, done: Sequence[Any]) -> None:
    if args.command == "retry-now":
        if args.json:
            _print_json({"retried_now": list(done)})
        else:
            print(f"{len(done)} message(s) due now" + (f": {', '.join(map(str, done))}" if done else ""))
    elif args.command == "requeue":
        if args.json:
            _print_json([{"old_id": old, "new_id": new} for old, new in done])
            return
        for old, new in done:
            print(f"requeued {old} as {new}")
        print(f"{len(done)} message(s) requeued")
    elif args.json:
        _print_json({"discarded": list(done)})
    else:
        print(f"{len(done)} message(s) discarded" + (f": {', '.join(map(str, done))}" if done else ""))


def _cmd_act(engine: Engine, args: argparse.Namespace) -> int:
    where = _filter(args, args.ids)
    actor = args.actor or _login_name()
    if not args.ids:
        if where.empty:
            raise _Failed(f"give message ids or a filter; {args.command} never acts on everything")
        include_delayed = getattr(args, "include_delayed", False)
        count = ops.count_candidates(engine, where, args.command, include_delayed=include_delayed)
        if count == 0 and not args.yes:
            # Nothing to confirm; acting anyway could touch rows that matched since the count.
            if args.json:
                _print_acted(args, [])
            else:
                print(f"no message matched the filter; nothing to {args.command}")
            return 0
        if not _confirm(count, args.command, args):
            print("nothing done")
            return 0
    if args.command == "retry-now":
        acted = ops.retry_now(
            engine, where, reason=args.reason, actor=actor, include_delayed=args.include_delayed
        )
        _print_acted(args, acted)
    elif args.command == "requeue":
        _print_acted(args, ops.requeue(engine, where, reason=args.reason, actor=actor))
    else:
        _print_acted(args, ops.discard(engine, where, reason=args.reason, actor=actor))
    return 0


def _tail_line(entry: ops.HistoryEntry) -> str:
    """One history row on one line: when, which message and route, what happened, and why."""
    said = (entry.error if entry.error_type is None else f"{entry.error_type}: {entry.error or ''}") or ""
    if entry.actor is not None:  # an operator's action
        said = f"by {entry.actor}: {entry.reason or ''}"
    first_line = said.strip().splitlines()[0] if said.strip() else ""
    fields = [
        entry.time.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        f"#{entry.message_id}",
        entry.handler or "-",
        entry.event_type or "-",
        f"attempt {entry.attempt}",
        entry.outcome,
        "-" if entry.duration_ms is None else f"{entry.duration_ms}ms",
        first_line[:300],
    ]
    return "  ".join(fields).rstrip()


def _cmd_tail(engine: Engine, args: argparse.Namespace) -> int:
    where = ops.HistoryFilter(
        handler=args.handler,
        event_type=args.event_type,
        queue=args.queue,
        outcomes=tuple(args.outcome),
        message_id=args.message_id,
    )
    shown = make_url(args.database_url).render_as_string(hide_password=True)

    def ready() -> None:  # on stderr, so stdout stays rows only; scripts and tests wait for it
        print(f"{PROG} tail: following the history of {shown} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    rows = ops.follow_history(
        engine, where, since=args.since, last=args.last or 0, interval=args.interval, ready=ready
    )
    printed = 0
    dumps = functools.partial(json.dumps, default=str, sort_keys=True)
    try:
        for entry in rows:
            print(dumps(entry.as_dict()) if args.json else _tail_line(entry))
            sys.stdout.flush()  # a reader at the other end of a pipe sees each row as it happens
            printed += 1
            if args.count is not None and printed >= args.count:
                break
    except KeyboardInterrupt:  # how a follow normally ends
        pass
    return 0


def _cmd_pause(engine: Engine, args: argparse.Namespace) -> int:
    actor = args.actor or _login_name()
    if args.command == "resume":
        lifted = ops.resume(engine, queue=args.queue, handler=args.handler, reason=args.reason, actor=actor)
        if args.json:
            _print_json({"resumed": lifted.as_dict()})
        else:
            print(
                f"resumed {lifted.kind} {lifted.name}"
                f" (paused since {_when(lifted.paused_at)} by {lifted.actor});"
                f" {lifted.held_back} pending message(s) may be claimed again"
            )
        return 0
    done = ops.pause(engine, queue=args.queue, handler=args.handler, reason=args.reason, actor=actor)
    held = done.pause
    if not done.known:
        print(
            f"{PROG} pause: warning: no message has used {held.kind} {held.name!r} yet;"
            " paused anyway (check the name)",
            file=sys.stderr,
        )
    if args.json:
        _print_json({"paused": held.as_dict(), "changed": done.changed, "known": done.known})
    elif done.changed:
        print(
            f"paused {held.kind} {held.name}: relays stop claiming it at their next claim;"
            f" {held.held_back} pending message(s) held back"
        )
    else:
        print(
            f"{held.kind} {held.name} was already paused since {_when(held.paused_at)} by {held.actor}"
            f" ({_flat(held.reason)}); nothing changed"
        )
    return 0


def _cmd_purge(engine: Engine, args: argparse.Namespace) -> int:
    result = ops.purge(
        engine,
        delivered_older_than=args.delivered_older_than,
        history_older_than=args.history_older_than,
        batch_size=args.batch_size,
        actor=args.actor or _login_name(),
        history_of_unresolved=args.include_unresolved_history,
    )
    if args.json:
        _print_json({"messages": result.messages, "attempts": result.attempts, "batches": result.batches})
    else:
        print(f"purged {result.messages} message(s) and {result.attempts} history row(s)")
    return 0


_COMMANDS: dict[str, Callable[[Engine, argparse.Namespace], int]] = {
    "stats": _cmd_stats,
    "list": _cmd_list,
    "show": _cmd_show,
    "requeue": _cmd_act,
    "discard": _cmd_act,
    "retry-now": _cmd_act,
    "tail": _cmd_tail,
    "pause": _cmd_pause,
    "resume": _cmd_pause,
    "purge": _cmd_purge,
}


def _one_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    url = _database_url(parser, args.database_url)
    shown = make_url(url).render_as_string(hide_password=True)
    if args.command == "migrate":
        try:
            applied = upgrade(url, args.revision)
        except SQLAlchemyError as error:
            print(f"{PROG} migrate: cannot migrate {shown}: {_one_line(error)}", file=sys.stderr)
            return 1
        except Exception as error:  # alembic's CommandError and friends: one line, no traceback
            print(f"{PROG} migrate: {error}", file=sys.stderr)
            return 1
        if applied:
            print(f"{PROG} migrate: applied {', '.join(applied)} to {shown}")
        else:
            print(f"{PROG} migrate: {shown} was already at {args.revision}; nothing to apply")
        return 0
    try:
        engine = sync_engine(url)
    except ConfigurationError as error:
        print(f"{PROG} {args.command}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        print(f"{PROG} {args.command}: cannot use {shown}: {_one_line(error)}", file=sys.stderr)
        return 2
    try:
        code = _COMMANDS[args.command](engine, args)
        sys.stdout.flush()  # here, so a closed pipe is handled below and not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`outbox stats | head -1`): stop quietly, as the Python docs
        # recommend; stdout goes to devnull so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ops.OpsError, _Failed) as error:
        print(f"{PROG} {args.command}: {error}", file=sys.stderr)
        return 1
    except SQLAlchemyError as error:
        missing = missing_outbox_table(error)
        if missing is not None:
            print(
                f"{PROG} {args.command}: the outbox tables are missing in {shown} (no {missing}):"
                " run `outbox migrate --database-url ...` first",
                file=sys.stderr,
            )
            return 1
        print(f"{PROG} {args.command}: database error on {shown}: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Every change is its own committed transaction (a purge batch included), so what
        # finished is recorded and the rest did not happen.
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        engine.dispose()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
