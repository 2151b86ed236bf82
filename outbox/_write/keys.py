"""``key`` and ``group_key`` at emit: placeholders, and ids that do not exist yet.

An idempotency key stores its event once per route, and drops every later
event with that key without a word (the INSERT's ``ON CONFLICT DO NOTHING``).
So a key built from an id the database has not assigned yet,
``f"order.placed:{order.id}"`` before the flush, is the worst kind of bug: the
first order's event is stored as ``order.placed:None`` and every later
order's is dropped as its duplicate.

Two things here prevent it:

- **Placeholders.** ``{aggregate_id}``, ``{aggregate_type}`` and
  ``{event_type}`` are filled in by the outbox. The last two are known at
  emit; ``{aggregate_id}`` is filled at emit when the emitting object already
  has its primary key, else when its row is written (after the flush that
  assigns it): a :class:`KeyTemplate` waits until then.
- **Refusing "None".** When an ``OutboxMixin`` object emits before it has an
  id, a key or group key whose own text has a word ``None`` (what ``str(None)``
  wrote), or a payload with its id as ``null``, is refused at emit, naming the
  placeholder to use instead. The check runs only then: with the id unset, a
  ``None`` in the caller's text is almost certainly that id, and an object
  that has its id never pays for the check.

Any other ``{...}`` (``{0}``, ``{order_id}``, a format spec) or an unmatched
brace is refused at emit: literal braces are written doubled, as in
``str.format``.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any

from sqlalchemy import inspect

from .._exceptions import EmitError, InvalidEmitOption, PayloadError
from .payload import text_problem

__all__ = ["KEY_LIMIT", "PLACEHOLDERS", "KeyTemplate", "check_payload_ids", "fill_key"]

#: Width of the idempotency_key and group_key columns.
KEY_LIMIT = 255
PLACEHOLDERS = ("aggregate_id", "aggregate_type", "event_type")
_NAMED = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
_FORMATTER = string.Formatter()
#: ``None`` as a word of its own: what ``f"order:{order.id}"`` writes for an unset id.
_NONE_WORD = re.compile(r"(?<![0-9A-Za-z])None(?![0-9A-Za-z])")
#: ``None`` right after a separator in payload text (``/orders/None``, ``order:None``): prose
#: ("None of them", "Order None") is not flagged.
_NONE_IN_TEXT = re.compile(r"(?<=[/:#=_.-])None(?![0-9A-Za-z])")


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A key waiting for ``{aggregate_id}``: the text around each occurrence, everything else filled."""

    name: str  # "key" or "group_key", for errors
    written: str  # as the caller wrote it
    parts: tuple[str, ...]

    def render(self, aggregate_id: str) -> str:
        """The stored key; EmitError if the id makes it longer than the column (it fails the write)."""
        text = aggregate_id.join(self.parts)
        if len(text) > KEY_LIMIT:
            raise EmitError(
                f"{self.name} {self.written!r} is {len(text)} characters once {{aggregate_id}} is "
                f"filled in; the column holds {KEY_LIMIT}"
            )
        return text


