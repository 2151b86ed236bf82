"""The application's tables, as its Alembic history has them."""

from decimal import Decimal

from sqlalchemy import Numeric, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import OutboxMixin


class Base(DeclarativeBase):
    pass


# --8<-- [start:model]
class Order(OutboxMixin, Base):  # OutboxMixin: order.emit(...) records the aggregate ("Order", its id)
    __tablename__ = "orders"
    __table_args__ = (UniqueConstraint("request_id", name="uq_orders_request_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64))  # sent by the client; a retry sends it again
    email: Mapped[str] = mapped_column(String(255))
    total: Mapped[Decimal] = mapped_column(Numeric(10, 2))


# --8<-- [end:model]
