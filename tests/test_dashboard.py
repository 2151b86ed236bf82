"""The dashboard over HTTP: every page and action through httpx against the ASGI app, on both databases.

The seven seeded messages (test_ops_cli's ``seeded``) are made by a real relay:
two delivered, two dead, one running, one pending, one discarded. What a page
shows is checked against what ``outbox.ops`` and the tables say, and every
action against the history row it must leave.
"""

from __future__ import annotations

import asyncio
import base64
import html as html_text
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_ops_cli
from sqlalchemy import select
from test_ops_cli import (
    Seeded,
    assert_cut_at_depth_shown,
    delivered_after_a_failure,
    history_of,
    insert_nested_message,
    statuses,
)

import outbox
from outbox import ops
from outbox._redact import TOO_DEEP
from outbox.dashboard import CONTENT_SECURITY_POLICY, create_app, token_auth
from outbox.relay import Relay

m = outbox.outbox_message
seeded = test_ops_cli.seeded  # the seven messages, as the CLI tests make them
ORIGIN = "http://testserver"
SAME_SITE = {"origin": ORIGIN, "sec-fetch-site": "same-origin"}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "dashboard.md"


class Client:
    """httpx against the ASGI app in this process: requests go through every middleware, no socket."""

    def __init__(self, app: Any) -> None:
        self._loop = asyncio.new_event_loop()
        transport = httpx.ASGITransport(app=app)
        self._http = httpx.AsyncClient(transport=transport, base_url=ORIGIN, follow_redirects=True)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._http.get(url, **kw))

    def post(self, url: str, **kw: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._http.post(url, **kw))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.run_until_complete(self._http.aclose())
        self._loop.close()


def client(seeded: Seeded, **options: Any) -> Client:
    return Client(create_app(seeded.engine, **options))


@pytest.fixture
def reader(seeded: Seeded) -> Iterator[Client]:
    with client(seeded) as c:
        yield c


@pytest.fixture
def operator(seeded: Seeded) -> Iterator[Client]:
    with client(seeded, allow_actions=True) as c:
        yield c


