"""Recovery is replay: a training run is its newest snapshot plus a journal of the requests accepted since.

Write-ahead order. A run's request (create_model, forward_backward, optim_step, a save, a sampler snapshot,
a load) is `journaled`: Service.submit writes its journal entry, the service call as plain data, in the
same transaction as its pending future, before the job is queued and before the client hears of it. So
every request the client was told about survives a crash of the process, with the database.

Snapshots. Every STEPWISE_SNAPSHOT_EVERY optim steps (sooner once a run's journal passes
STEPWISE_JOURNAL_MB) the optim_step also writes the run's state (weights and optimizer, no gradients:
they were just used) to the checkpoint store under a key of its own (engine_work.optim_step). When that step is
recorded, the run's journal up to its seq_id is deleted, and so are its snapshots past the newest
STEPWISE_SNAPSHOTS_KEPT: what is durable per run is its newest snapshot and the requests since (the older
snapshots kept are steps a fork can start from, service/past_steps.py).

Replay. When a backend starts (`replay`), each run of an active session that has a snapshot or a journal
is rebuilt before anything else runs: its snapshot is loaded (or the run is created again, with the seed
it was created with) and its journal entries after the snapshot are run again in seq_id order, each by
calling the same service function once more. A request whose future had finished runs silently (no
reply, no ledger row: the client has its answer); one whose future was pending at the crash runs as
itself, so the client's poll of it gets its answer. The engine is deterministic for one run's requests
run one after another, so the rebuilt run is bit for bit the run that was lost, and an optim_step in
flight at the crash is applied exactly once.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import functools
import importlib
import logging
import pickle

from sqlalchemy import delete, func, select

from kernel_backend.execution.engine_work import LoadState
from kernel_backend.execution.scheduler import Job
from kernel_backend.persistence.database import FutureRow, JournalRow, ModelRow, RunSnapshotRow, SessionRow, now

log = logging.getLogger("stepwise.recovery")

# The journaled service call being made on this thread or task: Service.submit journals it with its future.
_current: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("journaled_call", default=None)
# The journal entry being replayed on this thread (a fresh thread starts with none: API threads never see it).
_replaying: contextvars.ContextVar[JournalRow | None] = contextvars.ContextVar("replaying", default=None)


def journaled(fn):
    """Mark a service function whose requests change (or read) a run's state: they are journaled and replayed.
    Its arguments after `svc` must pickle (plain data, and module-level functions such as encoders)."""

    @functools.wraps(fn)
    def call(svc, *args, **kwargs):
        token = _current.set((fn.__module__, fn.__qualname__, args, kwargs))
        try:
            return fn(svc, *args, **kwargs)
        finally:
            _current.reset(token)

    return call


def entry(job: Job) -> JournalRow | None:
    """The journal entry of a job being submitted by a journaled call (None for anything else)."""
    current = _current.get()
    if current is None:
        return None
    return JournalRow(model_id=job.lane, seq=job.seq, request_id=job.request_id, call=pickle.dumps(current))


def snapshot_args(svc, tenant: str, model_id: str) -> dict:
    """What an OptimStep needs to snapshot the run (engine_work.optim_step): the key its state goes to, and when."""
    every = svc.settings.snapshot_every
    with svc.store.session() as s:
        journal_bytes = s.scalar(select(func.coalesce(func.sum(func.length(JournalRow.call)), 0))
                                 .where(JournalRow.model_id == model_id))
    if journal_bytes > svc.settings.journal_mb << 20:
        every = 1  # the journal is large: snapshot at this step, whatever its number
    return {"snapshot_key": f"{tenant}/{model_id.replace(':', '_')}/snapshot", "snapshot_every": every}


def snapshotted(svc, model_id: str, seq: int | None, snapshot: dict) -> None:
    """An optim_step wrote a snapshot: record it, then forget what it supersedes (the journal up to its seq, and
    the older snapshots past the newest STEPWISE_SNAPSHOTS_KEPT, which stay as steps to fork from: service/past_steps.py).
    The row is written before anything is deleted, so a crash in between loses nothing."""
    if seq is None:
        return  # without a seq_id nothing orders the journal around it: keep the journal whole
    svc.store.add(RunSnapshotRow(model_id=model_id, step=snapshot["step"], seq=seq, location=snapshot["location"]))
    with svc.store.session.begin() as s:
        s.execute(delete(JournalRow).where(JournalRow.model_id == model_id,
                                           (JournalRow.seq <= seq) | JournalRow.seq.is_(None)))
        older = s.scalars(select(RunSnapshotRow).where(RunSnapshotRow.model_id == model_id, RunSnapshotRow.seq < seq)
                          .order_by(RunSnapshotRow.seq.desc()).offset(max(0, svc.settings.snapshots_kept - 1))).all()
        for row in older:
            s.delete(row)
    for row in older:
        if row.location != snapshot["location"]:
            svc.storage.delete(row.location)


def snapshot_at(svc, model_id: str, step: int) -> str | None:
    """Where the run's snapshot of the state after `step` is in the store, if one is kept (service/past_steps.py)."""
    rows = svc.store.list(RunSnapshotRow, RunSnapshotRow.model_id == model_id, RunSnapshotRow.step == step,
                          order=RunSnapshotRow.seq.desc(), limit=1)
    return rows[0].location if rows else None


