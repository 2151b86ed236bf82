"""Issue 16's side-by-side: the relay's drain against a plain queue and against pgqueuer.

Three modes, each run once (like the drain, not best of N, so no side gets
a second chance the others do not):

- ``rawqueue``: the raw ceiling without history (``bench/rawqueue.py``);
- ``pgqueuer``: the nearest peer at its documented defaults (``bench/pgqueuer_peer.py``);
- ``drain_default``: the drain of mode 2 with ``outbox-relay`` at its own
  default ``--concurrency`` and ``--batch-size`` (neither flag passed).

Each at 1 and 2 worker processes. The ratios divide the relay's drain rates
by the peers' rates of the same run; the targets (drain at default flags
>= 2.0x pgqueuer and >= 0.5 of the raw ceiling) are checked in the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

from .drain import RelaySettings, drain_postgres
from .harness import Scratch
from .verdicts import rate_ratio_verdict

__all__ = ["PEER_MODES", "peer_rows", "run_peers"]

#: What ``--only`` accepts for these modes, in the order they run.
PEER_MODES = ("drain_default", "rawqueue", "pgqueuer")

#: issue 16 target 2: drain at default flags against each peer, 1 and 2 processes.
VS_PGQUEUER = 2.0
VS_RAWQUEUE = 0.5

Mode = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]


def run_peers(
    mode: Mode,
    out: dict[str, Any],
    scratch: Scratch,
    *,
    count: int,
    settings: RelaySettings,
    want: Callable[[str], bool],
) -> None:
    """Run the wanted peer modes through ``mode`` (the bench's runner), then every ratio they allow."""
    if want("drain_default"):
        defaults = dataclasses.replace(settings, default_sizes=True)
        out["drain_default_flags"] = " ".join(defaults.args())
        for n in (1, 2):
            run = partial(
                drain_postgres,
                scratch,
                relay_count=n,
                count=count,
                settings=defaults,
                purpose=f"draindefault{n}",
            )
            _record_rate(
                mode,
                out,
                f"drain_default_per_s_{n}",
                f"drain, {n} relay(s), outbox-relay's default sizes",
                run,
            )
    if want("rawqueue"):
        from .rawqueue import BATCH, rawqueue

        out["rawqueue_batch"] = BATCH
        for n in (1, 2):
            run = partial(rawqueue, scratch, workers=n, count=count)
            _record_rate(mode, out, f"rawqueue_per_s_{n}", f"raw queue without history, {n} worker(s)", run)
            leased = partial(rawqueue, scratch, workers=n, count=count, variant="lease")
            label = f"raw queue without history, under a lease, {n} worker(s)"
            _record_rate(mode, out, f"rawqueue_lease_per_s_{n}", label, leased)
    if want("pgqueuer"):
        from .pgqueuer_peer import pgqueuer_drain  # pgqueuer only when this mode runs

        for n in (1, 2):
            run = partial(pgqueuer_drain, scratch, workers=n, count=count)
            _record_rate(mode, out, f"pgqueuer_per_s_{n}", f"pgqueuer drain, {n} worker(s)", run)
    out.update(peer_ratios(out))


def _record_rate(
    mode: Mode, out: dict[str, Any], key: str, label: str, run: Callable[[], dict[str, Any]]
) -> None:
    """Run one timed mode; its msg/s goes under ``key`` when it verified."""
    figures = mode(label, run)
    if figures:
        out[key] = figures["per_s"]


def peer_ratios(out: dict[str, Any]) -> dict[str, float]:
    """``<ours>_vs_<peer>_<n>`` for every pair whose rates this run measured."""
    ratios = {}
    for ours, key in (("drain", "drain_per_s"), ("default", "drain_default_per_s")):
        for peer in ("rawqueue", "rawqueue_lease", "pgqueuer"):
            for n in (1, 2):
                mine, theirs = out.get(f"{key}_{n}"), out.get(f"{peer}_per_s_{n}")
                if mine is not None and theirs:
                    ratios[f"{ours}_vs_{peer}_{n}"] = mine / theirs
    return ratios


def _rate(value: Any) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def peer_rows(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The table's rows for these modes: rates, then target 2 per process count."""
    if not any(k.startswith(("rawqueue_", "pgqueuer_", "drain_default_")) for k in out):
        return []
    rows = []
    for n in (1, 2):
        rows.append(
            (
                f"16 peers, {n} process{'es' if n == 2 else ''}",
                f"drain {_rate(out.get(f'drain_per_s_{n}'))}, "
                f"at default sizes {_rate(out.get(f'drain_default_per_s_{n}'))}; "
                f"raw queue {_rate(out.get(f'rawqueue_per_s_{n}'))} "
                f"(under a lease {_rate(out.get(f'rawqueue_lease_per_s_{n}'))}); "
                f"pgqueuer {_rate(out.get(f'pgqueuer_per_s_{n}'))} msg/s",
                "",
                "-",
            )
        )
    for n in (1, 2):
        for peer, target in (("pgqueuer", VS_PGQUEUER), ("rawqueue", VS_RAWQUEUE)):
            ratio = out.get(f"default_vs_{peer}_{n}")
            rows.append(
                (
                    f"16 default sizes / {peer}, {n} process{'es' if n == 2 else ''}",
                    "n/a" if ratio is None else f"{ratio:.2f}",
                    f">= {target:.1f}",
                    rate_ratio_verdict(out, None if ratio is None else ratio >= target),
                )
            )
        lease = out.get(f"default_vs_rawqueue_lease_{n}")
        if lease is not None:  # the same queue without an open transaction across the work
            rows.append(
                (
                    f"16 default sizes / rawqueue under a lease, {n} process{'es' if n == 2 else ''}",
                    f"{lease:.2f}",
                    "",
                    "-",
                )
            )
    return rows
