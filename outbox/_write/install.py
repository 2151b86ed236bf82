"""Session event listeners, attached only where ``Outbox.install`` is told to.

No listener is registered at import time. Each installed class gets its own
set of listeners; a listener acts only for sessions whose most specific
installed class is its own, so an Outbox installed on ``Session`` and another
on a ``sessionmaker`` never both write (or both signal) for the same session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, SessionTransaction, scoped_session, sessionmaker

from .. import signals
from .._exceptions import ConfigurationError, NotInstalled
from .._tables import outbox_message
from . import pipeline_hooks
from .dedupe import announce
from .not_installed import describe_target, not_installed_message
from .pending import SessionEvents, events_of, innermost
from .rows import aggregate_identity, write_events
from .settings import EmitSettings

__all__ = ["install", "outbox_for", "uninstall", "write_owed"]

_served: dict[type[Session], EmitSettings] = {}
_listeners: dict[type[Session], list[tuple[str, Callable[..., Any]]]] = {}
#: What each served class was installed through, described for NotInstalled.
_targets: dict[type[Session], list[str]] = {}

_TARGETS = (
    "a Session class, a sessionmaker, a scoped_session, "
    "the AsyncSession class (or a subclass) or an async_sessionmaker"
)
_NOT_AN_INSTANCE = f"install() takes a session factory, not a session instance: pass {_TARGETS}"


def _sync_class_of_async_maker(maker: Any) -> type[Session]:
    """An async_sessionmaker makes plain AsyncSessions; give it a sync class of its own.

    Without that, its sessions would share the global ``Session`` class and an
    install would leak to every session in the process. The same holds for a
    ``sessionmaker(class_=AsyncSession)``: its ``class_`` is an AsyncSession,
    which takes no session events, and its sessions run on ``Session``.
    """
    configured = maker.kw.get("sync_session_class")
    if configured is None:
        base = getattr(maker.class_, "sync_session_class", Session)
        configured = type(f"Outbox{base.__name__}", (base,), {})
        maker.kw["sync_session_class"] = configured
    assert isinstance(configured, type) and issubclass(configured, Session)
    return configured


def _resolve(target: Any) -> type[Session]:
    try:  # asyncio support needs greenlet; sync-only applications may not have it
        from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker
    except ImportError:
        return _resolve_sync(target)
    if isinstance(target, async_scoped_session):
        target = target.session_factory
    if isinstance(target, async_sessionmaker) or (
        isinstance(target, sessionmaker) and issubclass(target.class_, AsyncSession)
    ):
        return _sync_class_of_async_maker(target)
    if isinstance(target, type) and issubclass(target, AsyncSession):
        return target.sync_session_class
    if isinstance(target, AsyncSession):
        raise ConfigurationError(_NOT_AN_INSTANCE)
    return _resolve_sync(target)


def _resolve_sync(target: Any) -> type[Session]:
    if isinstance(target, scoped_session):
        target = target.session_factory
    if isinstance(target, sessionmaker):
        return target.class_
    if isinstance(target, type):
        if issubclass(target, Session):
            return target
    if isinstance(target, Session):
        raise ConfigurationError(_NOT_AN_INSTANCE)
    raise ConfigurationError(f"cannot install an Outbox on {target!r}; pass {_TARGETS}")


def _owner(session: Session) -> type[Session] | None:
    for cls in type(session).__mro__:
        if cls in _served:
            return cls
    return None


def outbox_for(session: Session, facade: Any = None) -> EmitSettings:
    """The Outbox serving ``session``; ``facade`` is the AsyncSession the caller holds, if any."""
    owner = _owner(session)
    if owner is None:
        installed = (target for targets in _targets.values() for target in targets)
        raise NotInstalled(not_installed_message(session, facade, installed))
    return _served[owner]


_OUTBOX_BIND = {"clause": outbox_message}


def _flush_owed(session: Session, *, pipelined: bool = False) -> None:
    state = events_of(session, create=False)
    if state is None:
        return
    owed = state.unwritten()
    if not owed:
        return
    # The outbox table's own bind, so sessionmaker(binds={...}) works without a default bind.
    connection = session.connection(bind_arguments=_OUTBOX_BIND)
    write_events(connection, owed, pipelined=pipelined)
    state.connection = connection  # where dropped duplicates' holders are looked up after the commit
    current = innermost(session)
    for pending in owed:
        pending.written_in = current


def write_late(session: Session) -> None:
    """Write events emitted after the commit's own write (by a later before_commit listener).

    Outside a flush: flush first, so a new aggregate gets its id (after_flush
    then writes), and write what is left. Inside a flush, an event whose
    aggregate has no id yet is left to that flush's after_flush or
    after_flush_postexec, which run once ids are known.
    """
    if getattr(session, "_flushing", False):
        state = events_of(session, create=False)
        if state is not None and any(
            event.aggregate is not None and aggregate_identity(event.aggregate) is None
            for event in state.unwritten()
        ):
            return
    else:
        session.flush()
    _flush_owed(session)


def write_owed(session: Session) -> None:
    """Write now what the session's commit would write: its aggregates flushed, its events stored.

    For a test that reads its own transaction and never commits. Whatever
    happens next (a commit, a savepoint rollback) treats the rows as it treats
    rows a flush wrote.
    """
    state = events_of(session, create=False)
    if state is None or not state.unwritten():
        return
    session.flush()
    _flush_owed(session)


def _last(listeners: Any, fn: Callable[..., Any]) -> bool:
    """Is ``fn`` the last of a session's listeners for one event?"""
    return bool(listeners) and list(listeners)[-1] is fn


