"""``outbox inbox requeue`` and ``outbox inbox dead --status`` as an operator runs them, on both databases.

The installed command in a subprocess, never on a terminal: by ids, all or
none; by consumer, only with ``--yes``; mistakes in one line with the exit code
the other actions use; ``--json`` for scripts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from test_ops_cli import assert_one_line_error, ok, ok_json, run

import outbox
from outbox import Inbox, InboxMessage

dead = outbox.outbox_inbox_dead


@pytest.fixture
def letters(engine: Engine) -> Iterator[list[int]]:
    """Three dead letters: two of ``billing`` (one with a secret in its payload), one of ``shipping``."""
    ids = []
    with Session(engine) as s, s.begin():
        for n, consumer in ((1, "billing"), (2, "billing"), (3, "shipping")):
            message = InboxMessage(f"m{n}", "order.paid", {"order": n, "card_token": "tok_4242"})
            found = Inbox(consumer).dead_letter(
                s, message, ValueError(f"order {n} has no customer"), attempts=n
            )
            assert found is not None
            ids.append(found)
    yield ids


def statuses(engine: Engine) -> dict[str, tuple[str, str | None, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(select(dead.c.message_id, dead.c.status, dead.c.actor, dead.c.reason)).all()
    return {r.message_id: (r.status, r.actor, r.reason) for r in rows}


def test_requeue_by_ids_records_actor_and_reason_and_lists_as_requeued(database_url, engine, letters):
    first, second, _ = letters
    out = ok(
        run(
            "inbox",
            "requeue",
            str(second),
            str(first),
            "--reason",
            "customers imported",
            "--actor",
            "ana",
            database_url=database_url,
        )
    )
    assert out.startswith(f"requeued 2 dead letter(s): {first}, {second};"), out
    assert statuses(engine) == {
        "m1": ("requeued", "ana", "customers imported"),
        "m2": ("requeued", "ana", "customers imported"),
        "m3": ("dead", None, None),
    }
    listed = ok_json(run("inbox", "dead", "--status", "requeued", "--json", database_url=database_url))
    assert [(x["id"], x["status"], x["actor"]) for x in listed] == [
        (second, "requeued", "ana"),
        (first, "requeued", "ana"),
    ]
    assert listed[0]["payload"] == {"order": 2, "card_token": "***"}
    assert listed[0]["requeued_at"] is not None and listed[0]["handled_at"] is None
    table = ok(run("inbox", "dead", "--status", "any", database_url=database_url)).splitlines()
    assert table[0].split()[-1] == "status"
    assert table[1].split()[:3] == [str(letters[2]), "shipping", "m3"] and table[1].rstrip().endswith("dead")
    assert "requeued (requeued " in table[2] and "by ana: customers" in table[2]
    # The default listing is what still waits for a decision.
    assert [x["message_id"] for x in ok_json(run("inbox", "dead", "--json", database_url=database_url))] == [
        "m3"
    ]


def test_requeue_refusals_are_one_line_and_change_nothing(database_url, engine, letters):
    first, second, third = letters
    ok(run("inbox", "requeue", str(third), "--reason", "r", database_url=database_url))
    before = statuses(engine)
    for args, code, needles in (
        ([str(first), "999999"], 1, ["outbox inbox requeue:", "no inbox dead letter with id 999999"]),
        ([str(first), str(third)], 1, [f"not {third} (requeued)"]),
        ([], 1, ["give dead letter ids or --consumer NAME"]),
        ([str(first), "--consumer", "billing"], 2, ["give dead letter ids or --consumer, not both"]),
        (["0"], 2, ["dead letter ids are positive"]),
        (["x1"], 2, ["dead letter ids are integers"]),
        (["--consumer", "billing"], 1, ["would touch 2 dead letter(s)", "--yes"]),  # no terminal to ask
    ):
        result = run("inbox", "requeue", *args, "--reason", "r", database_url=database_url)
        assert_one_line_error(result, code, *needles)
    assert_one_line_error(run("inbox", "requeue", str(first), database_url=database_url), 2, "--reason")
    assert statuses(engine) == before


def test_requeue_a_consumers_dead_letters_with_yes(database_url, engine, letters):
    first, second, third = letters
    done = ok_json(
        run(
            "inbox",
            "requeue",
            "--consumer",
            "billing",
            "--reason",
            "all of billing",
            "--yes",
            "--json",
            database_url=database_url,
        )
    )
    assert done == {"requeued": [first, second]}
    assert statuses(engine)["m3"] == ("dead", None, None)
    # Nothing left that is dead: said, exit 0, no question.
    again = ok(
        run("inbox", "requeue", "--consumer", "billing", "--reason", "again", database_url=database_url)
    )
    assert again.strip() == "consumer billing has no dead letter with status dead; nothing to requeue"
    assert ok_json(
        run("inbox", "requeue", "--consumer", "nobody", "--reason", "r", "--json", database_url=database_url)
    ) == {"requeued": []}
