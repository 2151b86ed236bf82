"""The ``outbox-consumer`` command: run an inbox's broker sources, with the relay's operational surface.

Every flag has an ``OUTBOX_*`` environment variable (``--app`` reads
``OUTBOX_APP``, ``--database-url`` ``OUTBOX_DATABASE_URL``...).

Exit codes: 0 stopped cleanly, 1 the database could not be reached or the
inbox's tables are missing, 2 bad usage, an ``--app`` that cannot be loaded,
or a source's configuration refused. Mistakes are one line on stderr, never
a traceback.

Signals: the first SIGTERM or SIGINT stops fetching and lets the messages in
hand finish within ``--grace-period``; a second one cancels them (each comes
again, and is then a duplicate if it had committed).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from outbox import ConfigurationError, Inbox
from outbox._argparse import OneLineParser
from outbox._load_app import load_app
from outbox.relay.cli import _env, _number, add_log_flags, add_metrics_flags, require_app_and_database
from outbox.relay.logs import configure

from .metrics import ConsumerMetrics
from .runner import DEFAULT_CONCURRENCY, Consumer, ConsumerUnavailable

__all__ = ["main"]

PROG = "outbox-consumer"


def _parser() -> OneLineParser:
    p = OneLineParser(
        prog=PROG,
        description="Take messages from an inbox's broker sources, each once, through its handlers.",
    )
    p.add_argument(
        "--app",
        default=_env("APP"),
        help="the outbox.Inbox to run, as module:attribute; it runs the sources it consume()s ($OUTBOX_APP)",
    )
    p.add_argument(
        "--database-url", default=_env("DATABASE_URL"), help="SQLAlchemy URL ($OUTBOX_DATABASE_URL)"
    )
    p.add_argument(
        "--concurrency",
        type=_number(int, 1, inclusive=True, high=1000),
        default=_env("CONCURRENCY") or DEFAULT_CONCURRENCY,
        help=f"messages processed at once, and each source's prefetch (default: {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--grace-period",
        type=_number(float, 0, inclusive=True),
        default=_env("GRACE_PERIOD") or 30.0,
        help="seconds the messages in hand get to finish after SIGTERM (default: 30)",
    )
    add_metrics_flags(p)
    add_log_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    require_app_and_database(parser, args)
    configure(args.log_level, args.log_format)
    metrics = None
    try:
        inbox = load_app(args.app, Inbox, "myapp.consumer:inbox")
        if args.metrics_port is not None:
            metrics = ConsumerMetrics()
            port = metrics.serve(args.metrics_host, int(args.metrics_port))
            print(f"{PROG}: metrics on http://{args.metrics_host}:{port}/metrics", file=sys.stderr)
        consumer = Consumer(
            inbox,
            args.database_url,
            concurrency=int(args.concurrency),
            grace_period=float(args.grace_period),
            metrics=metrics,
        )
        consumer.run(install_signal_handlers=True)
    except ConsumerUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        if metrics is not None:
            metrics.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
