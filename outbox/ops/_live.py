"""``change_marker``: a cheap answer to "did anything happen since I last looked?"."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from .._tables import outbox_attempt, outbox_message, outbox_pause_log

__all__ = ["change_marker"]


def change_marker(engine: Engine) -> tuple[Any, ...]:
    """Changes when a message is emitted, an attempt or an operator's action is recorded, a pause changes.

    Three primary-key maxima: index lookups that stay instant on any table size.
    Every status change of a message writes a history row (delivery, retry,
    death, requeue, discard), so a live view that re-reads when this changes
    misses only claims, which it shows at the next change.
    """
    with engine.connect() as conn:
        row = conn.execute(
            select(
                select(func.max(outbox_message.c.id)).scalar_subquery(),
                select(func.max(outbox_attempt.c.id)).scalar_subquery(),
                select(func.max(outbox_pause_log.c.id)).scalar_subquery(),
            )
        ).one()
    return tuple(row)
