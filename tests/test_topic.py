"""Event-type patterns follow RabbitMQ's topic rules, so an inbox handler reads like a binding key."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox._topic import TopicPattern, is_topic_pattern, topic_matches


@pytest.mark.parametrize(
    ("pattern", "event_type", "expected"),
    [
        ("order.paid", "order.paid", True),
        ("order.paid", "order.paid.late", False),
        ("order.*", "order.paid", True),
        ("order.*", "order", False),
        ("order.*", "order.paid.late", False),
        ("*.paid", "order.paid", True),
        ("order.#", "order", True),
        ("order.#", "order.paid", True),
        ("order.#", "order.paid.late", True),
        ("order.#", "orders.paid", False),
        ("#", "anything.at.all", True),
        ("#.late", "late", True),
        ("#.late", "order.paid.late", True),
        ("#.late", "order.paid", False),
        ("order.#.late", "order.late", True),
        ("order.#.late", "order.paid.very.late", True),
        ("order.*.late", "order.late", False),
        ("#.#", "a", True),
        ("*.#.*", "a", False),
        ("*.#.*", "a.b", True),
    ],
)
def test_wildcards_follow_the_topic_rules(pattern: str, event_type: str, expected: bool) -> None:
    assert topic_matches(pattern, event_type) is expected
    assert TopicPattern(pattern).matches(event_type) is expected


@pytest.mark.parametrize("pattern", ["ord*", "order.pa#", "*x", "", "a.#b"])
def test_a_wildcard_inside_a_word_or_an_empty_pattern_is_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="wildcards only as a whole|non-empty"):
        TopicPattern(pattern)


def test_plain_types_are_not_patterns() -> None:
    assert not is_topic_pattern("order.paid")
    assert is_topic_pattern("order.*") and is_topic_pattern("#")
    assert not TopicPattern("order.paid").wildcard


def test_many_hashes_against_a_long_type_stay_quick() -> None:
    # A backtracking matcher takes exponential time here; matching by words does not.
    assert not topic_matches(".".join(["#"] * 40 + ["x"]), ".".join(["a"] * 200))


def _reference(pattern: str, event_type: str) -> bool:
    """The rules as a regular expression over words: ``#`` zero or more words, ``*`` exactly one."""
    parts: list[str] = []
    for word in pattern.split("."):
        if word == "#":
            parts.append(r"(?:[^.]*\.)*")
        elif word == "*":
            parts.append(r"[^.]*\.")
        else:
            parts.append(re.escape(word) + r"\.")
    return re.fullmatch("".join(parts), event_type + ".") is not None


words = st.sampled_from(["a", "b", ""])


@given(st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=6), st.lists(words, max_size=6))
def test_the_matcher_agrees_with_a_regular_expression(pattern: list[str], event_type: list[str]) -> None:
    text = ".".join(event_type) if event_type else "a"
    assert topic_matches(".".join(pattern), text) is _reference(".".join(pattern), text)
