"""``outbox resend``: a delivered (or discarded) message delivered again, as a new copy, on both databases.

The partner's webhook route records what a real relay hands it, so each test can check that a
resent copy reaches it with the original's event id. Messages are put in every status the honest
way: delivered and dead by the relay, pending by a delay, running by a claim, discarded by
``outbox discard``. The command runs as the installed console script; refusals are one line.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from test_ops_cli import (
    FAST,
    assert_one_line_error,
    fingerprint,
    history_of,
    login_of,
    ok,
    ok_json,
    run,
    run_all,
    snapshot,
)

import outbox
from outbox import Message, Outbox, PermanentError, emit, ops
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt


@dataclass
class Partner:
    """A webhook route that records every delivery, and one message in each status."""

    url: str
    engine: Engine
    ob: Outbox
    maker: sessionmaker[Session]
    received: list[Message] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)

    def id(self, key: str) -> int:
        return self.ids[key]

    def relay(self) -> int:
        """Deliver what is due in the partner's queue; the number delivered."""
        return Relay(self.ob, self.engine, queues=["partner"]).run_until_idle().delivered

    def row(self, message_id: int) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(select(m).where(m.c.id == message_id)).one()

    def rows(self) -> dict[int, Any]:
        with self.engine.connect() as conn:
            return {r.id: r for r in conn.execute(select(m))}


@pytest.fixture
def partner(database_url: str, engine: Engine) -> Iterator[Partner]:
    yield from partner_in(database_url, engine)


@pytest.fixture
def pg_partner(pg_url: str, pg_engine: Engine) -> Iterator[Partner]:
    yield from partner_in(pg_url, pg_engine)


def partner_in(database_url: str, engine: Engine) -> Iterator[Partner]:
    """``order:42`` and ``order:43`` (and a keyless one) delivered, ``order:44`` dead, ``order:45``
    pending (delayed), ``order:46`` discarded, ``order:47`` running (claimed, in queue ``slow``)."""
    ob = Outbox(default_backoff=FAST)
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    found = Partner(database_url, engine, ob, maker)

    def webhook(msg: Message) -> None:
        if msg.payload["order_id"] == 44:
            raise PermanentError("partner refuses order 44")
        found.received.append(msg)

    ob.route("order.paid", webhook, name="partner_webhook", queue="partner")
    ob.route("order.shipped", lambda msg: None, name="slow_webhook", queue="slow")
    with maker.begin() as s:
        for order in (42, 43, 44):
            emit(s, "order.paid", {"order_id": order}, key=f"order:{order}", group_key=f"customer:{order}")
        emit(s, "order.paid", {"order_id": 48})  # no key
        emit(s, "order.paid", {"order_id": 45}, key="order:45", delay=3600)
        emit(s, "order.paid", {"order_id": 46}, key="order:46", delay=3600)
        emit(s, "order.shipped", {"order_id": 47}, key="order:47")
    assert found.relay() == 3
    with engine.connect() as conn:
        found.ids = {r.idempotency_key or "keyless": r.id for r in conn.execute(select(m))}
    ops.discard(
        engine, ops.MessageFilter(ids=(found.id("order:46"),)), reason="order cancelled", actor="seed"
    )
    claimed = Relay(ob, engine, queues=["slow"]).store.claim("slow", ["slow_webhook"], 1)
    assert [r.id for r in claimed] == [found.id("order:47")]
    assert {found.row(i).idempotency_key: found.row(i).status for i in found.ids.values()} == {
        "order:42": "delivered",
        "order:43": "delivered",
        None: "delivered",
        "order:44": "dead",
        "order:45": "pending",
        "order:46": "discarded",
        "order:47": "running",
    }
    found.received.clear()
    yield found
    ob.uninstall(maker)


# -- one resend -----------------------------------------------------------------------------------------


