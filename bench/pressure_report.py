"""The pressure modes in a bench run: each asked-for mode run, its figures flattened, its table rows.

The relay's modes (``bench/pressure.py``) are judged against issue 34 item 1's
targets; the raw queue's (``bench/pressure_raw.py``), run in the same bench
run, are the outside reference beside them and carry no verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .drain import RelaySettings
from .harness import Scratch
from .pressure import (
    CLAIM_P99_MAX_RATIO,
    COMPLETION_MIN,
    PHASES,
    PRESSURE_MODES,
    WAKE_P99_MAX_MS,
    PressureSizes,
    pressure,
)
from .pressure_raw import RAW_MODES, raw_pressure
from .verdicts import verdict

__all__ = ["ALL_PRESSURE_MODES", "pressure_rows", "run_pressure"]

#: Every pressure mode, in the order they run: each relay mode, then its raw reference.
ALL_PRESSURE_MODES = (*PRESSURE_MODES, *RAW_MODES)

Mode = Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None]


def run_pressure(
    mode: Mode,
    out: dict[str, Any],
    scratch: Scratch,
    *,
    sizes: PressureSizes,
    settings: RelaySettings,
    want: Callable[[str], bool],
) -> None:
    """The pressure modes asked for, as modes of one bench run; flat keys ``pressure_<kind>_<phase>_*``."""
    for kind in ALL_PRESSURE_MODES:
        if not want(kind):
            continue
        prefix = kind.replace("-", "_")
        out[f"{prefix}_rate"] = sizes.rate
        out[f"{prefix}_seconds"] = {"clean": sizes.clean_seconds, "pressure": sizes.pressure_seconds}
        result = mode(
            f"{kind} ({sizes.rate:g} msg/s, {sizes.clean_seconds:g} s clean, "
            f"{sizes.pressure_seconds:g} s under pressure)",
            lambda kind=kind: _one(scratch, kind, sizes, settings),  # type: ignore[misc]
        )
        if result:
            out.update(flatten(prefix, result))


def _one(scratch: Scratch, kind: str, sizes: PressureSizes, settings: RelaySettings) -> dict[str, Any]:
    if kind in RAW_MODES:
        return raw_pressure(scratch, kind=kind, sizes=sizes)
    return pressure(scratch, kind=kind, sizes=sizes, settings=settings)


def flatten(prefix: str, result: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {f"{prefix}_messages": result["messages"]}
    for phase in PHASES:
        for key, value in result[phase].items():
            flat[f"{prefix}_{phase}_{key}"] = value
    clean, hold = result["clean"], result["pressure"]
    flat[f"{prefix}_completion_vs_clean"] = round(hold["completion"] / clean["completion"], 3)
    flat[f"{prefix}_claim_p99_vs_clean"] = round(hold["claim_ms_p99"] / clean["claim_ms_p99"], 2)
    return flat


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def pressure_rows(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Per mode that ran: each phase's figures, then the three targets with their verdicts.

    The raw queue's rows are marked ``ref``: they say what the host allows, and judge nothing.
    """
    rows: list[tuple[str, str, str, str]] = []
    for kind in ALL_PRESSURE_MODES:
        judge: Callable[[bool | None], str] = verdict if kind in PRESSURE_MODES else _reference
        prefix = kind.replace("-", "_")
        if f"{prefix}_rate" not in out:
            continue
        for phase in PHASES:
            k = f"{prefix}_{phase}_"
            rows.append(
                (
                    f"34 {kind}, {phase}",
                    f"{_fmt(out.get(k + 'completed_per_s'), ',.0f')} of "
                    f"{_fmt(out.get(k + 'offered_per_s'), ',.0f')} msg/s; claim p50/p99 "
                    f"{_fmt(out.get(k + 'claim_ms_p50'), '.1f')}/"
                    f"{_fmt(out.get(k + 'claim_ms_p99'), '.1f')} ms; "
                    f"wake p99 {_fmt(out.get(k + 'wake_ms_p99'), '.1f')} ms; dead tuples "
                    f"{_fmt(out.get(k + 'dead_message'), ',d')} msg / "
                    f"{_fmt(out.get(k + 'dead_attempt'), ',d')} "
                    f"history; front scan {_fmt(out.get(k + 'front_scan_buffers'), ',d')} buffers; "
                    f"backlog max {_fmt(out.get(k + 'backlog_max'), ',d')}, slowest 10 s "
                    f"{_fmt(out.get(k + 'slowest_10s_per_s'), ',.0f')} msg/s",
                    "",
                    "-",
                )
            )
        completion = out.get(f"{prefix}_completion_vs_clean")
        ratio = out.get(f"{prefix}_claim_p99_vs_clean")
        wake = out.get(f"{prefix}_pressure_wake_ms_p99")
        rows.append(
            (
                f"34 {kind}, completion / clean",
                _fmt(None if completion is None else 100 * completion, ".1f") + " %",
                f">= {100 * COMPLETION_MIN:.0f} %",
                judge(None if completion is None else completion >= COMPLETION_MIN),
            )
        )
        rows.append(
            (
                f"34 {kind}, claim p99 / clean",
                _fmt(ratio, ".2f"),
                f"<= {CLAIM_P99_MAX_RATIO:g}",
                judge(None if ratio is None else ratio <= CLAIM_P99_MAX_RATIO),
            )
        )
        rows.append(
            (
                f"34 {kind}, wake p99 under pressure",
                f"{_fmt(wake, '.2f')} ms",
                f"<= {WAKE_P99_MAX_MS:g} ms",
                judge(None if wake is None else wake <= WAKE_P99_MAX_MS),
            )
        )
    return rows


def _reference(ok: bool | None) -> str:
    return "ref"