def text_of(html: str) -> str:
    """The page as a reader sees it: tags dropped, whitespace folded."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_every_response_carries_the_security_headers(reader):
    for path in (
        "/",
        "/messages",
        "/dead",
        "/queues",
        "/reports",
        "/messages/999999",
        "/static/dashboard.css",
    ):
        response = reader.get(path)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert (
            "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
        )
        assert response.headers["x-frame-options"] == "DENY", path
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert response.headers["referrer-policy"] == "same-origin", path
        if not path.startswith("/static/"):
            assert response.headers["cache-control"] == "no-store", path
    assert reader.get("/messages/999999").status_code == 404


def test_the_referrer_policy_keeps_own_posts_origin_real_and_is_the_one_documented(reader):
    # Under no-referrer a browser sends "Origin: null" with the dashboard's own form posts, and one
    # that sends no Sec-Fetch-Site would then have every action refused by the Origin check.
    sent = reader.get("/").headers["referrer-policy"]
    assert sent == "same-origin"
    documented = re.findall(r"`Referrer-Policy: ([a-z-]+)`", " ".join(DOCS.read_text().split()))
    assert documented == [sent]


def test_pages_have_no_inline_script_or_style_and_load_nothing_from_elsewhere(reader, seeded):
    for path in ("/", "/messages", "/dead", "/queues", "/reports", f"/messages/{seeded.id('order:7')}"):
        html = reader.get(path).text
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), path
        assert " style=" not in html and "<style" not in html, path
        assert not re.search(r"(src|href)=\"(https?:)?//", html), path
        assert not re.search(r"\bon[a-z]+=", html), path


def test_overview_counts_match_ops_stats(reader, seeded):
    html = reader.get("/").text
    stats = ops.stats(seeded.engine)
    for status in ("pending", "running", "delivered", "discarded"):
        shown = re.search(rf'data-count="{status}">([\d,]+)<', html)
        assert shown is not None and int(shown.group(1).replace(",", "")) == stats.by_status.get(status, 0)
    assert re.search(r'data-count="dead">2<', html)
    assert re.search(r'data-count="dead_requeued">0<', html)
    page = text_of(html)
    assert "billing" in page and "invoice" in page and "welcome_email" in page
    assert "delivered 2" in page  # the last hour's history: signup:1 and signup:2


def test_list_filters_are_query_parameters_named_like_the_cli_flags(reader, seeded):
    def ids(query: str) -> set[int]:
        response = reader.get("/messages?" + query)
        assert response.status_code == 200, response.text
        return {int(i) for i in re.findall(r'href="/messages/(\d+)"', response.text)}

    assert ids("status=dead") == {seeded.id("order:7"), seeded.id("order:8")}
    assert ids("queue=reports&status=pending") == {seeded.id("report:2026-10")}
    assert ids("handler=welcome_email") == {seeded.id("signup:1"), seeded.id("signup:2")}
    assert ids("event_type=order.paid&where=payload.order_id%3D8") == {seeded.id("order:8")}
    assert ids("where=payload.card.api_key%3D%22sk_live_42%22") == {seeded.id("order:7")}
    assert ids("key=signup:2") == {seeded.id("signup:2")}
    assert ids("group_key=customer:4") == {seeded.id("order:8")}
    assert ids("since=2000-01-01&before=2000-01-02") == set()


def test_keyset_pages_cover_every_row_once_and_counts_are_capped(seeded):
    with client(seeded, page_size=2, count_cap=3) as c:
        seen: list[int] = []
        url = "/messages"
        while url:
            html = c.get(url).text
            seen += [int(i) for i in re.findall(r'href="/messages/(\d+)">#', html)]
            found = re.search(r'rel="next" href="([^"]+)"', html)
            url = found.group(1).replace("&amp;", "&") if found else ""
        assert seen == sorted(statuses(seeded.engine) and seen, reverse=True)
        assert sorted(seen) == sorted(seeded.ids.values())
        listing = c.get("/messages").text
        assert "matching" not in text_of(listing)  # more than a page: the count is its own request
        link = re.search(r'data-count-src="(/messages/count[^"]*)"', listing)
        assert link is not None
        assert "More than 3 matching" in text_of(c.get(link.group(1).replace("&amp;", "&")).text)
        counted = c.get("/dead/count?event_type=order.paid")
        assert "2 matching" in text_of(counted.text)
        assert 'href="/dead?status=dead&amp;event_type=order.paid"' in counted.text
        assert "2 matching" in text_of(c.get("/messages?status=dead").text)


def test_a_filtered_list_is_bookmarkable(reader, seeded):
    html = reader.get("/messages?queue=billing&where=payload.order_id%3D7").text
    bookmark = re.search(r"data-bookmark>([^<]+)<", html)
    assert bookmark is not None
    again = reader.get(bookmark.group(1).replace("&amp;", "&")).text
    assert re.findall(r'href="/messages/(\d+)">#', again) == [str(seeded.id("order:7"))]


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("status=lost", "status: one of pending, running, delivered, dead, discarded, got 'lost'"),
        ("where=order_id%3D7", "where: expected payload.PATH=VALUE"),
        ("before_id=abc", "before_id: expected a whole number, got 'abc'"),
        ("before_id=" + "9" * 5000, "before_id: expected 1 to 9223372036854775807, got a 5000-digit number"),
        ("limit=0", "limit: expected 1 to 500, got 0"),
        ("since=yesterday", "since: expected an ISO date or time"),
        ("before_id=²", "before_id: expected a whole number, got '²'"),  # isdigit() says yes, int() no
        ("before_id=٣", "before_id: expected a whole number, got '٣'"),  # int() would read 3
        ("limit=²", "limit: expected a whole number, got '²'"),
        ("queue=a%00b", "queue contains a NUL character"),
        ("where=payload.n%3D%00", "where contains a NUL character"),
        ("where=payload.n%3D%22%5Cu0000%22", "where: the value contains a NUL character"),
        ("where=payload.n%3D" + "9" * 500, "where: a 500-digit integer is out of range"),
        ("where=payload.n%3D" + "9" * 5000, "where is longer than 1000 characters"),
        ("needs_decision=yes", "needs_decision: 1 (only dead messages nobody has requeued) or 0, got 'yes'"),
        ("status=pending&needs_decision=1", "needs_decision: only dead messages need a decision"),
    ],
)
def test_bad_filters_get_a_specific_400(reader, query, problem):
    response = reader.get("/messages?" + query)
    assert response.status_code == 400
    assert problem in text_of(response.text).replace("&#39;", "'")


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/messages/²", "message id: expected a whole number, got '²'"),
        ("/messages/٣", "message id: expected a whole number, got '٣'"),
        ("/reports/%00", "report run id contains a NUL character"),
        ("/reports?before=%00", "before contains a NUL character"),
        ("/dead/count?before_id=²", "before_id: expected a whole number, got '²'"),
        ("/dead?needs_decision=%00", "needs_decision: 1 (only dead messages nobody has requeued) or 0"),
    ],
)
def test_bad_ids_and_names_in_urls_get_a_400(reader, path, problem):
    response = reader.get(path)
    assert response.status_code == 400
    assert problem in text_of(response.text).replace("&#39;", "'")


def row_ids(html: str) -> list[int]:
    """The ids of a listing's rows, in order (not the copies a row links to)."""
    return [int(i) for i in re.findall(r'<td class="num"><a href="/messages/(\d+)">#', html)]


