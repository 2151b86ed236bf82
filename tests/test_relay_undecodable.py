"""A stored message whose payload or headers cannot be decoded goes dead; the relay and the rest carry on.

Such rows are written past ``emit()`` (an older version accepted payloads nested
a thousand levels deep; another writer may store anything), so the tests store
them as the table's owner would, with plain SQL. Decoding one raised while the
claim's rows were fetched: the relay exited with a traceback, the claimed batch
stayed ``running``, and after a restart the lease recovery met the row again and
failed the same way.
"""

from __future__ import annotations

import signal
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from relayproc import APPS, RelayProcess, wait_until
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Message, Outbox, emit
from outbox.relay import Relay

sys.path.insert(0, str(APPS))
import counting_app  # noqa: E402  (the module the relay subprocesses serve)

m = outbox.outbox_message
a = outbox.outbox_attempt

#: Past Python's recursion limit (1000), which the json module's decoder spends a level of each.
LEVELS = 2000
TOO_DEEP = "[" * LEVELS + "]" * LEVELS
TOO_DEEP_REASON = f"nested {LEVELS} levels deep, deeper than Python's JSON decoder can go"
#: The headers' document: {"trace": TOO_DEEP}, one level more.
HEADERS_REASON = f"nested {LEVELS + 1} levels deep, deeper than Python's JSON decoder can go"
#: A number PostgreSQL's jsonb keeps, but past the digits Python turns into an int (4300).
TOO_LONG = "[" + "9" * 5000 + "]"


def _store(engine: Engine, message_id: int, column: str, document: str) -> None:
    """Put ``document`` (JSON text) in the row as its owner would, past emit()'s checks."""
    value = "CAST(:doc AS jsonb)" if engine.dialect.name == "postgresql" else ":doc"
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE outbox_message SET {column} = {value} WHERE id = :id"),
            {"doc": document, "id": message_id},
        )


def _emit(engine: Engine, ob: Outbox, event: str, count: int) -> list[int]:
    """Emit ``count`` events; the ids of their messages."""
    with engine.connect() as conn:
        before = conn.execute(select(func.coalesce(func.max(m.c.id), 0))).scalar_one()
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory.begin() as s:
            for n in range(count):
                emit(s, event, {"n": n})
    finally:
        ob.uninstall(factory)
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.id).where(m.c.id > before).order_by(m.c.id)).scalars())


def _statuses(engine: Engine) -> dict[int, tuple[str, int, str | None]]:
    with engine.connect() as conn:
        return {
            r.id: (r.status, r.attempts, r.last_error)
            for r in conn.execute(select(m.c.id, m.c.status, m.c.attempts, m.c.last_error))
        }


def _history(engine: Engine, message_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).where(a.c.message_id == message_id).order_by(a.c.id)))


def _lapsed(engine: Engine, message_id: int, *, attempts: int = 1) -> None:
    """Leave the row as a relay that crashed on it did: running, its lease run out."""
    with engine.begin() as conn:
        conn.execute(
            update(m)
            .where(m.c.id == message_id)
            .values(
                status="running",
                locked_by="crashed-relay",
                locked_until=datetime.now(UTC) - timedelta(minutes=5),
                attempts=attempts,
            )
        )


@pytest.fixture
def recording() -> tuple[Outbox, list[Message]]:
    ob = Outbox()
    given: list[Message] = []
    ob.route("e", given.append, name="recorder", max_attempts=5)
    return ob, given


def test_undecodable_payloads_and_headers_go_dead_unhandled_while_the_others_are_delivered(
    engine: Engine, recording: tuple[Outbox, list[Message]]
):
    ob, given = recording
    first, deep, deep_headers, long_number, last = _emit(engine, ob, "e", 5)
    _store(engine, deep, "payload", TOO_DEEP)
    _store(engine, deep_headers, "headers", '{"trace": ' + TOO_DEEP + "}")
    _store(engine, long_number, "payload", TOO_LONG)

    result = Relay(ob, engine, listen=False).run_until_idle()

    assert (result.delivered, result.dead, result.retried) == (2, 3, 0)
    assert sorted(msg.id for msg in given) == [first, last], "no handler is given what could not be decoded"
    found = _statuses(engine)
    assert found[first][:2] == found[last][:2] == ("delivered", 1)
    assert found[deep] == ("dead", 1, f"the stored payload cannot be decoded: {TOO_DEEP_REASON}")
    assert found[deep_headers][:2] == ("dead", 1)
    assert found[deep_headers][2] == f"the stored headers cannot be decoded: {HEADERS_REASON}"
    assert found[long_number][:2] == ("dead", 1)
    assert found[long_number][2].startswith(
        "the stored payload cannot be decoded: Exceeds the limit (4300 digits)"
    )
    for message_id in (deep, deep_headers, long_number):
        [row] = _history(engine, message_id)
        assert (row.attempt, row.outcome, row.error_type, row.error) == (
            1,
            "dead",
            "UndecodableMessage",
            found[message_id][2],
        )


