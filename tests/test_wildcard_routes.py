"""Wildcard routes: ``*`` one dot-separated word, ``#`` zero or more, as RabbitMQ topic bindings read them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import select

import outbox
from outbox import ConfigurationError, InvalidEmitOption, Outbox, UnroutedEvent, emit
from outbox._topic import words_match

m = outbox.outbox_message
DOCS = Path(__file__).resolve().parents[1] / "docs"


def nothing(msg: outbox.Message) -> None:
    pass


def stored(engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(m.c.event_type, m.c.handler).order_by(m.c.id))]


@pytest.mark.parametrize(
    ("pattern", "event_type", "matches"),
    [
        ("order.*", "order.paid", True),
        ("order.*", "order", False),
        ("order.*", "order.paid.late", False),
        ("order.#", "order", True),
        ("order.#", "order.paid.late", True),
        ("#", "anything.at.all", True),
        ("*", "order", True),
        ("*", "order.paid", False),
        ("*.paid", "invoice.paid", True),
        ("#.paid", "paid", True),
        ("#.paid", "a.b.paid", True),
        ("#.paid", "a.paid.b", False),
        ("order.#.late", "order.late", True),
        ("order.#.late", "order.paid.very.late", True),
        ("order.*.late", "order.late", False),
        ("order.paid", "order.paid", True),
        ("order.paid", "order.paidx", False),
    ],
)
def test_a_pattern_matches_as_a_rabbitmq_topic_binding_does(pattern, event_type, matches):
    route = Outbox().route(pattern, nothing, name="r")
    assert route.matches(event_type) is matches
    assert route.pattern is (pattern != "order.paid")


def _reference(pattern: str, event_type: str) -> bool:
    """RabbitMQ's rule as a regular expression over the dotted text: the same answer by another road.

    Each word is read with the dot before it, so ``#`` taking no words takes no dot either.
    """
    parts = {"*": r"\.[^.]*", "#": r"(?:\.[^.]*)*"}
    text = "".join(parts.get(word, r"\." + re.escape(word)) for word in pattern.split("."))
    return re.fullmatch(text, "." + event_type) is not None


@given(
    st.lists(st.sampled_from(["a", "b", "*", "#"]), min_size=1, max_size=5),
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6),
)
def test_matching_agrees_with_a_regular_expression_reading_of_the_rules(pattern, words):
    assert words_match(tuple(pattern), tuple(words)) == _reference(".".join(pattern), ".".join(words))


def test_an_event_matched_by_several_routes_is_stored_once_for_each(engine, ob, maker):
    ob.route("order.paid", nothing, name="exact")
    ob.route("order.*", nothing, name="one_word")
    ob.route("order.#", nothing, name="any_words")
    ob.route("#", nothing, name="audit")
    ob.route("invoice.*", nothing, name="invoices")
    with maker() as s, s.begin():
        emit(s, "order.paid", {})
        emit(s, "order.paid.late", {})
        emit(s, "order", {})
    assert stored(engine) == [
        ("order.paid", "exact"),
        ("order.paid", "one_word"),
        ("order.paid", "any_words"),
        ("order.paid", "audit"),
        ("order.paid.late", "any_words"),
        ("order.paid.late", "audit"),
        ("order", "any_words"),
        ("order", "audit"),
    ]


def test_a_route_added_after_an_emit_is_used_by_the_next_emit(engine, ob, maker):
    ob.route("order.paid", nothing, name="exact")
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    assert [r.name for r in ob.routes_for("order.paid")] == ["exact"]
    ob.route("order.*", nothing, name="one_word")
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 2})
    assert stored(engine) == [("order.paid", "exact"), ("order.paid", "exact"), ("order.paid", "one_word")]


def test_exact_routes_are_resolved_once_per_event_type():
    ob = Outbox()
    ob.route("order.paid", nothing, name="exact")
    first = ob.routes_for("order.paid")
    assert ob.routes_for("order.paid") is first
    ob.route("order.*", nothing, name="one_word")
    again = ob.routes_for("order.paid")
    assert [r.name for r in again] == ["exact", "one_word"]
    assert ob.routes_for("order.paid") is again
    assert ob.routes_for("order.*") == ()  # a pattern names no event


def test_unrouted_event_names_the_patterns_that_did_not_match(engine, ob, maker):
    ob.route("order.*", nothing, name="one_word")
    ob.route("user.signed_up", nothing, name="welcome")
    with maker() as s, s.begin():
        with pytest.raises(UnroutedEvent) as refused:
            emit(s, "order.paid.late", {})
    assert refused.value.patterns == ("order.*",)
    text = str(refused.value)
    assert "Known event types: user.signed_up." in text
    assert "Patterns: order.* ('*' matches one dot-separated word, '#' zero or more)." in text
    assert stored(engine) == []


def test_an_emit_may_not_name_a_pattern(engine, ob, maker):
    ob.route("order.*", nothing, name="one_word")
    with maker() as s, s.begin():
        for event_type in ("order.*", "order.#", "#"):
            with pytest.raises(InvalidEmitOption, match="is a pattern"):
                emit(s, event_type, {})
        emit(s, "order.paid", {})
    assert stored(engine) == [("order.paid", "one_word")]


@pytest.mark.parametrize("bad", ["order.pa*", "ord#.paid", "order.**", "#order"])
def test_a_wildcard_inside_a_word_is_refused_when_the_route_is_made(bad):
    with pytest.raises(ConfigurationError, match="only as a whole dot-separated word"):
        Outbox().route(bad, nothing, name="r")


def test_event_types_lists_patterns_beside_exact_types():
    ob = Outbox()
    ob.route("order.*", nothing, name="one_word")
    ob.route("order.paid", nothing, name="exact")
    ob.route("order.*", nothing, name="another")
    assert ob.event_types == ("order.*", "order.paid")
    assert [r.pattern for r in ob.routes] == [True, False, True]


def test_the_emitting_guides_wildcard_example_prints_what_it_shows(tmp_path):
    found = re.findall(
        r"```python\n(# wildcards\.py\n.*?)```\n\n```console\n\$ python wildcards\.py\n(.*?)```",
        (DOCS / "emitting.md").read_text(),
        re.S,
    )
    assert len(found) == 1, "emitting.md should hold one example '# wildcards.py' followed by its output"
    code, output = found[0]
    (tmp_path / "wildcards.py").write_text(code)
    run = subprocess.run(
        [sys.executable, "wildcards.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == output.splitlines()
