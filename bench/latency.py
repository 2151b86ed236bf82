"""Mode 4: commit-to-handler-start latency through an idle relay woken by LISTEN/NOTIFY.

The benchmark process emits one event per ORM transaction at a fixed rate (on
a schedule, so a slow commit does not shift the later ones) and takes
``time.time()`` right after each commit returns; the relay's ``latency``
handler takes ``time.time()`` as its first step. Same machine, same clock.
The relay polls only every 30 s, so every delivery measured here was woken
by NOTIFY. The check: every event delivered exactly once, one history row each.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import create_engine

from outbox import emit

from .app import EVENTS
from .drain import RelaySettings
from .emit import Base, Order, outbox_sessions
from .harness import Scratch, relays, wait_drained, wait_listening
from .verify import Expected, check_delivered, percentile, read_handler_starts, read_traces

__all__ = ["wake_latency"]


def wake_latency(scratch: Scratch, *, rate: float, seconds: float, settings: RelaySettings) -> dict[str, Any]:
    url = scratch.postgres("latency")
    workdir = scratch.subdir("latency")
    samples = workdir / "handler-starts.txt"
    count = round(rate * seconds)
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    sessions = outbox_sessions()
    sessions.configure(bind=engine)
    committed: dict[int, float] = {}
    env = {"BENCH_TRACE_DIR": str(workdir), "BENCH_LATENCY_FILE": str(samples)}
    try:
        with relays(url, 1, settings.args(poll_interval=30.0), workdir=workdir, env=env) as procs:
            wait_listening(url, procs)
            began = time.monotonic()
            for n in range(count):
                pause = began + n / rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                with sessions() as session, session.begin():
                    session.add(Order(n=n, kind="latency", note=f"order {n}"))
                    emit(session, EVENTS["latency"], {"n": n})
                committed[n] = time.time()
            wait_drained(url, count, procs, 60.0)
            procs[0].stop()
    finally:
        engine.dispose()
    expected = Expected(count, relays=[procs[0].name])
    check_delivered(url, expected)
    read_traces(workdir, "latency", expected)
    started = read_handler_starts(samples, committed)
    latencies = [(started[n] - committed[n]) * 1000 for n in committed]
    return {
        "p50": percentile(latencies, 50),
        "p95": percentile(latencies, 95),
        "p99": percentile(latencies, 99),
        "max": max(latencies),
        "samples": len(latencies),
    }
