"""Scale mode: does the relay's cost per message stay the same as the work grows?

Opt-in (``--only scale`` or ``--scale``): the full size takes minutes. Two
scratch databases, each filled before the relay starts and then
``VACUUM (ANALYZE)``-ed:

- *small*: the drain mode's backlog (20,000 pending ``noop`` messages), no history;
- *big*: ``--scale-history`` history rows (10,000,000) of messages delivered
  and purged over the last 30 days, then ``--scale-pending`` pending
  messages (1,000,000).

After each fill the server is settled as before every mode (``Scratch.settle``:
a ``CHECKPOINT``, no autovacuum worker running), so the relay does not
start while the checkpointer writes out the gigabytes the fill dirtied.

Per database the relay's real claim statement (``relay.sql_postgresql``,
with the relay's own session setting ``jit = off``) runs under
``EXPLAIN (ANALYZE, BUFFERS)`` in transactions that are rolled back; the
median execution time is reported. On the big database it runs once more
with the server's default ``jit`` setting, for comparison.

Then one ``outbox-relay`` with the bench's flags (as the drain mode) drains
each backlog. The rate is the relay's own history span (first attempt's
start to last attempt's finish), so the fill and the process start-up are
not in it. ``scale_vs_small`` compares the whole big drain with the small
one; ``scale_vs_small_first`` compares the big drain's first deliveries, as
many as the small backlog, when the backlog is at its largest, and the rate
over each tenth of the big drain shows whether it changes as the backlog
shrinks. The relay's
resident set (``VmRSS``) is read once the first small-backlog-worth of
messages is delivered (warm) and again after the last delivery.

The check before any figure is reported: every pending message delivered
exactly once (status, attempts, exactly one history row, the handler ran
once for each), and the history holds exactly the prefilled rows plus one
per delivery.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from relay.db import SHORT_STATEMENTS
from relay.sql_postgresql import CLAIM, claim_start

from .app import ob
from .bulk import fill_history, fill_session, vacuum_analyze
from .drain import RelaySettings
from .harness import RelayProcess, Scratch, conninfo, function_plans, prefill, relays, wait_listening
from .verdicts import verdict
from .verify import Expected, Unverified, read_traces

__all__ = ["ClaimPlan", "add_arguments", "figures", "scale", "scale_mode", "targets"]

ROUTE = "noop"
CLAIM_RUNS = 5
SCALE_VS_SMALL = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", action="store_true", help="also run the scale mode (minutes; see --only scale)")
    p.add_argument(
        "--scale-pending",
        type=int,
        default=1_000_000,
        help="scale mode: pending messages (default: 1,000,000)",
    )
    p.add_argument(
        "--scale-history", type=int, default=10_000_000, help="scale mode: history rows (default: 10,000,000)"
    )


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """One database's claim under EXPLAIN (ANALYZE, BUFFERS): its median time and one plan.

    The claim runs inside the database function ``outbox_claim``, which keeps its
    plan for the session: there is no planning time per claim to report.
    """

    label: str
    execution_ms: float
    runs: tuple[float, ...]
    plan: tuple[str, ...]


def _claim_params(queue: str, limit: int, start: tuple[int, int] | None) -> dict[str, Any]:
    handlers = sorted(r.name for r in ob.routes if r.queue == queue)
    return {
        "me": "bench-explain",
        "lease": 30.0,
        "queue": queue,
        "handlers": handlers,
        "limit": limit,
        "block_on_dead": True,
        **claim_start(start),
    }


def explain_claim(
    url: URL,
    *,
    label: str,
    limit: int,
    jit_off: bool = True,
    runs: int = CLAIM_RUNS,
    start: tuple[int, int] | None = None,
) -> ClaimPlan:
    """The relay's claim under EXPLAIN (ANALYZE, BUFFERS), each run rolled back: nothing is claimed.

    ``start`` is the claim's position in the queue (``relay/claim_position.py``); None: its front.
    """
    params = _claim_params(ob.get_route(ROUTE).queue, limit, start)
    times: list[float] = []
    plan: tuple[str, ...] = ()
    with psycopg.connect(conninfo(url)) as conn:
        if jit_off:
            conn.execute(SHORT_STATEMENTS)
            conn.commit()
        for _ in range(runs):
            try:
                nested = function_plans(conn, CLAIM, params)
            finally:
                conn.rollback()
            if not nested:
                raise Unverified("auto_explain reported no statement inside outbox_claim")
            times.append(nested[0].execution_ms)
            plan = nested[0].lines
    return ClaimPlan(label, statistics.median(times), tuple(times), plan)


@dataclass(frozen=True, slots=True)
class Drained:
    per_s: float  # the whole drain, over the relay's history span
    first_per_s: float  # its first ``window`` deliveries
    seconds: float
    per_s_by_tenth: list[float]
    rss_mb_start: float
    rss_mb_end: float
    hwm_mb_end: float
    history_rows: int
    late_claim: ClaimPlan | None  # from the relay's position in the queue: what its claims pay
    late_front_claim: ClaimPlan | None  # from the front: what its claim once a second pays
    autovacuums: int  # of outbox_message during the drain: what removes the claim index's dead entries


def _progress(conn: psycopg.Connection, history: int) -> int:
    """Deliveries recorded so far, from the history's primary key maximum: an instant index probe.

    An approximation (an identity value may be skipped), used only to pace
    the samples; the verification counts rows.
    """
    row = conn.execute("SELECT coalesce(max(id), 0) FROM outbox_attempt").fetchone()
    return (int(row[0]) if row else 0) - history


def _finished(conn: psycopg.Connection) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM outbox_message WHERE status IN ('pending', 'running')"
    ).fetchone()
    return row is not None and row[0] == 0


#: Share of the big drain after which the claim is timed again, with the relay still running.
LATE = 0.8


def _wait_and_sample(
    url: URL, relay: RelayProcess, *, count: int, history: int, warm: int, timeout: float, limit: int
) -> tuple[float, float, tuple[ClaimPlan, ClaimPlan] | None]:
    """Until every message is delivered; the relay's RSS (MB) after ``warm`` deliveries and at the end,
    and the claim's plans once ``LATE`` of the messages are delivered.

    By then the front of the claim index holds the entries of every row
    claimed so far, dead until a vacuum removes them. The relay's claims
    start at its position in the queue (the first row of its last claim,
    which :func:`_relay_position` approximates by the first row it holds);
    its claim from the front, once a second, steps over all of them. Both
    are timed with the relay process stopped (SIGSTOP, then SIGCONT, well
    within its leases), so they compete for the CPUs with nothing, as the
    claims before the drain did; their rows are locked and then released by
    the rollback.
    """
    deadline = time.monotonic() + timeout
    warm_mb: float | None = None
    late: tuple[ClaimPlan, ClaimPlan] | None = None
    reported = 0
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        while True:
            if not relay.alive():
                raise Unverified(f"the relay exited during the drain\n{relay.tail()}")
            if time.monotonic() > deadline:
                raise Unverified(f"timed out after {timeout:g}s draining {count} messages\n{relay.tail()}")
            done = _progress(conn, history)
            if warm_mb is None and done >= warm:
                warm_mb = relay.status_kb("VmRSS") / 1024
            if late is None and LATE * count <= done < count:
                label = f"big, {done:,} of {count:,} delivered, the relay stopped for it"
                start = _relay_position(conn)
                with relay.paused():
                    late = (
                        explain_claim(
                            url, label=f"{label}, from its position {start}", limit=limit, runs=3, start=start
                        ),
                        explain_claim(url, label=f"{label}, from the front", limit=limit, runs=3),
                    )
            if done >= reported + 100_000:
                reported = done - done % 100_000
                print(f"bench: scale: {done:,} of {count:,} delivered", file=sys.stderr, flush=True)
            if done >= count and _finished(conn):
                end_mb = relay.status_kb("VmRSS") / 1024
                return (end_mb if warm_mb is None else warm_mb), end_mb, late
            time.sleep(1.0)


def _relay_position(conn: psycopg.Connection) -> tuple[int, int] | None:
    """The first (priority, id) of the rows the relay holds: about where its last claim started."""
    row = conn.execute(
        "SELECT priority, id FROM outbox_message WHERE status = 'running' ORDER BY priority, id LIMIT 1"
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


def _verify(url: URL, *, count: int, history: int) -> int:
    """Every message delivered exactly once; the history is the prefill plus one row each."""
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE m.status = 'delivered' AND m.attempts = 1),
                   count(*) FILTER (WHERE a.rows = 1 AND a.delivered = 1)
              FROM outbox_message m
              LEFT JOIN (SELECT message_id, count(*) AS rows,
                                count(*) FILTER (WHERE outcome = 'delivered' AND attempt = 1) AS delivered
                           FROM outbox_attempt WHERE message_id > %(history)s
                          GROUP BY message_id) a ON a.message_id = m.id
            """,
            {"history": history},
        ).fetchone()
        total = conn.execute("SELECT count(*) FROM outbox_attempt").fetchone()
        old = conn.execute(
            "SELECT count(*) FROM outbox_attempt WHERE message_id <= %(history)s", {"history": history}
        ).fetchone()
    if row is None or total is None or old is None:
        raise Unverified("the verification queries returned nothing")
    messages, delivered, once = (int(v) for v in row)
    if messages != count or delivered != count or once != count:
        raise Unverified(
            f"{count} messages expected: {messages} stored, {delivered} delivered on their first attempt, "
            f"{once} with exactly one delivered history row"
        )
    if int(old[0]) != history or int(total[0]) != history + count:
        raise Unverified(
            f"expected {history:,} prefilled + {count:,} new history rows, "
            f"found {int(old[0]):,} prefilled of {int(total[0]):,}"
        )
    return int(total[0])


