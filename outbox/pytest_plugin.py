"""pytest fixtures for an application's tests (entry point ``outbox`` in ``pytest11``).

pytest loads this for every run in an environment where the package is
installed, so it defines fixtures and nothing else: no hooks, nothing
autouse, and it imports nothing but pytest (and the ``outbox`` package it
belongs to, which registers nothing at import). A fixture loads what it needs
when a test asks for it. ``-p no:outbox`` turns the plugin off.

Tell the fixtures where the test database is by defining ``outbox_database``
in your ``conftest.py``; a rollback-per-test suite also points
``outbox_capture_bind`` at the test's session::

    @pytest.fixture
    def outbox_database(engine):
        return engine                      # an Engine, an AsyncEngine or a URL

    @pytest.fixture
    def outbox_capture_bind(session):
        return session                     # read inside the test's own transaction

Fixtures:

``outbox_database``
    The test database: an Engine, AsyncEngine or URL. Yours to define; the
    default fails the test, saying so.
``outbox_capture_bind``
    What ``outbox_capture`` reads through. Defaults to ``outbox_database``
    (committed rows); point it at the test's Session, AsyncSession or
    Connection to see what a transaction that is never committed stored.
``outbox_capture``
    An :class:`outbox.testing.Capture`, capturing for the whole test.
``outbox_drain`` / ``outbox_adrain``
    ``outbox_drain(ob, **relay_options)`` runs ``outbox.testing.drain`` against
    ``outbox_database``; ``await outbox_adrain(ob)`` in an async test.
``outbox_reset``
    Empties the outbox tables of ``outbox_database`` before the test, history
    included (``outbox.testing.reset(..., disposable=True)``): asking for it
    says the database is disposable. Its value is the list of tables emptied.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from outbox import Outbox
    from outbox.testing import Capture

__all__ = [
    "outbox_adrain",
    "outbox_capture",
    "outbox_capture_bind",
    "outbox_database",
    "outbox_drain",
    "outbox_reset",
]


@pytest.fixture
def outbox_database() -> Any:
    """The test database for the outbox fixtures: define it in conftest.py (Engine, AsyncEngine or URL)."""
    pytest.fail(
        "the outbox fixtures need the test database: define a fixture named outbox_database in your "
        "conftest.py that returns its Engine, AsyncEngine or URL",
        pytrace=False,
    )


@pytest.fixture
def outbox_capture_bind(outbox_database: Any) -> Any:
    """What ``outbox_capture`` reads through: ``outbox_database``, or the test's own session."""
    return outbox_database


@pytest.fixture
def outbox_capture(outbox_capture_bind: Any) -> Iterator[Capture]:
    """An ``outbox.testing.Capture`` of what the test emits, read through ``outbox_capture_bind``.

    With an AsyncSession or AsyncConnection, ``await outbox_capture.refresh()`` before asking it.
    """
    from outbox.testing import capture

    cap = capture(outbox_capture_bind).start()
    try:
        yield cap
    finally:
        cap.stop()


@pytest.fixture
def outbox_drain(outbox_database: Any) -> Callable[..., Any]:
    """``outbox_drain(ob, **relay_options)``: deliver what is due through ``ob``'s handlers, here and now."""
    from outbox.testing import drain

    def run(outbox: Outbox, **relay_options: Any) -> Any:
        return drain(outbox, outbox_database, **relay_options)

    return run


@pytest.fixture
def outbox_adrain(outbox_database: Any) -> Callable[..., Awaitable[Any]]:
    """``await outbox_adrain(ob, **relay_options)``: ``outbox_drain`` on the running event loop."""
    from outbox.testing import adrain

    async def run(outbox: Outbox, **relay_options: Any) -> Any:
        return await adrain(outbox, outbox_database, **relay_options)

    return run


@pytest.fixture
def outbox_reset(outbox_database: Any) -> list[str]:
    """Empty the outbox tables of ``outbox_database`` before the test; asking for it says it is disposable."""
    from outbox.testing import reset

    return reset(outbox_database, disposable=True)
