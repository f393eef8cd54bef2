"""Training runs: create_model, get_info, forward_backward, optim_step, and the runs' REST listings.

A training run is one LoRA adapter (+ its optimizer) over a base model, or with rank 0 a full fine-tuning run
of its own copy of the model's weights (engine/full_weights.py); either is a lane of the scheduler:
its requests run in the client's seq_id order. Saving and loading its weights is in checkpoints.py.
"""

from __future__ import annotations

import random

from sqlalchemy import select

from kernel_backend.service import admission, budgets, recovery, sessions, stability
from kernel_backend.engine import base_models, optimizers
from kernel_backend.engine.core import Pass
from kernel_backend.metering import LOSS_TOKENS, Usage, loss_tokens
from kernel_backend.execution.engine_work import CreateAdapter, OptimStep
from kernel_backend.service.checkpoints import checkpoint_json
from kernel_backend.service.core import PROTO_TYPE, Service, audit, iso, json_result, new_id, train_key
from kernel_backend.execution.scheduler import Job
from kernel_backend.persistence.database import CheckpointRow, FutureRow, ModelRow, SessionRow, now
from kernel_backend.types import AdamParams, Datum, DimuonParams, LoraConfig
from kernel_backend.errors import UserError


@recovery.journaled
def create_model(svc: Service, tenant: str, session_id: str, model_seq_id: int, base_model: str, lora: dict | None,
                 optimizer_type: str, user_metadata: dict | None) -> FutureRow:
    svc.session(tenant, session_id)
    config = LoraConfig(**{"rank": 32, **{k: v for k, v in (lora or {}).items() if v is not None}})
    if not 0 <= config.rank <= 512:
        raise UserError(f"lora rank must be from 1 to 512, or 0 for full fine-tuning, got {config.rank}")
    optimizers.check_kind(optimizer_type, full=config.rank == 0)
    admission.check_seed(config.seed, "lora_config.seed")
    base = svc.model_name(base_model)
    model_id = f"{session_id}:train:{model_seq_id}"
    existing = svc.store.get(ModelRow, model_id)
    if existing is not None:  # a retry, or a replay after a crash: made as it was first made, with its seed
        config = LoraConfig(**existing.lora_config)
    else:
        # A seed of its own, kept: replaying its creation, a remake after a Ray worker dies and a data-parallel
        # run's replicas (execution/cluster.py) must all make the same adapter.
        if config.seed is None:
            config.seed = random.getrandbits(63)
        svc.admission.adapter(tenant, base, vars(config), training=True)
        budget = budgets.from_metadata(tenant, "run", model_id, user_metadata)  # {"budget_usd": "0.2"}
        svc.store.add(*([budget] if budget else []),
                      ModelRow(id=model_id, session_id=session_id, tenant=tenant, base_model=base,
                               lora_config=vars(config), user_metadata=dict(user_metadata or {}), optimizer=optimizer_type),
                      audit(tenant, "training_run_created", tenant, model_id=model_id, base_model=base,
                            lora_rank=config.rank))

    job = Job(new_id(), model_id, base, seq=None, op=CreateAdapter(model_id, config, optimizer_type, owner=tenant),
              replicas=replicas_asked(user_metadata))
    return svc.submit(tenant, "CreateModel", f"create_model:{session_id}:{model_seq_id}", job, ordered=True,
                      session_id=session_id, encode=lambda _: json_result({"model_id": model_id, "type": "create_model"}))


def replicas_asked(user_metadata: dict | None) -> int | None:
    """Data-parallel replicas a run asks for in its user_metadata ({"replicas": "2"}; kernel_backend/execution/cluster.py)."""
    value = (user_metadata or {}).get("replicas")
    if value is None:
        return None
    try:
        replicas = int(value)
    except (TypeError, ValueError):
        replicas = 0
    if not 1 <= replicas <= 64:
        raise UserError(f"user_metadata replicas must be a whole number from 1 to 64, got {value!r}")
    return replicas


def get_info(svc: Service, tenant: str, model_id: str, client_is_local: bool = False) -> dict:
    run = svc.run(tenant, model_id)
    # The SDK's get_tokenizer() loads tokenizer_id on the client. The server's own user on this machine (the
    # embedded backend's client, or a plain script using `serve`'s local key over loopback) gets the local folder,
    # which loads with no network wait (a hub id costs ~50 s of retries offline); anyone else gets the model's
    # name, never a path.
    folder = base_models.resolve(run.base_model, svc.settings.models_dir, svc.settings.base_models)[1]
    tokenizer_id = str(folder) if svc.settings.embedded or client_is_local else run.base_model
    return {
        "type": "get_info",
        "model_id": model_id,
        "model_data": {"arch": base_models.architecture(folder), "model_name": run.base_model, "tokenizer_id": tokenizer_id},
        "is_lora": run.lora_config["rank"] > 0,  # rank 0: full fine-tuning
        "lora_rank": run.lora_config["rank"],
        "model_name": run.base_model,
    }