def snapshot_steps(svc, model_id: str) -> list[int]:
    return sorted({row.step for row in svc.store.list(RunSnapshotRow, RunSnapshotRow.model_id == model_id)})


def forget(svc, model_ids: list[str]) -> None:
    """A session ended: its runs will never be rebuilt, so their journals and snapshots go."""
    with svc.store.session.begin() as s:
        s.execute(delete(JournalRow).where(JournalRow.model_id.in_(model_ids)))
        snapshots = s.scalars(select(RunSnapshotRow).where(RunSnapshotRow.model_id.in_(model_ids))).all()
        for row in snapshots:
            s.delete(row)
    for row in snapshots:
        svc.storage.delete(row.location)


def pending_journaled(svc) -> set[str]:
    """Request ids of journaled futures still pending: replay answers them, they are not interrupted."""
    with svc.store.session() as s:
        return set(s.scalars(select(FutureRow.request_id).where(
            FutureRow.status == "pending", FutureRow.request_id.in_(select(JournalRow.request_id)))).all())


def replaying() -> JournalRow | None:
    """The journal entry being run again on this thread, if any (Service.submit resubmits it, see there)."""
    return _replaying.get()


def replay(svc) -> int:
    """Rebuild every run of a live session (one that heart-beat within STEPWISE_SESSION_TIMEOUT_S: its client
    may still be waiting) from its snapshot and journal, before the scheduler starts. Returns how many."""
    alive_since = now() - dt.timedelta(seconds=svc.settings.session_timeout_s)
    active = select(SessionRow.id).where(SessionRow.status == "active", SessionRow.last_heartbeat >= alive_since)
    runs = svc.store.list(ModelRow, ModelRow.session_id.in_(active), ModelRow.copied_from.is_(None))
    rebuilt = 0
    for run in runs:
        snapshot = svc.store.list(RunSnapshotRow, RunSnapshotRow.model_id == run.id, order=RunSnapshotRow.seq.desc(),
                                  limit=1)
        if snapshot:
            load = LoadState(run.id, snapshot[0].location, f"snapshot of {run.id}", with_optimizer=True, owner=run.tenant)
            svc.executor.submit(Job(f"replay-load:{run.id}", run.id, run.base_model, seq=None, op=load), ordered=True)
        count = replay_run(svc, run.id, after_seq=snapshot[0].seq if snapshot else None, creation=not snapshot)
        if snapshot or count:
            rebuilt += 1
            log.info("run %s: rebuilt from %s and %d journaled requests", run.id,
                     f"its snapshot at step {snapshot[0].step}" if snapshot else "its creation", count)
    return rebuilt


def replay_run(svc, model_id: str, after_seq: int | None, creation: bool) -> int:
    """Run a run's journaled requests again, those after `after_seq` (all if None; its creation too only if
    `creation`), in seq_id order, each by calling its service function once more. Returns how many."""
    entries = svc.store.list(JournalRow, JournalRow.model_id == model_id, order=JournalRow.id)
    entries = [e for e in entries if (e.seq is None and creation)
               or (e.seq is not None and (after_seq is None or e.seq > after_seq))]
    for e in sorted(entries, key=lambda e: (e.seq is not None, e.seq or 0, e.id)):
        module, name, args, kwargs = pickle.loads(e.call)
        token = _replaying.set(e)
        try:
            getattr(importlib.import_module(module), name)(svc, *args, **kwargs)
        except Exception:  # a request that cannot be made again fails alone; the run goes on without it
            log.exception("replay of %s (seq %s) of run %s failed", name, e.seq, model_id)
        finally:
            _replaying.reset(token)
    return len(entries)


def replay_after_worker_loss(svc, model_id: str, snapshot_location: str | None) -> int:
    """A Ray worker died and the cluster restored `model_id` on a live one from its snapshot (or its origin):
    the journal since then makes it the run that was lost (kernel_backend/execution/cluster.py, Cluster._restore)."""
    after = None
    if snapshot_location is not None:
        rows = svc.store.list(RunSnapshotRow, RunSnapshotRow.model_id == model_id,
                              RunSnapshotRow.location == snapshot_location)
        if not rows:
            raise RuntimeError(f"run {model_id}'s snapshot {snapshot_location} has no journal position")
        after = rows[0].seq
    return replay_run(svc, model_id, after, creation=False)