def _fields(name: str, value: str) -> list[tuple[str, str | None]]:
    """(literal text, placeholder or None) pairs; InvalidEmitOption for anything but our placeholders."""
    try:
        pieces = list(_FORMATTER.parse(value))
    except ValueError as exc:
        raise InvalidEmitOption(
            f"{name} {value!r} is not a valid template ({exc}); the placeholders are {_NAMED}, "
            "and a literal brace is written twice ('{{' or '}}')"
        ) from None
    found: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in pieces:
        if field is not None and (field not in PLACEHOLDERS or spec or conversion):
            suffix = (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            written = "{" + field + suffix + "}"
            why = "takes no conversion or format" if field in PLACEHOLDERS else "is not a placeholder"
            raise InvalidEmitOption(
                f"{name} {value!r}: {written} {why}; the placeholders are {_NAMED}, and a literal "
                "brace is written twice ('{{' or '}}')"
            )
        found.append((literal, field))
    return found


def fill_key(
    name: str,
    value: str | None,
    *,
    event_type: str,
    aggregate: Any,
    aggregate_type: str | None,
    aggregate_id: str | None,
) -> str | KeyTemplate | None:
    """The key to store, a KeyTemplate waiting for the aggregate's id, or None; refused if it cannot be.

    ``value`` has passed the basic checks (a non-blank string, storable text).
    """
    if value is None:
        return None
    pending = aggregate is not None and aggregate_id is None
    if "{" not in value and "}" not in value:
        if pending:
            _refuse_none_word(name, value, aggregate)
        return _fits(name, value, value)
    parts = [""]
    for literal, field in _fields(name, value):
        if pending:
            _refuse_none_word(name, literal, aggregate, written=value)
        parts[-1] += literal
        if field is None:
            continue
        if field != "event_type" and aggregate is None:
            raise InvalidEmitOption(
                f"{name} {value!r} uses {{{field}}}, which only an emit from an aggregate has: emit "
                "from the OutboxMixin object (order.emit(...)), or write the value into the key"
            )
        if field == "event_type":
            parts[-1] += event_type
        elif field == "aggregate_type":
            assert aggregate_type is not None
            parts[-1] += aggregate_type
        elif aggregate_id is not None:
            parts[-1] += aggregate_id
        else:
            parts.append("")  # filled when the row is written
    if len(parts) == 1:
        return _fits(name, value, parts[0])
    # The id is at least one character: refuse now what can only be too long.
    _fits(name, value, "x".join(parts))
    return KeyTemplate(name, value, tuple(parts))


def _fits(name: str, written: str, text: str) -> str:
    if len(text) > KEY_LIMIT:
        filled = "" if text == written else " with its placeholders filled in"
        raise InvalidEmitOption(f"{name} must be at most {KEY_LIMIT} characters{filled}, got {len(text)}")
    problem = None if text is written else text_problem(text)  # the caller's own text was checked
    if problem:
        raise InvalidEmitOption(f"{name} {problem}")
    return text


def _refuse_none_word(name: str, text: str, aggregate: Any, *, written: str | None = None) -> None:
    if "None" not in text or not _NONE_WORD.search(text):
        return
    whole = text if written is None else written
    suggested = _NONE_WORD.sub("{aggregate_id}", whole)
    kind = type(aggregate).__name__
    raise InvalidEmitOption(
        f"{name} {whole!r} has 'None' where this {kind} has no id yet (the database assigns it "
        f"when the {kind} is flushed), so every {kind} would share this {name}: write {{aggregate_id}}, "
        f"filled in when the row is written ({name}={suggested!r}), or flush before emitting"
    )


def _id_names(aggregate: Any, aggregate_type: str) -> set[str]:
    """Payload keys that would hold this aggregate's unset id: ``id``, ``order_id``, ``orderId``, ..."""
    state = inspect(aggregate)
    mapper = state.mapper
    unset = [
        mapper.get_property_by_column(column).key
        for column, value in zip(mapper.primary_key, mapper.primary_key_from_instance(aggregate), strict=True)
        if value is None
    ]
    stems = {_snake(aggregate_type), _snake(type(aggregate).__name__)}
    table = getattr(mapper.local_table, "name", None)
    if isinstance(table, str):
        stems |= {table, table.removesuffix("s")}
    names = set(unset)
    for attribute in unset:
        for stem in stems:
            names |= {f"{stem}_{attribute}", f"{_camel(stem)}{attribute[:1].upper()}{attribute[1:]}"}
    return names


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _camel(snake: str) -> str:
    first, *rest = snake.split("_")
    return first + "".join(word.title() for word in rest)


def check_payload_ids(document: str, aggregate: Any, aggregate_type: str) -> None:
    """PayloadError if the payload holds the emitting object's id while it is still unset.

    Called only for an emit from an object without its id. The text is
    searched first, so a payload with neither ``null`` nor ``None`` in it is
    never parsed again.
    """
    if "null" not in document and "None" not in document:
        return
    names = _id_names(aggregate, aggregate_type)
    where = _find_unset_id(json.loads(document), names, [])
    if where is None:
        return
    kind = type(aggregate).__name__
    raise PayloadError(
        f"{where}: this {kind} has no id yet (the database assigns it when the {kind} is "
        "flushed), so the payload cannot hold it. The handler gets the id as msg.aggregate_id "
        "(the value {aggregate_id} fills in a key); or flush before emitting"
    )


def _find_unset_id(value: Any, names: set[str], parts: list[str]) -> str | None:
    if isinstance(value, dict):
        for key, item in value.items():
            parts.append(f"[{key!r}]")
            if key in names and item in (None, "None"):
                return f"payload{''.join(parts)} is {item!r}"
            found = _find_unset_id(item, names, parts)
            parts.pop()
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            parts.append(f"[{index}]")
            found = _find_unset_id(item, names, parts)
            parts.pop()
            if found:
                return found
    elif isinstance(value, str) and "None" in value and _NONE_IN_TEXT.search(value):
        return f"payload{''.join(parts)} is {value!r}"
    return None
