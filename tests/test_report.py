"""Report fan-out through the real relay: atomic start, idempotent chunks, exactly-once assembly."""

from __future__ import annotations

import csv
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Integer, String, delete, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, RetryLater, emit, ops, signals
from outbox.integrations.report import ReportJob, ReportProgress, outbox_report_chunk, outbox_report_run
from outbox.relay import Relay


class Base(DeclarativeBase):
    pass


class Sale(Base):
    __tablename__ = "sales"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    region: Mapped[str] = mapped_column(String(20))


@pytest.fixture
def sales(engine: Engine) -> Engine:
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(insert(Sale), [{"id": i, "region": f"r{i % 7}"} for i in range(1, 10_001)])
    return engine


def start_sales_report(engine: Engine, folder: Path) -> tuple[Outbox, ReportJob, str]:
    """A fresh Outbox with the sales report, and one run of it started (committed)."""
    ob = Outbox()
    job = make_job(ob, engine, folder)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s)
    return ob, job, run_id


def make_job(
    ob: Outbox,
    engine: Engine,
    folder: Path,
    fail: dict[int, int] | None = None,
    before_fetch: Callable[[int], None] | None = None,
    **options: Any,
) -> ReportJob:
    """The sales report; ``fail`` makes chunks raise, ``before_fetch(chunk)`` runs first in each rows()."""
    fail = fail if fail is not None else {}

    def rows(session: Session, params: dict[str, Any], offset: int, limit: int):
        chunk = offset // limit
        if before_fetch is not None:
            before_fetch(chunk)
        if fail.get(chunk, 0) > 0:
            fail[chunk] -= 1
            raise ConnectionError(f"warehouse unavailable for chunk {chunk}")
        return session.execute(select(Sale.id, Sale.region).order_by(Sale.id).offset(offset).limit(limit))

    return ReportJob(
        ob,
        "sales",
        engine=engine,
        header=["id", "region"],
        count=lambda session, params: session.scalar(select(func.count()).select_from(Sale)) or 0,
        rows=rows,
        output_dir=folder,
        chunk_size=500,
        **options,
    )


def test_report_of_10000_rows_in_20_chunks_with_a_flaky_chunk(sales, tmp_path):
    engine = sales
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    progress: list[ReportProgress] = []
    sampling = threading.Lock()
    run: list[str] = []

    def sample() -> None:
        # Under one lock, so the list's order is the order the database was read in.
        with sampling:
            progress.append(job.progress(run[0]))

    # Chunks also sample as they start: from the fifth on, each is claimed only after an earlier
    # chunk recorded itself, so progress is guaranteed to be seen part-way, not only at the ends.
    job = make_job(ob, engine, tmp_path, fail={7: 2}, before_fetch=lambda chunk: sample())
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s, {"region": "all"})
    run.append(run_id)

    stop = threading.Event()

    def watch() -> None:  # progress must be consistent at every moment a UI could look
        while not stop.is_set():
            sample()
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(100):
            Relay(ob, engine, concurrency=4).run_until_idle()
            if job.progress(run_id).status == "complete":
                break
            time.sleep(0.005)
    finally:
        stop.set()
        watcher.join()

    final = job.progress(run_id)
    assert final.status == "complete" and final.total_chunks == 20
    assert final.done_chunks == 20 and final.row_count == 10_000
    with Path(final.location or "").open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == ["id", "region"]
    ids = [int(line[0]) for line in lines[1:]]
    assert ids == list(range(1, 10_001)), "rows missing, duplicated or out of order"
    progress.append(final)
    done_seen = [p.done_chunks for p in progress]
    assert done_seen == sorted(done_seen), "progress went backwards"
    rows_seen = [p.row_count for p in progress]
    assert rows_seen == sorted(rows_seen), "row count went backwards"
    assert all(0 <= p.done_chunks <= 20 and p.row_count <= 10_000 for p in progress)
    # Every chunk holds exactly 500 rows, and a chunk's rows count the moment it counts as done.
    assert all(p.row_count == 500 * p.done_chunks for p in progress), "rows and chunks disagree"
    stages = [("running", "assembling", "complete").index(p.status) for p in progress]
    assert stages == sorted(stages), "status went backwards"
    assert all(p.status == "running" or p.done_chunks == 20 for p in progress)
    assert all((p.status == "complete") == (p.location is not None) for p in progress)
    assert all(p.status != "complete" or p.location == final.location for p in progress)
    assert any(0 < p.done_chunks < 20 for p in progress), "no sample saw the report part-way"
    assert all(p.total_chunks == 20 and p.error is None for p in progress)
    with engine.connect() as conn:
        attempts = conn.execute(
            select(outbox.outbox_attempt.c.outcome, func.count()).group_by(outbox.outbox_attempt.c.outcome)
        ).all()
        assert conn.execute(select(func.count()).select_from(outbox_report_chunk)).scalar() == 20
    assert dict(attempts) == {"delivered": 20, "failed": 2}
    assert not list(tmp_path.glob("*.parts")), "part files are cleaned up after assembly"


