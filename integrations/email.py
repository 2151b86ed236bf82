"""Email over SMTP, sent at most once per message once the server has accepted it.

::

    from outbox.integrations.email import EmailHandler, SentLog

    ob.route("user.signed_up", EmailHandler("smtp.example.com", 587, sender="Shop <shop@example.com>",
             username="shop", password=os.environ["SMTP_PASSWORD"], starttls=True,
             sent_log=SentLog(engine), templates="templates/email"), name="welcome_email")

    emit(s, "user.signed_up", {"to": "a@example.com", "template": "welcome", "context": {"name": "Ada"}})

A payload names ``to`` (an address or a list) and either ``subject`` with
``text`` and/or ``html``, or ``template`` with ``context``: templates
``<name>.subject.txt``, ``<name>.txt`` and/or ``<name>.html`` in the
``templates`` folder, rendered by a sandboxed Jinja2 environment that
autoescapes HTML.

Exactly-once effect: the ``Message-ID`` derives from the message's key (or its
event id and route), and the sent-log (``outbox_email_sent``) records it right
after the server accepts the mail; a later attempt of the same message finds it
there and sends nothing. The residual window is a crash between the server's
acceptance and that record: the mail may then be sent twice, with the same
``Message-ID``, which lets receiving systems deduplicate.
"""

from __future__ import annotations

import logging
import re
import smtplib
import ssl as ssl_module
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from email.message import EmailMessage
from email.utils import formataddr, getaddresses, parseaddr
from pathlib import Path
from typing import Any

from sqlalchemy import Column, DateTime, MetaData, String, Table, Text, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from outbox import ConfigurationError, Message, PermanentError, RetryLater
from outbox._tables import NAMING_CONVENTION

from ._ratelimit import RateLimiter

__all__ = ["EmailHandler", "SentLog", "email_metadata", "outbox_email_sent"]

log = logging.getLogger("outbox.integrations.email")

email_metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: Mails the SMTP server accepted, by Message-ID: what makes a retry send nothing twice.
outbox_email_sent = Table(
    "outbox_email_sent",
    email_metadata,
    Column("message_id", String(255), primary_key=True),
    Column("outbox_message_id", String(32), nullable=False),
    Column("accepted_at", DateTime(timezone=True), nullable=False),
    Column("smtp_response", Text),
)

_NEWLINE = re.compile(r"[\r\n]")


