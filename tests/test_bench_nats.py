"""The bench's NATS mode (issue 15), run for real at a tiny size against the local JetStream.

The bare nats-py loop and a relay subprocess publish the same messages; the
mode itself checks that each stream holds every message once. Asserted here:
both rates and both CPU figures are read, the relay delivered each message
once, and the mode leaves no stream behind. Never a speed.
"""

from __future__ import annotations

import asyncio
import os

import nats
import pytest

from bench.drain import RelaySettings
from bench.harness import Scratch
from bench.nats import nats_publish
from bench.verify import Expected, check_delivered

pytestmark = pytest.mark.postgres

URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
COUNT = 200


def _stream_names() -> set[str | None]:
    async def names() -> set[str | None]:
        nc = await nats.connect(URL, connect_timeout=2, max_reconnect_attempts=0)
        try:
            return {info.config.name for info in await nc.jetstream().streams_info()}
        finally:
            await nc.close()

    return asyncio.run(names())


def test_nats_mode_reads_both_rates_and_both_cpu_figures(scratch: Scratch) -> None:
    out = nats_publish(scratch, url=URL, count=COUNT, settings=RelaySettings(concurrency=40, batch_size=20))

    assert out["raw_per_s"] > 0 and out["outbox_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["outbox_per_s"] / out["raw_per_s"])
    # What bounds the ratio when both sides are busy on one core each.
    assert out["relay_cpu_us_per_msg"] > 0 and out["raw_cpu_us_per_msg"] > 0
    url = scratch.server.set(database=f"{scratch.tag}_nats")
    assert check_delivered(url, Expected(COUNT, relays=["relay1"]))["history_rows"] == COUNT
    tag = str(os.getpid())
    assert not {f"BENCH_RAW_{tag}", f"BENCH_OUTBOX_{tag}"} & _stream_names()
