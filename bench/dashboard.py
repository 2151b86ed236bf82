"""Mode 7: the dashboard's pages on a big table, served in-process through httpx.

A scratch database gets ``messages`` messages (1,000,000 in a full run) and
about three history rows each, written by set-based SQL (``INSERT ... SELECT
FROM generate_series``), then ``VACUUM (ANALYZE)`` so the planner has
statistics and index-only scans see an all-visible table. The shape is a
mature outbox's: about 95 % delivered, a recent backlog of pending and running
messages, 1.5 % dead, 1 % discarded, 8 queues, 30 handlers (each on one
queue), 12 event types, order aggregates, idempotency keys, nested JSON
payloads, ``created_at`` spread over 30 days up to a few minutes ago, one
history row per attempt (retries, failures, timeouts, deaths, deliveries)
plus the operators' discard and requeue rows, and a requeue chain every
10,007 messages (a dead original, a dead copy, a delivered copy of the copy).

No trigger is disabled: on PostgreSQL the only INSERT trigger is the NOTIFY
one on ``outbox_message``, which is statement-level (one notification for the
whole fill); the append-only triggers on ``outbox_attempt`` refuse UPDATE,
DELETE and TRUNCATE, and the fill only inserts.

The app is ``outbox.dashboard.create_app(engine)`` with its defaults
(``finished_max_age`` 30 s, ``count_cap`` 10,000, 50 rows a page), called
through ``httpx.AsyncClient(transport=httpx.ASGITransport(app))`` in this
process: the figures are the app's and the database's, without a network or
a server process. The first overview is timed on its own (it waits for the
delivered and discarded totals once); then every page gets one warm-up
request and ``samples`` timed ones, one at a time. Each timed response must be
a 200 with the page's marker in it, and the warm-up and last response of each
page are checked against the database: the overview's counts, the list's
"N matching" and its row ids, the detail page's history rows and lineage.

The statements behind each page are captured from the engine during one
request and run again under ``EXPLAIN (ANALYZE, BUFFERS)``; the mode reports
which of them read a big table without an index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine

from outbox.dashboard import create_app

from .bulk import fill_session, vacuum_analyze
from .harness import Scratch, conninfo
from .verify import Unverified, percentile

__all__ = ["dashboard", "fill", "pages"]

#: A requeue chain starts at every multiple of this id: the original, then two copies.
CHAIN_EVERY = 10_007
#: The recent backlog: among the newest messages, about half are pending and a few running.
BACKLOG_WINDOW = 40_000
COUNT_CAP = 1_000  # create_app's default
PAGE_SIZE = 50

# One row per id. ``chain`` is 0 for a chain's original, 1 and 2 for its copies, -1 outside
# any chain; ``base`` is the original's id for a copy, else the row's own: a copy repeats its
# original's route, payload and event id.
_MESSAGES = """
INSERT INTO outbox_message (
    id, event_id, event_type, handler, queue, priority, payload, headers, aggregate_type,
    aggregate_id, idempotency_key, group_key, status, attempts, max_attempts, available_at,
    created_at, updated_at, locked_by, locked_until, delivered_at, last_error, requeued_from)