#: The big drain's rate is also reported for each tenth of its deliveries: is it flat as the backlog shrinks?
TENTHS = 10


def _tenths(conn: psycopg.Connection, *, history: int, first: Any, count: int) -> list[float]:
    """The rate over each tenth of the deliveries, in finishing order (from a backlog of ``count`` down)."""
    step = max(count // TENTHS, 1)
    marks = [first] + [
        r[0]
        for r in conn.execute(
            "SELECT finished_at FROM (SELECT finished_at, row_number() OVER (ORDER BY finished_at) AS n"
            " FROM outbox_attempt WHERE message_id > %(history)s) AS d WHERE n %% %(step)s = 0",
            {"history": history, "step": step},
        )
    ]
    return [step / max((b - a).total_seconds(), 1e-6) for a, b in zip(marks, marks[1:], strict=False)]


def _rates(url: URL, *, history: int, window: int) -> tuple[float, float, float, list[float]]:
    """The relay's history span rate, the rate over its first ``window`` deliveries, the span (s), and
    the rate per tenth of the deliveries."""
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            "SELECT min(started_at), max(finished_at), count(*) FROM outbox_attempt"
            " WHERE message_id > %(history)s",
            {"history": history},
        ).fetchone()
        nth = conn.execute(
            "SELECT finished_at FROM outbox_attempt WHERE message_id > %(history)s"
            " ORDER BY finished_at OFFSET %(skip)s LIMIT 1",
            {"history": history, "skip": window - 1},
        ).fetchone()
        if row is None or nth is None:
            raise Unverified("no history written by the relay")
        first, last, count = row
        tenths = _tenths(conn, history=history, first=first, count=count)
    span = (last - first).total_seconds()
    return count / span, window / (nth[0] - first).total_seconds(), span, tenths


