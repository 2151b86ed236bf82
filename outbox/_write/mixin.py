"""OutboxMixin: events that know which aggregate emitted them."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, ClassVar

from sqlalchemy.orm import object_session

from .._exceptions import EmitError
from .emit import emit

__all__ = ["OutboxMixin"]


class OutboxMixin:
    """Add to an ORM model to emit events from its instances.

    ``order.emit("order.paid", {...})`` emits in the session that holds the
    instance and records ``aggregate_type`` (the class name, or
    ``__outbox_aggregate_type__``) and ``aggregate_id`` (its primary key, joined
    with ``:`` when composite). The id may be unknown at emit time; it is read
    when the event is written, after the instance's row is flushed. So a key
    names it as ``{aggregate_id}``, filled in then; a key, group key or payload
    that holds the unset id itself (``None``) is refused (``_write/keys.py``).
    """

    __outbox_aggregate_type__: ClassVar[str | None] = None

    def emit(
        self,
        event_type: str,
        payload: Any,
        *,
        key: str | None = None,
        group_key: str | None = None,
        delay: float | timedelta | None = None,
        headers: dict[str, str] | None = None,
        priority: int | None = None,
        queue: str | None = None,
        expires_at: datetime | None = None,
    ) -> uuid.UUID:
        session = object_session(self)
        if session is None:
            raise EmitError(
                f"this {type(self).__name__} is not in a session, so there is no transaction "
                "to emit in; session.add() it first"
            )
        return emit(
            session,
            event_type,
            payload,
            key=key,
            group_key=group_key,
            delay=delay,
            headers=headers,
            priority=priority,
            queue=queue,
            expires_at=expires_at,
            _aggregate=self,
        )
