"""What an attempt came to: a handler's return value, or what it raised, made into a :class:`Completion`.

One place decides it for every way a handler is called: one message at a
time (``dispatch.attempt``) and a batch at once (``batch.py``, where each
message's element of the returned list, or what the whole call raised, is
classified here as if that message's own call had returned or raised it).
It also makes whatever a handler produced storable: exception texts redacted
and cut to length, details plain JSON without NUL, so one odd outcome never
holds back the batch of outcomes it is written with.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from outbox import Message, PermanentError, RetryLater, Route
from outbox._redact import Redactor

from .outcomes import Completion

__all__ = ["MAX_RETRY_DELAY", "classify", "describe"]

_ERROR_LIMIT = 2000
_NAME_LIMIT = 255  # outbox_attempt.error_type is a VARCHAR(255)
#: The longest retry a handler may ask for: ``RetryLater(delay=float("inf"))`` (or a hostile
#: ``Retry-After``) would otherwise overflow the timestamp arithmetic when the outcome is written.
MAX_RETRY_DELAY = 365 * 24 * 3600.0


def describe(exc: BaseException, redactor: Redactor) -> tuple[str, str]:
    """The exception's public type name (``SystemExit``, ``outbox.RetryLater``) and its redacted text."""
    kind = type(exc)
    # The public path (outbox.RetryLater), not the private module it lives in.
    module = "outbox" if kind.__module__.startswith("outbox._") else kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    text = redactor.text(_text_of(exc))
    if len(text) > _ERROR_LIMIT:
        text = text[: _ERROR_LIMIT - 1] + "…"
    return name, text


def classify(
    route: Route,
    message: Message,
    max_attempts: int,
    *,
    started: datetime,
    clock: float,
    redactor: Redactor,
    rng: random.Random,
    returned: Any = None,
    raised: BaseException | None = None,
    timed_out: bool = False,
) -> Completion:
    """The outcome of one message's attempt that began at ``started`` (``clock``: ``time.monotonic()`` then).

    ``timed_out``: the route's timeout cut the call off. Otherwise ``raised``
    is what the call raised, or None if it returned ``returned``:

    - returned: delivered; a returned Mapping is the attempt's detail;
    - ``RetryLater``: retried after its delay (or the route's backoff), not
      counted if ``counts_as_attempt=False``, parked on its destination if
      ``until_recovered`` names one;
    - ``PermanentError``: dead at once;
    - anything else, ``SystemExit`` and ``KeyboardInterrupt`` included: failed.

    An attempt that ends undelivered on the message's last counted attempt
    makes it dead, with ``exhausted`` and the outcome it would have had.
    Whatever the handler's objects do when read (an exception's ``__str__``
    raising, a mapping that cannot be serialised) ends up as text, never as
    an exception out of here.
    """
    outcome, status = "delivered", "delivered"
    retry_in: float | None = None  # None: the route's backoff decides; RetryLater(delay=0) means now
    error_type: str | None = None
    error: str | None = None
    detail: dict[str, Any] | None = None
    last = message.attempt >= max_attempts
    refund = False
    parked_on: str | None = None
    if timed_out:
        outcome = "timeout"
        error_type = "TimeoutError"
        error = f"handler did not finish within {route.timeout:g}s"
    elif isinstance(raised, RetryLater):
        outcome = "retry"
        error_type, error = describe(raised, redactor)
        if raised.delay is not None:
            retry_in = raised.delay
        detail = _detail_of(raised, redactor)
        if not raised.counts_as_attempt:
            refund, last = True, False
            detail = {**(detail or {}), "counted": False}
        if raised.until_recovered is not None:
            parked_on = raised.until_recovered
            detail = {**(detail or {}), "parked_on": parked_on}
    elif isinstance(raised, PermanentError):
        outcome = "dead"
        error_type, error = describe(raised, redactor)
        detail = _detail_of(raised, redactor)
    elif raised is not None:
        outcome = "failed"
        error_type, error = describe(raised, redactor)
        detail = _detail_of(raised, redactor)
    if outcome == "delivered":
        # A handler may return facts about the delivery (HTTP status, SMTP queue id).
        if isinstance(returned, Mapping):
            detail = _redacted(returned, redactor)
    elif outcome == "dead" or last:
        status = "dead"
        if outcome != "dead":
            detail = {**(detail or {}), "exhausted": True, "last_outcome": outcome}
            outcome = "dead"
    else:
        status = "pending"
        if retry_in is None:
            retry_in = route.backoff.delay(message.attempt, rng)
    # Wall-clock stamps place the attempt in time; the monotonic clock measures it.
    finished = started + timedelta(seconds=time.monotonic() - clock)
    # Outcomes are written in batches: one that the database refuses would hold back every
    # other outcome in its batch, so whatever a handler produced is made storable here.
    return Completion(
        message_id=message.id,
        attempt=message.attempt,
        outcome=outcome,
        status=status,
        started_at=started,
        finished_at=finished,
        # float: RetryLater(delay=30) gives an int, and one batch's delays travel as one float8 array
        retry_in=float(min(retry_in or 0.0, MAX_RETRY_DELAY)),
        error_type=None if error_type is None else _storable_text(error_type)[:_NAME_LIMIT],
        error=None if error is None else _storable_text(error),
        detail=_storable_detail(detail),
        refund=refund,
        parked_on=None if status != "pending" else parked_on,
    )


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, which is the exception's own code and may itself raise.

    Here and in the helpers below, the relay runs the handler's code (an
    exception's ``__str__``, a returned mapping's items), so whatever that
    raises, ``SystemExit`` included, is caught: it must not escape the attempt.
    """
    try:
        text = str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"
    return text or type(exc).__name__


def _safe_repr(value: object) -> str:
    try:
        return repr(value)[:_ERROR_LIMIT]
    except BaseException:
        return f"<unprintable {type(value).__name__}>"


def _redacted(data: Mapping[Any, Any], redactor: Redactor) -> dict[str, Any]:
    """A handler's mapping with secrets masked; one whose keys cannot even be printed is kept as a note."""
    try:
        return redactor.mapping(data)
    except BaseException:
        return {"unstorable_detail": _safe_repr(data)}


