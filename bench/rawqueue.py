"""The raw ceiling without history: a plain PostgreSQL queue, psycopg 3 and nothing else.

What the hardware does for the simplest correct queue, the figure a user
compares any queue library with. Its own table in its own database::

    raw_queue(id bigserial, payload jsonb, done boolean, deliveries int)

Each worker process, on one connection, loops: in one transaction, lock a
batch of 100 not-done rows (``SELECT ... ORDER BY id LIMIT 100 FOR UPDATE
SKIP LOCKED``), do nothing with them, mark them done and count the delivery
(``UPDATE ... SET done = true, deliveries = deliveries + 1``), commit. It
exits when a claim finds nothing. No lease, no retry, no history row: the
rows stay locked while the (empty) work runs, so a crash would simply make
them claimable again.

The backlog is stored and analysed before the workers start; 1 or 2 worker
processes are started, told GO together, and timed from GO to the last exit.
Verified: every row done, each exactly once (``deliveries = 1``), and the
workers' own counts add up to the backlog.

The ``lease`` variant is the same queue as a relay has to run it: a handler
calls the network for seconds, so no transaction may stay open across it.
Each batch is claimed under a lease in one commit (``locked_until``), then
marked done in a second one: two commits per batch instead of one, still no
history. Both are reported; the issue's ratio is checked against the first.

``python -m bench.rawqueue DSN [lease]`` is the worker itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .gate import gated, run_gated, wait_for_go
from .harness import Scratch, conninfo
from .verify import Unverified

__all__ = ["BATCH", "VARIANTS", "check_rawqueue", "rawqueue", "reported"]

BATCH = 100

SCHEMA = """
CREATE TABLE raw_queue (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    done boolean NOT NULL DEFAULT false,
    deliveries integer NOT NULL DEFAULT 0,
    locked_until timestamptz
);
CREATE INDEX raw_queue_pending ON raw_queue (id) WHERE NOT done;
"""

PREFILL = """
INSERT INTO raw_queue (payload)
SELECT jsonb_build_object('n', g, 'fail', false) FROM generate_series(0, %(count)s - 1) AS g
"""

CLAIM = "SELECT id, payload FROM raw_queue WHERE NOT done ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED"
DONE = "UPDATE raw_queue SET done = true, deliveries = deliveries + 1 WHERE id = ANY(%(ids)s)"
LEASE = """
UPDATE raw_queue SET locked_until = now() + interval '30 seconds'
 WHERE id = ANY(ARRAY(SELECT id FROM raw_queue
                       WHERE NOT done AND (locked_until IS NULL OR locked_until < now())
                       ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED))
RETURNING id, payload
"""
#: The two shapes: one transaction per batch, or a lease commit and a done commit.
VARIANTS = ("locked", "lease")


def rawqueue(scratch: Scratch, *, workers: int, count: int, variant: str = "locked") -> dict[str, Any]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    url = scratch.postgres(f"rawqueue{variant}{workers}", migrate=False)
    workdir = scratch.subdir(f"rawqueue{variant}{workers}")
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(PREFILL, {"count": count})
        conn.execute("ANALYZE raw_queue")
    command = [sys.executable, "-m", "bench.rawqueue", conninfo(url), variant]
    with gated([command] * workers, workdir=workdir, envs=[{}] * workers) as procs:
        seconds = run_gated(procs, timeout=60.0 + count / 200)
        claimed = [reported(p.log_path) for p in procs]
    check_rawqueue(url, count, claimed)
    return {"per_s": count / seconds, "seconds": seconds, "by_worker": claimed, "database": url.database}


def reported(log: Path) -> int:
    lines = log.read_text().split()
    if len(lines) < 2 or lines[-2] != "delivered":
        raise Unverified(f"the worker's log does not end with its count: {log.read_text()[-300:]!r}")
    return int(lines[-1])


def check_rawqueue(url: URL, count: int, claimed: list[int]) -> None:
    """Every row done exactly once, and the workers' counts agree: else :class:`Unverified`."""
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE done AND deliveries = 1), "
            "count(DISTINCT (payload->>'n')::int), coalesce(sum(deliveries), 0) FROM raw_queue"
        ).fetchone()
    assert row is not None
    rows, once, distinct, deliveries = row
    if rows != count or distinct != count:
        raise Unverified(f"raw queue holds {rows} rows ({distinct} distinct), expected {count}")
    if once != count or deliveries != count:
        raise Unverified(f"{once} of {count} rows delivered exactly once ({deliveries} deliveries in all)")
    if sum(claimed) != count:
        raise Unverified(f"the workers report {sum(claimed)} deliveries ({claimed}), expected {count}")


def work(dsn: str, variant: str = "locked") -> int:
    """The worker loop; returns how many rows it delivered."""
    delivered = 0
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        wait_for_go()
        while True:
            if variant == "lease":
                with conn.transaction():
                    rows = conn.execute(LEASE, {"batch": BATCH}).fetchall()
                if not rows:
                    break
                with conn.transaction():  # the (empty) work ran outside any transaction
                    conn.execute(DONE, {"ids": [row[0] for row in rows]})
            else:
                with conn.transaction():
                    rows = conn.execute(CLAIM, {"batch": BATCH}).fetchall()
                    if not rows:
                        break
                    conn.execute(DONE, {"ids": [row[0] for row in rows]})
            delivered += len(rows)
    return delivered


if __name__ == "__main__":
    print("delivered", work(sys.argv[1], *sys.argv[2:3]), flush=True)
