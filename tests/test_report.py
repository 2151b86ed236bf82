"""Report fan-out through the real relay: atomic start, idempotent chunks, exactly-once assembly."""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Integer, String, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Outbox
from outbox.integrations.report import ReportJob, outbox_report_chunk, outbox_report_run
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


def make_job(ob: Outbox, engine: Engine, folder: Path, fail: dict[int, int] | None = None) -> ReportJob:
    fail = fail if fail is not None else {}

    def rows(session: Session, params: dict[str, Any], offset: int, limit: int):
        chunk = offset // limit
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
    )


def test_report_of_10000_rows_in_20_chunks_with_a_flaky_chunk(sales, tmp_path):
    engine = sales
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    job = make_job(ob, engine, tmp_path, fail={7: 2})
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s, {"region": "all"})

    progress: list[tuple[int, int, str]] = []
    stop = threading.Event()

    def watch() -> None:  # progress must be consistent at every moment a UI could look
        while not stop.is_set():
            p = job.progress(run_id)
            progress.append((p.done_chunks, p.row_count, p.status))
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
    done_seen = [d for d, _, _ in progress]
    assert done_seen == sorted(done_seen), "progress went backwards"
    assert all(0 <= d <= 20 and rows <= 10_000 for d, rows, _ in progress)
    assert all(status != "complete" or d == 20 for d, _, status in progress)
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
    ob = Outbox()
    job = make_job(ob, engine, tmp_path)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        run_id = job.start(s)
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

