"""A consumer of the shop's RabbitMQ exchange, for trying the walkthrough: prints each event it receives.

    python consume_orders.py      # binds a queue of its own to shop.orders for order.* and prints

The publisher sends every message ``mandatory``: with no queue bound for its
routing key, RabbitMQ returns it and the outbox records it dead
("unroutable"). Start a consumer (or bind a durable queue) before the first order.
"""

import asyncio
import json
import os

import aio_pika


async def main() -> None:
    connection = await aio_pika.connect_robust(os.environ["RABBITMQ_URL"])
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange("shop.orders", aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(exclusive=True)  # gone when this consumer stops
        await queue.bind(exchange, routing_key="order.*")
        print("consumer waiting for order.* on shop.orders", flush=True)
        async with queue.iterator() as messages:
            async for message in messages:
                async with message.process():
                    headers = message.headers
                    print(f"{headers['ce-type']} {headers['ce-id']}: {json.loads(message.body)}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
