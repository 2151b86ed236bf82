"""``--app module:attribute``: the object a command serves, imported the way ``python -m`` would.

Shared by ``outbox-relay`` (an Outbox) and ``outbox-consumer`` (an Inbox). A
mistake is one line that says which: a module that is not there, an import
that raised (with the file and line that raised; ``--log-level DEBUG`` logs
the whole traceback), an attribute that is missing or of the wrong kind.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from typing import Any, TypeVar

from ._exceptions import ConfigurationError

__all__ = ["load_app"]

T = TypeVar("T")

log = logging.getLogger("outbox")


def _failing_line(exc: BaseException) -> str:
    """``file:line`` of the frame that raised (for a syntax error, of the bad line), importlib left out."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen ")]
    if not frames:
        return "an unknown line"
    return f"{frames[-1].filename}:{frames[-1].lineno}"


def load_app(spec: str, kind: type[T], example: str) -> T:
    """Import ``module:attribute`` (the attribute may also be a function returning the object)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"--app must look like module:attribute (e.g. {example}), got {spec!r}")
    # Like `python -m`, resolve the application from the working directory.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the module itself is not there
            raise ConfigurationError(f"--app {spec}: cannot import {module_name!r}: {exc}") from None
        log.debug("importing %r failed", module_name, exc_info=True, extra={"action": "app_error"})
        raise ConfigurationError(
            f"--app {spec}: importing {module_name!r} failed at {_failing_line(exc)}: {exc}"
        ) from None
    except Exception as exc:
        # A bug in the application's module: the one line says where, DEBUG logs the whole traceback.
        log.debug("importing %r failed", module_name, exc_info=True, extra={"action": "app_error"})
        raise ConfigurationError(
            f"--app {spec}: importing {module_name!r} raised {type(exc).__name__}"
            f" at {_failing_line(exc)}: {exc}"
        ) from None
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(
                f"--app {spec}: {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not isinstance(target, kind) and callable(target):
        target = target()
    if not isinstance(target, kind):
        expected = f"{kind.__module__.split('.')[0]}.{kind.__name__}"
        raise ConfigurationError(f"--app {spec} is a {type(target).__name__}, not an {expected}")
    return target
