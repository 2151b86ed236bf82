"""librdkafka's mock Kafka cluster, driven through its C API: Kafka for the tests and the bench, no server.

confluent-kafka exposes the mock cluster only as ``test.mock.num.brokers``,
which hides the cluster inside one client; the fault injection the tests need
(request errors, brokers going down) is librdkafka's public mock API
(``rdkafka_mock.h``), which this module calls with ctypes on the very library
confluent-kafka loaded. The brokers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from pathlib import Path
from typing import Any

import confluent_kafka

#: Kafka protocol API keys (the mock cluster injects errors per request type).
PRODUCE = 0
INIT_PRODUCER_ID = 22


def _library_path() -> str | None:
    """The librdkafka confluent-kafka runs on: the mapped one if we can see it, else the wheel's copy."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "librdkafka" in os.path.basename(path):
                    return path
    except OSError:
        pass
    package = Path(confluent_kafka.__file__).parent
    for pattern in ("../confluent_kafka.libs/librdkafka*", ".dylibs/librdkafka*"):
        found = sorted(glob.glob(str(package / pattern)))
        if found:
            return found[0]
    return ctypes.util.find_library("rdkafka")


def _load() -> ctypes.CDLL | None:
    path = _library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.rd_kafka_mock_cluster_new  # noqa: B018 - built without the mock cluster?
    except (OSError, AttributeError):
        return None
    vp, cp, i32, i16 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int16
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "rd_kafka_conf_new": (vp, []),
        "rd_kafka_conf_set": (ctypes.c_int, [vp, cp, cp, cp, ctypes.c_size_t]),
        "rd_kafka_new": (vp, [ctypes.c_int, vp, cp, ctypes.c_size_t]),
        "rd_kafka_destroy": (None, [vp]),
        "rd_kafka_mock_cluster_new": (vp, [vp, ctypes.c_int]),
        "rd_kafka_mock_cluster_destroy": (None, [vp]),
        "rd_kafka_mock_cluster_bootstraps": (cp, [vp]),
        "rd_kafka_mock_topic_create": (ctypes.c_int, [vp, cp, ctypes.c_int, ctypes.c_int]),
        "rd_kafka_mock_broker_set_down": (ctypes.c_int, [vp, i32]),
        "rd_kafka_mock_broker_set_up": (ctypes.c_int, [vp, i32]),
        "rd_kafka_mock_push_request_errors_array": (
            None,
            [vp, i16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)],
        ),
        "rd_kafka_mock_clear_request_errors": (None, [vp, i16]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


LIB = _load()


class MockCluster:
    """A mock cluster of ``brokers`` brokers (ids 1..n) on 127.0.0.1, owned by a bare librdkafka handle."""

    def __init__(self, brokers: int = 3) -> None:
        if LIB is None:
            raise RuntimeError("librdkafka's mock cluster API is not reachable from this confluent-kafka")
        self.brokers = brokers
        errstr = ctypes.create_string_buffer(512)
        conf = LIB.rd_kafka_conf_new()
        # A handle of its own only hosts the cluster's thread; it never connects anywhere.
        LIB.rd_kafka_conf_set(conf, b"log_level", b"0", errstr, len(errstr))
        self._rk = LIB.rd_kafka_new(0, conf, errstr, len(errstr))  # RD_KAFKA_PRODUCER
        if not self._rk:
            raise RuntimeError(f"rd_kafka_new failed: {errstr.value.decode()}")
        self._mc = LIB.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not self._mc:
            LIB.rd_kafka_destroy(self._rk)
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        self.bootstrap_servers: str = LIB.rd_kafka_mock_cluster_bootstraps(self._mc).decode()
        for server in self.bootstrap_servers.split(","):
            host = server.rpartition(":")[0]
            assert host in ("127.0.0.1", "localhost", "[::1]"), f"mock broker not on loopback: {server}"

    def create_topic(self, name: str, partitions: int = 3, replication: int = 3) -> None:
        assert LIB is not None
        err = LIB.rd_kafka_mock_topic_create(self._mc, name.encode(), partitions, replication)
        assert err == 0, f"topic {name}: error {err}"

    def push_errors(self, api_key: int, *errors: int) -> None:
        """The next ``len(errors)`` requests of this type (to any broker) fail with these codes."""
        assert LIB is not None
        array = (ctypes.c_int * len(errors))(*errors)
        LIB.rd_kafka_mock_push_request_errors_array(self._mc, api_key, len(errors), array)

    def clear_errors(self, api_key: int) -> None:
        assert LIB is not None
        LIB.rd_kafka_mock_clear_request_errors(self._mc, api_key)

    def set_down(self) -> None:
        """Every broker closes its connections and refuses new ones (until :meth:`set_up`)."""
        assert LIB is not None
        for broker in range(1, self.brokers + 1):
            LIB.rd_kafka_mock_broker_set_down(self._mc, broker)

    def set_up(self) -> None:
        assert LIB is not None
        for broker in range(1, self.brokers + 1):
            LIB.rd_kafka_mock_broker_set_up(self._mc, broker)

    def set_initial_rebalance_delay(self, ms: int) -> None:
        """How long a new consumer group waits for more members before its first assignment.

        The mock cluster's default is a few seconds (a broker's
        ``group.initial.rebalance.delay.ms``); tests that start consumers want
        them assigned at once.
        """
        assert LIB is not None
        function = LIB.rd_kafka_mock_group_initial_rebalance_delay_ms
        function.restype, function.argtypes = None, [ctypes.c_void_p, ctypes.c_int32]
        function(self._mc, ms)

    def close(self) -> None:
        if LIB is not None and self._mc:
            LIB.rd_kafka_mock_cluster_destroy(self._mc)
            LIB.rd_kafka_destroy(self._rk)
            self._mc = self._rk = None


def serve() -> None:
    """``python -c 'from bench.kafkamock import serve; serve()' TOPIC...``: a one-broker cluster of its own.

    It creates the topics (3 partitions each), prints its bootstrap servers on
    one line and runs until its standard input closes. A process of its own
    keeps the brokers' CPU out of the figures of whoever produces to them.
    """
    import sys

    cluster = MockCluster(brokers=1)
    try:
        for topic in sys.argv[1:]:
            cluster.create_topic(topic, partitions=3, replication=1)
        print(cluster.bootstrap_servers, flush=True)
        sys.stdin.read()
    finally:
        cluster.close()
