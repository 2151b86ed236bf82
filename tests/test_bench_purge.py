"""``python -m bench.purge`` at a tiny size, against a real PostgreSQL: what it purged, not its speed."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from sqlalchemy.engine import make_url

from bench.harness import conninfo
from bench.purge import main

pytestmark = pytest.mark.postgres


def test_purge_mode_drops_the_day_keeps_unresolved_history_and_cleans_up(pg_base_url, capsys):
    name = f"outbox_bench_purge_{uuid.uuid4().hex[:8]}"
    args = ["--database-url", pg_base_url, "--rows", "3000", "--delete-rows", "600", "--kept", "7"]

    assert main([*args, "--database", name]) == 0

    figures = json.loads(capsys.readouterr().out)
    partitioned, rowwise = figures["partitioned"], figures["rowwise"]
    # The day's partition went whole; the pending messages' history stayed; no dead tuple is left.
    assert (partitioned["deleted"], partitioned["rows_left"], partitioned["dead_tuples_left"]) == (2993, 7, 0)
    assert partitioned["steps"] == 1, "one step for the whole day"
    # The schema before partitions deleted the same kind of day row by row (the dead tuples that leaves
    # are reported, not checked: pruning and autovacuum may already have taken some).
    assert (rowwise["deleted"], rowwise["rows_left"]) == (593, 7)
    assert partitioned["beside_writes"] > 0 and rowwise["beside_writes"] > 0
    admin = make_url(pg_base_url).set(drivername="postgresql+psycopg", database="postgres")
    with psycopg.connect(conninfo(admin)) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname LIKE %s", (f"{name}%",)
        ).fetchone()
    assert left == (0,), "both databases dropped"
