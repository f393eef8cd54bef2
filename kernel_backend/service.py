"""The training-session service: what each API call does, independent of HTTP.

It owns the store (durable rows), the scheduler (the thread that runs the engines) and the
futures' waiters. Routers in `kernel_backend.api` parse requests into the SDK's own pydantic
types, call one method here, and turn the answer into a response. Direct answers are plain
dicts; queued work returns a `FutureRow` whose result the client polls with retrieve_future.

Errors: `UserError` for bad input (the router answers 400), `NotFound` for ids the caller
cannot see (404, also for another tenant's ids, so their existence is not revealed).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import threading
import uuid


from kernel_backend import crypto, keys, models, runtime
from kernel_backend.keys import LOCAL_TENANT
from kernel_backend.config import Settings
from kernel_backend.metering import Prices, Usage
from kernel_backend.engine import Engine, Pass
from kernel_backend.scheduler import Job, Scheduler, error_payload
from kernel_backend.storage import CheckpointStorage, folder_size
from kernel_backend.store import (
    CheckpointRow,
    FutureRow,
    ModelRow,
    SamplerRow,
    SessionRow,
    Store,
    UsageRow,
    now,
    parse_tinker_path,
    tinker_path,
)
from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams, UserError

log = logging.getLogger("stepwise.service")

JSON_TYPE = "application/json"
PROTO_TYPE = "application/x-protobuf"
# How many in-memory sampler snapshots (save_weights_and_get_sampling_client) a run keeps.
SNAPSHOTS_PER_RUN = 4
# A long poll answers try_again after this long, well inside the SDK's 45 s timeout.
POLL_HOLD_S = 20.0


class NotFound(LookupError):
    pass


class Gone(Exception):
    """The thing existed but is over: a finished or expired session, an interrupted request (410)."""


class HomeInUse(RuntimeError):
    """Another backend already serves this SQLite home; the message names it."""


class RateLimited(Exception):
    """Over a per-tenant limit (429); `retry_after` seconds is when to try again."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _json(obj: dict) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), JSON_TYPE


def _new_id() -> str:
    return uuid.uuid4().hex


