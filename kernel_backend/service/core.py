"""The service's core: what every concern module shares.

`Service` owns the store (durable rows), the checkpoint storage, the executor (where jobs run: this
process's engines or Ray workers', kernel_backend/execution/executor.py), admission, and the futures' waiters.
It queues work (`submit`), records each outcome and its ledger row (`on_done`), answers polls
(`retrieve`), expires what is over (`reap`), and looks rows up for a tenant (`session`, `run`,
`live_run`, `checkpoint`, `sampler`): another tenant's ids are `NotFound`, so their existence is not revealed.

What each API call does lives in the concern modules beside this one (sessions, training,
checkpoints, sampling, accounts), as plain functions that take the `Service` first.

Errors (kernel_backend/errors.py): `UserError` for bad input (400), `NotFound` for ids the caller cannot
see (404, also for another tenant's ids), `Gone` (410), `RateLimited` (429) from admission
(kernel_backend/service/admission.py), which every function that queues work calls first, and `OverBudget`
(402) from the budgets (kernel_backend/service/budgets.py), which `admit` counts at the same moment.

Every change to a session, run, checkpoint or project writes an audit row (`audit`), in the same
transaction as the change where the change is an insert.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, cast

from sqlalchemy import func, select

from kernel_backend.service import budgets, metrics, recovery, refusals, stability
from kernel_backend.persistence import api_keys, signing
from kernel_backend.engine import base_models
from kernel_backend.execution import engine_work
from kernel_backend import runtime
from kernel_backend.service.admission import Admission
from kernel_backend.config import Settings
from kernel_backend import errors
from kernel_backend.errors import (Gone, HomeInUse, NotFound, OverBudget, RateLimited, UserError, error_payload,
                                    failure_category)
from kernel_backend.execution.executor import Executor, InProcess
from kernel_backend.persistence.api_keys import LOCAL_TENANT
from kernel_backend.metering import Prices, Usage
from kernel_backend.execution.scheduler import Job, log_failure
from kernel_backend.persistence.database import (
    CheckpointRow,
    FutureRow,
    JournalRow,
    ModelRow,
    AuditRow,
    SamplerRow,
    SessionRow,
    StabilityRow,
    Store,
    UsageRow,
    now,
    parse_tinker_path,
    utc,
)
from kernel_backend.types import LoraConfig

log = logging.getLogger("stepwise.service")

JSON_TYPE = "application/json"
PROTO_TYPE = "application/x-protobuf"
# A long poll answers try_again after this long, well inside the SDK's 45 s timeout.
POLL_HOLD_S = 20.0
# The project of a session created without one.
DEFAULT_PROJECT = "default"
# Request types that sample: their ledger rows name a sampler, not a training run.
SAMPLER_REQUESTS = ("Sample", "ChatCompletion", "Completion", "Message")


@dataclass
class Request:
    """The service's side of a job (`Job.request`): who asked, what the ledger calls it, and how the outcome becomes
    the reply (`encode(outcome) -> (bytes, content type)`, which may write rows on the way; None: the outcome as
    JSON). It stays on this process; execution hands it back with the outcome."""

    tenant: str
    request_type: str
    session_id: str | None
    api_key: str | None  # the prefix of the key that sent it (service/budgets.py)
    encode: Callable[[Any], tuple[bytes, str]] | None = None


def json_result(obj: dict) -> tuple[bytes, str]:
    """A job's reply as JSON bytes and their content type."""
    return json.dumps(obj).encode(), JSON_TYPE


def new_id() -> str:
    return uuid.uuid4().hex


def train_key(model_id: str, seq_id: int | None) -> str | None:
    """A training request's dedupe key: its run and seq_id. Without a seq_id, none: it is new work."""
    return None if seq_id is None else f"train:{model_id}:{seq_id}"


def iso(t: dt.datetime) -> str:
    return utc(t).isoformat()


def user_urn(tenant: str) -> str:
    """How the Tinker API names a principal (whoami, owners, audit actors); here a tenant is one user."""
    return f"tml:user:{tenant}"