def test_a_resent_message_reaches_the_partner_again_with_its_event_id_and_the_original_stays(partner):
    engine, old = partner.engine, partner.id("order:42")
    before_row = fingerprint(engine, old)
    before_history = [tuple(h) for h in history_of(engine, old)]
    stats_before = ops.stats(engine)

    out = ok(
        run(
            "resend",
            str(old),
            "--reason",
            "partner lost the webhook",
            "--actor",
            "alice",
            database_url=partner.url,
        )
    )
    (new,) = map(int, re.findall(rf"^resent {old} as (\d+)$", out, re.M))
    assert out.rstrip().endswith("1 message(s) resent"), out

    assert fingerprint(engine, old) == before_row, "a resend never modifies the original"
    original, copy = partner.row(old), partner.row(new)
    assert (copy.status, copy.attempts, copy.requeued_from) == ("pending", 0, old)
    assert copy.delivered_at is None and copy.last_error is None and copy.locked_by is None
    assert copy.idempotency_key == f"order:42~resend:{new}" == ops.resent_key("order:42", new)
    for column in ("event_id", "event_type", "handler", "queue", "priority", "payload", "headers"):
        assert getattr(copy, column) == getattr(original, column), column
    for column in ("group_key", "aggregate_type", "aggregate_id", "max_attempts"):
        assert getattr(copy, column) == getattr(original, column), column

    history = history_of(engine, old)
    assert [tuple(h) for h in history[:-1]] == before_history, "earlier history is untouched"
    resent = history[-1]
    assert (resent.outcome, resent.actor, resent.reason) == ("resent", "alice", "partner lost the webhook")
    assert resent.detail == {"new_id": new, "previous_status": "delivered", **login_of(engine)}
    assert (resent.attempt, resent.duration_ms) == (original.attempts, 0)
    assert resent.started_at == resent.finished_at
    assert history_of(engine, new) == []

    # The original stays delivered: the dead figure and the alerts do not move; the copy is one more.
    stats_after = ops.stats(engine)
    assert (stats_after.dead, stats_after.dead_requeued) == (stats_before.dead, stats_before.dead_requeued)
    assert stats_after.by_status["delivered"] == stats_before.by_status["delivered"]
    assert stats_after.by_status["pending"] == stats_before.by_status["pending"] + 1

    assert partner.relay() == 1
    (got,) = partner.received
    assert (got.id, got.event_id, got.key) == (new, original.event_id, copy.idempotency_key)
    assert partner.row(new).status == "delivered"
    assert [h.outcome for h in history_of(engine, new)] == ["delivered"]
    assert fingerprint(engine, old) == before_row, "delivering the copy leaves the original alone too"

    # outbox show and outbox tail say what happened, and which message carries the delivery on.
    shown = ok(run("show", str(old), database_url=partner.url))
    (line,) = [line for line in shown.splitlines() if " resent " in line]
    assert "alice" in line and "partner lost the webhook" in line and f'"new_id": {new}' in line
    assert (
        ok_json(run("show", str(new), "--json", database_url=partner.url))["message"]["requeued_from"] == old
    )
    # The two newest history rows are the resend and the copy's delivery.
    tail = ok(run("tail", "--message-id", str(old), "--last", "2", "--count", "1", database_url=partner.url))
    assert tail.rstrip().endswith(f"resent  0ms  by alice: partner lost the webhook (as #{new})"), tail
    only_resent = ok(
        run("tail", "--outcome", "resent", "--last", "5", "--count", "1", database_url=partner.url)
    )
    assert f"#{old} " in only_resent and " resent " in only_resent


def test_a_discarded_message_can_be_resent_and_then_not_requeued(partner):
    engine, dropped = partner.engine, partner.id("order:46")
    pairs = ok_json(
        run("resend", str(dropped), "--reason", "customer un-cancelled", "--json", database_url=partner.url)
    )
    ((old, new),) = [(p["old_id"], p["new_id"]) for p in pairs]
    assert old == dropped and partner.row(dropped).status == "discarded"
    assert history_of(engine, dropped)[-1].detail["previous_status"] == "discarded"
    # A requeue would now deliver the event a second time next to the resent copy.
    assert_one_line_error(
        run("requeue", str(dropped), "--reason", "r", database_url=partner.url),
        1,
        "already requeued or resent",
        f"{dropped} (as {new})",
    )
    assert partner.relay() == 1, "due at once: the copy keeps no delay of the original's"
    assert partner.row(new).status == "delivered"


