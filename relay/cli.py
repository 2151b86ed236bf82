"""The ``outbox-relay`` command.

Every flag has an ``OUTBOX_*`` environment variable (``--database-url`` reads
``OUTBOX_DATABASE_URL``, ``--queue`` reads a comma-separated ``OUTBOX_QUEUES``).

Exit codes: 0 stopped cleanly (or ``--once`` drained), 1 the database could not
be reached or the tables are missing (or failed during ``--once``), 2 bad usage
or an ``--app`` that cannot be loaded, 130 ``--once`` interrupted by Ctrl-C.
User mistakes get one line on stderr, never a traceback. An ``--app`` whose
import raises names the file and line that raised in that line; with
``--log-level DEBUG`` the whole traceback is logged before it.

Logging: ``--log-level`` sets the root logger; the ``httpx`` and ``httpcore``
loggers (the webhook handler's HTTP client) are kept at WARNING unless it is
DEBUG, since their INFO line per request repeats every delivery the relay logs.

Signals: the first SIGTERM or SIGINT stops claiming and lets in-flight
deliveries finish within ``--grace-period``; a second one cancels them. In a
container, start the relay with ``exec`` so the signal reaches it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from outbox import ConfigurationError, Outbox
from outbox._argparse import OneLineParser, shown
from outbox._first_line import first_line
from outbox._load_app import load_app as load_outbox_app
from outbox._routes import check_name
from outbox._urls import check_url
from outbox._write.payload import text_problem

from .logs import configure
from .metrics import RelayMetrics
from .relay import Relay
from .settings import DEFAULT_CONCURRENCY
from .startup import DatabaseUnavailable

__all__ = ["add_log_flags", "add_metrics_flags", "load_app", "main", "require_app_and_database"]

PROG = "outbox-relay"

log = logging.getLogger("outbox.relay")


def _env(name: str) -> str | None:
    return os.environ.get(f"OUTBOX_{name}") or None


#: Upper bound of whole-number flags: a PostgreSQL integer, far beyond any sane setting.
MAX_COUNT = 2**31 - 1
#: Upper bound of durations in seconds (a year): beyond it asyncio's timers and datetimes overflow.
MAX_SECONDS = 365 * 24 * 3600.0


def _number(
    kind: Callable[[str], Any], low: float, inclusive: bool = False, high: float | None = None
) -> Callable[[str], Any]:
    top = high if high is not None else (MAX_COUNT if kind is int else MAX_SECONDS)
    shown_top = f"{top:.0f}" if float(top).is_integer() else f"{top:g}"

    def parse(value: str) -> Any:
        if len(value.strip()) > 40:  # before int(): 5,000 digits would hit Python's own limit
            raise argparse.ArgumentTypeError(f"must be at most {shown_top}, got {shown(value)}")
        try:
            if not value.isascii():  # int() and float() take any script's digits ("٣")
                raise ValueError
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {shown(value)}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {shown(value)}")
        if number < low or (number == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {low:g}, got {shown(value)}"
            )
        if number > top:
            raise argparse.ArgumentTypeError(f"must be at most {shown_top}, got {shown(value)}")
        return number

    return parse


def _name(what: str) -> Callable[[str], str]:
    """A queue or relay name: the rule route names follow, and valid UTF-8."""

    def parse(value: str) -> str:
        if text_problem(value):
            raise argparse.ArgumentTypeError(f"{shown(value)} is not valid UTF-8 text")
        try:
            return check_name(what, value)
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _text(value: str) -> str:
    if text_problem(value):
        raise argparse.ArgumentTypeError(f"{shown(value)} is not valid UTF-8 text")
    return value


def _queue_limit(value: str) -> tuple[str, int]:
    name, sep, number = value.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected QUEUE=N, got {shown(value)}")
    limit = _number(int, 1, inclusive=True)(number.strip())
    return _name("queue")(name.strip()), int(limit)


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host``, as ``outbox-relay`` and ``outbox-consumer`` take them."""
    p.add_argument(
        "--metrics-port",
        type=_number(int, 0, inclusive=True, high=65535),
        default=_env("METRICS_PORT"),
        help="serve Prometheus /metrics, /healthz and /readyz on this port (needs the metrics extra)",
    )
    p.add_argument(
        "--metrics-host",
        type=_text,
        default=_env("METRICS_HOST") or "127.0.0.1",
        help="address for --metrics-port (default: 127.0.0.1; 0.0.0.0 in a container)",
    )


