"""Wildcard event types: RabbitMQ's topic rules, so a route pattern reads the same as a binding key.

An event type is words separated by dots (``order.paid`` is two words). In a
route's event type, a word that is exactly ``*`` stands for one word and a word
that is exactly ``#`` for zero or more: ``order.*`` matches ``order.paid`` but
neither ``order`` nor ``order.paid.late``; ``order.#`` matches all three. A
``*`` or ``#`` inside a word (``ord*``) is refused rather than read literally,
because RabbitMQ would read it literally and a reader of the route would not.

Matching runs once per event type an application emits (``Outbox`` keeps the
answer), so it is written for clarity, not speed. This module imports nothing
from the package: routes and errors both use it.
"""

from __future__ import annotations

__all__ = ["is_pattern", "pattern_problem", "segments_match"]

_ONE = "*"
_ANY = "#"


def is_pattern(event_type: str) -> bool:
    """Has ``event_type`` a word that is a wildcard (``*`` or ``#``)?"""
    if _ONE not in event_type and _ANY not in event_type:
        return False
    return any(word in (_ONE, _ANY) for word in event_type.split("."))


def pattern_problem(event_type: str) -> str | None:
    """Why ``event_type`` is not a valid route event type or pattern, or None."""
    for word in event_type.split("."):
        if word not in (_ONE, _ANY) and (_ONE in word or _ANY in word):
            return (
                f"event type {event_type!r} has {word!r}: '*' and '#' are wildcards only as a whole "
                "dot-separated word ('*' one word, '#' zero or more), e.g. 'order.*' or 'order.#'"
            )
    return None


def segments_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """Does the event type split into ``words`` match the pattern split into ``pattern``?

    A row of booleans per pattern word (may the pattern so far end after the
    first ``j`` words?), so no run of ``#`` can make it slow.
    """
    reach = [True] + [False] * len(words)  # the empty pattern ends after zero words only
    for word in pattern:
        if word == _ANY:  # zero words, or one more than where it could end before
            for j in range(1, len(reach)):
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [reach[j] and (word == _ONE or word == words[j]) for j in range(len(words))]
    return reach[-1]
