"""librdkafka's mock Kafka cluster for the tests: the driver lives with the benchmark, which hosts one too."""

from bench.kafkamock import INIT_PRODUCER_ID, LIB, PRODUCE, MockCluster

__all__ = ["INIT_PRODUCER_ID", "LIB", "PRODUCE", "MockCluster"]
