"""docs/walkthrough.md, run as written: its code is examples/walkthrough's, and every command on it runs.

The page's code blocks marked ``<!-- snippet: FILE#NAME -->`` must equal the
section of FILE between ``--8<-- [start:NAME]`` and ``--8<-- [end:NAME]``.
Its shell commands must be exactly :data:`COMMANDS` (edit both together), and
the last test runs them in order in a copy of examples/walkthrough, on an empty
PostgreSQL database and the machine's RabbitMQ, as a reader would in one
shell: exports carry over, servers start in the background and are stopped
when their section ends (the outside-world stand-ins at the end), and the ports
the page uses (8000, 8001, 8025) are replaced by free ones. ``pip install`` is
the one command not run (the suite runs from a checkout): its extras are
checked to exist instead.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "walkthrough.md"
EXAMPLE = ROOT / "examples" / "walkthrough"

CURL = (
    "curl -s -X POST localhost:8000/orders -H 'content-type: application/json' "
    """-d '{"request_id": "%s", "email": "%s", "total": "%s"}'"""
)

#: The page's shell blocks, command by command (comments stripped), in order.
COMMANDS = [
    ["pip install 'sqlalchemy-outbox[rabbitmq]'"],
    [
        "export DATABASE_URL=postgresql+asyncpg://app@localhost/shop",
        "alembic upgrade head",
        'outbox migrate --database-url "$DATABASE_URL"',
        "alembic check",
    ],
    [
        "export SMTP_HOST=127.0.0.1 SMTP_PORT=8025",
        "export PARTNER_WEBHOOK_URL=http://127.0.0.1:8001/hooks",
        "export PARTNER_WEBHOOK_SECRET=$(python -c "
        '"from outbox.integrations.webhook import generate_secret; print(generate_secret())")',
        "export RABBITMQ_URL=amqp://guest:guest@127.0.0.1/",
    ],
    ["python -m aiosmtpd -n -l 127.0.0.1:8025", "python partner.py", "python consume_orders.py"],
    [
        "uvicorn shop.app:app --port 8000",
        CURL % ("r-1", "ada@example.com", "12.50"),
        'outbox list --database-url "$DATABASE_URL"',
    ],
    [
        "SHOP_EMBEDDED_RELAY=0 uvicorn shop.app:app --port 8000",
        'outbox-relay --app shop.events:ob --database-url "$DATABASE_URL"',
        CURL % ("r-2", "grace@example.com", "30.00"),
        'outbox list --database-url "$DATABASE_URL"',
    ],
    ["pytest tests"],
]

#: Long-running commands: started in the background, ready when their output shows this.
SERVERS = {
    "python -m aiosmtpd": None,  # prints nothing until a mail comes: ready when its port answers
    "python partner.py": "partner listening",
    "python consume_orders.py": "consumer waiting",
    "uvicorn ": "Uvicorn running on",
    "SHOP_EMBEDDED_RELAY=0 uvicorn ": "Uvicorn running on",
    "outbox-relay ": "started",
}
#: Servers that stand in for the outside world: they run until the end, the others until their section ends.
OUTSIDE = ("python -m aiosmtpd", "python partner.py", "python consume_orders.py")

SNIPPET = re.compile(r"<!-- snippet: (?P<file>[^#]+)#(?P<name>[\w-]+) -->\n```\w*\n(?P<code>.*?)```", re.S)


def shell_blocks(page: str) -> list[list[str]]:
    blocks = re.findall(r"```sh\n(.*?)```", page, re.S)
    return [
        [re.sub(r"\s+#\s.*$", "", line).strip() for line in b.splitlines() if line.strip()] for b in blocks
    ]


def section(path: Path, name: str) -> str:
    found = re.search(
        rf"[ \t]*# --8<-- \[start:{name}\]\n(.*?)[ \t]*# --8<-- \[end:{name}\]", path.read_text(), re.S
    )
    assert found, f"no section {name!r} in {path}"
    return textwrap.dedent(found.group(1)).rstrip("\n") + "\n"


def test_the_pages_code_is_the_examples_code():
    page = PAGE.read_text()
    snippets = list(SNIPPET.finditer(page))
    assert len(snippets) >= 7
    for snippet in snippets:
        path = ROOT / snippet["file"]
        assert snippet["code"] == section(path, snippet["name"]), (
            f"{snippet['file']}#{snippet['name']} differs"
        )


def test_the_page_runs_the_commands_this_test_runs():
    assert shell_blocks(PAGE.read_text()) == COMMANDS


def test_the_install_line_names_extras_that_exist():
    (install,) = COMMANDS[0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = re.fullmatch(r"pip install '(?P<name>[\w-]+)\[(?P<extras>[\w,]+)\]'", install)
    assert named and named["name"] == project["name"]
    assert set(named["extras"].split(",")) <= set(project["optional-dependencies"])


def test_the_page_is_linked_from_the_readme_and_the_index():
    assert "(docs/walkthrough.md)" in (ROOT / "README.md").read_text()
    assert "(walkthrough.md)" in (ROOT / "docs" / "index.md").read_text()


# -- running it ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], object], what: str, logs: list[Path], timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2500:]}" for log in logs if log.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


@dataclass
class Reader:
    """One shell session, as a reader of the page has it: a folder, exports that carry over, servers."""

    workdir: Path
    env: dict[str, str]
    ports: dict[str, str]
    servers: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)

    def logs(self) -> list[Path]:
        return [log for _, _, log in self.servers]

    def localised(self, command: str) -> str:
        for page_port, port in self.ports.items():
            command = re.sub(rf"\b{page_port}\b", port, command)
        return command

    def export(self, command: str, overrides: dict[str, str]) -> None:
        done = subprocess.run(
            ["bash", "-c", f"set -e; {command}; env -0"],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            check=True,
        )
        self.env = dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)
        self.env.update({k: v for k, v in overrides.items() if k in self.env})

    def run(self, command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        self.outputs.append((command, done.stdout + done.stderr))
        return done.stdout

    def start(self, command: str, ready: str | None) -> None:
        log = self.workdir / f"server-{len(self.servers)}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", f"exec env {command}"],  # env: a command may start with VAR=value
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.servers.append((command, process, log))
        if ready is not None:
            wait_for(lambda: ready in log.read_text(), f"{command!r} to start", self.logs())
        else:
            port = int(command.rsplit(":", 1)[1])
            wait_for(lambda: _answers(port), f"{command!r} to listen", self.logs())

    def stop(self, keep: tuple[str, ...] = ()) -> None:
        """Stop the servers (SIGTERM, as Ctrl-C or a supervisor would), except those ``keep`` names."""
        for command, process, log in list(self.servers):
            if command.startswith(keep):
                continue
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
            output = log.read_text()
            # Recent uvicorn re-raises the SIGTERM it handled once shut down; either way it shut down cleanly.
            assert code in (0, -signal.SIGTERM), f"{command} exited {code}\n{output[-3000:]}"
            assert "Traceback" not in output, output[-3000:]
            self.servers.remove((command, process, log))


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def empty_database(pg_base_url: str) -> Iterator[str]:
    name = f"walkthrough_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(pg_base_url).set(drivername="postgresql+asyncpg", database=name)
    yield url.render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.xdist_group("rabbitmq")  # its consumer and relay use the broker: see tests/test_rabbitmq.py
def test_every_command_on_the_page_runs(empty_database, tmp_path):
    workdir = tmp_path / "shop"
    shutil.copytree(EXAMPLE, workdir, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTEST_", "DATABASE_URL"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    ports = {"8000": str(free_port()), "8001": str(free_port()), "8025": str(free_port())}
    reader = Reader(workdir, env, ports)
    overrides = {"DATABASE_URL": empty_database}
    smtp = partner = consumer = Path()
    database = create_engine(make_url(empty_database).set(drivername="postgresql+psycopg"))
    try:
        for block in COMMANDS[1:]:
            for page_command in block:
                command = reader.localised(page_command)
                server = next((prefix for prefix in SERVERS if command.startswith(prefix)), None)
                if command.startswith("export "):
                    reader.export(command, overrides)
                elif server is not None:
                    reader.start(command, SERVERS[server])
                else:
                    reader.run(command)
                    if command.startswith("curl"):
                        delivered(reader, database, request=command)
            if block[0].startswith("python -m aiosmtpd"):
                smtp, partner, consumer = reader.logs()
            reader.stop(keep=OUTSIDE)
    finally:
        reader.stop()
        database.dispose()

    # What the page says happens.
    outputs = dict(reader.outputs)
    assert "No new upgrade operations detected" in outputs["alembic check"]
    for order_id, email in ((1, "ada@example.com"), (2, "grace@example.com")):
        assert (
            f"Subject: Order {order_id} confirmed" in smtp.read_text() and f"To: {email}" in smtp.read_text()
        )
        assert re.search(
            rf"verified msg_\w+: {{'total': '[\d.]+', 'order_id': {order_id}}}", partner.read_text()
        )
        assert re.search(
            rf"order.placed [\w-]+: {{'total': '[\d.]+', 'order_id': {order_id}}}", consumer.read_text()
        )
    listings = [out for command, out in reader.outputs if command.startswith("outbox list")]
    assert [listing.count("delivered") for listing in listings] == [3, 6]
    assert "2 passed" in outputs["pytest tests"]


def delivered(reader: Reader, database: Engine, *, request: str) -> None:
    """After an order is placed: until its three messages are delivered, before the page's `outbox list`."""
    order = re.search(r'"request_id": "r-(\d)"', request)
    assert order is not None
    wanted = int(order.group(1)) * 3

    def done() -> bool:
        with database.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM outbox_message WHERE status = 'delivered'"))
            return count.scalar_one() >= wanted

    wait_for(done, f"{wanted} deliveries", reader.logs())
    # The relay's lines reach the output: uvicorn's through the logging the page sets up.
    line = f"INFO outbox.relay: delivered order.placed #{wanted}"
    for command, _, log in reader.servers:
        if command.startswith(("uvicorn", "outbox-relay")):
            wait_for(lambda log=log: line in log.read_text(), line, reader.logs())