class Service:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._lock_home()
        self.store = Store(self.settings.database_url)
        self.storage = CheckpointStorage(self.settings.checkpoints_dir, self.settings.storage_url)
        self.prices = Prices(self.settings.prices_path or None)
        self.scheduler = Scheduler(
            load_engine=lambda name: Engine(name, self.settings),
            on_done=self._on_done,
            max_batch_tokens=self.settings.max_batch_tokens,
        )
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._waiters_lock = threading.Lock()
        self._snapshots: dict[str, list[str]] = {}  # run id -> its in-memory sampler ids, oldest first
        self._tokenizers: dict[str, object] = {}
        self._fail_interrupted_futures()
        if self.settings.local_key:
            keys.create(self.store, LOCAL_TENANT, self.settings.local_key)
        self._reaper = threading.Thread(target=self._reap_forever, name="stepwise-reaper", daemon=True)
        self._stopping = threading.Event()

    def _lock_home(self) -> None:
        """One backend per SQLite home: a second one would mark the first's requests interrupted."""
        if not self.settings.database_url.startswith("sqlite"):
            return
        import fcntl

        self.settings.home.mkdir(parents=True, exist_ok=True)
        self._home_lock = open(self.settings.home / "backend.lock", "w")
        try:
            fcntl.flock(self._home_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = runtime.running_backend(self.settings.home) or {}
            where = f" at {holder['base_url']} (pid {holder['pid']})" if holder else ""
            raise HomeInUse(
                f"another Stepwise backend already serves {self.settings.home}{where}: use that one "
                "(workbench.connect() and `stepwise demo` in this home share it by themselves), or give this "
                "backend its own folder with STEPWISE_HOME=..."
            ) from None

    def start(self, preload: list[str] | None = None) -> None:
        """Load base models (before serving, so the first request is not slow) and start the thread."""
        for name in preload if preload is not None else [models.DEFAULT_MODEL, *self.settings.base_models]:
            self.scheduler.engine(self._model_name(name))
        self.scheduler.start()
        self._reaper.start()

    def stop(self) -> None:
        self._stopping.set()
        self.scheduler.stop()
        if self.settings.local_key:  # the embedded backend's key dies with it
            keys.revoke(self.store, self.settings.local_key)

    def _fail_interrupted_futures(self) -> None:
        """Futures left pending by a previous process will never finish: mark them interrupted.

        Polling one answers 410, on which the SDK submits the request again (and the resubmission
        replaces the interrupted row, see Store.insert_future).
        """
        for row in self.store.list(FutureRow, FutureRow.status == "pending"):
            payload = error_payload("the server restarted while this request was in flight; submit it again", "server")
            self.store.finish_future(row.request_id, "interrupted", payload, JSON_TYPE)

    # ---- housekeeping: expired sessions, expired checkpoints -----------------------------------

    def _reap_forever(self) -> None:
        while not self._stopping.wait(self.settings.reap_interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("housekeeping failed; will try again")

    def reap(self) -> None:
        """Expire sessions that stopped heart-beating (freeing their adapters) and expired checkpoints."""
        cutoff = now() - dt.timedelta(seconds=self.settings.session_timeout_s)
        for session in self.store.list(SessionRow, SessionRow.status == "active", SessionRow.last_heartbeat < cutoff):
            self._end_session(session.id, "expired")
        # A session opened by a process on this machine (workbench.connect() puts its pid in the
        # metadata) ends with that process: a shut-down kernel's session is over, not idle.
        for session in self.store.list(SessionRow, SessionRow.status == "active"):
            pid = str((session.user_metadata or {}).get("local_pid", ""))
            if pid.isdigit() and not runtime.pid_alive(int(pid)):
                self._end_session(session.id, "finished")
        for checkpoint in self.store.list(CheckpointRow, CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at < now()):
            self.store.delete_checkpoint(checkpoint)
            self.storage.delete(checkpoint.directory)

    def _end_session(self, session_id: str, status: str) -> None:
        """Mark a session over and free its adapters (on the scheduler thread)."""
        self.store.update(SessionRow, session_id, status=status)
        lanes = [r.id for r in self.store.list(ModelRow, ModelRow.session_id == session_id)]
        lanes += [r.id for r in self.store.list(SamplerRow, SamplerRow.session_id == session_id)]
        for lane in lanes:
            def free(engine: Engine, lane=lane):
                for e in self.scheduler.engines.values():
                    e.delete_adapter(lane)
                return _json({})
            self.scheduler.submit(Job(_new_id(), f"free:{lane}", models.DEFAULT_MODEL, seq=None, run=free), ordered=False)
        log.info("session %s %s; freed %d adapters", session_id, status, len(lanes))

    def _check_limits(self, tenant: str, tokens: int = 0, new_session: bool = False) -> None:
        """Per-tenant limits: concurrent sessions and tokens per minute (429 with Retry-After)."""
        from sqlalchemy import func, select

        if new_session and self.settings.max_sessions_per_tenant:
            alive = self.store.count(SessionRow, SessionRow.tenant == tenant, SessionRow.status == "active")
            if alive >= self.settings.max_sessions_per_tenant:
                raise RateLimited(f"tenant {tenant!r} has {alive} active sessions, the limit is "
                                  f"{self.settings.max_sessions_per_tenant}; close one (ServiceClient.close())", 10)
        if tokens and self.settings.tokens_per_minute:
            since = now() - dt.timedelta(seconds=60)
            with self.store.session() as s:
                used = s.scalar(select(func.coalesce(func.sum(UsageRow.prefill_tokens + UsageRow.sample_tokens
                                                              + UsageRow.train_tokens), 0))
                                .where(UsageRow.tenant == tenant, UsageRow.created_at >= since))
            if used + tokens > self.settings.tokens_per_minute:
                raise RateLimited(f"tenant {tenant!r} processed {used} tokens in the last minute; this request's "
                                  f"{tokens} would pass the limit of {self.settings.tokens_per_minute}", 5)

    # ---- futures -------------------------------------------------------------------------------

    def _submit(self, tenant: str, request_type: str, dedupe_key: str, job: Job, ordered: bool, extra=None,
                session_id: str | None = None) -> FutureRow:
        job.tenant, job.request_type, job.session_id = tenant, request_type, session_id
        row = FutureRow(
            request_id=job.request_id,
            dedupe_key=dedupe_key,
            tenant=tenant,
            request_type=request_type,
            model_id=job.lane,
            extra=extra or {},
        )
        row, created = self.store.insert_future(row)
        if created:
            self.scheduler.submit(job, ordered=ordered)
        return row

    def _on_done(self, job: Job, status: str, payload: bytes, content_type: str) -> None:
        """Record the outcome and, for a completed request, its ledger row (failures bill nothing)."""
        if not job.request_type:  # the service's own housekeeping (freeing adapters): no future, no bill
            return
        ledger = None
        if status == "done":
            usage = job.usage or Usage()
            engine = self.scheduler.engines.get(job.base_model)
            slot = engine.slots.get(job.lane) if engine else None
            is_sampler = job.request_type in ("Sample", "ChatCompletion", "Completion")
            ledger = UsageRow(
                request_id=job.request_id, tenant=job.tenant, session_id=job.session_id,
                model_id=None if is_sampler else job.lane, sampler_id=job.lane if is_sampler else None,
                base_model=job.base_model, request_type=job.request_type,
                step=slot.steps if slot is not None and not is_sampler else None,
                prefill_tokens=usage.prefill_tokens, sample_tokens=usage.sample_tokens, train_tokens=usage.train_tokens,
                cost=self.prices.cost(job.base_model, usage), duration_s=job.duration_s, metrics=job.metrics,
            )
        self.store.finish_future(job.request_id, status, payload, content_type, ledger)
        with self._waiters_lock:
            waiters = self._waiters.pop(job.request_id, [])
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def retrieve(self, tenant: str, request_id: str) -> FutureRow | None:
        """The finished future, or None if it is still running after a long poll (try again)."""
        row = self.store.get(FutureRow, request_id, tenant)
        if row is None:
            raise NotFound(f"unknown request_id {request_id!r}")
        if row.status != "pending":
            return row
        event = asyncio.Event()
        with self._waiters_lock:
            self._waiters.setdefault(request_id, []).append((asyncio.get_running_loop(), event))
        row = self.store.get(FutureRow, request_id)  # it may have finished before we registered
        if row.status == "pending":
            try:
                await asyncio.wait_for(event.wait(), POLL_HOLD_S)
            except asyncio.TimeoutError:
                return None
            row = self.store.get(FutureRow, request_id)
        return row

    # ---- sessions --------------------------------------------------------------------------------

    def create_session(self, tenant: str, tags, user_metadata, sdk_version, display_name=None) -> dict:
        self._check_limits(tenant, new_session=True)
        session_id = _new_id()[:20]
        self.store.add(
            SessionRow(
                id=session_id,
                tenant=tenant,
                tags=list(tags or []),
                user_metadata=dict(user_metadata or {}),
                display_name=display_name,
                sdk_version=sdk_version,
            )
        )
        return {"session_id": session_id, "type": "create_session"}

    def _session(self, tenant: str, session_id: str) -> SessionRow:
        row = self.store.get(SessionRow, session_id, tenant)
        if row is None:
            raise NotFound(f"unknown session {session_id!r}; create one with ServiceClient()")
        return row

    def heartbeat(self, tenant: str, session_id: str) -> dict:
        if self._session(tenant, session_id).status != "active":
            raise Gone(f"session {session_id} has ended")  # 410 stops the SDK's heartbeat loop
        self.store.update(SessionRow, session_id, last_heartbeat=now())
        return {"type": "session_heartbeat"}

    def finish_session(self, tenant: str, session_id: str, reason: str | None) -> dict:
        if self._session(tenant, session_id).status == "active":
            self._end_session(session_id, "finished")
        return {}

    def get_session(self, tenant: str, session_id: str) -> dict:
        row = self._session(tenant, session_id)
        runs = self.store.list(ModelRow, ModelRow.session_id == session_id, order=ModelRow.created_at)
        samplers = self.store.list(SamplerRow, SamplerRow.session_id == session_id, order=SamplerRow.created_at)
        return {
            "training_run_ids": [r.id for r in runs],
            "sampler_ids": [s.id for s in samplers],
            "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()},
            "display_name": row.display_name,
            "status": row.status,
        }

    def list_sessions(self, tenant: str, limit: int, offset: int) -> dict:
        rows = self.store.list(SessionRow, SessionRow.tenant == tenant, order=SessionRow.created_at.desc(), limit=limit, offset=offset)
        return {"sessions": [r.id for r in rows]}

    # ---- training runs -----------------------------------------------------------------------------

    def _model_name(self, name: str) -> str:
        """Canonical base-model name; UserError naming the available ones if unknown."""
        return models.resolve(name, self.settings.models_dir)[0]

    def _run(self, tenant: str, model_id: str) -> ModelRow:
        row = self.store.get(ModelRow, model_id, tenant)
        if row is None:
            raise NotFound(f"unknown training run {model_id!r}")
        return row

    def _live_run(self, tenant: str, model_id: str, tokens: int = 0) -> ModelRow:
        """A run that can still train: its session is active. Also applies the tenant's limits."""
        row = self._run(tenant, model_id)
        session = self.store.get(SessionRow, row.session_id)
        if session.status != "active":
            raise Gone(f"training run {model_id} belongs to a session that has {session.status}; its adapter was freed. "
                       "Resume from a checkpoint: create_training_client_from_state_with_optimizer(path)")
        self._check_limits(tenant, tokens)
        return row

    def create_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, lora: dict | None,
                     optimizer_type: str, user_metadata: dict | None) -> FutureRow:
        self._session(tenant, session_id)
        if optimizer_type != "adamw":
            raise UserError(f"optimizer {optimizer_type!r} is not supported; this backend supports: adamw")
        config = LoraConfig(**{"rank": 32, **{k: v for k, v in (lora or {}).items() if v is not None}})
        if not 1 <= config.rank <= 512:
            raise UserError(f"lora rank must be from 1 to 512, got {config.rank}")
        base = self._model_name(base_model)
        model_id = f"{session_id}:train:{model_seq_id}"
        if self.store.get(ModelRow, model_id) is None:
            self.store.add(ModelRow(id=model_id, session_id=session_id, tenant=tenant, base_model=base,
                                    lora_config=vars(config), user_metadata=dict(user_metadata or {})))

        def run(engine: Engine):
            engine.create_adapter(model_id, config)
            return _json({"model_id": model_id, "type": "create_model"})

        job = Job(_new_id(), model_id, base, seq=None, run=run)
        return self._submit(tenant, "CreateModel", f"create_model:{session_id}:{model_seq_id}", job, ordered=True,
                            session_id=session_id)

    def get_info(self, tenant: str, model_id: str) -> dict:
        run = self._run(tenant, model_id)
        _, path = models.resolve(run.base_model, self.settings.models_dir)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": "llama", "model_name": run.base_model, "tokenizer_id": str(path)},
            "is_lora": True,
            "lora_rank": run.lora_config["rank"],
            "model_name": run.base_model,
        }

    def _touch(self, model_id: str) -> None:
        self.store.update(ModelRow, model_id, last_request_time=now())

    def forward_backward(self, tenant: str, model_id: str, seq_id: int, data: list[Datum], loss_fn: str,
                         loss_fn_config: dict | None, forward_only: bool, encode) -> FutureRow:
        run = self._live_run(tenant, model_id, tokens=sum(len(d.tokens) for d in data))
        self._touch(model_id)
        fb = Pass(model_id, data, loss_fn, loss_fn_config, forward_only)
        job = Job(_new_id(), model_id, run.base_model, seq=seq_id, fb_pass=fb,
                  encode=lambda result: (encode(result), PROTO_TYPE), tokens=sum(len(d.tokens) for d in data))
        kind = "Forward" if forward_only else "ForwardBackward"
        return self._submit(tenant, kind, f"train:{model_id}:{seq_id}", job, ordered=True, session_id=run.session_id)

    def optim_step(self, tenant: str, model_id: str, seq_id: int, params: AdamParams) -> FutureRow:
        run = self._live_run(tenant, model_id)
        self._touch(model_id)

        def step(engine: Engine):
            job.metrics = engine.optim_step(model_id, params)
            return _json({"metrics": job.metrics, "type": "optim_step"})

        job = Job(_new_id(), model_id, run.base_model, seq=seq_id, run=step)
        return self._submit(tenant, "OptimStep", f"train:{model_id}:{seq_id}", job, ordered=True, session_id=run.session_id)

    def save_weights(self, tenant: str, model_id: str, seq_id: int, name: str | None, kind: str,
                     overwrite: bool = True, ttl_seconds: int | None = None, user_metadata: dict | None = None) -> FutureRow:
        """save_state (kind "training": weights + optimizer) or save_weights_for_sampler (kind "sampler")."""
        run = self._live_run(tenant, model_id)
        name = name or f"{kind}-{seq_id:06d}"
        if "/" in name or name in (".", "..") or not name.strip():
            raise UserError(f"checkpoint name {name!r} must be a plain name without '/'")
        path = tinker_path(model_id, kind, name)
        key = self.store.checkpoint_key(tenant, model_id, kind, name)
        expires = now() + dt.timedelta(seconds=ttl_seconds) if ttl_seconds else None

        def save(engine: Engine):
            existing = self.store.checkpoint_by_path(path)
            if existing is not None and not overwrite:
                raise UserError(f"checkpoint {path} already exists; pass overwrite=True or pick another name")
            with self.storage.writing(key) as (staging, located):
                if kind == "training":
                    engine.save_state(model_id, staging)
                else:
                    engine.save_weights_for_sampler(model_id, staging)
                if self.settings.encryption_key:  # sealed before it reaches the store
                    crypto.seal(staging, self.settings.encryption_key)
                size = folder_size(staging)
            if existing is not None:
                self.store.delete_checkpoint(existing)
            self.store.add(CheckpointRow(tinker_path=path, model_id=model_id, tenant=tenant, kind=kind, name=name,
                                         directory=located[0], size_bytes=size, expires_at=expires,
                                         user_metadata=dict(user_metadata or {})))
            return _json({"path": path, "type": "save_weights" if kind == "training" else "save_weights_for_sampler"})

        job = Job(_new_id(), model_id, run.base_model, seq=seq_id, run=save)
        request_type = "SaveWeights" if kind == "training" else "SaveWeightsForSampler"
        return self._submit(tenant, request_type, f"train:{model_id}:{seq_id}", job, ordered=True, session_id=run.session_id)

    def snapshot_for_sampler(self, tenant: str, model_id: str, seq_id: int, sampling_session_seq_id: int) -> FutureRow:
        """save_weights_and_get_sampling_client: an in-memory copy of the weights, with a sampler id."""
        run = self._live_run(tenant, model_id)
        sampler_id = f"{run.session_id}:sample:{sampling_session_seq_id}"

        def snapshot(engine: Engine):
            engine.snapshot_sampler(model_id, sampler_id)
            if self.store.get(SamplerRow, sampler_id) is None:
                self.store.add(SamplerRow(id=sampler_id, session_id=run.session_id, tenant=tenant,
                                          base_model=run.base_model, source_model_id=model_id))
            kept = self._snapshots.setdefault(model_id, [])
            kept.append(sampler_id)
            while len(kept) > SNAPSHOTS_PER_RUN:
                engine.delete_adapter(kept.pop(0))
            return _json({"path": None, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

        job = Job(_new_id(), model_id, run.base_model, seq=seq_id, run=snapshot)
        return self._submit(tenant, "SaveWeightsForSampler", f"train:{model_id}:{seq_id}", job, ordered=True,
                            session_id=run.session_id)

    def load_weights(self, tenant: str, path: str, with_optimizer: bool, model_id: str | None = None,
                     seq_id: int | None = None, session_id: str | None = None, model_seq_id: int | None = None,
                     user_metadata: dict | None = None) -> FutureRow:
        """Legacy load_state into an existing run, or create a new run from a checkpoint."""
        checkpoint = self._checkpoint(tenant, path)
        source = self.store.get(ModelRow, checkpoint.model_id)
        if model_id is None:  # create-via-load
            if session_id is None or model_seq_id is None:
                raise UserError("load_weights needs either model_id, or session_id and model_seq_id")
            self._session(tenant, session_id)
            model_id = f"{session_id}:train:{model_seq_id}"
            if self.store.get(ModelRow, model_id) is None:
                self.store.add(ModelRow(id=model_id, session_id=session_id, tenant=tenant, base_model=source.base_model,
                                        lora_config=source.lora_config, user_metadata=dict(user_metadata or source.user_metadata or {})))
            dedupe, seq = f"create_model:{session_id}:{model_seq_id}", None
        else:
            run = self._live_run(tenant, model_id)
            if run.base_model != source.base_model:
                raise UserError(f"checkpoint {path} is for {source.base_model}, but {model_id} trains {run.base_model}")
            dedupe, seq = f"train:{model_id}:{seq_id}", seq_id
        target = model_id

        def load(engine: Engine):
            with self.storage.open(checkpoint.directory, self.settings.encryption_key) as plain:
                engine.load_state(target, plain, with_optimizer=with_optimizer and checkpoint.kind == "training")
            return _json({"path": path, "model_id": target, "type": "load_weights"})

        job = Job(_new_id(), target, source.base_model, seq=seq, run=load)
        session = self.store.get(ModelRow, target).session_id
        return self._submit(tenant, "LoadWeights", dedupe, job, ordered=True, session_id=session)

    # ---- sampling -------------------------------------------------------------------------------

    def create_sampling_session(self, tenant: str, session_id: str, seq: int, base_model: str | None,
                                model_path: str | None) -> dict:
        self._session(tenant, session_id)
        sampler_id = f"{session_id}:sample:{seq}"
        if self.store.get(SamplerRow, sampler_id) is None:
            if model_path:
                checkpoint = self._checkpoint(tenant, model_path)
                base = self.store.get(ModelRow, checkpoint.model_id).base_model
            elif base_model:
                base = self._model_name(base_model)
            else:
                raise UserError("create_sampling_session needs base_model or model_path")
            self.store.add(SamplerRow(id=sampler_id, session_id=session_id, tenant=tenant, base_model=base,
                                      model_path=model_path))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def get_sampler(self, tenant: str, sampler_id: str) -> dict:
        row = self._sampler(tenant, sampler_id)
        return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}

    def _sampler(self, tenant: str, sampler_id: str) -> SamplerRow:
        row = self.store.get(SamplerRow, sampler_id, tenant)
        if row is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return row

    def sample(self, tenant: str, sampler_id: str, seq_id: int, prompt: list[int], num_samples: int,
               params: SamplingParams, prompt_logprobs: bool, topk_prompt_logprobs: int, encode) -> FutureRow:
        sampler = self._sampler(tenant, sampler_id)
        self._check_limits(tenant, len(prompt) + num_samples * (params.max_tokens or 0))
        request_id = _new_id()

        def sample(engine: Engine):
            adapter_id = self._ensure_sampler(engine, sampler)
            result = engine.sample(adapter_id, prompt, num_samples, params, prompt_logprobs, topk_prompt_logprobs)
            job.usage = Usage(prefill_tokens=len(prompt), sample_tokens=sum(len(s.tokens) for s in result.sequences))
            return encode(result), PROTO_TYPE

        job = Job(request_id, sampler_id, sampler.base_model, seq=None, run=sample)
        ids = [f"{request_id}:{i}" for i in range(num_samples)]
        return self._submit(tenant, "Sample", f"sample:{sampler_id}:{seq_id}", job, ordered=False,
                            extra={"sample_sequence_ids": ids}, session_id=sampler.session_id)

    def _ensure_sampler(self, engine: Engine, sampler: SamplerRow) -> str | None:
        """The engine adapter a sampler samples from (None: the base model). Scheduler thread only."""
        if sampler.source_model_id is None and sampler.model_path is None:
            return None
        if engine.has_adapter(sampler.id):
            return sampler.id
        if sampler.model_path is None:
            raise UserError(
                f"sampler {sampler.id} was an in-memory snapshot that is no longer kept (only the newest "
                f"{SNAPSHOTS_PER_RUN} per run are); call save_weights_and_get_sampling_client again"
            )
        checkpoint = self.store.checkpoint_by_path(sampler.model_path)
        if checkpoint is None:
            raise UserError(f"checkpoint {sampler.model_path} was deleted")
        with self.storage.open(checkpoint.directory, self.settings.encryption_key) as plain:
            engine.load_sampler(sampler.id, plain)
        return sampler.id

    # ---- the OpenAI-compatible endpoint ----------------------------------------------------------

    def openai_model(self, tenant: str, model: str) -> tuple[str, str | None]:
        """'base', 'tinker://...' or 'base;tinker://...' -> (base model, checkpoint path or None)."""
        base, _, path = model.partition(";") if ";" in model else (("", "", model) if model.startswith("tinker://") else (model, "", ""))
        if path:
            checkpoint = self._checkpoint(tenant, path)
            run_base = self.store.get(ModelRow, checkpoint.model_id).base_model
            if base and self._model_name(base) != run_base:
                raise UserError(f"{path} was trained on {run_base}, not {base}")
            return run_base, path
        try:
            return self._model_name(base), None
        except UserError as e:
            raise NotFound(f"model {model!r} not found: {e}") from None

    def openai_models(self, tenant: str) -> list[str]:
        names = list(dict.fromkeys([*models.available_models(), *self.scheduler.engines]))
        samplers = self.store.list(CheckpointRow, CheckpointRow.tenant == tenant, order=CheckpointRow.created_at)
        return names + [c.tinker_path for c in samplers]

    def tokenizer(self, base_model: str):
        """A tokenizer for the API threads (the engine's own belongs to the scheduler thread)."""
        if base_model not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[base_model] = AutoTokenizer.from_pretrained(models.resolve(base_model, self.settings.models_dir)[1])
        return self._tokenizers[base_model]

    def eos_ids(self, base_model: str) -> set[int]:
        tokenizer = self.tokenizer(base_model)
        return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()

    async def generate(self, tenant: str, request_type: str, base_model: str, path: str | None, prompt: list[int],
                       num_samples: int, params: SamplingParams, topk_sample_logprobs: int = 0, on_token=None):
        """Sample now, on the scheduler thread, metered like any request; returns the SampleResult."""
        lane = f"oai:{tenant}:{path or base_model}"
        request_id = _new_id()
        output = {}

        def sample(engine: Engine):
            adapter_id = None
            if path is not None:
                if not engine.has_adapter(lane):
                    checkpoint = self.store.checkpoint_by_path(path)
                    if checkpoint is None:
                        raise UserError(f"checkpoint {path} was deleted")
                    with self.storage.open(checkpoint.directory, self.settings.encryption_key) as plain:
                        engine.load_sampler(lane, plain)
                adapter_id = lane
            result = engine.sample(adapter_id, prompt, num_samples, params, on_token=on_token,
                                   topk_sample_logprobs=topk_sample_logprobs)
            job.usage = Usage(prefill_tokens=len(prompt), sample_tokens=sum(len(s.tokens) for s in result.sequences))
            output["result"] = result
            return _json({"sequences": len(result.sequences)})

        job = Job(request_id, lane, base_model, seq=None, run=sample)
        self._submit(tenant, request_type, f"oai:{request_id}", job, ordered=False)
        row = None
        while row is None:
            row = await self.retrieve(tenant, request_id)
        if row.status != "done":
            error = json.loads(row.result)
            raise (UserError if error.get("category") == "user" else RuntimeError)(error["error"])
        return output["result"]

    # ---- checkpoints and runs (REST) --------------------------------------------------------------

    def _checkpoint(self, tenant: str, path: str) -> CheckpointRow:
        parse_tinker_path(path)
        row = self.store.checkpoint_by_path(path, tenant)
        if row is None:
            raise NotFound(f"no checkpoint at {path}")
        return row

    def training_run(self, tenant: str, model_id: str) -> dict:
        return self._training_run_json(self._run(tenant, model_id))

    def _training_run_json(self, run: ModelRow) -> dict:
        checkpoints = self.store.list(CheckpointRow, CheckpointRow.model_id == run.id, order=CheckpointRow.created_at)
        last = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in ("training", "sampler")}
        return {
            "training_run_id": run.id,
            "base_model": run.base_model,
            "model_owner": run.tenant,
            "is_lora": True,
            "lora_rank": run.lora_config["rank"],
            "last_request_time": _iso(run.last_request_time),
            "last_checkpoint": _checkpoint_json(last["training"]) if last["training"] else None,
            "last_sampler_checkpoint": _checkpoint_json(last["sampler"]) if last["sampler"] else None,
            "user_metadata": {k: str(v) for k, v in (run.user_metadata or {}).items()},
        }

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict:
        where = (ModelRow.tenant == tenant,)
        rows = self.store.list(ModelRow, *where, order=ModelRow.created_at.desc(), limit=limit, offset=offset)
        return {
            "training_runs": [self._training_run_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": self.store.count(ModelRow, *where)},
        }

    def checkpoints(self, tenant: str, model_id: str | None, limit: int = 100, offset: int = 0) -> dict:
        where = [CheckpointRow.tenant == tenant]
        if model_id is not None:
            self._run(tenant, model_id)
            where.append(CheckpointRow.model_id == model_id)
        rows = self.store.list(CheckpointRow, *where, order=CheckpointRow.created_at.desc(), limit=limit, offset=offset)
        return {
            "checkpoints": [_checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": self.store.count(CheckpointRow, *where)},
        }

    def delete_checkpoint(self, tenant: str, model_id: str, segment: str, name: str) -> dict:
        path = f"tinker://{model_id}/{segment}/{name}"
        row = self._checkpoint(tenant, path)
        if row.tenant != tenant:
            raise NotFound(f"no checkpoint at {path}")
        self.store.delete_checkpoint(row)
        self.storage.delete(row.directory)
        return {}

    def set_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> dict:
        row = self._checkpoint(tenant, path)
        if row.tenant != tenant:
            raise NotFound(f"no checkpoint at {path}")
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds <= 0):
            raise UserError("ttl_seconds must be a positive integer, or null for no expiry")
        expires = now() + dt.timedelta(seconds=ttl_seconds) if ttl_seconds else None
        self.store.update(CheckpointRow, row.id, expires_at=expires)
        return _checkpoint_json(self.store.get(CheckpointRow, row.id))

    def weights_info(self, tenant: str, path: str) -> dict:
        row = self._checkpoint(tenant, path)
        run = self.store.get(ModelRow, row.model_id)
        lora = run.lora_config
        return {
            "base_model": run.base_model,
            "is_lora": True,
            "lora_rank": lora["rank"],
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
        }

    def capabilities(self) -> dict:
        names = dict.fromkeys([*models.available_models(), *self.scheduler.engines])
        supported = []
        for name in names:
            engine = self.scheduler.engines.get(name)
            supported.append({
                "model_name": name,
                "max_context_length": engine.max_context if engine else None,
                "trainable": True,
                "sampleable": True,
            })
        return {"supported_models": supported}


def _utc(t: dt.datetime) -> dt.datetime:
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)  # SQLite returns naive datetimes; we store UTC


