"""Real databases for every test: SQLite always, PostgreSQL from OUTBOX_TEST_DATABASE_URL.

Each test gets a freshly migrated database of its own (copied from a template),
so tests that commit never see each other's rows.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pgcluster
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

import outbox

if TYPE_CHECKING:
    from bench.harness import Scratch

PG_ENV = "OUTBOX_TEST_DATABASE_URL"
# The repository's root, where the bench package lives (it is not installed). Appended, not
# inserted: the checkout's alembic/ and outbox/ folders must not shadow the installed packages.
sys.path.append(str(Path(__file__).resolve().parents[1]))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker more than the cores, at most eight.

    A test spends most of its time waiting (on a relay subprocess, a commit, a
    server it started), so a spare worker keeps the cores busy: three workers
    on two cores run the suite in under half the time of one process. The cap
    keeps a large machine from starting dozens of relays and clusters at once.
    """
    return min((os.cpu_count() or 1) + 1, 8)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each ``xdist_group`` test's group in its node id, which ``--dist loadgroup`` schedules by.

    The tests marked ``xdist_group("rabbitmq")`` must share one worker (see tests/test_rabbitmq.py).
    pytest-xdist appends the group to the id through an attribute pytest 9.2 no longer reads, and
    the groups then silently do not group; this appends it where pytest keeps the id. It does
    nothing where xdist's suffix took, and outside loadgroup workers (``-n 0``, other modes).
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
            continue
        from _pytest.nodeid import NodeId  # pytest >= 9.2, the versions that need this

        item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "outbox.db"
    outbox.upgrade(f"sqlite:///{path}")
    return path


class _BackgroundDrops:
    """Drops each test's database on a thread of its own, so the next test need not wait for it.

    A ``DROP DATABASE`` removes the files of every table, index and partition
    of the schema: on a slow disk most of a second, after every test that
    takes a database. A thread per worker drops them in order while the
    tests go on; the server's base fixture waits for the last before it ends.
    """

    def __init__(self) -> None:
        self._pending: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.failed: list[str] = []

    def drop(self, base: str, name: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="test-database-drops", daemon=True)
            self._thread.start()
        self._pending.put((base, name))

    def _run(self) -> None:
        admins: dict[str, Engine] = {}
        while (item := self._pending.get()) is not None:
            base, name = item
            if base not in admins:
                admins[base] = create_engine(base, isolation_level="AUTOCOMMIT")
            try:
                with admins[base].connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            except Exception as exc:  # a database left behind is reported, not a test's failure
                self.failed.append(f"{name}: {exc}")
        for admin in admins.values():
            admin.dispose()

    def finish(self) -> None:
        """Wait for every drop asked for so far."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join()
            self._thread = None
        if self.failed:
            print("test databases not dropped:", *self.failed, sep="\n  ", file=sys.stderr)


_DROPS = _BackgroundDrops()


@pytest.fixture(scope="session")
def pg_base_url() -> Iterator[str]:
    """The server PostgreSQL tests create their databases on.

    ``OUTBOX_TEST_DATABASE_URL`` when set (CI sets it); otherwise a throwaway
    cluster when ``pg_ctl`` is on the PATH; otherwise PostgreSQL tests skip
    locally and fail in CI.
    """
    url = os.environ.get(PG_ENV)
    if url:
        try:
            yield url
        finally:
            _DROPS.finish()
        return
    if os.environ.get("CI"):
        pytest.fail(f"{PG_ENV} must be set in CI")
    if not pgcluster.available():
        pytest.skip(f"set {PG_ENV} (or put pg_ctl on the PATH) to run PostgreSQL tests")
    cluster = pgcluster.Cluster()
    cluster.start()
    try:
        yield cluster.url
    finally:
        _DROPS.finish()
        cluster.destroy()


@pytest.fixture
def scratch(pg_base_url: str) -> Iterator[Scratch]:
    """The bench's scratch space on the test server: every database a bench mode makes, dropped after."""
    from bench.harness import Scratch

    s = Scratch(pg_base_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def pg_template(pg_base_url: str) -> Iterator[str]:
    url = pg_base_url
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"outbox_template_{os.getpid()}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    template_url = make_url(url).set(database=name)
    outbox.upgrade(template_url.render_as_string(hide_password=False))
    yield name
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        template = request.getfixturevalue("sqlite_template")
        path = tmp_path / "test.db"
        shutil.copy(template, path)
        yield f"sqlite:///{path}"
        return
    yield from _fresh_pg_database(
        request.getfixturevalue("pg_base_url"), request.getfixturevalue("pg_template")
    )


def _fresh_pg_database(base: str, template: str) -> Iterator[str]:
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
        # As the throwaway clusters do (pgcluster): a commit still makes its rows visible to every
        # other connection at once, it only stops waiting for the disk. Only a crash of the server
        # could lose it, and tests that crash a server run their own cluster.
        conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
    admin.dispose()
    yield make_url(base).set(database=name).render_as_string(hide_password=False)
    _DROPS.drop(base, name)


@pytest.fixture
def pg_url(pg_base_url: str, pg_template: str) -> Iterator[str]:
    """A freshly migrated PostgreSQL database, for behaviour only PostgreSQL has (LISTEN, EXPLAIN, locks)."""
    yield from _fresh_pg_database(pg_base_url, pg_template)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    eng = create_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    eng = create_engine(database_url)
    yield eng
    eng.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with nothing in it."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    yield from _empty_pg_database(request.getfixturevalue("pg_base_url"))


@pytest.fixture
def empty_pg_url(pg_base_url: str) -> Iterator[str]:
    """An empty PostgreSQL database, for migrations run step by step (or by the code under test)."""
    yield from _empty_pg_database(pg_base_url)


def _empty_pg_database(base: str) -> Iterator[str]:
    name = f"outbox_empty_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        _DROPS.drop(base, name)


@pytest.fixture
def ob() -> outbox.Outbox:
    """An Outbox whose retries fall due within milliseconds, so a test drains them as it goes.

    A module that needs other defaults defines its own ``ob``; ``maker`` uses whichever is in scope.
    """
    return outbox.Outbox(default_backoff=outbox.Backoff(base=0.001, cap=0.002))


@pytest.fixture
def maker(engine: Engine, ob: outbox.Outbox) -> Iterator[sessionmaker[Session]]:
    """Sessions with ``ob`` installed, uninstalled again after the test."""
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)
