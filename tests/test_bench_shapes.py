"""The bench's table-shape prototype at a tiny size, against a real PostgreSQL: its checks, not its speed."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import URL

from bench.__main__ import DEFAULT_MODES, MODES, main
from bench.harness import Scratch, conninfo, prefill
from bench.shapes import NARROW_TABLE, SHAPES, _check, _run
from bench.verify import Unverified

pytestmark = pytest.mark.postgres

COUNT = 600


def _facts(url: URL, *queries: str) -> list[list[tuple[object, ...]]]:
    with psycopg.connect(conninfo(url)) as conn:
        return [conn.execute(query).fetchall() for query in queries]


BY_STATE = "SELECT status, attempts, count(*) FROM {} GROUP BY 1, 2"
HISTORY = "SELECT count(*), count(DISTINCT message_id) FROM outbox_attempt"


def test_each_shape_completes_every_message_once_and_leaves_its_rows_where_it_says(
    pg_base_url: str,
) -> None:
    scratch = Scratch(pg_base_url)
    try:
        rates = {shape: _run(scratch, shape, f"t{shape.replace('_', '')}", COUNT, 100) for shape in SHAPES}

        def database(shape: str) -> URL:
            return scratch.server.set(database=f"{scratch.tag}_t{shape.replace('_', '')}")

        narrow = _facts(
            database("narrow"), BY_STATE.format("outbox_state"), BY_STATE.format("outbox_message"), HISTORY
        )
        moved = _facts(
            database("moved"),
            BY_STATE.format("outbox_done"),
            "SELECT count(*) FROM outbox_message",
            "SELECT count(*) FROM outbox_done_today",
            HISTORY,
        )
        narrow_moved = _facts(
            database("narrow_moved"),
            "SELECT count(*) FROM outbox_state",
            BY_STATE.format("outbox_message"),
            HISTORY,
        )
    finally:
        scratch.close()
    assert all(rate > 0 for rate in rates.values()), rates
    # The narrow prototype's state lives beside the messages, which it leaves as they were.
    assert narrow == [[("delivered", 1, COUNT)], [("pending", 0, COUNT)], [(COUNT, COUNT)]]
    # Delivered rows left the queue table for today's partition of the finished ones.
    assert moved == [[("delivered", 1, COUNT)], [(0,)], [(COUNT,)], [(COUNT, COUNT)]]
    # Delivered state is deleted; the messages stay, and history says each was delivered once.
    assert narrow_moved == [[(0,)], [("pending", 0, COUNT)], [(COUNT, COUNT)]]


def test_the_check_refuses_a_shape_that_left_a_message_behind(pg_base_url: str) -> None:
    scratch = Scratch(pg_base_url)
    try:
        url = scratch.postgres("leftbehind")
        prefill(url, "noop", 3)
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            conn.execute(NARROW_TABLE)
            conn.execute(
                "UPDATE outbox_state SET status = 'delivered', attempts = 1"
                " WHERE id <> (SELECT min(id) FROM outbox_state)"
            )
        with pytest.raises(Unverified, match="outbox_state"):
            _check(url, 3, finished="outbox_state", emptied=None, history_rows=0)
    finally:
        scratch.close()


def test_the_check_refuses_a_shape_whose_delivery_left_a_row_behind(pg_base_url: str) -> None:
    scratch = Scratch(pg_base_url)
    try:
        url = scratch.postgres("leftinqueue")
        prefill(url, "noop", 3)
        with pytest.raises(Unverified, match=r"outbox_state: .* = \(3, 3, 3, 0, 0\)"):
            with psycopg.connect(conninfo(url), autocommit=True) as conn:
                conn.execute(NARROW_TABLE)
            _check(url, 3, finished=None, emptied="outbox_state", history_rows=0)
    finally:
        scratch.close()


def test_shapes_run_only_when_asked_for(pg_base_url: str, tmp_path: Path) -> None:
    assert "shapes" in MODES
    assert "shapes" not in DEFAULT_MODES
    out = tmp_path / "bench.json"
    code = main(["--database-url", pg_base_url, "--quick", "--only", "shapes", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["failed_modes"] is None
    assert result["shapes_vs_rawqueue_rawqueue"] == 1.0
    for shape in SHAPES:
        assert result[f"shapes_per_s_{shape}"] > 0
