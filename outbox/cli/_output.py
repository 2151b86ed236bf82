"""How every subcommand prints: JSON, a plain table, times, free text on one line, the y/N question."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from ._args import Failed

__all__ = ["confirmed", "flat", "print_json", "table", "when"]


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str, sort_keys=True))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[("" if v is None else str(v)).replace("\n", " ")[:60] for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def when(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def flat(text: str) -> str:
    """Free text on one line of output."""
    return " ".join(text.split())


def confirmed(question: str, refusal: str) -> bool:
    """Ask ``question [y/N]`` on a terminal; without one, refuse with ``refusal`` (exit 1).

    Anything but ``y``, or Ctrl-D (end of input), is no.
    """
    if not sys.stdin.isatty():
        raise Failed(refusal)
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:  # Ctrl-D: no answer is no
        print()
        return False
    return answer.strip().lower() in ("y", "yes")
