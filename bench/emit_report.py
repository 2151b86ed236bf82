"""Mode 1's figures as flat JSON keys and as rows of the target table.

Kept beside the mode, so the runner only calls these two: the targets are
emit overhead <= 1.25 in both shapes, and at most 200 µs added to the ORM
transaction by one emit, read next to what a hand-written enqueue of the same
row adds to a plain psycopg transaction in the same run, and what the raw
queue's enqueue of its own narrow row adds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EMIT_ADDED_TARGET_US", "EMIT_RATIO_TARGET", "emit_figures", "emit_targets"]

EMIT_RATIO_TARGET = 1.25
#: What one emit may add to the add-emit-commit transaction, in µs.
EMIT_ADDED_TARGET_US = 200.0


def emit_figures(emit: dict[str, Any]) -> dict[str, Any]:
    """The flat JSON keys of one PostgreSQL emit run."""
    return {
        "emit_overhead_ratio": emit["ratio"],
        "emit_overhead_ratio_flush": emit["ratio_flush"],
        "emit_per_s_without": emit["rate_without"],
        "emit_per_s_installed_no_emit": emit["rate_installed"],
        "emit_per_s_with": emit["rate_with"],
        "emit_per_s_without_flush": emit["rate_without_flush"],
        "emit_per_s_with_flush": emit["rate_with_flush"],
        "emit_added_us": emit["added_us"],
        "emit_added_us_flush": emit["added_us_flush"],
        "raw_insert_us": emit["raw_us"],
        "raw_plain_us": emit["raw_plain_us"],
        "raw_enqueue_added_us": emit["raw_enqueue_added_us"],
        "raw_queue_enqueue_added_us": emit["raw_queue_enqueue_added_us"],
    }


def _num(value: Any, spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def emit_targets(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(mode, figure, target, verdict) rows for both shapes; '-' where a figure is missing."""
    rows = []
    raw = _num(out.get("raw_insert_us"), ".0f")
    for label, suffix in (("add-emit-commit", ""), ("add-flush-emit-commit", "_flush")):
        ratio = out.get(f"emit_overhead_ratio{suffix}")
        rows.append(
            (
                f"1 emit overhead, {label} (pg)",
                f"{_num(out.get(f'emit_per_s_without{suffix}'), '.0f')} -> "
                f"{_num(out.get(f'emit_per_s_with{suffix}'), '.0f')} tx/s, ratio {_num(ratio, '.2f')}; "
                f"+{_num(out.get(f'emit_added_us{suffix}'), '.0f')} us/tx (raw INSERT+COMMIT {raw} us)",
                f"ratio <= {EMIT_RATIO_TARGET:.2f}",
                "-" if ratio is None else ("PASS" if ratio <= EMIT_RATIO_TARGET else "FAIL"),
            )
        )
    added = out.get("emit_added_us")
    rows.append(
        (
            "1 emit added time, add-emit-commit (pg)",
            f"+{_num(added, '.0f')} us/tx; a hand-written psycopg enqueue adds "
            f"+{_num(out.get('raw_enqueue_added_us'), '.0f')} us to a "
            f"{_num(out.get('raw_plain_us'), '.0f')} us transaction, the raw queue's enqueue "
            f"+{_num(out.get('raw_queue_enqueue_added_us'), '.0f')} us",
            f"<= {EMIT_ADDED_TARGET_US:.0f} us",
            "-" if added is None else ("PASS" if added <= EMIT_ADDED_TARGET_US else "FAIL"),
        )
    )
    return rows
