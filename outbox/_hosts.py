"""The host names a web server answers to, checked where they are written.

The dashboard refuses a request whose ``Host`` header it was not told about
(DNS rebinding). ``outbox dashboard --allowed-host`` and
``create_app(allowed_hosts=...)`` both take their names through
:func:`host_name`, so a value no ``Host`` header could ever match (a port, a
URL, a wildcard) is refused where it is given, not discovered later as a page
that answers 421. Standard library only: the command checks its flags before
it imports the dashboard's extra.
"""

from __future__ import annotations

import ipaddress
import re

from ._argparse import shown

__all__ = ["host_name"]

#: One label of a DNS name; underscores too, since container and service names use them.
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_MAX_NAME = 253


def host_name(value: str) -> str:
    """``value`` as the dashboard compares it with a ``Host`` header (lower case, IPv6 in brackets).

    Raises ``ValueError`` with one line saying what to write instead. The
    port is never part of the name: a ``Host`` header's port is ignored, so a
    listed name is accepted on any port, as the loopback names are.
    """
    name = value.lower()
    if not name:
        raise ValueError("a host name is empty")
    if "/" in name:
        raise ValueError(f"{shown(value)} is a URL: give the host name alone (e.g. ops.example.com)")
    if "*" in name:
        raise ValueError(f"{shown(value)}: wildcards are not supported; list each host name")
    inner = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    if ":" in inner:
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            if name.count(":") == 1 or "]:" in name:
                raise ValueError(
                    f"{shown(value)} has a port: give the host name alone (it is accepted on any port)"
                ) from None
            raise ValueError(f"{shown(value)} is neither a host name nor an IP address") from None
        return f"[{inner}]"  # the form a Host header carries
    if len(name) > _MAX_NAME or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        hint = " (write an internationalised name in its xn-- form)" if not name.isascii() else ""
        raise ValueError(f"{shown(value)} is not a host name{hint}")
    return name
