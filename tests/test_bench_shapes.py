"""The bench's table-shape prototype at a tiny size, against a real PostgreSQL: its checks, not its speed."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from bench.__main__ import DEFAULT_MODES, MODES, main
from bench.harness import Scratch, conninfo, prefill
from bench.shapes import NARROW_TABLE, SHAPES, _check, _run
from bench.verify import Unverified

pytestmark = pytest.mark.postgres

COUNT = 600


def test_each_shape_completes_every_message_once_and_the_narrow_one_leaves_the_messages_alone(
    pg_base_url: str,
) -> None:
    scratch = Scratch(pg_base_url)
    try:
        rates = {shape: _run(scratch, shape, f"t{shape.replace('_', '')}", COUNT, 100) for shape in SHAPES}
        narrow = scratch.server.set(database=f"{scratch.tag}_tnarrow")
        with psycopg.connect(conninfo(narrow)) as conn:
            state = conn.execute(
                "SELECT status, attempts, count(*) FROM outbox_state GROUP BY 1, 2"
            ).fetchall()
            messages = conn.execute(
                "SELECT status, attempts, count(*) FROM outbox_message GROUP BY 1, 2"
            ).fetchall()
            history = conn.execute(
                "SELECT count(*), count(DISTINCT message_id) FROM outbox_attempt"
            ).fetchone()
    finally:
        scratch.close()
    assert all(rate > 0 for rate in rates.values()), rates
    assert state == [("delivered", 1, COUNT)]
    assert messages == [("pending", 0, COUNT)]  # the prototype's state lives beside them
    assert history == (COUNT, COUNT)


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
            _check(url, "outbox_state", 3, history_rows=0)
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
