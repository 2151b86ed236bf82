"""The webhook receiver under SIGKILL: every event takes effect exactly once, on PostgreSQL.

The receiver is examples/webhook_receiver_fastapi.py as written, served by
uvicorn in a process of its own (tests/apps/webhook_receiver_app.py) on a port
that stays the same across restarts; its handler records a payment in a table
with no unique constraint, so a second effect of one webhook would show as a
second row. The sender is this outbox's own relay, an ``outbox-relay``
process delivering ``order.paid`` with ``WebhookHandler``
(tests/apps/webhook_sender_app.py). Both share one database, as two services
of one company might; nothing but HTTP passes between them.

The fault test kills the receiver in the two places that matter: its own
SIGKILL right after the commit of a webhook and before the answer goes out
(the window that makes a redelivery of something already done), and a
SIGKILL from outside at a random moment while requests are in flight. It
also resends some delivered messages, which keeps their ``webhook-id``. The
driver's choices come from a seed, printed with every failure and at the end
(``OUTBOX_INBOX_KILL_SEED`` replays it); ``OUTBOX_INBOX_KILL_MESSAGES`` sets
the number of events (10,000 by default), as for the broker sources.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from relayproc import APPS, RelayProcess, relay_env, wait_until
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from outbox import Message, Outbox, emit, outbox_inbox, outbox_message
from outbox.integrations.webhook import WebhookHandler, generate_secret, webhook_id
from outbox.ops import MessageFilter, resend

KILL_MESSAGES = int(os.environ.get("OUTBOX_INBOX_KILL_MESSAGES") or 10_000)
FAULTS = 8  # receiver runs that end in a SIGKILL; the run after them is let finish
WINDOW = 500  # messages waiting at the sender at most (see Emitter)
RESENDS = 3  # rounds of resends of delivered messages, while the receiver is being killed
LOCAL = ["127.0.0.0/8"]
EVENT, ROUTE = "order.paid", "partner"  # as tests/apps/webhook_sender_app.py routes them
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
m = outbox_message


class Emitter(threading.Thread):
    """Emits ``order.paid`` for orders 0 to KILL_MESSAGES - 1 as the relay makes room, like an application.

    At most WINDOW messages wait at the sender at a time. A backlog of all of
    them at once would have every outage park thousands of messages (a
    database write each, as the breaker turns them away) and the test would
    measure parking instead of receiving.
    """

    def __init__(self, engine: Engine, hook: str, secret: str) -> None:
        super().__init__(name="emit", daemon=True)
        self.engine = engine
        self.ob = Outbox()  # the emitting side: the route's name is what makes the webhook-id
        self.ob.route(EVENT, WebhookHandler(hook, secret, allowed_networks=LOCAL), name=ROUTE)
        self.events: dict[int, uuid.UUID] = {}
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        maker = sessionmaker(self.engine)
        self.ob.install(maker)
        try:
            while len(self.events) < KILL_MESSAGES and not self.stop.is_set():
                waiting = statuses(self.engine)
                if waiting["pending"] + waiting["running"] >= WINDOW:
                    time.sleep(0.2)  # each look is a count over the whole outbox
                    continue
                with maker.begin() as session:
                    for n in range(len(self.events), min(len(self.events) + 100, KILL_MESSAGES)):
                        payload = {"order_id": n, "total": f"{n}.00"}
                        self.events[n] = emit(session, EVENT, payload, key=f"order:{n}")
        except BaseException as exc:
            self.error = exc
        finally:
            self.ob.uninstall(maker)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Receiver:
    """One ``webhook_receiver_app.py`` process on ``port``; its output goes to a file the test reads."""

    def __init__(
        self, database_url: str, port: int, secret: str, evidence: Path, log: Path, **env: str
    ) -> None:
        async_url = make_url(database_url).set(drivername="postgresql+asyncpg")
        self.port = port
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(APPS / "webhook_receiver_app.py")],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=relay_env(
                DATABASE_URL=async_url.render_as_string(hide_password=False),
                WEBHOOK_SECRET=secret,
                WEBHOOK_RECEIVER_PORT=str(port),
                WEBHOOK_RECEIVER_DIR=str(evidence),
                **env,
            ),
            cwd=log.parent,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def serving(self) -> bool:
        return self.alive() and listening(self.port)

    def started(self) -> bool:
        """Listening, or gone already (a receiver may kill itself at its first answer)."""
        return self.serving() or not self.alive()

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def tail(self) -> str:
        text_ = self.log_path.read_text(errors="replace")
        return f"--- receiver pid {self.proc.pid}, {self.log_path.name}:\n" + "\n".join(
            text_.splitlines()[-15:]
        )


@pytest.fixture
def shared(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Engine]]:
    """The database both services use, its ``payments`` table made before any receiver starts."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import webhook_receiver_fastapi as example

    engine = create_engine(pg_url)
    example.Base.metadata.create_all(engine)  # else receivers starting together race to create it
    yield pg_url, engine
    engine.dispose()


