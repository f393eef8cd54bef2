"""What a job asks of an engine, as plain data: the seam between the service and whoever runs the engine.

The service (the gateway: store, ledger, replies) describes each job's engine-side work as one of
    an Op     a work item, one dataclass per kind: CreateAdapter, OptimStep, LoadState, FreeAdapters, Save,
              Snapshot, Noop; `run` below does one, by its type (the one place that dispatches)
    Pass      a forward or forward_backward pass (engine/core.py), batched with other runs'
    SampleOp  a sample request, which joins the model's decode batch
plain dataclasses of numbers, strings, lists and numpy arrays, which pickle. So one job runs on
the scheduler thread of this process, or travels as it is to an `EngineWorker` on Ray
(kernel_backend/execution/cluster.py), whose own scheduler runs it the same way. A misspelt or
missing argument fails where the item is made, in the service, not on the scheduler thread.

The functions below do the work, an item's fields their keyword arguments. Each touches only the
engine and a `Context`: the settings and the checkpoint store, which every worker reaches (a local
folder on one machine, an fsspec URL across machines). They return plain data; the service turns
it into the reply and writes the rows (the `Request` it keeps on `Job.request`, always on the gateway). The gateway locates
checkpoints (their store location, from its database); the engine side reads and writes their
files through the store.

The Context also holds the sampler: what answers sample requests, and what the service asks of it (which
options it refuses at admission, its stats). By default a `BuiltinSampler`: the engines' own decoders sample,
reading adapters from the engine itself, so each of its hooks does nothing. With STEPWISE_SAMPLER=vllm the
in-process executor (execution/executor.py) puts a `VllmSampling` (execution/vllm_sampler.py) there instead,
with the same methods: the work below (save, snapshot, free_adapters) tells it of each sampler adapter it makes
or drops, unconditionally, and neither this module nor the service asks which sampler it is.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernel_backend.persistence import crypto
from kernel_backend.engine import lora, sharding
from kernel_backend.engine.step_history import OPTIMIZER_FILES
from kernel_backend.config import Settings
from kernel_backend.persistence.checkpoint_storage import CheckpointStorage, folder_size
from kernel_backend.types import AdamParams, DimuonParams, LoraConfig, SampleOptions, SamplingParams
from kernel_backend.errors import UserError


# What a shard group's other member hands the engine as the folder of a save it takes part in: its engine writes
# nothing there (rank 0 writes, Engine._writes), and nothing can make it (a file's child), should one ever try.
NOT_WRITTEN = Path(os.devnull, "written-by-rank-0-of-the-shard-group")


class Op:
    """Engine-side work other than a pass or a sample: one of the dataclasses below (and a data-parallel worker's
    own RestoreGrads, execution/cluster_worker.py). Its fields are the keyword arguments of its function here."""


@dataclass
class CreateAdapter(Op):
    """A new run's adapter (create_model)."""

    model_id: str
    config: LoraConfig
    optimizer: str
    owner: str = ""


@dataclass
class OptimStep(Op):
    """One optimizer step, and the run's recovery snapshot when one is due."""

    model_id: str
    params: AdamParams | DimuonParams
    snapshot_key: str | None = None  # with snapshot_every: where (and how often) the step snapshots the run
    snapshot_every: int = 0


@dataclass
class LoadState(Op):
    """A checkpoint's or a snapshot's state into a run (load_weights; a run rebuilt)."""

    model_id: str
    location: str  # in the checkpoint store
    path: str  # what errors call it: a tinker:// path, or which snapshot
    with_optimizer: bool
    optimizer: str | None = None
    owner: str = ""


@dataclass
class FreeAdapters(Op):
    """Forget adapters and their snapshots (a session ended)."""

    adapter_ids: list[str]


@dataclass
class Save(Op):
    """A checkpoint into the store (save_state, save_weights_for_sampler, save_weights_external)."""

    model_id: str
    kind: str  # "training", "sampler" or "external"
    key: str  # in the checkpoint store
    path: str  # its tinker:// path
    overwrite: bool
    base_model: str
    age_recipients: list[str] | None = None
    step: int | None = None
    snapshot_location: str | None = None


@dataclass
class Snapshot(Op):
    """An in-memory copy of a run's weights to sample from (save_weights_and_get_sampling_client)."""

    model_id: str
    sampler_id: str
    base_model: str
    keep: int
    owner: str = ""


@dataclass
class Noop(Op):
    """Nothing: a replica's place in its run's seq_id order when another replica does the work."""


