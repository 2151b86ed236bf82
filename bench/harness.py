"""What every mode shares: scratch databases, pre-filled backlogs, relay subprocesses.

Nothing here measures anything; the modes do. Checking results lives in ``verify``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import case, create_engine, func, insert, select, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import NullPool

import outbox
from outbox import outbox_message

from .app import ob
from .verify import Unverified

__all__ = [
    "REPO_ROOT",
    "RelayProcess",
    "Scratch",
    "conninfo",
    "engine_for",
    "give_up_after",
    "prefill",
    "relays",
    "server_version",
    "wait_drained",
    "wait_listening",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
LISTEN_APPLICATION = "outbox-relay listen"  # relay/db.py names its LISTEN connection so


# -- scratch databases -----------------------------------------------------------------------


class Scratch:
    """PostgreSQL databases and SQLite files made for one benchmark run, all removed at the end."""

    def __init__(self, server_url: str) -> None:
        url = make_url(server_url)
        if url.get_backend_name() != "postgresql":
            raise SystemExit("bench: --database-url must be a PostgreSQL URL (SQLite runs use temp files)")
        self.server = url.set(drivername="postgresql+psycopg")
        self.admin = self.server.set(database="postgres")
        self.tag = f"outbox_bench_{os.getpid()}"
        self.databases: list[str] = []
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}_"))
        self._counter = 0

    def _admin_conninfo(self) -> str:
        return conninfo(self.admin)

    def postgres(self, purpose: str, *, migrate: bool = True) -> URL:
        """A fresh, migrated database (history is append-only: every mode starts from empty tables).

        ``migrate=False`` leaves it empty, for the peers, which bring their own schema.
        """
        name = f"{self.tag}_{purpose}"
        with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        url = self.server.set(database=name)
        if migrate:
            outbox.upgrade(url.render_as_string(hide_password=False))
        return url

    def settle(self, timeout: float = 60.0) -> float:
        """Let the server finish what earlier modes left behind; return the seconds that took.

        A drain leaves tens of thousands of dead tuples and dirty pages: the
        autovacuum workers and the checkpointer then compete for this
        machine's two cores and its disk flushes with whatever runs next. A
        mode starts only once a CHECKPOINT has written them out (skipped
        without the privilege) and no autovacuum worker is running, so each
        mode measures itself, not its predecessor's clean-up. The scratch
        databases are vacuumed here, so autovacuum has no reason to wake up
        in the middle of the next mode.
        """
        began = time.monotonic()
        for name in self.databases:
            with psycopg.connect(conninfo(self.server.set(database=name)), autocommit=True) as conn:
                conn.execute("VACUUM (ANALYZE)")
        with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
            try:
                conn.execute("CHECKPOINT")
            except psycopg.errors.InsufficientPrivilege:
                pass
            while time.monotonic() - began < timeout:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
                ).fetchone()
                if row is None or row[0] == 0:
                    break
                time.sleep(0.25)
        return time.monotonic() - began

    def sqlite(self, purpose: str) -> URL:
        url = make_url(f"sqlite:///{self.dir / (purpose + '.db')}")
        outbox.upgrade(url.render_as_string(hide_password=False))
        return url

    def subdir(self, purpose: str) -> Path:
        self._counter += 1
        path = self.dir / f"{self._counter:02d}-{purpose}"
        path.mkdir()
        return path

    def close(self) -> None:
        with psycopg.connect(self._admin_conninfo(), autocommit=True) as conn:
            for name in self.databases:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.databases.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def conninfo(url: URL) -> str:
    """A libpq URI for raw psycopg from a SQLAlchemy URL."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def engine_for(url: URL) -> Engine:
    return create_engine(url, poolclass=NullPool)


_AUTO_EXPLAIN = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_buffers = on",
    "SET auto_explain.log_level = notice",
)
_DURATION = re.compile(r"^duration: ([0-9.]+) ms")


@dataclass(frozen=True, slots=True)
class NestedPlan:
    """A statement a database function ran, as ``auto_explain`` reported it."""

    execution_ms: float
    lines: tuple[str, ...]  # "Query Text: ..." and the plan (ANALYZE, BUFFERS)