# -- again and again ------------------------------------------------------------------------------------


def test_a_message_can_be_resent_again_and_each_copy_has_a_key_of_its_own(partner):
    """(handler, idempotency_key) is unique: each copy's suffix names the copy, never the original."""
    engine, old, keyless = partner.engine, partner.id("order:42"), partner.id("keyless")
    first = ops.resend(engine, ops.MessageFilter(ids=(old, keyless)), reason="lost", actor="t")
    second = ops.resend(engine, ops.MessageFilter(ids=(old, keyless)), reason="lost again", actor="t")
    assert [o for o, _ in first] == [o for o, _ in second] == sorted([old, keyless])
    assert partner.relay() == 4
    copy, again = dict(first)[old], dict(second)[old]
    # A copy of a copy: the first copy, delivered, resent in turn.
    ((_, grandchild),) = ops.resend(
        engine, ops.MessageFilter(ids=(copy,)), reason="lost a third time", actor="t"
    )
    assert partner.relay() == 1

    rows = partner.rows()
    family = [old, copy, again, grandchild]
    keys = [rows[i].idempotency_key for i in family]
    assert keys == [
        "order:42",
        f"order:42~resend:{copy}",
        f"order:42~resend:{again}",
        f"{keys[1]}~resend:{grandchild}",
    ]
    assert len(set(keys)) == len(keys)
    assert {ops.root_key(k) for k in keys} == {"order:42"}
    assert (rows[again].requeued_from, rows[grandchild].requeued_from) == (old, copy)
    assert {rows[i].status for i in family} == {"delivered"}
    assert {rows[i].event_id for i in family} == {rows[old].event_id}
    assert [msg.event_id for msg in partner.received if msg.payload["order_id"] == 42] == [
        rows[old].event_id
    ] * 3
    resent = [h for h in history_of(engine, old) if h.outcome == "resent"]
    assert [(h.reason, h.detail["new_id"]) for h in resent] == [("lost", copy), ("lost again", again)]
    # A message without a key gets copies without one: NULL keys never conflict.
    keyless_copies = [new for pairs in (first, second) for o, new in pairs if o == keyless]
    assert [rows[i].idempotency_key for i in keyless_copies] == [None, None]

    lineage = ops.lineage(engine, old)
    assert [(c.id, c.requeued_from, c.made_by) for c in lineage.descendants] == [
        (copy, old, "resent"),
        (again, old, "resent"),
        (grandchild, copy, "resent"),
    ]
    assert ops.lineage(engine, grandchild).made_by == "resent"