def payments(engine: Engine) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(
            dict(conn.execute(text("SELECT order_id, count(*) FROM payments GROUP BY order_id")).all())
        )


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(dict(conn.execute(select(m.c.status, func.count()).group_by(m.c.status)).all()))


def sent_as(event_id: uuid.UUID) -> str:
    return webhook_id(Message(id=0, event_id=event_id, event_type=EVENT, handler=ROUTE, payload={}))


def evidence_of(evidence: Path, kind: str) -> list[str]:
    """The webhook ids of ``kind-<webhook-id>[-n]`` files (one per event of that kind)."""
    return [p.name.split("-")[1] for p in evidence.glob(f"{kind}-*")]


def test_kills_between_effect_and_answer_never_lose_or_repeat_a_payment(shared, tmp_path):
    """KILL_MESSAGES events through a receiver SIGKILLed again and again, some of them resent.

    Of the first FAULTS receiver runs the first ends in its own kill (at a
    random handled webhook, after its commit, before its answer), the second
    in a SIGKILL from outside (a random moment once it serves), the others in
    either at random; the run after them is let finish. The relay goes on
    throughout: what it sent into a dead receiver it sends again, what it
    cannot connect to it parks until the receiver is back.
    """
    url, engine = shared
    started_at = time.monotonic()
    seed = int(os.environ.get("OUTBOX_INBOX_KILL_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    secret, port = generate_secret(), free_port()
    hook = f"http://127.0.0.1:{port}/hooks/order-paid"
    evidence = tmp_path / "evidence"
    evidence.mkdir()

    emitter = Emitter(engine, hook, secret)
    relay = RelayProcess(
        url,
        # The last --app given wins over relayproc's default. 16 requests at a time keep both busy.
        ["--app", "webhook_sender_app:ob", "--concurrency", "16"],
        log_path=tmp_path / "relay.log",
        env={"WEBHOOK_URL": hook, "WEBHOOK_SECRET": secret},
    )
    emitter.start()
    resent: list[uuid.UUID] = []

    def resend_some() -> None:
        """Once a third, then two thirds, then all of the events were delivered: resend 30 of them."""
        if len(resent) >= 30 * RESENDS:
            return
        with engine.connect() as conn:
            delivered = conn.execute(
                select(m.c.id, m.c.event_id).where(m.c.status == "delivered", m.c.requeued_from.is_(None))
            ).all()
        if len(delivered) < KILL_MESSAGES * (len(resent) // 30 + 1) // RESENDS:
            return
        chosen = rng.sample(delivered, 30)
        resend(engine, MessageFilter(ids=[i for i, _ in chosen]), reason="partner lost it", actor="kill-test")
        resent.extend(e for _, e in chosen)

    progress = {"delivered": -1, "at": time.monotonic()}

    def done() -> bool:
        """All emitted, resent and delivered; fails on a dead message, or on two minutes without progress."""
        assert emitter.error is None, f"seed {seed}: emitting failed: {emitter.error!r}"
        left = statuses(engine)
        assert not left["dead"], f"seed {seed}: {left['dead']} dead at the sender\n{relay.tail()}"
        if left["delivered"] != progress["delivered"]:
            progress.update(delivered=left["delivered"], at=time.monotonic())
        assert time.monotonic() - progress["at"] < 120, f"seed {seed}: stuck for two minutes\n{relay.tail()}"
        if emitter.is_alive():
            return False
        resend_some()
        return len(resent) == 30 * RESENDS and set(statuses(engine)) == {"delivered"}

    runs, outside_kills, own_deaths = 0, 0, 0
    try:
        while True:
            runs += 1
            assert runs < 100, f"seed {seed}: no end in sight"
            fault = "none" if runs > FAULTS else "own" if runs == 1 else "outside" if runs == 2 else None
            fault = fault or rng.choice(["own", "outside"])
            kill_at = {"WEBHOOK_RECEIVER_KILL_AT": str(rng.randrange(1, max(2, KILL_MESSAGES // 10)))}
            receiver = Receiver(
                url,
                port,
                secret,
                evidence,
                tmp_path / f"receiver-{runs}.log",
                **(kill_at if fault == "own" else {}),
            )
            try:
                wait_until(receiver.started, "the receiver to listen", timeout=60)
                end = time.monotonic() + rng.uniform(0.3, 3.0) if fault == "outside" else math.inf
                while receiver.alive() and time.monotonic() < end and not done():
                    time.sleep(0.2)
                if not receiver.alive():  # its own SIGKILL (anything else fails on its exit code below)
                    own_deaths += fault == "own"
                elif fault == "outside" and time.monotonic() >= end:
                    receiver.proc.send_signal(signal.SIGKILL)
                    outside_kills += 1
                else:  # done
                    break
            finally:
                receiver.kill()
            code = receiver.proc.returncode
            assert code == -signal.SIGKILL, f"seed {seed}: the receiver exited {code}\n{receiver.tail()}"
    finally:
        emitter.stop.set()
        emitter.join(60)
        relay.signal(signal.SIGTERM)
        relay.wait(60)
        relay.kill()
    took = time.monotonic() - started_at

    counts = payments(engine)
    repeated = {k: v for k, v in counts.items() if v > 1}
    assert not repeated, f"seed {seed}: {len(repeated)} orders paid twice, e.g. {list(repeated.items())[:5]}"
    assert set(counts) == set(emitter.events), f"seed {seed}: lost {len(set(emitter.events) - set(counts))}"
    with engine.connect() as conn:
        markers = Counter(conn.scalars(select(outbox_inbox.c.outcome)).all())
    assert markers == {"handled": KILL_MESSAGES}
    assert statuses(engine) == {"delivered": KILL_MESSAGES + len(resent)}

    own_kills = evidence_of(evidence, "kill")
    duplicates = evidence_of(evidence, "duplicate")
    assert len(own_kills) == own_deaths and own_kills and outside_kills, (
        f"seed {seed}: the faults did not happen ({own_kills}, {outside_kills})"
    )
    # Killed after its commit: the relay heard nothing, sent it again, and was told "duplicate".
    assert set(own_kills) <= set(duplicates), f"seed {seed}: a killed webhook was never answered"
    # A resent copy carries the original's webhook-id: received again, nothing done again.
    assert {sent_as(e) for e in resent} <= set(duplicates), f"seed {seed}: a resend took effect"
    print(
        f"\n{KILL_MESSAGES} events (+{len(resent)} resent), {runs} receiver runs, {outside_kills} SIGKILLs "
        f"from outside, {len(own_kills)} between commit and answer, {len(duplicates)} answered duplicate, "
        f"{took:.1f}s ({KILL_MESSAGES / took:.0f} events/s), seed {seed}"
    )


def test_two_receivers_given_the_same_webhook_at_once_record_one_payment(shared, tmp_path):
    """Two receiver processes on one database get each webhook at the same moment: one payment each.

    The sender is ``WebhookHandler`` itself, called twice at once with the
    same message, once at each receiver: the same body and ``webhook-id``.
    The first receiver to take the marker keeps its transaction open until
    the other has the request in hand, so every pair truly overlaps.
    """
    url, engine = shared
    secret = generate_secret()
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    ports = [free_port(), free_port()]
    receivers = [
        Receiver(
            url, port, secret, evidence, tmp_path / f"receiver-{port}.log", WEBHOOK_RECEIVER_TOGETHER="2"
        )
        for port in ports
    ]
    handlers = [
        WebhookHandler(f"http://127.0.0.1:{port}/hooks/order-paid", secret, allowed_networks=LOCAL)
        for port in ports
    ]
    messages = [
        Message(
            id=n,
            event_id=uuid.uuid4(),
            event_type=EVENT,
            handler=ROUTE,
            payload={"order_id": n, "total": "1.00"},
        )
        for n in range(20)
    ]

    async def send_each_to_both() -> list[list[dict[str, object]]]:
        try:
            return [
                list(await asyncio.gather(*(handler(message) for handler in handlers)))
                for message in messages
            ]
        finally:
            for handler in handlers:
                await handler.outbox_shutdown()

    try:
        wait_until(lambda: all(r.serving() for r in receivers), "both receivers to listen", timeout=60)
        answers = asyncio.run(send_each_to_both())
    finally:
        for receiver in receivers:
            receiver.kill()
    assert all(detail["status"] == 200 for pair in answers for detail in pair)
    assert set(evidence_of(evidence, "together")) == {sent_as(msg.event_id) for msg in messages}
    assert payments(engine) == Counter(range(20))
    assert Counter(evidence_of(evidence, "duplicate")) == Counter(sent_as(msg.event_id) for msg in messages)
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(outbox_inbox)) == 20
