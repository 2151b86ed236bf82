"""orders

Revision ID: 3c1f5a2b8d40
Revises:
Create Date: 2025-11-03 09:12:44.120311

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3c1f5a2b8d40"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("email", sa.String(length=255), nullable=False),
        sa.Column("total", sa.Numeric(precision=10, scale=2), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("orders")
