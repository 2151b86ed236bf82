"""The consuming runtime: ``outbox-consumer`` and :class:`Consumer` run an inbox's broker sources.

Installed as ``outbox.consumer``; the core never imports it.
"""

from .metrics import ConsumerMetrics
from .runner import Consumer, ConsumerUnavailable

__all__ = ["Consumer", "ConsumerMetrics", "ConsumerUnavailable"]