def test_dead_letters_show_what_needs_a_decision_and_switch_to_every_dead_one(operator, seeded):
    first, second = seeded.id("order:7"), seeded.id("order:8")
    ((_, copy),) = ops.requeue(seeded.engine, ops.MessageFilter(ids=(first,)), reason="fixed", actor="t")
    overview = operator.get("/").text
    assert re.search(r'href="/dead"><span class="n" data-count="dead">1<', overview)
    assert re.search(
        r'href="/dead\?needs_decision=0"><span class="n" data-count="dead_requeued">1<', overview
    )

    needing = operator.get("/dead")
    assert needing.status_code == 200
    assert row_ids(needing.text) == [second], "the requeued original is left out"
    assert "1 matching." in text_of(needing.text)
    switch = re.search(r'<a href="([^"]+)" data-switch="all">', needing.text)
    assert switch is not None
    assert html_text.unescape(switch.group(1)) == "/dead?status=dead&needs_decision=0"

    every = operator.get(html_text.unescape(switch.group(1))).text
    assert row_ids(every) == [second, first]
    assert "2 matching." in text_of(every)
    marker = re.search(
        rf'data-requeued-to="{copy}">requeued as <a href="/messages/{copy}">#{copy}</a>', every
    )
    assert marker is not None, "the original links to its copy"
    assert every.count("data-requeued-to=") == 1
    assert '<input type="hidden" name="needs_decision" value="0">' in every, "Filter keeps the view"
    assert '<a href="/dead?needs_decision=0">Clear</a>' in every, "so does Clear"
    back = re.search(r'<a href="([^"]+)" data-switch="needing">', every)
    assert back is not None and back.group(1) == "/dead?status=dead"

    # Filters combine with either view, and the count and the bulk actions follow the page.
    assert row_ids(operator.get("/dead?needs_decision=0&where=payload.order_id%3D7").text) == [first]
    assert row_ids(operator.get("/dead?where=payload.order_id%3D7").text) == []
    assert "1 matching" in text_of(operator.get("/dead/count").text)
    counted = operator.get("/dead/count?needs_decision=0").text
    assert "2 matching" in text_of(counted) and 'href="/dead?status=dead&amp;needs_decision=0"' in counted
    form = {"scope": "filter", "reason": "refunded"}
    assert "Discard 1 dead message?" in text_of(
        operator.post("/dead/discard", data=form, headers=SAME_SITE).text
    )
    every_form = {**form, "needs_decision": "0"}
    ask = operator.post("/dead/discard", data=every_form, headers=SAME_SITE)
    assert "Discard 2 dead messages?" in text_of(ask.text)
    assert statuses(seeded.engine)["order:8"] == "dead", "nothing done before the confirmation"

    # The messages page takes the same parameter, named like `outbox list --needs-decision`.
    assert row_ids(operator.get("/messages?needs_decision=1").text) == [second]
    assert row_ids(operator.get("/messages?status=dead&needs_decision=1").text) == [second]
    listed = operator.get("/messages").text
    assert row_ids(listed) == sorted([*seeded.ids.values(), copy], reverse=True)
    assert re.search(rf'data-requeued-to="{copy}"', listed) and f"copy of #{first}" in text_of(listed)


def test_the_requeue_and_discard_forms_work_from_either_view(operator, seeded):
    first, second = seeded.id("order:7"), seeded.id("order:8")
    form = {"scope": "selected", "reason": "billing fixed", "id": [str(first)]}
    ask = operator.post("/dead/requeue", data=form, headers=SAME_SITE)
    confirm = dict(re.findall(r'name="(expected_ids|confirm|reason)" value="([^"]*)"', ask.text))
    done = operator.post("/dead/requeue", data={**confirm, "id": [str(first)]}, headers=SAME_SITE)
    assert "1 message requeued" in text_of(done.text)
    assert row_ids(operator.get("/dead").text) == [second]

    # The original, listed again under "all", can still be discarded (as the group runbook does).
    every = operator.get("/dead?needs_decision=0").text
    assert f'value="{first}" form="bulk"' in every
    form = {"scope": "selected", "reason": "copy made", "id": [str(first)], "needs_decision": "0"}
    ask = operator.post("/dead/discard", data=form, headers=SAME_SITE)
    assert "Discard 1 dead message?" in text_of(ask.text)
    confirm = dict(re.findall(r'name="(expected_ids|confirm|reason)" value="([^"]*)"', ask.text))
    done = operator.post("/dead/discard", data={**confirm, "id": [str(first)]}, headers=SAME_SITE)
    assert "1 message discarded" in text_of(done.text)
    assert statuses(seeded.engine)["order:7"] == "discarded"
    assert row_ids(operator.get("/dead?needs_decision=0").text) == [second]