SELECT
    g,
    md5(base::text)::uuid,
    (ARRAY['order.created', 'order.paid', 'order.shipped', 'order.cancelled', 'invoice.issued',
           'invoice.paid', 'customer.registered', 'customer.updated', 'refund.requested',
           'refund.settled', 'stock.reserved', 'stock.released'])[1 + h %% 12],
    'h' || h,
    'q' || (h %% 8),
    h %% 3,
    jsonb_build_object(
        'order_id', base,
        'customer', jsonb_build_object(
            'id', abs(hashint8(base + 11)) %% 5000,
            'country', (ARRAY['DE', 'FR', 'NL', 'GB', 'US', 'PL'])[1 + abs(hashint8(base + 12)) %% 6],
            'tier', (ARRAY['free', 'pro', 'enterprise'])[1 + abs(hashint8(base + 13)) %% 3]),
        'items', jsonb_build_array(
            jsonb_build_object('sku', 'SKU-' || (base %% 977), 'qty', 1 + base %% 3,
                               'price', (abs(hashint8(base + 14)) %% 10000) / 100.0),
            jsonb_build_object('sku', 'SKU-' || (base %% 131), 'qty', 1,
                               'price', (abs(hashint8(base + 15)) %% 5000) / 100.0)),
        'total', (abs(hashint8(base + 16)) %% 20000) / 100.0,
        'currency', 'EUR',
        'placed_at', created_at),
    jsonb_build_object('traceparent', '00-' || md5(g::text) || '-' || left(md5(base::text), 16) || '-01'),
    'order',
    (base / 4)::text,
    CASE WHEN chain <= 0 THEN 'order-' || base
         WHEN chain = 1 THEN 'order-' || base || '~requeue:' || base
               ELSE 'order-' || base || '~requeue:' || base || '~requeue:' || (base + 1) END,
    CASE WHEN h %% 5 = 0 THEN 'customer-' || (abs(hashint8(base + 11)) %% 5000) END,
    status,
    attempts,
    5,
    CASE WHEN status = 'pending' AND attempts > 0 THEN now() + (attempts * interval '1 minute')
         ELSE created_at END,
    created_at,
    CASE WHEN status = 'delivered' THEN created_at + (attempts - 1) * interval '20 seconds'
                                        + interval '300 milliseconds'
         WHEN attempts > 0 THEN created_at + (attempts - 1) * interval '20 seconds'
                                + interval '300 milliseconds'
         ELSE created_at END,
    CASE WHEN status = 'running' THEN 'relay-' || (g %% 4) END,
    CASE WHEN status = 'running' THEN now() + interval '30 seconds' END,
    CASE WHEN status = 'delivered' THEN created_at + (attempts - 1) * interval '20 seconds'
                                        + interval '300 milliseconds' END,
    CASE WHEN status <> 'delivered' AND attempts > 0
         THEN 'ConnectionError: upstream returned 503 for order ' || base END,
    CASE WHEN chain > 0 THEN g - 1 END
FROM (
    SELECT g, base, chain, h,
           CASE WHEN chain IN (0, 1) THEN 'dead'
                WHEN chain = 2 THEN 'delivered'
                WHEN g > %(n)s - %(window)s AND r < 500 THEN 'pending'
                WHEN g > %(n)s - %(window)s AND r < 525 THEN 'running'
                WHEN r < 15 THEN 'dead'
                WHEN r < 25 THEN 'discarded'
                ELSE 'delivered' END AS status,
           CASE WHEN chain IN (0, 1) THEN 5
                WHEN chain = 2 THEN 1
                WHEN g > %(n)s - %(window)s AND r < 500 THEN r2 %% 3
                WHEN g > %(n)s - %(window)s AND r < 525 THEN 1 + r2 %% 3
                WHEN r < 15 THEN 5
                WHEN r < 25 THEN r2 %% 3
                ELSE 1 + r2 %% 5 END AS attempts,
           now() - interval '3 minutes' - (%(n)s - base) * (interval '30 days' / %(n)s)
               + greatest(chain, 0) * interval '10 minutes' AS created_at
    FROM (
        SELECT g, base, chain, abs(hashint8(base)) %% 30 AS h, abs(hashint8(base + 1)) %% 1000 AS r,
               abs(hashint8(g + 2)) %% 1000 AS r2
        FROM (
            SELECT g,
                   CASE WHEN g >= %(chain)s AND g %% %(chain)s <= 2 THEN g %% %(chain)s ELSE -1 END AS chain,
                   CASE WHEN g >= %(chain)s AND g %% %(chain)s <= 2 THEN g - g %% %(chain)s
                        ELSE g END AS base
            FROM generate_series(1, %(n)s::int) AS g
        ) AS ids
    ) AS hashed
) AS shaped
"""

# One history row per attempt a relay finished: a running message's current attempt has
# none yet. The last attempt of a delivered or dead message says so; the others failed.
_HISTORY = """
INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,
                            relay_id, error_type, error, detail)