def _autovacuums(url: URL) -> int:
    """Autovacuum runs on ``outbox_message`` so far (the fill's own VACUUM is a manual one, not counted)."""
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            "SELECT autovacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox_message'"
        ).fetchone()
    return int(row[0]) if row else 0


def drain_filled(
    scratch: Scratch,
    url: URL,
    *,
    purpose: str,
    count: int,
    history: int,
    window: int,
    settings: RelaySettings,
) -> Drained:
    """One relay drains a backlog stored before it started; verified, then timed from its history."""
    workdir = scratch.subdir(purpose)
    env = {"BENCH_TRACE_DIR": str(workdir)}
    with relays(url, 1, settings.args(), workdir=workdir, env=env) as procs:
        relay = procs[0]
        wait_listening(url, procs)
        start_mb, end_mb, late = _wait_and_sample(
            url,
            relay,
            count=count,
            history=history,
            warm=window,
            timeout=120.0 + count / 200,
            limit=settings.batch_size,
        )
        hwm_mb = relay.status_kb("VmHWM") / 1024
        relay.stop()
    autovacuums = _autovacuums(url)
    history_rows = _verify(url, count=count, history=history)
    read_traces(workdir, ROUTE, Expected(count, relays=[relay.name]))
    per_s, first_per_s, span, tenths = _rates(url, history=history, window=min(window, count))
    late_claim, late_front = (None, None) if late is None else late
    return Drained(
        per_s,
        first_per_s,
        span,
        tenths,
        start_mb,
        end_mb,
        hwm_mb,
        history_rows,
        late_claim,
        late_front,
        autovacuums,
    )


