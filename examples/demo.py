"""The sqlalchemy-outbox demo: signups whose email, webhook and report survive failures.

Runs on the embedded SQLite default with nothing installed but the package
(and its dev extras, for the local SMTP sink). It starts, on 127.0.0.1 only:

* an SMTP sink that collects the welcome emails,
* a "CRM" webhook receiver that verifies signatures and fails its first calls,

then signs users up (one signup is rolled back: its events never exist), runs
an embedded relay until everything is settled, and prints every message's
attempt history straight from the ``outbox_attempt`` table.

    python examples/demo.py [--database-url postgresql+psycopg://...]

Every run can point at the same database: its idempotency keys carry a fresh
run nonce (the sent-log would rightly refuse a second welcome mail under an old
key), and it reports only the messages it emitted itself. Its working folder
(SQLite file, report CSV) is removed at exit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sqlalchemy import String, create_engine, func, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import Backoff, Outbox, OutboxMixin, ops
from outbox.integrations.email import EmailHandler
from outbox.integrations.report import ReportJob
from outbox.integrations.webhook import WebhookHandler, generate_secret, verify
from outbox.relay import Relay

CRM_SECRET = generate_secret()
ROUTES = ("welcome_email", "crm_webhook", "report.signups")
#: A report chunk may take every relay slot it is given; two of four leave mail its share.
REPORT_SLOTS = 2


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Base(DeclarativeBase):
    pass


class User(OutboxMixin, Base):
    __tablename__ = "demo_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200), unique=True)
    name: Mapped[str] = mapped_column(String(200))


# -- the local servers the handlers talk to ----------------------------------------------------


class SmtpSink:
    """aiosmtpd on a free loopback port, keeping what it receives."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.messages: list[dict[str, Any]] = []
        sink = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
                sink.messages.append(
                    {"to": envelope.rcpt_tos, "data": envelope.content.decode("utf-8", "replace")}
                )
                return "250 Message accepted for delivery"

        self.controller = Controller(Handler(), hostname="127.0.0.1", port=free_port())
        self.controller.start()
        self.port = int(self.controller.port)

    def stop(self) -> None:
        self.controller.stop()


class FlakyCrm:
    """A webhook receiver that answers 503 to its first ``failures`` calls, then 200."""

    def __init__(self, failures: int) -> None:
        self.calls: list[tuple[int, str]] = []
        crm = self

        class Endpoint(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                verify(body, dict(self.headers), CRM_SECRET)  # raises on a bad signature
                status = 503 if len(crm.calls) < failures else 200
                crm.calls.append((status, self.headers["webhook-id"]))
                self.send_response(status)
                if status == 503:
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


# -- the application ---------------------------------------------------------------------------


def build_outbox(engine: Engine, smtp_port: int, crm_port: int, reports: Path) -> tuple[Outbox, ReportJob]:
    ob = Outbox(default_backoff=Backoff(base=0.2, cap=2.0))
    ob.route(
        "user.signed_up",
        EmailHandler("127.0.0.1", smtp_port, sender="Demo <hello@demo.example>", timeout=5),
        name="welcome_email",
        queue="mail",
        priority=0,
        max_attempts=5,
    )
    ob.route(
        "user.signed_up",
        WebhookHandler(
            f"http://127.0.0.1:{crm_port}/hooks/signup",
            secret=CRM_SECRET,
            timeout=5,
            allowed_networks=["127.0.0.0/8"],
        ),
        name="crm_webhook",
        queue="webhooks",
        max_attempts=8,
    )
    report = ReportJob(
        ob,
        "signups",
        engine=engine,
        header=["id", "email", "name"],
        count=lambda s, params: s.scalar(select(func.count()).select_from(User)) or 0,
        rows=lambda s, params, offset, limit: s.execute(
            select(User.id, User.email, User.name).order_by(User.id).offset(offset).limit(limit)
        ),
        output_dir=reports,
        chunk_size=2,
    )
    return ob, report


def sign_up(factory: sessionmaker[Session], run: str, email: str, name: str, *, fail: bool = False) -> None:
    with factory() as s:
        try:
            with s.begin():
                user = User(email=email, name=name)
                s.add(user)
                user.emit(
                    "user.signed_up",
                    {
                        "to": email,
                        "subject": f"Welcome, {name}!",
                        "text": f"Hello {name}, thanks for joining.",
                    },
                    key=f"signup:{run}:{email}",
                )
                if fail:
                    raise RuntimeError("payment check failed")
        except RuntimeError as exc:
            print(f"  signup of {email} rolled back ({exc}): its events were never stored")
            return
    print(f"  signed up {email}")


def last_message_id(engine: Engine) -> int:
    """Messages above this id are this run's: an earlier run's stay in a reused database."""
    with engine.connect() as conn:
        return int(conn.execute(select(func.max(outbox.outbox_message.c.id))).scalar() or 0)


def discard_leftovers(engine: Engine) -> None:
    """An earlier run stopped mid-way left pending messages for servers that are gone: drop them, audited."""
    for route in ROUTES:
        left = ops.discard(
            engine,
            ops.MessageFilter(status="pending", handler=route),
            reason="left pending by an earlier demo run",
            actor="demo",
        )
        if left:
            print(f"  discarded {len(left)} pending {route} message(s) left by an earlier run")


def settled(engine: Engine, after: int) -> bool:
    m = outbox.outbox_message
    with engine.connect() as conn:
        return not conn.execute(
            select(func.count()).where(m.c.id > after, m.c.status.in_(("pending", "running")))
        ).scalar()


def print_history(engine: Engine, after: int) -> None:
    m, a = outbox.outbox_message, outbox.outbox_attempt
    with engine.connect() as conn:
        messages = list(conn.execute(select(m).where(m.c.id > after).order_by(m.c.id)))
        attempts = list(conn.execute(select(a).where(a.c.message_id > after).order_by(a.c.id)))
    print("\nEvery message and its attempts (SELECT ... FROM outbox_message / outbox_attempt):")
    for msg in messages:
        print(
            f"  #{msg.id:<3} {msg.event_type:<22} -> {msg.handler:<15} {msg.status:<9}"
            f" attempts={msg.attempts}"
        )
        # Whole lines: an SMTP reply or a webhook error cut short hides what the server said.
        for h in (h for h in attempts if h.message_id == msg.id):
            print(f"        attempt {h.attempt}: {h.outcome:<9} {h.duration_ms or 0:>4} ms")
            if h.error:
                print(f"            error:  {h.error_type}: {h.error}")
            if h.detail:
                print(f"            detail: {json.dumps(h.detail)}")


def print_report(location: str | None) -> None:
    if location is None:
        return
    print(f"report file {Path(location).name}:")
    for line in Path(location).read_text(encoding="utf-8").splitlines():
        print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", help="run against this database instead of a fresh SQLite file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="outbox-demo-", ignore_cleanup_errors=True) as folder:
        return run(args.database_url, Path(folder))


