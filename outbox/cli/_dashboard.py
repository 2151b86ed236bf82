"""``outbox dashboard``: serve the web dashboard, on the loopback interface unless it is protected.

The dashboard shows payloads and, with ``--allow-actions``, changes what
will be delivered, so it never listens on a reachable interface by accident:
any other ``--host`` needs ``--auth-token`` (or ``OUTBOX_DASHBOARD_TOKEN``,
which keeps the token out of ``ps``). It answers only the ``Host`` names it
knows (loopback names, its ``--host``, each ``--allowed-host``), so a page
that rebinds its own DNS name to 127.0.0.1 reads nothing; with a token and
no ``--allowed-host`` it answers any name, the token being the defence.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

from sqlalchemy.engine import Engine

from .._hosts import host_name

__all__ = ["ENV_ALLOWED_HOSTS", "ENV_TOKEN", "add_dashboard", "check_dashboard_args", "run_dashboard"]

ENV_TOKEN = "OUTBOX_DASHBOARD_TOKEN"
ENV_ALLOWED_HOSTS = "OUTBOX_DASHBOARD_ALLOWED_HOSTS"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")


def _port(value: str) -> int:
    # ASCII digits only: isdigit() also takes "²", which int() refuses (argparse: "invalid _port value").
    if not (value.isascii() and value.isdigit()) or len(value) > 5 or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0 to 65535, got {value[:40]!r}")
    return int(value)


def _allowed_host(value: str) -> str:
    try:
        return host_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_dashboard(commands: Any, add_database: Any, text: Any) -> None:
    sub = commands.add_parser(
        "dashboard",
        help="serve the web dashboard (extra [dashboard])",
        description="Serve the outbox dashboard: overview, messages, dead letters, queues, reports.",
    )
    add_database(sub)
    sub.add_argument("--host", type=text, default="127.0.0.1", help="interface (default: 127.0.0.1)")
    sub.add_argument("--port", type=_port, default=8765, help="default: 8765")
    sub.add_argument(
        "--auth-token",
        type=text,
        default=None,
        help=f"require this token (HTTP Basic password or Bearer); default: ${ENV_TOKEN}",
    )
    sub.add_argument(
        "--allowed-host",
        type=_allowed_host,
        action="append",
        default=None,
        metavar="HOST",
        help="also answer requests for this Host name (a proxy's public name), on any port; repeatable"
        f" (default: ${ENV_ALLOWED_HOSTS}, comma-separated)",
    )
    sub.add_argument(
        "--allow-actions", action="store_true", help="enable requeue, discard, retry now, pause and resume"
    )
    sub.add_argument(
        "--secret", type=text, action="append", default=[], help="a value or field name to mask; repeatable"
    )


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_dashboard_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything starts, a dashboard that anyone on the network could open."""
    if args.auth_token is None:
        args.auth_token = os.environ.get(ENV_TOKEN) or None
    if args.allowed_host is None:
        listed = os.environ.get(ENV_ALLOWED_HOSTS) or ""
        try:
            args.allowed_host = [host_name(name.strip()) for name in listed.split(",") if name.strip()]
        except ValueError as exc:
            parser.error(f"{ENV_ALLOWED_HOSTS}: {exc}")
    if args.auth_token is not None and len(args.auth_token) < 16:
        parser.error("--auth-token must be at least 16 characters (e.g. `python -m secrets` output)")
    if not is_loopback(args.host) and args.auth_token is None:
        parser.error(
            f"--host {args.host} is reachable from other machines: set --auth-token (or ${ENV_TOKEN}),"
            " or put the dashboard behind a proxy that authenticates, bind it to 127.0.0.1"
            " and name the proxy's host with --allowed-host"
        )


def _as_host(interface: str) -> list[str]:
    """The ``--host`` as a Host header would carry it, or nothing when it is no host name at all."""
    try:
        return [host_name(interface)]
    except ValueError:
        return []


def run_dashboard(engine: Engine, args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ..dashboard import create_app, token_auth
    except ImportError as exc:
        print(
            f"outbox dashboard: {exc.name or 'a dependency'} is not installed:"
            " pip install 'sqlalchemy-outbox[dashboard]'",
            file=sys.stderr,
        )
        return 1
    protected = args.auth_token is not None
    listed: list[str] = args.allowed_host
    app = create_app(
        engine,
        auth=token_auth(args.auth_token) if protected else None,
        allow_actions=args.allow_actions,
        secrets=args.secret,
        # Without a token, answer only to names we were told: a DNS-rebinding page gets nothing.
        allowed_hosts=None if protected and not listed else [*LOOPBACK_NAMES, *_as_host(args.host), *listed],
    )
    host = args.host.strip("[]")
    shown = f"[{host}]" if ":" in host else host
    mode = "actions enabled" if args.allow_actions else "read-only"
    print(
        f"outbox dashboard on http://{shown}:{args.port}/ ({mode}"
        f"{', token required' if protected else ''}"
        f"{', also as ' + ', '.join(listed) if listed else ''}); Ctrl-C stops it",
        file=sys.stderr,
    )
    uvicorn.run(app, host=host, port=args.port, log_level="warning", access_log=False, server_header=False)
    return 0
