"""What each ``outbox`` subcommand does with its arguments: ``ops`` calls, printed for people or as JSON."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine, make_url

from .. import ops
from ._args import PROG, Failed, login_name, message_filter
from ._dashboard import run_dashboard
from ._inbox import cmd_inbox
from ._output import confirmed, flat, print_json, table, when


def _cmd_stats(engine: Engine, args: argparse.Namespace) -> int:
    result = ops.stats(engine)
    if args.json:
        print_json(result.as_dict())
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
        table(rows, ["handler", "pending", "running", "delivered", "dead", "discarded"])
    for queue, age in sorted(result.oldest_pending_age_s.items()):
        print(f"oldest due message in queue {queue}: {age:.1f}s")
    # Counted from created_at: a message stuck in retries shows here, not above.
    for queue, age in sorted(result.oldest_unfinished_age_s.items()):
        print(f"oldest unfinished message in queue {queue}: {age:.1f}s")
    print(
        f"last hour: {result.delivered_last_hour} delivered, {result.failed_last_hour} failed attempts,"
        f" {result.expired_last_hour} expired"
    )
    # Requeued originals stay dead for the record; only the others still need a decision.
    print(f"dead: {result.dead} needing a decision, {result.dead_requeued} requeued")
    for held in result.paused:
        print(
            f"paused: {held.kind} {held.name} since {when(held.paused_at)} by {held.actor}"
            f" ({flat(held.reason)}), holding back {held.held_back} pending"
        )
    for breaker in result.breakers:
        print(
            f"circuit breaker {breaker.state}: {breaker.destination} (route {breaker.route})"
            f" since {when(breaker.since)}, {breaker.failures} failures, reopens {when(breaker.reopen_at)}"
        )
    for destination, count in sorted(result.parked.items()):
        print(f"parked: {count} pending waiting for {destination} to recover")
    return 0


def _status_of(status: str, requeued_to: int | None) -> str:
    """A requeued original stays dead for the record; the copy's id says it has been dealt with."""
    return status if requeued_to is None else f"{status}, requeued as {requeued_to}"


def _error_of(status: str, last_error: str | None) -> str | None:
    """A delivered message keeps the error of an attempt before the one that delivered it: history."""
    if last_error is not None and status == "delivered":
        return f"earlier error: {last_error}"
    return last_error


