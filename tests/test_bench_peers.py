"""The bench's peers (issue 16): a raw queue without history and pgqueuer, each verified.

Both modes run for real at a tiny size against PostgreSQL, in worker
processes behind the GO barrier; the assertions are on what they delivered,
never on speed. Each verifier is then shown to fail on a duplicate and on a
missing delivery, so a figure can never come from a run that lost or
repeated work.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import URL

from bench.__main__ import targets
from bench.drain import RelaySettings
from bench.harness import Scratch, conninfo
from bench.peers import peer_ratios, peer_rows
from bench.verify import Unverified

pytestmark = pytest.mark.postgres

COUNT = 600


def _database(scratch: Scratch, figures: dict[str, object]) -> URL:
    return scratch.server.set(database=str(figures["database"]))


def _execute(url: URL, sql: str) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(sql)


@pytest.mark.parametrize("variant", ["locked", "lease"])
def test_raw_queue_delivers_every_row_once_and_its_check_can_fail(scratch: Scratch, variant: str) -> None:
    from bench.rawqueue import check_rawqueue, rawqueue

    figures = rawqueue(scratch, workers=2, count=COUNT, variant=variant)

    assert figures["per_s"] > 0
    assert sum(figures["by_worker"]) == COUNT and len(figures["by_worker"]) == 2
    url = _database(scratch, figures)
    check_rawqueue(url, COUNT, figures["by_worker"])
    with pytest.raises(Unverified, match="workers report"):
        check_rawqueue(url, COUNT, [COUNT, 1])
    _execute(url, "UPDATE raw_queue SET deliveries = 2 WHERE id = (SELECT min(id) FROM raw_queue)")
    with pytest.raises(Unverified, match="exactly once"):
        check_rawqueue(url, COUNT, figures["by_worker"])
    _execute(url, "UPDATE raw_queue SET deliveries = 0, done = false WHERE deliveries = 2")
    with pytest.raises(Unverified, match="exactly once"):
        check_rawqueue(url, COUNT, figures["by_worker"])


def test_pgqueuer_runs_every_job_once_and_its_log_check_can_fail(scratch: Scratch) -> None:
    from bench.pgqueuer_peer import check_pgqueuer_log, pgqueuer_drain

    figures = pgqueuer_drain(scratch, workers=2, count=COUNT)

    assert figures["per_s"] > 0
    assert sum(figures["by_worker"]) == COUNT and len(figures["by_worker"]) == 2
    url = _database(scratch, figures)
    check_pgqueuer_log(url, COUNT)
    _execute(
        url,
        "INSERT INTO pgqueuer_log (job_id, status, entrypoint, priority) "
        "SELECT job_id, status, entrypoint, priority FROM pgqueuer_log WHERE status = 'successful' LIMIT 1",
    )
    with pytest.raises(Unverified, match="pgqueuer_log"):
        check_pgqueuer_log(url, COUNT)
    _execute(url, "DELETE FROM pgqueuer_log WHERE status = 'successful'")
    with pytest.raises(Unverified, match="pgqueuer_log"):
        check_pgqueuer_log(url, COUNT)


def test_pgqueuer_call_counts_catch_a_repeated_or_missing_job(tmp_path: Path) -> None:
    from bench.pgqueuer_peer import check_calls

    first, second = tmp_path / "calls1.bin", tmp_path / "calls2.bin"
    first.write_bytes(bytes([1, 0, 1, 0]))
    second.write_bytes(bytes([0, 1, 0, 1]))
    assert check_calls([first, second], 4) == [2, 2]

    second.write_bytes(bytes([1, 1, 0, 1]))
    with pytest.raises(Unverified, match="0 never ran and 1 ran more than once"):
        check_calls([first, second], 4)
    second.write_bytes(bytes([0, 1, 0, 0]))
    with pytest.raises(Unverified, match="1 never ran and 0 ran more than once"):
        check_calls([first, second], 4)
    with pytest.raises(Unverified, match="no call counts"):
        check_calls([first, tmp_path / "calls3.bin"], 4)


def test_the_default_sizes_drain_passes_no_size_flags() -> None:
    assert "--concurrency" in RelaySettings().args()
    args = RelaySettings(default_sizes=True).args()
    assert "--concurrency" not in args and "--batch-size" not in args
    assert args[args.index("--log-level") + 1] == "WARNING"


def test_ratios_and_target_lines_follow_the_rates() -> None:
    out = {
        "drain_per_s_1": 9000.0,
        "drain_default_per_s_1": 8000.0,
        "rawqueue_per_s_1": 20000.0,
        "pgqueuer_per_s_1": 5000.0,
        "drain_default_per_s_2": 9000.0,
        "pgqueuer_per_s_2": 4000.0,
    }
    ratios = peer_ratios(out)
    assert ratios == {
        "drain_vs_rawqueue_1": 0.45,
        "drain_vs_pgqueuer_1": 1.8,
        "default_vs_rawqueue_1": 0.4,
        "default_vs_pgqueuer_1": 1.6,
        "default_vs_pgqueuer_2": 2.25,
    }
    verdicts = {row[0]: row[3] for row in peer_rows({**out, **ratios})}
    assert verdicts["16 default sizes / pgqueuer, 1 process"] == "FAIL"
    assert verdicts["16 default sizes / rawqueue, 1 process"] == "FAIL"
    assert verdicts["16 default sizes / pgqueuer, 2 processes"] == "PASS"
    assert verdicts["16 default sizes / rawqueue, 2 processes"] == "-"
    assert peer_rows({"drain_per_s_1": 1.0}) == []
    # A quick run's rates are mostly start-up: its ratios get no verdict.
    assert {row[3] for row in peer_rows({**out, **ratios, "quick": True})} == {"-"}


def test_broker_ratios_get_a_verdict_in_full_runs_only() -> None:
    out = {
        "messages_nats": 20000,
        "nats_ratio": 0.5,
        "messages_rabbitmq": 20000,
        "rabbitmq_ratio": 0.8,
        "messages_kafka": 20000,
        "kafka_ratio": 0.2,
        "drain_per_s_1": 1.0,
        "drain_per_s_2": 2.0,
    }
    verdicts = {row[0]: row[3] for row in targets(out)}
    assert verdicts["NATS publish (outbox / raw)"] == "FAIL"
    assert verdicts["RabbitMQ publish (outbox / direct)"] == "PASS"
    assert verdicts["Kafka produce, mock cluster (outbox / raw)"] == "FAIL"
    quick = {row[0]: row[3] for row in targets({**out, "quick": True})}
    assert quick["NATS publish (outbox / raw)"] == quick["RabbitMQ publish (outbox / direct)"] == "-"
    assert quick["Kafka produce, mock cluster (outbox / raw)"] == "-"
    assert quick["2 drain, 2 relays"] == "PASS"  # a comparison within the outbox keeps its verdict
