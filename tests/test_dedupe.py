"""A duplicate key drops an event for its route, never silently: signal, log line and count, on every path."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Outbox, emit, signals
from outbox._write import pipeline as _pipeline

m = outbox.outbox_message


@pytest.fixture
def ob() -> Outbox:
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="receipt")
    ob.route("order.paid", lambda msg: None, name="warehouse")
    ob.route("order.refunded", lambda msg: None, name="refunds")
    return ob


@pytest.fixture
def heard(ob: Outbox) -> Iterator[list[dict[str, Any]]]:
    """What ``event_deduplicated`` said for ``ob``, in order."""
    found: list[dict[str, Any]] = []

    def receiver(sender: Outbox, **kw: Any) -> None:
        assert sender is ob
        found.append(kw)

    signals.event_deduplicated.connect(receiver, sender=ob)
    yield found
    signals.event_deduplicated.disconnect(receiver, sender=ob)


def ids(engine: Engine) -> dict[tuple[str, str | None], int]:
    with engine.connect() as conn:
        return {(r.handler, r.idempotency_key): r.id for r in conn.execute(select(m))}


def summary(heard: list[dict[str, Any]]) -> list[tuple[str, str, int | None]]:
    return [(kw["route"], kw["key"], kw["existing_id"]) for kw in heard]


def test_a_duplicate_across_transactions_is_signalled_logged_and_counted(engine, ob, maker, heard, caplog):
    with maker.begin() as s:
        first = emit(s, "order.paid", {"n": 1}, key="order:7")
    assert heard == [] and ob.deduplicated == {}
    stored = ids(engine)
    with caplog.at_level(logging.DEBUG, "outbox.write"), maker.begin() as s:
        again = emit(s, "order.paid", {"n": 2}, key="order:7")
        emit(s, "order.paid", {"n": 3}, key="order:8")  # new: stored, not announced
        assert heard == [], "announced once the transaction commits, not before"
    assert again == first
    assert summary(heard) == [
        ("receipt", "order:7", stored[("receipt", "order:7")]),
        ("warehouse", "order:7", stored[("warehouse", "order:7")]),
    ]
    assert {kw["event_id"] for kw in heard} == {first}
    assert {kw["event_type"] for kw in heard} == {"order.paid"}
    assert all(isinstance(kw["session"], Session) for kw in heard)
    assert ob.deduplicated == {"receipt": 1, "warehouse": 1}
    lines = [r for r in caplog.records if getattr(r, "action", None) == "deduplicated"]
    assert [(r.levelno, r.handler, r.message_id, r.event_id) for r in lines] == [
        (logging.DEBUG, "receipt", stored[("receipt", "order:7")], str(first)),
        (logging.DEBUG, "warehouse", stored[("warehouse", "order:7")], str(first)),
    ]
    assert "key 'order:7' is already held by message" in lines[0].getMessage()
    assert len(ids(engine)) == 4


def test_duplicates_within_one_transaction_in_one_write_or_across_flushes(engine, ob, maker, heard):
    with maker.begin() as s:
        emit(s, "order.paid", {}, key="a")
        emit(s, "order.paid", {}, key="a")  # the same INSERT: the second row is dropped
        s.flush()
        emit(s, "order.paid", {}, key="a")  # a later write meets the flushed row
        emit(s, "order.refunded", {}, key="a")  # another route: not a duplicate
    stored = ids(engine)
    assert summary(heard) == [
        ("receipt", "a", stored[("receipt", "a")]),
        ("warehouse", "a", stored[("warehouse", "a")]),
        ("receipt", "a", stored[("receipt", "a")]),
        ("warehouse", "a", stored[("warehouse", "a")]),
    ]
    assert ob.deduplicated == {"receipt": 2, "warehouse": 2}
    assert sorted(stored) == [("receipt", "a"), ("refunds", "a"), ("warehouse", "a")]


def test_a_rolled_back_transaction_announces_nothing(engine, ob, maker, heard):
    with maker.begin() as s:
        emit(s, "order.paid", {}, key="k")
    with maker() as s:
        emit(s, "order.paid", {}, key="k")
        s.flush()  # dropped here ...
        s.rollback()  # ... by a transaction that stored nothing
    assert heard == [] and ob.deduplicated == {}


def test_a_savepoint_rolled_back_after_the_write_announces_the_rewrite_once(engine, ob, maker, heard):
    with maker.begin() as s:
        emit(s, "order.paid", {}, key="k")
    with maker.begin() as s:
        emit(s, "order.paid", {}, key="k")  # the outer transaction's event
        with pytest.raises(ValueError), s.begin_nested():
            s.flush()  # written (and dropped) inside the savepoint
            emit(s, "order.paid", {}, key="inner")
            s.flush()
            raise ValueError
        # The savepoint's rollback took the write away: the commit writes the event again.
    assert [(kw["route"], kw["key"]) for kw in heard] == [("receipt", "k"), ("warehouse", "k")]
    assert sorted(ids(engine)) == [("receipt", "k"), ("warehouse", "k")]


def test_placeholder_keys_are_announced_as_stored(engine, maker, heard):
    from test_keys import Base, Order

    Base.metadata.create_all(engine)
    ob = Outbox()
    ob.route("order.placed", lambda msg: None, name="placed")
    factory = sessionmaker(engine, expire_on_commit=False)
    ob.install(factory)
    try:
        seen: list[Any] = []
        signals.event_deduplicated.connect(lambda sender, **kw: seen.append(kw), sender=ob, weak=False)
        with factory.begin() as s:
            order = Order()
            s.add(order)
            order.emit("order.placed", {}, key="placed:{aggregate_id}")
            order.emit("order.placed", {}, key="placed:{aggregate_id}")
        assert [(kw["key"], kw["route"]) for kw in seen] == [(f"placed:{order.id}", "placed")]
    finally:
        ob.uninstall(factory)


def test_a_write_without_keys_asks_nothing_more(engine, ob):
    quiet = Outbox(pipeline_writes=False)
    quiet.route("order.paid", lambda msg: None, name="receipt")
    factory = sessionmaker(engine)
    quiet.install(factory)
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "outbox_message" in statement:
            seen.append(statement)

    try:
        with factory.begin() as s:
            emit(s, "order.paid", {})
        with factory.begin() as s:
            emit(s, "order.paid", {}, key="k")
    finally:
        quiet.uninstall(factory)
    assert len(seen) == 2
    assert "RETURNING" not in seen[0], "a batch without a key cannot conflict"
    assert "RETURNING handler, idempotency_key" in seen[1].replace('"', "")


def test_a_session_joined_to_an_outer_transaction_reads_the_holder_inside_it(engine, ob, heard):
    outbox.enable_sqlite_savepoints(engine)  # the rollback-per-test fixture needs real savepoints
    factory = sessionmaker(join_transaction_mode="create_savepoint")
    ob.install(factory)
    try:
        with engine.connect() as conn:
            conn.begin()
            with factory(bind=conn) as s:
                emit(s, "order.paid", {}, key="k")
                emit(s, "order.paid", {}, key="k")
                s.commit()  # the session's savepoint only
            assert conn.in_transaction()
            inside = {r.handler: r.id for r in conn.execute(select(m.c.handler, m.c.id))}
            assert summary(heard) == [
                ("receipt", "k", inside["receipt"]),
                ("warehouse", "k", inside["warehouse"]),
            ]
            assert conn.execute(select(func.count()).select_from(m)).scalar_one() == 2
            conn.rollback()  # the test's rollback: nothing stays
    finally:
        ob.uninstall(factory)
    assert ids(engine) == {}


# -- the commit's pipelined write on psycopg -----------------------------------------------------


#: psycopg prepares a statement on its sixth run (``prepare_threshold`` is 5 by default).
PREPARED_AFTER = 6


@pytest.mark.parametrize("path", ["psycopg Pipeline", "prepared, through libpq"])
def test_the_pipelined_commit_announces_what_it_dropped(pg_engine, ob, heard, monkeypatch, path):
    factory = sessionmaker(pg_engine)
    ob.install(factory)
    direct: list[object] = []
    real = _pipeline.DirectBatch

    def spy(raw: object, statement: Any) -> object:
        direct.append(statement)
        return real(raw, statement)  # type: ignore[arg-type]

    monkeypatch.setattr(_pipeline, "DirectBatch", spy)
    try:
        if path.startswith("prepared"):
            for n in range(PREPARED_AFTER):  # both shapes below: one keyed row, and two
                with factory.begin() as s:
                    emit(s, "order.refunded", {}, key=f"warm-up {n}")
                with factory.begin() as s:
                    emit(s, "order.refunded", {}, key=f"warm-up {n}")
                    emit(s, "order.refunded", {}, key=f"warm-up {n}b")
            heard.clear()
            direct.clear()
        with factory.begin() as s:
            emit(s, "order.refunded", {}, key="r1")
        with factory.begin() as s:
            emit(s, "order.refunded", {}, key="r1")
            emit(s, "order.refunded", {}, key="r2")
    finally:
        ob.uninstall(factory)
    assert bool(direct) is path.startswith("prepared"), "the path this case is about was taken"
    assert summary(heard) == [("refunds", "r1", ids(pg_engine)[("refunds", "r1")])]
    assert ("refunds", "r2") in ids(pg_engine)


def test_the_pipelined_commit_still_raises_a_refused_insert(pg_engine, ob, heard):
    with pg_engine.begin() as conn:
        conn.execute(
            text("ALTER TABLE outbox_message ADD CONSTRAINT refuse_bad CHECK (payload->>'bad' IS NULL)")
        )
    factory = sessionmaker(pg_engine)
    ob.install(factory)
    try:
        with factory.begin() as s:
            emit(s, "order.refunded", {}, key="r1")
        with pytest.raises(Exception, match="refuse_bad"), factory.begin() as s:
            emit(s, "order.refunded", {}, key="r1")
            emit(s, "order.refunded", {"bad": 1}, key="r2")
    finally:
        ob.uninstall(factory)
    assert heard == [], "a commit that failed stored nothing, and announces nothing"


# -- the Core write: asyncio drivers, and SQLite through aiosqlite -----------------------------------


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])
def test_async_postgresql_drivers_announce_duplicates(pg_url, ob, heard, driver):
    _async_duplicates(make_url(pg_url).set(drivername=f"postgresql+{driver}"), ob, heard)


def test_aiosqlite_announces_duplicates(sqlite_template, tmp_path, ob, heard):
    shutil.copy(sqlite_template, tmp_path / "test.db")
    _async_duplicates(make_url(f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"), ob, heard)


def _async_duplicates(url: Any, ob: Outbox, heard: list[dict[str, Any]]) -> None:
    async def go() -> None:
        engine = create_async_engine(url)
        maker = async_sessionmaker(engine)
        ob.install(maker)
        try:
            for _ in range(2):
                async with maker() as s, s.begin():
                    emit(s, "order.refunded", {}, key="r1")
        finally:
            ob.uninstall(maker)
            await engine.dispose()

    asyncio.run(go())
    sync = create_engine(url.set(drivername=url.drivername.split("+")[0]))
    try:
        assert summary(heard) == [("refunds", "r1", ids(sync)[("refunds", "r1")])]
    finally:
        sync.dispose()


# -- a login that may not read message ids -----------------------------------------------------------


def test_a_login_without_select_on_id_still_commits_and_hears_of_the_duplicate(pg_url, ob, heard):
    """The application role of the least-privilege guide before it granted SELECT (id)."""
    role = f"dedupe_app_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA public TO {role}"))
        conn.execute(
            text(
                "GRANT INSERT (event_id, event_type, handler, queue, priority, payload, headers,"
                " aggregate_type, aggregate_id, idempotency_key, group_key, max_attempts, available_at,"
                f" created_at, updated_at, expires_at) ON outbox_message TO {role}"
            )
        )
        conn.execute(text(f"GRANT SELECT (handler, idempotency_key) ON outbox_message TO {role}"))
    app = create_engine(make_url(pg_url).set(username=role, password=None))
    try:
        factory = sessionmaker(app)
        ob.install(factory)
        for _ in range(2):
            with factory.begin() as s:
                emit(s, "order.refunded", {}, key="r1")
        outer = sessionmaker(join_transaction_mode="create_savepoint")
        ob.install(outer)
        with app.connect() as conn:
            conn.begin()
            with outer(bind=conn) as s:
                emit(s, "order.refunded", {}, key="r1")
                emit(s, "order.refunded", {}, key="r3")
                s.commit()
            conn.commit()  # the outer transaction was not aborted by the refused SELECT
        ob.uninstall(outer)
        ob.uninstall(factory)
    finally:
        app.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()
    assert summary(heard) == [("refunds", "r1", None), ("refunds", "r1", None)]
    assert sorted(ids(create_engine(pg_url))) == [("refunds", "r1"), ("refunds", "r3")]


def test_the_emitting_guides_dedupe_example_prints_what_it_shows(tmp_path):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "emitting.md").read_text()
    (shop,) = re.findall(r"```python\n(# file: shop\.py\n.*?)```", guide, re.S)
    found = re.findall(
        r"```python\n(# dedupe\.py\n.*?)```\n\n```console\n\$ python dedupe\.py\n(.*?)```", guide, re.S
    )
    assert len(found) == 1, "emitting.md should hold one example '# dedupe.py' followed by its output"
    code, output = found[0]
    (tmp_path / "shop.py").write_text(shop)
    (tmp_path / "dedupe.py").write_text(code)
    run = subprocess.run(
        [sys.executable, "dedupe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == output.splitlines()
