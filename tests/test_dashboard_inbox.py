"""The dashboard's Inbox page over HTTP: the inbox's dead letters listed, shown, requeued, on both databases.

Three dead letters (two of ``billing``, one of ``shipping``) made by real
inboxes; what the pages show is checked against ``outbox.ops``, and the
requeue against the row it must leave and the consumer's second try.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from test_dashboard import SAME_SITE, Client, text_of

import outbox
from outbox import Inbox, InboxMessage, ops
from outbox.dashboard import create_app, token_auth

dead = outbox.outbox_inbox_dead


@dataclass
class Letters:
    engine: Engine
    ids: dict[str, int]  # message id -> dead letter id
    billing: Inbox


@pytest.fixture
def letters(engine: Engine) -> Iterator[Letters]:
    billing = Inbox("billing")
    handled: list[str] = []
    billing.handler("order.paid", name="bill")(lambda session, message: handled.append(message.id))
    ids = {}
    with Session(engine) as s, s.begin():
        for message_id, consumer, payload in (
            ("m1", "billing", {"order": 1, "card": {"api_key": "sk_live_42"}}),
            ("m2", "billing", {"order": 2}),
            ("m3", "shipping", {"parcel": 3}),
        ):
            message = InboxMessage(message_id, "order.paid", payload, {"authorization": "Bearer abc"})
            found = Inbox(consumer).dead_letter(
                s, message, ValueError(f"{message_id} has no customer"), attempts=5
            )
            assert found is not None
            ids[message_id] = found
    yield Letters(engine, ids, billing)


@pytest.fixture
def reader(letters: Letters) -> Iterator[Client]:
    with Client(create_app(letters.engine)) as c:
        yield c


@pytest.fixture
def operator(letters: Letters) -> Iterator[Client]:
    with Client(create_app(letters.engine, allow_actions=True, secrets=["sk_live_42"])) as c:
        yield c


def listed(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'data-dead-letter="(\d+)"', html)]


def status_of(letters: Letters, message_id: str) -> tuple[str, str | None, str | None]:
    with letters.engine.connect() as conn:
        row = conn.execute(select(dead).where(dead.c.id == letters.ids[message_id])).one()
    return row.status, row.actor, row.reason


def test_the_inbox_lists_dead_letters_newest_first_filtered_by_consumer_and_status(reader, letters):
    ids = letters.ids
    page = reader.get("/inbox")
    assert page.status_code == 200
    assert listed(page.text) == [ids["m3"], ids["m2"], ids["m1"]]
    assert "3 matching." in text_of(page.text)
    assert 'href="/inbox" aria-current="page"' in page.text  # the navigation names the page
    billing = reader.get("/inbox?consumer=billing")
    assert listed(billing.text) == [ids["m2"], ids["m1"]]
    assert "data-bookmark>/inbox?consumer=billing<" in billing.text
    ops.requeue_inbox_dead_letter(letters.engine, ids["m1"], actor="ana", reason="r")
    assert listed(reader.get("/inbox?consumer=billing").text) == [ids["m2"]]  # the default: dead ones
    assert listed(reader.get("/inbox?consumer=billing&status=requeued").text) == [ids["m1"]]
    # The first thing on the page: how many wait for a decision, whatever the status filter shows.
    requeued_view = reader.get("/inbox?consumer=billing&status=requeued").text
    assert '<span class="n" data-count="waiting">1</span>' in requeued_view
    assert '<span class="n" data-count="waiting">2</span>' in reader.get("/inbox").text
    assert listed(reader.get("/inbox?status=any").text) == [ids["m3"], ids["m2"], ids["m1"]]
    assert listed(reader.get("/inbox?consumer=nobody").text) == []
    assert "No dead letter matches." in reader.get("/inbox?consumer=nobody").text


def test_pages_of_the_inbox_follow_the_page_size(letters):
    with Client(create_app(letters.engine, page_size=2)) as c:
        first = c.get("/inbox")
        assert listed(first.text) == [letters.ids["m3"], letters.ids["m2"]]
        older = re.search(r'<a rel="next" href="([^"]+)"', first.text)
        assert older is not None
        second = c.get(older.group(1).replace("&amp;", "&"))
        assert listed(second.text) == [letters.ids["m1"]]
        assert '<a rel="next"' not in second.text


def test_payloads_and_headers_are_masked_as_the_command_masks_them(operator, letters):
    page = operator.get(f"/inbox/{letters.ids['m1']}")
    assert page.status_code == 200
    shown = text_of(page.text)
    assert "sk_live_42" not in page.text and "Bearer abc" not in page.text
    assert "&#34;api_key&#34;: &#34;***&#34;" in page.text or '"api_key": "***"' in page.text
    assert "ValueError m1 has no customer" in shown
    assert "sk_live_42" not in operator.get("/inbox").text  # the list's preview too
    command = ops.inbox_dead_letter(letters.engine, letters.ids["m1"])
    assert command.payload["card"]["api_key"] == "***" and command.headers["authorization"] == "***"


def test_requeue_records_actor_and_reason_and_the_consumer_then_handles_it(operator, letters):
    dead_id = letters.ids["m1"]
    page = operator.get(f"/inbox/{dead_id}")
    assert f'action="/inbox/{dead_id}/requeue"' in page.text
    done = operator.post(f"/inbox/{dead_id}/requeue", data={"reason": "customer imported"}, headers=SAME_SITE)
    assert done.status_code == 200 and str(done.url).endswith(f"/inbox/{dead_id}")
    assert status_of(letters, "m1") == ("requeued", "dashboard", "customer imported")
    shown = text_of(done.text)
    assert re.search(r"Requeued .* by dashboard( \(\w+\) )?: customer imported", shown), shown
    assert "Waiting for its consumer's next process_requeued" in shown
    assert f'action="/inbox/{dead_id}/requeue"' not in done.text  # requeued: nothing to requeue
    again = operator.post(f"/inbox/{dead_id}/requeue", data={"reason": "twice"}, headers=SAME_SITE)
    assert again.status_code == 409 and "(requeued)" in text_of(again.text)

    assert [r.outcome for r in letters.billing.process_requeued(letters.engine)] == ["handled"]
    assert "Handled" in text_of(operator.get(f"/inbox/{dead_id}").text)
    assert status_of(letters, "m2")[0] == "dead"


@pytest.mark.parametrize(
    ("path", "form", "status", "problem"),
    [
        ("/inbox/{m1}/requeue", {"reason": "  "}, 400, "a reason is required"),
        ("/inbox/{m1}/requeue", {}, 400, "a reason is required"),
        ("/inbox/999999/requeue", {"reason": "r"}, 404, "no inbox dead letter with id 999999"),
        ("/inbox/x/requeue", {"reason": "r"}, 400, "dead letter id: expected a whole number"),
    ],
)
def test_bad_requeues_get_their_own_status_and_change_nothing(operator, letters, path, form, status, problem):
    response = operator.post(path.format(m1=letters.ids["m1"]), data=form, headers=SAME_SITE)
    assert response.status_code == status
    assert problem in text_of(response.text)
    assert status_of(letters, "m1") == ("dead", None, None)


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/inbox?status=lost", "status: one of dead, requeued, handled, any"),
        ("/inbox?before_id=abc", "before_id: expected a whole number"),
        ("/inbox/0", "dead letter id: expected 1 to"),
        ("/inbox/abc", "dead letter id: expected a whole number"),
    ],
)
def test_bad_inbox_urls_get_a_400(reader, path, problem):
    response = reader.get(path)
    assert response.status_code == 400
    assert problem in text_of(response.text)


def test_an_unknown_dead_letter_is_a_404(reader):
    response = reader.get("/inbox/999999")
    assert response.status_code == 404 and "no inbox dead letter with id 999999" in text_of(response.text)


def test_read_only_refuses_the_requeue_and_offers_no_form(reader, letters):
    dead_id = letters.ids["m1"]
    refused = reader.post(f"/inbox/{dead_id}/requeue", data={"reason": "x"}, headers=SAME_SITE)
    assert refused.status_code == 403 and "read-only" in refused.text
    assert reader.get(f"/inbox/{dead_id}/requeue").status_code == 405
    assert '<form method="post"' not in reader.get(f"/inbox/{dead_id}").text
    assert status_of(letters, "m1") == ("dead", None, None)


@pytest.mark.parametrize(
    "headers",
    [{"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}, {"origin": "null"}, {}],
)
def test_a_cross_site_requeue_is_refused(operator, letters, headers):
    response = operator.post(f"/inbox/{letters.ids['m1']}/requeue", data={"reason": "x"}, headers=headers)
    assert response.status_code == 403 and "refused" in response.text
    assert status_of(letters, "m1") == ("dead", None, None)


def test_auth_is_asked_for_requeue_and_names_the_actor(letters):
    asked: list[str] = []
    token = "s3cret-token-0123456789"
    check = token_auth(token)

    def auth(request, action):
        asked.append(action)
        return check(request, action) and request.headers.get("x-deny") != action

    basic = "Basic " + base64.b64encode(f"alice:{token}".encode()).decode()
    with Client(create_app(letters.engine, auth=auth, allow_actions=True)) as c:
        assert c.get("/inbox").status_code == 401
        assert c.get("/inbox", headers={"authorization": basic}).status_code == 200
        path = f"/inbox/{letters.ids['m2']}/requeue"
        denied = c.post(
            path, data={"reason": "r"}, headers={**SAME_SITE, "authorization": basic, "x-deny": "requeue"}
        )
        assert denied.status_code == 403 and asked[-1] == "requeue"
        done = c.post(path, data={"reason": "partner fixed"}, headers={**SAME_SITE, "authorization": basic})
        assert done.status_code == 200 and token not in done.text
    assert status_of(letters, "m2") == ("requeued", "dashboard:alice", "partner fixed")


def test_the_inbox_pages_carry_no_inline_script_and_escape_hostile_text(operator, letters):
    hostile = '<script>window.__xss=1</script>"><img src=x onerror=alert(1)>'
    with Session(letters.engine) as s, s.begin():
        dead_id = Inbox("billing").dead_letter(
            s, InboxMessage(hostile[:50], "order.paid", {"note": hostile}), ValueError(hostile)
        )
    for path in ("/inbox?status=any", f"/inbox/{dead_id}"):
        html = operator.get(path).text
        assert "<script>window" not in html and "<img" not in html, path
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), path
        assert " style=" not in html and "<style" not in html, path
        assert not re.search(r"\bon[a-z]+=", html.replace("onerror=alert", "")), path
