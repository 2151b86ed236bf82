"""History in daily partitions on PostgreSQL (outbox_0024): the migration, the guards, the purge.

``outbox_attempt`` is range-partitioned on ``started_at``, a partition per UTC
day plus a DEFAULT one. What a user relies on: the migration keeps every row
and id both ways, history stays append-only on every partition, no write is
lost for want of a partition, relays make the coming days' partitions, and a
purge removes whole old days (no dead tuples left) while still recording
itself, respecting the floor and keeping unresolved messages' history.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, func, insert, select, text, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

import outbox
from outbox import ops
from outbox.relay import Relay

m, a, run = outbox.outbox_message, outbox.outbox_attempt, outbox.outbox_retention_run
APPEND_ONLY = "outbox_attempt is append-only"
YEAR = timedelta(days=365)


def _today() -> date:
    return datetime.now(UTC).date()


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def _partitions(engine: Engine) -> dict[str, tuple[datetime, datetime]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT part::text, lower_bound, upper_bound FROM outbox_attempt_partitions()")
        )
        return {name: (low, high) for name, low, high in rows}


def _part(day: date) -> str:
    return f"outbox_attempt_p{day:%Y%m%d}"


def _history(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(a).order_by(a.c.id))]


def _where(engine: Engine) -> dict[int, str]:
    """Each history row's partition."""
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, tableoid::regclass::text FROM outbox_attempt")).all())


def _messages(engine: Engine, statuses: list[str]) -> list[int]:
    now = datetime.now(UTC)
    rows = [
        {
            "event_id": uuid.uuid4(),
            "event_type": "t",
            "handler": "h",
            "queue": "default",
            "payload": {},
            "headers": {},
            "status": status,
            "priority": 0,
            "max_attempts": 5,
            "available_at": now,
            "created_at": now,
            "updated_at": now,
        }
        for status in statuses
    ]
    with engine.begin() as conn:
        return list(conn.execute(insert(m).returning(m.c.id), rows).scalars())


def _attempts(engine: Engine, message_ids: list[int], started_at: datetime) -> list[int]:
    """History rows as the owner writes them (only the owner may insert directly), a microsecond apart."""
    rows = [
        {
            "message_id": mid,
            "attempt": 1,
            "outcome": "retry",
            "started_at": started_at + timedelta(microseconds=n),
            "finished_at": started_at + timedelta(microseconds=n),
        }
        for n, mid in enumerate(message_ids)
    ]
    with engine.begin() as conn:
        return list(conn.execute(insert(a).returning(a.c.id), rows).scalars())


def test_the_migration_moves_history_into_day_partitions_and_back_keeping_rows_and_ids(empty_pg_url):
    outbox.upgrade(empty_pg_url, "outbox_0023")
    engine = create_engine(empty_pg_url)
    try:
        ids = _messages(engine, ["delivered", "pending"])
        now = datetime.now(UTC)
        _attempts(engine, ids, now - timedelta(days=40))
        _attempts(engine, ids, now - timedelta(days=3))
        _attempts(engine, ids, now)
        before = _history(engine)
        last_id = max(r[0] for r in before)

        outbox.upgrade(empty_pg_url)

        assert _history(engine) == before, "every row, id and value kept"
        where = _where(engine)
        for row in before:
            assert where[row[0]] == _part(row[4].astimezone(UTC).date()), row
        days = {low.date() for low, _ in _partitions(engine).values()}
        first = (now - timedelta(days=40)).date()
        assert days == {first + timedelta(days=n) for n in range((_today() - first).days + 8)}
        (new_id,) = _attempts(engine, ids[:1], now + timedelta(seconds=1))
        assert new_id == last_id + 1, "the identity sequence carries on"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox_attempt_default")).scalar_one() == 0

        outbox.downgrade(empty_pg_url, "outbox_0023")

        assert _history(engine)[:-1] == before and _history(engine)[-1][0] == new_id
        with engine.connect() as conn:
            kind = conn.execute(text("SELECT relkind FROM pg_class WHERE relname = 'outbox_attempt'"))
            leftovers = conn.execute(
                text(
                    "SELECT count(*) FROM pg_class"
                    " WHERE relname ~ '^outbox_attempt_(p[0-9]|default)' AND relkind = 'r'"
                )
            )
            kind, leftovers = kind.scalar(), leftovers.scalar()
        assert (kind, leftovers) == ("r", 0)
        (after_down,) = _attempts(engine, ids[:1], now + timedelta(seconds=2))
        assert after_down == new_id + 1
        with pytest.raises(DBAPIError, match=APPEND_ONLY), engine.begin() as conn:
            conn.execute(update(a).values(reason="x"))
    finally:
        engine.dispose()


