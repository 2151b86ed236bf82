"""The bench's Kafka mode, run for real at a tiny size against librdkafka's mock cluster.

The bare producer loop and a relay subprocess produce the same messages into
a mock cluster of the mode's own; the mode itself checks that each topic holds
every message once. Asserted here: both rates and both CPU figures are read,
the relay delivered each message once, and the cluster's process is gone
afterwards. Never a speed.
"""

from __future__ import annotations

import subprocess

import pytest

from bench.drain import RelaySettings
from bench.harness import Scratch
from bench.kafka import kafka_produce
from bench.verify import Expected, check_delivered

pytestmark = pytest.mark.postgres

COUNT = 200


def _clusters() -> list[str]:
    found = subprocess.run(["pgrep", "-f", "bench.kafkamock import serve"], capture_output=True, text=True)
    return found.stdout.split()


def test_kafka_mode_reads_both_rates_and_both_cpu_figures(scratch: Scratch) -> None:
    before = set(_clusters())
    out = kafka_produce(scratch, count=COUNT, settings=RelaySettings(concurrency=40, batch_size=20))

    assert out["raw_per_s"] > 0 and out["outbox_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["outbox_per_s"] / out["raw_per_s"])
    assert out["relay_cpu_us_per_msg"] > 0 and out["raw_cpu_us_per_msg"] > 0
    url = scratch.server.set(database=f"{scratch.tag}_kafka")
    assert check_delivered(url, Expected(COUNT, relays=["relay1"]))["history_rows"] == COUNT
    assert set(_clusters()) <= before, "the mode left its mock cluster running"