def test_a_delivered_messages_earlier_error_reads_as_history(reader, seeded):
    delivered = delivered_after_a_failure(seeded)
    listing = reader.get("/messages?queue=sms").text
    assert row_ids(listing) == [delivered]
    assert '<td class="earlier">earlier error: SMS gateway timed out</td>' in listing
    assert '<td class="error">' not in listing
    detail = reader.get(f"/messages/{delivered}").text
    assert re.search(r'<dt>Earlier error</dt><dd class="earlier">SMS gateway timed out ', detail)
    assert "Last error" not in detail and 'dd class="error"' not in detail
    dead = reader.get(f"/messages/{seeded.id('order:7')}").text
    assert '<dt>Last error</dt><dd class="error">order 7 is unknown to billing</dd>' in dead
    assert '<td class="error">order 7 is unknown to billing</td>' in reader.get("/dead").text


def test_detail_shows_the_timeline_redacted_payload_and_lineage(operator, seeded):
    dead = seeded.id("order:7")
    html = operator.get(f"/messages/{dead}").text
    page = text_of(html)
    assert "sk_live_42" not in html and "***" in html
    assert "failed" in page and "dead" in page and "billing API unreachable" in page
    assert "Not a copy, and never requeued" in page
    # The login PostgreSQL stamps on each row stands with the relay it vouches for.
    assert "db_user" not in html
    if seeded.engine.dialect.name == "postgresql":
        login = seeded.engine.url.username
        assert re.search(rf"<td>[^<]+ <span [^>]*>\({login}\)</span></td>", html), "the relay's login"
    response = operator.post(f"/messages/{dead}/requeue", data={"reason": "billing fixed"}, headers=SAME_SITE)
    assert response.status_code == 200  # followed the 303 to the copy
    copy = int(str(response.url).rsplit("/", 1)[1])
    assert f"Requeued from #{dead}" in text_of(response.text).replace(" .", ".")
    assert f"Requeued as #{copy}" in text_of(operator.get(f"/messages/{dead}").text)
    last = history_of(seeded.engine, dead)[-1]
    assert (last.outcome, last.actor, last.reason) == ("requeued", "dashboard", "billing fixed")


def test_bulk_requeue_confirms_the_count_then_acts_on_exactly_those(operator, seeded):
    form = {"scope": "filter", "reason": "billing is back", "event_type": "order.paid"}
    ask = operator.post("/dead/requeue", data=form, headers=SAME_SITE)
    assert ask.status_code == 200
    assert "Requeue 2 dead messages?" in text_of(ask.text)
    assert statuses(seeded.engine)["order:7"] == "dead" and len(seeded.ids) == 7  # nothing happened yet
    confirm = dict(re.findall(r'name="(expected_ids|confirm|reason)" value="([^"]*)"', ask.text))
    ids = re.findall(r'name="id" value="(\d+)"', ask.text)
    done = operator.post(
        "/dead/requeue",
        data={**confirm, "id": ids},
        headers=SAME_SITE,  # type: ignore[dict-item]
    )
    assert done.status_code == 200
    assert "2 messages requeued" in text_of(done.text)
    with seeded.engine.connect() as conn:
        copies = conn.execute(select(m.c.requeued_from).where(m.c.requeued_from.is_not(None))).scalars().all()
    assert sorted(copies) == sorted([seeded.id("order:7"), seeded.id("order:8")])
    seeded.billing_fixed[0] = True
    Relay(seeded.ob, seeded.engine, queues=["billing"]).run_until_idle()
    with seeded.engine.connect() as conn:
        copies_now = dict(
            conn.execute(select(m.c.requeued_from, m.c.status).where(m.c.requeued_from.is_not(None))).all()
        )
    # order:8's copy is grouped behind its dead original (customer:4), as the CLI's requeue leaves it.
    assert copies_now == {seeded.id("order:7"): "delivered", seeded.id("order:8"): "pending"}


def test_the_scope_radio_decides_over_ticked_boxes(operator, seeded):
    one = seeded.id("order:7")
    form = {"reason": "r", "id": [str(one)]}
    picked = operator.post("/dead/requeue", data={**form, "scope": "selected"}, headers=SAME_SITE)
    assert "Requeue 1 dead message?" in text_of(picked.text)
    everything = operator.post("/dead/requeue", data={**form, "scope": "filter"}, headers=SAME_SITE)
    assert "Requeue 2 dead messages?" in text_of(everything.text)


def test_a_stale_confirmation_asks_again(operator, seeded):
    first = seeded.id("order:7")
    stale = {"reason": "r", "confirm": "yes", "expected_ids": f"{first}", "scope": "filter"}
    again = operator.post("/dead/requeue", data=stale, headers=SAME_SITE)
    assert "The selection changed" in text_of(again.text)
    assert "Requeue 2 dead messages?" in text_of(again.text)
    assert statuses(seeded.engine)["order:7"] == "dead"