@pytest.mark.parametrize("length", [255, 254, 237, 229, 228, 227, 200])
def test_resent_keys_fit_at_every_key_length_and_keep_the_original_whole(engine, length):
    """A key is never cut short: whole when the suffix fits, else its root key, as requeue does."""
    ob = Outbox(default_backoff=FAST)
    ob.route("order.paid", lambda msg: None, name="partner_webhook")
    maker = sessionmaker(engine)
    ob.install(maker)
    key = "k" * (length - 4) + "ключ"  # not only ASCII: the limit counts characters
    try:
        with maker.begin() as s:
            emit(s, "order.paid", {"order_id": 1}, key=key)
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            original = conn.execute(select(m.c.id)).scalar_one()
        parents = [original, original, original]
        copies = [
            new for _, new in ops.resend(engine, ops.MessageFilter(ids=(original,)), reason="r", actor="t")
        ]
        copies += [
            new for _, new in ops.resend(engine, ops.MessageFilter(ids=(original,)), reason="r", actor="t")
        ]
        Relay(ob, engine).run_until_idle()
        copies += [
            new for _, new in ops.resend(engine, ops.MessageFilter(ids=(copies[0],)), reason="r", actor="t")
        ]
        parents[2] = copies[0]
        assert Relay(ob, engine).run_until_idle().delivered == 1
        with engine.connect() as conn:
            keys = dict(conn.execute(select(m.c.id, m.c.idempotency_key)).all())
    finally:
        ob.uninstall(maker)
    assert keys[original] == key
    for parent, copy in zip(parents, copies, strict=True):
        assert keys[copy] == ops.resent_key(keys[parent], copy), (
            "derivable from the copied row and the new id"
        )
        assert keys[copy].endswith(f"~resend:{copy}") and len(keys[copy]) <= 255
    assert len(set(keys.values())) == len(keys)
    assert {ops.root_key(k) for k in keys.values()} == {ops.root_key(key)}
    assert len(ops.root_key(key)) == min(length, ops.ROOT_KEY_LIMIT)
    if length + len(f"~resend:{copies[0]}") <= 255:
        assert keys[copies[0]] == f"{key}~resend:{copies[0]}", "a key that fits is kept whole"


def test_root_key_takes_off_requeue_and_resend_suffixes_in_any_mix():
    assert ops.root_key("order:7~requeue:5~resend:9~requeue:12") == "order:7"
    assert ops.root_key("order:7~resend:9") == ops.root_key("order:7") == "order:7"
    assert ops.root_key("order:7~resend:") == "order:7~resend:", "only a suffix with an id is one"
    assert ops.resent_key(None, 5) is None
    assert ops.resent_key("order:7~requeue:5", 9) == "order:7~requeue:5~resend:9"
    longest = ops.resent_key("k" * ops.ROOT_KEY_LIMIT, 2**63 - 1)
    assert longest == "k" * ops.ROOT_KEY_LIMIT + f"~resend:{2**63 - 1}" and len(longest) <= 255
    assert ops.ROOT_KEY_LIMIT == 227, "unchanged: handlers derive identities from root keys"


# -- refusals -------------------------------------------------------------------------------------------


def test_resend_refuses_unfinished_and_dead_messages_in_one_line_and_changes_nothing(partner):
    url, engine = partner.url, partner.engine
    pending, running, dead = partner.id("order:45"), partner.id("order:47"), partner.id("order:44")
    delivered = partner.id("order:43")
    before = snapshot(engine)
    results = run_all(
        [
            ["resend", str(pending), "--reason", "r"],
            ["resend", str(running), "--reason", "r"],
            ["resend", str(dead), "--reason", "r"],
            ["resend", str(delivered), str(dead), str(pending), "--reason", "r"],
            ["resend", str(delivered), "999999", "--reason", "r"],
            ["resend", str(delivered), "--reason", "  "],
            ["resend", "--reason", "r"],
        ],
        url,
    )
    assert_one_line_error(results[0], 1, f"not {pending} (pending)", "still on its way")
    assert_one_line_error(results[1], 1, f"not {running} (running)", "still on its way")
    assert_one_line_error(
        results[2],
        1,
        "can only resend delivered or discarded messages",
        f"{dead} (dead)",
        "requeued, not resent",
    )
    said = assert_one_line_error(results[3], 1, f"{dead} (dead)", f"{pending} (pending)")
    assert sorted(map(int, re.findall(r"(\d+) \(", said))) == sorted([dead, pending]), "only the refused"
    assert_one_line_error(results[4], 1, "no message with id 999999")
    assert_one_line_error(results[5], 1, "a reason is required")
    assert_one_line_error(results[6], 1, "give message ids or a filter")
    assert snapshot(engine) == before, "a refused resend changes nothing, all or none"


# -- by filter ------------------------------------------------------------------------------------------


