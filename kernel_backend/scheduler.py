"""The scheduler: one thread owns the engines and runs every job, in order and fairly.

Each training run is a *lane* whose jobs run in the client's `seq_id` order (forward_backward
chunks of one step may arrive out of order; a missing sequence number is waited for briefly,
then skipped, so a request the client never managed to send cannot stall the run). Each
sampler is an unordered lane. Lanes take turns round-robin, so one busy session cannot starve
another. When several lanes have a forward / forward_backward at their head, those passes run
as one batch with per-row LoRA routing (`Engine.run_passes`).

A job's outcome is handed to `on_done(job, status, payload, content_type)`; the service stores
it with the job's usage (the ledger row) and wakes whoever is polling.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kernel_backend.engine import Engine, Pass
from kernel_backend.metering import Usage
from kernel_backend.types import ForwardResult, UserError, redact_paths

log = logging.getLogger("stepwise.scheduler")

# How long a lane waits for a missing seq_id before running the next one it has.
GAP_WAIT_S = 2.0


@dataclass
class Job:
    request_id: str
    lane: str  # training run id, or sampler id
    base_model: str
    # Ordering within a training lane; None for samplers and for a run's creation job.
    seq: int | None
    # Either a plain function of the engine returning the reply...
    run: Callable[[Engine], tuple[bytes, str]] | None = None
    # ...or a forward(_backward) pass, batched with other lanes', whose result `encode` turns into the reply.
    fb_pass: Pass | None = None
    encode: Callable[[ForwardResult], tuple[bytes, str]] | None = None
    tokens: int = 0
    # Who and what, for the ledger.
    tenant: str = ""
    session_id: str | None = None
    request_type: str = ""
    arrived: float = field(default_factory=time.monotonic)
    # Filled in while it runs, for the ledger: tokens processed, metrics, seconds of compute.
    usage: Usage | None = None
    metrics: dict = field(default_factory=dict)
    duration_s: float = 0.0


@dataclass
class _Lane:
    ordered: bool
    jobs: list[Job] = field(default_factory=list)
    last_seq: int | None = None

    def head(self, now: float) -> Job | None:
        """The job this lane may run now, if any."""
        if not self.jobs:
            return None
        if not self.ordered:
            return self.jobs[0]
        job = min(self.jobs, key=lambda j: -1 if j.seq is None else j.seq)
        if job.seq is None or self.last_seq is None or job.seq <= self.last_seq + 1:
            return job
        return job if now - job.arrived > GAP_WAIT_S else None


class Scheduler:
    def __init__(self, load_engine: Callable[[str], Engine], on_done, max_batch_tokens: int) -> None:
        self._load_engine = load_engine
        self._on_done = on_done
        self._max_batch_tokens = max_batch_tokens
        self.engines: dict[str, Engine] = {}
        self._lanes: dict[str, _Lane] = {}
        self._turns: deque[str] = deque()  # lane ids in round-robin order
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="stepwise-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def engine(self, base_model: str) -> Engine:
        """The engine for a base model, loaded on first use. Call from the scheduler thread only."""
        if base_model not in self.engines:
            self.engines[base_model] = self._load_engine(base_model)
        return self.engines[base_model]

    def submit(self, job: Job, ordered: bool) -> None:
        with self._cv:
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = _Lane(ordered=ordered)
                self._turns.append(job.lane)
            lane.jobs.append(job)
            self._cv.notify_all()

    def queue_depth(self, lane_id: str) -> int:
        with self._cv:
            lane = self._lanes.get(lane_id)
            return len(lane.jobs) if lane else 0

    # ---- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                picked = self._pick()
                while not picked and not self._stopping:
                    self._cv.wait(timeout=0.5)
                    picked = self._pick()
                if self._stopping:
                    return
            try:
                self._run(picked)
            except Exception:  # never let one job take the thread (and so the whole service) down
                log.exception("scheduler: unexpected error while finishing %s", [j.request_id for j in picked])

    def _pick(self) -> list[Job]:
        """Take the next job (or batch of passes) round-robin. Called with the lock held."""
        now = time.monotonic()
        for _ in range(len(self._turns)):
            lane_id = self._turns[0]
            self._turns.rotate(-1)
            lane = self._lanes[lane_id]
            job = lane.head(now)
            if job is None:
                continue
            picked = [job]
            if job.fb_pass is not None:
                picked += self._batch_partners(job, now)
            for j in picked:
                lane = self._lanes[j.lane]
                lane.jobs.remove(j)
                if lane.ordered and j.seq is not None:
                    lane.last_seq = max(lane.last_seq if lane.last_seq is not None else j.seq, j.seq)
            return picked
        return []

    def _batch_partners(self, first: Job, now: float) -> list[Job]:
        """Other lanes' ready passes on the same base model, up to the token budget."""
        partners, tokens = [], first.tokens
        for lane_id in self._turns:
            if lane_id == first.lane:
                continue
            job = self._lanes[lane_id].head(now)
            if job is None or job.fb_pass is None or job.base_model != first.base_model:
                continue
            if tokens + job.tokens > self._max_batch_tokens:
                break
            partners.append(job)
            tokens += job.tokens
        return partners

    def _run(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        try:
            engine = self.engine(jobs[0].base_model)
        except Exception as e:  # a base model that cannot load fails its jobs, not the thread
            for job in jobs:
                self._fail(job, e)
            return
        if jobs[0].fb_pass is not None:
            try:
                results = engine.run_passes([j.fb_pass for j in jobs])
            except Exception as e:
                results = [e] * len(jobs)
            elapsed = time.perf_counter() - start
            for job, result in zip(jobs, results):
                if isinstance(result, Exception):
                    self._fail(job, result)
                    continue
                # A batch's time is shared among its passes by their token counts.
                job.duration_s = elapsed * job.tokens / max(1, sum(j.tokens for j in jobs))
                job.metrics = result.metrics
                kind = "prefill_tokens" if job.fb_pass.forward_only else "train_tokens"
                job.usage = Usage(**{kind: job.tokens})
                self._finish(job, lambda r=result, j=job: j.encode(r))
            return
        job = jobs[0]

        def produce():
            reply = job.run(engine)
            job.duration_s = time.perf_counter() - start
            return reply

        self._finish(job, produce)

    def _finish(self, job: Job, produce: Callable[[], tuple[bytes, str]]) -> None:
        try:
            payload, content_type = produce()
        except Exception as e:
            self._fail(job, e)
            return
        self._on_done(job, "done", payload, content_type)

    def _fail(self, job: Job, error: Exception) -> None:
        if isinstance(error, UserError):
            category = "user"
        else:
            category = "server"
            log.error("request %s failed:\n%s", job.request_id, "".join(traceback.format_exception(error)))
        self._on_done(job, "failed", error_payload(str(error), category), "application/json")


def error_payload(message: str, category: str) -> bytes:
    """A failed future's answer; the message never carries a server path (the log has the full error)."""
    import json

    return json.dumps({"error": redact_paths(message), "category": category}).encode()
