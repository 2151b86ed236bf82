"""Helpers for an application's own test suite: see what was emitted, deliver it, assert on it.

No relay process is needed::

    from outbox.testing import capture, drain, recording

    def test_signup_sends_welcome(engine):
        with recording(engine) as rec:
            signup(engine, "a@example.com")          # commits
        rec.assert_emitted("user.signed_up", payload={"email": "a@example.com"})
        result = drain(ob, engine)                   # runs the real handlers, here and now
        assert result.delivered == 2

    def test_inside_a_rolled_back_transaction(session):
        with capture(session) as cap:                # reads the test's own transaction
            place_order(session)                     # never commits
        cap.assert_emitted("order.placed", count=1)

:func:`recording`, :func:`messages` and :func:`drain` read committed rows,
because that is the promise: an event that was rolled back must not show up.
:func:`capture` reads through the session or connection the test holds, so it
sees what that transaction stored. :func:`reset` empties the outbox tables of
a disposable test database. Every helper takes whatever the relay takes (an
Engine, an AsyncEngine, a sync or async URL) and also the Session,
AsyncSession, Connection or AsyncConnection a test holds. Importing this
module does not load the relay; :func:`drain` does, when it is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._outbox import Outbox
from .._urls import engine_of
from ._capture import Capture, Emitted, capture
from ._reset import reset
from ._rows import Recording, messages, recording

if TYPE_CHECKING:
    # The checkout maps relay/ into outbox.relay only when installed, which the
    # type checker of this repository cannot follow; installed users get the types.
    from outbox.relay import DrainResult  # type: ignore[import-not-found,unused-ignore]

    from ._binds import Bind

__all__ = [
    "Capture",
    "Emitted",
    "Recording",
    "adrain",
    "capture",
    "drain",
    "messages",
    "recording",
    "reset",
]


def drain(outbox: Outbox, bind: Bind, **relay_options: Any) -> DrainResult:
    """Deliver every due message through ``outbox``'s handlers, in this thread, and return the counts.

    Retries that fall due while draining are attempted too; a retry scheduled
    for later stays pending (shorten the route's ``backoff`` in tests). Extra
    keyword arguments go to :class:`outbox.relay.Relay`. The relay reads over
    connections of its own: it delivers committed messages only.
    """
    from outbox.relay import Relay  # type: ignore[import-not-found,unused-ignore]

    relay_options.setdefault("listen", False)
    return Relay(outbox, engine_of(bind), **relay_options).run_until_idle()


async def adrain(outbox: Outbox, bind: Bind, **relay_options: Any) -> DrainResult:
    """:func:`drain` for tests that already run an event loop (async handlers run on it)."""
    from outbox.relay import Relay  # type: ignore[import-not-found,unused-ignore]

    relay_options.setdefault("listen", False)
    return await Relay(outbox, engine_of(bind), **relay_options).drain()
