"""One line for an error, as logs and command-line reports quote it."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(error: BaseException) -> str:
    """The first line of what the error says, or its type's name when it says nothing.

    For SQLAlchemy's wrapped errors this is the driver's own message: the
    wrapper's later lines quote the statement and its parameters, which may
    hold payloads or secrets and have no place in a log line. An error whose
    ``str()`` itself fails is named by its type.
    """
    try:
        text = str(getattr(error, "orig", None) or error).strip()
    except Exception:
        return type(error).__name__
    return text.splitlines()[0] if text else type(error).__name__
