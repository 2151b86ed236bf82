"""``payload.PATH=VALUE``: equality on one value inside a message's payload, alike on both databases.

PATH is dot-separated segments of ASCII letters, digits and underscores; a
segment of digits only indexes an array (``items.0.sku``), any other names an
object key. VALUE is read as JSON when it is a JSON scalar (``42``, ``1.5``,
``true``, ``null``, ``"42"``) and as a string otherwise (``paid``). The value
at PATH must be of the same JSON type and equal: ``42`` does not match ``"42"``,
``true`` does not match ``1``, and ``null`` matches an explicit JSON null, not
a missing key.

Both are bound as parameters; no part of them is ever written into the SQL.
PostgreSQL tests ``payload @> '{"order_id": 42}'`` (which a GIN index on the
payload serves) and then the exact value at the path, since containment alone
would let ``items.0`` match any element; SQLite compares ``json_type`` and
``json_extract`` at the path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ARRAY, Boolean, ColumnElement, Text, and_, bindparam, cast, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

from .._exceptions import OutboxError
from .._tables import outbox_message
from .._write.payload import text_problem

__all__ = ["PayloadEquals", "parse_where"]

_SEGMENT = re.compile(r"[A-Za-z0-9_]+")  # fullmatch: "$" would let a trailing newline through
_INDEX = re.compile(r"[0-9]+")
#: Integers both databases compare exactly (SQLite's JSON functions stop at 64 bits).
_INT_LIMIT = 2**63
_INT_DIGITS = len(str(_INT_LIMIT))


class WhereError(OutboxError, ValueError):
    """A ``payload.PATH=VALUE`` condition that cannot be used as given."""


Scalar = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class PayloadEquals:
    """The value at ``path`` inside the payload equals ``value`` (same JSON type, same value)."""

    path: tuple[str | int, ...]
    value: Scalar

    def __post_init__(self) -> None:
        if not self.path:
            raise WhereError("a payload path needs at least one key")
        for segment in self.path:
            if isinstance(segment, bool) or not isinstance(segment, str | int):
                raise WhereError(f"path segments are keys or array indexes, got {segment!r}")
            if isinstance(segment, int) and segment < 0:
                raise WhereError(f"array indexes count from 0, got {segment}")
            if isinstance(segment, str) and (not _SEGMENT.fullmatch(segment) or _INDEX.fullmatch(segment)):
                raise WhereError(
                    f"bad key {segment!r}: keys are letters, digits and underscores, not digits only"
                )
        _check_value(self.value)

    def condition(self) -> ColumnElement[bool]:
        return _PayloadCondition(self)

    def __str__(self) -> str:
        return f"payload.{'.'.join(map(str, self.path))}={json.dumps(self.value)}"


def _check_value(value: Any) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        problem = text_problem(value)
        if problem:  # emit() stores no such string, and PostgreSQL refuses it mid-query
            raise WhereError(f"the value {problem}, so no payload holds it")
        return
    if isinstance(value, int):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise WhereError(f"{value} is out of range: integers are compared up to 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise WhereError(f"{value} is not a JSON number")
        return
    raise WhereError(
        f"compare one value at a time (a string, number, true, false or null), not {type(value).__name__};"
        " name a deeper path instead"
    )


def _not_json(constant: str) -> Any:
    raise ValueError(constant)  # NaN and Infinity are Python's extension, not JSON


def _json_int(digits: str) -> int:
    """A JSON integer, refused before ``int()`` when it is too long to compare.

    ``int()`` itself refuses more than ``sys.get_int_max_str_digits()`` digits
    (4,300) with a ValueError, which would read the number as text: a
    5,000-digit id would then quietly match nothing.
    """
    if len(digits.lstrip("-")) > _INT_DIGITS:
        raise WhereError(
            f"a {len(digits.lstrip('-'))}-digit integer is out of range: integers are compared up to 64 bits"
        )
    return int(digits)


def parse_where(text: str) -> PayloadEquals:
    """``payload.order.id=42`` → ``PayloadEquals(("order", "id"), 42)``; anything malformed is refused."""
    target, equals, raw = text.partition("=")
    if not equals:
        raise WhereError(f"expected payload.PATH=VALUE, got {text!r}")
    prefix, dot, path = target.strip().partition(".")
    if prefix != "payload" or not dot or not path:
        raise WhereError(f"expected payload.PATH=VALUE (e.g. payload.order_id=42), got {text!r}")
    segments: list[str | int] = []
    for segment in path.split("."):
        if not _SEGMENT.fullmatch(segment):
            raise WhereError(f"bad path {path!r}: dot-separated keys of letters, digits and underscores")
        segments.append(int(segment) if _INDEX.fullmatch(segment) else segment)
    try:
        value: Any = json.loads(raw, parse_constant=_not_json, parse_int=_json_int)
    except WhereError:
        raise
    except ValueError:
        value = raw
    if isinstance(value, dict | list):
        raise WhereError(
            f"{raw!r} is a JSON {'object' if isinstance(value, dict) else 'array'}: compare one value"
            " at a time, with a deeper path (payload.items.0.sku=A1)"
        )
    return PayloadEquals(tuple(segments), value)


class _PayloadCondition(ColumnElement[bool]):
    inherit_cache = False
    type = Boolean()

    def __init__(self, where: PayloadEquals) -> None:
        self.where = where


def _containment(path: tuple[str | int, ...], value: Scalar) -> Any:
    """The document ``@>`` needs: the keys up to the first array index, the rest in a one-element array."""
    document: Any = value
    for segment in reversed(path):
        document = [document] if isinstance(segment, int) else {segment: document}
    return document


@compiles(_PayloadCondition, "postgresql")
def _postgresql(element: _PayloadCondition, compiler: SQLCompiler, **kw: Any) -> str:
    payload = outbox_message.c.payload
    path, value = element.where.path, element.where.value
    exact = and_(
        payload.op("@>")(cast(bindparam(None, json.dumps(_containment(path, value)), Text), JSONB)),
        payload.op("#>")(cast(bindparam(None, [str(s) for s in path], ARRAY(Text)), ARRAY(Text)))
        == cast(bindparam(None, json.dumps(value), Text), JSONB),
    )
    return f"({compiler.process(exact, **kw)})"


def _sqlite_path(path: tuple[str | int, ...]) -> str:
    return "$" + "".join(f"[{s}]" if isinstance(s, int) else f'."{s}"' for s in path)


def _sqlite_type(value: Scalar) -> tuple[str, ...]:
    if value is None:
        return ("null",)
    if value is True:
        return ("true",)
    if value is False:
        return ("false",)
    if isinstance(value, str):
        return ("text",)
    return ("integer", "real")


@compiles(_PayloadCondition)
def _sqlite(element: _PayloadCondition, compiler: SQLCompiler, **kw: Any) -> str:
    payload = outbox_message.c.payload
    path, value = element.where.path, element.where.value
    where = bindparam(None, _sqlite_path(path), Text)
    condition: ColumnElement[bool] = func.json_type(payload, where).in_(_sqlite_type(value))
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        condition = and_(condition, func.json_extract(payload, where) == bindparam(None, value))
    return f"({compiler.process(condition, **kw)})"
