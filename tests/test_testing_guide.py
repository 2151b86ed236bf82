"""docs/testing.md's examples, run as written: every fixture style, on SQLite and PostgreSQL.

The guide's ``# file: PATH`` blocks are written into a project folder of their
own, and pytest runs each style's folder in a subprocess, with the plugin found
through its entry point and the database named by ``TEST_DATABASE_URL`` (and
``TEST_ASYNC_DATABASE_URL``), as a user's CI would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "testing.md"
#: Each style's folder, and how many tests it holds (a test that silently vanished would fail here).
STYLES = {
    "rollback": 5,
    "rollback_async": 2,
    "database_per_test": 7,
    "shared_database": 2,
    "schema_per_test": 1,
}


def guide_files() -> dict[str, str]:
    blocks = re.findall(r"```python\n# file: (\S+)\n(.*?)```", GUIDE.read_text(), re.S)
    return dict(blocks)


def write_project(folder: Path) -> None:
    for name, source in guide_files().items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def async_url(url: str) -> str:
    parsed = make_url(url)
    driver = "sqlite+aiosqlite" if parsed.get_backend_name() == "sqlite" else "postgresql+asyncpg"
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def run_style(folder: Path, style: str, url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTEST_"))}
    env.update(TEST_DATABASE_URL=url, TEST_ASYNC_DATABASE_URL=async_url(url))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", style],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{STYLES[style]} passed in .*", summary), summary


def test_the_guide_has_a_folder_per_style_and_every_block_is_a_file():
    files = guide_files()
    assert {name.split("/")[0] for name in files if "/" in name} == set(STYLES)
    assert {"app.py", "conftest.py"} <= set(files)
    blocks = re.findall(r"```python\n", GUIDE.read_text())
    assert len(blocks) == len(files), "every Python block of the guide is one of the example's files"


@pytest.mark.parametrize("style", [s for s in STYLES if s != "schema_per_test"])
def test_the_guides_fixture_styles_run_as_written(style, empty_url, tmp_path):
    write_project(tmp_path / "project")
    run_style(tmp_path / "project", style, empty_url)


@pytest.fixture
def empty_pg_url(pg_base_url: str) -> Iterator[str]:
    name = f"outbox_guide_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(pg_base_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def test_the_guides_schema_per_test_style_runs_as_written(empty_pg_url, tmp_path):
    write_project(tmp_path / "project")
    run_style(tmp_path / "project", "schema_per_test", empty_pg_url)