SELECT m.id, n, o.outcome, o.started_at, o.started_at + o.duration_ms * interval '1 millisecond',
       o.duration_ms, 'relay-' || ((m.id + n) %% 4),
       CASE WHEN o.outcome NOT IN ('delivered') THEN
            (ARRAY['ConnectionError', 'HTTPError', 'TimeoutError'])[1 + (m.id + n) %% 3] END,
       CASE WHEN o.outcome NOT IN ('delivered') THEN 'upstream returned 503 for order ' || m.id END,
       CASE WHEN o.outcome = 'timeout' THEN jsonb_build_object('timeout_s', 30) END
FROM outbox_message AS m
CROSS JOIN LATERAL generate_series(1, m.attempts - (m.status = 'running')::int) AS n
CROSS JOIN LATERAL (
    SELECT CASE WHEN n = m.attempts AND m.status = 'delivered' THEN 'delivered'
                WHEN n = m.attempts AND m.status = 'dead' THEN 'dead'
                ELSE (ARRAY['retry', 'failed', 'timeout', 'retry'])[1 + (m.id + n) %% 4] END AS outcome,
           m.created_at + (n - 1) * interval '20 seconds' AS started_at,
           5 + abs(hashint8(m.id * 8 + n)) %% 250 AS duration_ms
) AS o
"""

# What operators did: a discard on each discarded message, a requeue on each requeued one.
_OPERATORS = """
INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,
                            actor, reason, detail)
SELECT m.id, m.attempts, o.outcome, o.at, o.at, 0, 'ops@example.com', o.reason,
       CASE WHEN o.outcome = 'requeued'
            THEN jsonb_build_object('new_id', c.id, 'previous_status', m.status)
            ELSE jsonb_build_object('previous_status', 'pending') END
