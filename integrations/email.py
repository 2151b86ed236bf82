"""Email over SMTP, sent at most once per message once the server has accepted it.

::

    from outbox.integrations.email import EmailHandler, SentLog

    ob.route(
        "user.signed_up",
        EmailHandler("smtp.example.com", 587, sender="Shop <shop@example.com>", username="shop",
                     password=os.environ["SMTP_PASSWORD"], starttls=True, sent_log=SentLog(engine),
                     templates="templates/email", rate_limit=10),
        name="welcome_email",
    )
    emit(s, "user.signed_up", {"to": "ada@example.com", "template": "welcome", "context": {"name": "Ada"}})

A payload names ``to`` (an address or a list) and either ``subject`` with
``text`` and/or ``html``, or ``template`` with ``context``: the templates
``<name>.subject.txt`` (required), ``<name>.txt`` and/or ``<name>.html``,
rendered by a sandboxed Jinja2 environment that autoescapes ``.html`` only.
``emit()`` checks that shape through :meth:`EmailHandler.outbox_validate`, so a
payload the handler could not send is refused in the request; a route's
``transform=`` can build it from an event payload of another shape.

Exactly-once effect: the ``Message-ID`` derives from the message's key (or its
event id) and route, and the sent-log (``outbox_email_sent``) records it right
after the server accepts the mail; a later attempt of the same message finds it
there and sends nothing. The residual window is a crash (or a lost reply) between
the server's acceptance and that record: the mail may then go twice, with the
same ``Message-ID``, which lets receiving systems deduplicate. ``docs/email.md``
has the whole story.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import math
import os
import ssl as ssl_module
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import ConfigurationError, Message, PayloadError, PermanentError, RetryLater

from ._mail import (
    Body,
    InvalidAddress,
    bad_header_text,
    build_mail,
    earlier_message_ids,
    message_id_for,
    parse_address,
    parse_recipients,
)
from ._mail_body import environment, payload_mapping, ready_body, render, template_request, templates_of
from ._ratelimit import RateLimited, RateLimiter
from ._sentlog import SentLog, SentRecord, email_metadata, outbox_email_sent
from ._smtp import SmtpSettings, transact

if TYPE_CHECKING:
    from email.headerregistry import Address
    from email.message import EmailMessage

    from jinja2 import BaseLoader

__all__ = ["EmailHandler", "RateLimiter", "SentLog", "SentRecord", "email_metadata", "outbox_email_sent"]

log = logging.getLogger("outbox.integrations.email")

#: The longest a delivery holds its worker thread waiting, for a connection slot and the rate
#: limit together; a longer wait is handed back to the relay as a deferral that does not use up
#: an attempt. With the default route timeout (30 s) and SMTP timeout (20 s), the waits plus the
#: conversation still fit the route's.
MAX_RATE_WAIT = 5.0

#: SMTP connections one handler has open at once, by default. The relay runs up to its
#: concurrency (200 by default) deliveries at once, and a mail server that takes fewer answers
#: the rest with 421 at connect: each such answer would use up an attempt, so a long backlog
#: could exhaust its messages' attempts against a server that was only busy. Mail servers
#: commonly allow a few to a few dozen connections from one client.
DEFAULT_MAX_CONNECTIONS = 10

#: When a delivery that found every connection busy is tried again.
BUSY_RETRY = 1.0

#: ``context_loader(message)``: more template context, loaded when the message runs.
ContextLoader = Callable[[Message], Mapping[str, Any]]


class EmailHandler:
    """Send a message's payload as one email over SMTP.

    A plain callable: the relay runs it on a worker thread, one SMTP connection
    per mail, at most ``max_connections`` of them at once (``None``: as many as
    the relay runs deliveries). Safe to share between concurrent deliveries.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 25,
        *,
        sender: str,
        username: str | None = None,
        password: str | None = None,
        starttls: bool = False,
        ssl: bool = False,
        templates: str | os.PathLike[str] | BaseLoader | None = None,
        timeout: float = 20.0,
        rate_limit: float | RateLimiter | None = None,
        max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
        sent_log: SentLog | Engine | bool | None = True,
        context_loader: ContextLoader | None = None,
        ssl_context: ssl_module.SSLContext | None = None,
    ) -> None:
        if not isinstance(host, str) or not host or bad_header_text(host) or " " in host:
            raise ConfigurationError(f"EmailHandler: host must be a host name, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigurationError(f"EmailHandler: port must be 1-65535, got {port!r}")
        if starttls and ssl:
            raise ConfigurationError(
                "EmailHandler: choose starttls=True (port 587) or ssl=True (port 465), not both"
            )
        if (username is None) != (password is None):
            raise ConfigurationError("EmailHandler: username and password go together")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ConfigurationError(
                f"EmailHandler: timeout must be a positive number of seconds, got {timeout!r}"
            )
        if ssl_context is not None and not isinstance(ssl_context, ssl_module.SSLContext):
            raise ConfigurationError(
                f"EmailHandler: ssl_context must be an ssl.SSLContext, got {ssl_context!r}"
            )
        if max_connections is not None and (
            isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1
        ):
            raise ConfigurationError(
                f"EmailHandler: max_connections must be an integer >= 1 or None, got {max_connections!r}"
            )
        if context_loader is not None and not callable(context_loader):
            raise ConfigurationError("EmailHandler: context_loader must be a callable taking the Message")
        try:
            if not isinstance(sender, str):
                raise InvalidAddress(sender)
            self._sender: Address = parse_address(sender)
        except InvalidAddress:
            raise ConfigurationError(
                f"EmailHandler: sender must be one email address, got {sender!r}"
            ) from None
        self.host, self.port, self.sender = host, port, sender
        self.username = username
        self.timeout = float(timeout)
        self._smtp = SmtpSettings(host, port, username, password, starttls, ssl, self.timeout, ssl_context)
        self._secrets = _secret_forms(username, password)
        # True: the sent-log lives in the relay's own database, bound when a relay starts
        # (outbox_bind); False or None: no sent-log, delivery is at least once.
        self._sent_log_from_relay = sent_log is True
        if isinstance(sent_log, bool) or sent_log is None:
            self.sent_log: SentLog | None = None
        elif isinstance(sent_log, Engine):
            self.sent_log = SentLog(sent_log)
        elif isinstance(sent_log, SentLog):
            self.sent_log = sent_log
        else:
            raise ConfigurationError(
                f"EmailHandler: sent_log must be True, False, a SentLog or an Engine, got {sent_log!r}"
            )
        self.rate_limiter: RateLimiter | None = (
            rate_limit
            if rate_limit is None or isinstance(rate_limit, RateLimiter)
            else RateLimiter(rate_limit)
        )
        self.max_connections = max_connections
        self._connections = None if max_connections is None else threading.BoundedSemaphore(max_connections)
        self.context_loader = context_loader
        self._templates = environment(templates) if templates is not None else None
        if password is not None and not (starttls or ssl) and not _is_loopback(host):
            log.warning(
                "EmailHandler for %s:%d sends its password unencrypted: set starttls=True or ssl=True",
                host,
                port,
                extra={"action": "smtp_plaintext_auth", "smtp_host": host},
            )

    def __repr__(self) -> str:  # never the password
        return f"<EmailHandler {self.host}:{self.port} from {self._sender}>"

    def outbox_bind(self, engine: Engine) -> None:
        """Called by a relay as it starts: by default the sent-log uses the relay's own database."""
        if self._sent_log_from_relay and self.sent_log is None:
            self.sent_log = SentLog(engine)

    def outbox_secrets(self) -> list[str]:
        """The password (and its base64 forms, as AUTH PLAIN/LOGIN send it) for the relay to mask."""
        return list(self._secrets)

    # -- building the mail ----------------------------------------------------------------

    def message_id(self, message: Message) -> str:
        """The ``Message-ID`` header of ``message``'s mail: the same for every attempt."""
        return message_id_for(message, self._sender.domain)

    def build(self, message: Message) -> EmailMessage:
        """The mail ``message`` sends, without sending it (previews, tests); raises PermanentError."""
        payload = payload_mapping(message.payload)
        recipients = parse_recipients(payload.get("to"))
        return build_mail(self._sender, recipients, self._body(message, payload), self.message_id(message))

    def outbox_validate(self, payload: Any) -> None:
        """Refuse at emit, with ``PayloadError``, a payload that :meth:`build` would refuse at delivery.

        ``emit()`` calls it with the route's payload. It checks what the payload
        decides: the recipients, a subject with a text and/or html body, or a
        template name whose files this handler finds. Rendering waits for
        delivery, where ``context_loader`` completes the context; the SMTP
        server's verdict on a recipient can only come then too.
        """
        try:
            payload = payload_mapping(payload)
            parse_recipients(payload.get("to"))
            if "template" in payload:
                env, name, _ = template_request(self._templates, payload)
                templates_of(env, name)
            else:
                ready_body(payload)
        except PermanentError as exc:
            raise PayloadError(str(exc)) from None

    def _body(self, message: Message, payload: Mapping[str, Any]) -> Body:
        if "template" not in payload:
            return ready_body(payload)
        env, name, context = template_request(self._templates, payload)
        if self.context_loader is not None:
            loaded = self.context_loader(message)
            if not isinstance(loaded, Mapping):
                raise PermanentError(
                    f"context_loader returned {type(loaded).__name__}, not a mapping",
                    detail={"reason": "bad_context"},
                )
            context.update(loaded)
        return render(env, name, context)

    # -- sending --------------------------------------------------------------------------------

    def __call__(self, message: Message) -> dict[str, Any]:
        message_id = self.message_id(message)
        if self.sent_log is not None:
            earlier = self._already_sent(message_id, *earlier_message_ids(message, self._sender.domain))
            if earlier is not None:
                skipped = {
                    "message_id": message_id,
                    "skipped": "already accepted by the server",
                    "accepted_at": earlier.accepted_at.isoformat(),
                    "accepted_in_attempt": earlier.attempt,
                }
                if earlier.message_id != message_id:  # sent by an earlier release, under its Message-ID
                    skipped["accepted_message_id"] = earlier.message_id
                return skipped
        mail = self.build(message)
        recipients = [*mail["To"].addresses]
        began = time.monotonic()
        self._take_connection()
        try:
            budget = MAX_RATE_WAIT - (time.monotonic() - began)
            accepted = transact(
                self._smtp,
                self._sender,
                recipients,
                mail,
                scrub=self._scrub,
                before_data=lambda: self._wait_for_rate(budget),
            )
        finally:
            if self._connections is not None:
                self._connections.release()
        detail: dict[str, Any] = {
            "message_id": message_id,
            "smtp_code": accepted.code,
            "smtp_message": accepted.text,
            "recipients": len(recipients),
        }
        if self.sent_log is not None:
            try:
                self.sent_log.record(
                    message_id,
                    handler=message.handler,
                    outbox_message_id=message.id,
                    attempt=message.attempt,
                    response=accepted.response,
                )
            except SQLAlchemyError as exc:
                # Sent is sent: reporting a failure now would make the relay send it again.
                log.error(
                    "mail %s was accepted but could not be recorded in the sent-log: %s",
                    message_id,
                    type(exc).__name__,
                    extra={"action": "email_sent_log_failed", "message_id": message.id},
                )
                detail["sent_log"] = "not recorded"
        return detail

    def _already_sent(self, *message_ids: str) -> SentRecord | None:
        """The sent-log's record of the first of ``message_ids`` a server accepted, if any."""
        assert self.sent_log is not None
        try:
            for message_id in message_ids:
                record = self.sent_log.lookup(message_id)
                if record is not None:
                    return record
            return None
        except SQLAlchemyError as exc:
            raise RetryLater(
                f"the email sent-log could not be read ({type(exc).__name__}); nothing was sent",
                detail={"reason": "sent_log_unavailable"},
            ) from None

    def _take_connection(self) -> None:
        """A slot among ``max_connections``, or a deferral that does not use up an attempt."""
        if self._connections is None:
            return
        if not self._connections.acquire(timeout=min(MAX_RATE_WAIT, self.timeout / 2)):
            raise RetryLater(
                f"all {self.max_connections} SMTP connections to {self.host}:{self.port} are busy; "
                "rescheduled, nothing sent",
                delay=BUSY_RETRY,
                detail={
                    "reason": "connections_busy",
                    "smtp_host": self.host,
                    "max_connections": self.max_connections,
                },
                counts_as_attempt=False,
            )

    def _wait_for_rate(self, budget: float) -> None:
        """Wait for the rate limit, for what is left of ``MAX_RATE_WAIT`` after the connection slot."""
        if self.rate_limiter is None:
            return
        try:
            self.rate_limiter.acquire_sync(max_wait=min(max(budget, 0.0), self.timeout))
        except RateLimited as exc:
            raise RetryLater(
                f"rate limit for {self.host} reached; rescheduled",
                delay=exc.wait,
                detail={"rate_limit": "deferred", "smtp_host": self.host, "retry_in": round(exc.wait, 3)},
                counts_as_attempt=False,
            ) from None

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _secret_forms(username: str | None, password: str | None) -> tuple[str, ...]:
    if not password:
        return ()
    plain = base64.b64encode(f"\0{username}\0{password}".encode()).decode()
    login = base64.b64encode(password.encode()).decode()
    return tuple(dict.fromkeys((password, plain, login)))


def _is_loopback(host: str) -> bool:
    """Whether a password sent in the clear to ``host`` stays on this machine (no warning then)."""
    name = host.strip().rstrip(".").lower()  # "LOCALHOST" and "localhost." name it too
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False