def _iso(t: dt.datetime) -> str:
    return _utc(t).isoformat()


def _checkpoint_json(row: CheckpointRow) -> dict:
    segment = "weights" if row.kind == "training" else "sampler_weights"
    return {
        "checkpoint_id": f"{segment}/{row.name}",
        "checkpoint_type": row.kind,
        "time": _iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
        "expires_at": _iso(row.expires_at) if row.expires_at else None,
    }


# ---- the ledger ----------------------------------------------------------------------------------


def usage_report(service: Service, tenant: str, session_id: str | None = None, training_run_id: str | None = None,
                 since: dt.datetime | None = None, until: dt.datetime | None = None, after: int = 0,
                 limit: int = 1000) -> dict:
    """Totals by kind and cost, plus the per-request series after ledger row `after` (a cursor)."""
    from sqlalchemy import select

    where = [UsageRow.tenant == tenant]
    if session_id:
        where.append(UsageRow.session_id == session_id)
    if training_run_id:
        where.append(UsageRow.model_id == training_run_id)
    if since:
        where.append(UsageRow.created_at >= since)
    if until:
        where.append(UsageRow.created_at < until)
    with service.store.session() as s:
        per_model = s.execute(_ledger_sums(UsageRow.base_model, *where)).all()
        rows = list(s.scalars(select(UsageRow).where(*where, UsageRow.id > after).order_by(UsageRow.id).limit(limit)))
    return {
        "totals": _totals(service, per_model),
        "series": [
            {
                "id": r.id, "time": _iso(r.created_at), "request_type": r.request_type, "session_id": r.session_id,
                "training_run_id": r.model_id, "sampler_id": r.sampler_id, "base_model": r.base_model, "step": r.step,
                "prefill_tokens": r.prefill_tokens, "sample_tokens": r.sample_tokens, "train_tokens": r.train_tokens,
                "cost": r.cost, "duration_s": r.duration_s, "metrics": r.metrics or {},
            }
            for r in rows
        ],
        "cursor": rows[-1].id if rows else after,
        "currency": "USD",
    }


