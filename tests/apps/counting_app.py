"""An application for relay subprocess tests: every delivery leaves a row in ``delivery_log``.

The handler records each delivery in its own transaction, on an engine built
from ``OUTBOX_DATABASE_URL`` (the variable the relay itself reads), so a test
can count side effects per message and per relay process with plain SQL.
Tests create the table with ``delivery_log.create(engine)``.

Behaviour knobs, read from the environment of the relay process:

- ``COUNTING_SLEEP``: seconds each delivery takes before it records anything
  (keeps messages in flight while a test injects a fault);
- ``COUNTING_STARTED_DIR``: a directory where each started delivery touches a
  file named after the message id, the test's evidence that a handler runs;
- ``COUNTING_GATE``: a file path; each delivery, once started, waits until the
  file exists (for at most a minute), so a test decides when in-flight work ends.

A payload with ``"poison": true`` always fails.

A second route, ``awkward`` (event ``awkward.result``), hands the relay what real
integrations produce: a result mapping that is not plain JSON (datetimes, UUIDs,
NaN), an error text with NUL bytes echoed from a binary reply, or a retry
"never" (``RetryLater(delay=inf)``).

A third route, ``concurrency_probe`` (event ``probe.concurrency``, payload
``{"queue": name}``), measures how many of its deliveries run at once per queue
named in the payload: with ``COUNTING_PROBE_DIR`` set, each start touches
``started-<queue>-<id>`` there and keeps ``peak-<queue>`` holding the highest
count seen, then waits for a file ``go`` in that directory (at most a minute).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, Table, create_engine
from sqlalchemy.engine import Engine

from outbox import Backoff, Message, Outbox, RetryLater

EVENT = "count.me"
AWKWARD_EVENT = "awkward.result"
PROBE_EVENT = "probe.concurrency"
MAX_ATTEMPTS = 3

metadata = MetaData()
delivery_log = Table(
    "delivery_log",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("message_id", BigInteger, nullable=False),
    Column("relay_pid", Integer, nullable=False),
    Column("delivered_at", DateTime(timezone=True), nullable=False),
)

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.2))

_engine: Engine | None = None


def _side_effects() -> Engine:
    global _engine
    if _engine is None:
        # One connection per concurrent delivery, so handlers never queue for the pool.
        _engine = create_engine(os.environ["OUTBOX_DATABASE_URL"], pool_size=30, pool_pre_ping=True)
    return _engine


class Poisoned(Exception):
    pass


def _wait_for(path: Path, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@ob.handler(EVENT, name="counter", max_attempts=MAX_ATTEMPTS)
def count(msg: Message) -> None:
    started_dir = os.environ.get("COUNTING_STARTED_DIR")
    if started_dir:
        Path(started_dir, str(msg.id)).touch()
    gate = os.environ.get("COUNTING_GATE")
    if gate:
        _wait_for(Path(gate))
    time.sleep(float(os.environ.get("COUNTING_SLEEP") or 0))
    if isinstance(msg.payload, dict) and msg.payload.get("poison"):
        raise Poisoned(f"message {msg.id} can never be delivered")
    with _side_effects().begin() as conn:
        conn.execute(
            delivery_log.insert().values(
                message_id=msg.id, relay_pid=os.getpid(), delivered_at=datetime.now(UTC)
            )
        )


@ob.handler(AWKWARD_EVENT, name="awkward", max_attempts=2)
def awkward(msg: Message) -> dict[str, object]:
    if msg.payload.get("retry_never"):
        raise RetryLater("come back never", delay=float("inf"))
    if msg.payload.get("fail"):
        raise RuntimeError(f"upstream replied b'\x00\x01\xff' to message {msg.id}")
    return {"accepted_at": datetime.now(UTC), "receipt": uuid.uuid4(), "score": float("nan")}


_probe_lock = threading.Lock()
_probe_running: Counter[str] = Counter()


@ob.handler(PROBE_EVENT, name="concurrency_probe")
def concurrency_probe(msg: Message) -> None:
    directory = Path(os.environ["COUNTING_PROBE_DIR"])
    queue = msg.payload["queue"]
    with _probe_lock:  # one relay process: its handler threads share this count
        _probe_running[queue] += 1
        peak = directory / f"peak-{queue}"
        highest = max(_probe_running[queue], int(peak.read_text()) if peak.exists() else 0)
        peak.write_text(str(highest))
        (directory / f"started-{queue}-{msg.id}").touch()
    try:
        _wait_for(directory / "go")
    finally:
        with _probe_lock:
            _probe_running[queue] -= 1
