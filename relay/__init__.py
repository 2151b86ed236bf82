"""The relay: claims committed outbox messages and delivers them to their handlers.

Importing this package is what an emitting application never has to do; the
``outbox-relay`` command and :class:`Relay` live here.
"""

from .relay import DEFAULT_CONCURRENCY, DrainResult, Relay
from .startup import DatabaseUnavailable

__all__ = ["DEFAULT_CONCURRENCY", "DatabaseUnavailable", "DrainResult", "Relay"]