def test_history_stays_append_only_on_every_partition(pg_engine):
    (mid,) = _messages(pg_engine, ["delivered"])
    _attempts(pg_engine, [mid], datetime.now(UTC))
    _attempts(pg_engine, [mid], datetime.now(UTC) + timedelta(days=400))  # no partition: DEFAULT
    where = set(_where(pg_engine).values())
    assert where == {_part(_today()), "outbox_attempt_default"}
    for table in ("outbox_attempt", *sorted(where)):
        for statement, refused in (
            (f"UPDATE {table} SET reason = 'rewritten'", "UPDATE is not allowed"),
            (f"DELETE FROM {table}", "DELETE is not allowed"),
            (f"TRUNCATE {table}", "TRUNCATE is not allowed"),
        ):
            with pytest.raises(DBAPIError, match=refused), pg_engine.begin() as conn:
                conn.execute(text(statement))
    assert len(_history(pg_engine)) == 2


def test_a_write_without_its_partition_lands_in_default_and_moves_when_the_day_gets_one(pg_engine):
    (mid,) = _messages(pg_engine, ["delivered"])
    far = _today() + timedelta(days=30)
    (row_id,) = _attempts(pg_engine, [mid], _midnight(far) + timedelta(hours=5))
    assert _where(pg_engine) == {row_id: "outbox_attempt_default"}
    before = _history(pg_engine)

    with pg_engine.begin() as conn:
        made = conn.execute(text("SELECT outbox_history_partitions_ahead(31)")).scalar_one()

    assert made == 31 - 7, "today and the next seven existed"
    assert _where(pg_engine) == {row_id: _part(far)}
    assert _history(pg_engine) == before
    with pg_engine.begin() as conn:
        assert conn.execute(text("SELECT outbox_history_partitions_ahead(31)")).scalar_one() == 0


def _drop_partitions(engine: Engine, days: list[date]) -> None:
    """What days passing look like: the coming days have no partition yet (the owner drops them)."""
    with engine.begin() as conn:
        for day in days:
            conn.execute(text(f"DROP TABLE {_part(day)}"))


def test_a_relay_makes_the_coming_days_partitions(pg_engine):
    coming = [_today() + timedelta(days=n) for n in range(1, 8)]
    _drop_partitions(pg_engine, coming)
    assert not any(_part(d) in _partitions(pg_engine) for d in coming)

    ob = outbox.Outbox()
    ob.route("t", lambda msg: None, name="h")
    Relay(ob, pg_engine).run_until_idle()

    assert {_part(_today() + timedelta(days=n)) for n in range(8)} <= set(_partitions(pg_engine))