def test_start_is_atomic_with_the_callers_transaction(sales, tmp_path):
    engine = sales
    ob = Outbox()
    job = make_job(ob, engine, tmp_path)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        job.start(s)
        s.rollback()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox_report_run)).scalar() == 0
        assert conn.execute(select(func.count()).select_from(outbox.outbox_message)).scalar() == 0


def test_rerunning_a_finished_chunk_changes_nothing(sales, tmp_path):
    engine = sales
    ob, job, run_id = start_sales_report(engine, tmp_path)
    Relay(ob, engine).run_until_idle()
    done = job.progress(run_id)
    assert done.status == "complete"
    content = Path(done.location or "").read_bytes()
    with engine.connect() as conn:
        first = conn.execute(select(outbox.outbox_message).order_by(outbox.outbox_message.c.id)).first()
    assert first is not None
    from outbox.relay.dispatch import to_message

    assert job(to_message(first))["skipped"] == "complete"
    assert job.progress(run_id) == done
    assert Path(done.location or "").read_bytes() == content


def chunk_messages(engine: Engine) -> list[Any]:
    m = outbox.outbox_message
    with engine.connect() as conn:
        return list(conn.execute(select(m).where(m.c.event_type == "report.sales.chunk").order_by(m.c.id)))


def test_rerunning_a_chunk_while_its_run_is_running_overwrites_its_own_part(sales, tmp_path):
    engine = sales
    ob, job, run_id = start_sales_report(engine, tmp_path)
    from outbox.relay.dispatch import to_message

    chunk3 = to_message(chunk_messages(engine)[3])
    # A first attempt recorded its part, then (say) the relay died before recording the outcome:
    # the chunk runs again while the run is still running.
    first = job(chunk3)
    again = job(chunk3)
    assert first == again == {"run_id": run_id, "chunk": 3, "rows": 500, "done": 1}
    p = job.progress(run_id)
    assert (p.status, p.done_chunks, p.row_count, p.location) == ("running", 1, 500, None)
    with engine.connect() as conn:
        recorded = conn.execute(select(outbox_report_chunk.c.chunk, outbox_report_chunk.c.row_count)).all()
    assert [tuple(r) for r in recorded] == [(3, 500)]
    parts = tmp_path / f"sales-{run_id}.parts"
    assert sorted(f.name for f in parts.iterdir()) == ["part-000003.csv"], "a re-run leaves no extra files"
    with (parts / "part-000003.csv").open(newline="") as f:
        assert [int(line[0]) for line in csv.reader(f)] == list(range(1501, 2001))

    # The relay still delivers chunk 3's message: a third run of the same chunk.
    Relay(ob, engine).run_until_idle()
    final = job.progress(run_id)
    assert (final.status, final.done_chunks, final.row_count) == ("complete", 20, 10_000)
    with Path(final.location or "").open(newline="") as f:
        ids = [int(line[0]) for line in list(csv.reader(f))[1:]]
    assert ids == list(range(1, 10_001)), "rows missing, duplicated or out of order"
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(outbox_report_chunk)).scalar() == 20