def _only(listeners: Any, fn: Callable[..., Any]) -> bool:
    """Is ``fn`` a session's only listener for one event?"""
    found = list(listeners)
    return len(found) == 1 and found[0] is fn


def _listeners_for(cls: type[Session]) -> list[tuple[str, Callable[..., Any]]]:
    def mine(session: Session) -> bool:
        return _owner(session) is cls

    def after_transaction_create(session: Session, transaction: SessionTransaction) -> None:
        if transaction.parent is None and mine(session):
            state = events_of(session, create=False)
            if state is not None:
                state.adopt(transaction)

    def after_flush(session: Session, flush_context: Any) -> None:
        if not mine(session):
            return
        state = events_of(session, create=False)
        if state is None or not state.committing:
            _flush_owed(session)
        elif _rest_of_flush_is_quiet(session):
            # The commit's flush: send now, so PostgreSQL works while the flush winds up.
            _flush_owed(session, pipelined=True)
        # else before_commit writes once the flush has finished

    def _rest_of_flush_is_quiet(session: Session) -> bool:
        """Will nothing but our own listeners run between here and the flush's end?"""
        dispatch = session.dispatch
        return (
            _last(dispatch.after_flush, after_flush)
            and _only(dispatch.after_flush_postexec, after_flush_postexec)
            and _only(dispatch.after_transaction_end, after_transaction_end)
            and not dispatch.pending_to_persistent
            and not dispatch.persistent_to_deleted
        )

    def after_flush_postexec(session: Session, flush_context: Any) -> None:
        # Events emitted by after_flush listeners that ran after ours.
        if mine(session):
            state = events_of(session, create=False)
            if state is not None and not state.committing:
                _flush_owed(session)

    def before_commit(session: Session) -> None:
        if not mine(session):
            return
        # Fired for a savepoint's commit too, and (when the root commits with a
        # savepoint still open) twice with the savepoint present.
        root = session.get_nested_transaction() is None
        state = events_of(session)
        assert state is not None
        if state.unwritten():
            # A flush first, so aggregates get their ids (after_flush writes then);
            # a session with no ORM changes does not flush, so write what is left.
            state.committing = root and _may_pipeline(session, state)
            try:
                session.flush()
                _flush_owed(session, pipelined=state.committing)
            finally:
                state.committing = False
        # Until this transaction ends, an emit (by a later before_commit listener) is written at once.
        state.commit_written = True

    def _may_pipeline(session: Session, state: SessionEvents) -> bool:
        """May this commit's write ride with the COMMIT (see _pipeline)?

        Only when nothing but SQLAlchemy can run between the write and the
        COMMIT, and that COMMIT is the session's own: the root transaction's
        commit (a savepoint's "commit" is a RELEASE), on an engine the session
        connects itself (not a Connection an outer transaction owns), with no
        before_commit listener after ours that could use the connection
        meanwhile. The write goes out from after_flush only when the rest of
        the flush runs no other listener, else after the flush, so no flush or
        lifecycle listener runs while its reply is pending.
        """
        if not state.events[0].outbox.pipeline_writes:
            return False
        if not isinstance(session.get_bind(clause=outbox_message), Engine):
            return False
        return _last(session.dispatch.before_commit, before_commit)

    def after_commit(session: Session) -> None:
        if session.get_nested_transaction() is not None or not mine(session):
            return
        state = events_of(session, create=False)
        if state is None:
            return
        written = state.written()
        if signals.messages_committed.receivers:  # first: an embedded relay waits on it
            queues: dict[EmitSettings, set[str]] = {}
            for pending in written:
                queues.setdefault(pending.outbox, set()).update(row["queue"] for row in pending.rows)
            for outbox, names in queues.items():
                signals.messages_committed.send(outbox, session=session, queues=names)
        if any(pending.dropped for pending in written):
            announce(session, state.connection, written)

    def after_soft_rollback(session: Session, previous: SessionTransaction) -> None:
        if mine(session):
            state = events_of(session, create=False)
            if state is not None:
                state.rolled_back(previous)

    def after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
        if not mine(session):
            return
        state = events_of(session, create=False)
        if state is None:
            return
        if transaction.nested or transaction.parent is None:  # a savepoint or the database transaction
            state.commit_written = False
        if transaction.parent is None:
            state.ended(transaction)
            state.connection = None

    return [
        ("after_transaction_create", after_transaction_create),
        ("after_flush", after_flush),
        ("after_flush_postexec", after_flush_postexec),
        ("before_commit", before_commit),
        ("after_commit", after_commit),
        ("after_soft_rollback", after_soft_rollback),
        ("after_transaction_end", after_transaction_end),
    ]


def install(outbox: EmitSettings, target: Any) -> None:
    cls = _resolve(target)
    current = _served.get(cls)
    if current is not None and current is not outbox:
        raise ConfigurationError(
            f"{cls.__name__} sessions are already served by another Outbox; give each Outbox "
            "its own sessionmaker, or uninstall the other first"
        )
    if outbox.pipeline_writes:
        pipeline_hooks.attach()
    if cls not in _listeners:
        listeners = _listeners_for(cls)
        for name, fn in listeners:
            event.listen(cls, name, fn)
        _listeners[cls] = listeners
    _served[cls] = outbox
    described = describe_target(target, cls)
    if described not in _targets.setdefault(cls, []):
        _targets[cls].append(described)


def uninstall(outbox: EmitSettings, target: Any) -> None:
    cls = _resolve(target)
    if _served.get(cls) is not outbox:
        raise ConfigurationError(f"this Outbox is not installed on {cls.__name__}")
    del _served[cls]
    _targets.pop(cls, None)
    for name, fn in _listeners.pop(cls, []):
        event.remove(cls, name, fn)