def audit(tenant: str, event: str, actor: str | None, **details) -> AuditRow:
    """An audit-log row for `tenant`, whose resource it is: `event` is <resource>_<action>, `actor` the
    tenant that acted (another one when it read a published checkpoint; None: the server's housekeeping)."""
    return AuditRow(tenant=tenant, event=event, details={"actor": user_urn(actor) if actor else "system", **details})


class Service:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._lock_home()
        self.store = Store(self.settings.database_url)
        # What engine-side work reaches: settings, the checkpoint store, and the sampler (what it refuses, its stats:
        # the engines' own decoders, or vLLM's workers, which the in-process executor puts there; engine_work.py).
        self.ctx = engine_work.Context.of(self.settings)
        self.storage = self.ctx.storage
        self.prices = Prices(self.settings.prices_path or None)
        self.admission = Admission(self.settings, self.store, self.adapter_bytes)
        self.budgets = budgets.Budgets(self.store)
        self.refusals = refusals.Refusals()  # what admit() refused, for the sidebar and the cost meter
        self.metrics = metrics.Metrics(self)  # GET /metrics (kernel_backend/api/monitoring.py)
        self.signing_key = signing.server_secret(self.store, self.settings.signing_key)
        if self.settings.sampler not in ("batched", "serial", "vllm"):
            raise ValueError(f"STEPWISE_SAMPLER must be 'batched', 'serial' or 'vllm', not {self.settings.sampler!r}")
        # Where jobs run (kernel_backend/execution/executor.py): this process's engines, or Ray workers'
        # (STEPWISE_WORKERS or STEPWISE_RAY_ADDRESS, kernel_backend/execution/cluster.py).
        self.executor: Executor
        if self.settings.workers or self.settings.ray_address:
            if self.settings.sampler == "vllm":
                raise ValueError("STEPWISE_SAMPLER=vllm runs with the in-process engine only; unset STEPWISE_WORKERS "
                                 "and STEPWISE_RAY_ADDRESS, or use the built-in sampler")
            from kernel_backend.execution.cluster import Cluster

            self.executor = Cluster(self.settings, self.storage, self.on_done,
                                    replay=lambda run_id, location: recovery.replay_after_worker_loss(self, run_id, location),
                                    rebuild=self._replay_journals)
        else:
            self.executor = InProcess(self.settings, self.ctx, self.on_done, replay=self._replay_journals)
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._waiters_lock = threading.Lock()
        # State of one concern each, kept here because it lives as long as the service:
        self.tokenizers: dict[str, object] = {}  # sampling: base model -> tokenizer for the API threads
        self.stability = stability.Recorder(self.settings, self.store)  # stable_reinforce: the recording cap
        self.kept_steps: dict[str, list[int]] = {}  # steps: run -> the steps its engine keeps in memory (service/past_steps.py)
        self._fail_interrupted_futures()
        if cleaned := self.storage.clean_staging():
            log.info("removed %d scratch folders of interrupted checkpoint writes", cleaned)
        if self.settings.local_key:
            api_keys.create(self.store, LOCAL_TENANT, self.settings.local_key)
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
        registered = base_models.registered_models(self.settings.base_models)
        # dict.fromkeys: the default model once, also where a registered entry stands in for it.
        names = list(dict.fromkeys(self.model_name(name) for name in
                                   (preload if preload is not None else [base_models.DEFAULT_MODEL, *registered])))
        self.executor.start(names)
        self._reaper.start()

    def _replay_journals(self) -> None:
        """Runs a crash cut off come back (their snapshot, then their journal) before any new request runs."""
        if rebuilt := recovery.replay(self):
            log.info("rebuilt %d training runs from their snapshots and journals", rebuilt)

    def stop(self) -> None:
        self._stopping.set()
        self.executor.stop()
        if self.settings.local_key:  # the embedded backend's key dies with it
            api_keys.revoke(self.store, self.settings.local_key)

    def _fail_interrupted_futures(self) -> None:
        """Futures left pending by a previous process, other than journaled ones (replay answers those, see
        service/recovery.py; with Ray workers too, once the workers are live), will never finish: mark
        them interrupted. Polling one answers 410, on which the SDK submits the request again (and the
        resubmission replaces the interrupted row, see Store.insert_future).
        """
        replayed = recovery.pending_journaled(self)
        for row in self.store.list(FutureRow, FutureRow.status == "pending"):
            if row.request_id in replayed:
                continue
            payload = error_payload("the server restarted while this request was in flight; submit it again", "server")
            self.store.finish_future(row.request_id, "interrupted", payload, JSON_TYPE, keep_s=self.settings.result_ttl_s)

    # ---- housekeeping: expired sessions, expired checkpoints -----------------------------------

    def _reap_forever(self) -> None:
        while not self._stopping.wait(self.settings.reap_interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("housekeeping failed; will try again")

    def reap(self) -> None:
        """Expire sessions that stopped heart-beating (freeing their adapters), expired checkpoints and
        expired results of finished requests and expired stability info."""
        self.store.delete_expired_futures()
        self.store.delete_stability(StabilityRow.expires_at < now())
        cutoff = now() - dt.timedelta(seconds=self.settings.session_timeout_s)
        for session in self.store.list(SessionRow, SessionRow.status == "active", SessionRow.last_heartbeat < cutoff):
            self.end_session(session.id, "expired")
            self.store.add(audit(session.tenant, "session_expired", None, session_id=session.id))
        # A session opened by a process on this machine (workbench.connect() puts its pid in the metadata; a
        # plain SDK script's is found by its socket) ends with that process: a shut-down kernel's or a finished
        # script's session is over, not idle.
        for session in self.store.list(SessionRow, SessionRow.status == "active"):
            if session.local_pid is not None and not runtime.pid_alive(session.local_pid):
                self.end_session(session.id, "finished")
        for checkpoint in self.store.list(CheckpointRow, CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at < now()):
            self.store.delete_checkpoint(checkpoint)
            self.store.add(audit(checkpoint.tenant, "checkpoint_expired", None, tinker_path=checkpoint.tinker_path,
                                 model_id=checkpoint.model_id))
            self.storage.delete(checkpoint.directory)

    def end_session(self, session_id: str, status: str) -> None:
        """Mark a session over and free its adapters (on the scheduler thread)."""
        self.store.update(SessionRow, session_id, status=status)
        self.store.delete_stability(StabilityRow.session_id == session_id)  # nothing can train on it any more
        lanes = self.store.list(ModelRow, ModelRow.session_id == session_id)
        recovery.forget(self, [run.id for run in lanes])
        for run in lanes:  # their engines free them: no step of theirs is kept any more
            self.kept_steps.pop(run.id, None)
        lanes += self.store.list(SamplerRow, SamplerRow.session_id == session_id)
        for lane in lanes:
            free = Job(new_id(), f"free:{lane.id}", lane.base_model, seq=None,
                       op=engine_work.FreeAdapters([lane.id]))
            self.executor.submit(free, ordered=False)
        log.info("session %s %s; freed %d adapters", session_id, status, len(lanes))

    # ---- futures -------------------------------------------------------------------------------

    def admit(self, tenant: str, request_type: str, request_id: str, base_model: str, bound: Usage,
              session_id: str | None = None, run_id: str | None = None, dedupe_key: str | None = None) -> None:
        """Count a request's most work (`bound`, tokens by kind) now, when it is admitted: against the tenant's
        tokens per minute (service/admission.py) and every budget that covers it (service/budgets.py), or raise before
        anything is queued (and remember the refusal: service/refusals.py). Its ledger row settles both (`on_done`)."""
        tokens = bound.prefill_tokens + bound.sample_tokens + bound.train_tokens
        if not tokens:  # free work (an optim_step, a save) passes every budget
            return
        scopes = budgets.Scopes(tenant, session_id, run_id, budgets.request_key())
        budgets.note(tokens=tokens)  # the request's log line and metrics say what it asked for
        try:
            self.budgets.admit(request_id, scopes, self.prices.cost(base_model, bound), tokens)
            try:
                self.admission.tokens(tenant, request_id, tokens)
            except Exception:
                self.budgets.release(request_id)
                raise
        except (OverBudget, RateLimited) as refused:
            status = errors.HTTP[type(refused)][0]
            self.metrics.refused.labels(str(status)).inc()
            # A refused forward_backward leaves the step after it with no gradient: remember which step that is.
            step = self._steps_taken(run_id) if run_id and request_type == "ForwardBackward" else None
            self.refusals.record(refusals.Refusal(tenant, session_id, run_id, request_type, step, status,
                                                  errors.redact_paths(str(refused)), now(), dedupe_key))
            raise

    def _steps_taken(self, run_id: str) -> int:
        """The optimizer steps a run has taken or has queued: the ledger step its next forward_backward gets."""
        with self.store.session() as s:
            done = s.scalar(select(func.count()).select_from(UsageRow).where(
                UsageRow.model_id == run_id, UsageRow.request_type == "OptimStep"))
            queued = s.scalar(select(func.count()).select_from(FutureRow).where(
                FutureRow.model_id == run_id, FutureRow.request_type == "OptimStep", FutureRow.status == "pending"))
        return int(done or 0) + int(queued or 0)

    def submit(self, tenant: str, request_type: str, dedupe_key: str | None, job: Job, ordered: bool, extra=None,
               session_id: str | None = None, bound: Usage | None = None, run_id: str | None = None,
               encode: Callable[[Any], tuple[bytes, str]] | None = None) -> FutureRow:
        """Admit the job's most work (`bound`; None: free work, or admitted already as part of a batch) and queue
        it, or return the original future of a retry. `run_id`: the training run whose budget it counts against;
        `encode`: how its outcome becomes the reply (Request).

        `dedupe_key` names the work by the client's sequence numbers; without one (no seq_id) every
        submission is new work."""
        job.request = Request(tenant, request_type, session_id, budgets.request_key(), encode)
        if (replayed := recovery.replaying()) is not None:
            # (recovery.replay_run, the caller of a replayed call, does not read what it returns)
            return cast(FutureRow, self._resubmit(job, ordered, replayed))
        dedupe_key = dedupe_key or f"once:{job.request_id}"
        existing = self.store.future_by_key(dedupe_key)
        if existing is not None and existing.status != "interrupted":
            return existing  # a retry: admitted when it was first sent
        if bound is not None:
            self.admit(tenant, request_type, job.request_id, job.base_model, bound, session_id, run_id, dedupe_key)
        row = FutureRow(
            request_id=job.request_id,
            dedupe_key=dedupe_key,
            tenant=tenant,
            request_type=request_type,
            model_id=job.lane,
            extra=extra or {},
        )
        row, created = self.store.insert_future(row, recovery.entry(job) if ordered else None)
        if not created:  # another thread stored the same request first: this copy does nothing
            self.admission.settle(job.request_id, 0)
            self.budgets.release(job.request_id)
        if created:
            self.executor.submit(job, ordered=ordered)
        return row

    def _resubmit(self, job: Job, ordered: bool, replayed: JournalRow) -> FutureRow | None:
        """A journaled request run again at start-up: as itself when its future was pending at the crash (the
        client's poll gets its answer), else silently (no reply, no ledger row: the client has its answer)."""
        original = self.store.get(FutureRow, replayed.request_id)
        if original is not None and original.status == "pending":
            job.request_id = original.request_id
        else:
            job.request = None
        self.executor.submit(job, ordered=ordered)
        return original

    def on_done(self, job: Job, outcome) -> None:
        """Record a job's outcome (its op's result, or the exception it raised) as the reply its Request's `encode`
        makes of it and, for a completed request, its ledger row (failures bill nothing)."""
        if isinstance(outcome, dict) and "kept_steps" in outcome:  # what a run can go back to (service/past_steps.py)
            self.kept_steps[job.lane] = outcome["kept_steps"]
        request: Request | None = job.request
        if request is None:  # the service's own housekeeping (freeing adapters): no future, no bill
            return
        status, content_type = "done", JSON_TYPE
        if isinstance(outcome, Exception):  # the op failed (and was logged where it ran)
            status, payload = "failed", error_payload(str(outcome), failure_category(outcome))
        else:
            try:
                payload, content_type = request.encode(outcome) if request.encode is not None else json_result(outcome)
            except Exception as e:  # writing its rows failed
                log_failure(job.request_id, e)
                status, payload, content_type = "failed", error_payload(str(e), failure_category(e)), JSON_TYPE
        usage = job.usage or Usage()
        self.admission.settle(job.request_id, usage.prefill_tokens + usage.sample_tokens + usage.train_tokens
                              if status == "done" else 0)
        self.stability.settle(job.request_id)
        ledger = None
        if status == "done":
            is_sampler = request.request_type in SAMPLER_REQUESTS
            ledger = UsageRow(
                request_id=job.request_id, tenant=request.tenant, session_id=request.session_id,
                model_id=None if is_sampler else job.lane, sampler_id=job.lane if is_sampler else None,
                base_model=job.base_model, request_type=request.request_type,
                step=None if is_sampler else job.step,
                prefill_tokens=usage.prefill_tokens, sample_tokens=usage.sample_tokens, train_tokens=usage.train_tokens,
                cost=self.prices.cost(job.base_model, usage), duration_s=job.duration_s, metrics=job.metrics,
                api_key=request.api_key,
            )
        self.store.finish_future(job.request_id, status, payload, content_type, ledger, keep_s=self.settings.result_ttl_s)
        self.metrics.job_done(request.request_type, status, usage if status == "done" else None,
                              failure_category(outcome) if isinstance(outcome, Exception) else None)
        self.budgets.release(job.request_id)  # only now: its cost is in the ledger
        with self._waiters_lock:
            waiters = self._waiters.pop(job.request_id, [])
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def retrieve(self, tenant: str, request_id: str) -> FutureRow | None:
        """The finished future, or None if it is still running after a long poll (try again)."""
        row = self._get(FutureRow, request_id, tenant, f"unknown request_id {request_id!r} (a result is kept "
                        f"{self.settings.result_keep_after_retrieval_s:g} s after it is first retrieved)")
        if row.status != "pending":
            self.store.retrieved(row, self.settings.result_keep_after_retrieval_s)
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
        self.store.retrieved(row, self.settings.result_keep_after_retrieval_s)
        return row

    # ---- lookups for a tenant: another tenant's ids are NotFound ----------------------------------

    def _get(self, table, row_id: str, tenant: str, unknown: str):
        """The tenant's row of `table`, or NotFound(`unknown`): another tenant's ids are unknown too."""
        row = self.store.get(table, row_id, tenant)
        if row is None:
            raise NotFound(unknown)
        return row

    def session(self, tenant: str, session_id: str) -> SessionRow:
        return self._get(SessionRow, session_id, tenant, f"unknown session {session_id!r}; create one with ServiceClient()")

    def run(self, tenant: str, model_id: str) -> ModelRow:
        """A training run of this tenant's."""
        return self._get(ModelRow, model_id, tenant, f"unknown training run {model_id!r}")

    def live_run(self, tenant: str, model_id: str) -> ModelRow:
        """A run that can still train: not a copy, and its session is active."""
        row = self.run(tenant, model_id)
        if row.copied_from:
            raise UserError(f"training run {model_id} holds a copy of {row.copied_from} and cannot be trained; "
                            "train a new run from it: create_training_client_from_state(path)")
        session = self.store.get(SessionRow, row.session_id)
        if session.status != "active":
            raise Gone(f"training run {model_id} belongs to a session that has {session.status}; its adapter was freed. "
                       "Resume from a checkpoint: create_training_client_from_state_with_optimizer(path)")
        return row

    def checkpoint(self, tenant: str, path: str) -> CheckpointRow:
        """A checkpoint this tenant may read: its own, or a published one."""
        parse_tinker_path(path)
        row = self.store.checkpoint_by_path(path, tenant)
        if row is None:
            raise NotFound(f"no checkpoint at {path}")
        return row

    def sampler(self, tenant: str, sampler_id: str) -> SamplerRow:
        return self._get(SamplerRow, sampler_id, tenant, f"unknown sampling session {sampler_id!r}")

    def model_name(self, name: str) -> str:
        """Canonical base-model name; UserError naming the available ones if unknown."""
        return base_models.resolve(name, self.settings.models_dir, self.settings.base_models)[0]

    def adapter_bytes(self, base_model: str, lora_config: dict) -> int:
        """One copy of an adapter's weights on `base_model` (0 while that model is not loaded); admission's measure."""
        facts = self.executor.facts().get(base_model)
        return 0 if facts is None else engine_work.adapter_bytes(facts, LoraConfig(**lora_config))
