"""The benchmark's emit mode at a tiny size: it runs, verifies its rows, and reports every key.

Behaviour only: the figures are timings, so the test checks that they exist
and are sane, never how large they are.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from sqlalchemy.engine import make_url

from bench.emit import emit_overhead
from bench.emit_report import emit_figures, emit_targets

KEYS = (
    "emit_overhead_ratio",
    "emit_overhead_ratio_flush",
    "emit_added_us",
    "emit_added_us_flush",
    "raw_insert_us",
    "raw_plain_us",
    "raw_enqueue_added_us",
    "raw_queue_enqueue_added_us",
)


def _finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def test_emit_mode_reports_both_shapes_and_the_raw_insert(pg_url: str) -> None:
    out = emit_figures(emit_overhead(make_url(pg_url), transactions=5))

    for key in KEYS:
        assert _finite(out[key]), key
    for key in ("emit_overhead_ratio", "emit_overhead_ratio_flush", "raw_insert_us", "raw_plain_us"):
        assert out[key] > 0, key
    for key in out:
        if key.startswith("emit_per_s"):
            assert out[key] > 0, key
    # The µs an emit adds is a difference of two noisy means, so only its consistency is checked.
    assert math.isclose(
        out["emit_added_us"],
        (1 / out["emit_per_s_with"] - 1 / out["emit_per_s_without"]) * 1e6,
        rel_tol=1e-6,
    )
    rows = emit_targets(out)
    assert [row[0] for row in rows] == [
        "1 emit overhead, add-emit-commit (pg)",
        "1 emit overhead, add-flush-emit-commit (pg)",
        "1 emit added time, add-emit-commit (pg)",
    ]
    assert [row[2] for row in rows] == ["ratio <= 1.25", "ratio <= 1.25", "<= 200 us"]
    assert all(row[3] in ("PASS", "FAIL") for row in rows)
    # The enqueue written by hand is read beside the emit, from the same run.
    assert f"+{out['raw_enqueue_added_us']:.0f} us" in rows[2][1]
    assert f"the raw queue's enqueue +{out['raw_queue_enqueue_added_us']:.0f} us" in rows[2][1]


def test_emit_mode_on_sqlite_has_no_raw_insert(sqlite_template: Path, tmp_path: Path) -> None:
    path = tmp_path / "emit.db"
    shutil.copy(sqlite_template, path)
    figures = emit_overhead(make_url(f"sqlite:///{path}"), transactions=3)

    assert figures["raw_us"] is None and figures["raw_enqueue_added_us"] is None
    assert figures["raw_queue_enqueue_added_us"] is None
    assert figures["ratio"] > 0 and figures["ratio_flush"] > 0
    assert "n/a" in emit_targets(emit_figures(figures))[0][1]
