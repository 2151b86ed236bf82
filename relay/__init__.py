"""The relay: claims committed outbox messages and delivers them to their handlers.

Importing this package is what an emitting application never has to do; the
``outbox-relay`` command and :class:`Relay` live here.
"""

from .startup import DatabaseUnavailable
from .worker import DrainResult, Relay

__all__ = ["DatabaseUnavailable", "DrainResult", "Relay"]