def _filled(scratch: Scratch, purpose: str, *, pending: int, history: int) -> tuple[URL, float]:
    began = time.monotonic()
    url = scratch.postgres(purpose)
    fill_history(url, history, progress=history >= 1_000_000)
    prefill(url, ROUTE, pending)
    with fill_session(url) as conn:
        vacuum_analyze(conn, "outbox_message", "outbox_attempt")
    return url, time.monotonic() - began


def scale(
    scratch: Scratch, *, pending: int, history: int, small: int, settings: RelaySettings
) -> dict[str, Any]:
    if min(pending, small) < 1 or history < 0:
        raise ValueError("the scale mode needs at least one pending message in each database")
    window = min(small, pending)
    limit = settings.batch_size
    small_url, _ = _filled(scratch, "scale_small", pending=small, history=0)
    settle_s = scratch.settle()
    claim_small = explain_claim(small_url, label=f"small: {small:,} pending, no history", limit=limit)
    small_run = drain_filled(
        scratch, small_url, purpose="scale-small", count=small, history=0, window=window, settings=settings
    )
    big_url, fill_s = _filled(scratch, "scale_big", pending=pending, history=history)
    settle_s += scratch.settle()
    big_label = f"big: {pending:,} pending, {history:,} history rows"
    claim_big = explain_claim(big_url, label=big_label, limit=limit)
    claim_jit = explain_claim(big_url, label=big_label + ", server default jit", limit=limit, jit_off=False)
    big_run = drain_filled(
        scratch,
        big_url,
        purpose="scale-big",
        count=pending,
        history=history,
        window=window,
        settings=settings,
    )
    return {
        "pending": pending,
        "history": history,
        "small": small,
        "fill_s": fill_s,
        "settle_s": settle_s,
        "small_run": small_run,
        "big_run": big_run,
        "plans": (claim_small, claim_big, claim_jit)
        + tuple(p for p in (big_run.late_claim, big_run.late_front_claim) if p is not None),
    }


def scale_mode(
    mode: Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None],
    out: dict[str, Any],
    args: argparse.Namespace,
    scratch: Scratch,
    *,
    small: int,
    settings: RelaySettings,
    append: bool,
) -> None:
    """Run the mode through ``python -m bench``'s ``mode`` runner and add its figures to ``out``."""
    out.update(scale_pending=args.scale_pending, scale_history=args.scale_history)
    result = mode(
        "scale",
        lambda: scale(
            scratch, pending=args.scale_pending, history=args.scale_history, small=small, settings=settings
        ),
    )
    if result:
        figures(out, result, args.explain, append=append)


def figures(out: dict[str, Any], result: dict[str, Any], explain: Path | None, *, append: bool) -> None:
    """The mode's flat JSON keys; the claim plans go to ``explain`` (after the dashboard's, if it ran)."""
    small: Drained = result["small_run"]
    big: Drained = result["big_run"]
    claim_small, claim_big, claim_jit = result["plans"][:3]
    late, front = big.late_claim, big.late_front_claim
    out.update(
        scale_pending=result["pending"],
        scale_history=result["history"],
        scale_small=result["small"],
        scale_fill_s=round(result["fill_s"], 1),
        scale_drain_per_s_small=small.per_s,
        scale_drain_per_s_big=big.per_s,
        scale_drain_per_s_big_first=big.first_per_s,
        scale_drain_seconds_big=round(big.seconds, 1),
        scale_drain_per_s_big_by_tenth=", ".join(f"{rate:.0f}" for rate in big.per_s_by_tenth),
        scale_settle_s=round(result["settle_s"], 1),
        scale_vs_small=big.per_s / small.per_s,
        scale_vs_small_first=big.first_per_s / small.per_s,
        scale_claim_ms_small=claim_small.execution_ms,
        scale_claim_ms_big=claim_big.execution_ms,
        scale_claim_ms_big_default_jit=claim_jit.execution_ms,
        scale_autovacuums_big=big.autovacuums,
        scale_claim_ms_big_late=None if late is None else late.execution_ms,
        scale_claim_buffers_big=_claim_buffers(claim_big),
        scale_claim_buffers_big_late=None if late is None else _claim_buffers(late),
        scale_claim_ms_big_late_front=None if front is None else front.execution_ms,
        scale_claim_buffers_big_late_front=None if front is None else _claim_buffers(front),
        scale_rss_mb_start=big.rss_mb_start,
        scale_rss_mb_end=big.rss_mb_end,
        scale_rss_mb_peak=big.hwm_mb_end,
        scale_history_rows_after=big.history_rows,
    )
    for plan in result["plans"]:
        runs = ", ".join(f"{t:.1f}" for t in plan.runs)
        print(f"bench: scale claim, {plan.label}: {plan.execution_ms:.1f} ms ({runs})", file=sys.stderr)
    if explain is not None:
        text = "\n\n".join(
            f"-- claim, {p.label} (median of {len(p.runs)}: {p.execution_ms:.1f} ms)\n" + "\n".join(p.plan)
            for p in result["plans"]
        )
        with explain.open("a" if append else "w") as f:
            f.write(("\n\n" if append else "") + text + "\n")


