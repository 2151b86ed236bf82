"""``outbox dashboard`` as a user starts it, and the live feed over a real socket.

The command runs as a subprocess on a free loopback port; the live-refresh
stream is read with httpx from a real uvicorn server, so what a browser's
EventSource gets is what these tests get.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_ops_cli import assert_one_line_error, outbox_cmd, run

from outbox import Outbox, emit, ops
from outbox.dashboard import create_app

DOCS = Path(__file__).resolve().parents[1] / "docs" / "dashboard.md"


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
        (["--port", "²"], "expected a port number 0 to 65535, got '²'"),
        (["--allowed-host", "ops.example.com:443"], "--allowed-host: 'ops.example.com:443' has a port"),
        (["--allowed-host", "https://ops.example.com"], "is a URL: give the host name alone"),
        (["--allowed-host", "*.example.com"], "wildcards are not supported"),
        (["--allowed-host", ""], "a host name is empty"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(empty_url, args, needle):
    result = run("dashboard", *args, database_url=empty_url)
    assert_one_line_error(result, 2, needle)


def test_a_bad_allowed_hosts_variable_is_refused_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DASHBOARD_ALLOWED_HOSTS"] = "ops.example.com, ops.internal:8443"
    url = f"sqlite:///{tmp_path / 'never-created.db'}"
    result = subprocess.run(
        outbox_cmd("dashboard", database_url=url), capture_output=True, text=True, timeout=60, env=env
    )
    assert_one_line_error(result, 2, "OUTBOX_DASHBOARD_ALLOWED_HOSTS: 'ops.internal:8443' has a port")
    assert not (tmp_path / "never-created.db").exists()


def proxy_recipe() -> tuple[list[str], str, str]:
    """docs/dashboard.md's proxy recipe: the ``outbox dashboard`` flags, the nginx block, its server_name."""
    section = DOCS.read_text().split("## Behind a reverse proxy", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    nginx = re.search(r"```nginx\n(.*?)```", section, re.S)
    assert shell is not None and nginx is not None, "the recipe lost its command or its nginx block"
    words = shlex.split(shell.group(1))
    flags = words[words.index("dashboard") + 1 :]
    server_name = re.search(r"server_name\s+([^;\s]+);", nginx.group(1))
    assert server_name is not None
    return flags, nginx.group(1), server_name.group(1)


@pytest.mark.parametrize("named_by", ["flag", "variable"])
def test_the_documented_proxy_recipe_serves_its_host_and_no_other(database_url, engine, named_by):
    """The proxy passes the browser's Host and scheme and its own Basic login: pages, and an action, work."""
    flags, nginx, public = proxy_recipe()
    assert re.search(r"proxy_set_header\s+Host\s+\$host;", nginx)
    assert re.search(r"proxy_set_header\s+X-Forwarded-Proto\s+\$scheme;", nginx)
    assert re.search(r"proxy_pass\s+http://127\.0\.0\.1:8765;", nginx)  # the default --host and --port
    assert "--auth-token" not in flags and "--allowed-host" in flags
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if named_by == "variable":
        at = flags.index("--allowed-host")
        env["OUTBOX_DASHBOARD_ALLOWED_HOSTS"] = flags[at + 1]
        flags = flags[:at] + flags[at + 2 :]
    port = free_port()
    proc = subprocess.Popen(
        outbox_cmd("dashboard", *flags, "--port", str(port), database_url=database_url),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    login = "Basic " + base64.b64encode(b"alice:what-the-htpasswd-checked").decode()
    proxied = {"host": public, "x-forwarded-proto": "https", "authorization": login}
    try:
        page = wait_for(base + "/", headers=proxied)
        assert page.status_code == 200 and "Overview" in page.text
        for other in ("evil.example", f"sub.{public}", f"{public}.evil.example"):
            assert httpx.get(base + "/", headers={**proxied, "host": other}).status_code == 421, other
        # A browser without Sec-Fetch-Site states only its Origin: the proxy's headers make it ours.
        form = {"kind": "queue", "name": "billing", "reason": "vendor outage"}
        paused = httpx.post(
            base + "/queues/pause", data=form, headers={**proxied, "origin": f"https://{public}"}
        )
        assert paused.status_code == 303, paused.text
        [pause] = ops.paused(engine)
        assert (pause.name, pause.actor) == ("billing", "dashboard:alice")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert f"also as {public}" in err


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


@pytest.mark.parametrize("listed", [[], ["--allowed-host", "dash.example.com"]])
def test_a_token_protects_a_reachable_dashboard(database_url, listed):
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
            *listed,
            database_url=database_url,
        ),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}/"
    try:
        assert wait_for(base).status_code == 401
        assert httpx.get(base, auth=("me", token)).status_code == 200
        # The token is the defence against rebinding; --allowed-host narrows the names all the same.
        other = httpx.get(base, auth=("me", token), headers={"host": "evil.example"})
        assert other.status_code == (421 if listed else 200)
        if listed:
            assert (
                httpx.get(base, auth=("me", token), headers={"host": "dash.example.com"}).status_code == 200
            )
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
