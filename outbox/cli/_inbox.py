"""``outbox inbox``: the inbox's dead letters, listed (``dead``) and handed back (``requeue``)."""

from __future__ import annotations

import argparse

from sqlalchemy.engine import Engine

from .. import ops
from ._args import Failed, login_name
from ._output import confirmed, flat, print_json, table, when

__all__ = ["cmd_inbox"]


def cmd_inbox(engine: Engine, args: argparse.Namespace) -> int:
    if args.inbox_command == "requeue":
        return _requeue(engine, args)
    status = None if args.status == "any" else args.status
    found = ops.inbox_dead_letters(engine, consumer=args.consumer, status=status, limit=args.limit)
    if args.json:
        print_json([letter.as_dict() for letter in found])
    elif not found:
        said = "no dead letter" if status == "dead" else f"no dead letter with status {args.status}"
        print(said + (f" for consumer {args.consumer}" if args.consumer else ""))
    else:
        header = ["id", "consumer", "message id", "event type", "attempts", "dead at", "error type", "error"]
        rows = [
            [
                x.id,
                x.consumer,
                x.message_id,
                x.event_type,
                x.attempts,
                when(x.dead_at),
                x.error_type,
                x.error,
                *([] if status == "dead" else [_status(x)]),
            ]
            for x in found
        ]
        table(rows, header if status == "dead" else [*header, "status"])
    return 0


def _status(letter: ops.InboxDeadLetter) -> str:
    """A dead letter's status with its last requeue: who, when, why."""
    if letter.requeued_at is None:
        return letter.status
    why = flat(letter.reason or "")
    return f"{letter.status} (requeued {when(letter.requeued_at)} by {letter.actor}: {why})"


def _requeue(engine: Engine, args: argparse.Namespace) -> int:
    if not args.ids and args.consumer is None:
        raise Failed("give dead letter ids or --consumer NAME; requeue never acts on everything")
    actor = args.actor or login_name()
    if args.consumer is not None and not args.yes:
        count = ops.count_inbox_dead_letters(engine, consumer=args.consumer)
        if count == 0:  # nothing to confirm; acting anyway could touch dead letters written since
            if args.json:
                print_json({"requeued": []})
            else:
                print(f"consumer {args.consumer} has no dead letter with status dead; nothing to requeue")
            return 0
        question = f"requeue {count} dead letter(s) of consumer {args.consumer}?"
        refusal = (
            f"requeue of consumer {args.consumer} would touch {count} dead letter(s); pass --yes to confirm"
        )
        if not confirmed(question, refusal):
            print("nothing done")
            return 0
    done = ops.requeue_inbox_dead_letters(
        engine, args.ids, consumer=args.consumer, reason=args.reason, actor=actor
    )
    if args.json:
        print_json({"requeued": done})
    elif done:
        print(
            f"requeued {len(done)} dead letter(s): {', '.join(map(str, done))};"
            " their consumer's next process_requeued runs its handlers on them once more"
        )
    else:
        print("no dead letter was requeued")
    return 0