@dataclass
class SampleOp:
    """A sample request from the base model (adapter_id None) or an adapter the engine holds or loads."""

    adapter_id: str | None
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    options: SampleOptions = field(default_factory=SampleOptions)
    # Where the adapter's checkpoint is, when the engine does not hold it yet; `missing` is the error
    # when it neither holds it nor can load it (an in-memory snapshot no longer kept, a deleted checkpoint).
    location: str | None = None
    path: str | None = None  # the checkpoint's tinker:// path: what errors call it
    missing: str = ""
    owner: str = ""  # the tenant whose share of the adapter cache a loaded checkpoint uses (engine/adapter_cache.py)


class BuiltinSampler:
    """The sampler when the engines' own decoders sample (the default, and always on Ray workers): it answers
    every option the engine validates and finds adapters on the engine, so there is nothing to refuse, count,
    start or tell. VllmSampling (execution/vllm_sampler.py) has the same methods and does each."""

    def start(self, base_models: list[str]) -> None:
        """Start the sampler's own processes (the decoders are the engines')."""

    def stop(self) -> None: ...

    def check_options(self, options: SampleOptions, params: SamplingParams | None = None) -> None:
        """Refuse, with a UserError (a 400 at admission), the options this sampler cannot answer: none."""

    def stats(self) -> dict | None:
        """The sampler's own stats for GET /api/v1/admin/stats (the decoders' are the executor's sampling_stats)."""
        return None

    def add_snapshot(self, engine, base_model: str, sampler_id: str) -> None:
        """The engine took an in-memory snapshot of a run's weights (save_weights_and_get_sampling_client)."""

    def add_checkpoint(self, engine, base_model: str, path: str, folder) -> None:
        """A sampler checkpoint was written at `path`; `folder`: its files, before they are sealed."""

    def remove(self, adapter_id: str) -> None:
        """An adapter or snapshot is gone from the engine."""


@dataclass
class Context:
    """What engine-side work reaches besides the engine. One per scheduler (this process, or a worker)."""

    settings: Settings
    storage: CheckpointStorage
    # What samples (the module docstring): the engines' own decoders, or VllmSampling in this process only.
    sampler: BuiltinSampler = field(default_factory=BuiltinSampler)
    snapshots: dict[str, list[str]] = field(default_factory=dict)  # run id -> its in-memory sampler snapshots
    # False on a shard group's other members (execution/cluster_worker.py): rank 0 writes every checkpoint and
    # snapshot where the files go; they take part in the engine's side of it (a full run's weights gathered whole, a
    # collective) and touch no file, so nothing of a save can fail on them that rank 0 reports done.
    writes: bool = True

    @classmethod
    def of(cls, settings: Settings) -> "Context":
        return cls(settings, CheckpointStorage(settings.checkpoints_dir, settings.storage_url, settings.storage_fs_options))


def run(engine, ctx: Context, op: Op) -> dict:
    """Do a work item: the function of its type (WORK, at the end), with its fields."""
    return WORK[type(op)](engine, ctx, **vars(op))


# ---- training runs -------------------------------------------------------------------------------


def create_adapter(engine, ctx: Context, model_id: str, config: LoraConfig, optimizer: str, owner: str = "") -> dict:
    engine.create_adapter(model_id, config, optimizer, owner)
    return {"kept_steps": engine.kept_steps(model_id)}


def optim_step(engine, ctx: Context, model_id: str, params: AdamParams | DimuonParams,
               snapshot_key: str | None = None, snapshot_every: int = 0) -> dict:
    """One optimizer step; with `snapshot_every`, every that many steps the run's state (weights and
    optimizer) is also written to `snapshot_key` in the store, which recovery restores from (execution/cluster.py)."""
    metrics = engine.optim_step(model_id, params)
    step = engine.steps(model_id)
    snapshot = None
    if snapshot_every and step % snapshot_every == 0 and not ctx.writes:
        engine.save_state(model_id, NOT_WRITTEN)  # its part of rank 0's snapshot: the gathers, no file
    elif snapshot_every and step % snapshot_every == 0:
        # A key of its own per step: the snapshot before it stays whole until this one is recorded.
        with ctx.storage.writing(f"{snapshot_key}-{step:06d}") as (staging, located):
            engine.save_state(model_id, staging)
            if ctx.settings.encryption_key:
                crypto.seal(staging, ctx.settings.encryption_key)
        snapshot = {"step": step, "location": located[0]}
    return {"metrics": metrics, "snapshot": snapshot, "kept_steps": engine.kept_steps(model_id)}