def _cmd_list(engine: Engine, args: argparse.Namespace) -> int:
    rows = ops.list_messages(engine, message_filter(args), limit=args.limit, before_id=args.before_id)
    if args.json:
        print_json([dict(r._mapping) for r in rows])
        return 0
    table(
        [
            [
                r.id,
                _status_of(r.status, r.requeued_to),
                r.handler,
                r.event_type,
                f"{r.attempts}/{r.max_attempts}",
                r.created_at,
                _error_of(r.status, r.last_error),
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
        print_json(
            {
                "message": found.message,
                "attempts": found.attempts,
                "pauses": [span.as_dict() for span in found.pauses],
            }
        )
        return 0
    message = {**found.message, "last_error": _error_of(found.message["status"], found.message["last_error"])}
    if message.get("parked_on") and message["status"] == "pending":
        latest = when(message["available_at"])
        print(f"waiting for {message['parked_on']} to recover (due at {latest} at the latest)")
    for key, value in message.items():
        print(f"{key:>15}: {json.dumps(value, default=str) if isinstance(value, dict | list) else value}")
    print()
    rows: list[list[Any]] = []
    details: list[tuple[str, str]] = []
    events = _pause_events(found.pauses)
    for h in found.attempts:
        while events and events[0][0] < h["started_at"]:
            rows.append(events.pop(0)[1])
        reported, login = ops.login_apart(h["detail"])
        detail = json.dumps(reported, default=str, ensure_ascii=False) if reported else ""
        if len(detail) > _DETAIL_WIDTH:  # never cut: the whole document goes below the table
            details.append((f"attempt {h['attempt']} ({h['outcome']})", json.dumps(reported, indent=2)))
            detail = f"(below: {len(detail)} characters)"
        by = h["relay_id"] or h["actor"]
        uncounted = isinstance(reported, dict) and reported.get("counted") is False
        rows.append(
            [
                f"{h['attempt']} not counted" if uncounted else h["attempt"],
                _outcome_label(h["outcome"], uncounted),
                h["started_at"],
                h["duration_ms"],
                f"{by} ({login})" if login is not None and login != by else by,
                h["error"] or h["reason"],
                detail,
            ]
        )
    rows += [row for _, row in events]
    table(rows, ["attempt", "outcome", "started_at", "ms", "by", "error/reason", "detail"])
    for title, document in details:
        print(f"\ndetail of {title}:\n{document}")
    return 0


def _outcome_label(outcome: str, uncounted: bool) -> str:
    """A history row's outcome as ``show`` labels it: what happened to the delivery, in a word or two."""
    if uncounted:
        return "deferred"
    if outcome == "expired":  # the relay discarded it unseen: nothing was sent
        return "expired, not sent"
    return outcome


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
    return confirmed(
        f"{verb} {count} message(s)?",
        f"{verb} by filter would touch {count} message(s); pass --yes to confirm",
    )


def _print_acted(args: argparse.Namespace, done: Sequence[Any]) -> None:
    if args.command == "retry-now":
        if args.json:
            print_json({"retried_now": list(done)})
        else:
            print(f"{len(done)} message(s) due now" + (f": {', '.join(map(str, done))}" if done else ""))
    elif args.command in ("requeue", "resend"):
        if args.json:
            print_json([{"old_id": old, "new_id": new} for old, new in done])
            return
        did = "requeued" if args.command == "requeue" else "resent"
        for old, new in done:
            print(f"{did} {old} as {new}")
        print(f"{len(done)} message(s) {did}")
    elif args.json:
        print_json({"discarded": list(done)})
    else:
        print(f"{len(done)} message(s) discarded" + (f": {', '.join(map(str, done))}" if done else ""))


def _cmd_act(engine: Engine, args: argparse.Namespace) -> int:
    where = message_filter(args, args.ids)
    actor = args.actor or login_name()
    if not args.ids:
        if where.empty:
            raise Failed(f"give message ids or a filter; {args.command} never acts on everything")
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
    elif args.command == "resend":
        _print_acted(args, ops.resend(engine, where, reason=args.reason, actor=actor))
    else:
        _print_acted(args, ops.discard(engine, where, reason=args.reason, actor=actor))
    return 0


def _tail_line(entry: ops.HistoryEntry) -> str:
    """One history row on one line: when, which message and route, what happened, and why."""
    said = (entry.error if entry.error_type is None else f"{entry.error_type}: {entry.error or ''}") or ""
    if entry.actor is not None:  # an operator's action
        said = f"by {entry.actor}: {entry.reason or ''}"
    first_line = said.strip().splitlines()[0] if said.strip() else ""
    copy = _copy_named(entry.outcome, entry.detail)
    if copy is not None:  # requeued or resent: which message carries the delivery on
        first_line = f"{first_line[:280]} (as #{copy})"
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


def _copy_named(outcome: str, detail: Any) -> int | None:
    """The copy a ``requeued`` or ``resent`` history row names (``detail.new_id``), else None."""
    if outcome not in ("requeued", "resent") or not isinstance(detail, dict):
        return None
    new_id = detail.get("new_id")
    return new_id if isinstance(new_id, int) and not isinstance(new_id, bool) else None


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
    actor = args.actor or login_name()
    if args.command == "resume":
        lifted = ops.resume(engine, queue=args.queue, handler=args.handler, reason=args.reason, actor=actor)
        if args.json:
            print_json({"resumed": lifted.as_dict()})
        else:
            print(
                f"resumed {lifted.kind} {lifted.name}"
                f" (paused since {when(lifted.paused_at)} by {lifted.actor});"
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
        print_json({"paused": held.as_dict(), "changed": done.changed, "known": done.known})
    elif done.changed:
        print(
            f"paused {held.kind} {held.name}: relays stop claiming it at their next claim;"
            f" {held.held_back} pending message(s) held back"
        )
    else:
        print(
            f"{held.kind} {held.name} was already paused since {when(held.paused_at)} by {held.actor}"
            f" ({flat(held.reason)}); nothing changed"
        )
    return 0


def _cmd_breaker(engine: Engine, args: argparse.Namespace) -> int:
    if args.breaker_command == "list":
        found = ops.breakers(engine)
        if args.json:
            print_json([breaker.as_dict() for breaker in found])
        elif not found:
            print("no circuit breaker is open")
        else:
            rows = [
                [x.destination, x.route, x.state, when(x.since), x.failures, when(x.reopen_at), x.opened_by]
                for x in found
            ]
            table(
                rows,
                ["destination", "route", "state", "since", "failures", "reopen at", "opened by"],
            )
        return 0
    actor = args.actor or login_name()
    was = ops.reset_breaker(engine, args.destination, reason=args.reason, actor=actor)
    if args.json:
        print_json({"reset": was.as_dict()})
    else:
        print(
            f"reset the circuit breaker for {was.destination} (route {was.route}, {was.state} since"
            f" {when(was.since)} after {was.failures} failures); every relay sends to it again within a"
            f" second. Messages it deferred keep their time: `{PROG} retry-now --handler {was.route}`"
            " sends them now"
        )
    return 0


def _cmd_purge(engine: Engine, args: argparse.Namespace) -> int:
    result = ops.purge(
        engine,
        delivered_older_than=args.delivered_older_than,
        history_older_than=args.history_older_than,
        batch_size=args.batch_size,
        actor=args.actor or login_name(),
        history_of_unresolved=args.include_unresolved_history,
    )
    if args.json:
        print_json(
            {
                "messages": result.messages,
                "attempts": result.attempts,
                "markers": result.markers,
                "batches": result.batches,
            }
        )
    elif result.markers:
        print(
            f"purged {result.messages} message(s), {result.attempts} history row(s)"
            f" and {result.markers} inbox marker(s)"
        )
    else:
        print(f"purged {result.messages} message(s) and {result.attempts} history row(s)")
    return 0


COMMANDS: dict[str, Callable[[Engine, argparse.Namespace], int]] = {
    "stats": _cmd_stats,
    "list": _cmd_list,
    "show": _cmd_show,
    "requeue": _cmd_act,
    "resend": _cmd_act,
    "discard": _cmd_act,
    "retry-now": _cmd_act,
    "tail": _cmd_tail,
    "pause": _cmd_pause,
    "resume": _cmd_pause,
    "purge": _cmd_purge,
    "inbox": cmd_inbox,
    "breaker": _cmd_breaker,
    "dashboard": run_dashboard,
}
