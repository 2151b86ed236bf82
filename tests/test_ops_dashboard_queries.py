"""The reads a dashboard makes through ``outbox.ops``: capped counts, the breakdown, per-minute activity,
requeue lineage and report runs, on real SQLite and PostgreSQL databases.

Messages are emitted and delivered or failed by a real :class:`~outbox.relay.Relay`, copies are made by
``ops.requeue``, report runs by a real ``ReportJob``: the queries read what the library writes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Integer, String, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from test_ops_cli import FAST, ok_json, run

import outbox
from outbox import Outbox, OutboxMixin, PermanentError, emit, ops
from outbox.integrations.report import ReportJob, outbox_report_chunk, outbox_report_run
from outbox.ops._reports import report_chunk_table, report_run_table
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt


class Base(DeclarativeBase):
    pass


class Order(OutboxMixin, Base):
    __tablename__ = "dashboard_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ref: Mapped[str] = mapped_column(String(20))


@dataclass
class Shop:
    """Mail always delivers; billing fails for good until ``fixed``."""

    url: str
    engine: Engine
    ob: Outbox
    maker: sessionmaker[Session]
    fixed: bool = False

    def emit(self, event_type: str, payload: dict[str, Any], **kw: Any) -> None:
        with self.maker.begin() as s:
            emit(s, event_type, payload, **kw)

    def relay(self) -> Any:
        return Relay(self.ob, self.engine).run_until_idle()

    def id(self, key: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(m.c.id).where(m.c.idempotency_key == key)).scalar_one())


@pytest.fixture
def shop(database_url: str, engine: Engine) -> Iterator[Shop]:
    ob = Outbox(default_backoff=FAST)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    found = Shop(database_url, engine, ob, maker)

    @ob.handler("order.paid", name="invoice", queue="billing", max_attempts=2)
    def invoice(msg: outbox.Message) -> None:
        if not found.fixed:
            raise PermanentError(f"order {msg.payload['order_id']} is unknown to billing")

    @ob.handler("user.signed_up", name="welcome_email", queue="mail")
    def welcome(msg: outbox.Message) -> None:
        pass

    yield found
    ob.uninstall(maker)


# -- aggregate filter and capped count ------------------------------------------------------------


def test_the_aggregate_filter_finds_one_aggregates_messages_in_python_and_on_the_command_line(shop):
    Base.metadata.create_all(shop.engine)
    with shop.maker.begin() as s:
        first, second = Order(id=1, ref="A"), Order(id=11, ref="B")
        s.add_all([first, second])
        first.emit("order.paid", {"order_id": 1}, key="paid:1")
        second.emit("order.paid", {"order_id": 11}, key="paid:11")
        first.emit("user.signed_up", {"user_id": 5}, key="signup:5")
    shop.emit("order.paid", {"order_id": 1}, key="paid:plain")  # same payload, no aggregate
    mine = [shop.id("signup:5"), shop.id("paid:1")]

    where = ops.MessageFilter(aggregate_type="Order", aggregate_id="1")
    assert [r.id for r in ops.list_messages(shop.engine, where)] == mine
    assert ops.count_messages(shop.engine, where) == ops.CappedCount(2, False)
    assert ops.count_messages(shop.engine, ops.MessageFilter(aggregate_type="Order")).count == 3
    assert not ops.MessageFilter(aggregate_id="1").empty, "an aggregate id alone is a filter"
    assert ops.count_messages(shop.engine, ops.MessageFilter(aggregate_id="11")).count == 1

    listed = ok_json(
        run("list", "--aggregate-type", "Order", "--aggregate-id", "1", "--json", database_url=shop.url)
    )
    assert [r["id"] for r in listed] == mine
    # The actions take the same flags: discard one aggregate's pending messages.
    done = ok_json(
        run(
            "discard",
            "--aggregate-type",
            "Order",
            "--aggregate-id",
            "11",
            "--reason",
            "order 11 cancelled",
            "--yes",
            "--json",
            database_url=shop.url,
        )
    )
    assert done == {"discarded": [shop.id("paid:11")]}


def test_a_count_stops_at_its_cap_and_says_so(shop):
    for n in range(6):
        shop.emit("user.signed_up", {"user_id": n}, key=f"signup:{n}")
    shop.emit("order.paid", {"order_id": 1}, key="paid:1")
    engine = shop.engine
    mail = ops.MessageFilter(queue="mail")
    assert ops.count_messages(engine) == ops.CappedCount(7, False)
    assert ops.count_messages(engine, mail, cap=6) == ops.CappedCount(6, False), "exactly the cap"
    assert ops.count_messages(engine, mail, cap=5) == ops.CappedCount(5, True), "cap + 1 rows"
    assert ops.count_messages(engine, cap=1) == ops.CappedCount(1, True)
    assert ops.count_messages(engine, ops.MessageFilter(status="dead")) == ops.CappedCount(0, False)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ops.OpsError, match="cap must be"):
            ops.count_messages(engine, cap=bad)


# -- breakdown ------------------------------------------------------------------------------------------


def test_the_breakdown_counts_by_queue_handler_and_status(shop):
    for n in range(3):
        shop.emit("user.signed_up", {"user_id": n}, key=f"signup:{n}")
    shop.emit("order.paid", {"order_id": 1}, key="paid:1")
    shop.emit("order.paid", {"order_id": 2}, key="paid:2", queue="billing-eu")
    shop.relay()
    shop.emit("user.signed_up", {"user_id": 9}, key="signup:9")
    cells = ops.breakdown(shop.engine)
    assert [(c.queue, c.handler, c.status, c.count) for c in cells] == [
        ("billing", "invoice", "dead", 1),
        ("billing-eu", "invoice", "dead", 1),
        ("mail", "welcome_email", "delivered", 3),
        ("mail", "welcome_email", "pending", 1),
    ]
    with shop.engine.connect() as conn:
        first_signup = conn.execute(
            select(func.min(m.c.created_at)).where(m.c.handler == "welcome_email", m.c.status == "pending")
        ).scalar_one()
    assert cells[3].oldest_created_at == first_signup
    assert [c.requeued for c in cells] == [0, 0, 0, 0]
    ops.requeue(shop.engine, ops.MessageFilter(queue="billing"), reason="retry", actor="ops")
    dead = {(c.queue, c.status): c for c in ops.breakdown(shop.engine, statuses=("dead",))}
    assert (dead["billing", "dead"].count, dead["billing", "dead"].requeued) == (1, 1)
    assert dead["billing-eu", "dead"].requeued == 0
    unfinished = ops.breakdown(shop.engine, statuses=("pending", "running", "dead", "discarded"))
    assert [(c.queue, c.status, c.count) for c in unfinished] == [
        ("billing", "dead", 1),
        ("billing", "pending", 1),  # the requeued copy
        ("billing-eu", "dead", 1),
        ("mail", "pending", 1),
    ]
    assert ops.breakdown(shop.engine, statuses=()) == []
    for bad in (["done"], "dead"):
        with pytest.raises(ops.OpsError, match="statuses must be"):
            ops.breakdown(shop.engine, statuses=bad)


def test_the_breakdown_of_an_empty_outbox_is_empty(engine):
    assert ops.breakdown(engine) == []


# -- activity -------------------------------------------------------------------------------------------


def record(engine: Engine, at: datetime, outcome: str, count: int = 1) -> None:
    """History rows as a relay at another moment would have written them (inserting is allowed)."""
    with engine.begin() as conn:
        conn.execute(
            insert(a),
            [
                {"message_id": 10_000 + n, "attempt": 1, "outcome": outcome, "started_at": at}
                for n in range(count)
            ],
        )


def bucket_of(series: list[ops.MinuteActivity], at: datetime) -> ops.MinuteActivity:
    (found,) = [b for b in series if b.minute <= at < b.minute + timedelta(minutes=1)]
    return found


def test_activity_buckets_history_by_minute_zero_filled_oldest_first(shop):
    engine = shop.engine
    for n in range(2):
        shop.emit("user.signed_up", {"user_id": n}, key=f"signup:{n}")
    shop.emit("order.paid", {"order_id": 1}, key="paid:1")
    shop.relay()  # now: two delivered, one dead (PermanentError)
    now = datetime.now(UTC)
    ten_ago = now - timedelta(minutes=10)
    record(engine, ten_ago, "delivered", 3)
    for outcome in ("retry", "failed", "timeout", "lease_expired"):
        record(engine, ten_ago, outcome)
    record(engine, ten_ago, "requeued")  # an operator's action: neither delivered, retried nor died
    record(engine, now - timedelta(minutes=30), "dead", 2)
    record(engine, now - timedelta(minutes=61), "delivered", 5)  # before the window
    record(engine, now + timedelta(minutes=5), "delivered", 7)  # a relay with a fast clock

    series = ops.activity(engine)
    assert len(series) == 60
    starts = [b.minute for b in series]
    assert starts == sorted(starts) and all(b.minute.tzinfo is not None for b in series)
    assert all(later - earlier == timedelta(minutes=1) for earlier, later in pairwise(starts))
    assert all(b.minute.second == 0 and b.minute.microsecond == 0 for b in series)
    assert now - timedelta(minutes=1) < series[-1].minute <= datetime.now(UTC), "ends with the current minute"

    assert bucket_of(series, ten_ago) == ops.MinuteActivity(bucket_of(series, ten_ago).minute, 3, 4, 0)
    thirty_ago = bucket_of(series, now - timedelta(minutes=30))
    assert (thirty_ago.delivered, thirty_ago.retried, thirty_ago.died) == (0, 0, 2)
    # The relay's own rows landed in the current minute (or the one before, across a minute boundary).
    recent = [b for b in series if b.minute >= ten_ago + timedelta(minutes=1)]
    assert sum(b.delivered for b in recent) == 2 and sum(b.died for b in recent) == 1
    assert sum(b.delivered + b.retried + b.died for b in series) == 3 + 4 + 2 + 2 + 1, "zeros elsewhere"
    assert sum(1 for b in series if (b.delivered, b.retried, b.died) == (0, 0, 0)) >= 56

    two = ops.activity(engine, minutes=2)
    assert len(two) == 2 and sum(b.delivered for b in two) == 2
    wide = ops.activity(engine, minutes=ops.MAX_ACTIVITY_MINUTES)
    assert len(wide) == ops.MAX_ACTIVITY_MINUTES and sum(b.delivered for b in wide) == 3 + 2 + 5
    for bad in (0, ops.MAX_ACTIVITY_MINUTES + 1, True):
        with pytest.raises(ops.OpsError, match="minutes must be"):
            ops.activity(engine, minutes=bad)


# -- lineage --------------------------------------------------------------------------------------------


def test_lineage_follows_a_requeue_chain_of_three_both_ways(shop):
    engine = shop.engine
    shop.emit("order.paid", {"order_id": 7}, key="paid:7")
    shop.emit("user.signed_up", {"user_id": 1}, key="signup:1")
    shop.relay()
    original = shop.id("paid:7")
    ((_, first),) = ops.requeue(engine, ops.MessageFilter(ids=(original,)), reason="retry 1", actor="t")
    shop.relay()  # still unknown to billing: the copy dies too
    ((_, second),) = ops.requeue(engine, ops.MessageFilter(ids=(first,)), reason="retry 2", actor="t")
    shop.fixed = True
    shop.relay()

    assert ops.lineage(engine, original) == ops.Lineage(
        original,
        ancestors=[],
        descendants=[ops.LineageCopy(first, "dead", original), ops.LineageCopy(second, "delivered", first)],
    )
    assert ops.lineage(engine, first) == ops.Lineage(
        first,
        ancestors=[original],
        descendants=[ops.LineageCopy(second, "delivered", first)],
        made_by="requeued",
    )
    assert ops.lineage(engine, second) == ops.Lineage(
        second, ancestors=[original, first], descendants=[], made_by="requeued"
    )
    alone = shop.id("signup:1")
    assert ops.lineage(engine, alone) == ops.Lineage(alone, [], [])
    with pytest.raises(ops.NotFound, match="no message with id 99999"):
        ops.lineage(engine, 99999)


# -- report runs -----------------------------------------------------------------------------------------


ROWS = [[n, f"r{n % 3}"] for n in range(10)]


def report_job(
    ob: Outbox,
    engine: Engine,
    folder: Path,
    name: str,
    broken: set[int],
    together: threading.Barrier | None = None,
) -> ReportJob:
    """Ten rows in chunks of four (three chunks); chunks in ``broken`` fail for good.

    A run whose chunk is dead is failed, and its chunks that start after that
    skip instead of running. With ``together``, the broken chunks fail only
    once all of them have started, so every one of them dies.
    """

    def rows(session: Session, params: dict[str, Any], offset: int, limit: int) -> list[list[Any]]:
        if offset // limit in broken:
            if together is not None:
                together.wait()
            raise PermanentError(f"warehouse lost chunk {offset // limit}")
        return ROWS[offset : offset + limit]

    return ReportJob(
        ob,
        name,
        engine=engine,
        header=["n", "region"],
        count=lambda session, params: len(ROWS),
        rows=rows,
        output_dir=folder,
        chunk_size=4,
    )


def test_report_runs_list_newest_first_with_their_dead_chunks(engine, tmp_path):
    ob = Outbox(default_backoff=FAST)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    try:
        sales = report_job(ob, engine, tmp_path, "sales", broken={1})
        stock = report_job(ob, engine, tmp_path, "stock", broken=set())
        with maker.begin() as s:
            failing = sales.start(s, {"month": "2026-11"})
        Relay(ob, engine).run_until_idle()
        with maker.begin() as s:
            done = stock.start(s)
        Relay(ob, engine).run_until_idle()
        with maker.begin() as s:
            waiting = sales.start(s)  # not relayed yet

        runs = ops.report_runs(engine)
        assert [r.id for r in runs] == [waiting, done, failing]
        new, complete, failed = runs
        assert (new.report, new.status, new.total_chunks, new.done_chunks, new.failed_chunks) == (
            "sales",
            "running",
            3,
            0,
            0,
        )
        assert new.finished_at is None and new.created_at.tzinfo is not None
        assert (complete.status, complete.done_chunks, complete.row_count, complete.failed_chunks) == (
            "complete",
            3,
            10,
            0,
        )
        assert complete.location is not None and complete.location.endswith(f"stock-{done}.csv")
        assert failed.status == "failed" and failed.failed_chunks == 1
        assert failed.error is not None and "chunk 1 is dead" in failed.error

        # Pages: the last id of a page is where the next one starts.
        assert [r.id for r in ops.report_runs(engine, limit=2)] == [waiting, done]
        assert [r.id for r in ops.report_runs(engine, limit=2, before=done)] == [failing]
        assert ops.report_runs(engine, before=failing) == []
        with pytest.raises(ops.NotFound, match="no report run"):
            ops.report_runs(engine, before="nope")
        for bad in (0, ops.MAX_REPORT_RUNS + 1):
            with pytest.raises(ops.OpsError, match="limit must be"):
                ops.report_runs(engine, limit=bad)

        detail = ops.report_run(engine, failing)
        assert detail.run == failed
        finished = {chunk.chunk: chunk.row_count for chunk in detail.chunks}
        assert 1 not in finished and finished.get(0, 4) == 4 and finished.get(2, 2) == 2
        assert all(chunk.finished_at.tzinfo is not None for chunk in detail.chunks)
        (dead,) = detail.dead_chunks
        assert (dead.status, dead.chunk, dead.requeued) == ("dead", 1, False)
        assert "warehouse lost chunk 1" in (dead.last_error or "")

        # An operator requeues it; the copy finds the run failed and skips. Both messages stay
        # listed under the run: the original is dead as stored, now marked requeued.
        ops.requeue(engine, ops.MessageFilter(ids=(dead.id,)), reason="warehouse back", actor="t")
        Relay(ob, engine).run_until_idle()
        again = ops.report_run(engine, failing)
        assert [(d.id, d.requeued) for d in again.dead_chunks] == [(dead.id, True)]
        assert again.run.failed_chunks == 1

        assert ops.report_run(engine, done).dead_chunks == []
        assert [c.chunk for c in ops.report_run(engine, done).chunks] == [0, 1, 2]
        with pytest.raises(ops.NotFound, match="no report run 'nope'"):
            ops.report_run(engine, "nope")
    finally:
        ob.uninstall(maker)


def test_a_dead_chunk_of_another_run_or_another_report_is_not_counted(engine, tmp_path):
    ob = Outbox(default_backoff=FAST)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    try:
        # Two runs, two broken chunks each: all four fail together, before either run is failed.
        together = threading.Barrier(4, timeout=30)
        sales = report_job(ob, engine, tmp_path, "sales", broken={0, 2}, together=together)

        @ob.handler("audit.note", name="audit")
        def audit(msg: outbox.Message) -> None:
            raise PermanentError("no auditor")

        with maker.begin() as s:
            one, two = sales.start(s), sales.start(s)
        Relay(ob, engine).run_until_idle()
        counts = {r.id: r.failed_chunks for r in ops.report_runs(engine)}
        assert counts == {one: 2, two: 2}
        # A dead message of another handler with the same run id in its payload is not a chunk.
        with maker.begin() as s:
            emit(s, "audit.note", {"run_id": one, "chunk": 1})
        Relay(ob, engine).run_until_idle()
        assert ops.count_messages(engine, ops.MessageFilter(status="dead", handler="audit")).count == 1
        assert {r.id: r.failed_chunks for r in ops.report_runs(engine)} == counts
        assert [d.chunk for d in ops.report_run(engine, one).dead_chunks] == [0, 2]
    finally:
        ob.uninstall(maker)


def test_the_core_copies_of_the_report_tables_match_the_integrations_tables():
    """``outbox`` declares the report tables again (it must not import its integrations); they must agree."""
    for core, real in ((report_run_table, outbox_report_run), (report_chunk_table, outbox_report_chunk)):
        assert core.name == real.name
        for column in core.c:
            assert column.name in real.c, column.name
            assert type(column.type) is type(real.c[column.name].type), column.name
    assert ops.report_handler("sales") == "report.sales"
