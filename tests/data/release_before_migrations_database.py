# kernel_backend/persistence/database.py as the release before migrations shipped it (commit f429805, 2026-12), kept
# verbatim for tests/test_migrations.py: a database made by it must open in today's server.
"""The service's durable record: SQLAlchemy tables and the checkpoint folder.

Tables: sessions, training runs (models), samplers, futures, checkpoints, the usage ledger, budgets,
API keys, the audit log, the server's secrets and the sampler's recorded stability info (stable_reinforce). SQLite under
$STEPWISE_HOME by default; any SQLAlchemy URL (PostgreSQL) through STEPWISE_DATABASE_URL.
Every row carries its tenant. Futures are keyed by a `dedupe_key` built from the client's
sequence numbers, so a retried submission finds the original future instead of running twice.
A finished future's row (its stored result) expires: Service.reap deletes it after `expires_at`.
The SQLite file is created readable by its owner only (0600), like the checkpoints.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import cast

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    String,
    Text,
    create_engine,
    event,
    inspect,
    select,
    text,
    UniqueConstraint,
)
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def utc(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)  # SQLite returns naive datetimes; we store UTC


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    display_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    sdk_version: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_heartbeat: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | finished | expired
    project_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # None: DEFAULT_PROJECT
    # What the client said when it closed the session (ServiceClient.close): success | errored | interrupted.
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    finish_detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The process on this machine that opened it over loopback (a plain SDK script: runtime.loopback_peer), and
    # its script's name: what the sidebar calls a session without a display_name; it ends when that process does.
    client_pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    client_name: Mapped[str | None] = mapped_column(String(256), nullable=True)

    @property
    def local_pid(self) -> int | None:
        """The process on this machine that opened it: found by its socket, or the pid workbench.connect() put in
        its metadata (None for a remote client). The session ends with it (Service.reap)."""
        pid = str(self.client_pid or (self.user_metadata or {}).get("local_pid", ""))
        return int(pid) if pid.isdigit() else None


class ModelRow(Base):
    """A training run: one LoRA adapter (+ optimizer) over a base model."""

    __tablename__ = "models"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "{session}:train:{n}"
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    lora_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    last_request_time: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    # A run made by copy_weights holds a copy of this checkpoint and cannot be trained.
    copied_from: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    # The copy's X-Idempotency-Key: a retried copy_weights finds this run instead of copying again.
    idempotency_key: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    optimizer: Mapped[str | None] = mapped_column(String(32), nullable=True)  # "adamw" or "dimuon"; None: adamw (older rows)
    # A run made from another's checkpoint: where it branched off (the user's user_metadata stays theirs).
    parent_run_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    fork_step: Mapped[int | None] = mapped_column(Integer, nullable=True)


class SamplerRow(Base):
    __tablename__ = "samplers"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # "{session}:sample:{n}"
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # tinker:// path, if any
    source_model_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # ephemeral snapshots
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class FutureRow(Base):
    __tablename__ = "futures"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    dedupe_key: Mapped[str] = mapped_column(String(256), unique=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    request_type: Mapped[str] = mapped_column(String(32))
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | done | failed | interrupted
    # The reply for a finished future: JSON text or protobuf bytes, with its content type.
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    extra: Mapped[dict] = mapped_column(JSON, default=dict)  # e.g. sample_sequence_ids
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    completed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # When the finished row (and its result) may be deleted: a TTL after it finished, sooner once retrieved.
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tinker_path: Mapped[str] = mapped_column(String(1024), unique=True)
    model_id: Mapped[str] = mapped_column(String(128), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler | external
    name: Mapped[str] = mapped_column(String(512))
    directory: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The optim steps its run had taken when it was saved (the step a run made from it starts at).
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)


class JournalRow(Base):
    """A training run's accepted request, written in the same transaction as its future, before it is queued:
    what recovery replays after a crash (kernel_backend/service/recovery.py). Pruned at each run snapshot."""

    __tablename__ = "journal"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String(128), index=True)
    seq: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the client's seq_id; None: the run's creation
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    call: Mapped[bytes] = mapped_column(LargeBinary)  # pickled (module, function, args, kwargs) of the service call
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class RunSnapshotRow(Base):
    """A run's state (weights + optimizer) after the optim_step with seq `seq`, in the checkpoint store."""

    __tablename__ = "run_snapshots"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String(128), index=True)
    step: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    location: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class UsageRow(Base):
    """The ledger: one row per completed request, written with the future's result in one transaction."""

    __tablename__ = "usage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)  # a retried request is one row
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    session_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    model_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # training run
    sampler_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    base_model: Mapped[str] = mapped_column(String(512))
    request_type: Mapped[str] = mapped_column(String(32))
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)  # optim steps the run had taken
    prefill_tokens: Mapped[int] = mapped_column(Integer, default=0)
    sample_tokens: Mapped[int] = mapped_column(Integer, default=0)
    train_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost: Mapped[float] = mapped_column(Float, default=0.0)
    duration_s: Mapped[float] = mapped_column(Float, default=0.0)
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)
    # The prefix of the API key that sent it (its key budget counts it); None for the server's own work.
    api_key: Mapped[str | None] = mapped_column(String(16), nullable=True, index=True)


