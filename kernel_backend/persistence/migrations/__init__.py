"""Schema migrations (Alembic): the database brought to this release's schema when a Store opens it.

Three cases, told apart by what the database holds:
- nothing: every table made from the models (database.py), and stamped with the newest revision;
- an `alembic_version` table: `alembic upgrade head` (versions/, one file per change, oldest first);
- tables but no `alembic_version`: a release from before migrations (2026-12). The old fix-ups bring it to today's
  schema (missing tables made, nullable columns added, 32-bit counters widened on PostgreSQL), then it is stamped with
  the newest revision. They can only add; a change they cannot make needs this path to stamp the revision before it.

A new change to the schema: edit the model in database.py, then add a revision in versions/ that makes the same change
with `op` (see 0001's docstring), and a test that opens a database of the release before it (tests/test_migrations.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine

HERE = Path(__file__).parent
logging.getLogger("alembic").setLevel(logging.WARNING)  # its INFO lines (plugins, "will assume ...") at every start


def _config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(HERE))
    config.attributes["connection"] = connection  # env.py migrates on it, inside the caller's transaction
    return config


def upgrade(engine: Engine, metadata, old_fixups: Callable[[Connection], None]) -> str:
    """Bring the database to this release's schema; returns which case it was ("new", "upgraded", "pre-migrations")."""
    with engine.begin() as conn:
        tables = set(inspect(conn).get_table_names())
        if "alembic_version" in tables:
            command.upgrade(_config(conn), "head")
            return "upgraded"
        metadata.create_all(conn)
        if tables:
            old_fixups(conn)
        command.stamp(_config(conn), "head")
        return "pre-migrations" if tables else "new"