def test_bulk_actions_need_a_reason_a_selection_and_stay_under_the_cap(seeded):
    with client(seeded, allow_actions=True, bulk_cap=1) as c:
        no_reason = c.post("/dead/discard", data={"scope": "filter"}, headers=SAME_SITE)
        assert no_reason.status_code == 400 and "a reason is required" in no_reason.text
        nothing = c.post("/dead/discard", data={"reason": "x", "scope": "selected"}, headers=SAME_SITE)
        assert nothing.status_code == 400 and "select messages" in nothing.text
        over = c.post("/dead/discard", data={"reason": "x", "scope": "filter"}, headers=SAME_SITE)
        assert over.status_code == 400 and "more than 1 messages match" in text_of(over.text)
    assert statuses(seeded.engine)["order:7"] == "dead"


@pytest.mark.parametrize(
    ("path", "form", "problem"),
    [
        (
            "/dead/requeue",
            {"reason": "r", "confirm": "yes", "expected_ids": "²", "scope": "filter"},
            "expected_ids: expected a whole number, got '²'",
        ),
        ("/dead/discard", {"reason": "r", "id": ["²"]}, "message id: expected a whole number, got '²'"),
        ("/messages/²/requeue", {"reason": "r"}, "message id: expected a whole number, got '²'"),
        ("/messages/٣/discard", {"reason": "r"}, "message id: expected a whole number, got '٣'"),
        ("/queues/pause", {"reason": "r", "kind": "queue", "name": "bill\x00ing"}, "name contains a NUL"),
    ],
)
def test_bad_action_input_gets_a_400_and_changes_nothing(operator, seeded, path, form, problem):
    before = statuses(seeded.engine)
    response = operator.post(path, data=form, headers=SAME_SITE)
    assert response.status_code == 400
    assert problem in text_of(response.text).replace("&#39;", "'")
    assert statuses(seeded.engine) == before and ops.paused(seeded.engine) == []


@pytest.mark.parametrize(
    ("user", "problem"),
    [
        ("a" * 246, "is longer than 255 characters, the most the history records"),  # dashboard:a...a
        ("al\x00ice", "contains a NUL character"),
    ],
)
def test_an_actor_the_history_cannot_record_is_refused_before_the_action(seeded, user, problem):
    token = "s3cret-token-0123456789"
    dead = seeded.id("order:7")
    before = (statuses(seeded.engine), len(history_of(seeded.engine, dead)))
    with client(seeded, auth=token_auth(token), allow_actions=True) as c:
        basic = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        for path, form in (
            (f"/messages/{dead}/requeue", {"reason": "r"}),
            (
                "/dead/discard",
                {"reason": "r", "id": [str(dead)], "confirm": "yes", "expected_ids": str(dead)},
            ),
            ("/queues/pause", {"reason": "r", "kind": "queue", "name": "billing"}),
        ):
            response = c.post(path, data=form, headers={**SAME_SITE, "authorization": basic})
            assert response.status_code == 400, path
            assert "the actor name 'dashboard:a" in text_of(response.text).replace("&#39;", "'")
            assert problem in text_of(response.text), path
    assert (statuses(seeded.engine), len(history_of(seeded.engine, dead))) == before
    assert ops.paused(seeded.engine) == []


def test_the_longest_actor_the_history_holds_is_recorded_whole(seeded):
    token = "s3cret-token-0123456789"
    user = "a" * 245  # "dashboard:" and the name: 255 characters, the actor column's width
    dead = seeded.id("order:7")
    with client(seeded, auth=token_auth(token), allow_actions=True) as c:
        basic = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        done = c.post(
            f"/messages/{dead}/requeue", data={"reason": "r"}, headers={**SAME_SITE, "authorization": basic}
        )
        assert done.status_code == 200
    assert history_of(seeded.engine, dead)[-1].actor == f"dashboard:{user}"


def test_pause_and_resume_record_actor_and_reason(operator, seeded):
    paused = operator.post(
        "/queues/pause",
        data={"kind": "queue", "name": "billing", "reason": "vendor outage"},
        headers=SAME_SITE,
    )
    assert paused.status_code == 200 and 'data-state="paused"' in paused.text
    [pause] = ops.paused(seeded.engine)
    assert (pause.kind, pause.name, pause.actor, pause.reason) == (
        "queue",
        "billing",
        "dashboard",
        "vendor outage",
    )
    resumed = operator.post(
        "/queues/resume",
        data={"kind": "queue", "name": "billing", "reason": "vendor back"},
        headers=SAME_SITE,
    )
    assert resumed.status_code == 200 and ops.paused(seeded.engine) == []


