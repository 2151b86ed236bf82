"""The pytest plugin (entry point ``outbox``), loaded the way a user's pytest loads it: by being installed.

Each test writes a small test suite into a folder of its own and runs pytest on
it in a subprocess, so the plugin is found through its entry point, not
imported by this suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

APP = """
import pytest
from sqlalchemy import create_engine

import outbox
from outbox import Message, Outbox, emit
from sqlalchemy.orm import sessionmaker

delivered = []
ob = Outbox()


@ob.handler("user.signed_up", name="welcome")
def welcome(msg: Message) -> None:
    delivered.append(msg.payload["email"])


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    engine = create_engine(f"sqlite:///{tmp_path_factory.mktemp('db') / 'test.db'}")
    outbox.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def outbox_database(engine):
    return engine


@pytest.fixture
def sessions(engine):
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def signup(sessions, email):
    with sessions.begin() as session:
        emit(session, "user.signed_up", {"email": email})
"""


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


def suite(folder: Path, **files: str) -> Path:
    folder.mkdir()
    for name, source in files.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return folder


def test_the_plugin_is_registered_under_its_entry_point():
    (found,) = [e for e in entry_points(group="pytest11") if e.name == "outbox"]
    assert found.value == "outbox.pytest_plugin"


def test_the_fixtures_capture_drain_and_reset_a_shared_test_database(tmp_path):
    folder = suite(
        tmp_path / "app",
        conftest=APP,
        test_app="""
        from conftest import delivered, ob, signup


        def test_one(outbox_reset, outbox_capture, outbox_drain, sessions):
            signup(sessions, "a@example.com")
            outbox_capture.assert_emitted("user.signed_up", payload={"email": "a@example.com"}, count=1)
            assert outbox_drain(ob).delivered == 1
            assert delivered == ["a@example.com"]


        def test_two_starts_from_an_empty_outbox(outbox_reset, outbox_capture, outbox_drain, sessions):
            assert "outbox_attempt" in outbox_reset
            outbox_capture.assert_nothing_emitted()
            signup(sessions, "b@example.com")
            assert outbox_drain(ob).delivered == 1, "only this test's message: the reset took the first"
        """,
    )
    done = run_pytest(folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_without_outbox_database_a_fixture_says_what_to_define_and_other_tests_are_untouched(tmp_path):
    folder = suite(
        tmp_path / "app",
        test_app="""
        def test_needs_the_database(outbox_capture):
            pass


        def test_does_not_use_the_plugin():
            assert True
        """,
    )
    done = run_pytest(folder, "-rfE")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 1 error" in done.stdout
    assert "define a fixture named outbox_database in your conftest.py" in done.stdout


def test_loading_the_plugin_imports_nothing_optional():
    check = (
        "import sys, outbox.pytest_plugin\n"
        "print(sorted(m for m in sys.modules if m.startswith(('outbox.testing', 'outbox.relay', "
        "'outbox.integrations', 'sqlalchemy.ext.asyncio', 'alembic', 'httpx', 'greenlet'))))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_plugin_can_be_turned_off(tmp_path):
    folder = suite(tmp_path / "app", test_app="def test_x(outbox_capture):\n    pass\n")
    done = run_pytest(folder, "-p", "no:outbox")
    assert "fixture 'outbox_capture' not found" in done.stdout