FROM outbox_message AS m
LEFT JOIN outbox_message AS c ON c.requeued_from = m.id
CROSS JOIN LATERAL (
    SELECT CASE WHEN c.id IS NOT NULL THEN 'requeued' ELSE 'discarded' END AS outcome,
           coalesce(c.created_at, m.updated_at + interval '1 hour') AS at,
           CASE WHEN c.id IS NOT NULL THEN 'bench: upstream fixed, sending again'
                ELSE 'bench: order cancelled, nothing to send' END AS reason
) AS o
WHERE m.status = 'discarded' OR c.id IS NOT NULL
"""


@dataclass(slots=True)
class Filled:
    """What the fill wrote, read back with plain SQL: what the pages must show."""

    messages: int
    history: int
    by_status: dict[str, int]
    dead_requeued: int
    detail_id: int
    seconds: float
    chains: int


def fill(url: URL, messages: int) -> Filled:
    if messages < 3 * CHAIN_EVERY:
        raise ValueError(f"the dashboard mode needs at least {3 * CHAIN_EVERY} messages, got {messages}")
    began = time.monotonic()
    params = {"n": messages, "window": min(BACKLOG_WINDOW, messages // 4), "chain": CHAIN_EVERY}
    with fill_session(url) as conn:
        with conn.transaction():
            conn.execute(_MESSAGES, params)
            conn.execute(
                "SELECT setval(pg_get_serial_sequence('outbox_message', 'id'), %(n)s)", {"n": messages}
            )
        conn.execute(_HISTORY, {})
        conn.execute(_OPERATORS, {})
        vacuum_analyze(conn, "outbox_message", "outbox_attempt")
        seconds = time.monotonic() - began
        by_status = {
            str(s): int(n)
            for s, n in conn.execute("SELECT status, count(*) FROM outbox_message GROUP BY status").fetchall()
        }
        row = conn.execute(
            "SELECT count(*) FROM outbox_message AS m WHERE m.status = 'dead'"
            " AND EXISTS (SELECT 1 FROM outbox_message AS c WHERE c.requeued_from = m.id)"
        ).fetchone()
        dead_requeued = int(row[0]) if row else 0
        row = conn.execute("SELECT count(*) FROM outbox_attempt").fetchone()
        history = int(row[0]) if row else 0
    chains = messages // CHAIN_EVERY
    # The first copy of the middle chain: an original above it, a copy below it.
    detail_id = (chains // 2) * CHAIN_EVERY + 1
    return Filled(
        messages=sum(by_status.values()),
        history=history,
        by_status=by_status,
        dead_requeued=dead_requeued,
        detail_id=detail_id,
        seconds=seconds,
        chains=chains,
    )


# -- the pages ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Page:
    key: str  # names its JSON keys: dashboard_<key>_ms_p50 ...
    label: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    #: the list filter in plain SQL, for checking the page (list pages only)
    sql_where: str = ""

    @property
    def url(self) -> str:
        return f"{self.path}?{urlencode(self.params)}" if self.params else self.path


def pages(detail_id: int, now: datetime) -> list[Page]:
    since = (now - timedelta(days=7)).replace(microsecond=0).isoformat()
    listed = [
        Page("overview", "overview /", "/"),
        Page(
            "list_dead",
            "list ?status=dead&queue=q3",
            "/messages",
            (("status", "dead"), ("queue", "q3")),
            "status = 'dead' AND queue = 'q3'",
        ),
        Page(
            "list_handler",
            "list ?handler=h7&since=<7 days ago>",
            "/messages",
            (("handler", "h7"), ("since", since)),
            f"handler = 'h7' AND created_at >= '{since}'",
        ),
        Page(
            "list_payload",
            "list ?queue=q1&where=payload.customer.id=123",
            "/messages",
            (("queue", "q1"), ("where", "payload.customer.id=123")),
            "queue = 'q1' AND payload -> 'customer' -> 'id' = '123'::jsonb",
        ),
        Page("detail", f"detail /messages/{detail_id}", f"/messages/{detail_id}"),
    ]
    # Each list's count: its own request, which the list page's script makes after the page.
    counts = [
        Page(f"count_{p.key[5:]}", f"count {p.label[5:]}", "/messages/count", p.params, p.sql_where)
        for p in listed
        if p.key.startswith("list_")
    ]
    return listed + counts


#: What every timed response of a page must contain, cheaply checked.
#: The index a user adds for frequent payload filters (docs/dashboard.md), built after the other pages.
GIN_INDEX = "CREATE INDEX ix_outbox_message_payload ON outbox_message USING gin (payload jsonb_path_ops)"

_MARKERS = {
    "list_payload_gin": 'class="grid messages"',
    "count_payload_gin": 'data-count="matching"',
    "overview": 'data-count="pending"',
    "list_dead": 'class="grid messages"',
    "list_handler": 'class="grid messages"',
    "list_payload": 'class="grid messages"',
    "count_dead": 'data-count="matching"',
    "count_handler": 'data-count="matching"',
    "count_payload": 'data-count="matching"',
    "detail": 'class="grid timeline"',
}
_COUNT = re.compile(r'data-count="(\w+)">([^<]*)<')
_ROW_ID = re.compile(r'<td class="num"><a href="/messages/(\d+)">#')


def _number(text: str) -> int:
    return int(text.replace(",", "").strip())


class Checker:
    """The pages' content against the database, read with plain SQL (not through ``outbox.ops``)."""

    def __init__(self, url: URL, filled: Filled) -> None:
        self.url = url
        self.filled = filled

    def _rows(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(conninfo(self.url)) as conn:
            return list(conn.execute(sql).fetchall())

    def check(self, page: Page, body: str) -> None:
        if page.key == "overview":
            self._overview(body)
        elif page.key == "detail":
            self._detail(body)
        else:
            self._list(page, body)

    def _overview(self, body: str) -> None:
        shown = {name: _number(value) for name, value in _COUNT.findall(body)}
        f = self.filled
        expected = {s: n for s, n in f.by_status.items() if s != "dead"}
        expected["dead"] = f.by_status.get("dead", 0) - f.dead_requeued
        expected["dead_requeued"] = f.dead_requeued
        for name, count in expected.items():
            if shown.get(name) != count:
                raise Unverified(f"overview shows {name} = {shown.get(name)}, the database holds {count}")
        if sum(shown[s] for s in expected) != f.messages:
            raise Unverified(f"overview counts add up to {sum(shown.values())}, not {f.messages}")
        last_hour = re.search(r"delivered ([\d,]+)\s*<span", body)
        if last_hour is None or _number(last_hour.group(1)) == 0:
            raise Unverified("overview shows no delivery in the last hour")

    def _list(self, page: Page, body: str) -> None:
        total = self._rows(f"SELECT count(*) FROM outbox_message WHERE {page.sql_where}")[0][0]
        ids = [
            r[0]
            for r in self._rows(
                f"SELECT id FROM outbox_message WHERE {page.sql_where} ORDER BY id DESC LIMIT {PAGE_SIZE}"
            )
        ]
        if page.key.startswith("count_"):
            shown = dict(_COUNT.findall(body)).get("matching", "").split(" matching")[0]
            want = f"More than {COUNT_CAP:,}" if total > COUNT_CAP else f"{total:,}"
            if shown.strip() != want:
                raise Unverified(f"{page.url} says {shown!r} matching; the database has {total}")
            return
        rows = [int(i) for i in _ROW_ID.findall(body)]
        if rows != ids:
            raise Unverified(
                f"{page.url} lists {rows[:5]}... ({len(rows)}); expected {ids[:5]}... ({len(ids)})"
            )
        if not ids:
            raise Unverified(
                f"{page.url} matches nothing: the fill did not make the rows it is meant to show"
            )

    def _detail(self, body: str) -> None:
        mid = self.filled.detail_id
        history = self._rows(f"SELECT count(*) FROM outbox_attempt WHERE message_id = {mid}")[0][0]
        parent, child = self._rows(
            f"SELECT (SELECT requeued_from FROM outbox_message WHERE id = {mid}),"
            f" (SELECT id FROM outbox_message WHERE requeued_from = {mid})"
        )[0]
        timeline = body.partition('class="grid timeline"')[2].partition("</table>")[0]
        rows = timeline.count('<span class="badge ')
        if history < 3 or rows != history:
            raise Unverified(f"detail of #{mid} shows {rows} history rows; the database has {history}")
        if parent is None or child is None:
            raise Unverified(f"#{mid} is not the middle of a requeue chain")
        for text in (
            f'Requeued from <a href="/messages/{parent}">',
            f'Requeued as <a href="/messages/{child}">',
        ):
            if text not in body:
                raise Unverified(f"detail of #{mid} lacks {text!r}")


# -- statements and plans ---------------------------------------------------------------------------


@dataclass(slots=True)
class Captured:
    statements: list[tuple[str, Any]] = field(default_factory=list)


@contextmanager
def capture(engine: Engine) -> Iterator[Captured]:
    """Every statement the engine runs meanwhile, as the driver gets it (SQL and parameters)."""
    seen = Captured()

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        seen.statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


_BIG_TABLES = ("outbox_message", "outbox_attempt")


@dataclass(slots=True)
class Plan:
    page: str
    sql: str
    plan: list[str]

    @property
    def execution_ms(self) -> float:
        for line in reversed(self.plan):
            if line.startswith("Execution Time:"):
                return float(line.split(":")[1].split()[0])
        return float("nan")

    @property
    def seq_scans(self) -> list[str]:
        return sorted(
            {t for line in self.plan for t in _BIG_TABLES if re.search(rf"Seq Scan on {t}\b", line)}
        )

    @property
    def indexes(self) -> list[str]:
        found = (
            re.search(
                r"(?:Index Only Scan|Index Scan|Bitmap Index Scan)(?: Backward)? (?:using|on) (\w+)", ln
            )
            for ln in self.plan
        )
        return sorted({m.group(1) for m in found if m})


def explain(engine: Engine, page: str, statements: list[tuple[str, Any]]) -> list[Plan]:
    plans = []
    with engine.connect() as conn:
        for sql, params in statements:
            if not sql.lstrip().upper().startswith(("SELECT", "WITH")) or "outbox_" not in sql:
                continue
            rows = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).all()
            plans.append(Plan(page, sql, [str(r[0]) for r in rows]))
    return plans