def test_a_malformed_request_is_a_bad_request_and_a_refusal_by_state_a_conflict(operator, seeded):
    """400 says "fix what you sent"; 409 says "not in this state": a client retries only the second."""
    malformed = operator.post(
        "/queues/pause",
        data={"kind": "queue", "name": "bill ing", "reason": "vendor outage"},
        headers=SAME_SITE,
    )
    assert malformed.status_code == 400
    assert "must not contain whitespace" in text_of(malformed.text)
    not_paused = operator.post(
        "/queues/resume", data={"kind": "queue", "name": "billing", "reason": "r"}, headers=SAME_SITE
    )
    assert not_paused.status_code == 409
    assert ops.paused(seeded.engine) == []


def test_read_only_by_default_and_actions_need_post(reader, seeded):
    dead = seeded.id("order:7")
    refused = reader.post(f"/messages/{dead}/requeue", data={"reason": "x"}, headers=SAME_SITE)
    assert refused.status_code == 403 and "read-only" in refused.text
    assert reader.get(f"/messages/{dead}/requeue").status_code == 405
    assert '<form method="post"' not in reader.get(f"/messages/{dead}").text
    assert statuses(seeded.engine)["order:7"] == "dead"


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://evil.example"},
        {"sec-fetch-site": "cross-site", "origin": "http://evil.example"},
        {"sec-fetch-site": "same-site"},
        {"origin": "null"},
        {},
    ],
)
def test_cross_site_posts_are_refused(operator, seeded, headers):
    response = operator.post(
        f"/messages/{seeded.id('order:7')}/discard", data={"reason": "x"}, headers=headers
    )
    assert response.status_code == 403 and "refused" in response.text
    assert statuses(seeded.engine)["order:7"] == "dead"


def test_a_same_origin_fetch_site_is_enough_even_with_origin_null(operator, seeded):
    # A privacy setting or extension that blanks the referrer makes Chromium send Origin "null".
    mid = seeded.id("order:8")
    own_form = {"sec-fetch-site": "same-origin", "origin": "null"}
    done = operator.post(f"/messages/{mid}/discard", data={"reason": "duplicate"}, headers=own_form)
    assert done.status_code == 200
    assert statuses(seeded.engine)["order:8"] == "discarded"


def test_auth_decides_per_request_and_per_action(seeded):
    asked: list[str] = []

    def auth(request, action):
        asked.append(action)
        return request.headers.get("x-user") == "ops" and action != "discard"

    with client(seeded, auth=auth, allow_actions=True) as c:
        denied = c.get("/")
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Basic")
        assert c.get("/", headers={"x-user": "ops"}).status_code == 200
        mid = seeded.id("order:7")
        no = c.post(f"/messages/{mid}/discard", data={"reason": "x"}, headers={**SAME_SITE, "x-user": "ops"})
        assert no.status_code == 403
        assert asked[-1] == "discard"
        assert statuses(seeded.engine)["order:7"] == "dead"


def test_token_auth_accepts_basic_and_bearer_and_names_the_actor(seeded):
    token = "s3cret-token-0123456789"
    with client(seeded, auth=token_auth(token), allow_actions=True) as c:
        assert c.get("/").status_code == 401
        assert c.get("/", headers={"authorization": "Bearer nope"}).status_code == 401
        assert c.get("/", headers={"authorization": f"Bearer {token}"}).status_code == 200
        basic = "Basic " + base64.b64encode(f"alice:{token}".encode()).decode()
        mid = seeded.id("order:8")
        done = c.post(
            f"/messages/{mid}/discard",
            data={"reason": "duplicate order"},
            headers={**SAME_SITE, "authorization": basic},
        )
        assert done.status_code == 200 and token not in done.text
    assert history_of(seeded.engine, mid)[-1].actor == "dashboard:alice"


def test_host_header_must_be_allowed(seeded):
    with client(seeded, allowed_hosts=["127.0.0.1", "localhost", "OPS.example.com", "::1"]) as c:
        assert c.get("/", headers={"host": "evil.example"}).status_code == 421
        assert c.get("/", headers={"host": "localhost:8765"}).status_code == 200
        for listed in ("ops.example.com", "Ops.Example.Com:8443", "[::1]:8765"):
            assert c.get("/", headers={"host": listed}).status_code == 200, listed
        for near_miss in ("sub.ops.example.com", "ops.example.com.evil.example", "ops.example", "[::2]:8765"):
            assert c.get("/", headers={"host": near_miss}).status_code == 421, near_miss


