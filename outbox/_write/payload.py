"""Payload and header checks done at emit time, in the request, not later in the relay."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import TYPE_CHECKING, Any
from uuid import UUID

from .._exceptions import InvalidEmitOption, PayloadError
from .._redact import DEPTH_SHOWN

if TYPE_CHECKING:
    from .._routes import Route

#: ``Outbox(json_default=...)``: a JSON stand-in for a value, or TypeError (``json.dumps``'s ``default``).
JsonDefault = Callable[[Any], Any]
#: How many times in a row json_default may hand back something it must be asked about again.
_CONVERSIONS = 8

__all__ = [
    "DEFAULT_DEPTH_LIMIT",
    "DEFAULT_PAYLOAD_LIMIT",
    "MAX_DEPTH_LIMIT",
    "JsonDefault",
    "check_headers",
    "convert",
    "route_document",
    "serialise_payload",
    "text_problem",
]

DEFAULT_PAYLOAD_LIMIT = 64 * 1024
#: How many levels of objects and arrays a payload may nest, the payload itself being level 1
#: (``{"a": {"b": [1]}}`` is 3 deep). Real documents (an order with its lines, a rich-text tree,
#: a JSON Schema) stay well under 20. Everything that handles a payload after emit() spends
#: stack per level: the json module's encoder and decoder (which psycopg's JSONB adaptation
#: uses both ways, and the relay to read a claimed row) take one level of Python's recursion
#: limit (1000) each, shared with whatever the caller's stack already holds; SQLite's JSON
#: functions refuse more than 1000 levels; PostgreSQL's parser is bounded by max_stack_depth.
#: Without a cap a payload 990 deep passed emit() and then broke the caller's commit on SQLite,
#: the relay's claim on PostgreSQL, and every reader. 64 is far inside all of these.
DEFAULT_DEPTH_LIMIT = 64
#: The most ``Outbox(payload_depth_limit=...)`` allows: still a quarter of the recursion limit,
#: leaving the rest to a web framework's and SQLAlchemy's frames; and the depth operators'
#: readers (``outbox show``, the dashboard) show whole.
MAX_DEPTH_LIMIT = DEPTH_SHOWN


def _path(parts: list[str]) -> str:
    return "payload" + "".join(parts)


class _TooDeep(Exception):
    """The walk reached a container more levels deep than allowed (a reference cycle does too)."""

    def __init__(self, parts: list[str]) -> None:
        super().__init__()
        self.where = _short_path(parts)


def _short_path(parts: list[str]) -> str:
    """A path for an error line: the deep middle of a long one elided."""
    if len(parts) > 8:
        parts = [*parts[:4], "…", *parts[-3:]]
    return _path(parts)


def _containers(value: Any) -> Any:
    """(path part, item) of each object or array directly inside ``value``."""
    if isinstance(value, dict):
        return ((f"[{key!r}]", item) for key, item in value.items() if isinstance(item, dict | list | tuple))
    return ((f"[{index}]", item) for index, item in enumerate(value) if isinstance(item, dict | list | tuple))


def _depth_problem(payload: dict[str, Any], limit: int, where: str) -> str:
    """The error for a payload the walk found nested past ``limit`` levels (first at ``where``).

    Measures the whole depth, to say how far over the limit it is, with a loop
    and a stack of its own rather than recursion, so no depth is too much to
    measure; only ever run for a payload that is already refused. A payload
    that contains itself is endlessly deep, and is named for that instead.
    """
    deepest = 1
    parts: list[str] = []
    stack = [(id(payload), _containers(payload))]  # from the payload down to where the walk is
    is_open = {id(payload)}
    while stack:
        for part, item in stack[-1][1]:
            if id(item) in is_open:
                return (
                    f"{_short_path([*parts, part])} is an object or array that contains itself, "
                    "which JSON cannot represent; store a copy without the cycle"
                )
            parts.append(part)
            stack.append((id(item), _containers(item)))
            is_open.add(id(item))
            deepest = max(deepest, len(stack))
            break
        else:
            is_open.discard(stack.pop()[0])
            if parts:
                parts.pop()
    return (
        f"payload is nested {deepest} levels deep, over the limit of {limit} (level {limit + 1} "
        f"starts at {where}); store it flatter, or raise the limit with "
        f"Outbox(payload_depth_limit=...) (at most {MAX_DEPTH_LIMIT})"
    )


def _find_unstorable(value: Any, parts: list[str], levels: int) -> str | None:
    """Say where and why a value would not survive a JSON round trip unchanged.

    ``levels``: how many levels of containers may still open here; one more
    raises ``_TooDeep``. Counted in the walk emit() makes anyway, so the depth
    check costs an argument and a comparison per container, and the walk never
    recurses far enough to meet Python's recursion limit.
    """
    if value is None or isinstance(value, str | bool | int):
        return None
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        return f"{_path(parts)} is {value!r}, which JSON cannot represent"
    if isinstance(value, dict):
        if not levels:
            raise _TooDeep(parts)
        for key, item in value.items():
            if not isinstance(key, str):
                return (
                    f"{_path(parts)} has key {key!r} of type {type(key).__name__}; "
                    "JSON object keys must be strings"
                )
            parts.append(f"[{key!r}]")
            problem = _find_unstorable(item, parts, levels - 1)
            parts.pop()
            if problem:
                return problem
        return None
    if isinstance(value, list | tuple):
        if not levels:
            raise _TooDeep(parts)
        for index, item in enumerate(value):
            parts.append(f"[{index}]")
            problem = _find_unstorable(item, parts, levels - 1)
            parts.pop()
            if problem:
                return problem
        return None
    return f"{_path(parts)} is a {type(value).__name__}, which is {NOT_SERIALISABLE}{_hint(value)}"


#: What every "this type cannot be stored" message says; a json_default that passed on it adds to it.
NOT_SERIALISABLE = "not JSON-serialisable"
_CONVERTS = " or let Outbox(json_default=outbox.json_default) convert it"


def _hint(value: Any) -> str:
    """What to store instead; for the kinds ``outbox.json_default`` converts, that it does."""
    if isinstance(value, Mapping):  # json.dumps writes dicts only: a mappingproxy, say, would fail there
        return " (store dict(value))"
    if isinstance(value, datetime | date | time):
        return f" (store value.isoformat(),{_CONVERTS})"
    if isinstance(value, UUID | Decimal):
        return f" (store str(value),{_CONVERTS})"
    if isinstance(value, bytes | bytearray | memoryview):
        return " (store base64 text, or better a reference to the data)"
    if isinstance(value, Enum):
        return f" (store value.value,{_CONVERTS})"
    if dataclasses.is_dataclass(value) or hasattr(value, "model_dump"):
        return f" (store a dict of its fields,{_CONVERTS})"
    return " (convert it to JSON types, or pass Outbox(json_default=...))"


def _find_unencodable(value: Any, parts: list[str]) -> str | None:
    """Say where a string holds what PostgreSQL cannot store: NUL, or a lone surrogate.

    The same walk as ``_find_unstorable``, kept apart on purpose: that one runs on
    every emit, and folding both checks into one generic walk made every emit
    slower (11 to 20 µs for a small payload); this one runs only when the
    serialised text already hints at a problem.
    """
    if isinstance(value, str):
        problem = text_problem(value)
        return f"{_path(parts)} {problem}" if problem else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            parts.append(f"[{key!r}]")
            problem = _find_unencodable(key, parts) or _find_unencodable(item, parts)
            parts.pop()
            if problem:
                return problem
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            parts.append(f"[{index}]")
            problem = _find_unencodable(item, parts)
            parts.pop()
            if problem:
                return problem
    return None


def _find_unwritable_int(value: Any, parts: list[str], digits: int) -> str | None:
    """Say where an integer has more digits than Python will turn into text (sys.get_int_max_str_digits).

    Only walked after json.dumps refused the payload, so ordinary payloads never pay for it.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if digits and abs(value) >= 10**digits:
            return (
                f"{_path(parts)} is an integer of more than {digits} digits, which cannot be "
                "written as JSON text; store it as a string"
            )
        return None
    if isinstance(value, dict):
        items: Any = ((f"[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for part, item in items:
        parts.append(part)
        problem = _find_unwritable_int(item, parts, digits)
        parts.pop()
        if problem:
            return problem
    return None


def _name(default: JsonDefault) -> str:
    """``json_default=<its name>``, as the Outbox was given it."""
    return f"json_default={getattr(default, '__qualname__', None) or repr(default)}"


def convert(value: Any, default: JsonDefault, levels: int, parts: list[str]) -> Any:
    """``value`` with what JSON has no type for replaced by ``default``'s stand-in, as json.dumps would.

    Containers are copied only where something in them changed. Whatever
    ``default`` cannot convert (it raised TypeError) is left in place for the
    checks to name, and so is anything deeper than ``levels``: the depth check
    says how deep, a cycle included. Any other exception from ``default`` is a
    PayloadError naming where it happened.
    """
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        if levels <= 0:
            return value
        changed: dict[Any, Any] | None = None
        for key, item in value.items():
            parts.append(f"[{key!r}]")
            new = convert(item, default, levels - 1, parts)
            parts.pop()
            if new is not item:
                if changed is None:
                    changed = dict(value)
                changed[key] = new
        return value if changed is None else changed
    if isinstance(value, list | tuple):
        if levels <= 0:
            return value
        items = []
        differs = False
        for index, item in enumerate(value):
            parts.append(f"[{index}]")
            new = convert(item, default, levels - 1, parts)
            parts.pop()
            differs = differs or new is not item
            items.append(new)
        return items if differs else value
    original = value
    for _ in range(_CONVERSIONS):
        try:
            value = default(value)
        except TypeError:
            return original
        except Exception as exc:
            raise PayloadError(
                f"{_path(parts)}: {_name(default)} raised {type(exc).__name__} for a "
                f"{type(value).__name__}: {exc}"
            ) from exc
        if value is None or isinstance(value, str | bool | int | float | dict | list | tuple):
            return convert(value, default, levels, parts)
    return original


def text_problem(value: str) -> str | None:
    """Why a string cannot be stored in a text column (NUL, lone surrogate), or None."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which PostgreSQL text and JSON reject"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate, which is not valid UTF-8"
    return None


def serialise_payload(payload: Any, limit: int, depth_limit: int, default: JsonDefault | None = None) -> str:
    """Return the payload as compact JSON, or raise PayloadError saying what to fix.

    ``limit`` is in bytes of JSON, ``depth_limit`` in levels of nesting (see
    ``DEFAULT_DEPTH_LIMIT``). The returned document is what gets stored: a
    caller who changes the dict after emit() cannot slip an unchecked,
    oversized or deeper value past the checks.

    ``default`` (``Outbox(json_default=...)``) converts what JSON has no type
    for; it is consulted only for a payload the plain check refuses, so a
    payload of JSON types costs nothing more, and what it makes passes every
    check (size and depth included) as if the caller had written it.
    """
    if default is not None and not isinstance(payload, dict):
        payload = convert(payload, default, depth_limit, [])
    if not isinstance(payload, dict):
        hint = "pass dict(payload)" if isinstance(payload, Mapping) else "wrap it, e.g. {'value': ...}"
        raise PayloadError(f"payload must be a JSON object (a dict), got {type(payload).__name__}; {hint}")
    try:
        problem = _find_unstorable(payload, [], depth_limit)
        if problem and default is not None:
            payload = convert(payload, default, depth_limit, [])
            problem = _find_unstorable(payload, [], depth_limit)
            if problem and NOT_SERIALISABLE in problem:
                problem = f"{problem}; {_name(default)} did not convert it (it raised TypeError)"
    except _TooDeep as exc:
        raise PayloadError(_depth_problem(payload, depth_limit, exc.where)) from None
    except RecursionError:  # only if the caller's own stack is already close to the limit
        raise PayloadError("payload is nested too deeply to serialise") from None
    if problem:
        raise PayloadError(problem)
    try:
        document = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # The walk above covers types and floats; what is left is an integer past Python's digit limit.
        problem = _find_unwritable_int(payload, [], sys.get_int_max_str_digits())
        raise PayloadError(problem or f"payload cannot be written as JSON: {exc}") from None
    try:
        encoded = document.encode("utf-8")
    except UnicodeEncodeError:
        encoded = b""
    # json.dumps writes NUL as \u0000; only a payload with that (or literal "\u0000" text) is walked.
    if not encoded or "\\u0000" in document:
        problem = _find_unencodable(payload, [])
        if problem:
            raise PayloadError(problem)
    size = len(encoded)
    if size > limit:
        raise PayloadError(
            f"payload is {size} bytes as JSON, over the limit of {limit} bytes; store a "
            "reference (an id, a URL) and load the data in the handler, or raise the limit "
            "with Outbox(payload_limit=...)"
        )
    return document


def route_document(
    route: Route,
    event_type: str,
    payload: Any,
    document: str,
    limit: int,
    depth_limit: int,
    default: JsonDefault | None = None,
) -> str:
    """The JSON text ``route`` stores for one event, or PayloadError naming the route.

    ``document`` is the event's checked payload text. A transform gets its own
    copy parsed from it (what a handler would see; one route's transform cannot
    change what the next one gets), and its result passes the same checks as an
    event's payload. The handler's validator then sees the route's payload.
    Called only for routes with a transform or a validator.
    """
    shaped = payload
    if route.transform is not None:
        try:
            shaped = route.transform(json.loads(document))
        except Exception as exc:
            raise PayloadError(
                f"route {route.name!r}: transform of the {event_type!r} payload failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(shaped, dict) and inspect.isawaitable(shaped):
            close = getattr(shaped, "close", None)
            if close is not None:
                close()  # never awaited: say so here rather than in a RuntimeWarning
            raise PayloadError(
                f"route {route.name!r}: transform of the {event_type!r} payload returned an awaitable; "
                "a transform runs inside emit() and must be a plain function"
            )
        try:
            document = serialise_payload(shaped, limit, depth_limit, default)
        except PayloadError as exc:
            raise PayloadError(
                f"route {route.name!r}: transform of the {event_type!r} payload returned one that "
                f"cannot be stored: {exc}"
            ) from exc
    if route.validator is not None:
        if default is not None:  # what json_default made of it, as the handler will get it
            shaped = json.loads(document)
        try:
            route.validator(shaped)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, PayloadError) else f"{type(exc).__name__}: {exc}"
            raise PayloadError(f"route {route.name!r} refuses this {event_type!r} payload: {reason}") from exc
    return document


def check_headers(headers: Any) -> dict[str, str]:
    """The headers as a flat mapping of str to str: nothing nests, so there is no depth to cap."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidEmitOption(f"headers must be a mapping of str to str, got {type(headers).__name__}")
    checked: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidEmitOption(f"header names must be non-empty strings, got {name!r}")
        if not isinstance(value, str):
            raise InvalidEmitOption(f"header {name!r} must have a str value, got {type(value).__name__}")
        if any(ch in name + value for ch in "\r\n\x00"):
            raise InvalidEmitOption(f"header {name!r} contains a line break or NUL character")
        problem = text_problem(name + value)
        if problem:
            raise InvalidEmitOption(f"header {name!r} {problem}")
        checked[name] = value
    return checked
