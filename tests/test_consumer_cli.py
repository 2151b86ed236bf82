"""The ``outbox-consumer`` command as users run it: a subprocess, its exit code, what it serves and prints.

The inbox it runs (tests/apps/spool_consumer_app.py) reads deliveries from a
spool directory, so these tests pin the command's own surface; the broker
sources run under it against their real servers in their own modules.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from relayproc import APPS, relay_env
from sqlalchemy import create_engine, select

sys.path.insert(0, str(APPS))
from spool_consumer_app import effects  # noqa: E402

APP = "spool_consumer_app:inbox"


def _command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-consumer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.consumer"]


def _spool(folder: Path, name: str, message_id: str, event_type: str, body: str = "{}") -> None:
    data = {"headers": {"ce-id": message_id, "ce-type": event_type}, "body": body}
    (folder / f"{name}.tmp").write_text(json.dumps(data))
    (folder / f"{name}.tmp").rename(folder / f"{name}.json")


def _run(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_command(), *args], cwd=cwd, env=relay_env(**env), capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ((), "--app is required"),
        (("--app", APP), "--database-url is required"),
        (("--app", "no_such_module:inbox", "--database-url", "sqlite://"), "cannot import 'no_such_module'"),
        (("--app", "spool_consumer_app:effects", "--database-url", "sqlite://"), "not an outbox.Inbox"),
        (("--app", APP, "--database-url", "sqlite://", "--concurrency", "0"), "must be >= 1"),
        (("--app", APP, "--database-url", "nonsense"), "not a SQLAlchemy database URL"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], said: str) -> None:
    done = _run(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert said in lines[-1]
    assert "Traceback" not in done.stderr


def test_a_database_without_the_inbox_tables_is_exit_1(tmp_path: Path) -> None:
    done = _run("--app", APP, "--database-url", f"sqlite:///{tmp_path}/empty.db", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("outbox-consumer: the inbox's tables are missing")


def _effects(url: str) -> list[tuple[str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(select(effects.c.message_id, effects.c.event_type))]
    finally:
        engine.dispose()


def _wait(condition, what: str, process: subprocess.Popen[str], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the consumer exited ({process.returncode}) waiting for {what}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_it_serves_metrics_and_readiness_and_finishes_the_message_in_hand_on_sigterm(
    database_url: str, tmp_path: Path
) -> None:
    engine = create_engine(database_url)
    effects.create(engine)
    engine.dispose()
    spool = tmp_path / "spool"
    spool.mkdir()
    for n in range(3):
        _spool(spool, f"a{n}", f"m-{n}", "order.paid")
    _spool(spool, "a3", "m-1", "order.paid")  # a redelivery: a duplicate
    started = tmp_path / "started"
    log = (tmp_path / "consumer.log").open("w+")
    process = subprocess.Popen(
        [
            *_command(),
            "--app",
            APP,
            "--database-url",
            database_url,
            "--metrics-port",
            "0",
            "--log-format",
            "json",
        ],
        cwd=tmp_path,
        env=relay_env(SPOOL_DIR=str(spool), SPOOL_STARTED=str(started), SPOOL_SLEEP="2"),
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    try:
        port_line: list[str] = []

        def port_said() -> bool:
            log.seek(0)
            port_line[:] = re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read())
            return bool(port_line)

        _wait(port_said, "the metrics port", process)
        base = f"http://127.0.0.1:{port_line[0]}"
        _wait(lambda: not list(spool.glob("*.json")), "the spool to drain", process)
        assert sorted(_effects(database_url)) == [(f"m-{n}", "order.paid") for n in range(3)]
        _wait(lambda: httpx.get(f"{base}/readyz").status_code == 200, "readiness", process)
        scraped = httpx.get(f"{base}/metrics").text
        assert (
            'outbox_inbox_messages_total{inbox="spool",outcome="handled",source="spool:test"} 3.0' in scraped
        )
        assert (
            'outbox_inbox_messages_total{inbox="spool",outcome="duplicate",source="spool:test"} 1.0'
            in scraped
        )
        assert 'outbox_inbox_source_up{inbox="spool",source="spool:test"} 1.0' in scraped

        _spool(spool, "b0", "m-slow", "slow.report")
        _wait(started.exists, "the slow handler to start", process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert ("m-slow", "slow.report") in _effects(database_url)  # finished, committed
    assert not (spool / "b0.json").exists()  # and acknowledged
    log.seek(0)
    actions = [json.loads(line).get("action") for line in log if line.startswith("{")]
    assert "stopping" in actions and actions[-1] == "stopped"
