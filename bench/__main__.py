"""``python -m bench``: run every mode, print a table, write flat JSON.

Exit codes: 0 every mode verified, 1 some mode could not verify its result
(its figures are null), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ceiling import ceiling
from .drain import RelaySettings, drain_postgres, drain_sqlite
from .emit import emit_overhead
from .harness import Scratch, server_version
from .latency import wake_latency
from .memory import peak_rss
from .verify import Unverified

#: The flat JSON keys the issue fixes, so runs compare across commits; extras follow them.
KEYS = (
    "emit_overhead_ratio",
    "drain_per_s_1",
    "drain_per_s_2",
    "ceiling_per_s",
    "drain_vs_ceiling",
    "failure_mix_per_s",
    "latency_ms_p50",
    "latency_ms_p95",
    "latency_ms_p99",
    "rss_mb_10k",
    "rss_mb_100k",
)


@dataclass(frozen=True, slots=True)
class Sizes:
    emit_transactions: int
    drain: int
    latency_rate: float
    latency_seconds: float
    memory: tuple[int, int] | None
    sqlite_emit_transactions: int
    sqlite_drain: int
    ceiling_runs: int


#: ``--only NAME``: the mode it runs.
ONLY = {"rabbitmq": "rabbitmq publish"}

FULL = Sizes(5000, 20000, 20.0, 15.0, (10_000, 100_000), 2000, 20000, 3)
QUICK = Sizes(300, 2000, 20.0, 3.0, None, 200, 2000, 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL"),
        help="a PostgreSQL server URL; the benchmark creates and drops its own databases there",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute; skips memory")
    p.add_argument("--json", type=Path, help="write the flat JSON result here")
    p.add_argument("--concurrency", type=int, default=500, help="relay --concurrency (default: 500)")
    p.add_argument("--batch-size", type=int, default=250, help="relay --batch-size (default: 250)")
    p.add_argument("--no-sqlite", action="store_true", help="skip the SQLite runs")
    p.add_argument(
        "--rabbitmq-url",
        default=os.environ.get("OUTBOX_BENCH_RABBITMQ_URL"),
        help="an AMQP URL: adds the RabbitMQ mode (needs the rabbitmq extra)",
    )
    p.add_argument("--only", choices=sorted(ONLY), help="run this mode alone")
    return p


def _cpu_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy right now: other load on the machine skews every figure."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(seconds)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(total1 - total0, 1)


def _machine() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "machine_cpus": os.cpu_count(),
        "machine_cpu_model": model,
        "machine_python": platform.python_version(),
        "machine_load_before": round(os.getloadavg()[0], 2),
        "machine_busy_before_pct": round(100 * _cpu_busy(), 1),
    }


class Run:
    """Runs modes one by one; a mode that fails leaves its keys null and its reason in ``failures``."""

    def __init__(self, settle: Callable[[], float], only: str | None = None) -> None:
        self.result: dict[str, Any] = dict.fromkeys(KEYS)
        self.failures: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.settled: dict[str, float] = {}
        self._settle = settle
        self._only = only

    def mode(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        if self._only is not None and name != self._only:
            return None
        self.settled[name] = self._settle()
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            figures = fn()
        except Unverified as exc:
            self.failures[name] = f"unverified: {exc}"
            print(f"bench: {name}: NOT VERIFIED, no figure: {exc}", file=sys.stderr)
            return None
        except Exception as exc:
            self.failures[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None
        finally:
            self.durations[name] = time.monotonic() - began
        print(f"bench: {name}: done in {self.durations[name]:.1f}s", file=sys.stderr, flush=True)
        return figures


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    sizes = QUICK if args.quick else FULL
    settings = RelaySettings(concurrency=args.concurrency, batch_size=args.batch_size)
    scratch = Scratch(args.database_url)
    r = Run(scratch.settle, None if args.only is None else ONLY[args.only])
    out = r.result
    out.update(_machine())
    out.update(
        quick=args.quick,
        relay_concurrency=settings.concurrency,
        relay_batch_size=settings.batch_size,
        relay_log_level=settings.log_level,
        messages_drain=sizes.drain,
        emit_transactions=sizes.emit_transactions,
    )
    try:
        out["machine_postgresql"] = server_version(scratch.admin)
        emit = r.mode(
            "emit overhead (postgresql)",
            lambda: emit_overhead(scratch.postgres("emit"), transactions=sizes.emit_transactions),
        )
        if emit:
            out.update(
                emit_overhead_ratio=emit["ratio"],
                emit_per_s_without=emit["rate_without"],
                emit_per_s_installed_no_emit=emit["rate_installed"],
                emit_per_s_with=emit["rate_with"],
            )
        wake = r.mode(
            "wake-up latency",
            lambda: wake_latency(
                scratch, rate=sizes.latency_rate, seconds=sizes.latency_seconds, settings=settings
            ),
        )
        if wake:
            out.update(
                latency_ms_p50=wake["p50"],
                latency_ms_p95=wake["p95"],
                latency_ms_p99=wake["p99"],
                latency_ms_max=wake["max"],
                latency_samples=wake["samples"],
            )
        one = r.mode(
            "drain, 1 relay",
            lambda: drain_postgres(scratch, relay_count=1, count=sizes.drain, settings=settings),
        )
        if one:
            out.update(drain_per_s_1=one["per_s"], drain_history_span_per_s_1=one["history_span_per_s"])
        two = r.mode(
            "drain, 2 relays",
            lambda: drain_postgres(scratch, relay_count=2, count=sizes.drain, settings=settings),
        )
        if two:
            shares = sorted(two["by_relay"].values())
            out.update(
                drain_per_s_2=two["per_s"],
                drain_history_span_per_s_2=two["history_span_per_s"],
                drain_2_smaller_share=shares[0] / sizes.drain if len(shares) == 2 else 0.0,
            )
        top = r.mode(
            "ceiling (raw psycopg loop)",
            lambda: ceiling(
                scratch, count=sizes.drain, batch_size=settings.batch_size, runs=sizes.ceiling_runs
            ),
        )
        if top:
            out.update(
                ceiling_per_s=top["per_s"],
                ceiling_batch_size=settings.batch_size,
                ceiling_runs_per_s=", ".join(f"{rate:.0f}" for rate in top["runs"]),
            )
            if out["drain_per_s_1"] is not None:
                out["drain_vs_ceiling"] = out["drain_per_s_1"] / top["per_s"]
        mix = r.mode(
            "failure mix",
            lambda: drain_postgres(
                scratch, relay_count=1, count=sizes.drain, settings=settings, fail_every=10, purpose="failmix"
            ),
        )
        if mix:
            out.update(
                failure_mix_per_s=mix["per_s"],
                failure_mix_history_rows=mix["history_rows"],
                failure_mix_failing=mix["failing"],
            )
        if sizes.memory is not None:
            small, large = sizes.memory
            mem = r.mode("memory", lambda: peak_rss(scratch, small=small, large=large, settings=settings))
            if mem:
                out.update(
                    rss_mb_10k=mem["small_mb"],
                    rss_mb_100k=mem["large_mb"],
                    rss_mb_idle=mem["idle_mb"],
                    rss_growth=mem["growth"],
                    drain_per_s_90k_backlog=mem["large_backlog_per_s"],
                )
        if not args.no_sqlite:
            lite = r.mode(
                "emit overhead (sqlite)",
                lambda: emit_overhead(scratch.sqlite("emit"), transactions=sizes.sqlite_emit_transactions),
            )
            if lite:
                out.update(
                    sqlite_emit_overhead_ratio=lite["ratio"],
                    sqlite_emit_per_s_without=lite["rate_without"],
                    sqlite_emit_per_s_with=lite["rate_with"],
                )
            lite_drain = r.mode(
                "drain, 1 relay (sqlite)",
                lambda: drain_sqlite(scratch, count=sizes.sqlite_drain, settings=settings),
            )
            if lite_drain:
                out["sqlite_drain_per_s_1"] = lite_drain["per_s"]
        if args.rabbitmq_url:
            from .rabbitmq import rabbitmq_publish  # needs the rabbitmq extra, unlike every other mode

            rabbit = r.mode(
                "rabbitmq publish",
                lambda: rabbitmq_publish(
                    scratch, broker=args.rabbitmq_url, count=sizes.drain, settings=settings
                ),
            )
            if rabbit:
                out.update(
                    rabbitmq_direct_per_s=rabbit["direct_per_s"],
                    rabbitmq_outbox_per_s=rabbit["outbox_per_s"],
                    rabbitmq_ratio=rabbit["ratio"],
                    rabbitmq_direct_runs_per_s=", ".join(f"{v:.0f}" for v in rabbit["direct_runs_per_s"]),
                    rabbitmq_window=rabbit["window"],
                )
    finally:
        scratch.close()
    out["settle_seconds"] = round(sum(r.settled.values()), 1)
    out["machine_busy_after_pct"] = round(100 * _cpu_busy(), 1)
    out["failed_modes"] = ", ".join(r.failures) or None
    return out, r.failures


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def targets(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(mode, figure, target, verdict) rows; a verdict is '-' where a figure is missing or has no target."""

    def known(*keys: str) -> bool:
        return all(out.get(k) is not None for k in keys)

    rows = []
    ratio = out.get("emit_overhead_ratio")
    rows.append(
        (
            "1 emit overhead (pg)",
            f"{_fmt(out.get('emit_per_s_without'), '.0f')} -> "
            f"{_fmt(out.get('emit_per_s_with'), '.0f')} tx/s, "
            f"ratio {_fmt(ratio, '.2f')}",
            "ratio <= 1.30",
            _verdict(None if ratio is None else ratio <= 1.30),
        )
    )
    rows.append(("2 drain, 1 relay", f"{_fmt(out.get('drain_per_s_1'), ',.0f')} msg/s", "", "-"))
    two_ok = out["drain_per_s_2"] > out["drain_per_s_1"] if known("drain_per_s_1", "drain_per_s_2") else None
    rows.append(
        (
            "2 drain, 2 relays",
            f"{_fmt(out.get('drain_per_s_2'), ',.0f')} msg/s",
            "> 1 relay",
            _verdict(two_ok),
        )
    )
    rows.append(("3 ceiling (raw psycopg)", f"{_fmt(out.get('ceiling_per_s'), ',.0f')} msg/s", "", "-"))
    share = out.get("drain_vs_ceiling")
    rows.append(
        (
            "3 drain / ceiling",
            _fmt(None if share is None else 100 * share, ".0f", " %"),
            ">= 60 %",
            _verdict(None if share is None else share >= 0.60),
        )
    )
    p50, p99 = out.get("latency_ms_p50"), out.get("latency_ms_p99")
    rows.append(
        (
            "4 wake-up latency",
            f"p50 {_fmt(p50, '.2f')} / p95 {_fmt(out.get('latency_ms_p95'), '.2f')} / "
            f"p99 {_fmt(p99, '.2f')} ms",
            "p50 <= 2, p99 <= 5 ms",
            _verdict(None if p50 is None or p99 is None else p50 <= 2 and p99 <= 5),
        )
    )
    rows.append(
        (
            "5 failure mix (10 % fail once)",
            f"{_fmt(out.get('failure_mix_per_s'), ',.0f')} msg/s, "
            f"{_fmt(out.get('failure_mix_history_rows'), ',d')} history rows",
            "",
            "-",
        )
    )
    small, large = out.get("rss_mb_10k"), out.get("rss_mb_100k")
    rows.append(
        (
            "6 relay peak RSS",
            f"{_fmt(small, '.1f')} MB @10k, {_fmt(large, '.1f')} MB @100k",
            "@100k within 10 % of @10k",
            _verdict(None if small is None or large is None else large <= small * 1.10),
        )
    )
    if "sqlite_emit_overhead_ratio" in out or "sqlite_drain_per_s_1" in out:
        rows.append(
            (
                "1 emit overhead (sqlite)",
                f"{_fmt(out.get('sqlite_emit_per_s_without'), '.0f')} -> "
                f"{_fmt(out.get('sqlite_emit_per_s_with'), '.0f')} tx/s, "
                f"ratio {_fmt(out.get('sqlite_emit_overhead_ratio'), '.2f')}",
                "",
                "-",
            )
        )
        rows.append(
            ("2 drain, 1 relay (sqlite)", f"{_fmt(out.get('sqlite_drain_per_s_1'), ',.0f')} msg/s", "", "-")
        )
    if "rabbitmq_ratio" in out or "rabbitmq_outbox_per_s" in out:
        ratio = out.get("rabbitmq_ratio")
        rows.append(
            (
                "7 rabbitmq: outbox / direct",
                f"{_fmt(out.get('rabbitmq_outbox_per_s'), ',.0f')} / "
                f"{_fmt(out.get('rabbitmq_direct_per_s'), ',.0f')} msg/s, ratio {_fmt(ratio, '.2f')}",
                "ratio >= 0.70",
                _verdict(None if ratio is None else ratio >= 0.70),
            )
        )
    return rows


def table(out: dict[str, Any]) -> str:
    rows = [("mode", "figure", "target", "result"), *targets(out)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("--database-url is required (or set OUTBOX_BENCH_DATABASE_URL)")
    if args.only == "rabbitmq" and not args.rabbitmq_url:
        parser.error("--only rabbitmq needs --rabbitmq-url (or OUTBOX_BENCH_RABBITMQ_URL)")
    began = time.monotonic()
    out, failures = run(args)
    out["bench_seconds"] = round(time.monotonic() - began, 1)
    print()
    print(
        f"sqlalchemy-outbox bench ({'quick' if args.quick else 'full'}): {out['machine_cpus']} CPUs "
        f"({out['machine_cpu_model']}), Python {out['machine_python']}, "
        f"PostgreSQL {out.get('machine_postgresql')}; relay --concurrency {out['relay_concurrency']} "
        f"--batch-size {out['relay_batch_size']}; other load before the run: "
        f"{out['machine_busy_before_pct']} % CPU; {out['bench_seconds']} s"
    )
    print(table(out))
    for name, reason in failures.items():
        print(f"\n{name}: {reason}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
