"""Log output for the relay process: human text, or one JSON object per line for collectors.

Every record the relay logs carries ``extra={"action": ...}`` (claim, deliver,
retry, dead, lease_expired, db_error, ...); the JSON form keeps those fields
as keys so a log pipeline can filter on them without parsing prose.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["QUIETED", "JSONFormatter", "configure"]

#: Libraries whose INFO lines duplicate the relay's own: kept at WARNING unless the level is DEBUG.
QUIETED = ("httpx", "httpcore")

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def configure(level: str, fmt: Literal["text", "json"]) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs one INFO line per request: the relay's own line per delivery already says it.
    for noisy in QUIETED:
        logging.getLogger(noisy).setLevel(logging.NOTSET if level.upper() == "DEBUG" else logging.WARNING)
