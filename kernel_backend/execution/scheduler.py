"""The scheduler: one thread owns the engines and runs every job, in order and fairly.

Each training run is a *lane* whose jobs run in the client's `seq_id` order (forward_backward
chunks of one step may arrive out of order; a missing sequence number is waited for briefly,
then skipped, so a request the client never managed to send cannot stall the run). Each
sampler is an unordered lane. Lanes take turns round-robin, so one busy session cannot starve
another. When several lanes have a forward / forward_backward at their head, those passes run
as one batch with per-row LoRA routing (`Engine.run_passes`).

Sample requests do not take turns one by one: they join their base model's decoder (one
continuous batch, kernel_backend/engine/sampler.py), taken round-robin across sampler lanes whenever the
decoder has room. The thread then alternates between decode steps (each a step for every live
request) and the other jobs, sharing its time between them by lanes: the decoder counts as many
lanes as it has requests from, so a long generation cannot starve training, nor training stall
generation. A job is never interrupted: a decode step waits for the job before it, and a job
for the decode step before it.

A job's engine-side work is plain data (kernel_backend/execution/engine_work.py: an `Op`, a `Pass` or a `SampleOp`), so
the same scheduler runs in this process or inside an `EngineWorker` on Ray (kernel_backend/execution/cluster.py).

Each turn of the thread is a `Unit`: the sample requests it admits, then one decode step or one job (or batch of
passes). A model sharded over several workers (engine/sharding.py) needs every process to run the same units in the
same order, so one scheduler decides: its `mirror` hook is handed each unit before it runs (the shard group's rank 0
sends it to the others, execution/cluster_worker.py), and the others run what they are sent with `work`, their own
thread never deciding anything.
Its outcome, the op's plain result or the exception it raised, is handed to `on_done(job, outcome)`
with the job's usage, metrics, duration and the run's step filled in; the service turns it into the
reply and the ledger row (`Job.request`) and wakes whoever is polling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from kernel_backend.execution import engine_work
from kernel_backend.engine.core import Engine, Pass
from kernel_backend.metering import COMPUTED, Usage
from kernel_backend.execution.engine_work import Op, SampleOp
from kernel_backend.engine.sampler import SampleRequest
from kernel_backend.errors import UserError

log = logging.getLogger("stepwise.scheduler")

# How long a lane waits for a missing seq_id before running the next one it has.
GAP_WAIT_S = 2.0
# Idle this long after work, the scheduler gives freed memory back to the system (`return_freed_memory`). Not at
# once: a client's next call usually follows within milliseconds, and memory given back costs page faults to take again.
RETURN_MEMORY_AFTER_IDLE_S = 1.0


@dataclass
class Job:
    request_id: str
    lane: str  # training run id, or sampler id
    base_model: str
    # Ordering within a training lane; None for samplers and for a run's creation job.
    seq: int | None
    # The engine-side work, plain data (kernel_backend/execution/engine_work.py), one of: an Op, a work item of its own
    # type (CreateAdapter, OptimStep, Save, ...; engine_work.run does it)...
    op: Op | None = None
    # ...or a forward(_backward) pass, batched with other lanes'...
    fb_pass: Pass | None = None
    # ...or a sample request, which joins its model's decoder (engine_work.sample_request validates it there).
    sample: SampleOp | None = None
    # Never sent to a worker: a function of the engine, made where it runs (the vLLM sampler's own calls; a
    # worker's data-parallel steps around the op).
    call: Callable[[Engine], object] | None = None
    # A streaming sample's per-token callback and its cancel event; never sent to a worker.
    on_token: Callable | None = None
    cancel: object | None = None
    # A worker's own condition for running the job once it heads its lane (a data-parallel optim_step
    # waits for its gradient all-reduce, execution/cluster.py); called on the scheduler thread.
    gate: Callable[[], bool] | None = None
    tokens: int = 0
    # Data-parallel replicas a run's first job asks for (kernel_backend/execution/cluster.py; None: the server's setting).
    replicas: int | None = None
    # The service's record of the request (service/core.py's `Request`: who asked, what the ledger calls it, how the
    # outcome becomes the reply). Execution hands it back in on_done untouched and never sends it to a worker;
    # None marks the service's own housekeeping (freeing adapters, a replayed load), which has no future and no bill.
    request: Any = None
    arrived: float = field(default_factory=time.monotonic)
    # Filled in while it runs, for the ledger: tokens processed, metrics, seconds of compute, and the
    # optim steps its training run has taken when it is done.
    usage: Usage | None = None
    metrics: dict = field(default_factory=dict)
    duration_s: float = 0.0
    step: int | None = None


@dataclass
class Unit:
    """One turn of the scheduler thread: the sample jobs it admits to their decoders, then one decode step of every
    busy decoder (`decode`) or one job or batch of passes (`batch`), or neither."""

    samples: list[Job]
    decode: bool
    batch: list[Job]

    def jobs(self) -> list[Job]:
        return [*self.samples, *self.batch]


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
        if job.gate is not None and not job.gate():
            return None
        if job.seq is None or self.last_seq is None or job.seq <= self.last_seq + 1:
            return job
        return job if now - job.arrived > GAP_WAIT_S else None


class Scheduler:
    def __init__(self, load_engine: Callable[[str], Engine], on_done, max_batch_tokens: int,
                 ctx: engine_work.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`on_done(job, outcome)`: the op's result, or the exception it raised. `ctx`: what ops reach besides
        the engine (the settings and the checkpoint store). `clock`: what a lane's wait for a missing seq_id
        (against `Job.arrived`) and the decode/jobs time share are measured on; a seam for tests
        (tests/test_scheduler.py), which move a fake clock rather than sleep and hope the thread kept up."""
        self._clock = clock
        self._load_engine = load_engine
        self._on_done = on_done
        self._max_batch_tokens = max_batch_tokens
        self.ctx = ctx
        self.engines: dict[str, Engine] = {}
        self._facts: dict[str, dict] = {}
        self._lanes: dict[str, _Lane] = {}
        self._turns: deque[str] = deque()  # lane ids in round-robin order
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="stepwise-scheduler", daemon=True)
        # Sample jobs inside a decoder, by id of their SampleRequest; scheduler thread only.
        self._decoding: dict[int, tuple[Job, SampleRequest]] = {}
        # Seconds spent decoding and running other jobs while both had work (the time share).
        self._decode_s = self._jobs_s = 0.0
        # Times the thread looked at the lanes, found nothing it may run and went to wait (lock held). A test that
        # submits a job and reads this after waits for it to grow: proof the thread saw the job and held it back.
        self.idle_passes = 0
        # Called with each unit before it runs (the module docstring: a sharded model's other processes run it too);
        # an exception fails the unit's jobs unrun.
        self.mirror: Callable[[Unit], None] | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def context(self) -> engine_work.Context:
        """The context for the work. A scheduler without one (tests/test_scheduler.py, tests/test_engine.py) runs only
        work that never reaches it (engines holding their adapters, no store), so it is handed on as it is."""
        return cast(engine_work.Context, self.ctx)

    def engine(self, base_model: str) -> Engine:
        """The engine for a base model, loaded on first use. Call from the scheduler thread only."""
        if base_model not in self.engines:
            self.engines[base_model] = self._load_engine(base_model)
        return self.engines[base_model]

    def facts(self) -> dict[str, dict]:
        """Each loaded base model's facts (engine_work.model_facts); any thread."""
        for name, engine in list(self.engines.items()):
            if name not in self._facts:
                self._facts[name] = engine_work.model_facts(engine)
        return dict(self._facts)

    def submit(self, job: Job, ordered: bool) -> None:
        with self._cv:
            lane = self._lanes.get(job.lane)
            if lane is None:
                lane = self._lanes[job.lane] = _Lane(ordered=ordered)
                self._turns.append(job.lane)
            lane.jobs.append(job)
            self._cv.notify_all()

    def queue_depth(self, lane_id: str | None = None) -> int:
        """Jobs waiting in one lane, or in all of them."""
        with self._cv:
            if lane_id is None:
                return sum(len(lane.jobs) for lane in self._lanes.values()) + len(self._decoding)
            lane = self._lanes.get(lane_id)
            return len(lane.jobs) if lane else 0

    def reset_lane(self, lane_id: str, error: Exception) -> None:
        """Fail the jobs waiting in a lane and forget its place in seq_id order (a run about to be restored from
        a snapshot: they were meant for the state it leaves behind, and its journal is replayed from the
        snapshot's seq_id, before the ones this lane ran). A job running now finishes."""
        with self._cv:
            lane = self._lanes.get(lane_id)
            dropped = list(lane.jobs) if lane else []
            if lane:
                lane.jobs.clear()
                lane.last_seq = None
        for job in dropped:
            self._on_done(job, error)

    def wake(self) -> None:
        """Look at the lanes again now (a job's gate may have opened)."""
        with self._cv:
            self._cv.notify_all()

    # ---- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        worked, idle_since = False, None  # work done since memory was last returned; when the thread went idle
        while True:
            with self._cv:
                while True:
                    if self._stopping:
                        return
                    samples = self._take_samples()
                    decoding = bool(samples or self._decoding)
                    job_lanes = self._ready_job_lanes()
                    if decoding or job_lanes:
                        break
                    if worked:  # idle a while after work: return what it freed (not between a client's calls)
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since >= RETURN_MEMORY_AFTER_IDLE_S:
                            return_freed_memory()
                            worked = False
                    self.idle_passes += 1
                    self._cv.wait(timeout=0.5)
                worked, idle_since = True, None
                decode_turn = decoding and (not job_lanes or self._decode_s / self._decoding_lanes(samples)
                                            <= self._jobs_s / job_lanes)
                picked = [] if decode_turn else self._pick()
            start = self._clock()
            unit = Unit(samples, decode_turn, picked)
            try:
                if self.mirror is not None and (unit.decode or unit.jobs()):
                    self.mirror(unit)
            except Exception as e:  # the unit cannot run alike everywhere: it runs nowhere
                for job in unit.jobs():
                    self._fail(job, e)
                if unit.decode:  # nor can the requests whose decode step it was
                    for name, engine in self.engines.items():
                        if engine.decoder.busy:
                            self._fail_decoder(name, e)
                continue
            self.work(unit)
            # Only time spent while both sides had work counts toward the share; an idle side starts afresh.
            if decoding and job_lanes:
                if decode_turn:
                    self._decode_s += self._clock() - start
                else:
                    self._jobs_s += self._clock() - start
            else:
                self._decode_s = self._jobs_s = 0.0

    def work(self, unit: Unit) -> None:
        """Run one unit: this thread's turn, or, on a sharded model's other processes, the turn their rank 0 took."""
        try:
            for job in unit.samples:
                self._admit(job)
            if unit.decode:
                self._decode_step()
            elif unit.batch:
                self._run(unit.batch)
        except Exception:  # never let one job take the thread (and so the whole service) down
            log.exception("scheduler: unexpected error while running %s",
                          [j.request_id for j in unit.batch] or "a decode step")

    def _decoding_lanes(self, samples: list[Job]) -> int:
        return len({job.lane for job, _ in self._decoding.values()} | {job.lane for job in samples}) or 1

    def _ready_job_lanes(self) -> int:
        """Lanes whose head is a job (not a sample request) that may run now. Lock held."""
        now = self._clock()
        return sum(1 for lane in self._lanes.values() if (job := lane.head(now)) is not None and job.sample is None)

    def _take_samples(self) -> list[Job]:
        """Sample jobs for decoders with room, one lane at a time round-robin. Lock held.

        Room is counted in prompt tokens (a job's `tokens`): about one step's prefill, so requests
        wait in their lanes, where turns are fair, rather than in a decoder's first-come queue.
        """
        taken: list[Job] = []
        room = {name: engine.decoder.prefill_room() for name, engine in self.engines.items()}
        took = True
        while took:
            took = False
            for lane_id in self._turns:
                lane = self._lanes[lane_id]
                job = lane.jobs[0] if lane.jobs and not lane.ordered else None
                # An engine not loaded yet takes one job: loading it is that job's admission.
                if job is None or job.sample is None or room.get(job.base_model, 1) <= 0:
                    continue
                lane.jobs.pop(0)
                taken.append(job)
                room[job.base_model] = room.get(job.base_model, 1) - max(1, job.tokens)
                took = True
        return taken

    def _pick(self) -> list[Job]:
        """Take the next job (or batch of passes) round-robin, sample requests aside. Lock held."""
        now = self._clock()
        for _ in range(len(self._turns)):
            lane_id = self._turns[0]
            self._turns.rotate(-1)
            lane = self._lanes[lane_id]
            job = lane.head(now)
            if job is None or job.sample is not None:
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

    # ---- sampling -----------------------------------------------------------------------------

    def _admit(self, job: Job) -> None:
        """Validate a sample job on its engine and hand it to the engine's decoder."""
        sample = job.sample
        assert sample is not None  # _take_samples takes only sample jobs
        try:
            engine = self.engine(job.base_model)
            request = engine_work.sample_request(engine, self.context(), sample, job.on_token, job.cancel)
        except Exception as e:  # bad input, an unknown sampler, a model that cannot load
            self._fail(job, e)
            return
        engine.decoder.admit(request)
        self._decoding[id(request)] = (job, request)

    def _decode_step(self) -> None:
        """One step of every busy decoder; finish the requests that left it."""
        for name, engine in list(self.engines.items()):
            if not engine.decoder.busy:
                continue
            try:
                finished = engine.decoder.step()
            except Exception as e:  # the whole batch failed (say, out of memory): fail its requests
                log.exception("scheduler: a decode step failed; failing the requests decoding on %s", name)
                self._fail_decoder(name, e)
                continue
            for request in finished:
                job, _ = self._decoding.pop(id(request))
                self._finish_sample(job, request)

    def _fail_decoder(self, name: str, error: Exception) -> None:
        """Fail every request decoding on base model `name`, and start its decoder afresh."""
        failed = [request for job, request in self._decoding.values() if job.base_model == name]
        for request in failed:
            request.error = error
        self.engines[name].reset_decoder()
        for request in failed:
            job, _ = self._decoding.pop(id(request))
            self._finish_sample(job, request)

    def _finish_sample(self, job: Job, request: SampleRequest) -> None:
        if request.error is not None:
            self._fail(job, request.error)
            return
        result = request.result
        assert result is not None  # a request leaves the decoder with a result or an error
        job.usage = Usage(prefill_tokens=len(request.prompt), sample_tokens=sum(len(s.tokens) for s in result.sequences))
        job.duration_s = request.compute_s
        self._on_done(job, result)

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

    def _run(self, batch: list[Job]) -> None:
        start = time.perf_counter()
        try:
            engine = self.engine(batch[0].base_model)
        except Exception as e:  # a base model that cannot load fails its batch, not the thread
            for job in batch:
                self._fail(job, e)
            return
        if batch[0].fb_pass is not None:
            passes = [j.fb_pass for j in batch if j.fb_pass is not None]
            assert len(passes) == len(batch)  # a pass is batched with passes only (_batch_partners)
            try:
                results = engine.run_passes(passes)
            except Exception as e:
                results = [e] * len(batch)
            elapsed = time.perf_counter() - start
            for job, fb_pass, result in zip(batch, passes, results):
                if isinstance(result, Exception):
                    self._fail(job, result)
                    continue
                # A batch's time is shared among its passes by their token counts.
                job.duration_s = elapsed * job.tokens / max(1, sum(j.tokens for j in batch))
                # The ledger shows what the model ran beside what is billed (every token sent, Tinker's price):
                # rows that share a prefix run it once (engine/prefix_tree.py).
                job.metrics = {**result.metrics, COMPUTED: result.computed_tokens}
                kind = "prefill_tokens" if fb_pass.forward_only else "train_tokens"
                job.usage = Usage(**{kind: job.tokens})
                job.step = _steps(engine, job.lane)
                self._on_done(job, result)
            return
        job = batch[0]
        try:
            if job.call is not None:
                outcome = job.call(engine)
            else:
                assert job.op is not None  # a job is an op, a pass, a sample or a call, and passes and samples ran above
                outcome = engine_work.run(engine, self.context(), job.op)
        except Exception as e:
            self._fail(job, e)
            return
        job.duration_s = time.perf_counter() - start
        job.step = _steps(engine, job.lane)
        self._on_done(job, outcome)

    def _fail(self, job: Job, error: Exception) -> None:
        log_failure(job.request_id, error)
        self._on_done(job, error)


def _load_libc():
    path = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


_LIBC = _load_libc()


def return_freed_memory() -> None:
    """Give the memory the last jobs freed back to the operating system (glibc's malloc_trim).

    A training micro-batch's activations take about 2.5 MB a token (docs/performance.md). Once freed,
    glibc keeps most of that memory in its heaps for later, so without this the server's resident
    memory stays near the highest peak it ever reached (a laptop's browser and notebook need it back).
    Called when the scheduler goes idle; it takes a few milliseconds. A no-op without glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _steps(engine: Engine, lane: str) -> int | None:
    """Optim steps the lane's adapter has taken (None for a sampler, or an adapter the engine does not hold)."""
    return engine.steps(lane)


def log_failure(request_id: str, error: Exception) -> None:
    """Bad input is the user's and needs no log; anything else is ours: the log gets its traceback."""
    if not isinstance(error, UserError):
        log.error("request %s failed:\n%s", request_id, "".join(traceback.format_exception(error)))