def _touch(svc: Service, model_id: str) -> None:
    svc.store.update(ModelRow, model_id, last_request_time=now())


@recovery.journaled
def forward_backward(svc: Service, tenant: str, model_id: str, seq_id: int | None, data: list[Datum], loss_fn: str,
                     loss_fn_config: dict | None, forward_only: bool, encode) -> FutureRow:
    run = svc.live_run(tenant, model_id)
    if loss_fn == "stable_reinforce":  # its sampler logprobs come from what the sampler recorded
        data = stability.resolve(svc.store, tenant, run.session_id, data)
    _touch(svc, model_id)
    tokens = sum(len(d.tokens) for d in data)
    fb = Pass(model_id, data, loss_fn, loss_fn_config, forward_only)
    counted = loss_tokens(data, loss_fn)

    def reply(result):
        # The ledger row keeps what the loss counts over beside its loss:sum (the sidebar's loss per token).
        job.metrics = {**(job.metrics or {}), LOSS_TOKENS: counted}
        return encode(result), PROTO_TYPE

    job = Job(new_id(), model_id, run.base_model, seq=seq_id, fb_pass=fb, tokens=tokens)
    kind = "Forward" if forward_only else "ForwardBackward"
    bound = Usage(prefill_tokens=tokens) if forward_only else Usage(train_tokens=tokens)  # exact: what it will bill
    return svc.submit(tenant, kind, train_key(model_id, seq_id), job, ordered=True, session_id=run.session_id,
                      bound=bound, run_id=model_id, encode=reply)


@recovery.journaled
def optim_step(svc: Service, tenant: str, model_id: str, seq_id: int | None, params: AdamParams | DimuonParams) -> FutureRow:
    run = svc.live_run(tenant, model_id)
    _touch(svc, model_id)

    def reply(result: dict):
        job.metrics = result["metrics"]
        if result.get("snapshot"):
            recovery.snapshotted(svc, model_id, seq_id, result["snapshot"])
        return json_result({"metrics": job.metrics, "type": "optim_step"})

    # Every STEPWISE_SNAPSHOT_EVERY steps the step also snapshots the run (with Ray workers the cluster decides).
    snapshot = {} if svc.executor.restores_runs else recovery.snapshot_args(svc, tenant, model_id)
    job = Job(new_id(), model_id, run.base_model, seq=seq_id, op=OptimStep(model_id, params, **snapshot))
    return svc.submit(tenant, "OptimStep", train_key(model_id, seq_id), job, ordered=True, session_id=run.session_id,
                      encode=reply)


# ---- REST: runs and the models they can use ---------------------------------------------------------


def training_run(svc: Service, tenant: str, model_id: str) -> dict:
    return training_run_json(svc, svc.run(tenant, model_id))


def training_run_json(svc: Service, run: ModelRow) -> dict:
    checkpoints = svc.store.list(CheckpointRow, CheckpointRow.model_id == run.id, order=CheckpointRow.created_at)
    last = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in ("training", "sampler")}
    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": run.tenant,
        "is_lora": run.lora_config["rank"] > 0,  # rank 0: full fine-tuning
        "lora_rank": run.lora_config["rank"],
        "last_request_time": iso(run.last_request_time),
        "last_checkpoint": checkpoint_json(last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["sampler"]) if last["sampler"] else None,
        "user_metadata": {k: str(v) for k, v in (run.user_metadata or {}).items()},
    }


def training_runs(svc: Service, tenant: str, limit: int, offset: int, project_id: str | None = None) -> dict:
    """The tenant's runs, newest first; with `project_id`, only those whose session is in that project."""
    where = [ModelRow.tenant == tenant]
    if project_id is not None:
        in_project = select(SessionRow.id).where(SessionRow.tenant == tenant,
                                                 sessions.project_column() == sessions.check_project_id(project_id))
        where.append(ModelRow.session_id.in_(in_project))
    rows = svc.store.list(ModelRow, *where, order=ModelRow.created_at.desc(), limit=limit, offset=offset)
    return {
        "training_runs": [training_run_json(svc, r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": svc.store.count(ModelRow, *where)},
    }


def capabilities(svc: Service) -> dict:
    loaded = svc.executor.facts()
    supported = []
    for name in dict.fromkeys([*base_models.available_models(), *loaded]):
        supported.append({
            "model_name": name,
            "max_context_length": loaded[name]["max_context"] if name in loaded else None,
            "trainable": True,
            "sampleable": True,
        })
    return {"supported_models": supported}