def run(database_url: str | None, workdir: Path) -> int:
    url = database_url or f"sqlite:///{workdir / 'demo.db'}"
    print(f"database: {make_url(url).render_as_string(hide_password=True)}")
    outbox.upgrade(url)
    engine = create_engine(url)
    try:
        return demo(engine, workdir)
    finally:
        engine.dispose()  # before the SQLite file's folder goes


def demo(engine: Engine, workdir: Path) -> int:
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    run_nonce = uuid.uuid4().hex[:8]
    discard_leftovers(engine)
    after = last_message_id(engine)

    smtp, crm = SmtpSink(), FlakyCrm(failures=3)
    ob, report = build_outbox(engine, smtp.port, crm.port, workdir)
    factory = sessionmaker(engine)
    ob.install(factory)
    # Reports may hold at most REPORT_SLOTS of the relay's slots: the rest stay free for mail
    # (priority orders messages only within a queue; see docs/reports.md).
    relay = Relay(ob, engine, poll_interval=0.5, concurrency=4, queue_concurrency={"reports": REPORT_SLOTS})
    thread = threading.Thread(target=relay.run, name="relay")
    thread.start()
    try:
        print(f"signups (run {run_nonce}):")
        sign_up(factory, run_nonce, "ada@example.com", "Ada")
        sign_up(factory, run_nonce, "grace@example.com", "Grace")
        sign_up(factory, run_nonce, "mallory@example.com", "Mallory", fail=True)
        sign_up(factory, run_nonce, "linus@example.com", "Linus")
        with factory() as s, s.begin():
            run_id = report.start(s)
        print(f"  requested the signups report (run {run_id[:8]})")
        deadline = time.monotonic() + 60
        while not settled(engine, after) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        relay.stop()
        thread.join(30)
        smtp.stop()
        crm.stop()
    print_history(engine, after)
    progress = report.progress(run_id)
    print(f"\nemails received by the SMTP sink: {len(smtp.messages)}")
    print(f"CRM calls: {', '.join(str(status) for status, _ in crm.calls)} (retried until it recovered)")
    print(f"report: {progress.status}, {progress.row_count} rows")
    print_report(progress.location)
    ok = settled(engine, after) and len(smtp.messages) == 3 and progress.status == "complete"
    print("\ndemo finished: everything delivered" if ok else "\ndemo finished with undelivered messages")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