def _storable_text(text: str) -> str:
    # PostgreSQL text and JSON cannot hold NUL; an exception quoting a binary reply often does.
    return text.replace("\x00", "\\x00")


def _storable_detail(detail: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Plain JSON for the history's detail column.

    Datetimes, UUIDs and Decimals become strings; so do NaN and infinities,
    which PostgreSQL's JSON types reject. A mapping that cannot be serialised
    at all (a cycle, non-string keys) is stored as its repr.
    """
    if detail is None:
        return None
    if _is_plain(detail):  # what handlers usually return (status codes, ids): no round trip needed
        return _without_nul(detail)  # type: ignore[no-any-return]
    try:
        plain = json.loads(json.dumps(detail, default=str), parse_constant=str)
    except BaseException:
        plain = {"unstorable_detail": _safe_repr(detail)}
    cleaned: dict[str, Any] = _without_nul(plain)
    return cleaned


_SCALARS = (str, int, bool, type(None))


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Already plain JSON: exact built-in types, string keys, finite floats, shallow nesting."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is float:
        return math.isfinite(value)
    if depth > 8:
        return False
    if kind is dict:
        return all(type(k) is str and _is_plain(v, depth + 1) for k, v in value.items())
    if kind is list:
        return all(_is_plain(v, depth + 1) for v in value)
    return False


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return _storable_text(value)
    if isinstance(value, dict):
        return {_storable_text(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _detail_of(exc: BaseException, redactor: Redactor) -> dict[str, Any] | None:
    """Handlers attach structured facts (HTTP status, SMTP code) as ``exc.detail``."""
    try:
        detail = getattr(exc, "detail", None)
    except BaseException:  # a property of the handler's own exception class
        return None
    if isinstance(detail, dict):
        return _redacted(detail, redactor)
    return None