class BudgetRow(Base):
    """A spending limit on a session, a training run, an API key or a tenant (kernel_backend/service/budgets.py)."""

    __tablename__ = "budgets"
    __table_args__ = (UniqueConstraint("scope", "target"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)  # whose limit it is
    scope: Mapped[str] = mapped_column(String(16))  # session | run | key | tenant
    target: Mapped[str] = mapped_column(String(128))  # session id, training run id, key prefix, tenant
    usd: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the key; the key itself is never stored
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings, to tell keys apart
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AuditRow(Base):
    """The audit log: one row per change to a session, run, checkpoint or project, and per read of a
    checkpoint by another tenant or for download. Rows belong to the tenant whose resource it is."""

    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=now, index=True)
    event: Mapped[str] = mapped_column(String(64))  # <resource>_<action>, e.g. checkpoint_published
    details: Mapped[dict] = mapped_column(JSON, default=dict)  # who did it (actor) and what it was about


class SecretRow(Base):
    """Secrets the server makes once and every gateway of a deployment shares (the token signing key)."""

    __tablename__ = "secrets"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class StabilityRow(Base):
    """One sampled sequence as the sampler recorded it (record_stability_info), for stable_reinforce:
    the request's prompt, the sampled tokens and the sampler's logprob of each (little-endian int32,
    int32, float32). kernel_backend/service/stability.py reads and bounds them."""

    __tablename__ = "stability_info"
    sequence_id: Mapped[str] = mapped_column(String(80), primary_key=True)  # the SampledSequence.sequence_id
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    prompt: Mapped[bytes] = mapped_column(LargeBinary)
    tokens: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(Integer)  # prompt + sampled tokens: what the session's cap counts
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), index=True)


KIND_SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
# Checkpoint names: a path segment on every filesystem and object store, readable in a tinker:// path.
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# The longest a checkpoint may be kept by a TTL: ten years (no TTL keeps it until it is deleted).
MAX_TTL_S = 10 * 365 * 86400


