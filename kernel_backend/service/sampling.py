"""Sampling: sampling sessions, sample (and compute_logprobs, which is a sample), and `generate`,
which the OpenAI-compatible endpoint (kernel_backend/api/openai.py) samples through.

A sampler samples from the base model, a saved sampler checkpoint (loaded into the engine on first
use), or an in-memory snapshot of a run (save_weights_and_get_sampling_client). Every request is
bounded and admitted before it is queued (admission.check_sampling).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

from kernel_backend.service import admission, stability
from kernel_backend.engine import base_models
from kernel_backend.execution.engine_work import SampleOp
from kernel_backend.service.checkpoints import SNAPSHOTS_PER_RUN, loadable
from kernel_backend.service.core import PROTO_TYPE, Service, json_result, new_id
from kernel_backend.errors import NotFound, UserError
from kernel_backend.execution.scheduler import Job
from kernel_backend.metering import Usage
from kernel_backend.persistence.database import CheckpointRow, FutureRow, ModelRow, SamplerRow, parse_tinker_path
from kernel_backend.types import SampleOptions, SamplingParams


def create_sampling_session(svc: Service, tenant: str, session_id: str, seq: int, base_model: str | None,
                            model_path: str | None) -> dict:
    svc.session(tenant, session_id)
    sampler_id = f"{session_id}:sample:{seq}"
    if svc.store.get(SamplerRow, sampler_id) is None:
        if model_path:
            checkpoint = loadable(svc, tenant, model_path, "sampling")
            run = svc.store.get(ModelRow, checkpoint.model_id)
            base = run.base_model
            svc.admission.adapter(tenant, base, run.lora_config, training=False)
        elif base_model:
            base = svc.model_name(base_model)
        else:
            raise UserError("create_sampling_session needs base_model or model_path")
        svc.store.add(SamplerRow(id=sampler_id, session_id=session_id, tenant=tenant, base_model=base,
                                 model_path=model_path))
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


def get_sampler(svc: Service, tenant: str, sampler_id: str) -> dict:
    row = svc.sampler(tenant, sampler_id)
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


def sample(svc: Service, tenant: str, sampler_id: str, seq_id: int, prompt: list[int], num_samples: int,
           params: SamplingParams, options: SampleOptions, encode, record_stability_info: bool = False) -> FutureRow:
    """Queue a sample request. With `record_stability_info`, each returned sequence's tokens and logprobs are
    kept under its sequence id for stable_reinforce (service/stability.py), within the session's cap."""
    sampler = svc.sampler(tenant, sampler_id)
    check_still_published(svc, tenant, sampler)
    bound = check_sampling(svc, sampler.base_model, prompt, num_samples, params, options)
    svc.ctx.sampler.check_options(options, params)  # what the sampler cannot answer is a 400 now, not a failure later
    request_id = new_id()
    op = sampler_op(svc, sampler, prompt, num_samples, params, options)
    ids = [f"{request_id}:{i}" for i in range(num_samples)]

    def reply(result):
        if record_stability_info:
            stability.record(svc.store, tenant, sampler.session_id, ids, prompt, result)
        return encode(result), PROTO_TYPE

    job = Job(request_id, sampler_id, sampler.base_model, seq=None, sample=op, tokens=len(prompt))
    key = f"sample:{sampler_id}:{seq_id}"
    recording = record_stability_info and svc.store.future_by_key(key) is None  # a retry was admitted when first sent
    if recording:
        svc.stability.admit(sampler.session_id, request_id,
                            stability.most_tokens(len(prompt), num_samples, params.max_tokens))
    try:
        return svc.submit(tenant, "Sample", key, job, ordered=False, extra={"sample_sequence_ids": ids},
                          session_id=sampler.session_id, bound=bound,
                          run_id=sampler.source_model_id or run_of(sampler.model_path), encode=reply)
    except Exception:
        svc.stability.settle(request_id)
        raise


