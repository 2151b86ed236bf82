"""An application for the metrics endpoint test (tests/test_metrics.py), served by ``outbox-relay``.

- ``partner_webhook`` (event ``partner.notified``, queue ``webhooks``): a WebhookHandler posting to
  ``METRICS_HOOK_URL``, a local server that fails; its breaker opens after one failure and stays
  open for ten minutes, so the ``outbox_breaker_open`` gauge has something to show;
- ``crm_sync`` (event ``crm.sync``, queue ``crm``): always asks to be retried in an hour, the
  message stuck in retries that only the created_at-based age gauge can see.
"""

from __future__ import annotations

import base64
import os

from outbox import Backoff, Message, Outbox, RetryLater
from outbox.integrations.webhook import WebhookHandler

SECRET = "whsec_" + base64.b64encode(b"m" * 32).decode()

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.2))
ob.route(
    "partner.notified",
    WebhookHandler(
        os.environ["METRICS_HOOK_URL"],
        SECRET,
        allowed_networks=["127.0.0.0/8"],
        breaker_threshold=1,
        breaker_cooldown=600,
        timeout=5,
    ),
    name="partner_webhook",
    queue="webhooks",
    max_attempts=10,
)


@ob.handler("crm.sync", name="crm_sync", queue="crm", max_attempts=100)
def crm_sync(msg: Message) -> None:
    raise RetryLater("CRM answers 503", delay=3600)
