"""What ``NotInstalled`` says: which session this is, where it came from, and what is installed.

An install serves one session class, so a session of another class is not
served even though an Outbox is installed: one built directly (``Session(...)``,
``AsyncSession(...)``), one from a maker nobody installed on, or one an
``async_sessionmaker`` made before ``ob.install()`` gave it a sync class of its
own. Which of these happened is what a reader needs to know, named with
the database each thing is bound to (passwords hidden).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

__all__ = ["describe_target", "not_installed_message"]

_FIX = (
    "call ob.install(...) on the sessionmaker or class your sessions come from, or make this "
    "session with an installed maker (in a test: maker(bind=connection))"
)


def _class_name(cls: type) -> str:
    if cls.__module__.startswith(("sqlalchemy.", "outbox.")):  # SQLAlchemy's, or one install() made
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def _where(bind: Any) -> str:
    url = getattr(bind, "url", None) or getattr(getattr(bind, "engine", None), "url", None)
    if url is None:
        return type(bind).__name__
    return str(url.render_as_string(hide_password=True))


def _made_by_a_sessionmaker(cls: type[Session]) -> bool:
    """sessionmaker gives each maker a subclass of its own, named after its class_, made in SQLAlchemy."""
    bases = cls.__bases__
    return cls.__module__ == sessionmaker.__module__ and len(bases) == 1 and bases[0].__name__ == cls.__name__


def _origin(session: Session, facade: Any) -> str:
    cls = type(session)
    bound = f", bound to {_where(session.bind)}" if session.bind is not None else ""
    if facade is not None and facade is not session:
        kind = type(facade).__name__
        if cls is Session:
            return (
                f"this {kind}{bound}: it runs on the plain Session class, so it was built directly "
                f"({kind}(...)) or made by an async_sessionmaker before ob.install() gave that maker a "
                "session class of its own (create the maker with sync_session_class=YourSession and "
                "install on it: sessions it made before the install are then served too)"
            )
        return f"this {kind}{bound}, whose sync session class is {_class_name(cls)}"
    if cls is Session:
        return f"this Session{bound}: it is of the plain Session class, so it was built directly"
    if _made_by_a_sessionmaker(cls):
        return f"this Session{bound}, made by a sessionmaker on which no Outbox is installed"
    return f"this {_class_name(cls)} session{bound}"


def not_installed_message(session: Session, facade: Any, installed: Iterable[str]) -> str:
    """``session`` is the sync session; ``facade`` the AsyncSession the caller holds, if any."""
    targets = "; ".join(installed) or "nothing (no ob.install() has run in this process)"
    return f"no Outbox is installed for {_origin(session, facade)}; installed on: {targets}; {_FIX}"


def describe_target(target: Any, cls: type[Session]) -> str:
    """An install target as a reader recognises it: its kind and the database it is bound to."""
    if isinstance(target, type):
        runs_on = f" (its sessions run on {_class_name(cls)})" if target is not cls else ""
        return f"the {_class_name(target)} class{runs_on}"
    factory = getattr(target, "session_factory", None)  # a scoped_session, an async_scoped_session
    if factory is not None:
        return f"{type(target).__name__} of {describe_target(factory, cls)}"
    bind = getattr(target, "kw", {}).get("bind")
    return type(target).__name__ + (f" bound to {_where(bind)}" if bind is not None else "")