def test_resend_by_filter_asks_first_and_takes_only_finished_messages(partner):
    url, engine = partner.url, partner.engine
    finished = sorted(partner.id(k) for k in ("order:42", "order:43", "keyless", "order:46"))
    untouched = {
        i: fingerprint(engine, i) for i in (partner.id(k) for k in ("order:44", "order:45", "order:47"))
    }
    before = snapshot(engine)

    asked = run(
        "resend", "--event-type", "order.paid", "--reason", "partner restored a backup", database_url=url
    )
    assert_one_line_error(asked, 1, "4 message(s)", "--yes")
    assert snapshot(engine) == before, "no answer, no action"
    nothing = ok(run("resend", "--key", "order:99", "--reason", "r", database_url=url))
    assert nothing == "no message matched the filter; nothing to resend\n"

    pairs = ok_json(
        run(
            "resend",
            "--queue",
            "partner",
            "--reason",
            "partner restored a backup",
            "--yes",
            "--json",
            database_url=url,
        )
    )
    assert [p["old_id"] for p in pairs] == finished
    assert {i: fingerprint(engine, i) for i in untouched} == untouched, "pending, running and dead untouched"
    for p in pairs:
        assert partner.row(p["new_id"]).requeued_from == p["old_id"]
    assert partner.relay() == 4
    assert sorted(msg.payload["order_id"] for msg in partner.received) == [42, 43, 46, 48]


def test_a_filtered_resend_takes_only_messages_that_existed_when_it_began(partner):
    """A copy it made that a relay delivers before the next batch is not resent in turn."""
    engine = partner.engine
    relay_side = create_engine(partner.url)
    batches: list[str] = []

    def deliver_between_batches(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # The filter's batch query; from the second one on, what the first batch copied is committed.
        if "LIMIT" not in statement or "outbox_message.id >" not in statement:
            return
        batches.append(statement)
        if len(batches) == 2:
            assert Relay(partner.ob, relay_side, queues=["partner"]).run_until_idle().delivered == 1

    event.listen(engine, "before_cursor_execute", deliver_between_batches)
    try:
        where = ops.MessageFilter(queue="partner", status="delivered")
        pairs = ops.resend(engine, where, reason="partner restored a backup", actor="t", batch_size=1)
    finally:
        event.remove(engine, "before_cursor_execute", deliver_between_batches)
        relay_side.dispose()
    originals = sorted(partner.id(k) for k in ("order:42", "order:43", "keyless"))
    assert [old for old, _ in pairs] == originals
    assert len(batches) >= 4, "one batch per message, and the one that found nothing"
    assert partner.row(pairs[0][1]).status == "delivered", "the first copy was delivered mid-run"


# -- the database function (PostgreSQL) ----------------------------------------------------------------


def test_outbox_resend_checks_everything_it_is_given(pg_partner):
    """What a caller of the function itself (plain SQL over the operator's login) cannot get past."""
    partner = pg_partner
    engine = partner.engine
    delivered, pending = partner.id("order:42"), partner.id("order:45")
    call = "SELECT old_id, new_id FROM outbox_resend(:ids, :keys, 'ops', 'r', :strict)"

    def refused(ids: list[int], keys: list[str | None], strict: bool, why: str) -> None:
        with pytest.raises(DBAPIError, match=why), engine.begin() as conn:
            conn.execute(text(call), {"ids": ids, "keys": keys, "strict": strict})

    refused([pending], ["order:45"], True, f"outbox resend: message {pending} changed meanwhile; try again")
    refused([delivered], [None], False, "needs its root key, or NULL")
    refused([delivered, pending], ["order:42"], False, "one root key")
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_message SET idempotency_key = :k WHERE id = :id"),
            {"k": "x" * 255, "id": delivered},
        )
    refused([delivered], ["y" * 250], False, "leaves no room for ~resend:")
    with pytest.raises(DBAPIError, match="a reason is required"), engine.begin() as conn:
        conn.execute(text("SELECT * FROM outbox_resend(ARRAY[1]::bigint[], ARRAY['k'], 'ops', ' ', true)"))

    with engine.begin() as conn:
        skipped = conn.execute(text(call), {"ids": [pending], "keys": ["order:45"], "strict": False}).all()
        assert skipped == [], "not strict: a message in another status is passed over"
        # An id given twice is resent once; the copy's key comes from the stand-in given for it.
        stand_in = ops.root_key("x" * 255)
        pairs = conn.execute(
            text(call), {"ids": [delivered, delivered], "keys": [stand_in, stand_in], "strict": True}
        ).all()
        database_now = conn.execute(text("SELECT now()")).scalar_one()
    ((old, new),) = pairs
    assert partner.row(new).idempotency_key == f"{stand_in}~resend:{new}" == ops.resent_key("x" * 255, new)
    (resent,) = [h for h in history_of(engine, old) if h.outcome == "resent"]
    assert resent.started_at == database_now == partner.row(new).created_at, "the database's clock"
    assert resent.detail == {"new_id": new, "previous_status": "delivered", **login_of(engine)}

    with engine.connect() as conn:
        secdef, config, acl, owner = conn.execute(
            text(
                "SELECT prosecdef, proconfig, proacl::text[], pg_get_userbyid(proowner) FROM pg_proc"
                " WHERE oid = 'outbox_resend(bigint[], text[], text, text, boolean)'::regprocedure"
            )
        ).one()
        table_owner = conn.execute(
            text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = 'outbox_message'::regclass")
        ).scalar_one()
    assert secdef and config == ["search_path=pg_catalog, pg_temp"] and owner == table_owner
    assert not any(entry.startswith("=") for entry in acl or []), f"PUBLIC may not execute it: {acl}"


