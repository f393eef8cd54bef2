"""Checkpoints: save_state, save_weights_for_sampler, save_weights_external, load_state, and the REST
calls on saved ones (list, delete, TTL, weights_info).

Saving and loading are jobs in their run's seq_id order. A checkpoint is a folder in the checkpoint
store (kernel_backend/persistence/checkpoint_storage.py: staged, sealed when encryption is on, put in place atomically)
plus a row that names it by its tinker:// path. Three kinds:

    weights/           save_state: the adapter (PEFT format) and its optimizer's state
    sampler_weights/   save_weights_for_sampler: the adapter alone
    external_weights/  save_weights_external: the adapter alone, in Hugging Face PEFT format (what
                       `stepwise export` writes), optionally age-encrypted; downloaded through signed
                       URLs (downloads.py), never loaded by this server

Who else may read a checkpoint (publishing, copies) is in publishing.py.
"""

from __future__ import annotations

from kernel_backend.persistence import crypto
from kernel_backend.engine import optimizers
from kernel_backend.execution.engine_work import LoadState, Save, Snapshot
from kernel_backend.service import recovery
from kernel_backend.service.core import Service, audit, iso, json_result, new_id, train_key
from kernel_backend.errors import NotFound, UserError
from kernel_backend.execution.scheduler import Job
from kernel_backend.persistence.database import (
    CheckpointRow,
    KIND_SEGMENTS,
    FutureRow,
    ModelRow,
    SamplerRow,
    check_checkpoint_name,
    expiry,
    tinker_path,
)

# How many in-memory sampler snapshots (save_weights_and_get_sampling_client) a run keeps.
SNAPSHOTS_PER_RUN = 4


SAVE_REQUESTS = {"training": ("SaveWeights", "save_weights"), "sampler": ("SaveWeightsForSampler", "save_weights_for_sampler"),
                 "external": ("SaveWeightsExternal", "save_weights_external")}


@recovery.journaled
def save_weights(svc: Service, tenant: str, model_id: str, seq_id: int | None, name: str | None, kind: str,
                 overwrite: bool = True, ttl_seconds: int | None = None, user_metadata: dict | None = None,
                 age_recipients: list[str] | None = None, step: int | None = None) -> FutureRow:
    """save_state (kind "training": weights + optimizer), save_weights_for_sampler (kind "sampler") or
    save_weights_external (kind "external": optionally age-encrypted to `age_recipients`).

    With `step`: the run's state after that optim step, not its current one (service/past_steps.py)."""
    run = svc.live_run(tenant, model_id)
    if name is None:
        if seq_id is None:
            raise UserError("save_weights needs a path (the checkpoint's name), or a seq_id to name it after")
        name = f"{kind}-{seq_id:06d}"
    check_checkpoint_name(name)
    # Copies and external weights are kept at least an hour, as Tinker documents for them.
    expires = expiry(ttl_seconds, min_s=3600 if kind == "external" else 1)
    if age_recipients is not None:
        crypto.age_recipients(age_recipients)  # each one parses: a bad one is a 400 now, not a failed save later
    path = tinker_path(model_id, kind, name)
    key = svc.store.checkpoint_key(tenant, model_id, kind, name)
    request_type, answer_type = SAVE_REQUESTS[kind]
    dedupe = train_key(model_id, seq_id)
    if dedupe is None or svc.store.future_by_key(dedupe) is None:  # a retry was admitted when first sent
        svc.admission.storage(tenant)

    def record(saved: dict):
        """The files are in place (ops.save): the checkpoint's row, replacing an overwritten one's."""
        existing = svc.store.checkpoint_by_path(path)
        if existing is not None:
            svc.store.delete_checkpoint(existing)
        svc.store.add(CheckpointRow(tinker_path=path, model_id=model_id, tenant=tenant, kind=kind, name=name,
                                    directory=saved["location"], size_bytes=saved["size"], expires_at=expires,
                                    user_metadata=dict(user_metadata or {}), step=saved.get("step")),
                      audit(tenant, "checkpoint_created", tenant, tinker_path=path, model_id=model_id,
                            size_bytes=saved["size"], age_encrypted=age_recipients is not None))
        answer = {"path": path, "type": answer_type, **({"step": step} if step is not None else {})}
        return json_result({**answer, "size_bytes": saved["size"]} if kind == "external" else answer)

    op = Save(model_id, kind, key, path, overwrite, run.base_model, age_recipients=age_recipients, step=step,
              snapshot_location=None if step is None else recovery.snapshot_at(svc, model_id, step))
    job = Job(new_id(), model_id, run.base_model, seq=seq_id, op=op)
    return svc.submit(tenant, request_type, dedupe, job, ordered=True, session_id=run.session_id, encode=record)


