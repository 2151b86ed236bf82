"""The shop's test fixtures: each test runs in a transaction that is rolled back, on the migrated database."""

import os

import pytest
from httpx import ASGITransport, AsyncClient
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from outbox.integrations.webhook import generate_secret

# The handlers are built when shop.events is imported; these tests never reach them.
for name, value in {
    "SMTP_HOST": "127.0.0.1",
    "SMTP_PORT": "25",
    "PARTNER_WEBHOOK_URL": "http://127.0.0.1:9/hooks",
    "PARTNER_WEBHOOK_SECRET": generate_secret(),
    "RABBITMQ_URL": "amqp://guest:guest@127.0.0.1/",
}.items():
    os.environ.setdefault(name, value)

from shop.app import app, get_session  # noqa: E402
from shop.db import DATABASE_URL  # noqa: E402
from shop.events import ob  # noqa: E402


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


# --8<-- [start:fixtures]
@pytest.fixture
async def session():
    engine = create_async_engine(DATABASE_URL)
    async with engine.connect() as conn:
        transaction = await conn.begin()
        # The app's commits release a savepoint instead: nothing is ever committed.
        Session = async_sessionmaker(
            bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False
        )
        ob.install(Session)
        async with Session() as session:
            yield session
        ob.uninstall(Session)
        await transaction.rollback()
    await engine.dispose()


@pytest.fixture
async def client(session):
    async def the_tests_session():
        yield session

    app.dependency_overrides[get_session] = the_tests_session
    async with AsyncClient(transport=ASGITransport(app=app), base_url="http://shop") as client:
        yield client
    app.dependency_overrides.clear()


# --8<-- [end:fixtures]