@pytest.mark.parametrize(
    ("hosts", "problem"),
    [
        (["ops.example.com:443"], "has a port: give the host name alone"),
        (["https://ops.example.com"], "is a URL"),
        (["*.example.com"], "wildcards are not supported"),
        ([""], "a host name is empty"),
        (["ops example"], "is not a host name"),
        ("ops.example.com", "allowed_hosts is a list of host names"),  # would be read letter by letter
    ],
)
def test_allowed_hosts_no_host_header_could_match_are_refused_at_once(hosts, problem):
    with pytest.raises(ValueError, match=problem):
        create_app("sqlite://", allowed_hosts=hosts)


@pytest.mark.parametrize("levels", [600, 5000])
def test_a_message_nested_however_deeply_gets_its_page(engine, levels):
    """Rows from before emit() capped nesting, or from other writers, once answered 500."""
    mid = insert_nested_message(engine, levels)
    with Client(create_app(engine)) as reader:
        response = reader.get(f"/messages/{mid}")
    assert response.status_code == 200, response.text
    assert "hunter2" not in response.text
    payload, headers = re.findall(r'<pre class="json"[^>]*>(.*?)</pre>', response.text, re.S)
    assert_cut_at_depth_shown(json.loads(html_text.unescape(payload)), levels)
    assert_cut_at_depth_shown(json.loads(html_text.unescape(headers)), levels)
    assert json.dumps(TOO_DEEP) in html_text.unescape(response.text)  # the history row's detail


def test_hostile_text_renders_inert(operator, seeded):
    hostile = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    with seeded.maker.begin() as s:
        outbox.emit(s, "user.signed_up", {"user_id": 3, "name": hostile}, key="signup:" + hostile)
    mid = max(ops.candidate_ids(seeded.engine, ops.MessageFilter(handler="welcome_email"), "discard"))
    for path in (f"/messages/{mid}", "/messages?key=" + hostile.replace("&", "%26").replace("#", "%23")):
        html = operator.get(path).text
        assert "<script>alert" not in html and "<img src=x" not in html
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_counts_are_shared_reads_refreshed_within_their_age(seeded):
    def delivered_and_pending(c: Client) -> tuple[int, int]:
        html = c.get("/").text
        found = [re.search(rf'data-count="{s}">([\d,]+)<', html) for s in ("delivered", "pending")]
        assert found[0] is not None and found[1] is not None
        return int(found[0].group(1)), int(found[1].group(1))

    with client(seeded, finished_max_age=0.3) as c:
        read_before = time.monotonic()
        assert delivered_and_pending(c) == (2, 1)
        with seeded.maker.begin() as s:
            outbox.emit(s, "user.signed_up", {"user_id": 3}, key="signup:3")
        pending = delivered_and_pending(c)[1]
        # Pending: the shared read, while it is younger than a second. A host too loaded to get
        # here within that second has seen it expire, which the next step checks anyway.
        if time.monotonic() - read_before < 1.0:
            assert pending == 1
        time.sleep(1.1)
        assert delivered_and_pending(c) == (2, 2)  # older than a second: read again
        seeded.deliver("mail")
        deadline = time.monotonic() + 10
        while delivered_and_pending(c)[0] != 3:  # delivered: refreshed in the background
            assert time.monotonic() < deadline, "the delivered total was never refreshed"
            time.sleep(0.1)


def test_mounted_under_a_path_every_link_and_form_stays_under_it(seeded):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    host = Starlette(routes=[Mount("/ops/outbox", app=create_app(seeded.engine, allow_actions=True))])
    with Client(host) as c:
        html = c.get("/ops/outbox/dead").text
        links = re.findall(r'(?:href|action|formaction|src|data-live-source)="(/[^"]*)"', html)
        assert links and all(link.startswith("/ops/outbox/") for link in links), links
        mid = seeded.id("order:7")
        done = c.post(f"/ops/outbox/messages/{mid}/requeue", data={"reason": "mounted"}, headers=SAME_SITE)
        assert done.status_code == 200 and str(done.url).startswith(f"{ORIGIN}/ops/outbox/messages/")
        assert c.get("/ops/outbox/static/dashboard.js").status_code == 200


def test_retry_now_pulls_a_waiting_message_forward_and_records_it(operator, seeded):
    with seeded.maker.begin() as s:
        outbox.emit(s, "user.signed_up", {"user_id": 4}, key="signup:4", delay=3600)
    [waiting] = test_ops_cli.ids_where(seeded.engine, m.c.idempotency_key == "signup:4")
    done = operator.post(
        f"/messages/{waiting}/retry", data={"reason": "customer is waiting"}, headers=SAME_SITE
    )
    assert done.status_code == 200
    last = history_of(seeded.engine, waiting)[-1]
    assert (last.outcome, last.actor, last.reason) == ("retried_now", "dashboard", "customer is waiting")
    again = operator.post(f"/messages/{waiting}/retry", data={"reason": "twice"}, headers=SAME_SITE)
    assert again.status_code == 409  # due now: nothing to pull forward, said on a page of its own


