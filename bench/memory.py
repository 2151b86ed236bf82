"""Mode 6: the relay's peak resident set after 10,000 and after 100,000 deliveries.

One relay process serves the whole run. It drains a first backlog, then (in
the same process) a second one that brings it to the larger total; after each
drain the benchmark reads ``VmHWM`` (the kernel's high-water mark of the
resident set) from ``/proc/<pid>/status``. The handler keeps only a call
counter here, no per-message state, so what grows is the relay's own.
The check: every message delivered once, one history row each, and the
handler's call count equal to the number of messages.
"""

from __future__ import annotations

from typing import Any

from .drain import RelaySettings
from .harness import Scratch, prefill, relays, wait_drained, wait_listening
from .verify import Expected, Unverified, check_delivered, drain_window, read_calls

__all__ = ["peak_rss"]


def peak_rss(scratch: Scratch, *, small: int, large: int, settings: RelaySettings) -> dict[str, Any]:
    url = scratch.postgres("memory")
    workdir = scratch.subdir("memory")
    env = {"BENCH_COUNT_DIR": str(workdir)}
    with relays(url, 1, settings.args(), workdir=workdir, env=env) as procs:
        relay = procs[0]
        wait_listening(url, procs)
        idle_kb = relay.status_kb("VmHWM")
        prefill(url, "noop", small)
        wait_drained(url, small, procs, 60.0 + small / 200)
        small_kb = relay.status_kb("VmHWM")
        committed = prefill(url, "noop", large - small, first=small)
        wait_drained(url, large, procs, 60.0 + large / 200)
        large_kb = relay.status_kb("VmHWM")
        rss_kb = relay.status_kb("VmRSS")
        relay.stop()
    check_delivered(url, Expected(large, relays=[relay.name]))
    _, _, written = drain_window(url)
    calls = read_calls(workdir, "noop")
    if calls != large:
        raise Unverified(f"the handler ran {calls} times for {large} messages")
    return {
        "idle_mb": idle_kb / 1024,
        "small_mb": small_kb / 1024,
        "large_mb": large_kb / 1024,
        "rss_end_mb": rss_kb / 1024,
        "growth": large_kb / small_kb - 1,
        # the second backlog is large: a claim whose cost grows with the backlog shows here
        "large_backlog_per_s": (large - small) / (written.timestamp() - committed),
    }
