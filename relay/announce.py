"""Sending the relay's blinker signals without letting a receiver stop the relay.

Receivers are user code (metrics, tracing, an embedded app's hooks). blinker's
own ``send`` stops at the first receiver that raises and hands the exception
to the sender; in the relay that sender is a claim round, the outcome writer
or the lease recoverer, and a receiver's bug would stop deliveries, recording
or recovery. Every signal the relay sends therefore goes through :func:`send`,
which calls each receiver on its own and logs one that raises (action
``signal_error``, with the signal's and the receiver's names), then carries on.

``KeyboardInterrupt`` and ``SystemExit`` are not receivers' bugs: they pass.
"""

from __future__ import annotations

import inspect
from typing import Any

from blinker import NamedSignal

from .run_context import log

__all__ = ["send"]


def send(signal: NamedSignal, sender: Any, **kwargs: Any) -> None:
    if not signal.receivers:  # the common case, on the hot path: nobody listens
        return
    for receiver in list(signal.receivers_for(sender)):
        try:
            result = receiver(sender, **kwargs)
            if inspect.iscoroutine(result):
                result.close()
                raise TypeError("async receivers are not supported: the relay sends signals synchronously")
        except Exception as exc:
            name = signal.name.replace("-", "_")
            relay = kwargs.get("relay")
            log.error(
                "a %s receiver (%s) raised %s; the relay carries on",
                name,
                _name_of(receiver),
                type(exc).__name__,
                exc_info=True,
                extra={
                    "action": "signal_error",
                    "signal": name,
                    "receiver": _name_of(receiver),
                    "relay_id": getattr(relay, "id", None),
                },
            )


def _name_of(receiver: Any) -> str:
    name = getattr(receiver, "__qualname__", None) or type(receiver).__qualname__
    module = getattr(receiver, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) else str(name)