# -- the mode ------------------------------------------------------------------------------------------


async def _time_pages(
    app: Any, todo: list[Page], checker: Checker, samples: int, engine: Engine
) -> tuple[float, dict[str, list[float]], list[Plan]]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:

        async def get(page: Page) -> tuple[float, str]:
            began = time.perf_counter()
            response = await client.get(page.url)
            elapsed = (time.perf_counter() - began) * 1000
            if response.status_code != 200:
                raise Unverified(f"GET {page.url}: {response.status_code}\n{response.text[:500]}")
            if _MARKERS[page.key] not in response.text:
                raise Unverified(f"GET {page.url}: no {_MARKERS[page.key]!r} in the page")
            return elapsed, response.text

        with capture(engine) as cold_sql:
            cold, body = await get(todo[0])  # the overview, the app's very first request
        checker.check(todo[0], body)
        times: dict[str, list[float]] = {}
        plans: list[Plan] = []
        for page in todo:
            if page.key != "overview":
                _, body = await get(page)  # warm-up
                checker.check(page, body)
            with capture(engine) as seen:
                await get(page)
            plans += explain(engine, page.label, seen.statements)
            if page.key == "overview":  # what only the first overview ran: the finished totals
                warm = {sql for sql, _ in seen.statements}
                first_only = [s for s in cold_sql.statements if s[0] not in warm]
                plans += explain(engine, "overview, first request only", first_only)
            runs = []
            for _ in range(samples):
                elapsed, body = await get(page)
                runs.append(elapsed)
            checker.check(page, body)
            times[page.key] = runs
    return cold, times, plans