def load_state(engine, ctx: Context, model_id: str, location: str, path: str, with_optimizer: bool,
               optimizer: str | None = None, owner: str = "") -> dict:
    with ctx.storage.open(location, ctx.settings.decryption_keys, path) as plain:
        engine.load_state(model_id, plain, with_optimizer=with_optimizer, optimizer=optimizer, owner=owner)
    return {"kept_steps": engine.kept_steps(model_id)}


def free_adapters(engine, ctx: Context, adapter_ids: list[str]) -> dict:
    """Forget adapters (a session ended) and the snapshots kept for them."""
    for adapter_id in adapter_ids:
        engine.delete_adapter(adapter_id)
        ctx.snapshots.pop(adapter_id, None)
        ctx.sampler.remove(adapter_id)
    return {}


# ---- checkpoints ---------------------------------------------------------------------------------


def save(engine, ctx: Context, model_id: str, kind: str, key: str, path: str, overwrite: bool, base_model: str,
         age_recipients: list[str] | None = None, step: int | None = None, snapshot_location: str | None = None) -> dict:
    """save_state (kind "training"), save_weights_for_sampler ("sampler") or save_weights_external ("external")
    into the store at `key`: staged, sealed when encryption is on, put in place atomically. Returns its location,
    size and step; the gateway writes the checkpoint's row.

    With `step`, the state after that step instead of the run's current one: from the engine's step history
    (engine/step_history.py), else from the run's recovery snapshot of that step at `snapshot_location`.

    On a shard group (ctx.writes False on the other members) rank 0 alone looks at the store and writes; every
    member takes part in the engine's save (a full run's weights gathered whole), then they agree that each did
    (`_agreed`) before rank 0 puts the checkpoint in place. A refusal before any of it (the checkpoint exists) is
    rank 0's, made before the unit is sent: the others get a Noop (EngineWorker._follower_job)."""
    from_snapshot = step is not None and step not in engine.kept_steps(model_id) and snapshot_location is not None
    if not ctx.writes:  # (the same decisions as rank 0's: the members hold the same runs and kept steps)
        if not from_snapshot:
            _agreed(engine, ctx, lambda: _engine_save(engine, model_id, kind, step, NOT_WRITTEN))
        return {}
    if not overwrite and ctx.storage.exists(key):
        raise UserError(f"checkpoint {path} already exists; pass overwrite=True or pick another name")
    with ctx.storage.writing(key) as (staging, located):
        if from_snapshot:
            assert snapshot_location is not None  # (from_snapshot says so)
            _copy_snapshot(ctx, snapshot_location, staging, with_optimizer=kind == "training")
        else:
            _agreed(engine, ctx, lambda: _engine_save(engine, model_id, kind, step, staging))
        if kind == "sampler":  # registered while the files are plain (before sealing)
            ctx.sampler.add_checkpoint(engine, base_model, path, staging)
        if age_recipients is not None:
            crypto.age_encrypt_folder(staging, crypto.age_recipients(age_recipients))
        if ctx.settings.encryption_key:  # sealed before it reaches the store
            crypto.seal(staging, ctx.settings.encryption_key)
        size = folder_size(staging)
    return {"location": located[0], "size": size, "step": engine.steps(model_id) if step is None else step}


def _engine_save(engine, model_id: str, kind: str, step: int | None, folder) -> None:
    """The engine writes the run's state (kind "training") or weights into `folder`: of `step` from its step
    history, else its current ones. On a shard group's other members it only gathers (Engine._writes)."""
    if step is not None:
        engine.save_step(model_id, step, folder, with_optimizer=kind == "training")
    elif kind == "training":
        engine.save_state(model_id, folder)
    else:
        engine.save_weights_for_sampler(model_id, folder)


def _agreed(engine, ctx: Context, part: Callable[[], None]) -> None:
    """Do this member's `part` of a save; on a sharded model the group's members then agree on it (one all-reduce,
    sharding.on_any_process), so that rank 0 never writes a checkpoint another member could not take part in. Only
    another member's failure parts their ways: rank 0's own (a full disk: it alone writes) is its error alone, and one
    they all meet (a step no longer kept) is the same error everywhere. Unsharded: just the part."""
    failed: Exception | None = None
    try:
        part()
    except Exception as e:  # (raised once the others know: they are waiting to agree)
        failed = e
    if engine.group is not None:
        another_failed = sharding.on_any_process(failed is not None and not ctx.writes, engine.model)
        if another_failed and ctx.writes and failed is None:
            raise MemberFailed("another member of this shard group failed its part of this save (its log says why): "
                               "the checkpoint was not written, and the group is taken for lost; its runs come back "
                               "from their snapshots on the group formed again, where the save runs again")
    if failed is not None:
        raise failed