def check_still_published(svc: Service, tenant: str, sampler: SamplerRow) -> None:
    """A sampler of another tenant's checkpoint samples only while its owner keeps it published."""
    checkpoint = svc.store.checkpoint_by_path(sampler.model_path) if sampler.model_path else None
    if checkpoint is not None and checkpoint.tenant != tenant and not checkpoint.public:
        raise NotFound(f"no checkpoint at {sampler.model_path}: its owner no longer publishes it")


def run_of(path: str | None) -> str | None:
    """The training run whose weights a tinker:// path holds."""
    return parse_tinker_path(path)[0] if path else None


def check_sampling(svc: Service, base_model: str, prompt: list[int], num_samples, params: SamplingParams,
                   options: SampleOptions) -> Usage:
    """Bound a sampling request before it is queued (admission.check_sampling); returns its most work."""
    facts = svc.executor.facts().get(base_model)
    max_context = facts["max_context"] if facts is not None else len(prompt) + svc.settings.max_sample_tokens
    vocab_size = facts.get("vocab_size", 1 << 31) if facts is not None else 1 << 31  # not loaded yet: the engine checks
    return admission.check_sampling(len(prompt), num_samples, params, max_context, svc.settings.max_sample_tokens,
                                    options, vocab_size)


def sampler_op(svc: Service, sampler: SamplerRow, prompt: list[int], num_samples: int, params: SamplingParams,
               options: SampleOptions) -> SampleOp:
    """A sample from what the sampler samples: the base model, an in-memory snapshot the engine holds, or a
    checkpoint the engine loads (from the store) the first time."""
    op = SampleOp(None, prompt, num_samples, params, options)
    if sampler.source_model_id is None and sampler.model_path is None:
        return op
    op.adapter_id = sampler.id
    if sampler.model_path is None:
        op.missing = (f"sampler {sampler.id} was an in-memory snapshot that is no longer kept (only the newest "
                      f"{SNAPSHOTS_PER_RUN} per run are); call save_weights_and_get_sampling_client again")
        return op
    locate(svc, op, sampler.model_path)
    op.owner = sampler.tenant
    return op


def locate(svc: Service, op: SampleOp, path: str) -> None:
    """Where the engine loads `path` from, if it does not hold it yet."""
    checkpoint = svc.store.checkpoint_by_path(path)
    op.path, op.missing = path, f"checkpoint {path} was deleted"
    op.location = checkpoint.directory if checkpoint is not None else None


# ---- the OpenAI-compatible endpoint ----------------------------------------------------------------


def openai_model(svc: Service, tenant: str, model: str) -> tuple[str, str | None]:
    """'base', 'tinker://...' or 'base;tinker://...' -> (base model, checkpoint path or None)."""
    base, _, path = model.partition(";") if ";" in model else (("", "", model) if model.startswith("tinker://") else (model, "", ""))
    if path:
        checkpoint = loadable(svc, tenant, path)
        run_base = svc.store.get(ModelRow, checkpoint.model_id).base_model
        if base and svc.model_name(base) != run_base:
            raise UserError(f"{path} was trained on {run_base}, not {base}")
        return run_base, path
    try:
        return svc.model_name(base), None
    except UserError as e:
        raise NotFound(f"model {model!r} not found: {e}") from None


def openai_models(svc: Service, tenant: str) -> list[str]:
    names = list(dict.fromkeys([*base_models.available_models(), *svc.executor.facts()]))
    samplers = svc.store.list(CheckpointRow, CheckpointRow.tenant == tenant, CheckpointRow.kind != "external",
                              order=CheckpointRow.created_at)
    return names + [c.tinker_path for c in samplers]


def tokenizer(svc: Service, base_model: str):
    """A tokenizer for the API threads (the engine's own belongs to the scheduler thread)."""
    if base_model not in svc.tokenizers:
        from transformers import AutoTokenizer

        folder = base_models.resolve(base_model, svc.settings.models_dir, svc.settings.base_models)[1]
        svc.tokenizers[base_model] = AutoTokenizer.from_pretrained(folder)
    return svc.tokenizers[base_model]


def eos_ids(svc: Service, base_model: str) -> set[int]:
    tok = tokenizer(svc, base_model)
    return {tok.eos_token_id} if tok.eos_token_id is not None else set()


