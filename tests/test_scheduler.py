"""The scheduler's ordering and fairness, with recording jobs (the compute is tested elsewhere).

The engine here is a stand-in that records which passes ran together, and its decoder a stand-in
whose requests each need a given number of steps: these tests are about who runs when, not about
what the model computes. Time is a fake clock the scheduler reads (its `clock` seam): the stand-in
work moves it by how long it "takes", and a test moves it past a wait, so what is checked does not
depend on how fast the machine or its other processes are. The same scheduling with the real model
and decoder is in tests/test_engine.py (test_a_training_job_finishes_while_a_long_sample_decodes).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

from helpers import wait_until
from kernel_backend.engine.core import Pass
from kernel_backend.execution import engine_work
from kernel_backend.execution.engine_work import SampleOp
from kernel_backend.engine.sampler import SampleRequest
from kernel_backend.execution.scheduler import GAP_WAIT_S, Job, Scheduler
from kernel_backend.types import ForwardResult, SampleResult, SamplingParams


class Clock:
    """The scheduler's clock: it moves only when the stand-in work or the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CountingDecoder:
    """Each request is done after `params.max_tokens` steps of `step_s` seconds (on the clock); steps are logged."""

    def __init__(self, log: list[str], step_s: float, clock: Clock) -> None:
        self.log, self.step_s, self.clock = log, step_s, clock
        self.live: list[list] = []  # [request, steps left]
        self.steps = 0

    def admit(self, request: SampleRequest) -> None:
        self.live.append([request, request.params.max_tokens])

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def prefill_room(self) -> int:
        return 1000

    def step(self) -> list[SampleRequest]:
        self.clock.advance(self.step_s)
        self.steps += 1
        self.log.append(f"step:{len(self.live)}")
        for entry in self.live:
            entry[1] -= 1
        done = [r for r, left in self.live if left == 0]
        self.live = [e for e in self.live if e[1] > 0]
        for request in done:
            request.result = SampleResult(sequences=[])
        return done