class Store:
    """Database access plus the checkpoint store's key layout. Safe to share between threads."""

    def __init__(self, database_url: str) -> None:
        if database_url.startswith("sqlite:///"):
            path = Path(database_url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # SQLite's WAL and journal copy its mode
            os.chmod(path, 0o600)
        self.engine = create_engine(database_url, pool_pre_ping=True)
        if self.engine.dialect.name == "sqlite":
            # WAL lets the API threads read while the scheduler thread writes.
            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(conn, _record):
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=10000")

        Base.metadata.create_all(self.engine)
        self._add_new_columns()
        self.session = sessionmaker(self.engine, expire_on_commit=False)

    def _add_new_columns(self) -> None:
        """Columns added to a table after a database was made (nullable ones only): create_all does not."""
        inspector = inspect(self.engine)
        with self.engine.begin() as conn:
            for table in Base.metadata.sorted_tables:
                have = {c["name"] for c in inspector.get_columns(table.name)}
                for column in table.columns:
                    if column.name not in have and column.nullable:
                        kind = column.type.compile(dialect=self.engine.dialect)
                        conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}'))

    # ---- generic helpers ----------------------------------------------------------------------

    def add(self, *rows) -> None:
        """Insert rows in one transaction: all or none (a change and its audit row, say)."""
        with self.session.begin() as s:
            s.add_all(rows)

    def get(self, cls, key, tenant: str | None = None):
        """A row by primary key, or None; with `tenant`, another tenant's row is None too."""
        with self.session() as s:
            row = s.get(cls, key)
        if row is not None and tenant is not None and row.tenant != tenant:
            return None
        return row

    def update(self, cls, key, **values) -> None:
        with self.session.begin() as s:
            row = s.get(cls, key)
            if row is not None:
                for k, v in values.items():
                    setattr(row, k, v)

    def list(self, cls, *where, order=None, limit: int | None = None, offset: int = 0) -> list:
        with self.session() as s:
            q = select(cls).where(*where)
            if order is not None:
                q = q.order_by(order)
            return list(s.scalars(q.offset(offset).limit(limit)))

    def count(self, cls, *where) -> int:
        from sqlalchemy import func

        with self.session() as s:
            return s.scalar(select(func.count()).select_from(cls).where(*where)) or 0

    # ---- futures --------------------------------------------------------------------------------

    def insert_future(self, row: FutureRow, journal: JournalRow | None = None) -> tuple[FutureRow, bool]:
        """Insert a pending future (with its run's journal entry, in one transaction), or return the existing
        one with the same dedupe key.

        Returns (row, created). Retries of a submission carry the same sequence numbers, so they
        land on the original future and the work is never done twice.
        """
        existing = self.future_by_key(row.dedupe_key)
        if existing is not None and existing.status == "interrupted":
            # Cut off by a server restart: the client's resubmission runs it afresh.
            with self.session.begin() as s:
                s.delete(s.get(FutureRow, existing.request_id))
            existing = None
        if existing is not None:
            return existing, False
        try:
            self.add(row, *([journal] if journal is not None else []))
            return row, True
        except IntegrityError:  # a concurrent duplicate won the race
            winner = self.future_by_key(row.dedupe_key)
            if winner is None:  # (and was deleted since: no reaper deletes a future that young)
                raise
            return winner, False

    def future_by_key(self, dedupe_key: str) -> FutureRow | None:
        with self.session() as s:
            return s.scalars(select(FutureRow).where(FutureRow.dedupe_key == dedupe_key)).first()

    def finish_future(self, request_id: str, status: str, result: bytes, content_type: str,
                      usage: UsageRow | None = None, keep_s: float | None = None) -> None:
        """Store a future's outcome and, for a completed request, its ledger row: both or neither.
        The row expires `keep_s` seconds from now (never if None)."""
        with self.session.begin() as s:
            row = s.get(FutureRow, request_id)
            if row is None:
                raise KeyError(f"no future {request_id} to finish")
            row.status, row.result, row.content_type, row.completed_at = status, result, content_type, now()
            row.expires_at = None if keep_s is None else now() + dt.timedelta(seconds=keep_s)
            if usage is not None:
                s.add(usage)

    def retrieved(self, row: FutureRow, keep_s: float) -> None:
        """A finished future was read: keep it only `keep_s` seconds more (for a re-poll after a lost answer)."""
        soon = now() + dt.timedelta(seconds=keep_s)
        if row.expires_at is None or utc(row.expires_at) > soon:
            self.update(FutureRow, row.request_id, expires_at=soon)

    def delete_expired_futures(self) -> int:
        """Delete finished futures past their expiry (their ledger rows stay). Returns how many."""
        from sqlalchemy import delete

        with self.session.begin() as s:
            done = delete(FutureRow).where(FutureRow.status != "pending", FutureRow.expires_at < now())
            return cast(CursorResult, s.execute(done)).rowcount

    # ---- stability info (stable_reinforce) ------------------------------------------------------

    def stability_tokens(self, session_id: str) -> int:
        """Tokens a session's unexpired recorded sequences hold (what its cap counts)."""
        from sqlalchemy import func

        with self.session() as s:
            return s.scalar(select(func.coalesce(func.sum(StabilityRow.size), 0)).where(
                StabilityRow.session_id == session_id, StabilityRow.expires_at >= now())) or 0

    def stability_rows(self, sequence_ids) -> dict[str, StabilityRow]:
        """The unexpired recorded sequences among `sequence_ids`, by id."""
        with self.session() as s:
            rows = s.scalars(select(StabilityRow).where(StabilityRow.sequence_id.in_(list(sequence_ids)),
                                                        StabilityRow.expires_at >= now()))
            return {row.sequence_id: row for row in rows}

    def keep_stability(self, sequence_ids, until: dt.datetime) -> None:
        from sqlalchemy import update

        with self.session.begin() as s:
            s.execute(update(StabilityRow).where(StabilityRow.sequence_id.in_(list(sequence_ids))).values(expires_at=until))

    def delete_stability(self, *where) -> int:
        """Delete recorded sequences (expired ones, or an ended session's). Returns how many."""
        from sqlalchemy import delete

        with self.session.begin() as s:
            return cast(CursorResult, s.execute(delete(StabilityRow).where(*where))).rowcount

    # ---- checkpoints ----------------------------------------------------------------------------

    def checkpoint_key(self, tenant: str, model_id: str, kind: str, name: str) -> str:
        """Where a checkpoint goes in the checkpoint store (kernel_backend.persistence.checkpoint_storage), relative to its root."""
        # ':' is legal in model ids but awkward in paths on some filesystems; keep it readable.
        return f"{tenant}/{model_id.replace(':', '_')}/{KIND_SEGMENTS[kind]}/{name}"

    def checkpoint_by_path(self, tinker_path: str, tenant: str | None = None) -> CheckpointRow | None:
        with self.session() as s:
            row = s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).first()
        if row is not None and tenant is not None and row.tenant != tenant and not row.public:
            return None
        return row

    def delete_checkpoint(self, row: CheckpointRow) -> None:
        with self.session.begin() as s:
            s.delete(s.get(CheckpointRow, row.id))


