"""The outbox dashboard: an ASGI app to watch the outbox and act on it (extra ``[dashboard]``).

Mount it in an app you run already, or start it alone with ``outbox dashboard``::

    from outbox.dashboard import create_app, token_auth

    app.mount("/outbox", create_app(engine, auth=token_auth(os.environ["OUTBOX_TOKEN"]), allow_actions=True))

Every figure and every action comes from :mod:`outbox.ops`, the same
functions as the ``outbox`` command, so the two never disagree; every action
is written to the history with its actor and reason.
"""

from __future__ import annotations

from ._app import create_app
from ._security import ACTIONS, CONTENT_SECURITY_POLICY, Action, Auth, token_auth

__all__ = ["ACTIONS", "CONTENT_SECURITY_POLICY", "Action", "Auth", "create_app", "token_auth"]