@recovery.journaled
def snapshot_for_sampler(svc: Service, tenant: str, model_id: str, seq_id: int, sampling_session_seq_id: int) -> FutureRow:
    """save_weights_and_get_sampling_client: an in-memory copy of the weights, with a sampler id."""
    run = svc.live_run(tenant, model_id)
    sampler_id = f"{run.session_id}:sample:{sampling_session_seq_id}"

    def record(_):
        if svc.store.get(SamplerRow, sampler_id) is None:
            svc.store.add(SamplerRow(id=sampler_id, session_id=run.session_id, tenant=tenant,
                                     base_model=run.base_model, source_model_id=model_id))
        return json_result({"path": None, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

    op = Snapshot(model_id, sampler_id, run.base_model, keep=SNAPSHOTS_PER_RUN, owner=tenant)
    job = Job(new_id(), model_id, run.base_model, seq=seq_id, op=op)
    return svc.submit(tenant, "SaveWeightsForSampler", train_key(model_id, seq_id), job, ordered=True,
                      session_id=run.session_id, encode=record)


@recovery.journaled
def load_weights(svc: Service, tenant: str, path: str, with_optimizer: bool, model_id: str | None = None,
                 seq_id: int | None = None, session_id: str | None = None, model_seq_id: int | None = None,
                 user_metadata: dict | None = None, optimizer_type: str | None = None) -> FutureRow:
    """Legacy load_state into an existing run, or create a new run from a checkpoint.

    optimizer_type: the optimizer for a weights-only load (default AdamW); with the optimizer
    state the run keeps the one it was saved with.
    """
    if optimizer_type is not None:
        optimizers.check_kind(optimizer_type)
    checkpoint = loadable(svc, tenant, path, "load_weights")
    source = svc.store.get(ModelRow, checkpoint.model_id)
    dedupe: str | None  # (None: a load without a seq_id, never deduplicated)
    if model_id is None:  # create-via-load
        if session_id is None or model_seq_id is None:
            raise UserError("load_weights needs either model_id, or session_id and model_seq_id")
        svc.session(tenant, session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        if svc.store.get(ModelRow, model_id) is None:
            svc.admission.adapter(tenant, source.base_model, source.lora_config, training=True)
            restored = with_optimizer and checkpoint.kind == "training"  # the run keeps the optimizer it was saved with
            svc.store.add(ModelRow(id=model_id, session_id=session_id, tenant=tenant, base_model=source.base_model,
                                   lora_config=source.lora_config, user_metadata=own_metadata(source, user_metadata),
                                   optimizer=(source.optimizer if restored else optimizer_type) or "adamw",
                                   parent_run_id=source.id, fork_step=checkpoint.step),
                          audit(tenant, "training_run_created", tenant, model_id=model_id, base_model=source.base_model,
                                lora_rank=source.lora_config["rank"], from_checkpoint=path))
        dedupe, seq = f"create_model:{session_id}:{model_seq_id}", None
    else:
        run = svc.live_run(tenant, model_id)
        if run.base_model != source.base_model:
            raise UserError(f"checkpoint {path} is for {source.base_model}, but {model_id} trains {run.base_model}")
        dedupe, seq = train_key(model_id, seq_id), seq_id
    target = model_id
    op = LoadState(target, checkpoint.directory, path, with_optimizer=with_optimizer and checkpoint.kind == "training",
                   optimizer=optimizer_type, owner=tenant)
    job = Job(new_id(), target, source.base_model, seq=seq, op=op)
    session = svc.store.get(ModelRow, target).session_id
    return svc.submit(tenant, "LoadWeights", dedupe, job, ordered=True, session_id=session,
                      encode=lambda _: json_result({"path": path, "model_id": target, "type": "load_weights"}))


def own_metadata(source: ModelRow, user_metadata: dict | None) -> dict:
    """A run made from a checkpoint: the user_metadata its creator gave, else its parent's but for the parent's name
    (and the lineage keys rows from before lineage had columns of its own kept there). Where it branched off is
    in its own fields, ModelRow.parent_run_id and fork_step."""
    if user_metadata:
        return dict(user_metadata)
    return {k: v for k, v in (source.user_metadata or {}).items() if k not in ("name", "parent_run_id", "fork_step")}


def lineage(run: ModelRow) -> dict:
    """Where a run branched off: {"parent_run_id", "fork_step"}, both None for a run made from scratch. Rows
    from before the columns kept it in user_metadata, as strings."""
    meta = run.user_metadata or {}
    if run.parent_run_id is not None or "parent_run_id" not in meta:
        return {"parent_run_id": run.parent_run_id, "fork_step": run.fork_step}
    step = str(meta.get("fork_step", ""))
    return {"parent_run_id": meta["parent_run_id"], "fork_step": int(step) if step.isdigit() else None}


# ---- whose checkpoint: the tenant's own, or one published --------------------------------------------


def owned_checkpoint(svc: Service, tenant: str, path: str) -> CheckpointRow:
    """A checkpoint of this tenant's own: what it may delete, expire, publish or download (404 otherwise,
    also for another tenant's published one)."""
    row = svc.checkpoint(tenant, path)
    if row.tenant != tenant:
        raise NotFound(f"no checkpoint at {path}")
    return row


def loadable(svc: Service, tenant: str, path: str, purpose: str | None = None) -> CheckpointRow:
    """A checkpoint `tenant` may load weights from: its own or a published one, of weights or sampler weights.
    With a `purpose`, a read of another tenant's published checkpoint goes in its owner's audit log."""
    row = svc.checkpoint(tenant, path)
    if row.kind == "external":
        raise UserError(f"{path} holds external weights, which are for download (RestClient.get_external_weights_urls);"
                        " load a weights/ or sampler_weights/ checkpoint instead")
    if purpose is not None and row.tenant != tenant:
        svc.store.add(audit(row.tenant, "checkpoint_read", tenant, tinker_path=path, model_id=row.model_id,
                            purpose=purpose))
    return row


# ---- REST: saved checkpoints -----------------------------------------------------------------------


def checkpoint_json(row: CheckpointRow) -> dict:
    segment = KIND_SEGMENTS[row.kind]
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": row.kind,
        "time": iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
        "expires_at": iso(row.expires_at) if row.expires_at else None,
    }


def checkpoints(svc: Service, tenant: str, model_id: str | None, limit: int = 100, offset: int = 0) -> dict:
    where = [CheckpointRow.tenant == tenant]
    if model_id is not None:
        svc.run(tenant, model_id)
        where.append(CheckpointRow.model_id == model_id)
    rows = svc.store.list(CheckpointRow, *where, order=CheckpointRow.created_at.desc(), limit=limit, offset=offset)
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": svc.store.count(CheckpointRow, *where)},
    }


def delete_checkpoint(svc: Service, tenant: str, model_id: str, segment: str, name: str) -> dict:
    path = f"tinker://{model_id}/{segment}/{name}"
    row = owned_checkpoint(svc, tenant, path)
    svc.store.delete_checkpoint(row)
    svc.store.add(audit(tenant, "checkpoint_deleted", tenant, tinker_path=path, model_id=model_id))
    svc.storage.delete(row.directory)
    return {}


def set_ttl(svc: Service, tenant: str, path: str, ttl_seconds: int | None) -> dict:
    row = owned_checkpoint(svc, tenant, path)
    expires = expiry(ttl_seconds)
    svc.store.update(CheckpointRow, row.id, expires_at=expires)
    svc.store.add(audit(tenant, "checkpoint_ttl_set", tenant, tinker_path=path, model_id=row.model_id,
                        ttl_seconds=ttl_seconds))
    return checkpoint_json(svc.store.get(CheckpointRow, row.id))


def weights_info(svc: Service, tenant: str, path: str) -> dict:
    row = svc.checkpoint(tenant, path)
    run = svc.store.get(ModelRow, row.model_id)
    lora = run.lora_config
    optimizer = run.optimizer or "adamw"
    return {
        "base_model": run.base_model,
        "optimizer_config": {"type": optimizer, **({"version": 1} if optimizer == "dimuon" else {})},  # the SDK's
        "is_lora": lora["rank"] > 0,  # rank 0: full fine-tuning
        "lora_rank": lora["rank"],
        "train_unembed": lora["train_unembed"],
        "train_mlp": lora["train_mlp"],
        "train_attn": lora["train_attn"],
    }