def test_a_chunk_whose_row_set_shifted_since_start_says_so(sales, tmp_path, caplog):
    engine = sales
    ob, job, run_id = start_sales_report(engine, tmp_path)
    with engine.begin() as conn:  # rows deleted after start: the last chunk's page comes back short
        conn.execute(delete(Sale).where(Sale.id <= 10))
    with caplog.at_level(logging.WARNING, logger="outbox.integrations.report"):
        Relay(ob, engine).run_until_idle()
    assert job.progress(run_id).row_count == 9_990
    shifted = [r for r in caplog.records if getattr(r, "action", None) == "report_rows_shifted"]
    assert len(shifted) == 1 and "chunk 19 got 490 rows where count() promised 500" in shifted[0].message
    with engine.connect() as conn:
        details = [d for (d,) in conn.execute(select(outbox.outbox_attempt.c.detail))]
    assert [d["chunk"] for d in details if "expected_rows" in d] == [19]


# -- capacity: report chunks must not take the slots urgent mail needs --------------------------------


class Backlog:
    """Report chunks that hold their relay slot until released, and a mail-like route beside them."""

    def __init__(self, engine: Engine, folder: Path, **options: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.events: list[str] = []  # chunks returning from rows(), and the mail, in order
        self.mailed = threading.Event()
        self.ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
        self.job = make_job(self.ob, engine, folder, before_fetch=self._hold, **options)
        # "transactional" sorts after "reports": the alphabet gives mail no head start here.
        self.ob.route("password.reset", self._send_mail, name="reset_mail", queue="transactional", priority=0)
        self.factory = sessionmaker(engine)
        self.ob.install(self.factory)

    def _hold(self, chunk: int) -> None:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.release()
        held = self.release.wait(60)
        with self.lock:
            self.inside -= 1
            self.events.append(f"chunk {chunk}")
        assert held, "the test never released the report chunks"

    def _send_mail(self, message: Message) -> None:
        with self.lock:
            self.events.append("mail")
        self.mailed.set()

    def wait_until_chunks_hold(self, count: int) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=30), "the relay did not start the report chunks"

    def emit_mail(self) -> None:
        with self.factory() as s, s.begin():
            emit(s, "password.reset", {"to": "ada@example.com"}, key="reset:ada")

    def wait_for_report(self, run_id: str) -> ReportProgress:
        deadline = time.monotonic() + 60
        while (p := self.job.progress(run_id)).status != "complete":
            assert time.monotonic() < deadline, f"the report did not finish: {p}"
            time.sleep(0.02)
        return p


def serving(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, name="relay")
    thread.start()
    return thread


def test_a_capped_reports_queue_leaves_mail_a_slot_behind_a_backlog_of_slow_chunks(sales, tmp_path):
    """The setting docs/reports.md recommends: mail is delivered while every report chunk still waits."""
    backlog = Backlog(sales, tmp_path)
    relay = Relay(backlog.ob, sales, concurrency=4, queue_concurrency={"reports": 2}, poll_interval=0.05)
    thread = serving(relay)
    try:
        with backlog.factory() as s, s.begin():
            run_id = backlog.job.start(s)
        backlog.wait_until_chunks_hold(2)
        backlog.emit_mail()
        assert backlog.mailed.wait(30), "the mail was not delivered while the report chunks held"
        with backlog.lock:
            assert backlog.events == ["mail"], "the mail waited for report chunks"
        assert backlog.job.progress(run_id).done_chunks == 0
        m = outbox.outbox_message
        with sales.connect() as conn:
            waiting = conn.execute(
                select(func.count()).where(m.c.queue == "reports", m.c.status.in_(("pending", "running")))
            ).scalar()
        assert waiting == 20, "the whole report backlog was still waiting when the mail went out"
        backlog.release.set()
        final = backlog.wait_for_report(run_id)
    finally:
        backlog.release.set()
        relay.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert (final.done_chunks, final.row_count) == (20, 10_000)
    assert backlog.most_inside == 2, "the cap let more report chunks run at once"
    assert backlog.events[0] == "mail" and len(backlog.events) == 21


