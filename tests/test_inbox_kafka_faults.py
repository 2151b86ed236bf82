"""``outbox-consumer`` with the Kafka source as real subprocesses: SIGKILLs, a broker outage, SIGTERM.

Each process runs tests/apps/kafka_inbox_app.py's inbox, whose handler
inserts one row per effect into a table without a unique constraint: a
second effect of a message would show. The mock cluster lives in the test
process, so killing a consumer never touches the brokers.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafkainbox import (
    effects,
    event,
    high_watermarks,
    kafka_inbox_app,
    markers,
    new_cluster,
    produce,
    stored_offsets,
    wait_until,
)
from kafkamock import MockCluster
from relayproc import relay_env
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import Engine

INBOX = kafka_inbox_app.inbox.name
#: Messages the kill test delivers (each also published again now and then, to another partition).
KILL_MESSAGES = int(os.environ.get("OUTBOX_INBOX_KILL_MESSAGES", "10000"))
KILL_PARTITIONS = 6
#: SIGKILLs from the test, each when progress passes a random threshold.
DRIVER_KILLS = 6


def consumer_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m outbox.consumer``."""
    script = Path(sys.executable).with_name("outbox-consumer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.consumer"]


class ConsumerProcess:
    """One ``outbox-consumer --app kafka_inbox_app:inbox`` process; its output goes to a file."""

    def __init__(
        self, database_url: str, cluster: MockCluster, log_path: Path, *args: str, **env: str
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*consumer_command(), "--app", "kafka_inbox_app:inbox", "--database-url", database_url, *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=relay_env(database_url, KAFKA_APP_SERVERS=cluster.bootstrap_servers, **env),
            cwd=log_path.parent,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def tail(self, lines: int = 12) -> str:
        state = "running" if self.alive() else f"exited {self.proc.returncode}"
        body = "\n".join(self.text().splitlines()[-lines:])
        return f"--- consumer pid {self.proc.pid} ({state}), {self.log_path.name}:\n{body}"


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mc = new_cluster(partitions=KILL_PARTITIONS)
    yield mc
    mc.close()


@pytest.fixture
def pg(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    kafka_inbox_app.metadata.create_all(engine)
    yield engine
    engine.dispose()


def test_sigkills_at_any_moment_lose_no_record_and_repeat_no_effect(pg, pg_url, cluster, tmp_path):
    """Two consumers of one group, SIGKILLed at random and by their own acknowledgements and handlers.

    Kills land anywhere: mid-transaction (the handler kills its process after
    writing its effect), between the commit and the acknowledgement (the
    acknowledgement kills it), and wherever the driver's SIGKILL finds it,
    rebalances included. Every message must have exactly one effect, and each
    partition's stored offset must reach its end.
    """
    seed = int(os.environ.get("OUTBOX_INBOX_KILL_SEED") or random.SystemRandom().randrange(2**32))
    rng = random.Random(seed)
    ids = [str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(KILL_MESSAGES)]
    records = [(n % KILL_PARTITIONS, *event(i, {"n": n})) for n, i in enumerate(ids)]
    again = rng.sample(range(KILL_MESSAGES), KILL_MESSAGES // 50)  # a producer's retries, elsewhere
    records += [((n + 1) % KILL_PARTITIONS, *event(ids[n], {"n": n})) for n in again]
    produce(cluster, records)
    ends = high_watermarks(cluster, KILL_PARTITIONS)
    assert sum(ends.values()) == len(records)

    started = time.monotonic()
    runs = 0

    def start(**env: str) -> ConsumerProcess:
        nonlocal runs
        runs += 1
        return ConsumerProcess(
            pg_url,
            cluster,
            tmp_path / f"consumer-{runs}.log",
            "--log-format",
            "json",
            "--log-level",
            "WARNING",
            KAFKA_APP_KILL_ACK="0.0003",
            KAFKA_APP_KILL_EFFECT="0.0001",
            **env,
        )

    # The first two kill themselves for sure, one between its commit and its acknowledgement,
    # one between its effect and its commit; the driver kills the others when progress passes
    # each of its thresholds (wherever that finds them), and leaves those two alone.
    procs = [
        start(KAFKA_APP_KILL_ACK_AT=str(rng.randint(100, 600))),
        start(KAFKA_APP_KILL_EFFECT_AT=str(rng.randint(100, 600))),
    ]
    armed = [True, True]
    thresholds = sorted(rng.uniform(0.02, 0.85) * KILL_MESSAGES for _ in range(DRIVER_KILLS))
    killed = died = armed_died = 0
    try:
        deadline = started + 240
        while markers(pg) < KILL_MESSAGES or stored_offsets(pg, INBOX) != ends:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"seed {seed}: {markers(pg)} of {KILL_MESSAGES} messages after {killed} kills and "
                    f"{died} deaths\n" + "\n".join(p.tail() for p in procs)
                )
            time.sleep(rng.uniform(0.05, 0.3))
            for n, proc in enumerate(procs):
                if not proc.alive():
                    assert proc.proc.returncode == -signal.SIGKILL, f"seed {seed}\n{proc.tail()}"
                    died += 1
                    armed_died += armed[n]
                    armed[n] = False
                    proc.kill()
                    procs[n] = start()
            victims = [n for n in range(len(procs)) if not armed[n]]
            if thresholds and markers(pg) >= thresholds[0] and victims:
                thresholds.pop(0)
                n = rng.choice(victims)
                procs[n].kill()
                killed += 1
                procs[n] = start()
        for proc in procs:
            proc.proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.proc.wait(60)
    finally:
        for proc in procs:
            proc.kill()
    elapsed = time.monotonic() - started
    print(f"\nseed {seed}: {KILL_MESSAGES} messages in {elapsed:.1f}s, {killed} kills, {died} self-kills")

    with pg.connect() as conn:
        table = kafka_inbox_app.effects
        twice = conn.execute(
            select(table.c.message_id, func.count())
            .group_by(table.c.message_id)
            .having(func.count() > 1)
            .limit(5)
        ).all()
    assert not twice, f"seed {seed}: messages with more than one effect: {twice}"
    assert {row.message_id for row in effects(pg)} == set(ids), f"seed {seed}: messages without an effect"
    assert stored_offsets(pg, INBOX) == ends
    assert killed >= 3 and died >= 1, (
        f"seed {seed}: the faults did not happen ({killed} kills, {died} deaths)"
    )


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _metrics_port(proc: ConsumerProcess) -> int | None:
    found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", proc.text())
    return int(found.group(1)) if found else None


def test_ready_only_while_kafka_answers_and_a_sigterm_lets_the_record_in_hand_commit(
    pg, pg_url, cluster, tmp_path
):
    proc = ConsumerProcess(
        pg_url,
        cluster,
        tmp_path / "consumer.log",
        "--metrics-port",
        "0",
        "--log-format",
        "json",
        KAFKA_APP_STARTED=str(tmp_path),
    )
    try:
        port = wait_until(lambda: _metrics_port(proc), what=f"the metrics port\n{proc.tail()}")
        wait_until(lambda: _status(port, "/readyz") == 200, what=f"readiness\n{proc.tail()}")
        produce(cluster, [(p, *event(f"before-{p}", {})) for p in range(KILL_PARTITIONS)])
        wait_until(lambda: markers(pg) == KILL_PARTITIONS, what="the records before the outage")

        cluster.set_down()
        wait_until(lambda: _status(port, "/readyz") == 503, what=f"unreadiness\n{proc.tail()}")
        assert _status(port, "/healthz") == 200 and proc.alive()
        cluster.set_up()
        wait_until(lambda: _status(port, "/readyz") == 200, what=f"readiness again\n{proc.tail()}")
        produce(cluster, [(p, *event(f"after-{p}", {})) for p in range(KILL_PARTITIONS)])
        wait_until(lambda: markers(pg) == 2 * KILL_PARTITIONS, what="the records after the outage")

        # Stopped during an outage, it does not wait for a coordinator that cannot answer.
        cluster.set_down()
        wait_until(lambda: _status(port, "/readyz") == 503, what=f"unreadiness\n{proc.tail()}")
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0, proc.tail()
        assert '"action": "kafka_dropped"' in proc.text(), proc.tail()
    finally:
        cluster.set_up()
        proc.kill()

    slow = ConsumerProcess(
        pg_url, cluster, tmp_path / "slow.log", KAFKA_APP_SLOW="2", KAFKA_APP_STARTED=str(tmp_path)
    )
    try:
        produce(cluster, [(0, *event("in-hand", {}))])
        wait_until(lambda: (tmp_path / "in-hand").exists(), what=f"the handler to start\n{slow.tail()}")
        slow.proc.send_signal(signal.SIGTERM)
        assert slow.proc.wait(60) == 0, slow.tail()
    finally:
        slow.kill()
    assert [row.message_id for row in effects(pg)].count("in-hand") == 1
    assert stored_offsets(pg, INBOX) == high_watermarks(cluster, KILL_PARTITIONS)