def _count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def _dead_tuples(engine: Engine) -> dict[str, int]:
    """Dead tuples in every partition left, as pgstattuple counts them (exactly, by reading the pages)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        return {
            name: conn.execute(text("SELECT dead_tuple_count FROM pgstattuple(:t)"), {"t": name}).scalar_one()
            for name in [*_partitions(engine), "outbox_attempt_default"]
        }


@pytest.fixture
def old_history(empty_pg_url: str) -> Iterator[tuple[Engine, dict[str, list[int]]]]:
    """History of ten and three days ago, made before the migration so its day partitions exist."""
    outbox.upgrade(empty_pg_url, "outbox_0023")
    engine = create_engine(empty_pg_url)
    done = _messages(engine, ["delivered"] * 20)
    (waiting,) = _messages(engine, ["pending"])
    now = datetime.now(UTC)
    rows = {
        "ten_days": _attempts(engine, done, now - timedelta(days=10)),
        "waiting_ten_days": _attempts(engine, [waiting], now - timedelta(days=10, seconds=1)),
        "three_days": _attempts(engine, done, now - timedelta(days=3)),
        "today": _attempts(engine, done, now),
    }
    outbox.upgrade(empty_pg_url)
    try:
        yield engine, rows
    finally:
        engine.dispose()


def test_a_purge_drops_whole_old_days_records_itself_and_leaves_no_dead_tuples(old_history):
    engine, rows = old_history
    ten, three = (_today() - timedelta(days=d) for d in (10, 3))
    assert {_part(ten), _part(three)} <= set(_partitions(engine))

    result = ops.purge(engine, delivered_older_than=timedelta(days=365), history_older_than=timedelta(days=2))

    assert result.attempts == 40, "both days' rows, less the pending message's one"
    left = _partitions(engine)
    assert _part(ten) not in left and _part(three) not in left
    assert {_part(_today() - timedelta(days=d)) for d in (0,)} <= set(left)
    with engine.connect() as conn:
        record = conn.execute(select(run).where(run.c.id == result.run_id)).one()
    assert record.attempts_deleted == 40 and record.finished_at is not None
    assert record.db_user == "postgres" and not record.history_of_unresolved
    # The cutoff is the start of the day the asked-for one falls in, and the run says so.
    asked = record.started_at - timedelta(days=2)
    assert record.history_before == _midnight(asked.astimezone(UTC).date())
    # The pending message's history is kept, id and all, in the DEFAULT partition now.
    (kept,) = rows["waiting_ten_days"]
    assert _where(engine) == {**{i: _part(_today()) for i in rows["today"]}, kept: "outbox_attempt_default"}
    assert _dead_tuples(engine) == dict.fromkeys([*left, "outbox_attempt_default"], 0)


def test_a_purge_of_unresolved_history_too_drops_it_with_the_day(old_history):
    engine, rows = old_history

    result = ops.purge(
        engine,
        delivered_older_than=timedelta(days=365),
        history_older_than=timedelta(days=2),
        history_of_unresolved=True,
    )

    assert result.attempts == 41
    assert set(_where(engine)) == set(rows["today"])
    with engine.connect() as conn:
        assert conn.execute(select(run.c.history_of_unresolved)).scalar_one() is True


def test_rows_in_the_default_partition_are_still_purged_row_by_row(old_history):
    engine, rows = old_history
    ops.purge(engine, delivered_older_than=timedelta(days=365), history_older_than=timedelta(days=2))
    (kept,) = rows["waiting_ten_days"]
    with engine.begin() as conn:
        conn.execute(update(m).values(status="delivered"))  # the message is resolved now

    result = ops.purge(engine, delivered_older_than=timedelta(days=365), history_older_than=timedelta(days=2))

    assert result.attempts == 1 and kept not in _where(engine)
    # The contrast: a row deleted row by row leaves a dead tuple until vacuum; a dropped day leaves none.
    assert _dead_tuples(engine)["outbox_attempt_default"] == 1


def test_the_floor_holds_a_purge_never_drops_yesterday_or_today(pg_engine):
    ids = _messages(pg_engine, ["delivered"] * 3)
    now = datetime.now(UTC)
    _attempts(pg_engine, ids, now - timedelta(hours=23))  # yesterday, or earlier today
    _attempts(pg_engine, ids, now)
    before = _history(pg_engine)
    parts = set(_partitions(pg_engine))

    with pytest.raises(ops.OpsError, match="at least 1d"):
        ops.purge(pg_engine, delivered_older_than=timedelta(days=365), history_older_than=timedelta(hours=23))
    with pytest.raises(DBAPIError, match="less than 24 hours ago"), pg_engine.begin() as conn:
        conn.execute(text("SELECT outbox_purge_start('t', interval '365 days', interval '23 hours')"))
    result = ops.purge(pg_engine, delivered_older_than=YEAR, history_older_than=timedelta(days=1))

    assert result.attempts == 0
    assert _history(pg_engine) == before and set(_partitions(pg_engine)) >= parts
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(run)).scalar_one() == 1, "the run is recorded"


def test_only_the_owner_detaches_or_drops_a_partition(pg_url, pg_engine):
    (mid,) = _messages(pg_engine, ["delivered"])
    _attempts(pg_engine, [mid], datetime.now(UTC))
    role = f"parts_{uuid.uuid4().hex[:10]}"
    with pg_engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(text(f'GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_attempt TO "{role}"'))
        conn.execute(text(f'GRANT EXECUTE ON FUNCTION outbox_history_partitions_ahead(integer) TO "{role}"'))
    other = create_engine(make_url(pg_url).set(username=role))
    today = _part(_today())
    try:
        for statement, refused in (
            (f"DROP TABLE {today}", "must be owner"),
            (f"ALTER TABLE outbox_attempt DETACH PARTITION {today}", "must be owner"),
            (f"DELETE FROM {today}", "permission denied"),
            ("DELETE FROM outbox_attempt", APPEND_ONLY),
            (f"TRUNCATE {today}", "permission denied"),
        ):
            with pytest.raises(DBAPIError, match=refused), other.begin() as conn:
                conn.execute(text(statement))
        with other.begin() as conn:  # making partitions ahead is all the function lets it do
            assert conn.execute(text("SELECT outbox_history_partitions_ahead(9)")).scalar_one() == 2
        assert len(_history(pg_engine)) == 1
    finally:
        other.dispose()
        with pg_engine.begin() as conn:
            conn.execute(
                text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
            )
            conn.execute(text(f'DROP OWNED BY "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))