def record_custom_loss(service: Service, tenant: str, training_run_id: str, surrogate_loss: float,
                       metrics: dict[str, float]) -> dict:
    """forward_backward_custom runs the user's loss in the client and sends a linear surrogate: the
    client reports the loss its function returned (metrics["loss:sum"]) for the ForwardBackward row
    that carried the surrogate, which the row then keeps as "surrogate_loss:sum"."""
    import math

    from sqlalchemy import select

    if "loss:sum" not in metrics or not all(math.isfinite(v) for v in metrics.values()):
        raise UserError("metrics must hold a finite 'loss:sum' (the custom loss), and only finite numbers")
    with service.store.session.begin() as s:
        recent = s.scalars(select(UsageRow).where(
            UsageRow.tenant == tenant, UsageRow.model_id == training_run_id, UsageRow.request_type == "ForwardBackward",
        ).order_by(UsageRow.id.desc()).limit(8))
        for row in recent:
            loss = (row.metrics or {}).get("loss:sum")
            if (loss is not None and "surrogate_loss:sum" not in row.metrics
                    and math.isclose(loss, surrogate_loss, rel_tol=1e-5, abs_tol=1e-9)):
                row.metrics = {**row.metrics, **metrics, "surrogate_loss:sum": loss}
                return {"usage_id": row.id}
    raise NotFound(f"no recent forward_backward of {training_run_id!r} has the surrogate loss {surrogate_loss}")