def test_without_a_cap_report_chunks_take_every_slot_and_mail_waits(sales, tmp_path):
    """Why the cap is needed: priority 100 on the reports queue does not keep a slot for mail."""
    backlog = Backlog(sales, tmp_path)
    relay = Relay(backlog.ob, sales, concurrency=4, poll_interval=0.05)
    thread = serving(relay)
    try:
        with backlog.factory() as s, s.begin():
            run_id = backlog.job.start(s)
        backlog.wait_until_chunks_hold(4)
        backlog.emit_mail()
        backlog.release.set()
        assert backlog.mailed.wait(30)
        backlog.wait_for_report(run_id)
    finally:
        backlog.release.set()
        relay.stop()
        thread.join(30)
    assert backlog.most_inside == 4
    assert backlog.events.index("mail") >= 1, "mail went out while report chunks held every slot"


def test_a_dead_chunk_fails_its_run(sales, tmp_path):
    engine = sales
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    job = make_job(ob, engine, tmp_path, fail={3: 100})
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s)
    for _ in range(50):
        Relay(ob, engine).run_until_idle()
        if job.progress(run_id).status == "failed":
            break
        time.sleep(0.005)
    failed = job.progress(run_id)
    assert failed.status == "failed" and "chunk 3 is dead" in (failed.error or "")
    # Chunks still queued when the run failed skip their work instead of finishing a dead run.
    assert failed.done_chunks <= 19 and failed.location is None


# -- discarded chunks: the run ends, as it does for a dead chunk ---------------------------------------


def chunk_message_id(engine: Engine, run_id: str, chunk: int) -> int:
    m = outbox.outbox_message
    with engine.connect() as conn:
        return int(
            conn.execute(select(m.c.id).where(m.c.idempotency_key == f"report:{run_id}:{chunk}")).scalar_one()
        )


def report_statuses(engine: Engine) -> dict[str, int]:
    m = outbox.outbox_message
    with engine.connect() as conn:
        query = select(m.c.status, func.count()).where(m.c.queue == "reports").group_by(m.c.status)
        return {status: n for status, n in conn.execute(query)}


def discard_chunk(engine: Engine, run_id: str, chunk: int) -> None:
    """What ``outbox discard ID`` does: the operator's own path, which knows nothing of reports."""
    target = ops.MessageFilter(ids=[chunk_message_id(engine, run_id, chunk)])
    assert ops.discard(engine, target, reason="the customer cancelled the export", actor="alice")


def assert_failed_by_the_discard(engine: Engine, job: ReportJob, run_id: str, chunk: int) -> None:
    """The run ended, and says why, wherever it is read: the dashboard's views and progress()."""
    reason = f"chunk {chunk} was discarded by alice: the customer cancelled the export"
    detail = ops.report_run(engine, run_id)
    assert (detail.run.status, detail.run.error) == ("failed", reason)
    assert detail.run.finished_at is not None and detail.run.location is None
    (listed,) = [r for r in ops.report_runs(engine) if r.id == run_id]
    assert (listed.status, listed.error) == ("failed", reason)
    assert (job.progress(run_id).status, job.progress(run_id).error) == ("failed", reason)