class MemberFailed(RuntimeError):
    """A shard group's other member failed its part of a save that this one did: the members no longer hold the same
    state (execution/cluster_worker.py takes the group for lost)."""


def _copy_snapshot(ctx: Context, location: str, staging, with_optimizer: bool) -> None:
    """A recovery snapshot's files (save_state's format) into a checkpoint being written; the weights alone
    for a sampler."""
    staging.mkdir(parents=True)
    with ctx.storage.open(location, ctx.settings.decryption_keys, "a snapshot") as plain:
        for item in plain.iterdir():
            if item.name != crypto.MANIFEST and (with_optimizer or item.name not in OPTIMIZER_FILES):
                shutil.copy2(item, staging / item.name)


def snapshot(engine, ctx: Context, model_id: str, sampler_id: str, base_model: str, keep: int, owner: str = "") -> dict:
    """save_weights_and_get_sampling_client: an in-memory copy of the weights under `sampler_id`; a run
    keeps its newest `keep`, older ones are dropped."""
    engine.snapshot_sampler(model_id, sampler_id, owner)
    ctx.sampler.add_snapshot(engine, base_model, sampler_id)
    kept = ctx.snapshots.setdefault(model_id, [])
    kept.append(sampler_id)
    while len(kept) > keep:
        dropped = kept.pop(0)
        engine.delete_adapter(dropped)
        ctx.sampler.remove(dropped)
    return {}


# ---- sampling ------------------------------------------------------------------------------------


def sample_request(engine, ctx: Context, op: SampleOp, on_token=None, cancel=None):
    """The engine's validated request for its decoder (UserError for bad input), the adapter loaded first
    when the engine does not hold it (never loaded here, or dropped by the adapter cache to make room). `on_token`
    and `cancel` belong to the caller's process (streaming)."""
    if op.adapter_id is not None and not engine.has_adapter(op.adapter_id):
        if op.location is None:
            raise UserError(op.missing)
        with ctx.storage.open(op.location, ctx.settings.decryption_keys, op.path) as plain:
            engine.load_sampler(op.adapter_id, plain, op.owner)
    return engine.sample_request(op.adapter_id, op.prompt, op.num_samples, op.params, op.options,
                                 on_token=on_token, cancel=cancel)


# ---- what the gateway needs to know about a loaded model -------------------------------------------


def model_facts(engine) -> dict:
    """A loaded base model's facts the gateway bounds requests with, wherever the engine runs: its context
    length, its vocabulary's size, and admission's adapter measure: the bytes one rank of LoRA takes on each target
    module kind, and the bytes of the model's weights (a full fine-tuning run's copy, engine/full_weights.py)."""
    per_rank: dict[str, int] = {}
    for name, module in lora.lora_layers(engine.model).items():
        kind = name.rsplit(".", 1)[-1]
        weight = module.base.weight
        per_rank[kind] = per_rank.get(kind, 0) + (weight.shape[0] + weight.shape[1]) * 4  # float32 over any base
    full = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # each tied weight once
    return {"max_context": engine.max_context, "vocab_size": engine.vocab_size, "lora_bytes_per_rank": per_rank,
            "full_bytes": full}


def adapter_bytes(facts: dict, config: LoraConfig) -> int:
    """One copy of a run's weights on the model of `facts` (model_facts): its LoRA matrices, or with rank 0 the
    whole model's weights."""
    if config.rank == 0:
        return facts["full_bytes"]
    per_rank = facts["lora_bytes_per_rank"]
    return sum(per_rank.get(kind, 0) for kind in lora.targets_of(config)) * config.rank


def noop(engine, ctx: Context) -> dict:
    """Nothing: keeps a replica's seq_id order whole when another replica does the work (execution/cluster.py)."""
    return {}


WORK: dict[type[Op], Callable[..., dict]] = {CreateAdapter: create_adapter, OptimStep: optim_step, LoadState: load_state, FreeAdapters: free_adapters,
        Save: save, Snapshot: snapshot, Noop: noop}