def function_plans(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> list[NestedPlan]:
    """The plans of the statements inside the database function ``sql`` calls.

    The relay's writes are calls of PL/pgSQL functions (migration ``outbox_0015``),
    and ``EXPLAIN`` of a call shows only a function scan. PostgreSQL's
    ``auto_explain`` module, told to report at NOTICE for this session, gives the
    plan of each statement the function ran, with its buffers. ``LOAD`` needs a
    superuser; the module ships with PostgreSQL.
    """
    notices: list[str] = []

    def keep(diagnostic: psycopg.errors.Diagnostic) -> None:
        notices.append(diagnostic.message_primary or "")

    for setting in _AUTO_EXPLAIN:
        conn.execute(setting)
    conn.add_notice_handler(keep)
    try:
        conn.execute(sql, params).fetchall()
    finally:
        conn.remove_notice_handler(keep)
        conn.execute("SET auto_explain.log_min_duration = -1")
    call = sql.strip().splitlines()[0]
    plans = []
    for notice in notices:
        duration = _DURATION.match(notice)
        if duration is not None and call not in notice:  # the call itself, when it is reported
            plans.append(NestedPlan(float(duration.group(1)), tuple(notice.splitlines()[1:])))
    return plans


# -- backlogs ----------------------------------------------------------------------------------

_PG_PREFILL = """
INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,
                            max_attempts, available_at, created_at, updated_at)
SELECT gen_random_uuid(), %(event_type)s, %(handler)s, %(queue)s, %(priority)s,
       jsonb_build_object('n', g, 'fail', %(fail_every)s > 0 AND g %% greatest(%(fail_every)s, 1) = 0),
       '{}'::jsonb, %(max_attempts)s, now(), now(), now()
FROM generate_series(%(first)s, %(first)s + %(count)s - 1) AS g
"""


def prefill(
    url: URL, route: str, count: int, *, first: int = 0, fail_every: int = 0, app: outbox.Outbox = ob
) -> float:
    """Store ``count`` messages for ``route`` in one transaction; returns ``time.time()`` after the commit.

    The rows are exactly what ``emit()`` writes for a one-route event (one
    INSERT of generated rows instead of 20,000 ORM transactions, which mode 1
    measures on its own). On PostgreSQL the commit fires the NOTIFY trigger
    once, which is the start signal for relays already listening. ``app`` is
    the Outbox whose route it is (the relays' ``--app``).
    """
    spec = app.get_route(route)
    if url.get_backend_name() == "postgresql":
        params = {
            "event_type": spec.event_type,
            "handler": route,
            "queue": spec.queue,
            "priority": spec.priority,
            "max_attempts": spec.max_attempts,
            "first": first,
            "count": count,
            "fail_every": fail_every,
        }
        with psycopg.connect(conninfo(url)) as conn:
            conn.execute(_PG_PREFILL, params)
            conn.commit()
            return time.time()
    import uuid

    now = datetime.now(UTC)
    rows = [
        {
            "event_id": uuid.uuid4(),
            "event_type": spec.event_type,
            "handler": route,
            "queue": spec.queue,
            "priority": spec.priority,
            "payload": {"n": n, "fail": fail_every > 0 and n % fail_every == 0},
            "headers": {},
            "max_attempts": spec.max_attempts,
            "available_at": now,
            "created_at": now,
            "updated_at": now,
        }
        for n in range(first, first + count)
    ]
    engine = engine_for(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert(outbox_message), rows)
    finally:
        engine.dispose()
    return time.time()


# -- relay subprocesses ----------------------------------------------------------------------------


def relay_command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.relay"]


class RelayProcess:
    """``outbox-relay --app bench.app:ob`` as a subprocess, its log in a file."""

    def __init__(
        self, url: URL, args: Sequence[str], *, workdir: Path, name: str, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "BENCH_"))}
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), environ.get("PYTHONPATH")) if p)
        environ.update(env or {})
        self.command = [
            *relay_command(),
            "--app",
            "bench.app:ob",
            "--database-url",
            url.render_as_string(hide_password=False),
            "--relay-id",
            name,
            *args,
        ]
        #: when it was spawned: ``time.time()`` (to compare with the database's timestamps) and monotonic
        self.started = time.time()
        self.started_monotonic = time.monotonic()
        #: monotonic time :meth:`wait_exit` saw it exit; CPU seconds from its rusage then
        self.exited_monotonic: float | None = None
        self._exit_cpu: float | None = None
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=workdir,
        )
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The process stopped (SIGSTOP) for the block: a measurement taken meanwhile shares no CPU with it.

        Keep the block far shorter than the relay's lease, or its claims are recovered from under it.
        """
        os.kill(self.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def status_kb(self, field_name: str) -> int:
        """A field of /proc/<pid>/status in kB (VmHWM: peak resident set, VmRSS: current)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1])
        raise Unverified(f"/proc/{self.pid}/status has no {field_name}")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the relay has used so far, all its threads together.

        The figure a capacity plan needs (µs of CPU per delivered message). A
        running process is read from ``/proc/<pid>/stat`` (``utime`` and
        ``stime``, in clock ticks); one that :meth:`wait_exit` reaped answers
        from the rusage ``wait4`` returned, start-up and shutdown included.
        """
        if self._exit_cpu is not None:
            return self._exit_cpu
        # The command name in parentheses may hold spaces: the fields after ")" start at field 3 (state).
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wait_exit(self, timeout: float) -> None:
        """Wait for a relay that exits by itself (``--once``); a non-zero exit is unverified.

        ``os.wait4`` blocks until the exit, so ``exited_monotonic`` is not late
        by a polling interval, and returns the child's resource usage, which
        ``/proc`` no longer has once the process is reaped. A watchdog kills a
        relay that outlives ``timeout``.
        """
        watchdog = threading.Timer(timeout, self.proc.kill)
        watchdog.start()
        try:
            _, status, usage = os.wait4(self.pid, 0)
        finally:
            watchdog.cancel()
            self._log.close()
        self.exited_monotonic = time.monotonic()
        self._exit_cpu = usage.ru_utime + usage.ru_stime
        code = os.waitstatus_to_exitcode(status)
        self.proc.returncode = code  # reaped here, so Popen must not wait for it again
        if code == -signal.SIGKILL and self.exited_monotonic - self.started_monotonic >= timeout:
            raise Unverified(f"relay {self.name} did not exit within {timeout:g}s\n{self.tail()}")
        if code != 0:
            raise Unverified(f"relay {self.name} exited {code}\n{self.tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then wait: a clean exit (0) is part of every verification."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise Unverified(f"relay {self.name} did not stop within {timeout:g}s\n{self.tail()}") from None
        finally:
            self._log.close()
        if code != 0:
            raise Unverified(f"relay {self.name} exited {code}\n{self.tail()}")

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def tail(self, lines: int = 12) -> str:
        body = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return f"--- {self.name} (pid {self.pid}) log tail:\n{body}"


@contextmanager
def relays(
    url: URL, count: int, args: Sequence[str], *, workdir: Path, env: dict[str, str] | None = None
) -> Iterator[list[RelayProcess]]:
    procs = [RelayProcess(url, args, workdir=workdir, name=f"relay{i + 1}", env=env) for i in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def _wait(check: Callable[[], bool], what: str, timeout: float, procs: Sequence[RelayProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [p for p in procs if not p.alive()]
        if dead or time.monotonic() > deadline:
            reason = "a relay exited" if dead else f"timed out after {timeout:g}s"
            raise Unverified(f"{reason} waiting for {what}\n" + "\n".join(p.tail() for p in procs))
        time.sleep(0.02)


def wait_listening(url: URL, procs: Sequence[RelayProcess], timeout: float = 30.0) -> None:
    """Until every relay holds its LISTEN connection, and a moment more for its catch-up claim."""
    database = url.database

    def listening() -> bool:
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                (database, LISTEN_APPLICATION),
            ).fetchone()
        return row is not None and row[0] >= len(procs)

    _wait(listening, "relays to LISTEN", timeout, procs)
    time.sleep(0.5)


def give_up_after(count: int, *, slowest_per_s: float) -> float:
    """Seconds to wait for ``count`` deliveries before calling a run failed.

    A minute for start-up, plus the count at the slowest rate the mode has
    shown on a loaded shared host: a slow run is still measured, a stuck one
    ends with its relays' output instead of hanging the benchmark.
    """
    return 60.0 + count / slowest_per_s


def wait_drained(
    url: URL, expected: int, procs: Sequence[RelayProcess], timeout: float, poll: float = 0.1
) -> None:
    """Until ``expected`` messages are delivered and none is pending or running.

    Polls slowly on purpose: the figure comes from timestamps the relay wrote,
    not from when this loop noticed, and a tight poll would steal CPU from it.
    """
    engine = engine_for(url)
    m = outbox_message
    stmt = select(
        func.count(),
        func.coalesce(func.sum(case((m.c.status == "delivered", 1), else_=0)), 0),
    )
    try:

        def done() -> bool:
            with engine.connect() as conn:
                total, delivered = conn.execute(stmt).one()
            if delivered == expected == total:
                return True
            time.sleep(poll)
            return False

        _wait(done, f"{expected} deliveries", timeout, procs)
    finally:
        engine.dispose()


def server_version(url: URL) -> str:
    engine = engine_for(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar_one())
    finally:
        engine.dispose()
