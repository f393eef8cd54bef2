"""Alembic's entry point: migrate on the connection kernel_backend/persistence/migrations/__init__.py hands it."""

from alembic import context

from kernel_backend.persistence.database import Base

context.configure(connection=context.config.attributes["connection"], target_metadata=Base.metadata,
                  render_as_batch=True)  # SQLite alters a table by copying it: batch mode does that
with context.begin_transaction():
    context.run_migrations()