def check_checkpoint_name(name) -> None:
    from kernel_backend.errors import UserError

    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise UserError(f"checkpoint name {shown} is not allowed: use 1 to 128 letters, digits, '_', '-' or '.', "
                        "starting with a letter, digit or '_' (for example 'step-000100')")


def expiry(ttl_seconds, min_s: int = 1) -> dt.datetime | None:
    """When a checkpoint kept for `ttl_seconds` expires; None (no TTL) keeps it until deleted. Copies and
    external weights take at least an hour (min_s=3600), as Tinker documents."""
    from kernel_backend.errors import UserError

    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not min_s <= ttl_seconds <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be an integer from {min_s} to {MAX_TTL_S} (ten years), or null for no "
                        f"expiry; got {ttl_seconds!r}")
    return now() + dt.timedelta(seconds=ttl_seconds)


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{KIND_SEGMENTS[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """'tinker://{model_id}/{weights|sampler_weights|external_weights}/{name}' -> (model_id, kind, name)."""
    from kernel_backend.errors import UserError

    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"checkpoint path must start with 'tinker://', got {path!r}")
    parts = path.removeprefix("tinker://").split("/")
    kinds = {v: k for k, v in KIND_SEGMENTS.items()}
    if len(parts) != 3 or parts[1] not in kinds or not parts[0] or not parts[2]:
        raise UserError(
            f"malformed checkpoint path {path!r}; expected tinker://<training run id>/weights/<name>, "
            "tinker://<training run id>/sampler_weights/<name> or tinker://<training run id>/external_weights/<name>"
        )
    return parts[0], kinds[parts[1]], parts[2]
