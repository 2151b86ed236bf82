"""One SMTP transaction, step by step, with every failure sorted into retry or dead.

``smtplib.send_message`` is not used: it hides the server's reply to DATA
(the queue id worth recording), accepts a mail for some recipients while
refusing others, and its context manager raises on a failed QUIT after the
server has already accepted the mail. Here the steps are explicit:

==================================  ============================================
what happened                       outcome
==================================  ============================================
connection refused/reset, timeout   ``RetryLater`` (nothing can have been sent,
                                    except on the final DATA reply, see below)
4xx at any step                     ``RetryLater`` with ``smtp_code``/``smtp_message``
5xx at any step                     ``PermanentError`` with the code
a recipient refused                 all-or-nothing: RSET, no mail to anyone;
                                    dead if any refusal is 5xx, else retried
authentication failed (535, ...)    ``PermanentError``, logged at ERROR
                                    (``action=smtp_auth_failed``)
no STARTTLS / AUTH / SMTPUTF8       ``PermanentError``: a configuration problem
==================================  ============================================

The one ambiguous moment is the reply to the final ``.`` of DATA: a timeout or
a dropped connection there is retried, although the server may have queued the
mail. That retry sends a second copy with the same ``Message-ID``.
"""

from __future__ import annotations

import logging
import smtplib
import socket
import ssl as ssl_module
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.headerregistry import Address
from email.message import EmailMessage
from email.policy import SMTPUTF8
from functools import cache
from typing import Any, NoReturn

from outbox import PermanentError, RetryLater

from ._mail import POLICY, needs_smtputf8

__all__ = ["Accepted", "SmtpSettings", "transact"]

log = logging.getLogger("outbox.integrations.email")

_TEXT_LIMIT = 300


@dataclass(frozen=True, slots=True)
class SmtpSettings:
    host: str
    port: int
    username: str | None
    password: str | None
    starttls: bool
    ssl: bool
    timeout: float
    ssl_context: ssl_module.SSLContext | None

    def __repr__(self) -> str:  # never the password, whoever prints it
        return f"SmtpSettings({self.host}:{self.port}, user={self.username!r})"


@dataclass(frozen=True, slots=True)
class Accepted:
    """The server's reply to DATA."""

    code: int
    text: str

    @property
    def response(self) -> str:
        return f"{self.code} {self.text}"


@cache
def _local_hostname() -> str:
    # smtplib would call getfqdn() (a reverse DNS lookup) on every connection.
    return socket.getfqdn()