class RecordingEngine:
    def __init__(self, step_s: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.log: list[str] = []
        self.clock = Clock()
        self.decoder = CountingDecoder(self.log, step_s, self.clock)

    def steps(self, adapter_id):  # the scheduler puts a run's step count into its ledger row
        return None

    def sample_request(self, adapter_id, prompt, num_samples, params, *args, **options):
        return SampleRequest(None, prompt, num_samples, params, set(), [])

    def run_passes(self, passes):
        self.batches.append([p.adapter_id for p in passes])
        return [ForwardResult([], {"loss:sum": 0.0}) for _ in passes]


def make_scheduler(step_s: float = 0.0):
    engine = RecordingEngine(step_s)
    order: list[str] = []
    done = threading.Event()
    finished: list[str] = []

    def on_done(job, outcome):
        finished.append(job.request_id)
        engine.log.append(f"done:{job.request_id}")
        done.set()

    scheduler = Scheduler(load_engine=lambda name: engine, on_done=on_done, max_batch_tokens=10_000,
                          clock=engine.clock)
    scheduler.engine("m")  # loaded before start, as the service does
    return scheduler, engine, order, finished


def sample_job(request_id: str, lane: str, steps: int) -> Job:
    """A sample job whose request needs `steps` decode steps."""
    return Job(request_id, lane, "m", seq=None, sample=SampleOp(None, [1], 1, SamplingParams(max_tokens=steps)))


def recording_job(order, request_id, lane, seq, delay=0.0, arrived=None):
    """A job that takes `delay` seconds on the clock; `arrived`: when on the clock (a missing seq_id's wait)."""
    def run(engine):
        engine.clock.advance(delay)
        order.append(request_id)
        return {}

    job = Job(request_id, lane, "m", seq=seq, call=run)
    if arrived is not None:
        job.arrived = arrived
    return job


def wait_for(finished, n, timeout=30):
    wait_until(lambda: len(finished) >= n, timeout, f"{n} jobs to finish (finished: {finished})")


def looked_at(scheduler, act) -> None:
    """Do `act()` (a submit, a wake) and wait until the scheduler has since looked at its lanes and gone idle."""
    act()
    seen = scheduler.idle_passes  # a pass counted after this read began after act() (both hold the lock)
    wait_until(lambda: scheduler.idle_passes > seen, 30, "the scheduler to look at its lanes")


def test_a_busy_session_does_not_starve_another():
    scheduler, _, order, finished = make_scheduler()
    for i in range(10):
        scheduler.submit(recording_job(order, f"a{i}", "run-a", seq=i, delay=0.01), ordered=True)
    for i in range(2):
        scheduler.submit(recording_job(order, f"b{i}", "run-b", seq=i), ordered=True)
    scheduler.start()
    wait_for(finished, 12)
    scheduler.stop()
    # Turns alternate: run-b's two jobs are done by the time run-a has had three turns.
    assert order.index("b1") < order.index("a3"), order
    assert [x for x in order if x.startswith("a")] == [f"a{i}" for i in range(10)]


def test_each_run_executes_in_seq_id_order_whatever_the_arrival_order():
    scheduler, _, order, finished = make_scheduler()
    for seq in (3, 1, 2, 0):
        scheduler.submit(recording_job(order, f"s{seq}", "run", seq=seq), ordered=True)
    scheduler.start()
    wait_for(finished, 4)
    scheduler.stop()
    assert order == ["s0", "s1", "s2", "s3"]


def test_a_missing_seq_id_is_waited_for_then_skipped():
    scheduler, engine, order, finished = make_scheduler()
    clock = engine.clock
    scheduler.start()
    scheduler.submit(recording_job(order, "s1", "run", seq=1, arrived=clock()), ordered=True)
    wait_for(finished, 1)
    s3 = recording_job(order, "s3", "run", seq=3, arrived=clock())  # seq 2 not yet
    looked_at(scheduler, lambda: scheduler.submit(s3, ordered=True))
    assert order == ["s1"]  # waiting for 2...
    clock.advance(GAP_WAIT_S / 2)
    looked_at(scheduler, scheduler.wake)
    assert order == ["s1"]  # ...still, halfway through the wait
    scheduler.submit(recording_job(order, "s2", "run", seq=2, arrived=clock()), ordered=True)
    wait_for(finished, 3)
    assert order == ["s1", "s2", "s3"]
    s5 = recording_job(order, "s5", "run", seq=5, arrived=clock())  # 4 is lost for good
    looked_at(scheduler, lambda: scheduler.submit(s5, ordered=True))
    assert len(finished) == 3  # waited for, at first...
    clock.advance(GAP_WAIT_S + 0.001)
    scheduler.wake()
    wait_for(finished, 4)  # ...then skipped
    scheduler.stop()
    assert order[-1] == "s5"


def test_passes_of_different_runs_are_batched_together():
    scheduler, engine, _, finished = make_scheduler()
    for lane in ("run-a", "run-b", "run-c"):
        job = Job(f"{lane}-fb", lane, "m", seq=1, fb_pass=Pass(lane, []), tokens=100)
        scheduler.submit(job, ordered=True)
    scheduler.start()
    wait_for(finished, 3)
    scheduler.stop()
    assert sorted(engine.batches[0]) == ["run-a", "run-b", "run-c"]


def test_sample_requests_of_several_lanes_decode_together():
    scheduler, engine, _, finished = make_scheduler()
    for lane in ("sampler-a", "sampler-b", "sampler-c"):
        scheduler.submit(sample_job(f"{lane}-1", lane, steps=3), ordered=False)
    scheduler.start()
    wait_for(finished, 3)
    scheduler.stop()
    # One batch of three requests, three steps, not three requests one after another.
    assert engine.log[:3] == ["step:3"] * 3 and engine.decoder.steps == 3, engine.log


def test_a_long_decode_and_training_jobs_take_turns():
    """Neither starves the other: training finishes while the long sample still decodes, and the
    decode keeps stepping while training jobs are queued."""
    scheduler, engine, order, finished = make_scheduler(step_s=0.005)
    scheduler.submit(sample_job("long-sample", "sampler", steps=60), ordered=False)
    for i in range(6):
        scheduler.submit(recording_job(order, f"t{i}", "run", seq=i, delay=0.02), ordered=True)
    scheduler.start()
    wait_for(finished, 7)
    scheduler.stop()
    log = engine.log
    assert log.index("done:t5") < log.index("done:long-sample"), log
    # Decode steps ran between training jobs, not only after all of them.
    between = log[log.index("done:t0") : log.index("done:t5")]
    assert sum(entry.startswith("step") for entry in between) >= 5, log


def test_every_work_item_s_fields_are_its_functions_arguments():
    """engine_work.run calls an item's function with the item's fields as keyword arguments: a field renamed on
    one side only would fail on the scheduler thread, at the first such job. Checked here for every kind."""
    for item, work in engine_work.WORK.items():
        fields = [f.name for f in dataclasses.fields(item)]
        arguments = list(inspect.signature(work).parameters)[2:]  # after (engine, ctx)
        assert fields == arguments, (item.__name__, fields, arguments)