def _ledger_sums(group, *where):
    """The ledger's sums per value of `group` (a UsageRow column): (group, requests, prefill, sample,
    train, cost) rows."""
    from sqlalchemy import func, select

    return (select(group, func.count(), func.sum(UsageRow.prefill_tokens), func.sum(UsageRow.sample_tokens),
                   func.sum(UsageRow.train_tokens), func.sum(UsageRow.cost))
            .where(*where).group_by(group))


def _totals(service: Service, per_model) -> dict:
    """Requests, tokens by kind and cost, from _ledger_sums rows per base model; each kind priced at its
    model's rate."""
    by_kind = {kind: {"tokens": 0, "cost": 0.0} for kind in ("prefill", "sample", "train")}
    requests, cost = 0, 0.0
    for base_model, count, prefill, sample, train, model_cost in per_model:
        price = service.prices.for_model(base_model)
        requests += count
        cost += model_cost or 0.0
        for kind, tokens in (("prefill", prefill), ("sample", sample), ("train", train)):
            by_kind[kind]["tokens"] += int(tokens or 0)
            by_kind[kind]["cost"] += int(tokens or 0) * price[kind] / 1e6
    return {
        "requests": requests,
        "prefill_tokens": by_kind["prefill"]["tokens"],
        "sample_tokens": by_kind["sample"]["tokens"],
        "train_tokens": by_kind["train"]["tokens"],
        "cost": cost,
        "by_kind": by_kind,
    }