MAX_PROMPTS = 256  # prompts x samples in one OpenAI completions request (each prompt is its own job)


def generate(svc: Service, tenant: str, request_type: str, base_model: str, path: str | None, prompts: list[list[int]],
             num_samples: int, params: SamplingParams, options: SampleOptions | None = None, on_token=None,
             session_id: str | None = None):
    """Sample `num_samples` continuations of each prompt on the scheduler thread, metered like any
    request (a ledger row per prompt). Every prompt is bounded, and the whole batch admitted as one,
    now (raising UserError or RateLimited before anything is queued or streams); each prompt is a job
    of its own, so they share the decode batch with everyone's. Await the result for one SampleResult
    per prompt. `on_token(row, token, logprob)` streams a single prompt's tokens. `session_id`: the session it is
    recorded under (the OpenAI and Anthropic routes': the client's own, sessions.client_session)."""
    options = options or SampleOptions()
    if not prompts or len(prompts) * num_samples > MAX_PROMPTS:
        raise UserError(f"a request takes 1 to {MAX_PROMPTS} prompts x n samples, got {len(prompts)} x {num_samples}; "
                        "split it into several requests")
    if on_token is not None and len(prompts) != 1:
        raise UserError("streaming takes one prompt per request")
    most = [check_sampling(svc, base_model, prompt, num_samples, params, options) for prompt in prompts]
    svc.ctx.sampler.check_options(options, params)  # what the sampler cannot answer is a 400 now, not a failure later
    batch = new_id()
    # A checkpoint's sampling counts against its run (the run's budget; the run's scope of usage finds its rows by
    # their lane, budgets.ledger_scope), and is recorded under the caller's own session, not the run's: an eval of a
    # notebook's checkpoint is the eval client's work, not the notebook's (the sidebar shows it on its own row).
    run_id = run_of(path)
    svc.admit(tenant, request_type, batch, base_model, Usage(prefill_tokens=sum(u.prefill_tokens for u in most),
                                               sample_tokens=sum(u.sample_tokens for u in most)),
              session_id, run_id)  # the jobs below are admitted as this one batch
    lane = f"oai:{tenant}:{path or base_model}"
    outputs: list[dict] = [{} for _ in prompts]
    jobs = []
    cancel = threading.Event()  # set when the caller goes away (a closed stream)
    first = SampleOp(None, prompts[0], num_samples, params, options)
    if path is not None:  # where the checkpoint is: looked up once, for every prompt's op
        first.adapter_id, first.owner = lane, tenant
        locate(svc, first, path)
    for prompt, output in zip(prompts, outputs):
        op = dataclasses.replace(first, prompt=prompt)

        def keep(result, output=output):
            output["result"] = result
            return json_result({"sequences": len(result.sequences)})

        jobs.append((Job(new_id(), lane, base_model, seq=None, sample=op, on_token=on_token, cancel=cancel,
                         tokens=len(prompt)), keep))
    try:
        for job, keep in jobs:
            svc.submit(tenant, request_type, None, job, ordered=False, session_id=session_id, encode=keep)
    except Exception:
        svc.admission.settle(batch, 0)
        svc.budgets.release(batch)
        raise

    async def results() -> list:
        try:
            rows = [await _finished(svc, tenant, job.request_id) for job, _ in jobs]
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:  # what the batch really processed replaces its bound (the ledger rows have it exactly)
            done = [o["result"] for o in outputs if "result" in o]
            svc.admission.settle(batch, sum(len(p) for p in prompts) + sum(len(s.tokens) for r in done for s in r.sequences))
            svc.budgets.release(batch)  # each job's ledger row has its cost now
        for row in rows:
            if row.status != "done":
                error = json.loads(row.result)
                raise (UserError if error.get("category") == "user" else RuntimeError)(error["error"])
        return [output["result"] for output in outputs]

    return results()


async def _finished(svc: Service, tenant: str, request_id: str):
    row = None
    while row is None:
        row = await svc.retrieve(tenant, request_id)
    return row