_LIMIT_BUFFERS = re.compile(r"->  Limit .*\n\s+Buffers: shared hit=(\d+)(?: read=(\d+))?")


def _claim_buffers(plan: ClaimPlan) -> int | None:
    """Buffers the claim's id selection read (its LIMIT node): flat if the index scan stays short."""
    found = _LIMIT_BUFFERS.search("\n".join(plan.plan))
    return None if found is None else int(found.group(1)) + int(found.group(2) or 0)


def targets(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The scale mode's rows of the result table (none when it did not run)."""
    if "scale_pending" not in out:
        return []

    def fmt(key: str, spec: str) -> str:
        value = out.get(key)
        return "n/a" if value is None else f"{value:{spec}}"

    ratio, first = out.get("scale_vs_small"), out.get("scale_vs_small_first")
    small_ms, big_ms = out.get("scale_claim_ms_small"), out.get("scale_claim_ms_big")
    late = out.get("scale_claim_ms_big_late")
    start, end = out.get("scale_rss_mb_start"), out.get("scale_rss_mb_end")
    size = f"{fmt('scale_pending', ',d')} pending, {fmt('scale_history', ',d')} history"
    return [
        (
            "6 drain as the work grows",
            f"{fmt('scale_drain_per_s_big', ',.0f')} msg/s ({size}) vs "
            f"{fmt('scale_drain_per_s_small', ',.0f')} ({fmt('scale_small', ',d')}): "
            f"{fmt('scale_vs_small', '.2f')}; first {fmt('scale_small', ',d')}: "
            f"{fmt('scale_vs_small_first', '.2f')}",
            f">= {SCALE_VS_SMALL:.1f}",
            verdict(None if ratio is None or first is None else min(ratio, first) >= SCALE_VS_SMALL),
        ),
        (
            "6 claim query, before the big drain",
            f"{fmt('scale_claim_ms_small', '.1f')} ms small, {fmt('scale_claim_ms_big', '.1f')} ms big "
            f"({fmt('scale_claim_ms_big_default_jit', '.1f')} ms with the server's jit)",
            "flat",
            verdict(None if small_ms is None or big_ms is None else big_ms <= max(2 * small_ms, 5.0)),
        ),
        (
            "6 claim query, late in the big drain",
            f"{fmt('scale_claim_ms_big_late', '.1f')} ms, "
            f"{fmt('scale_claim_buffers_big_late', ',d')} buffers "
            f"(before: {fmt('scale_claim_buffers_big', ',d')}; from the front, once a second: "
            f"{fmt('scale_claim_ms_big_late_front', '.1f')} ms, "
            f"{fmt('scale_claim_buffers_big_late_front', ',d')} buffers)",
            "flat",
            verdict(None if small_ms is None or late is None else late <= max(2 * small_ms, 5.0)),
        ),
        (
            "6 relay RSS over the big drain",
            f"{fmt('scale_rss_mb_start', '.1f')} MB -> {fmt('scale_rss_mb_end', '.1f')} MB",
            "within 10 %",
            verdict(None if start is None or end is None else end <= start * 1.10),
        ),
    ]
