"""Scrub secrets from anything the relay writes to history or logs.

Exceptions routinely echo credentials (an SMTP library quoting the AUTH line, an
HTTP client quoting a URL with a token). The relay knows the secret values its
handlers declare and replaces them wherever they appear; mapping keys that name
a secret are masked whatever their value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MASK", "Redactor"]

MASK = "***"
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
        if isinstance(value, str):
            return self.text(value)
        if value is None or isinstance(value, int | float):  # the common case, before the ABC check
            return value
        if isinstance(value, Mapping):
            return self.mapping(value)
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

    def mapping(self, data: Mapping[str, Any]) -> dict[str, Any]:
        masked = {}
        for k, v in data.items():
            key = k if type(k) is str else str(k)
            masked[key] = MASK if _names_a_secret(key) else self.value(v)
        return masked
