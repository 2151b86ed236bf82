"""The ``outbox-relay`` command as users run it: a subprocess, its exit code, what it prints.

Exit codes: 0 clean stop or ``--once`` drained, 1 database unreachable or not migrated, 2 bad usage
or an ``--app`` that cannot be loaded, 130 ``--once`` interrupted by Ctrl-C. User mistakes get one
line, never a traceback.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from relayproc import APPS, RelayProcess, relay_command, relay_env, wait_until
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import emit
from outbox._first_line import first_line
from outbox.relay.logs import QUIETED, configure

sys.path.insert(0, str(APPS))
import counting_app  # noqa: E402  (the module the relay subprocesses serve)

m = outbox.outbox_message
a = outbox.outbox_attempt

APP = "counting_app:ob"


def run_relay(
    *args: str, cwd: Path, database_url: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*relay_command(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=relay_env(database_url, **env),
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], code: int, *needles: str, usage: bool = False
) -> str:
    """The exit code, no traceback, and stderr exactly one line saying what went wrong.

    A usage error (``usage=True``) points at ``--help`` instead of printing argparse's usage block.
    """
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    (problem,) = lines
    assert problem.startswith("outbox-relay: "), result.stderr
    if usage:
        assert problem.startswith("outbox-relay: error: "), problem
        assert problem.endswith("(see outbox-relay --help)"), problem
    for needle in needles:
        assert needle in problem, problem
    return problem


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "outbox.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--database-url", "sqlite://"], "--app is required"),
        (["--app", APP], "--database-url is required"),
        (["--app", APP, "--database-url", "sqlite://", "--concurrency", "lots"], "--concurrency"),
        (["--app", APP, "--database-url", "sqlite://", "--concurrency", "0"], "--concurrency"),
        (["--app", APP, "--database-url", "sqlite://", "--poll-interval", "-1"], "--poll-interval"),
        (["--app", APP, "--database-url", "sqlite://", "--frobnicate"], "--frobnicate"),
        (["--app", APP, "--database-url", "no-such-scheme"], "not a SQLAlchemy database URL"),
        (["--app", APP, "--database-url", "sqlite://", "--queue-concurrency", "reports"], "QUEUE=N"),
        (["--app", APP, "--database-url", "sqlite://", "--queue-concurrency", "reports=0"], ">= 1"),
        (["--app", APP, "--database-url", "sqlite://", "--queue-concurrency", "=3"], "QUEUE=N"),
        (["--app", APP, "--database-url", "sqlite://", "--queue-concurrency", "reports=two"], "'two'"),
    ]
    + [
        (["--app", APP, "--database-url", "sqlite://", *flag], needle)
        for flag, needle in (
            (["--metrics-port", "70000"], "--metrics-port: must be at most 65535"),
            (["--poll-interval", "nan"], "--poll-interval: expected a finite number"),
            (["--lease", "inf"], "--lease: expected a finite number"),
            (["--grace-period", "1e400"], "--grace-period: expected a finite number"),
            (["--lease", "1e12"], "--lease: must be at most 31536000"),
            (["--concurrency", "9" * 20], "--concurrency: must be at most 2147483647"),
            (["--batch-size", "9" * 5000], "--batch-size: must be at most 2147483647"),
            (["--concurrency", "\u0663"], "--concurrency: expected a number"),
            (["--lease", "\uff13\uff10"], "--lease: expected a number"),
            (["--queue-concurrency", "reports=" + "9" * 20], "must be at most 2147483647"),
            (["--queue-concurrency", "bulk jobs=2"], "whitespace"),
            (["--queue", "\udcff"], "--queue: '\\xff' is not valid UTF-8"),
            (["--queue", "q" * 256], "at most 255 characters"),
            (["--relay-id", "r\udcff"], "--relay-id: 'r\\xff' is not valid UTF-8"),
            (["--metrics-host", "\udcff", "--metrics-port", "0"], "--metrics-host"),
            (["--queue-concurrency", "\udcff=1"], "--queue-concurrency"),
        )
    ]
    + [(["--app", APP, "--database-url", "sqlite:///\udcff.db"], "--database-url is not valid UTF-8")],
    ids=[
        "no-app",
        "no-url",
        "concurrency-text",
        "concurrency-zero",
        "negative-poll",
        "unknown-flag",
        "bad-url",
        "queue-cap-no-number",
        "queue-cap-zero",
        "queue-cap-no-queue",
        "queue-cap-text",
        "metrics-port-past-65535",
        "poll-nan",
        "lease-inf",
        "grace-overflows-to-inf",
        "lease-past-a-year",
        "concurrency-past-int4",
        "batch-size-5000-digits",
        "concurrency-in-arabic-indic-digits",
        "lease-in-fullwidth-digits",
        "queue-cap-past-int4",
        "queue-cap-bad-name",
        "queue-not-utf8",
        "queue-too-long",
        "relay-id-not-utf8",
        "metrics-host-not-utf8",
        "queue-cap-name-not-utf8",
        "url-not-utf8",
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, args, needle):
    assert_one_line_error(run_relay(*args, cwd=tmp_path), 2, needle, usage=True)


@pytest.mark.parametrize("value", ["reports", "reports=2,mail=0", "=3"])
def test_a_bad_queue_concurrency_from_the_environment_exits_2_with_one_line(tmp_path, value):
    result = run_relay(
        "--app", APP, "--database-url", "sqlite://", cwd=tmp_path, OUTBOX_QUEUE_CONCURRENCY=value
    )
    assert_one_line_error(result, 2, "OUTBOX_QUEUE_CONCURRENCY", usage=True)


@pytest.mark.parametrize(
    ("app", "needle"),
    [
        ("nosuchmodule:ob", "cannot import 'nosuchmodule'"),
        ("counting_app:missing", "has no attribute 'missing'"),
        ("counting_app:EVENT", "not an outbox.Outbox"),
        ("counting_app", "module:attribute"),
    ],
)
def test_an_app_that_cannot_be_loaded_exits_2_with_one_line(tmp_path, sqlite_url, app, needle):
    result = run_relay("--app", app, "--database-url", sqlite_url, cwd=tmp_path)
    assert_one_line_error(result, 2, needle)


def test_an_unreachable_database_exits_1_with_one_line(tmp_path):
    url = "postgresql+psycopg://postgres@127.0.0.1:1/x"
    result = run_relay("--app", APP, "--database-url", url, cwd=tmp_path)
    assert_one_line_error(result, 1, "cannot reach the database", "127.0.0.1:1")


@pytest.mark.parametrize(
    ("flag", "env"),
    [(["--queue", "\udcff"], {}), ([], {"OUTBOX_QUEUES": "mail,\udcff"}), (["--relay-id", "\udcff"], {})],
    ids=["queue-flag", "queues-env", "relay-id"],
)
def test_text_that_is_not_utf_8_is_refused_before_the_database_sees_it(database_url, tmp_path, flag, env):
    """Bytes that are not UTF-8 in argv or the environment once crashed the relay in the driver."""
    result = run_relay("--app", APP, "--database-url", database_url, "--once", *flag, cwd=tmp_path, **env)
    assert_one_line_error(result, 2, "not valid UTF-8", usage=True)


def test_a_database_without_the_outbox_tables_exits_1_pointing_at_outbox_migrate(tmp_path, empty_url):
    result = run_relay("--app", APP, "--database-url", empty_url, cwd=tmp_path)
    assert_one_line_error(result, 1, "outbox tables are missing", "outbox migrate")


def _emit(engine, numbers: range, **options) -> None:
    factory = sessionmaker(engine)
    counting_app.ob.install(factory)
    try:
        with factory() as s, s.begin():
            for n in numbers:
                emit(s, counting_app.EVENT, {"n": n}, **options)
    finally:
        counting_app.ob.uninstall(factory)


def test_once_delivers_what_is_due_and_exits_0(engine, database_url, tmp_path):
    counting_app.delivery_log.create(engine)
    _emit(engine, range(3))
    _emit(engine, range(3, 4), delay=3600)
    result = run_relay(
        "--app", APP, "--database-url", database_url, "--once", cwd=tmp_path, database_url=database_url
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "outbox-relay: delivered 3, retrying 0, dead 0"
    with engine.connect() as conn:
        rows = {r.payload["n"]: r for r in conn.execute(select(m))}
        logged = sorted(conn.execute(select(counting_app.delivery_log.c.message_id)).scalars())
    assert [r.status for r in rows.values()].count("delivered") == 3
    assert (rows[3].status, rows[3].attempts) == ("pending", 0), "not due yet: left alone"
    assert logged == sorted(r.id for r in rows.values() if r.status == "delivered")


def test_json_logs_are_one_object_per_line_each_with_an_action(sqlite_url, tmp_path):
    engine = create_engine(sqlite_url)
    try:
        counting_app.delivery_log.create(engine)
        _emit(engine, range(2))
    finally:
        engine.dispose()
    result = run_relay(
        *("--app", APP, "--database-url", sqlite_url, "--once", "--log-format", "json"),
        cwd=tmp_path,
        database_url=sqlite_url,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert records and all(isinstance(r, dict) and r.get("action") for r in records), result.stderr
    delivered = [r for r in records if r["action"] == "deliver"]
    assert len(delivered) == 2 and {r["handler"] for r in delivered} == {"counter"}
    assert all(isinstance(r["message_id"], int) and r["level"] == "info" for r in delivered)
    (summary,) = [r for r in records if r["action"] == "drained"]
    assert (summary["delivered"], summary["retried"], summary["dead"]) == (2, 0, 0)


def _emit_probes(engine, queues: dict[str, int]) -> None:
    factory = sessionmaker(engine)
    counting_app.ob.install(factory)
    try:
        with factory() as s, s.begin():
            for queue, count in queues.items():
                for _ in range(count):
                    emit(s, counting_app.PROBE_EVENT, {"queue": queue}, queue=queue)
    finally:
        counting_app.ob.uninstall(factory)


def _probe_starts(directory: Path, queue: str) -> int:
    return len(list(directory.glob(f"started-{queue}-*")))


@pytest.mark.parametrize("source", ["flag", "env"])
def test_queue_concurrency_caps_one_queue_while_the_others_flow(engine, database_url, tmp_path, source):
    probe = tmp_path / "probe"
    probe.mkdir()
    _emit_probes(engine, {"reports": 6, "mail": 4})
    cap = ("--queue-concurrency", "reports=2") if source == "flag" else ()
    env = {"OUTBOX_QUEUE_CONCURRENCY": "reports=2"} if source == "env" else {}
    relay = RelayProcess(
        database_url,
        ["--concurrency", "10", "--poll-interval", "0.2", *cap],
        log_path=tmp_path / "relay.log",
        env={"COUNTING_PROBE_DIR": str(probe), **env},
    )
    try:
        # Evidence first: all of mail and the capped two of reports are held running together.
        wait_until(
            lambda: _probe_starts(probe, "mail") == 4 and _probe_starts(probe, "reports") >= 2,
            "mail and reports deliveries to start",
            relays=[relay],
        )
        (probe / "go").touch()
        wait_until(
            lambda: _statuses(engine) == {"delivered"} and _probe_starts(probe, "reports") == 6,
            "every probe delivered",
            relays=[relay],
        )
        relay.signal(signal.SIGTERM)
        assert relay.wait(20) == 0, relay.tail()
    finally:
        relay.kill()
    peaks = {q: int((probe / f"peak-{q}").read_text()) for q in ("reports", "mail")}
    assert peaks == {"reports": 2, "mail": 4}, "never more than 2 of reports at once; all of mail together"


def _statuses(engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(select(m.c.status)).scalars())


def test_once_interrupted_by_ctrl_c_exits_130_with_one_line_and_hands_the_message_back(
    engine, database_url, tmp_path
):
    counting_app.delivery_log.create(engine)
    _emit(engine, range(1))
    started = tmp_path / "started"
    started.mkdir()
    relay = RelayProcess(
        database_url,
        # The CLI's own line is the subject; ERROR keeps the relay's warning about the cancel off stderr.
        ["--once", "--log-format", "text", "--log-level", "ERROR"],
        log_path=tmp_path / "relay.log",
        env={"COUNTING_GATE": str(tmp_path / "never"), "COUNTING_STARTED_DIR": str(started)},
    )
    try:
        wait_until(lambda: list(started.iterdir()), "the handler to start", relays=[relay])
        relay.signal(signal.SIGINT)
        assert relay.wait(30) == 130, relay.tail()
    finally:
        relay.kill()
    output = relay.text()
    assert "Traceback" not in output, output
    assert output.strip().splitlines() == [
        "outbox-relay: interrupted; unfinished messages were handed back (or return when their lease ends)"
    ]
    with engine.connect() as conn:
        row = conn.execute(select(m)).one()
        tried = [(h.attempt, h.outcome, h.error_type) for h in conn.execute(select(a))]
        effects = conn.execute(select(counting_app.delivery_log)).all()
    assert (row.status, row.attempts, row.locked_by, row.locked_until) == ("pending", 1, None, None)
    assert tried == [(1, "failed", "Cancelled")], "the interrupted attempt is on record, not left running"
    assert effects == []


def test_a_bug_in_the_app_module_names_its_file_and_line_and_debug_shows_the_traceback(tmp_path, sqlite_url):
    (tmp_path / "buggy_app.py").write_text(
        "from outbox import Outbox\n\nob = Outbox()\nrate = undefined_setting * 2\n"
    )
    (tmp_path / "needy_app.py").write_text("import nosuchdependency\n")
    where = f"{tmp_path / 'buggy_app.py'}:4"
    result = run_relay("--app", "buggy_app:ob", "--database-url", sqlite_url, "--once", cwd=tmp_path)
    assert_one_line_error(result, 2, "importing 'buggy_app' raised NameError at", where, "undefined_setting")
    result = run_relay("--app", "needy_app:ob", "--database-url", sqlite_url, "--once", cwd=tmp_path)
    assert_one_line_error(
        result, 2, f"importing 'needy_app' failed at {tmp_path / 'needy_app.py'}:1", "nosuchdependency"
    )

    debug = run_relay(
        "--app", "buggy_app:ob", "--database-url", sqlite_url, "--once", "--log-level", "DEBUG", cwd=tmp_path
    )
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr and 'buggy_app.py", line 4' in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("outbox-relay: --app buggy_app:ob: importing")


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://postgres@127.0.0.1:1/x", "sqlite:////nonexistent-dir/outbox.db"]
)
def test_once_on_a_database_it_cannot_reach_says_only_that(tmp_path, url):
    """No warning about outcomes it could not record: a drain that never started has none."""
    result = run_relay("--app", APP, "--database-url", url, "--once", cwd=tmp_path)
    assert_one_line_error(result, 1, "cannot reach the database")


def test_httpx_request_lines_are_kept_out_of_the_relay_log_unless_debugging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level for n in QUIETED}
    try:
        configure("INFO", "text")
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("httpcore").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("outbox.relay").getEffectiveLevel() == logging.INFO
        configure("DEBUG", "json")
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.DEBUG
    finally:
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for name, value in levels.items():
            logging.getLogger(name).setLevel(value)


def test_an_error_is_quoted_by_its_first_line_without_the_statement_or_its_parameters(tmp_path):
    """What logs and the commands print for a database error: never the SQL's parameters (secrets)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    secret = "hunter2-" + uuid.uuid4().hex
    with engine.connect() as conn, pytest.raises(DBAPIError) as raised:
        conn.execute(text("INSERT INTO missing_table VALUES (:password)"), {"password": secret})
    engine.dispose()
    assert secret in str(raised.value)  # SQLAlchemy's own message quotes it on a later line
    assert first_line(raised.value) == "no such table: missing_table"

    class Mute(Exception):
        def __str__(self) -> str:
            raise RuntimeError("cannot say")

    assert first_line(Mute()) == "Mute"
    assert first_line(ValueError("   ")) == "ValueError"
    assert first_line(ValueError("first\nsecond")) == "first"