# -- the migration --------------------------------------------------------------------------------------


def test_outbox_0017_keeps_history_and_its_guards_and_its_downgrade_keeps_resent_rows(empty_url):
    outbox.upgrade(empty_url, "outbox_0016")
    engine = create_engine(empty_url)
    row = (
        "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at)"
        " VALUES (1, 1, :o, '2026-12-01T00:00:00+00:00')"
    )
    try:
        with engine.begin() as conn:
            for outcome in ("failed", "delivered", "retried_now"):
                conn.execute(text(row), {"o": outcome})
            before = conn.execute(text("SELECT * FROM outbox_attempt ORDER BY id")).all()
        with pytest.raises(Exception, match="ck_outbox_attempt_outcome"), engine.begin() as conn:
            conn.execute(text(row), {"o": "resent"})

        assert outbox.upgrade(empty_url, "outbox_0017") == ["outbox_0017"]
        with engine.begin() as conn:
            assert conn.execute(text("SELECT * FROM outbox_attempt ORDER BY id")).all() == before
            conn.execute(text(row), {"o": "resent"})
        with pytest.raises(Exception, match="append-only"), engine.begin() as conn:
            conn.execute(text("UPDATE outbox_attempt SET reason = 'rewritten'"))
        with pytest.raises(Exception, match="history row.s. record a resend"):
            outbox._migrations.downgrade(empty_url, "outbox_0016")
        with engine.connect() as conn:
            assert (
                conn.execute(
                    text("SELECT count(*) FROM outbox_attempt WHERE outcome = 'resent'")
                ).scalar_one()
                == 1
            )
    finally:
        engine.dispose()


def test_a_database_not_migrated_that_far_says_to_migrate(empty_url):
    outbox.upgrade(empty_url)  # delivered by a relay of this version, which needs the latest schema
    engine = create_engine(empty_url)
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="partner_webhook")
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            emit(s, "order.paid", {"order_id": 1}, key=f"order:{uuid.uuid4()}")
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            delivered = conn.execute(select(m.c.id)).scalar_one()
        outbox._migrations.downgrade(empty_url, "outbox_0016")
        before = snapshot(engine)
        said = assert_one_line_error(
            run("resend", str(delivered), "--reason", "r", database_url=empty_url), 1
        )
        assert "run `outbox migrate` first" in said, said
        assert snapshot(engine) == before
    finally:
        ob.uninstall(maker)
        engine.dispose()
