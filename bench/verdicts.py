"""The table's PASS / FAIL / "-" column, in one place.

A ratio of two systems' rates means nothing at ``--quick``'s 2,000 messages:
each side's start-up and exit outweigh its deliveries (a quick run once showed
the raw-queue ratio as 1.02, "PASS", against 0.27 at full size). Such rows
print their figure with no verdict there, as the backlog rows always did.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rate_ratio_verdict", "verdict"]


def verdict(ok: bool | None) -> str:
    """'-' where the figure is missing, else PASS or FAIL."""
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def rate_ratio_verdict(out: dict[str, Any], ok: bool | None) -> str:
    """As ``verdict``, but '-' in a quick run, where rates of a few thousand messages are start-up."""
    return "-" if out.get("quick") else verdict(ok)
