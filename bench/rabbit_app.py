"""The Outbox ``outbox-relay --app bench.rabbit_app:ob`` serves in the RabbitMQ mode.

One route, ``rabbitmq`` (event ``bench.rabbitmq``), publishing with the real
:class:`~outbox.integrations.rabbitmq.RabbitMQPublisher` to
``$BENCH_RABBITMQ_EXCHANGE`` on ``$BENCH_RABBITMQ_URL``. Only the relay
process imports it; the other modes never need the ``[rabbitmq]`` extra.
"""

from __future__ import annotations

import os

from outbox import Outbox
from outbox.integrations.rabbitmq import RabbitMQPublisher

from .rabbitmq import EVENT, ROUTE

ob = Outbox()
ob.route(
    EVENT,
    RabbitMQPublisher(os.environ["BENCH_RABBITMQ_URL"], os.environ["BENCH_RABBITMQ_EXCHANGE"]),
    name=ROUTE,
)