def dashboard(scratch: Scratch, *, messages: int, samples: int) -> dict[str, Any]:
    url = scratch.postgres("dashboard")
    filled = fill(url, messages)
    if filled.messages != messages:
        raise Unverified(f"filled {filled.messages} messages, meant {messages}")
    scratch.settle()
    engine = create_engine(url)
    try:
        todo = pages(filled.detail_id, datetime.now(UTC))
        app = create_app(engine, page_size=PAGE_SIZE, count_cap=COUNT_CAP)
        checker = Checker(url, filled)
        cold, times, plans = asyncio.run(_time_pages(app, todo, checker, samples, engine))
        # The payload filter again, with the optional GIN index docs/dashboard.md describes.
        began = time.perf_counter()
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            conn.execute(GIN_INDEX)
            conn.execute("ANALYZE outbox_message")
        gin_build_s = time.perf_counter() - began
        payload = [
            dataclasses.replace(p, key=f"{p.key}_gin", label=f"{p.label} (GIN index)")
            for p in todo
            if p.key in ("list_payload", "count_payload")
        ]
        fresh = create_app(engine, page_size=PAGE_SIZE, count_cap=COUNT_CAP)
        _, gin_times, gin_plans = asyncio.run(
            _time_pages(fresh, [todo[0], *payload], checker, samples, engine)
        )
        times.update({k: v for k, v in gin_times.items() if k.endswith("_gin")})
        plans += [p for p in gin_plans if "GIN" in p.page]
    finally:
        engine.dispose()
    out: dict[str, Any] = {
        "messages": filled.messages,
        "history_rows": filled.history,
        "by_status": filled.by_status,
        "fill_s": filled.seconds,
        "overview_cold_ms": cold,
        "gin_build_s": gin_build_s,
        "samples": samples,
        "pages": {p.key: p.label for p in todo},
        "plans": plans,
    }
    for key, runs in times.items():
        out[f"{key}_ms_p50"] = statistics.median(runs)
        out[f"{key}_ms_p95"] = percentile(runs, 95)
        out[f"{key}_ms_max"] = max(runs)
    out["seq_scans"] = sorted({f"{p.page}: {t}" for p in plans for t in p.seq_scans})
    return out