def test_a_chunk_discarded_while_others_deliver_fails_its_run_and_nothing_is_left_running(sales, tmp_path):
    backlog = Backlog(sales, tmp_path)
    relay = Relay(backlog.ob, sales, concurrency=4, queue_concurrency={"reports": 2}, poll_interval=0.05)
    thread = serving(relay)
    try:
        with backlog.factory() as s, s.begin():
            run_id = backlog.job.start(s)
        backlog.wait_until_chunks_hold(2)  # chunks 0 and 1 run; the other 18 wait
        discard_chunk(sales, run_id, 10)
        backlog.release.set()
        deadline = time.monotonic() + 30
        while ops.report_run(sales, run_id).run.status != "failed" or report_statuses(sales).keys() & {
            "pending",
            "running",
        }:
            assert time.monotonic() < deadline, f"the run did not end: {backlog.job.progress(run_id)}"
            time.sleep(0.02)
    finally:
        backlog.release.set()
        relay.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert_failed_by_the_discard(sales, backlog.job, run_id, 10)
    assert report_statuses(sales) == {"delivered": 19, "discarded": 1}
    assert backlog.job.progress(run_id).done_chunks < 19, "chunks after the failure skipped their work"
    with sales.connect() as conn:
        details = [d for (d,) in conn.execute(select(outbox.outbox_attempt.c.detail))]
    noticed = sorted(d["chunk"] for d in details if d.get("discarded_chunk") == 10)
    assert noticed == [0, 1], "the chunks held while chunk 10 was discarded say why the run failed"
    assert not list(tmp_path.glob("sales-*.csv")), "no report was assembled without chunk 10"


@pytest.mark.parametrize("relay_kind", ["drain", "serving"])
def test_a_run_whose_last_outstanding_chunk_is_discarded_is_failed_by_the_next_relay_to_look(
    sales, tmp_path, relay_kind
):
    """No chunk of the run is left to notice the discard: the relays' own look does."""
    engine = sales
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))

    def chunk_2_waits_an_hour(chunk: int) -> None:
        if chunk == 2:
            raise RetryLater("the warehouse is being rebuilt", delay=3600)

    job = make_job(ob, engine, tmp_path, before_fetch=chunk_2_waits_an_hour, discard_check_interval=0.05)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s)
    Relay(ob, engine).run_until_idle()
    assert (job.progress(run_id).status, job.progress(run_id).done_chunks) == ("running", 19)
    assert report_statuses(engine) == {"delivered": 19, "pending": 1}

    if relay_kind == "drain":  # outbox-relay --once, say, run after the operator's discard
        discard_chunk(engine, run_id, 2)
        assert Relay(ob, engine).run_until_idle().attempts == 0
    else:  # a relay already serving, idle, when the operator discards
        started = threading.Event()

        def on_started(sender: Any, **kwargs: Any) -> None:
            started.set()

        signals.relay_started.connect(on_started, sender=ob)
        relay = Relay(ob, engine, poll_interval=0.05)
        thread = serving(relay)
        try:
            assert started.wait(30)
            assert job.progress(run_id).status == "running"
            discard_chunk(engine, run_id, 2)
            deadline = time.monotonic() + 30
            while job.progress(run_id).status != "failed":
                assert time.monotonic() < deadline, "the serving relay never noticed the discarded chunk"
                time.sleep(0.02)
        finally:
            relay.stop()
            thread.join(30)
            signals.relay_started.disconnect(on_started, sender=ob)
        assert not thread.is_alive()
    assert_failed_by_the_discard(engine, job, run_id, 2)
    assert report_statuses(engine) == {"delivered": 19, "discarded": 1}


def test_bad_report_configuration_fails_at_definition(engine, tmp_path):
    with pytest.raises(ConfigurationError, match="chunk_size"):
        ReportJob(
            Outbox(),
            "r",
            engine=engine,
            count=lambda s, p: 0,
            rows=lambda s, p, o, n: [],
            header=["a"],
            output_dir=tmp_path,
            chunk_size=0,
        )
    for interval in (0, -1, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ConfigurationError, match="discard_check_interval"):
            make_job(Outbox(), engine, tmp_path, discard_check_interval=interval)
