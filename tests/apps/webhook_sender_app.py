"""An application for webhook relay subprocess tests: ``order.paid`` POSTed to ``$WEBHOOK_URL``.

The handler is the real ``WebhookHandler`` on 127.0.0.1, with a short
timeout, quick retries and a breaker that tries a receiver back every 0.2 s,
so a receiver killed and restarted again and again costs the test seconds,
not minutes; ``max_attempts`` leaves room for every kill of a request in
flight (each one a counted retry). The test runs the relay with a small
``--concurrency``, which bounds the requests open to the receiver at once.
"""

from __future__ import annotations

import os

from outbox import Backoff, Outbox
from outbox.integrations.webhook import WebhookHandler

EVENT = "order.paid"
ROUTE = "partner"

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.5))
ob.route(
    EVENT,
    WebhookHandler(
        os.environ["WEBHOOK_URL"],
        os.environ["WEBHOOK_SECRET"],
        timeout=5.0,
        allowed_networks=["127.0.0.0/8"],
        breaker_cooldown=0.2,
    ),
    name=ROUTE,
    max_attempts=100,
)
