"""The dashboard in a real browser: Chromium driven by Playwright against a real uvicorn server.

What a person sees and does: live counts over server-sent events, the filter
form and its bookmark, a dead message's timeline, a bulk requeue with its
confirmation, pause and resume, an inbox dead letter requeued and then
handled by its consumer, hostile text that stays text, a cross-site form that
is refused. Every page is also checked for console errors, where a
Content-Security-Policy violation (an inline script or style that slipped in)
would show.

Chromium is Debian's (``apt install chromium``), found on the PATH: these
tests fail rather than skip without it, since CI installs it. Screenshots of
every page go to each test's tmp_path and, when ``OUTBOX_SCREENSHOTS`` names a
directory, there too (docs/images is made that way).

Every test runs on SQLite and PostgreSQL: the whole file takes about 40 s on
two cores, most of it the browser's page loads.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import pytest
import test_ops_cli
from playwright.sync_api import ConsoleMessage, Page, Response, expect, sync_playwright
from relayproc import wait_until
from sqlalchemy.orm import Session
from test_dashboard_serve import Served
from test_ops_cli import Seeded, history_of, statuses

from outbox import Inbox, InboxMessage, PermanentError, emit, ops
from outbox.integrations.report import ReportJob
from outbox.relay import Relay

seeded = test_ops_cli.seeded  # the seven messages: 2 delivered, 2 dead, 1 running, 1 pending, 1 discarded

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 800}
WAIT_MS = 10_000  # generous: two shared cores, a relay and a browser
SCREENSHOTS_ENV = "OUTBOX_SCREENSHOTS"
expect.set_options(timeout=WAIT_MS)


T = TypeVar("T")


def in_thread(work: Callable[[], T]) -> T:
    """Run asyncio code (a relay) while Playwright drives the page.

    Playwright's sync API keeps its own event loop marked as running in the
    test's thread, so ``asyncio.run`` (a relay's ``run_until_idle``) must run
    in another thread.
    """
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    if errors:
        raise errors[0]
    assert result, "the work did not finish within 120 s"
    return result[0]


def chromium_path() -> str:
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(
            "chromium is not on the PATH: the browser tests need it (Debian: apt-get install chromium); "
            "`playwright install` is not used"
        )
    return executable


@dataclass
class Dashboard:
    base: str
    served: Served

    def url(self, path: str) -> str:
        return self.base + path


@pytest.fixture
def dashboard(seeded: Seeded) -> Iterator[Callable[..., Dashboard]]:
    """Serve the dashboard over the seeded database: ``dashboard(allow_actions=True)``.

    Stopped after the page closes (``page`` depends on this fixture): uvicorn waits for open
    responses, and a page's event stream never ends on its own.
    """
    running: list[Served] = []

    def start(**options: Any) -> Dashboard:
        served = Served(seeded.engine, **{"poll_interval": 0.2, **options})
        base = served.__enter__()
        running.append(served)
        return Dashboard(base, served)

    yield start
    for served in running:
        served.__exit__(None, None, None)


@pytest.fixture
def console() -> list[str]:
    """Console errors and uncaught exceptions of every page of the test, CSP violations included."""
    return []


@pytest.fixture
def page(dashboard: Callable[..., Dashboard], console: list[str]) -> Iterator[Page]:
    """A fresh browser per test, started after the database is seeded (seeding runs asyncio here)."""
    executable = chromium_path()  # first: a started Playwright left running breaks asyncio.run() after it
    playwright = sync_playwright().start()
    browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    context.set_default_timeout(WAIT_MS)

    def watch(tab: Page) -> None:
        def on_console(msg: ConsoleMessage) -> None:
            if msg.type == "error":
                console.append(f"{tab.url}: {msg.text}")

        def on_response(response: Response) -> None:
            if response.status >= 400:  # the console says "Failed to load resource" without the URL
                console.append(f"{tab.url}: {response.request.method} {response.url} {response.status}")

        tab.on("console", on_console)
        tab.on("response", on_response)
        tab.on("pageerror", lambda exc: console.append(f"{tab.url}: uncaught {exc}"))

    context.on("page", watch)
    tab = context.new_page()
    try:
        yield tab
    finally:
        context.close()
        browser.close()
        playwright.stop()


def dead_ids(seeded: Seeded) -> tuple[int, int]:
    return seeded.id("order:7"), seeded.id("order:8")


def row_ids(page: Page) -> list[str]:
    return page.locator("table.messages tbody td.num a").all_inner_texts()


def test_overview_counts_move_live_without_a_reload(page, dashboard, seeded, console):
    dash = dashboard()
    page.goto(dash.url("/"))
    pending = page.locator('[data-count="pending"]')
    expect(pending).to_have_text("1")
    page.evaluate("window.__same_page = true")  # gone if the page reloads
    feed = dash.served.app.state.outbox.feed
    deadline = time.monotonic() + 10
    while not feed.watching and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.watching, "the page never subscribed to /events"
    time.sleep(0.5)  # the watcher reads its first marker; an emit before that would be the baseline

    with seeded.maker.begin() as s:
        emit(s, "user.signed_up", {"user_id": 3}, key="signup:3")

    expect(pending).to_have_text("2")
    assert page.evaluate("window.__same_page") is True
    expect(page.locator('[data-count="dead"]')).to_have_text("2")
    assert console == []


def test_filter_form_and_its_bookmark_show_the_same_rows(page, dashboard, seeded, console):
    dash = dashboard()
    page.goto(dash.url("/messages"))
    expect(page.locator("table.messages tbody tr")).to_have_count(7)
    page.get_by_label("Queue").fill("billing")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**/messages?*queue=billing*")

    expect(page.locator(".count")).to_have_text("2 matching.")
    rows = page.locator("table.messages tbody tr")
    expect(rows).to_have_count(2)
    for row in rows.all():
        expect(row).to_contain_text("billing")
        expect(row).to_contain_text("invoice")
    shown = row_ids(page)
    assert sorted(shown) == sorted(f"#{i}" for i in dead_ids(seeded))

    href = page.locator("a[data-bookmark]").get_attribute("href")
    assert href == "/messages?queue=billing"  # empty fields are left out of the saved query
    again = page.context.new_page()
    again.goto(dash.url(href))
    expect(again.get_by_label("Queue")).to_have_value("billing")
    expect(again.locator("table.messages tbody tr")).to_have_count(2)
    assert row_ids(again) == shown
    assert console == []


def test_a_dead_messages_timeline_reads_failed_then_dead(page, dashboard, seeded, console):
    dash = dashboard()
    dead = seeded.id("order:7")
    page.goto(dash.url("/messages"))
    page.get_by_role("link", name=f"#{dead}", exact=True).click()
    expect(page.locator("h1")).to_have_text(f"Message #{dead} dead")
    steps = page.locator("table.timeline tbody tr")
    expect(steps).to_have_count(2)
    expect(steps.locator(".badge")).to_have_text(["failed", "dead"])
    expect(steps.nth(0)).to_contain_text("ConnectionError")
    expect(steps.nth(0)).to_contain_text("billing API unreachable")
    expect(steps.nth(1)).to_contain_text("order 7 is unknown to billing")
    expect(page.locator("dl.facts")).to_contain_text("order 7 is unknown to billing")
    payload = page.locator("pre[data-payload]")
    expect(payload).to_contain_text('"order_id": 7')
    expect(payload).not_to_contain_text("sk_live_42")  # the api_key is masked
    assert console == []


def test_requeue_from_dead_letters_then_the_copy_delivers(page, dashboard, seeded, console):
    dash = dashboard(allow_actions=True)
    dead = seeded.id("order:7")
    page.goto(dash.url("/dead"))
    expect(page.locator("table.messages tbody tr")).to_have_count(2)
    page.get_by_label(f"select #{dead}").check()
    page.locator("#bulk").get_by_label("Reason").fill("billing API is back")
    page.get_by_role("button", name="Requeue…").click()

    confirm = page.locator("[data-confirm-count]")
    expect(page.locator("h1")).to_have_text("Requeue 1 dead message?")
    expect(confirm).to_have_attribute("data-confirm-count", "1")
    expect(page.locator("q")).to_have_text("billing API is back")
    assert statuses(seeded.engine)["order:7"] == "dead"  # nothing happens before the confirmation
    confirm.click()

    expect(page.locator("h1")).to_have_text("1 message requeued")
    links = page.locator("ul.done a")
    expect(links.first).to_have_text(f"#{dead}")
    links.nth(1).click()
    copy = int(page.url.rsplit("/", 1)[1])
    expect(page.locator("h1")).to_have_text(f"Message #{copy} pending")
    expect(page.get_by_text(f"Requeued from #{dead}")).to_be_visible()
    last = history_of(seeded.engine, dead)[-1]
    assert (last.outcome, last.actor, last.reason) == ("requeued", "dashboard", "billing API is back")

    seeded.billing_fixed[0] = True
    in_thread(Relay(seeded.ob, seeded.engine, queues=["billing"]).run_until_idle)
    page.reload()
    expect(page.locator("h1")).to_have_text(f"Message #{copy} delivered")
    expect(page.locator("table.timeline .badge")).to_have_text(["delivered"])
    assert statuses(seeded.engine)["order:8"] == "dead"  # not selected, not touched
    assert console == []


def inbox_dead_letters(seeded: Seeded) -> tuple[Inbox, dict[str, bool], int]:
    """Two consumers' dead letters, made by real inboxes; billing's handler works once ``fixed``."""
    billing = Inbox("billing")
    state = {"fixed": False}

    @billing.handler("order.paid", name="bill")
    def bill(session: Session, message: InboxMessage) -> None:
        if not state["fixed"]:
            raise PermanentError(f"customer of order {message.payload['order']} unknown")

    paid = InboxMessage(
        "evt-7", "order.paid", {"order": 7, "card_token": "tok_live_1"}, source="rabbitmq:orders"
    )
    result = billing.process(seeded.engine, paid)
    assert result.dead_letter_id is not None
    shipping = Inbox("shipping")
    assert (
        shipping.process(seeded.engine, InboxMessage("evt-9", "parcel.lost", {"parcel": 9})).outcome == "dead"
    )
    return billing, state, result.dead_letter_id


def test_requeue_an_inbox_dead_letter_then_its_consumer_handles_it(page, dashboard, seeded, console):
    billing, state, dead_id = inbox_dead_letters(seeded)
    dash = dashboard(allow_actions=True)
    page.goto(dash.url("/"))
    page.get_by_role("link", name="Inbox", exact=True).click()
    rows = page.locator("table.inbox tbody tr")
    expect(rows).to_have_count(2)
    page.get_by_label("Consumer").fill("billing")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**/inbox?consumer=billing*")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("customer of order 7 unknown")
    expect(rows.first.locator("[data-payload-preview]")).not_to_contain_text("tok_live_1")

    page.get_by_role("link", name=f"#{dead_id}", exact=True).click()
    expect(page.locator("h1")).to_have_text(f"Dead letter #{dead_id} dead")
    payload = page.locator("pre[data-payload]")
    expect(payload).to_contain_text('"order": 7')
    expect(payload).not_to_contain_text("tok_live_1")  # masked, as `outbox inbox dead --json` masks it
    page.get_by_label("Reason").fill("customer 7 imported")
    page.get_by_role("button", name="Requeue").click()

    expect(page.locator("h1")).to_have_text(f"Dead letter #{dead_id} requeued")
    expect(page.locator("[data-requeued]")).to_contain_text("by dashboard")
    expect(page.locator("[data-requeued]")).to_contain_text("customer 7 imported")
    expect(page.locator("[data-waiting]")).to_be_visible()
    expect(page.get_by_role("button", name="Requeue")).to_have_count(0)
    [letter] = ops.inbox_dead_letters(seeded.engine, status="requeued")
    assert (letter.id, letter.actor, letter.reason) == (dead_id, "dashboard", "customer 7 imported")

    state["fixed"] = True
    assert [r.outcome for r in billing.process_requeued(seeded.engine)] == ["handled"]
    page.reload()
    expect(page.locator("h1")).to_have_text(f"Dead letter #{dead_id} handled")
    page.goto(dash.url("/inbox?status=handled"))
    expect(rows).to_have_count(1)
    assert console == []


def test_pause_and_resume_a_queue(page, dashboard, seeded, console):
    dash = dashboard(allow_actions=True)
    page.goto(dash.url("/queues"))
    billing = page.locator('tr[data-queue="billing"]')
    expect(billing.locator("[data-state]")).to_have_attribute("data-state", "running")
    billing.get_by_placeholder("reason").fill("vendor outage")
    billing.get_by_role("button", name="Pause").click()

    state = page.locator('tr[data-queue="billing"] [data-state]')
    expect(state).to_have_attribute("data-state", "paused")
    expect(state).to_have_text("paused")
    expect(page.locator('tr[data-queue="billing"]')).to_contain_text("by dashboard: vendor outage")
    expect(page.locator('tr[data-queue="mail"] [data-state]')).to_have_text("running")
    [pause] = ops.paused(seeded.engine)
    assert (pause.kind, pause.name, pause.reason) == ("queue", "billing", "vendor outage")

    page.locator('tr[data-queue="billing"]').get_by_placeholder("reason").fill("vendor is back")
    page.locator('tr[data-queue="billing"]').get_by_role("button", name="Resume").click()
    expect(page.locator('tr[data-queue="billing"] [data-state]')).to_have_attribute("data-state", "running")
    expect(page.locator('tr[data-queue="billing"] [data-state]')).to_have_text("running")
    assert ops.paused(seeded.engine) == []
    assert console == []


def test_a_live_update_keeps_a_reason_being_typed_then_catches_up(page, dashboard, seeded, console):
    """A change elsewhere must not wipe the form an operator is filling in; the page catches up after."""
    dash = dashboard(allow_actions=True)
    page.goto(dash.url("/queues"))
    page.evaluate(
        "window.__refreshed = []; document.addEventListener('outbox:refreshed',"
        " function (e) { window.__refreshed.push(!!(e.detail && e.detail.held)); })"
    )
    reason = page.locator('tr[data-queue="billing"]').get_by_placeholder("reason")
    reason.fill("vendor outage, per the status page")
    ops.pause(seeded.engine, queue="mail", reason="elsewhere", actor="cli")  # the live feed announces it

    # The page's CSP rules out Playwright's wait_for_function.
    refreshed = wait_until(lambda: page.evaluate("window.__refreshed.slice()"), "a live update", timeout=10)
    assert all(refreshed), "a live update redrew the form being filled in"
    expect(reason).to_have_value("vendor outage, per the status page")
    expect(page.locator('tr[data-queue="mail"] [data-state]')).to_have_text("running")  # held, not redrawn

    reason.fill("")
    reason.blur()
    expect(page.locator('tr[data-queue="mail"] [data-state]')).to_have_text("paused")
    assert console == []


SCRIPT = "<script>window.__xss=1</script>"
ATTRIBUTE = '"><img src=x onerror="window.__xss=2">'


def test_hostile_payload_and_key_render_as_text(page, dashboard, seeded, console):
    dash = dashboard(allow_actions=True)
    hostile = SCRIPT + ATTRIBUTE
    with seeded.maker.begin() as s:
        emit(s, "user.signed_up", {"user_id": 3, "name": hostile, "bio": ATTRIBUTE}, key=hostile)
    mid = max(ops.candidate_ids(seeded.engine, ops.MessageFilter(handler="welcome_email"), "discard"))

    page.goto(dash.url(f"/messages/{mid}"))
    expect(page.locator("h1")).to_have_text(f"Message #{mid} pending")
    expect(page.locator("dl.facts code").filter(has_text="window.__xss=1")).to_have_text(hostile)
    payload = page.locator("pre[data-payload]")
    expect(payload).to_contain_text(SCRIPT)
    expect(payload).to_contain_text('"bio": "\\"><img src=x onerror=\\"window.__xss=2\\">"')
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__xss") is None

    page.goto(dash.url("/messages?" + urlencode({"key": hostile})))
    expect(page.get_by_label("Idempotency key")).to_have_value(hostile)
    expect(page.locator("table.messages tbody tr")).to_have_count(1)
    expect(page.get_by_role("link", name=f"#{mid}", exact=True)).to_be_visible()
    expect(page.locator("a[data-bookmark]")).to_contain_text("key=%3Cscript%3E")
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__xss") is None
    assert console == []


class HostileSite:
    """Another origin on 127.0.0.1: a page whose own script file submits a form to the dashboard."""

    def __init__(self, target: str) -> None:
        page = (
            "<!doctype html><title>Win a prize</title>"
            f'<form id="f" method="post" action="{target}">'
            '<input name="reason" value="pwned"></form>'
            '<script src="/submit.js"></script>'
        ).encode()
        script = b'document.getElementById("f").submit();'

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                body, kind = (script, "text/javascript") if self.path == "/submit.js" else (page, "text/html")
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def test_a_cross_site_form_post_is_refused(page, dashboard, seeded):
    dash = dashboard(allow_actions=True)
    dead = seeded.id("order:7")
    target = dash.url(f"/messages/{dead}/discard")
    with HostileSite(target) as hostile:
        assert hostile != dash.base + "/"
        with page.expect_response(target) as answer:
            page.goto(hostile)
        assert answer.value.status == 403
        assert answer.value.request.method == "POST"
        expect(page).to_have_url(target)
        expect(page.locator("h1")).to_have_text("Refused")
        expect(page.locator(".problem")).to_contain_text("cross-site request refused")
    assert statuses(seeded.engine)["order:7"] == "dead"
    assert history_of(seeded.engine, dead)[-1].outcome == "dead"


# -- screenshots -----------------------------------------------------------------------------------------


REPORT_ROWS = [[n, f"r{n % 3}"] for n in range(10)]


def seed_report_runs(seeded: Seeded, folder: Path) -> None:
    """Two runs by a real ReportJob and relay: one complete, one failed on a lost chunk."""

    def job(name: str, broken: set[int]) -> ReportJob:
        def rows(session: Session, params: dict[str, Any], offset: int, limit: int) -> list[list[Any]]:
            if offset // limit in broken:
                raise PermanentError(f"warehouse lost chunk {offset // limit}")
            return REPORT_ROWS[offset : offset + limit]

        return ReportJob(
            seeded.ob,
            name,
            engine=seeded.engine,
            header=["n", "region"],
            count=lambda session, params: len(REPORT_ROWS),
            rows=rows,
            output_dir=folder,
            chunk_size=4,
            queue="exports",
        )

    sales, stock = job("sales", broken={1}), job("stock", broken=set())
    with seeded.maker.begin() as s:
        sales.start(s, {"month": "2026-11"})
        stock.start(s)
    for _ in range(50):
        in_thread(Relay(seeded.ob, seeded.engine, queues=["exports"]).run_until_idle)
        if {r.status for r in ops.report_runs(seeded.engine)} == {"complete", "failed"}:
            return
        time.sleep(0.01)
    raise AssertionError("the report runs did not finish")


def shoot(page: Page, folder: Path, name: str) -> None:
    path = folder / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000
    wanted = os.environ.get(SCREENSHOTS_ENV)
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(wanted) / path.name)


def test_screenshots_of_every_page(page, dashboard, seeded, console, tmp_path):
    seed_report_runs(seeded, tmp_path / "reports")
    dash = dashboard(allow_actions=True)
    dead = seeded.id("order:7")

    page.goto(dash.url("/"))
    expect(page.locator('[data-count="dead"]')).to_have_text("3")  # order:7, order:8, the lost chunk
    # What an on-call engineer must act on leads the cards.
    expect(page.locator(".cards .card").first).to_contain_text("dead, needing a decision")
    shoot(page, tmp_path, "overview")

    page.goto(dash.url("/messages"))
    page.get_by_label("Queue").fill("billing")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("table.messages tbody tr")).to_have_count(2)
    shoot(page, tmp_path, "messages")

    page.goto(dash.url(f"/messages/{dead}"))
    expect(page.locator("table.timeline tbody tr")).to_have_count(2)
    shoot(page, tmp_path, "message")

    page.goto(dash.url("/dead"))
    page.get_by_label(f"select #{dead}").check()
    page.locator("#bulk").get_by_label("Reason").fill("billing API is back")
    shoot(page, tmp_path, "dead")

    page.get_by_label("all matching the filter").check()
    page.get_by_role("button", name="Requeue…").click()
    expect(page.locator("[data-confirm-count]")).to_have_attribute("data-confirm-count", "3")
    shoot(page, tmp_path, "confirm")

    page.goto(dash.url("/queues"))
    billing = page.locator('tr[data-queue="billing"]')
    billing.get_by_placeholder("reason").fill("vendor outage, INC-4211")
    billing.get_by_role("button", name="Pause").click()
    expect(page.locator('tr[data-queue="billing"] [data-state]')).to_have_text("paused")
    shoot(page, tmp_path, "queues")

    page.goto(dash.url("/reports"))
    expect(page.locator("#report-runs tbody tr")).to_have_count(2)
    expect(page.locator("#report-runs")).to_contain_text("failed")
    shoot(page, tmp_path, "reports")

    inbox_dead_letters(seeded)
    page.goto(dash.url("/inbox"))
    expect(page.locator("table.inbox tbody tr")).to_have_count(2)
    shoot(page, tmp_path, "inbox")
    assert console == []


def test_the_pages_forms_post_with_their_real_origin(page, dashboard, seeded):
    """The referrer policy keeps Origin a real origin, so browsers without Sec-Fetch-Site can act too."""
    dash = dashboard(allow_actions=True)
    sent: list[dict[str, str]] = []
    page.on("request", lambda r: sent.append(r.headers) if r.method == "POST" else None)
    page.goto(dash.url(f"/messages/{seeded.id('order:8')}"))
    page.fill("form[action$='/discard'] input[name=reason]", "duplicate order")
    page.click("form[action$='/discard'] button")
    expect(page.locator("h1")).to_contain_text("discarded")
    assert sent and sent[0].get("origin") == dash.base


def test_a_long_list_fetches_its_count_after_the_page(page, dashboard, seeded, console):
    dash = dashboard(page_size=2)
    page.goto(dash.url("/messages"))
    expect(page.locator("[data-count=matching]")).to_have_text("7 matching.")
    assert len(row_ids(page)) == 2
    assert console == []