class SentLog:
    """The record of accepted mails, in the application's database (created by ``outbox migrate``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def was_sent(self, message_id: str) -> bool:
        with self.engine.connect() as conn:
            found = conn.execute(
                select(outbox_email_sent.c.message_id).where(outbox_email_sent.c.message_id == message_id)
            ).first()
        return found is not None

    def record(self, message_id: str, outbox_message_id: int, response: str) -> None:
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(outbox_email_sent).values(
                        message_id=message_id,
                        outbox_message_id=str(outbox_message_id),
                        accepted_at=datetime.now(UTC),
                        smtp_response=response[:500],
                    )
                )
        except IntegrityError:  # recorded already by an earlier attempt of the same message
            pass


def _no_newlines(what: str, value: str) -> str:
    if _NEWLINE.search(value):
        raise PermanentError(
            f"{what} contains a line break (header injection refused)", detail={"field": what}
        )
    return value


def _addresses(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else None
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise PermanentError("payload 'to' must be an address or a non-empty list of addresses")
    result = []
    for item in items:
        _no_newlines("to", item)
        name, addr = parseaddr(item)
        if "@" not in addr or addr.startswith("@") or addr.endswith("@") or " " in addr:
            raise PermanentError(f"invalid recipient address {item!r}", detail={"field": "to"})
        result.append(formataddr((name, addr)) if name else addr)
    return result


class EmailHandler:
    """Send a message's payload as an email over SMTP (run by the relay in a worker thread)."""

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
        templates: str | Path | None = None,
        timeout: float = 20.0,
        sent_log: SentLog | Engine | None = None,
        rate_limit: float | None = None,
        context_loader: Callable[[Message], Mapping[str, Any]] | None = None,
    ) -> None:
        if starttls and ssl:
            raise ConfigurationError("EmailHandler: choose starttls (port 587) or ssl (port 465), not both")
        if (username is None) != (password is None):
            raise ConfigurationError("EmailHandler: username and password go together")
        if not isinstance(sender, str) or _NEWLINE.search(sender) or "@" not in parseaddr(sender)[1]:
            raise ConfigurationError(f"EmailHandler: sender must be an email address, got {sender!r}")
        if not (0 < timeout < float("inf")):
            raise ConfigurationError(f"EmailHandler: timeout must be a positive number, got {timeout!r}")
        self.host, self.port, self.sender = host, port, sender
        self.username, self._password = username, password
        self.starttls, self.ssl, self.timeout = starttls, ssl, timeout
        self.sent_log = SentLog(sent_log) if isinstance(sent_log, Engine) else sent_log
        self.limiter = RateLimiter(rate_limit) if rate_limit is not None else None
        self.context_loader = context_loader
        self._domain = parseaddr(sender)[1].rsplit("@", 1)[1]
        self._templates = self._environment(templates) if templates is not None else None

    def __repr__(self) -> str:  # never the password
        return f"<EmailHandler {self.host}:{self.port} from {self.sender}>"

    def outbox_secrets(self) -> list[str]:
        return [self._password] if self._password else []

    @staticmethod
    def _environment(folder: str | Path) -> Any:
        try:
            from jinja2 import FileSystemLoader, StrictUndefined, select_autoescape
            from jinja2.sandbox import SandboxedEnvironment
        except ImportError:
            raise ConfigurationError(
                "email templates need Jinja2: pip install 'sqlalchemy-outbox[email]'"
            ) from None
        if not Path(folder).is_dir():
            raise ConfigurationError(f"EmailHandler: templates folder {folder} does not exist")
        return SandboxedEnvironment(
            loader=FileSystemLoader(str(folder)),
            autoescape=select_autoescape(["html"]),
            undefined=StrictUndefined,
        )

    # -- building the mail ------------------------------------------------------------

    def message_id(self, message: Message) -> str:
        basis = message.key if message.key is not None else f"{message.event_id}:{message.handler}"
        token = uuid.uuid5(uuid.NAMESPACE_URL, f"outbox-email:{message.handler}:{basis}").hex
        return f"<{token}@{self._domain}>"

    def _render(self, message: Message) -> tuple[str, str | None, str | None]:
        payload = message.payload
        if "template" in payload:
            if self._templates is None:
                raise PermanentError("payload names a template but the handler has no templates folder")
            context = dict(payload.get("context") or {})
            if self.context_loader is not None:
                context.update(self.context_loader(message))
            name = str(payload["template"])
            if "/" in name or "\\" in name or name.startswith("."):
                raise PermanentError(f"invalid template name {name!r}")
            try:
                from jinja2 import TemplateError, TemplateNotFound
            except ImportError:  # pragma: no cover - checked at construction
                raise
            try:
                subject = self._templates.get_template(f"{name}.subject.txt").render(context).strip()
                text = self._optional(f"{name}.txt", context, TemplateNotFound)
                html = self._optional(f"{name}.html", context, TemplateNotFound)
            except TemplateNotFound as exc:
                raise PermanentError(f"template {exc.name} not found") from None
            except TemplateError as exc:
                raise PermanentError(f"template {name} failed: {exc}") from None
        else:
            subject = payload.get("subject")
            text, html = payload.get("text"), payload.get("html")
            if not isinstance(subject, str):
                raise PermanentError("payload needs 'subject' with 'text' and/or 'html', or 'template'")
        if text is None and html is None:
            raise PermanentError("the mail has neither a text nor an html body")
        return _no_newlines("subject", subject), text, html

    def _optional(self, name: str, context: Mapping[str, Any], missing: type[Exception]) -> str | None:
        assert self._templates is not None
        try:
            return str(self._templates.get_template(name).render(context))
        except missing:
            return None

    def build(self, message: Message) -> EmailMessage:
        recipients = _addresses(message.payload.get("to"))
        subject, text, html = self._render(message)
        mail = EmailMessage()
        mail["From"] = self.sender
        mail["To"] = ", ".join(recipients)
        mail["Subject"] = subject
        mail["Message-ID"] = self.message_id(message)
        if text is not None:
            mail.set_content(text)
            if html is not None:
                mail.add_alternative(html, subtype="html")
        else:
            mail.set_content(html or "", subtype="html")
        return mail

    # -- sending ----------------------------------------------------------------------

    def __call__(self, message: Message) -> dict[str, Any]:
        mail = self.build(message)
        message_id = str(mail["Message-ID"])
        if self.sent_log is not None and self.sent_log.was_sent(message_id):
            return {"message_id": message_id, "skipped": "already accepted by the server"}
        if self.limiter is not None:
            self.limiter.acquire_sync()
        response = self._send(mail)
        if self.sent_log is not None:
            self.sent_log.record(message_id, message.id, response)
        return {"message_id": message_id, "smtp_response": response}

    def _send(self, mail: EmailMessage) -> str:
        recipients = [addr for _, addr in getaddresses([str(mail["To"])])]
        try:
            client: smtplib.SMTP
            if self.ssl:
                client = smtplib.SMTP_SSL(
                    self.host, self.port, timeout=self.timeout, context=ssl_module.create_default_context()
                )
            else:
                client = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
            with client:
                if self.starttls:
                    client.starttls(context=ssl_module.create_default_context())
                if self.username is not None and self._password is not None:
                    client.login(self.username, self._password)
                refused = client.send_message(mail, from_addr=parseaddr(self.sender)[1], to_addrs=recipients)
        except smtplib.SMTPAuthenticationError as exc:
            log.error(
                "SMTP authentication failed at %s:%d for %s (%d)",
                self.host,
                self.port,
                self.username,
                exc.smtp_code,
                extra={"action": "smtp_auth_failed"},
            )
            raise PermanentError(
                f"SMTP authentication failed ({exc.smtp_code})",
                detail=_smtp_detail(exc.smtp_code, exc.smtp_error),
            ) from None
        except smtplib.SMTPRecipientsRefused as exc:
            codes = {addr: code for addr, (code, _) in exc.recipients.items()}
            first_code, first_text = next(iter(exc.recipients.values()))
            detail = {**_smtp_detail(first_code, first_text), "recipients": codes}
            if all(400 <= c < 500 for c in codes.values()):
                raise RetryLater(f"recipient temporarily refused ({first_code})", detail=detail) from None
            raise PermanentError(f"recipient refused ({first_code})", detail=detail) from None
        except smtplib.SMTPResponseException as exc:
            detail = _smtp_detail(exc.smtp_code, exc.smtp_error)
            if 400 <= exc.smtp_code < 500:
                raise RetryLater(f"SMTP {exc.smtp_code}: {detail['smtp_message']}", detail=detail) from None
            raise PermanentError(f"SMTP {exc.smtp_code}: {detail['smtp_message']}", detail=detail) from None
        except (TimeoutError, smtplib.SMTPServerDisconnected, smtplib.SMTPConnectError, OSError) as exc:
            raise RetryLater(f"SMTP connection failed: {exc or type(exc).__name__}") from None
        if refused:
            raise PermanentError(f"some recipients were refused: {sorted(refused)}")
        return "250 accepted"


def _smtp_detail(code: int, message: bytes | str) -> dict[str, Any]:
    text = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
    return {"smtp_code": code, "smtp_message": text[:300]}
