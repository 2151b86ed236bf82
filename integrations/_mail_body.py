"""What a mail payload makes of a mail: a subject with ready bodies, or Jinja2 templates rendered.

Jinja2 is imported only when a handler has templates (the ``[email]`` extra);
everything here refuses a payload it cannot make a mail from with a
:class:`~outbox.PermanentError` naming the reason, which ``outbox_validate``
turns into a ``PayloadError`` at emit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from outbox import ConfigurationError, PermanentError

from ._mail import Body, checked_header

if TYPE_CHECKING:
    from jinja2 import BaseLoader, Environment, Template

__all__ = ["environment", "payload_mapping", "ready_body", "render", "template_request", "templates_of"]

_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
_INSTALL_HINT = "email templates need Jinja2: pip install 'sqlalchemy-outbox[email]'"


def payload_mapping(payload: Any) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping):
        raise PermanentError("an email payload must be a JSON object", detail={"reason": "bad_payload"})
    return payload


def ready_body(payload: Mapping[str, Any]) -> Body:
    """The subject and bodies a payload without a template gives, checked."""
    subject, text, html = payload.get("subject"), payload.get("text"), payload.get("html")
    if subject is None:
        raise PermanentError(
            "payload needs 'subject' with 'text' and/or 'html', or 'template' with 'context'",
            detail={"reason": "bad_payload"},
        )
    if not all(part is None or isinstance(part, str) for part in (text, html)) or text is html is None:
        raise PermanentError("payload needs 'text' and/or 'html' strings", detail={"reason": "bad_payload"})
    return Body(checked_header("subject", subject), text, html)


def templates_of(env: Environment, name: str) -> tuple[Template, Template | None, Template | None]:
    """The subject, text and html templates of ``name`` (compiled once, then cached by Jinja2).

    PermanentError when they cannot make a mail: no subject template, neither
    body, or a template that does not compile.
    """
    from jinja2 import TemplateError, TemplateNotFound

    found: dict[str, Template | None] = {}
    try:
        for suffix in ("subject.txt", "txt", "html"):
            try:
                found[suffix] = env.get_template(f"{name}.{suffix}")
            except TemplateNotFound as exc:
                if exc.name != f"{name}.{suffix}":
                    raise
                found[suffix] = None
    except TemplateError as exc:
        raise PermanentError(
            f"template {name} failed: {type(exc).__name__}: {exc}",
            detail={"reason": "template_error", "template": name},
        ) from None
    subject = found["subject.txt"]
    if subject is None:
        raise PermanentError(
            f"template {name}.subject.txt not found (a template needs a subject)",
            detail={"reason": "template_not_found", "template": f"{name}.subject.txt"},
        )
    if found["txt"] is None and found["html"] is None:
        raise PermanentError(
            f"template {name} has neither {name}.txt nor {name}.html",
            detail={"reason": "template_not_found", "template": name},
        )
    return subject, found["txt"], found["html"]


def template_request(
    env: Environment | None, payload: Mapping[str, Any]
) -> tuple[Environment, str, dict[str, Any]]:
    """The environment, template name and payload context of a templated mail, all checked."""
    if "subject" in payload or "text" in payload or "html" in payload:
        raise PermanentError(
            "payload gives both 'template' and 'subject'/'text'/'html'; use one or the other",
            detail={"reason": "bad_payload"},
        )
    if env is None:
        raise PermanentError(
            "payload names a template but this EmailHandler has no templates=",
            detail={"reason": "no_templates"},
        )
    name = payload["template"]
    if not isinstance(name, str) or not _TEMPLATE_NAME.match(name) or ".." in name:
        raise PermanentError(f"invalid template name {name!r}", detail={"reason": "bad_template_name"})
    context = payload.get("context", {})
    if not isinstance(context, Mapping):
        raise PermanentError("payload 'context' must be an object", detail={"reason": "bad_payload"})
    return env, name, dict(context)


def render(env: Environment, name: str, context: Mapping[str, Any]) -> Body:
    """The mail ``name``'s templates make with ``context``; a template error is permanent."""
    from jinja2 import TemplateError

    subject, text, html = templates_of(env, name)
    try:
        return Body(
            checked_header(
                "subject", subject.render(context), source=f"the subject rendered from {name}.subject.txt"
            ),
            None if text is None else text.render(context),
            None if html is None else html.render(context),
        )
    except TemplateError as exc:  # undefined variable, sandbox violation, missing include
        raise PermanentError(
            f"template {name} failed: {type(exc).__name__}: {exc}",
            detail={"reason": "template_error", "template": name},
        ) from None


def environment(templates: Any) -> Environment:
    try:
        from jinja2 import BaseLoader, FileSystemLoader, StrictUndefined, select_autoescape
        from jinja2.sandbox import SandboxedEnvironment
    except ImportError:
        raise ConfigurationError(_INSTALL_HINT) from None
    if isinstance(templates, BaseLoader):
        loader: BaseLoader = templates
    elif isinstance(templates, str | os.PathLike):
        if not os.path.isdir(templates):
            raise ConfigurationError(
                f"EmailHandler: templates folder {os.fspath(templates)!r} does not exist"
            )
        loader = FileSystemLoader(os.fspath(templates))
    else:
        raise ConfigurationError(
            f"EmailHandler: templates must be a folder or a jinja2 loader, got {type(templates).__name__}"
        )
    # Autoescape by file name: .html is escaped, the .txt bodies and subject lines are not.
    return SandboxedEnvironment(
        loader=loader,
        autoescape=select_autoescape(
            enabled_extensions=("html", "htm"), default_for_string=False, default=False
        ),
        undefined=StrictUndefined,
    )
