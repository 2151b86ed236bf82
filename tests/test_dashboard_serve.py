"""``outbox dashboard`` as a user starts it, and the live feed over a real socket.

The command runs as a subprocess on a free loopback port; the live-refresh
stream is read with httpx from a real uvicorn server, so what a browser's
EventSource gets is what these tests get.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_ops_cli import assert_one_line_error, outbox_cmd, run

from outbox import Outbox, emit, ops
from outbox.dashboard import create_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, timeout: float = 20.0, **kw: object) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=2, **kw)  # type: ignore[arg-type]
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 is reachable from other machines: set --auth-token"),
        (["--host", "192.168.1.5"], "reachable from other machines"),
        (["--auth-token", "short"], "--auth-token must be at least 16 characters"),
        (["--port", "70000"], "expected a port number 0 to 65535"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(empty_url, args, needle):
    result = run("dashboard", *args, database_url=empty_url)
    assert_one_line_error(result, 2, needle)


def test_the_command_serves_loopback_and_stops_on_ctrl_c(database_url):
    port = free_port()
    env = {**os.environ, "OUTBOX_DASHBOARD_TOKEN": ""}
    proc = subprocess.Popen(
        outbox_cmd("dashboard", "--port", str(port), database_url=database_url),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        page = wait_for(f"http://127.0.0.1:{port}/")
        assert page.status_code == 200 and "Overview" in page.text
        assert "read-only" in page.text
        # DNS rebinding: a page served as evil.example that resolves to 127.0.0.1 gets nothing.
        rebound = httpx.get(f"http://127.0.0.1:{port}/", headers={"host": "evil.example"})
        assert rebound.status_code == 421
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert f"outbox dashboard on http://127.0.0.1:{port}/ (read-only)" in err


def test_a_token_protects_a_reachable_dashboard(database_url):
    port = free_port()
    token = "correct-horse-battery-staple"
    env = {**os.environ, "OUTBOX_DASHBOARD_TOKEN": token}
    proc = subprocess.Popen(
        outbox_cmd(
            "dashboard",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--allow-actions",
            database_url=database_url,
        ),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert wait_for(f"http://127.0.0.1:{port}/").status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/", auth=("me", token)).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert token not in err


class Served:
    def __init__(self, engine: Engine, **options: object) -> None:
        self.port = free_port()
        self.app = create_app(engine, **options)  # type: ignore[arg-type]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        base = f"http://127.0.0.1:{self.port}"
        wait_for(base + "/static/dashboard.css")
        return base

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def app_outbox(engine: Engine) -> Iterator[tuple[Outbox, sessionmaker[Session]]]:
    ob = Outbox()
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)

    @ob.handler("user.signed_up", name="welcome_email")
    def welcome(msg: object) -> None:
        pass

    yield ob, maker
    ob.uninstall(maker)


def test_live_feed_announces_an_emitted_message(engine, app_outbox):
    _, maker = app_outbox
    with Served(engine, poll_interval=0.2) as base, httpx.Client(timeout=30) as http:
        with http.stream("GET", base + "/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()
            assert next(lines) == "retry: 3000"

            def emit_soon() -> None:
                time.sleep(0.5)
                with maker.begin() as s:
                    emit(s, "user.signed_up", {"user_id": 1})

            threading.Thread(target=emit_soon).start()
            started = time.monotonic()
            for line in lines:
                if line == "event: update":
                    break
            assert time.monotonic() - started < 20
    assert ops.stats(engine).by_status == {"pending": 1}


def test_the_feed_stops_watching_when_the_last_page_closes(engine):
    served = Served(engine, poll_interval=0.1)
    feed = served.app.state.outbox.feed
    with served as base:
        assert not feed.watching
        for _ in range(2):
            with httpx.Client(timeout=10) as http, http.stream("GET", base + "/events") as stream:
                lines = stream.iter_lines()  # held: a dropped line iterator closes the connection
                assert next(lines) == "retry: 3000"
                deadline = time.monotonic() + 10
                while not feed.watching and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert feed.watching
            deadline = time.monotonic() + 10
            while feed.watching and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not feed.watching
