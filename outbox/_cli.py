"""The ``outbox`` command: database maintenance for the outbox tables.

Exit codes: 0 success, 1 the operation failed (database unreachable, migration
error), 2 bad usage. User mistakes get one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from ._migrations import BRANCH, upgrade

__all__ = ["main"]

ENV_DATABASE_URL = "OUTBOX_DATABASE_URL"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox", description="Maintain the outbox tables.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    migrate = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox tables",
        description="Upgrade the database to the newest outbox schema (Alembic branch 'outbox').",
    )
    migrate.add_argument(
        "--database-url",
        default=os.environ.get(ENV_DATABASE_URL),
        help=f"SQLAlchemy URL of the database (default: ${ENV_DATABASE_URL})",
    )
    migrate.add_argument(
        "--revision",
        default=f"{BRANCH}@head",
        help="target revision (default: %(default)s)",
    )
    return parser


def _database_url(parser: argparse.ArgumentParser, value: str | None) -> str:
    if not value:
        parser.error(f"--database-url is required (or set {ENV_DATABASE_URL})")
    try:
        make_url(value)
    except ArgumentError:
        parser.error(f"--database-url {value!r} is not a SQLAlchemy database URL")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "migrate":
        url = _database_url(parser, args.database_url)
        shown = make_url(url).render_as_string(hide_password=True)
        try:
            upgrade(url, args.revision)
        except SQLAlchemyError as error:
            reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
            print(f"outbox migrate: cannot migrate {shown}: {reason}", file=sys.stderr)
            return 1
        except Exception as error:  # alembic's CommandError and friends: one line, no traceback
            print(f"outbox migrate: {error}", file=sys.stderr)
            return 1
        print(f"outbox migrate: {shown} is at {args.revision}")
        return 0
    parser.error(f"unknown command {args.command!r}")  # argparse refuses first; never returns


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