def _text(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return " ".join(text.split())[:_TEXT_LIMIT]


def _detail(stage: str, code: int | None = None, text: str | None = None, **extra: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"smtp_stage": stage}
    if code is not None:
        found["smtp_code"] = code
    if text is not None:
        found["smtp_message"] = text
    return {**found, **extra}


#: Stages before the message is named to the server (MAIL FROM): a failure there says nothing about
#: the message (the server is down, busy or unreachable), so its deferral uses up no attempt.
BEFORE_THE_MESSAGE = frozenset({"connect", "ehlo", "starttls"})
#: How long a message waits when the server was unavailable before it heard of the message.
UNAVAILABLE_RETRY = 5.0


def _reply_error(stage: str, code: int, raw: bytes | str, scrub: Callable[[str], str]) -> NoReturn:
    text = scrub(_text(raw))
    detail = _detail(stage, code, text)
    if code == 421 and stage in BEFORE_THE_MESSAGE:  # "service not available" before the message
        raise RetryLater(
            f"SMTP {code} at {stage}: {text}; not counted",
            delay=UNAVAILABLE_RETRY,
            counts_as_attempt=False,
            detail={**detail, "reason": "unavailable"},
        )
    if 400 <= code < 500:
        raise RetryLater(f"SMTP {code} at {stage}: {text}", detail=detail)
    raise PermanentError(f"SMTP {code} at {stage}: {text}", detail=detail)


class _Steps:
    """Which step the conversation is at, and the one deadline all steps share."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.stage = "connect"

    def enter(self, client: smtplib.SMTP, stage: str) -> None:
        self.stage = stage
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the SMTP conversation took longer than {self.timeout:g}s")
        if client.sock is not None:
            client.sock.settimeout(remaining)


def transact(
    settings: SmtpSettings,
    sender: Address,
    recipients: list[Address],
    mail: EmailMessage,
    *,
    scrub: Callable[[str], str],
    before_data: Callable[[], None] | None = None,
) -> Accepted:
    """Deliver ``mail`` to the server in one connection; returns its reply to DATA or raises.

    ``settings.timeout`` bounds the whole conversation, not each read. ``scrub``
    masks the credentials in any server text before it is raised or logged.
    ``before_data`` runs just before DATA (a rate limit's wait: DATA is what a
    provider counts, so spacing it there keeps the spacing the server sees);
    its time does not count against the conversation's deadline, and what it
    raises ends the conversation with nothing sent.
    """
    steps = _Steps(settings.timeout)
    client: smtplib.SMTP | None = None
    try:
        client = _connect(settings)
        steps.enter(client, "ehlo")
        client.ehlo_or_helo_if_needed()
        if settings.starttls:
            steps.enter(client, "starttls")
            if not client.has_extn("starttls"):
                raise PermanentError(
                    f"{settings.host}:{settings.port} does not offer STARTTLS; refusing to continue in clear",
                    detail=_detail("starttls", reason="starttls_unavailable"),
                )
            code, raw = client.starttls(context=settings.ssl_context or ssl_module.create_default_context())
            if code != 220:
                _reply_error("starttls", code, raw, scrub)
            steps.enter(client, "ehlo")
            client.ehlo()
        if settings.username is not None and settings.password is not None:
            steps.enter(client, "auth")
            _login(client, settings, scrub)
        international = needs_smtputf8([sender, *recipients])
        options: list[str] = []
        if international:
            if not client.has_extn("smtputf8"):
                raise PermanentError(
                    "an address needs SMTPUTF8, which the server does not offer",
                    detail=_detail("mail", reason="smtputf8_unavailable"),
                )
            options.append("SMTPUTF8")
        steps.enter(client, "mail")
        code, raw = client.mail(sender.addr_spec, options)
        if code != 250:
            _reply_error("mail", code, raw, scrub)
        _recipients(client, steps, recipients, scrub)
        flattened = mail.as_bytes(policy=SMTPUTF8 if international else POLICY)
        if before_data is not None:
            waiting_since = time.monotonic()
            before_data()
            steps.deadline += time.monotonic() - waiting_since
        steps.enter(client, "data")
        code, raw = client.data(flattened)
        if code != 250:
            _reply_error("data", code, raw, scrub)
        return Accepted(code, scrub(_text(raw)))
    except smtplib.SMTPResponseException as exc:  # the greeting, HELO, or a 354 that never came
        _reply_error(steps.stage, exc.smtp_code, exc.smtp_error, scrub)
    except smtplib.SMTPServerDisconnected as exc:
        _connection_failed(settings, steps.stage, exc, scrub)
    except smtplib.SMTPException as exc:  # "No suitable authentication method found", ...
        text = scrub(_text(str(exc)))
        detail = _detail(steps.stage, error=text)
        raise PermanentError(f"SMTP {steps.stage} failed: {text}", detail=detail) from None
    except OSError as exc:  # refused, reset, unreachable, TLS handshake, timeouts
        _connection_failed(settings, steps.stage, exc, scrub)
    finally:
        if client is not None:
            _close(client)


def _connection_failed(
    settings: SmtpSettings, stage: str, exc: OSError, scrub: Callable[[str], str]
) -> NoReturn:
    # smtplib reports a timed-out read as SMTPServerDisconnected; the timeout is its context.
    timed_out = isinstance(exc, TimeoutError) or isinstance(exc.__context__, TimeoutError)
    kind = "timeout" if timed_out else type(exc).__name__
    text = scrub(_text(str(exc) or kind))
    if stage in BEFORE_THE_MESSAGE:  # refused, reset or silent before the message was named
        raise RetryLater(
            f"SMTP connection to {settings.host}:{settings.port} failed at {stage}: {text}; not counted",
            delay=UNAVAILABLE_RETRY,
            counts_as_attempt=False,
            detail=_detail(stage, error=kind, smtp_message=text, reason="unavailable"),
        ) from None
    raise RetryLater(
        f"SMTP connection to {settings.host}:{settings.port} failed at {stage}: {text}",
        detail=_detail(stage, error=kind, smtp_message=text),
    ) from None


def _connect(settings: SmtpSettings) -> smtplib.SMTP:
    if settings.ssl:
        return smtplib.SMTP_SSL(
            settings.host,
            settings.port,
            local_hostname=_local_hostname(),
            timeout=settings.timeout,
            context=settings.ssl_context or ssl_module.create_default_context(),
        )
    return smtplib.SMTP(
        settings.host, settings.port, local_hostname=_local_hostname(), timeout=settings.timeout
    )


def _login(client: smtplib.SMTP, settings: SmtpSettings, scrub: Callable[[str], str]) -> None:
    assert settings.username is not None and settings.password is not None
    if not client.has_extn("auth"):
        hint = (
            "" if settings.starttls or settings.ssl else "; many servers offer AUTH only after starttls=True"
        )
        log.error(
            "SMTP server %s:%d offers no AUTH for user %r%s",
            settings.host,
            settings.port,
            settings.username,
            hint,
            extra={"action": "smtp_auth_failed", "smtp_host": settings.host},
        )
        raise PermanentError(
            f"{settings.host}:{settings.port} does not offer AUTH{hint}",
            detail=_detail("auth", reason="auth_unavailable"),
        )
    try:
        client.login(settings.username, settings.password)
    except smtplib.SMTPAuthenticationError as exc:
        text = scrub(_text(exc.smtp_error))
        temporary = 400 <= exc.smtp_code < 500
        log.log(
            logging.WARNING if temporary else logging.ERROR,
            "SMTP authentication %s at %s:%d for user %r: %d %s",
            "temporarily failed" if temporary else "FAILED",
            settings.host,
            settings.port,
            settings.username,
            exc.smtp_code,
            text,
            extra={"action": "smtp_auth_failed", "smtp_host": settings.host, "smtp_code": exc.smtp_code},
        )
        detail = _detail("auth", exc.smtp_code, text)
        if temporary:  # 454: the server's authentication backend is down
            raise RetryLater(
                f"SMTP authentication temporarily failed ({exc.smtp_code})", detail=detail
            ) from None
        raise PermanentError(
            f"SMTP authentication failed ({exc.smtp_code}): check the EmailHandler's username and password",
            detail=detail,
        ) from None


def _recipients(
    client: smtplib.SMTP, steps: _Steps, recipients: list[Address], scrub: Callable[[str], str]
) -> None:
    """RCPT for each; any refusal means nobody gets the mail (no half-delivered messages)."""
    refused: dict[str, tuple[int, str]] = {}
    for address in recipients:
        steps.enter(client, "rcpt")
        code, raw = client.rcpt(address.addr_spec)
        if code not in (250, 251):
            refused[address.addr_spec] = (code, scrub(_text(raw)))
    if not refused:
        return
    try:
        client.rset()
    except (OSError, smtplib.SMTPException):
        pass  # the connection is closed next anyway
    code, text = next(iter(refused.values()))
    permanent = [a for a, (c, _) in refused.items() if not 400 <= c < 500]
    detail = _detail("rcpt", code, text, refused={a: c for a, (c, _) in refused.items()})
    if permanent:
        raise PermanentError(
            f"recipient(s) refused: {', '.join(permanent)} ({refused[permanent[0]][0]}); nothing was sent",
            detail={
                **detail,
                "smtp_code": refused[permanent[0]][0],
                "smtp_message": refused[permanent[0]][1],
            },
        )
    raise RetryLater(f"recipient(s) temporarily refused ({code}); nothing was sent", detail=detail)


def _close(client: smtplib.SMTP) -> None:
    """QUIT politely; whatever goes wrong now cannot change what the server accepted."""
    try:
        client.quit()
    except (OSError, smtplib.SMTPException):
        pass
    finally:
        client.close()
