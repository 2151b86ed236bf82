"""examples/fastapi_app.py and examples/flask_app.py started for real, on SQLite and PostgreSQL.

FastAPI runs under uvicorn as a subprocess (its lifespan migrates and starts the
embedded relay); Flask runs on werkzeug's server in a thread, with
``outbox-relay`` as a separate process, the way docs/frameworks.md runs it. Each
test POSTs a signup over HTTP and waits for the handler's delivery file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from relayproc import relay_command
from sqlalchemy.engine import make_url

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(params=["sqlite", "postgresql"])
def app_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(sync URL, async URL) of an empty database."""
    if request.param == "sqlite":
        path = tmp_path / "app.db"
        yield f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}"
        return
    url = request.getfixturevalue("empty_url")  # only the postgresql parameter reaches here
    yield url, make_url(url).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


@pytest.fixture
def empty_url(pg_base_url: str) -> Iterator[str]:
    import uuid

    from sqlalchemy import create_engine, text

    name = f"outbox_example_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(pg_base_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _wait_for(check, what: str, timeout: float = 30.0, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def _deliveries(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _post(base: str, email: str) -> dict[str, object]:
    response = httpx.post(f"{base}/signups", json={"email": email}, timeout=10)
    assert response.status_code == 201, response.text
    body: dict[str, object] = response.json()
    return body


def test_fastapi_app_delivers_through_its_embedded_relay(app_database, tmp_path):
    _, async_url = app_database
    deliveries = tmp_path / "deliveries.jsonl"
    log = tmp_path / "uvicorn.log"
    port = _free_port()
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path,
            env=_env(DATABASE_URL=async_url, DELIVERIES_FILE=str(deliveries)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        # Uvicorn runs the lifespan ("Application startup complete") before it binds the socket;
        # "Uvicorn running on" comes once it listens.
        _wait_for(lambda: b"Uvicorn running on" in log.read_bytes(), "uvicorn", log=log)
        signup = _post(base, "a@example.com")
        delivered = _wait_for(lambda: _deliveries(deliveries), "the delivery", log=log)
        assert delivered == [
            {"message_id": 1, "attempt": 1, "user_id": signup["id"], "email": "a@example.com"}
        ]
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    text = log.read_text()
    # Recent uvicorn re-raises the SIGTERM it handled once shut down; either way the shutdown was clean.
    assert code in (0, -signal.SIGTERM), text
    assert "Application shutdown complete" in text  # the lifespan awaited the relay's graceful stop
    assert "Traceback" not in text and "ERROR" not in text


def test_flask_app_emits_and_a_relay_process_delivers(app_database, tmp_path, monkeypatch):
    sync_url, _ = app_database
    deliveries = tmp_path / "deliveries.jsonl"
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("DELIVERIES_FILE", str(deliveries))
    import flask_app
    from werkzeug.serving import make_server

    app = flask_app.create_app(sync_url)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    log = tmp_path / "relay.log"
    try:
        with log.open("wb") as out:
            relay = subprocess.Popen(
                [
                    *relay_command(),
                    "--app",
                    "flask_app:ob",
                    "--database-url",
                    sync_url,
                    "--poll-interval",
                    "0.2",
                ],
                cwd=tmp_path,
                env=_env(DELIVERIES_FILE=str(deliveries)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            signup = _post(base, "b@example.com")
            delivered = _wait_for(lambda: _deliveries(deliveries), "the delivery", log=log)
            assert delivered == [
                {"message_id": 1, "attempt": 1, "user_id": signup["id"], "email": "b@example.com"}
            ]
        finally:
            relay.send_signal(signal.SIGTERM)
            assert relay.wait(timeout=60) == 0, log.read_text()
    finally:
        server.shutdown()
        thread.join(timeout=10)
        with app.app_context():
            flask_app.db.engine.dispose()