def test_report_runs_and_a_run_with_a_failed_chunk(reader, seeded, tmp_path):
    from test_dashboard_browser import seed_report_runs

    seed_report_runs(seeded, tmp_path / "reports")
    runs = {r.report: r for r in ops.report_runs(seeded.engine)}
    listing = text_of(reader.get("/reports").text)
    assert "sales" in listing and "stock" in listing and "complete" in listing and "failed" in listing
    failed = reader.get(f"/reports/{runs['sales'].id}").text
    assert "warehouse lost chunk 1" in failed and re.search(r'href="/messages/\d+">#\d+', failed)
    assert reader.get("/reports/no-such-run").status_code == 404


def test_bulk_discard_by_selection(operator, seeded):
    mid = seeded.id("order:8")
    ask = operator.post("/dead/discard", data={"id": [str(mid)], "reason": "duplicate"}, headers=SAME_SITE)
    assert "Discard 1 dead message?" in text_of(ask.text)
    confirm = dict(re.findall(r'name="(expected_ids|confirm|reason)" value="([^"]*)"', ask.text))
    done = operator.post("/dead/discard", data={**confirm, "id": [str(mid)]}, headers=SAME_SITE)
    assert "1 message discarded" in text_of(done.text)
    assert statuses(seeded.engine)["order:8"] == "discarded"


def test_resend_from_a_finished_messages_page_lands_on_the_copy(operator, seeded):
    delivered, dead = seeded.id("signup:2"), seeded.id("order:7")
    form = f'action="/messages/{delivered}/resend"'
    assert form in operator.get(f"/messages/{delivered}").text
    assert "/resend" in operator.get(f"/messages/{seeded.id('report:2026-11')}").text, "discarded too"
    for label in ("order:7", "report:2026-09", "report:2026-10"):  # dead, running, pending: no button
        assert "/resend" not in operator.get(f"/messages/{seeded.id(label)}").text, label

    response = operator.post(
        f"/messages/{delivered}/resend", data={"reason": "the user lost the mail"}, headers=SAME_SITE
    )
    assert response.status_code == 200  # followed the 303 to the copy
    copy = int(str(response.url).rsplit("/", 1)[1])
    assert f"Resent from #{delivered}" in text_of(response.text).replace(" .", ".")
    original_page = operator.get(f"/messages/{delivered}").text
    assert f"Resent as #{copy}" in text_of(original_page)
    assert f'as <a href="/messages/{copy}">#{copy}</a>' in original_page, "the timeline row links the copy"
    last = history_of(seeded.engine, delivered)[-1]
    assert (last.outcome, last.actor, last.reason) == ("resent", "dashboard", "the user lost the mail")
    assert last.detail["new_id"] == copy
    seeded.deliver("mail")
    with seeded.engine.connect() as conn:
        copied = conn.execute(select(m).where(m.c.id == copy)).one()
        original = conn.execute(select(m).where(m.c.id == delivered)).one()
    assert (copied.status, copied.event_id, original.status) == ("delivered", original.event_id, "delivered")

    refused = operator.post(f"/messages/{dead}/resend", data={"reason": "r"}, headers=SAME_SITE)
    assert refused.status_code == 409 and "a dead message is requeued, not resent" in text_of(refused.text)
    no_reason = operator.post(f"/messages/{delivered}/resend", data={"reason": " "}, headers=SAME_SITE)
    assert no_reason.status_code == 400 and "a reason is required" in no_reason.text


def test_resend_is_a_permission_of_its_own_behind_the_same_checks(seeded):
    delivered = seeded.id("signup:2")
    path, form = f"/messages/{delivered}/resend", {"reason": "x"}
    before = test_ops_cli.snapshot(seeded.engine)
    with client(seeded) as reader:
        assert reader.post(path, data=form, headers=SAME_SITE).status_code == 403
        assert reader.get(path).status_code == 405
        assert "/resend" not in reader.get(f"/messages/{delivered}").text
    with client(seeded, allow_actions=True) as operator:
        cross_site = {"sec-fetch-site": "cross-site", "origin": "http://evil.example"}
        assert operator.post(path, data=form, headers=cross_site).status_code == 403
    asked: list[str] = []

    def auth(request: Any, action: str) -> bool:
        asked.append(action)
        return action != "resend"

    with client(seeded, auth=auth, allow_actions=True) as limited:
        no = limited.post(path, data=form, headers=SAME_SITE)
        assert no.status_code == 403 and "You may not resend here." in no.text
        assert asked[-1] == "resend"
    assert test_ops_cli.snapshot(seeded.engine) == before, "nothing was resent"
