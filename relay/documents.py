"""A message's stored JSON documents (payload, headers) as the relay decodes them: one decode for every read.

Every claimed row has a payload to decode, so the decode is one call of the
json module's C decoder, with nothing else in the way of a normal document.
A document that call cannot decode is another matter. One nested deeper than
Python's recursion limit lets the decoder go (about a thousand levels: written
before ``emit()`` capped nesting, or by another writer), one holding an integer
of more digits than Python turns into a number, text that is not JSON at all
(SQLite keeps any text): decoding it raised while the claim's rows were
fetched. On PostgreSQL the claim's UPDATE had committed by then, so its whole
batch stayed ``running`` until the leases lapsed; ``outbox-relay`` exited with
a traceback, and after a restart the lease recovery met the row again and
failed the same way, a crash loop.

So the decode returns an :class:`Undecodable` in the document's place, saying
why, and only the failure costs anything. A message with one is never handed
to its handler: it goes ``dead`` at once with that reason, as a normal outcome
with its history row (``claimer.py``), and a lease recovery that finds one
makes it dead too instead of due again (``store.py``).

The relay reads rows two ways, and both decode here. Its own psycopg
connections (``db.LoopConnection``: the claim on PostgreSQL) use
:func:`load_document` as their JSON loader; SQLAlchemy statements (the claim
on SQLite and other drivers, the lease recovery) read the documents as text
and decode them in :func:`as_decoded`'s result type, where the driver's or
SQLAlchemy's own ``json.loads`` would raise.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy import ColumnElement, Dialect, Text, cast
from sqlalchemy.types import TypeDecorator

from outbox._first_line import first_line

__all__ = ["Undecodable", "as_decoded", "load_document", "undecodable"]

_DECODER = json.JSONDecoder()


class Undecodable(str):
    """In a stored document's place: why it could not be decoded.

    A ``str``, so whatever shows a claimed message's payload (a signal
    receiver, a log line) shows the reason instead of failing.
    """

    __slots__ = ()


def load_document(data: str | bytes) -> Any:
    """A json/jsonb value as the database hands it over, decoded; an :class:`Undecodable` if it cannot be.

    UTF-8 text is decoded without ``json.loads``'s sniffing: ``json.loads`` on
    bytes first guesses their encoding (UTF-16? UTF-32?) in Python, and every
    claimed message has a payload to decode, so the guess was a measurable part
    of the claim.
    """
    try:
        return _DECODER.decode(data if isinstance(data, str) else data.decode())
    except RecursionError:
        text = data if isinstance(data, str) else data.decode()
        return Undecodable(f"nested {_depth(text)} levels deep, deeper than Python's JSON decoder can go")
    except json.JSONDecodeError as exc:
        return Undecodable(f"not JSON ({exc})")
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits(), bytes that are not UTF-8
        return Undecodable(first_line(exc))


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """Levels of objects and arrays in JSON text, counted by a loop (the decoder needed a frame per level)."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class _Decoded(TypeDecorator[Any]):
    """A JSON document read as its text, decoded by :func:`load_document`."""

    impl = Text
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return None if value is None else load_document(value)


def as_decoded(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """A JSON column for a SQLAlchemy statement to return: read as text, decoded here, whatever it holds.

    Cast to text, so that on PostgreSQL the driver hands the text over instead
    of decoding the ``jsonb`` itself; on SQLite the column is text already.
    """
    return cast(column, _Decoded()).label(column.key)


def undecodable(row: Any) -> str | None:
    """Why a row's payload or headers cannot be given to a handler, or None (nearly always)."""
    if type(row.payload) is not Undecodable and type(row.headers) is not Undecodable:
        return None
    part = "payload" if type(row.payload) is Undecodable else "headers"
    return f"the stored {part} cannot be decoded: {getattr(row, part)}"
