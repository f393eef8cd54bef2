"""`stepwise backup --to DIR` and `stepwise restore --from DIR`: the database and the checkpoint store, whole.

A backup is a folder:
- `backup.json`: when it was made, from which home and database (no password), each table's row count, and every
  checkpoint it covers;
- `tables/<table>.jsonl`: every row of every table, read in one transaction (a consistent cut of a running
  server's database; SQLite in WAL mode and PostgreSQL both give one), as JSON, whatever the database;
- `checkpoints/`: the local checkpoint store's files (STEPWISE_STORAGE_URL unset), scratch folders left out. An
  object store (s3://...) is not copied: the bucket has its own versioning and replication; its checkpoints'
  locations are listed in backup.json (restore checks only local checkpoints' folders).

Restore goes into a home whose database is empty (a new STEPWISE_HOME, or a new PostgreSQL database): the rows go in
as they were (ids, the server's signing secret, API keys as their hashes), each local checkpoint's folder is
rewritten from the old home's checkpoints/ to the new one's, and a PostgreSQL database's id sequences are moved past
the restored ids. Encrypted checkpoints stay encrypted: the restored server needs the same STEPWISE_ENCRYPTION_KEY.
A server must not be running on the home being restored into.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import shutil
from pathlib import Path

from sqlalchemy import DateTime, Integer, LargeBinary, func, select, text

from kernel_backend import runtime
from kernel_backend.config import without_password
from kernel_backend.persistence.database import Base, CheckpointRow, Store

FORMAT = 1


def _encode(value):
    if isinstance(value, dt.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    return value


def _decode(value, column):
    if isinstance(value, dict) and "$datetime" in value and isinstance(column.type, DateTime):
        return dt.datetime.fromisoformat(value["$datetime"])
    if isinstance(value, dict) and "$bytes" in value and isinstance(column.type, LargeBinary):
        return base64.b64decode(value["$bytes"])
    return value


def _moved(value, old: str, new: str):
    """`value` with every string that starts with the old checkpoints folder starting with the new one instead."""
    if isinstance(value, str):
        return new + value[len(old):] if value.startswith(old) else value
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    return value


def backup(settings, to: Path) -> dict:
    """Write a backup of `settings`' database and checkpoint store into the new folder `to`; returns its summary."""
    to = Path(to)
    if to.exists() and any(to.iterdir()):
        raise SystemExit(f"stepwise backup: {to} is not empty; give a new folder")
    (to / "tables").mkdir(parents=True, exist_ok=True)
    store = Store(settings.database_url)
    counts = {}
    with store.engine.connect() as conn, conn.begin():  # one transaction: one consistent cut of every table
        if store.engine.dialect.name == "postgresql":
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        for table in Base.metadata.sorted_tables:
            rows = conn.execute(select(table)).mappings().all()
            with open(to / "tables" / f"{table.name}.jsonl", "w") as out:
                for row in rows:
                    out.write(json.dumps({k: _encode(v) for k, v in row.items()}) + "\n")
            counts[table.name] = len(rows)
        checkpoints = [row.directory for row in conn.execute(select(CheckpointRow.directory))]
    missing = []
    if not settings.storage_url and settings.checkpoints_dir.is_dir():
        shutil.copytree(settings.checkpoints_dir, to / "checkpoints", ignore=shutil.ignore_patterns(".staging"))
        missing = [c for c in checkpoints if c.startswith(str(settings.checkpoints_dir))
                   and not (to / "checkpoints" / Path(c).relative_to(settings.checkpoints_dir)).exists()]
    summary = {"format": FORMAT, "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
               "home": str(settings.home), "checkpoints_dir": str(settings.checkpoints_dir),
               "database": without_password(settings.database_url),
               "storage_url": settings.storage_url or None, "tables": counts, "checkpoints": checkpoints,
               "checkpoints_missing": missing}  # deleted while the backup was made: their rows, not their files
    (to / "backup.json").write_text(json.dumps(summary, indent=1))
    return summary


def restore(settings, source: Path) -> dict:
    """Restore the backup in `source` into `settings`' (empty) database and checkpoint store; returns its summary."""
    source = Path(source)
    try:
        summary = json.loads((source / "backup.json").read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"stepwise restore: {source} holds no backup ({error}); give a folder `stepwise backup` made")
    if summary.get("format") != FORMAT:
        raise SystemExit(f"stepwise restore: {source} is a backup of format {summary.get('format')!r}; this release "
                         f"reads format {FORMAT}")
    if runtime.running_backend(settings.home):
        raise SystemExit(f"stepwise restore: a server is running on {settings.home}; stop it first")
    store = Store(settings.database_url)
    with store.engine.connect() as conn:
        filled = [t.name for t in Base.metadata.sorted_tables if conn.execute(select(func.count()).select_from(t)).scalar()]
    if filled:
        raise SystemExit(f"stepwise restore: the database of {settings.home} is not empty (tables {', '.join(filled)}); "
                         "restore into a new STEPWISE_HOME or a new database")
    old, new = summary["checkpoints_dir"], str(settings.checkpoints_dir)
    with store.engine.begin() as conn:
        for table in Base.metadata.sorted_tables:
            path = source / "tables" / f"{table.name}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            columns = {c.name: c for c in table.columns}
            rows = [{k: _moved(_decode(v, columns[k]), old, new) for k, v in row.items() if k in columns} for row in rows]
            if rows:
                conn.execute(table.insert(), rows)
            # PostgreSQL hands out ids from a sequence: move it past the ids just restored.
            key = next(iter(table.primary_key.columns), None)
            if rows and conn.dialect.name == "postgresql" and key is not None and isinstance(key.type, Integer) \
                    and key.autoincrement in (True, "auto"):
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table.name}', '{key.name}'), "
                                  f"(SELECT MAX({key.name}) FROM {table.name}))"))
    if (source / "checkpoints").is_dir():
        shutil.copytree(source / "checkpoints", settings.checkpoints_dir, dirs_exist_ok=True)
    absent = [c for c in (_moved(c, old, new) for c in summary["checkpoints"]) if "://" not in c and not Path(c).exists()]
    return {**summary, "restored_into": str(settings.home), "checkpoints_absent": absent}
