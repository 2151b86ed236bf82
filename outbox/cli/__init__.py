"""The ``outbox`` command: migrations, audit, dead letters and live history for the outbox tables.

Exit codes: 0 success, 1 the operation failed (database unreachable, migration
error, unknown id, refused action, or the reader of stdout went away, as in
``outbox stats | head -1``, which ends quietly), 2 bad usage (a flag's value is
checked when parsed: ids and counts up to BIGINT, text valid UTF-8, times
representable in UTC), 130 interrupted (Ctrl-C).
User mistakes get one line on stderr, never a traceback. Every subcommand takes
``--database-url`` (or ``OUTBOX_DATABASE_URL``).

Bulk ``requeue``, ``resend``, ``discard`` and ``retry-now`` by filter ask for
confirmation (``--yes`` skips the question; without a terminal they refuse,
exit 1). When the filter
matches nothing they say so and exit 0 without asking: an empty dead-letter
queue is not an error for a script. Answering anything but ``y``, or Ctrl-D
(end of input) at the question, does nothing and exits 0.

``tail`` runs until Ctrl-C (exit 0) or ``--count`` rows.

``pause`` of something paused already changes nothing and exits 0 (it says
so); ``resume`` of something not paused exits 1, so a mistyped name is never
taken for a resume. Pausing a queue or handler no message has used yet works,
with a warning on stderr.

``breaker reset`` of a destination whose breaker is not open exits 1, naming
those that are, as ``resume`` does.

``inbox requeue`` takes dead letter ids (all or none: an unknown id, or one
whose status is not ``dead``, exits 1 and requeues nothing) or ``--consumer``
(every dead one of that inbox, asked first as a filter is; none is exit 0);
neither is refused (exit 1, as ``requeue`` without ids or a filter), both is
bad usage (exit 2).

``--actor`` defaults to the login name; when the system cannot name the user
(a container running as a uid with no passwd entry), to ``uid:<number>``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from .. import ops
from .._exceptions import ConfigurationError
from .._first_line import first_line
from .._migrations import missing_outbox_table, upgrade
from .._urls import sync_engine
from ._args import PROG, Failed, build_parser, check_inbox_args, check_list_args, database_url_from
from ._commands import COMMANDS
from ._dashboard import check_dashboard_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        check_list_args(args)
    check_inbox_args(args)
    url = database_url_from(parser, args.database_url)
    if args.command == "dashboard":
        check_dashboard_args(parser, args)
    shown = make_url(url).render_as_string(hide_password=True)
    # What errors are prefixed with: the subcommand, and its verb where it has one (`breaker reset`).
    verb = getattr(args, "breaker_command", None) or getattr(args, "inbox_command", None)
    said = " ".join(filter(None, (args.command, verb)))
    if args.command == "migrate":
        try:
            applied = upgrade(url, args.revision)
        except SQLAlchemyError as error:
            print(f"{PROG} migrate: cannot migrate {shown}: {first_line(error)}", file=sys.stderr)
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
        print(f"{PROG} {said}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        print(f"{PROG} {said}: cannot use {shown}: {first_line(error)}", file=sys.stderr)
        return 2
    try:
        code = COMMANDS[args.command](engine, args)
        sys.stdout.flush()  # here, so a closed pipe is handled below and not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`outbox stats | head -1`): stop quietly, as the Python docs
        # recommend; stdout goes to devnull so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ops.OpsError, Failed) as error:
        print(f"{PROG} {said}: {error}", file=sys.stderr)
        return 1
    except SQLAlchemyError as error:
        missing = missing_outbox_table(error)
        if missing is not None:
            print(
                f"{PROG} {said}: the outbox tables are missing in {shown} (no {missing}):"
                " run `outbox migrate --database-url ...` first",
                file=sys.stderr,
            )
            return 1
        print(f"{PROG} {said}: database error on {shown}: {first_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Every change is its own committed transaction (a purge batch included), so what
        # finished is recorded and the rest did not happen.
        print(f"{PROG} {said}: interrupted", file=sys.stderr)
        return 130
    finally:
        engine.dispose()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
