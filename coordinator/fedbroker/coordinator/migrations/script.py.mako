"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

# the schema version this revision brings a store to (ids are the version numbers, zero-padded)
revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade() -> None:
    """${message}"""
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    """Refused: a downgrade would drop what a newer release recorded."""
    raise RuntimeError("the coordinator's state is never downgraded: restore a backup taken before the upgrade")
