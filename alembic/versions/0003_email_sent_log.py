"""The email sent-log: Message-IDs an SMTP server accepted (outbox.integrations.email).

Revision ID: outbox_0003
Revises: outbox_0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0003"
down_revision = "outbox_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox_email_sent",
        sa.Column("message_id", sa.String(320), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("outbox_message_id", sa.BigInteger, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("accepted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("smtp_response", sa.Text),
        sa.PrimaryKeyConstraint("message_id", name="pk_outbox_email_sent"),
    )


def downgrade() -> None:
    op.drop_table("outbox_email_sent")
