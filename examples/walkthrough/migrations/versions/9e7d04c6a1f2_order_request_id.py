"""order request id: a retried request finds the order it already placed

Revision ID: 9e7d04c6a1f2
Revises: 3c1f5a2b8d40
Create Date: 2026-01-20 14:03:09.551872

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9e7d04c6a1f2"
down_revision: str | Sequence[str] | None = "3c1f5a2b8d40"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("orders", sa.Column("request_id", sa.String(length=64), nullable=False))
    op.create_unique_constraint("uq_orders_request_id", "orders", ["request_id"])


def downgrade() -> None:
    op.drop_constraint("uq_orders_request_id", "orders", type_="unique")
    op.drop_column("orders", "request_id")
