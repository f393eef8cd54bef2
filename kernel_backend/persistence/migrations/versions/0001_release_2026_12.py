"""The schema of release 2026-12, the first under migrations: what database.py's models make.

Nothing to do: a new database is made from the models and a release before this one is brought here by the old
fix-ups (migrations/__init__.py). The next change goes in a revision after this one, e.g.

    def upgrade() -> None:
        with op.batch_alter_table("sessions") as table:
            table.add_column(sa.Column("notes", sa.Text(), nullable=True))

Revision ID: 0001
"""

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass
