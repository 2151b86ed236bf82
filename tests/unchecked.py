"""Rows that reach the relay without the emit-time checks of their handlers.

A message stored by a release before ``outbox_validate`` existed, copied by a
requeue, or written by hand never met its handler's check, so delivery must
still refuse a bad one. This stores such rows through a throwaway Outbox whose
routes share the real routes' names but not their handlers.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from outbox import Message, Outbox, emit


def _unchecked(msg: Message) -> None:
    raise AssertionError("the throwaway outbox only writes; the real one delivers")


def store_unchecked(engine: Engine, event_type: str, payload: dict[str, Any], *route_names: str) -> None:
    writer = Outbox()
    for name in route_names:
        writer.route(event_type, _unchecked, name=name)
    factory = sessionmaker(engine)
    writer.install(factory)
    try:
        with factory.begin() as session:
            emit(session, event_type, payload)
    finally:
        writer.uninstall(factory)