def test_a_lapsed_lease_on_an_undecodable_message_is_recovered_as_dead_not_retried(
    engine: Engine, recording: tuple[Outbox, list[Message]]
):
    """What an older relay that crashed on the row left behind: recovery must not crash on it in turn."""
    ob, given = recording
    deep, fine = _emit(engine, ob, "e", 2)
    _store(engine, deep, "payload", TOO_DEEP)
    _lapsed(engine, deep)

    result = Relay(ob, engine, listen=False).run_until_idle()

    assert (result.recovered, result.delivered, result.dead) == (1, 1, 0)
    assert [msg.id for msg in given] == [fine]
    status, attempts, last_error = _statuses(engine)[deep]
    assert (status, attempts) == ("dead", 1), "attempts left or not, it can never be delivered"
    assert last_error.startswith("lease held by relay crashed-relay expired at ")
    assert last_error.endswith(f"; the stored payload cannot be decoded: {TOO_DEEP_REASON}")
    [row] = _history(engine, deep)
    assert (row.attempt, row.outcome, row.relay_id, row.error) == (
        1,
        "lease_expired",
        "crashed-relay",
        last_error,
    )
    assert row.detail["dead"] is True


# -- outbox-relay ------------------------------------------------------------------------------------


@pytest.fixture
def counting(engine: Engine) -> Iterator[None]:
    counting_app.delivery_log.create(engine)
    yield


def _serve(database_url: str, tmp_path: Path) -> RelayProcess:
    return RelayProcess(
        database_url, ["--poll-interval", "0.1", "--lease", "2"], log_path=tmp_path / "relay.log"
    )


def _handled(engine: Engine) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(conn.execute(select(counting_app.delivery_log.c.message_id)).scalars())


def _counts(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(dict(conn.execute(select(m.c.status, func.count()).group_by(m.c.status)).all()))


def test_outbox_relay_serves_on_past_an_undecodable_message_and_exits_0(
    engine: Engine, database_url: str, tmp_path: Path, counting: None
):
    ids = _emit(engine, counting_app.ob, counting_app.EVENT, 9)
    deep = ids[4]
    _store(engine, deep, "payload", TOO_DEEP)
    relay = _serve(database_url, tmp_path)
    try:
        wait_until(
            lambda: _counts(engine) == Counter(delivered=8, dead=1), "8 delivered and 1 dead", relays=[relay]
        )
        later = _emit(engine, counting_app.ob, counting_app.EVENT, 3)  # and it still claims new work
        wait_until(
            lambda: _counts(engine) == Counter(delivered=11, dead=1), "the later ones too", relays=[relay]
        )
        relay.signal(signal.SIGTERM)
        assert relay.wait(20) == 0, relay.tail()
    finally:
        relay.kill()
    assert _handled(engine) == Counter(dict.fromkeys([*ids[:4], *ids[5:], *later], 1))
    assert _statuses(engine)[deep] == ("dead", 1, f"the stored payload cannot be decoded: {TOO_DEEP_REASON}")
    assert [r["message_id"] for r in relay.actions("dead")] == [deep]
    assert "Traceback" not in relay.text()


def test_outbox_relay_recovers_an_undecodable_message_a_crashed_relay_left_running_as_dead(
    engine: Engine, database_url: str, tmp_path: Path, counting: None
):
    """The crash loop: each restart's lease recovery met the row and failed as the claim had."""
    deep, *others = _emit(engine, counting_app.ob, counting_app.EVENT, 4)
    _store(engine, deep, "payload", TOO_DEEP)
    _lapsed(engine, deep)
    relay = _serve(database_url, tmp_path)
    try:
        wait_until(
            lambda: _counts(engine) == Counter(delivered=3, dead=1),
            "3 delivered and 1 recovered as dead",
            relays=[relay],
        )
        relay.signal(signal.SIGTERM)
        assert relay.wait(20) == 0, relay.tail()
    finally:
        relay.kill()
    assert _handled(engine) == Counter(dict.fromkeys(others, 1))
    [recovered] = relay.actions("lease_expired")
    assert recovered["message_id"] == deep
    assert recovered["message"].endswith(f"the stored payload cannot be decoded: {TOO_DEEP_REASON}: dead")
    assert [(h.outcome, h.error_type) for h in _history(engine, deep)] == [("lease_expired", "LeaseExpired")]
    assert "Traceback" not in relay.text()
