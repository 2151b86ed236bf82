"""Issue 16 targets 3 and 7: ``outbox-relay`` started on a backlog that is already there.

The drain mode measures the most favourable case: relays already running and
idle on LISTEN, woken by one commit. What users meet is often the other one:
messages piled up during an outage or a deploy, or between two runs of a cron
``outbox-relay --once``, and a relay process that starts on them. Here 20,000
messages (the drain mode's no-op route and rows) are stored in a fresh
database before any relay exists, the server is settled, and then one relay
process starts on them:

- ``serve``: the normal long-running relay, stopped (SIGTERM, exit 0) once
  every message is delivered;
- ``once``: ``outbox-relay --once``, which drains (``Relay.run_until_idle()``)
  and exits by itself.

Each at two flag sets: ``default`` passes no ``--concurrency`` or
``--batch-size``, so the relay runs at whatever its defaults are in this build;
``tuned`` passes the bench's own (``--concurrency``/``--batch-size``). Every
run gets its own database with the same backlog.

Each run is timed two ways. Over the history's own span (first ``started_at``
to last ``finished_at`` in ``outbox_attempt``): the delivery work alone. And
from the moment the process was spawned: to its exit for ``once``, to the
last outcome written (``max(outbox_message.updated_at)``) for ``serve``, which
never exits by itself; start-up (imports, connecting, the lease recovery) is
in both. ``start_seconds`` (spawn to the first attempt) and ``end_seconds``
(last attempt to the end) say where the difference went. ``--once`` within
10 % of serve, by both clocks, is issue 16's target 3. A full bench run
repeats each run three times, serve and ``--once`` alternating, and reports
medians.

The relay's CPU (user + system, all threads, start-up included) divided by
the messages gives ``relay_cpu_us_per_msg``: target 7, the figure a capacity
plan needs. Serve is read from ``/proc`` just before it is stopped; ``--once``
from the rusage of its exit, so its shutdown is in it too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from statistics import median
from typing import Any

from .drain import RelaySettings
from .harness import Scratch, give_up_after, prefill, relays, wait_drained
from .verdicts import rate_ratio_verdict
from .verify import Expected, check_delivered, drain_window, read_traces

__all__ = ["BACKLOG_MODES", "backlog", "backlog_ratios", "backlog_rows", "flag_sets", "run_backlog"]

#: What ``--only`` accepts for this module.
BACKLOG_MODES = ("backlog",)
#: How the relay runs on the backlog: the long-running relay, and ``--once``.
HOWS = ("serve", "once")
#: Issue 16 target 3: ``--once`` at least this share of serve's rate on the same backlog.
ONCE_VS_SERVE_MIN = 0.90

#: What each run reports, as a median over the runs, with its rounding.
FIGURES = {
    "per_s": 1,
    "wall_per_s": 1,
    "wall_seconds": 3,
    "start_seconds": 3,
    "end_seconds": 3,
    "relay_cpu_us_per_msg": 1,
}

Mode = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]


def flag_sets(settings: RelaySettings) -> dict[str, list[str]]:
    """``default``: no size flags, so the relay's own defaults; ``tuned``: the bench's sizes."""
    return {"default": ["--log-level", settings.log_level], "tuned": settings.args()}


def _timeout(count: int) -> float:
    """Half the drain mode's floor.

    A relay started on a backlog pays its start-up, and ``--once`` at default
    flags is the slowest way the benchmark runs a relay.
    """
    return give_up_after(count, slowest_per_s=100)


def backlog(
    scratch: Scratch, *, how: str, flags: str, args: list[str], count: int, run: int = 1
) -> dict[str, Any]:
    """One relay process started on ``count`` stored messages; its rates and CPU, once verified."""
    if how not in HOWS:
        raise ValueError(f"how must be one of {HOWS}, not {how!r}")
    purpose = f"backlog_{how}_{flags}_{run}"
    url = scratch.postgres(purpose)
    workdir = scratch.subdir(purpose)
    prefill(url, "noop", count)
    # The backlog's dirty pages written out and its statistics taken, as after any real outage:
    # the run measures the relay, not the checkpoint of the rows it was given.
    scratch.settle()
    env = {"BENCH_TRACE_DIR": str(workdir)}
    once = how == "once"
    with relays(url, 1, [*args, *(["--once"] if once else [])], workdir=workdir, env=env) as procs:
        proc = procs[0]
        if once:
            proc.wait_exit(_timeout(count))
            cpu = proc.cpu_seconds()
        else:
            wait_drained(url, count, procs, _timeout(count))
            cpu = proc.cpu_seconds()  # before SIGTERM: what delivering cost, not the stop
            proc.stop()
    expected = Expected(count, relays=[proc.name])
    facts = check_delivered(url, expected)
    calls = read_traces(workdir, "noop", expected)
    first, last, written = drain_window(url)
    span = (last - first).total_seconds()
    if once:
        assert proc.exited_monotonic is not None
        wall = proc.exited_monotonic - proc.started_monotonic
    else:
        wall = written.timestamp() - proc.started
    # Where the time outside the history's span went: before the first attempt, after the last.
    start = first.timestamp() - proc.started
    return {
        "per_s": count / span,
        "wall_per_s": count / wall,
        "span_seconds": span,
        "wall_seconds": wall,
        "start_seconds": start,
        "end_seconds": wall - start - span,
        "cpu_seconds": cpu,
        "relay_cpu_us_per_msg": 1e6 * cpu / count,
        "history_rows": facts["history_rows"],
        "handler_calls": calls,
    }


def backlog_ratios(out: dict[str, Any]) -> dict[str, float]:
    """``--once`` / serve per flag set and clock, where both rates are known."""
    ratios: dict[str, float] = {}
    for flags in ("default", "tuned"):
        for clock in ("", "_wall"):
            once = out.get(f"backlog_once{clock}_per_s_{flags}")
            serve = out.get(f"backlog_serve{clock}_per_s_{flags}")
            if once is not None and serve:
                ratios[f"backlog_once_vs_serve{clock}_{flags}"] = round(once / serve, 3)
    return ratios


def run_backlog(
    mode: Mode,
    out: dict[str, Any],
    scratch: Scratch,
    *,
    count: int,
    settings: RelaySettings,
    want: Callable[[str], bool],
    runs: int = 1,
) -> None:
    """Serve and ``--once``, at default and tuned flags, ``runs`` times each, as modes of one bench run.

    Serve and ``--once`` of one flag set alternate, so their ratio compares
    runs under the same load on a shared machine; each figure is the median
    of its runs (one noisy run moves it less than a mean), and reported only
    when every run verified.
    """
    if not want("backlog"):
        return
    out["messages_backlog"] = count
    out["backlog_runs"] = runs
    out["backlog_default_concurrency"] = _default_concurrency()
    for flags, args in flag_sets(settings).items():
        results: dict[str, list[dict[str, Any]]] = {how: [] for how in HOWS}
        for run in range(1, runs + 1):
            for how in HOWS:
                label = f"backlog, {'outbox-relay --once' if how == 'once' else 'serve'}, {flags} flags"
                if runs > 1:
                    label += f", run {run} of {runs}"
                figures = mode(
                    label, partial(backlog, scratch, how=how, flags=flags, args=args, count=count, run=run)
                )
                if figures:
                    results[how].append(figures)
        for how, got in results.items():
            if len(got) < runs:
                continue
            for key, digits in FIGURES.items():
                out[f"backlog_{how}_{key}_{flags}"] = round(median(f[key] for f in got), digits)
            out[f"backlog_{how}_runs_per_s_{flags}"] = ", ".join(f"{f['per_s']:.0f}" for f in got)
            out[f"backlog_{how}_runs_wall_per_s_{flags}"] = ", ".join(f"{f['wall_per_s']:.0f}" for f in got)
    out.update(backlog_ratios(out))


def _default_concurrency() -> int | None:
    """The relay's default ``--concurrency`` in this build, for the report only (never passed)."""
    import outbox.relay

    value = getattr(outbox.relay, "DEFAULT_CONCURRENCY", None)
    return value if isinstance(value, int) else None


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def _drain_cpu_rows(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The drain mode's relay CPU: per message once started, and what starting costs."""
    rows: list[tuple[str, str, str, str]] = []
    for relays_n in (1, 2):
        cpu = out.get(f"drain_relay_cpu_us_per_msg_{relays_n}")
        if cpu is not None:
            rows.append((f"7 relay CPU, drain, {relays_n} relay(s)", f"{cpu:.0f} us/msg", "", "-"))
    startup = out.get("relay_startup_cpu_s")
    if startup is not None:
        rows.append(("7 relay CPU to start (to LISTEN)", f"{startup:.2f} s", "", "-"))
    return rows


def backlog_rows(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Table rows: each run's rates and CPU, then target 3's ratio per flag set with its verdict."""
    rows = _drain_cpu_rows(out)
    if "messages_backlog" not in out:
        return rows
    for flags in ("default", "tuned"):
        for how in HOWS:
            name = "--once" if how == "once" else "serve"
            cpu = out.get(f"backlog_{how}_relay_cpu_us_per_msg_{flags}")
            rows.append(
                (
                    f"3 backlog, {name}, {flags} flags",
                    f"{_fmt(out.get(f'backlog_{how}_per_s_{flags}'), ',.0f')} msg/s over the history, "
                    f"{_fmt(out.get(f'backlog_{how}_wall_per_s_{flags}'), ',.0f')} from spawn; "
                    f"7 relay CPU {_fmt(cpu, '.0f')} us/msg",
                    "",
                    "-",
                )
            )
        span = out.get(f"backlog_once_vs_serve_{flags}")
        wall = out.get(f"backlog_once_vs_serve_wall_{flags}")
        both = None if span is None or wall is None else min(span, wall) >= ONCE_VS_SERVE_MIN
        rows.append(
            (
                f"3 --once / serve, {flags} flags",
                f"{_fmt(span, '.2f')} over the history, {_fmt(wall, '.2f')} from spawn",
                f">= {ONCE_VS_SERVE_MIN:.2f} both",
                rate_ratio_verdict(out, both),
            )
        )
    return rows