def sessions_report(service: Service, tenant: str, active_only: bool = False, limit: int = 50) -> dict:
    """One row per session, newest first, for dashboards (the JupyterLab sidebar): its run's base model
    and rank, optim steps, last loss, tokens and cost, and checkpoints; plus totals of the active ones.

    Computed from the store and the ledger in a few grouped queries, so polling it every second is cheap.
    """
    from sqlalchemy import func, select

    where = [SessionRow.tenant == tenant] + ([SessionRow.status == "active"] if active_only else [])
    with service.store.session() as s:
        sessions = list(s.scalars(select(SessionRow).where(*where).order_by(SessionRow.created_at.desc()).limit(limit)))
        ids = [r.id for r in sessions]
        runs = list(s.scalars(select(ModelRow).where(ModelRow.session_id.in_(ids)).order_by(ModelRow.created_at)))
        totals = {row[0]: row[2:] for row in s.execute(_ledger_sums(UsageRow.session_id, UsageRow.session_id.in_(ids)))}
        steps = dict(s.execute(select(UsageRow.session_id, func.count()).where(
            UsageRow.session_id.in_(ids), UsageRow.request_type == "OptimStep").group_by(UsageRow.session_id)).all())
        last_fb = {}  # session -> metrics of its newest forward_backward
        newest = (select(UsageRow.session_id, func.max(UsageRow.id)).where(
            UsageRow.session_id.in_(ids), UsageRow.request_type == "ForwardBackward").group_by(UsageRow.session_id))
        for session_id, row_id in s.execute(newest).all():
            last_fb[session_id] = (s.get(UsageRow, row_id).metrics or {})
        checkpoints = list(s.scalars(select(CheckpointRow).where(
            CheckpointRow.model_id.in_([r.id for r in runs])).order_by(CheckpointRow.created_at.desc())))
        # The running totals cover every active session, not only the `limit` listed.
        active = select(SessionRow.id).where(SessionRow.tenant == tenant, SessionRow.status == "active")
        running = {"sessions": s.scalar(select(func.count()).select_from(active.subquery())),
                   **_totals(service, s.execute(_ledger_sums(UsageRow.base_model, UsageRow.session_id.in_(active))).all())}

    runs_of = {i: [r for r in runs if r.session_id == i] for i in ids}
    session_of_run = {r.id: r.session_id for r in runs}
    moment = now()
    rows = []
    for session in sessions:
        prefill, sample, train, cost = totals.get(session.id, (0, 0, 0, 0.0))
        first = runs_of[session.id][0] if runs_of[session.id] else None
        row = {
            "session_id": session.id,
            "status": session.status,
            "display_name": session.display_name,
            "created_at": _iso(session.created_at),
            "age_s": round((moment - _utc(session.created_at)).total_seconds(), 1),
            "base_model": first.base_model if first else None,
            "lora_rank": first.lora_config["rank"] if first else None,
            "training_run_ids": [r.id for r in runs_of[session.id]],
            "steps": int(steps.get(session.id, 0)),
            "last_loss": last_fb.get(session.id, {}).get("loss:sum"),
            "prefill_tokens": int(prefill or 0),
            "sample_tokens": int(sample or 0),
            "train_tokens": int(train or 0),
            "cost": float(cost or 0.0),
            "checkpoints": [
                {**_checkpoint_json(c), "training_run_id": c.model_id}
                for c in checkpoints if session_of_run[c.model_id] == session.id
            ],
        }
        rows.append(row)
    return {"sessions": rows, "running": running, "currency": "USD"}
