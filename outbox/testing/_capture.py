"""``capture()``: what a block emitted, seen from inside the test's own transaction.

A test wrapped in a transaction that is rolled back at the end never commits,
so :func:`~outbox.testing.recording` (committed rows) sees nothing. A capture
learns *which* events were emitted from the ``event_emitted`` signal, and reads
*what was stored* for them through the bind the test holds: a session or
connection is read inside its transaction, where the rows are. Before reading
through a session it writes the events that session still buffers, as its
commit would.

Two sources, so two answers: :attr:`Capture.emitted` is every event ``emit()``
accepted while capturing; :meth:`Capture.messages` is the rows the bind sees
for them. An event emitted in a savepoint that rolled back is in the first and
not the second, as it would be in production.

An AsyncSession or AsyncConnection can be read only from a coroutine: the
capture reads it when its ``async with`` block ends, or at ``await
cap.refresh()``, and answers from that reading.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Row

from .. import signals
from ._binds import is_async_transaction, read_messages, read_messages_async
from ._rows import RowAssertions, check_columns

if TYPE_CHECKING:
    from ._binds import Bind

__all__ = ["Capture", "Emitted", "capture"]


@dataclass(frozen=True, slots=True)
class Emitted:
    """One event ``emit()`` accepted: not necessarily stored (its transaction may still roll back)."""

    event_id: uuid.UUID
    event_type: str
    routes: tuple[str, ...]


class Capture(RowAssertions):
    """The events emitted while the capture is open, and the rows stored for them.

    Use it as ``with capture(bind) as cap`` or ``async with capture(bind) as
    cap``; the assertions (``assert_emitted``, ``assert_nothing_emitted``,
    ``messages``, ``event_types``, ``payloads``) work inside the block and
    after it.
    """

    _seen = "stored"

    def __init__(self, bind: Bind) -> None:
        self._bind = bind
        self._needs_coroutine = is_async_transaction(bind)
        self._lock = threading.Lock()
        self._emitted: list[Emitted] = []
        self._open = False
        self._snapshot: list[Row[Any]] | None = None
        self._snapshot_covers = 0

    # -- opening and closing ---------------------------------------------------------------------

    def start(self) -> Capture:
        """Begin capturing (what entering the block does)."""
        if not self._open:
            signals.event_emitted.connect(self._received, weak=False)
            self._open = True
        return self

    def stop(self) -> None:
        """Stop capturing; what was captured stays readable."""
        if self._open:
            signals.event_emitted.disconnect(self._received)
            self._open = False

    def __enter__(self) -> Capture:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Capture:
        return self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if kind is None:
            await self.refresh()

    def _received(self, sender: Any, *, event_id: uuid.UUID, event_type: str, routes: Any, **_: Any) -> None:
        # Receivers run in the emitting thread: an app under test may emit from a server thread.
        with self._lock:
            self._emitted.append(Emitted(event_id, event_type, tuple(routes)))

    # -- what was emitted, what was stored ---------------------------------------------------------

    @property
    def emitted(self) -> list[Emitted]:
        """Every event ``emit()`` accepted while capturing, in emit order, stored or not."""
        with self._lock:
            return list(self._emitted)

    def _event_ids(self) -> list[uuid.UUID]:
        return list(dict.fromkeys(e.event_id for e in self.emitted))

    async def refresh(self) -> None:
        """Read the stored rows now: needed inside `async with` on an AsyncSession or AsyncConnection.

        Harmless for other binds, which are read at each question.
        """
        covers = len(self.emitted)
        self._snapshot = await read_messages_async(self._bind, self._event_ids())
        self._snapshot_covers = covers

    def _rows(self) -> list[Row[Any]]:
        if not self._needs_coroutine:
            return read_messages(self._bind, self._event_ids())
        emitted = len(self.emitted)
        if self._snapshot is None or self._snapshot_covers != emitted:
            since = emitted - self._snapshot_covers if self._snapshot is not None else emitted
            raise RuntimeError(
                f"this capture reads an {type(self._bind).__name__}, which only a coroutine can do, and "
                f"{since} event(s) were emitted since it last read: `await cap.refresh()` first "
                "(leaving an `async with capture(...)` block reads it too)"
            )
        return self._snapshot

    def messages(self, **columns: Any) -> list[Row[Any]]:
        """The rows stored for the captured events, oldest first, filtered by equality on any column."""
        check_columns(columns)
        return [row for row in self._rows() if all(getattr(row, k) == v for k, v in columns.items())]

    def _more_about(self, event_type: str) -> str:
        stored = {row.event_id for row in self._rows()}
        lost = [e.event_type for e in self.emitted if e.event_id not in stored]
        if not lost:
            return ""
        return (
            f"; emitted but not stored: {lost} (rolled back, or written by a session "
            "this capture does not read through and not yet committed)"
        )


def capture(bind: Bind) -> Capture:
    """Capture what is emitted inside the block, read through ``bind``: ``with`` or ``async with``.

    ``bind`` is what the test holds. A Session, AsyncSession, Connection or
    AsyncConnection is read inside its own transaction, so a test that rolls
    back instead of committing sees what it emitted; an Engine, AsyncEngine or
    URL reads committed rows.
    """
    return Capture(bind)
