"""Scrub secrets from anything the relay writes to history or logs.

Exceptions routinely echo credentials (an SMTP library quoting the AUTH line, an
HTTP client quoting a URL with a token). The relay knows the secret values its
handlers declare and replaces them wherever they appear; mapping keys that name
a secret are masked whatever their value.

Operators' readers (``outbox show``, the dashboard, ``outbox tail``) pass every
stored document through a redactor before printing it, including rows written
before emit() capped nesting, or by other writers, so the copy is made with a
loop and a stack of its own: no document is too deep for it. What lies deeper
than ``DEPTH_SHOWN`` levels is replaced by a marker, which keeps the copy safe
for the recursive JSON encoders that print it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from itertools import repeat
from typing import Any

__all__ = ["CYCLE", "DEPTH_SHOWN", "MASK", "TOO_DEEP", "Redactor"]

MASK = "***"
#: Levels of objects and arrays a redacted copy keeps, the document itself being level 1: as
#: deep as emit() ever lets a payload nest (``Outbox(payload_depth_limit=...)`` allows no more).
DEPTH_SHOWN = 256
#: In place of an object or array deeper than ``DEPTH_SHOWN``.
TOO_DEEP = f"… (nested deeper than {DEPTH_SHOWN} levels, not shown)"
#: In place of an object or array inside itself (a handler's detail can be anything).
CYCLE = "… (contains itself, not shown)"
_SECRET_KEY = re.compile(r"pass(word)?|secret|token|api[_-]?key|authorization|cookie", re.IGNORECASE)


#: Whether a key names a secret, per key seen: handlers return the same few keys with every
#: delivery, and the search ran for each of them each time. Bounded: keys are the handlers' choice.
_KEY_VERDICTS: dict[str, bool] = {}
_KEY_VERDICTS_MAX = 4096


def _names_a_secret(key: str) -> bool:
    verdict = _KEY_VERDICTS.get(key)
    if verdict is None:
        verdict = _SECRET_KEY.search(key) is not None
        if len(_KEY_VERDICTS) < _KEY_VERDICTS_MAX:
            _KEY_VERDICTS[key] = verdict
    return verdict


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first, so a secret containing another is masked whole.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def text(self, value: str) -> str:
        for secret in self._secrets:
            value = value.replace(secret, MASK)
        return value

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like value with secrets masked; never deeper than ``DEPTH_SHOWN``."""
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, int | float):  # the common case, before the ABC check
            return value
        if isinstance(value, dict | list | tuple) or isinstance(value, Mapping):
            return self._copy(value)
        return value

    def mapping(self, data: Mapping[Any, Any]) -> dict[str, Any]:
        masked: dict[str, Any] = self._copy(data)
        return masked

    def _copy(self, root: Mapping[Any, Any] | list[Any] | tuple[Any, ...]) -> Any:
        """The masked copy, made level by level with a stack rather than by recursion.

        Each stack entry is a container being filled, the source entries still
        to copy into it, and the source's id (to notice a container met again
        inside itself).
        """
        top, entries = _empty_like(root)
        stack = [(top, entries, id(root))]
        is_open = {id(root)}
        while stack:
            target, entries, _ = stack[-1]
            into_mapping = type(target) is dict
            for key, item in entries:
                if into_mapping:
                    key = key if type(key) is str else str(key)
                    if _names_a_secret(key):
                        target[key] = MASK
                        continue
                if isinstance(item, str):
                    item = self.text(item)
                elif item is None or isinstance(item, int | float):
                    pass
                elif isinstance(item, dict | list | tuple) or isinstance(item, Mapping):  # the ABC last: slow
                    if len(stack) >= DEPTH_SHOWN:
                        item = TOO_DEEP
                    elif id(item) in is_open:
                        item = CYCLE
                    else:
                        child, child_entries = _empty_like(item)
                        if into_mapping:
                            target[key] = child
                        else:
                            target.append(child)
                        stack.append((child, child_entries, id(item)))
                        is_open.add(id(item))
                        break  # the child is copied next; this level's entries resume after it
                if into_mapping:
                    target[key] = item
                else:
                    target.append(item)
            else:
                is_open.discard(stack.pop()[2])
        return top


def _empty_like(value: Mapping[Any, Any] | list[Any] | tuple[Any, ...]) -> tuple[Any, Iterator[Any]]:
    """An empty dict or list to copy ``value`` into, and its (key, item) pairs (key None in a list)."""
    if isinstance(value, list | tuple):
        return [], zip(repeat(None), value)
    return {}, iter(value.items())
