"""Building the mail: strict address parsing, header-injection checks, the deterministic Message-ID.

Everything a payload puts into a header passes through here. Any line break
(CR, LF and every other character ``str.splitlines`` breaks on) or control
character is refused with a :class:`~outbox.PermanentError`, before the email
package sees it: its own check raises a ``ValueError``, which the relay would
treat as transient and retry pointlessly. The same goes for a value whose
RFC 2047 encoded words decode to one (see :func:`header_problem`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from email import policy
from email.headerregistry import Address
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any

from outbox import Message, PermanentError
from outbox.ops import root_key

__all__ = [
    "Body",
    "bad_header_text",
    "build_mail",
    "checked_header",
    "earlier_message_ids",
    "header_problem",
    "message_id_for",
    "parse_address",
    "parse_recipients",
]

#: What the email package (and some mail readers) treat as a line end, plus NUL and other C0 controls.
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")
_LABEL = re.compile(r"^[^\W_](?:[\w-]{0,61}[^\W_])?$")
_MAX_RECIPIENTS = 100
#: How releases before ``outbox.ops.root_key`` took requeue suffixes off a key for the Message-ID.
_EARLIER_REQUEUE_SUFFIX = re.compile(r"(?:~requeue:\d+)+$")
#: Rounds of RFC 2047 decoding a header value is followed through. An honest value settles after
#: one (or none); one still changing after these is nested on purpose, and refused.
_DECODING_ROUNDS = 4

#: 7bit bodies (quoted-printable or base64 when needed): right for every server, 8BITMIME or not.
POLICY = policy.SMTP.clone(cte_type="7bit")


class InvalidAddress(ValueError):
    """An address the handler refuses to put in an envelope or a header."""


def bad_header_text(value: str) -> bool:
    return _UNSAFE.search(value) is not None


def header_problem(value: str) -> str | None:
    """Why ``value`` may not go into a header (as the end of a sentence naming it), or None.

    The email package decodes RFC 2047 encoded words when a header is set
    (``=?utf-8?q?a=0D=0AReply-To:...?=``, ``=?UTF-8?B?...?=``: any charset,
    either encoding, any letter case, even glued to other text) and writes the
    decoded text back out, so an encoded line break becomes a real one on the
    wire, and what follows it forged headers or a body. No supported way of
    setting a header skips that decoding, and encoding the value ourselves
    would only hand the receiver the same encoded word to decode. So the value
    is checked as written and then as the email package's own header parser
    decodes it, the very code that builds the mail: whatever that decoder makes
    of a value is what is checked, however lenient it is. Decoding repeats
    while it changes the value, since text that decodes to an encoded word
    goes out as one, and the receiving mail reader decodes it in turn.
    """
    if bad_header_text(value):
        return "contains a line break or control character"
    for _ in range(_DECODING_ROUNDS):
        try:
            decoded = str(POLICY.header_factory("subject", value))  # unstructured: decodes anywhere
        except Exception:  # the header parser has crash paths on some malformed input
            return "cannot be parsed as header text"
        if decoded == value:
            return None
        if bad_header_text(decoded):
            return "decodes (RFC 2047 encoded word) to a line break or control character"
        value = decoded
    return "holds encoded words nested too deep"


def checked_header(field: str, value: Any, *, source: str | None = None) -> str:
    """A value bound for header ``field``: a string safe as written and decoded, or a permanent error.

    ``source`` names where the value came from for the error (by default the
    payload's field); the error names the header, never the value.
    """
    where = source or f"payload {field!r}"
    if not isinstance(value, str):
        raise PermanentError(f"{where} must be a string", detail={"field": field})
    problem = header_problem(value)
    if problem is not None:
        raise PermanentError(
            f"{where} {problem} (header injection refused)",
            detail={"field": field, "reason": "header_injection"},
        )
    return value.strip()


def _domain(domain: str) -> str:
    try:  # internationalised domains travel as their ASCII (IDNA) form
        ascii_domain = domain.encode("idna").decode("ascii") if not domain.isascii() else domain
    except UnicodeError:
        raise InvalidAddress(f"invalid domain {domain!r}") from None
    labels = ascii_domain.split(".")
    if len(ascii_domain) > 253 or not all(_LABEL.match(label) for label in labels):
        raise InvalidAddress(f"invalid domain {domain!r}")
    return ascii_domain.lower()


def parse_address(value: str) -> Address:
    """One mailbox (``a@example.com`` or ``Name <a@example.com>``), strictly; raises InvalidAddress.

    Group syntax, several addresses in one string, comments the parser had to
    repair and source routes are all refused rather than guessed at.
    """
    problem = header_problem(value)
    if problem is not None:
        raise InvalidAddress(f"address {problem} (header injection refused)")
    try:
        header = policy.default.header_factory("to", value)
        groups = header.groups
    except Exception:  # the header parser has crash paths on some malformed input
        raise InvalidAddress(f"invalid address {value!r}") from None
    defects = [d for d in header.defects if type(d).__name__ != "NonASCIILocalPartDefect"]
    if defects or len(groups) != 1 or groups[0].display_name is not None or len(groups[0].addresses) != 1:
        raise InvalidAddress(
            f"invalid address {value!r} (one mailbox per entry: 'a@example.com' or 'Name <a@...>')"
        )
    mailbox: Address = groups[0].addresses[0]
    local, domain = mailbox.username, mailbox.domain
    if not local or not domain or len(local) > 64 or domain.startswith("["):
        raise InvalidAddress(f"invalid address {value!r}")
    problem = header_problem(mailbox.display_name)
    if problem is not None:  # the parser decoded the display name: check what it made of it again
        raise InvalidAddress(f"display name {problem} (header injection refused)")
    return Address(display_name=mailbox.display_name, username=local, domain=_domain(domain))


def parse_recipients(value: Any) -> list[Address]:
    """The payload's ``to``: one address or a list of them; never empty."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list | tuple) else None
    if not items or len(items) > _MAX_RECIPIENTS or not all(isinstance(v, str) for v in items):
        raise PermanentError(
            f"payload 'to' must be an address or a list of 1 to {_MAX_RECIPIENTS} addresses",
            detail={"field": "to", "reason": "invalid_address"},
        )
    result: list[Address] = []
    for item in items:
        try:
            result.append(parse_address(item))
        except InvalidAddress as exc:
            reason = "header_injection" if "injection" in str(exc) else "invalid_address"
            raise PermanentError(f"payload 'to': {exc}", detail={"field": "to", "reason": reason}) from None
    return result


def message_id_for(message: Message, domain: str) -> str:
    """``<32 hex digits@sender domain>``, the same for every attempt of the message.

    From the idempotency key when the message has one (so re-emitting the same
    key maps to the same mail even after the outbox rows were purged), else from
    the event id; the route's name keeps two email routes of one event apart.
    The key counts through :func:`outbox.ops.root_key`, which is the same for
    a message and every requeued copy of it at any key length, so a copy is
    the same mail and the sent-log still applies.
    """
    if message.key is not None:
        return _message_id(message, "key:" + root_key(message.key), domain)
    return _message_id(message, f"event:{message.event_id}", domain)


def earlier_message_ids(message: Message, domain: str) -> list[str]:
    """Another ``Message-ID`` earlier releases gave the same mail, which the sent-log may hold.

    Those used the whole key, without its requeue suffixes, however long; a
    key of over 227 characters now counts through its shortened stand-in
    instead. A mail accepted under the old ``Message-ID`` is still found.
    """
    if message.key is None:
        return []
    earlier = "key:" + _EARLIER_REQUEUE_SUFFIX.sub("", message.key)
    if earlier == "key:" + root_key(message.key):
        return []
    return [_message_id(message, earlier, domain)]


def _message_id(message: Message, basis: str, domain: str) -> str:
    token = uuid.uuid5(uuid.NAMESPACE_URL, f"outbox-email:{message.handler}:{basis}").hex
    return f"<{token}@{domain}>"


@dataclass(frozen=True, slots=True)
class Body:
    subject: str
    text: str | None
    html: str | None


def build_mail(sender: Address, recipients: list[Address], body: Body, message_id: str) -> EmailMessage:
    mail = EmailMessage(policy=POLICY)
    mail["From"] = sender
    mail["To"] = recipients
    mail["Subject"] = body.subject
    mail["Date"] = formatdate(usegmt=True)
    mail["Message-ID"] = message_id
    if body.text is not None:
        mail.set_content(body.text)
        if body.html is not None:
            mail.add_alternative(body.html, subtype="html")
    else:
        mail.set_content(body.html or "", subtype="html")
    return mail


def needs_smtputf8(addresses: list[Address]) -> bool:
    return any(not a.username.isascii() for a in addresses)
