"""``outbox.json_default``: the everyday Python values an application's payloads hold, as JSON.

Passed as ``Outbox(json_default=outbox.json_default)``, it is asked about each
payload value JSON has no type for, as ``json.dumps(default=...)`` asks its
``default``: it returns something JSON can hold, or raises ``TypeError``. What
it returns is converted again if need be (a dataclass's Decimal field, an
Enum whose value is a UUID), then the payload passes the usual checks.

The conversions are one way: a handler gets the JSON types back (a string for
a Decimal, a datetime or a UUID; a dict for a dataclass or a model), never the
original objects. docs/emitting.md lists what survives the round trip.
Pydantic is recognised by its ``model_dump(mode="json")`` method, never
imported: an application without it loads nothing more.
"""

from __future__ import annotations

import dataclasses
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

__all__ = ["json_default"]


def json_default(value: Any) -> Any:
    """A JSON-ready stand-in for ``value``, or ``TypeError`` if it is none of the kinds below.

    - ``Decimal``: its exact text, ``str(value)`` (``"19.90"``; a string, so no
      precision is lost to a float);
    - ``datetime``, ``date``, ``time``: ISO 8601, ``value.isoformat()`` (a naive
      datetime stays naive: no offset is made up);
    - ``UUID``: its canonical text;
    - ``Enum``: its ``value``;
    - a dataclass instance: a dict of its fields (nested values converted in turn);
    - a Pydantic model (anything with ``model_dump``): ``model_dump(mode="json")``.
    """
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Shallow on purpose: asdict() deep-copies every field, and what is nested is converted anyway.
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if not isinstance(value, type) and callable(getattr(value, "model_dump", None)):
        return value.model_dump(mode="json")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
