"""Event-type patterns with RabbitMQ's topic rules, for anything that subscribes by event type.

An event type is words separated by dots: ``order.paid`` is two words. In a
pattern, a word that is exactly ``*`` stands for one word and a word that is
exactly ``#`` for any number of words, none included: ``order.*`` matches
``order.paid`` but neither ``order`` nor ``order.paid.late``, and ``order.#``
matches all three. A ``*`` or ``#`` inside a word (``ord*``) is refused: a
broker would read it literally and a reader of the code would not, so it is
better said at once.

Matching by words, not by a regular expression, keeps a run of ``#`` from
making it slow (``#.#.#.x`` against a long type stays linear in words per
pattern word). Callers that match the same event types again and again keep
the answer (the inbox does, per event type); this module keeps nothing and
imports nothing from the package, so routes, errors, the write side and the inbox all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TopicPattern", "is_topic_pattern", "topic_matches", "topic_pattern_problem", "words_match"]

ONE_WORD = "*"
ANY_WORDS = "#"


def is_topic_pattern(text: str) -> bool:
    """Has ``text`` a word that is a wildcard (``*`` or ``#``)?"""
    if ONE_WORD not in text and ANY_WORDS not in text:
        return False
    return any(word in (ONE_WORD, ANY_WORDS) for word in text.split("."))


def topic_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not a valid event type or pattern, or None."""
    for word in pattern.split("."):
        if word not in (ONE_WORD, ANY_WORDS) and (ONE_WORD in word or ANY_WORDS in word):
            return (
                f"{pattern!r} has the word {word!r}: '*' and '#' are wildcards only as a whole "
                "dot-separated word ('*' one word, '#' any number), e.g. 'order.*' or 'order.#'"
            )
    return None


def words_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """Does the event type split into ``words`` match the pattern split into ``pattern``?"""
    # reach[j]: may the pattern read so far end after the first j words of the event type?
    reach = [True] + [False] * len(words)
    for word in pattern:
        if word == ANY_WORDS:  # as before, or one word further than any place it could end
            for j in range(1, len(reach)):
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [reach[j] and (word == ONE_WORD or word == words[j]) for j in range(len(words))]
    return reach[-1]


@dataclass(frozen=True, slots=True)
class TopicPattern:
    """A checked pattern (or plain event type), split once, to match many event types against.

    ``TopicPattern("order.*").matches("order.paid")`` is True. Building one
    refuses a malformed pattern with ``ValueError`` naming the fix.
    """

    text: str
    wildcard: bool = field(init=False, repr=False, compare=False)
    _words: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"an event type pattern must be a non-empty string, got {self.text!r}")
        problem = topic_pattern_problem(self.text)
        if problem:
            raise ValueError(problem)
        object.__setattr__(self, "wildcard", is_topic_pattern(self.text))
        object.__setattr__(self, "_words", tuple(self.text.split(".")))

    def matches(self, event_type: str) -> bool:
        """Is ``event_type`` (a plain event type, not a pattern) one this pattern stands for?"""
        if not self.wildcard:
            return event_type == self.text
        return words_match(self._words, tuple(event_type.split(".")))


def topic_matches(pattern: str, event_type: str) -> bool:
    """Does ``event_type`` match ``pattern`` (``*`` one word, ``#`` any number)?

    ``topic_matches("order.#", "order.paid.late")`` is True. For many event
    types against one pattern, build a :class:`TopicPattern` once.
    """
    return TopicPattern(pattern).matches(event_type)