def add_log_flags(p: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format``, as ``outbox-relay`` and ``outbox-consumer`` take them."""
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=(_env("LOG_LEVEL") or "INFO").upper(),
    )
    p.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT") or "text")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Deliver committed outbox messages to the handlers an Outbox routes them to.",
    )
    p.add_argument(
        "--app", default=_env("APP"), help="the Outbox to serve, as module:attribute ($OUTBOX_APP)"
    )
    p.add_argument(
        "--database-url", default=_env("DATABASE_URL"), help="SQLAlchemy URL ($OUTBOX_DATABASE_URL)"
    )
    queues = _env("QUEUES")
    p.add_argument(
        "--queue",
        action="append",
        type=_name("queue"),
        dest="queues",
        default=None,
        help="serve only this queue; repeat for several (default: every queue; $OUTBOX_QUEUES)",
    )
    p.set_defaults(env_queues=[q.strip() for q in queues.split(",") if q.strip()] if queues else None)
    p.add_argument(
        "--concurrency",
        type=_number(int, 1, inclusive=True),
        default=_env("CONCURRENCY") or DEFAULT_CONCURRENCY,
        help=f"deliveries at once (default: {DEFAULT_CONCURRENCY})",
    )
    limits = _env("QUEUE_CONCURRENCY")
    p.add_argument(
        "--queue-concurrency",
        action="append",
        type=_queue_limit,
        default=None,
        metavar="QUEUE=N",
        help="at most N deliveries of QUEUE at once, within --concurrency; repeatable "
        "(e.g. reports=2, so bulk work never takes every slot; $OUTBOX_QUEUE_CONCURRENCY, comma-separated)",
    )
    p.set_defaults(env_queue_concurrency=limits)
    p.add_argument(
        "--batch-size",
        type=_number(int, 1, inclusive=True),
        default=_env("BATCH_SIZE"),
        help="messages per claim (default: the concurrency)",
    )
    p.add_argument(
        "--poll-interval",
        type=_number(float, 0),
        default=_env("POLL_INTERVAL") or 1.0,
        help="seconds between claims when no wake-up arrives (default: 1)",
    )
    p.add_argument(
        "--lease",
        type=_number(float, 0),
        default=_env("LEASE") or 30.0,
        help="seconds a claim lasts unless renewed; a crashed relay's claims return after it (default: 30)",
    )
    p.add_argument(
        "--grace-period",
        type=_number(float, 0, inclusive=True),
        default=_env("GRACE_PERIOD") or 30.0,
        help="seconds in-flight deliveries get to finish after SIGTERM (default: 30)",
    )
    p.add_argument(
        "--group-policy",
        choices=("block", "skip"),
        default=_env("GROUP_POLICY") or "block",
        help="what a dead message does to the rest of its group (default: block)",
    )
    p.add_argument(
        "--relay-id",
        type=_name("relay_id"),
        default=_env("RELAY_ID"),
        help="name recorded in locks and history",
    )
    p.add_argument(
        "--no-listen",
        action="store_true",
        default=bool(_env("NO_LISTEN")),
        help="poll only, no LISTEN/NOTIFY (for pgbouncer in transaction pooling mode)",
    )
    add_metrics_flags(p)
    p.add_argument("--once", action="store_true", help="deliver what is due now, then exit")
    add_log_flags(p)
    return p


def load_app(spec: str) -> Outbox:
    """Import ``module:attribute`` (the attribute may also be a function returning the Outbox)."""
    return load_outbox_app(spec, Outbox, "myapp.outbox:ob")


def _freeze_startup_heap() -> None:
    """Put what start-up built (modules, the app, its routes) out of the cyclic collector's reach.

    A relay makes and drops millions of short-lived objects, so full
    collections keep coming, and each one walked every object the imports
    left behind (60,000 to 75,000 of them) to find nothing. With a NATS
    publisher that was a tenth of the relay's CPU (bench/RESULTS.md, "The collector frozen at start-up"). No
    ``gc.collect()`` first: it finds nothing at this point and would cost the
    start of every ``--once`` run about 20 ms. Only the command does this: an
    application running ``Relay`` in its own process keeps its collector as it
    set it.
    """
    gc.freeze()


def require_app_and_database(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--app`` and a usable ``--database-url``, or one line and exit 2 (``outbox-consumer`` too)."""
    if not args.app:
        parser.error("--app is required (or set OUTBOX_APP)")
    if not args.database_url:
        parser.error("--database-url is required (or set OUTBOX_DATABASE_URL)")
    if text_problem(args.database_url):
        parser.error("--database-url is not valid UTF-8 text")
    try:
        make_url(args.database_url)
    except ArgumentError:
        parser.error(f"--database-url {args.database_url!r} is not a SQLAlchemy database URL")
    try:
        check_url(args.database_url)
    except ConfigurationError as exc:
        parser.error(f"--database-url: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    require_app_and_database(parser, args)
    if args.queues is None and args.env_queues:
        try:
            args.env_queues = [_name("queue")(q) for q in args.env_queues]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"OUTBOX_QUEUES: {exc}")
    queue_limits = args.queue_concurrency
    if queue_limits is None and args.env_queue_concurrency:
        try:
            queue_limits = [_queue_limit(v) for v in args.env_queue_concurrency.split(",") if v.strip()]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"OUTBOX_QUEUE_CONCURRENCY: {exc}")
    configure(args.log_level, args.log_format)
    metrics = None
    try:
        ob = load_app(args.app)
        if args.metrics_port is not None:
            metrics = RelayMetrics()
            port = metrics.serve(args.metrics_host, int(args.metrics_port))
            logging.getLogger("outbox.relay").info(
                "metrics on http://%s:%d/metrics", args.metrics_host, port, extra={"action": "metrics"}
            )
        relay = Relay(
            ob,
            args.database_url,
            queues=args.queues or args.env_queues,
            concurrency=int(args.concurrency),
            queue_concurrency=dict(queue_limits or ()),
            batch_size=None if args.batch_size is None else int(args.batch_size),
            poll_interval=float(args.poll_interval),
            lease=float(args.lease),
            grace_period=float(args.grace_period),
            listen=not args.no_listen,
            group_policy=args.group_policy,
            relay_id=args.relay_id,
            metrics=metrics,
        )
    except ConfigurationError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        if metrics is not None:
            metrics.close()
        return 2
    _freeze_startup_heap()
    try:
        if args.once:
            result = relay.run_until_idle()
            summary = f"delivered {result.delivered}, retrying {result.retried}, dead {result.dead}"
            if result.expired:
                summary += f", expired {result.expired}"
            if args.log_format == "json":
                # A log collector reading JSON lines must not get one line of prose at the end.
                log.info(
                    summary,
                    extra={
                        "action": "drained",
                        "delivered": result.delivered,
                        "retried": result.retried,
                        "dead": result.dead,
                        "expired": result.expired,
                        "recovered": result.recovered,
                    },
                )
            else:
                print(f"{PROG}: {summary}", file=sys.stderr)
        else:
            relay.run(install_signal_handlers=True)
    except DatabaseUnavailable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except ConfigurationError as exc:  # a handler's outbox_start refused this configuration
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:  # --once: a drain reports database errors instead of retrying
        print(f"{PROG}: database error: {first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # --once only: run() handles SIGINT itself
        print(
            f"{PROG}: interrupted; unfinished messages were handed back (or return when their lease ends)",
            file=sys.stderr,
        )
        return 130
    finally:
        if metrics is not None:
            metrics.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
