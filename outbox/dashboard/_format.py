"""How values read in the pages: times, ages, counts, JSON. Jinja filters, escaped by the templates."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from outbox.ops import login_apart

__all__ = ["FILTERS"]


def _time(value: datetime | None) -> str:
    if value is None:
        return "–"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _age(seconds: float | None) -> str:
    """Two units, the way an operator reads an age: ``3d 4h``, ``2h 5m``, ``4m 10s``, ``0.4s``."""
    if seconds is None:
        return "–"
    seconds = max(0.0, float(seconds))
    whole = int(seconds)
    for (big, size), (small, small_size) in zip(_UNITS, _UNITS[1:], strict=False):
        if whole >= size:
            return f"{whole // size}{big} {(whole % size) // small_size}{small}"
    return f"{seconds:.1f}s"


_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def _since(value: datetime | None) -> str:
    if value is None:
        return "–"
    return _age((datetime.now(UTC) - value).total_seconds())


def _number(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _compact(value: Any) -> str:
    """A JSON document on one line, for a preview; the template escapes it."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str, separators=(", ", ": "))


def _short(value: str | None, length: int = 120) -> str:
    if not value:
        return ""
    line = value.strip().splitlines()[0] if value.strip() else value
    return line if len(line) <= length else line[: length - 1] + "…"


FILTERS: dict[str, Any] = {
    "time": _time,
    "age": _age,
    "since": _since,
    "number": _number,
    "pretty": _pretty,
    "compact": _compact,
    "short": _short,
    "login_apart": login_apart,
}
