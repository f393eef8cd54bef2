"""The engine worker of a Ray cluster (execution/cluster.py): a Ray actor per device, an Engine per base model and the same
Scheduler as in-process, answering each job's Outcome to the gateway.

Also what both sides of the cluster share: a worker's answer (`Outcome`), the error of a lost worker (`WorkerLost`),
that of a process Ray restarted, which the gateway has not started again (`WorkerRestarted`), that of a shard group
whose collective failed (`ShardGroupLost`), a worker's place in a shard group (`ShardRole`) and a job as it travels
(`wire`). This module imports without Ray: `Cluster` makes EngineWorker an actor (ray.remote(EngineWorker)).

A shard group (STEPWISE_SHARD, issue 55): N workers whose engines hold one base model sharded over their process
group (engine/sharding.py), every one of them running the same engine calls in the same order on the same rows,
batched the same way (each gathered weight is a collective). Rank 0, the leader, is the only member the gateway
sends jobs to, and its scheduler alone decides, as in any worker: lanes in seq_id order, passes of several runs
batched into one, the decode batch. Each unit it decides (scheduler.Unit) is sent to the other members before it runs
(`follow`, in the order they number them), and they run exactly that unit with `Scheduler.work`; their answers are
dropped (rank 0 answers, and writes the checkpoints: Engine._writes). So multi-tenant batching is kept: what a group
batches is the leader's batch. What could part the members is fixed by the leader before it sends: a sample request
without a seed gets one (each process would draw its own), and a save the leader refuses before any collective (a
checkpoint that exists) is a no-op on the others. A collective that fails (a member died, or hung past
STEPWISE_GROUP_TIMEOUT_S) fails its jobs with ShardGroupLost and every later unit at once: the gateway takes the group
for lost, and forms it again once Ray has restarted its members (execution/cluster.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_backend.execution import engine_work
from kernel_backend.config import Settings
from kernel_backend.engine.core import Engine
from kernel_backend.errors import UserError
from kernel_backend.metering import Usage
from kernel_backend.execution.engine_work import FreeAdapters, Noop, Op, OptimStep, Save
from kernel_backend.execution.scheduler import RETURN_MEMORY_AFTER_IDLE_S, Job, Scheduler, Unit, return_freed_memory

log = logging.getLogger("stepwise.cluster")

# A worker's shard group among its process groups (the others are data-parallel runs', by run id: none starts with @).
SHARD = "@shard"


class WorkerLost(RuntimeError):
    """A request's worker stopped before it answered; the message says what became of its run."""


class WorkerRestarted(RuntimeError):
    """A call reached a worker process that Ray restarted before the gateway noticed (it has not started it again):
    the state the call was meant for died with the old process, so the gateway takes the worker for lost."""


class ShardGroupLost(RuntimeError):
    """A shard group's collective failed (a member died, or hung past STEPWISE_GROUP_TIMEOUT_S): its engines cannot go
    on, and the gateway takes every member for lost."""


@dataclass
class ShardRole:
    """A worker's place in a shard group: its rank, the group's workers in rank order, and for rank 0 the others'
    actor handles (Ray's, typed Any), to send each unit to."""

    rank: int
    members: list[str]
    followers: list[Any] = field(default_factory=list)


def wire(job: Job) -> Job:
    """The job as it travels to a worker: its plain fields only (no gateway callbacks, no worker's own steps)."""
    return dataclasses.replace(job, request=None, on_token=None, cancel=None, gate=None, call=None)


@dataclass
class RestoreGrads(Op):
    """A data-parallel replica puts back the gradients it kept before request `request_id`'s backward pass (another
    shard of it failed: Cluster._undo_shards). The worker does it (it keeps them), not engine_work.run."""

    request_id: str


@dataclass
class Outcome:
    """A worker's answer for one job: the op's result or the exception it raised, and the ledger's facts."""

    result: object
    usage: Usage | None = None
    metrics: dict = field(default_factory=dict)
    duration_s: float = 0.0
    step: int | None = None


class EngineWorker:
    """One device: an Engine per base model and a Scheduler over them, as in-process, inside a Ray actor.

    Its methods are coroutines on the actor's event loop; the scheduler thread owns the engines. Made a
    Ray actor by `Cluster` (ray.remote(EngineWorker)), so this module imports without Ray."""

    def __init__(self, name: str, settings: Settings, memory_budget: int) -> None:
        torch.set_num_threads(max(1, settings.worker_threads))
        self.name, self.settings, self.memory_budget = name, settings, memory_budget
        self.incarnation = uuid.uuid4().hex  # a process Ray restarted is a new incarnation: its state is gone
        self.ctx = engine_work.Context.of(settings)
        # An engine's model is sharded over the worker's shard group, once it has joined one (start).
        self.scheduler = Scheduler(lambda base: Engine(base, settings, group=self._groups.get(SHARD)), self._done,
                                   settings.max_batch_tokens, self.ctx)
        self.shard: ShardRole | None = None
        self._broken: str | None = None  # why its shard group cannot go on (a collective failed)
        self._units_sent = 0  # rank 0: units sent to the other members
        self._units: dict[int, Unit] = {}  # another member: units received, by number, not run yet
        self._units_arrived = threading.Condition()
        self.state = "starting"
        self.error: str | None = None  # why it failed to start
        self._waiting: dict[str, asyncio.Future] = {}
        self._stores: dict[str, torch.distributed.TCPStore] = {}  # run id -> the TCPStore its group meets at (rank 0 keeps it)
        self._groups: dict[str, object] = {}  # run id -> its data-parallel process group
        self._undo: dict[str, tuple[str, list]] = {}  # run id -> (its last backward pass, the gradients before it)
        self._reduce: dict[str, tuple] = {}  # request id -> (all-reduce work, flat gradients), for an optim_step

    async def start(self, base_models: list[str], shard: ShardRole | None = None) -> dict:
        """Load the base models, then start the scheduler. A worker that cannot is `failed`: reported, given nothing.
        `shard`: its place in the shard group it has joined (join_group with SHARD), whose members the gateway starts
        together: rank 0 runs the scheduler and sends each unit to the others, which run what it sends."""
        self._loop = asyncio.get_running_loop()
        if self.state == "starting":
            self.shard = shard
            try:
                await asyncio.to_thread(self._load, base_models)
                self.state = "live"
            except Exception as e:
                log.exception("worker %s could not load %s", self.name, base_models)
                self.state, self.error = "failed", f"{type(e).__name__}: {e}"
        return await self.report()

    def _load(self, base_models: list[str]) -> None:
        if self.shard is not None and SHARD not in self._groups:
            raise RuntimeError(f"engine worker {self.name} was started as rank {self.shard.rank} of a shard group it "
                               "has not joined")
        for name in base_models:
            self.scheduler.engine(name)
        if self.shard is not None and self.shard.rank > 0:
            # The leader's scheduler decides; this one runs what it is sent. It writes no checkpoint: rank 0 does, and
            # this one takes part in the engine's side of each save only (engine_work.Context.writes).
            self.scheduler.ctx = dataclasses.replace(self.ctx, writes=False)
            threading.Thread(target=self._follow, name="stepwise-shard-follower", daemon=True).start()
            return
        if self.shard is not None:
            self.scheduler.mirror = self._mirror
        self.scheduler.start()

    async def report(self) -> dict:
        """The heartbeat: state, models, adapters, queue and memory."""
        engines = dict(self.scheduler.engines)
        return {
            "name": self.name, "incarnation": self.incarnation, "state": self.state, "error": self.error,
            "device": self.settings.device, "pid": os.getpid(), "node": _node_ip(), "node_id": _node_id(),
            "models": self.scheduler.facts() if self.state == "live" else {},
            "adapters": {name: list(engine.adapters.entries) for name, engine in engines.items()},
            "adapter_cache": {name: engine.adapters.stats() for name, engine in engines.items()},
            "queue_depth": self.scheduler.queue_depth(), "memory": self._memory(engines),
            "sampling": {name: engine.decoder.stats() for name, engine in engines.items()},
            "shard": None if self.shard is None else {"rank": self.shard.rank, "members": self.shard.members,
                                                      "broken": self._broken},
        }

    def _memory(self, engines: dict) -> dict:
        """What this worker holds and has left, by its engines' own measures (Engine.memory): `free` places runs
        and admits batches (run); `adapter_room` is the most one run's state could have here, every other
        adapter spilled (the gateway admits a new run against it); a batch's activations need about
        `activation_bytes_per_token` a token of its largest micro-batch."""
        held = {name: _measured(engine) for name, engine in engines.items()}
        # The base weights and, with STEPWISE_SAMPLE_DTYPE=bfloat16, their sampling copy (engine/lora.py).
        base = sum(m["base_model_bytes"] + m["sampler_weights_bytes"] for m in held.values())
        adapters = sum(m["adapter_bytes"] for m in held.values())  # resident, as the adapter caches count them
        # The rest it holds: recent steps' copies, the decoders' KV and prefix caches.
        others = sum(m["step_history_bytes"] + m["sampler_kv_bytes"] + m["prefix_cache_bytes"] for m in held.values())
        if self.settings.device.startswith("cuda") and self.state == "live":
            free, total = torch.cuda.mem_get_info(torch.device(self.settings.device))
            room = free + adapters
        else:
            total = self.memory_budget
            free, room = total - base - others - adapters, total - base - others
        return {"total": total, "free": max(0, free), "adapter_room": max(0, room), "base_model_bytes": base,
                "adapter_bytes": adapters, "other_bytes": others,
                "activation_bytes_per_token": {name: activation_bytes_per_token(engine.model.config)
                                               for name, engine in engines.items()},
                "engines": held}

    def _refuse_if_too_big(self, job: Job) -> None:
        """A forward(_backward) whose activations need more than this worker has free fails here, at admission,
        instead of the worker being killed for memory by the OS or Ray's monitor mid-pass. It still takes its
        place in its run's seq_id order (a no-op that fails), so the run's next request does not wait for it."""
        if job.fb_pass is None or not job.fb_pass.data:
            return
        memory = self._memory(dict(self.scheduler.engines))
        per_token = memory["activation_bytes_per_token"].get(job.base_model)
        if per_token is None:
            return
        lengths = [len(d.tokens) for d in job.fb_pass.data]
        # The engine cuts a pass into micro-batches of STEPWISE_MICRO_BATCH_TOKENS (a longer row is one alone).
        peak = min(sum(lengths), max(self.settings.micro_batch_tokens, max(lengths)))
        need = peak * per_token
        if need <= memory["free"]:
            return
        gpu = self.settings.device.startswith("cuda")
        budget = f"its GPU ({self.settings.device})" if gpu else "its memory budget, STEPWISE_WORKER_MEMORY_MB"
        message = (f"this batch needs about {need >> 20} MB on engine worker {self.name} ({peak} tokens in its largest "
                   f"micro-batch at about {per_token / 2**20:.2f} MB a token), which has {memory['free'] >> 20} MB free "
                   f"of {memory['total'] >> 20} MB ({budget}): send fewer tokens per request or lower "
                   "STEPWISE_MICRO_BATCH_TOKENS" +
                   ("" if gpu else ", or raise STEPWISE_WORKER_MEMORY_MB (and restart the server)"))

        def refuse(engine):
            raise UserError(message)

        job.fb_pass, job.op, job.call = None, Noop(), refuse

    async def run(self, job: Job, ordered: bool) -> Outcome:
        """Queue a job on this worker's scheduler and answer its outcome when it is done."""
        if self.state != "live":  # only a process Ray restarted is called before it started (or while it starts)
            raise WorkerRestarted(f"engine worker {self.name} is a new process ({self.state}): its runs went with "
                                  "the old one")
        future = self._loop.create_future()
        self._waiting[job.request_id] = future
        job.arrived = time.monotonic()  # the gateway's clock is not this machine's
        self._refuse_if_too_big(job)
        self._prepare(job)
        self.scheduler.submit(job, ordered)
        return await future

    def _done(self, job: Job, outcome) -> None:
        """The scheduler thread: hand the outcome to the waiting call, on the actor's loop."""
        if self.shard is not None and self.shard.rank > 0:
            return  # a unit rank 0 sent: rank 0 answers it
        if self.shard is not None and isinstance(outcome, Exception) and (
                _collective_failed(outcome) or isinstance(outcome, engine_work.MemberFailed)):
            what = "a member failed its part of a save" if isinstance(outcome, engine_work.MemberFailed) else \
                "a collective failed"
            self._broken = self._broken or (
                f"the shard group of engine workers {', '.join(self.shard.members)} lost a member: {what} "
                f"({type(outcome).__name__}: {str(outcome)[:300]})")
            outcome = ShardGroupLost(self._broken)
        if isinstance(outcome, Exception) and not isinstance(outcome, (UserError, WorkerLost, ShardGroupLost)):
            outcome = RuntimeError(str(outcome))  # the traceback is in this worker's log; the message travels
        answer = Outcome(outcome, job.usage, job.metrics, job.duration_s, job.step)
        self._loop.call_soon_threadsafe(self._resolve, job.request_id, answer)

    def _resolve(self, request_id: str, answer: Outcome) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(answer)

    # ---- a shard group (the module docstring) ----------------------------------------------------------

    def _mirror(self, unit: Unit) -> None:
        """Rank 0, before it runs a unit: what could part the members fixed, then the unit sent to each of them."""
        if self._broken:
            raise ShardGroupLost(self._broken)
        for job in unit.samples:  # each process would draw its own seed
            sample = job.sample
            if sample is not None and sample.params.seed is None:
                job.sample = dataclasses.replace(sample, params=dataclasses.replace(
                    sample.params, seed=random.getrandbits(63)))
        sent = Unit([wire(job) for job in unit.samples], unit.decode, [self._follower_job(job) for job in unit.batch])
        assert self.shard is not None  # (the mirror of a shard group's rank 0 only)
        for follower in self.shard.followers:
            follower.follow.remote(self._units_sent, sent)  # the unit's first collective is where they meet
        self._units_sent += 1

    def _follower_job(self, job: Job) -> Job:
        """A job as the other members run it: rank 0 answers and writes, so a save it refuses before any collective
        (its checkpoint exists) is nothing for them (they never look at the store: engine_work.Context.writes).
        Decided here, just before rank 0's thread runs the same save: a checkpoint's key is its run's, whose lane
        runs one job at a time, so nothing writes it in between."""
        sent = wire(job)
        op = sent.op
        if isinstance(op, Save) and not op.overwrite and self.ctx.storage.exists(op.key):
            sent.op = Noop()
        return sent

    async def follow(self, number: int, unit: Unit) -> None:
        """Another member: unit `number` of rank 0's, to run after the ones before it (Ray may deliver out of order)."""
        with self._units_arrived:
            self._units[number] = unit
            self._units_arrived.notify_all()

    def _follow(self) -> None:
        """Another member's thread: rank 0's units, in order, each run as rank 0 runs it. Idle a while after work, it
        gives back the memory the work freed, as the scheduler's own thread does (scheduler.return_freed_memory)."""
        number, worked = 0, False
        while True:
            with self._units_arrived:
                idle = RETURN_MEMORY_AFTER_IDLE_S if worked else None
                unit = self._units.pop(number) if self._units_arrived.wait_for(lambda: number in self._units, idle) else None
            if unit is None:
                return_freed_memory()
                worked = False
                continue
            number, worked = number + 1, True
            self.scheduler.work(unit)

    # ---- data parallel ------------------------------------------------------------------------------

    async def open_group(self, run_id: str, size: int) -> tuple[str, int]:
        """Rank 0 of a run's group: the TCPStore the ranks meet at (a free port on this node)."""
        import torch.distributed as dist

        host = _node_ip()
        self._stores[run_id] = dist.TCPStore(host, 0, size, True, wait_for_workers=False,
                                             timeout=dt.timedelta(seconds=self.settings.group_timeout_s))
        return host, self._stores[run_id].port

    async def join_group(self, run_id: str, key: str, host: str, port: int, rank: int, size: int) -> None:
        """Join a run's process group, or with run_id SHARD the worker's shard group (every rank at once: the gateway
        calls them together). Its collectives fail past STEPWISE_GROUP_TIMEOUT_S, never hang."""
        import torch.distributed as dist

        timeout = dt.timedelta(seconds=self.settings.group_timeout_s)

        def connect():
            store = self._stores[run_id] if rank == 0 else dist.TCPStore(host, port, size, False, timeout=timeout)
            store = dist.PrefixStore(key, store)
            gpu = self.settings.device.startswith("cuda")
            if run_id == SHARD:
                # The process's default group (sharding's dist.* calls translate ranks through it); one per process,
                # as a worker joins one shard group in its life (a group formed again is made of new processes).
                # Gloo picks the interface of the machine's hostname (GLOO_SOCKET_IFNAME names another).
                dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=size,
                                        timeout=timeout)
                return dist.group.WORLD
            if gpu:
                return dist.ProcessGroupNCCL(store, rank, size)
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=_node_ip())]
            options._timeout = timeout
            return dist.ProcessGroupGloo(store, rank, size, options)

        self._groups[run_id] = await asyncio.to_thread(connect)

    async def reset_run(self, run_id: str, base_model: str) -> Outcome:
        """Before a run is restored here from a snapshot: what waits in its lane was meant for the state being
        replaced (it fails); then its adapter and group go."""
        self.scheduler.reset_lane(run_id, WorkerLost(f"training run {run_id} is being restored from a snapshot"))
        for held in (self._groups, self._stores, self._undo):
            held.pop(run_id, None)
        free = Job(uuid.uuid4().hex, run_id, base_model, seq=None, op=FreeAdapters([run_id]))
        return await self.run(free, True)

    def _prepare(self, job: Job) -> None:
        """This worker's part of a data-parallel run's job: gates and local steps around the plain work."""
        if isinstance(job.op, FreeAdapters):
            for adapter_id in job.op.adapter_ids:
                for held in (self._groups, self._stores, self._undo):
                    held.pop(adapter_id, None)
        group = self._groups.get(job.lane)
        if group is None:
            return
        if job.fb_pass is not None and not job.fb_pass.forward_only:
            job.gate = lambda: self._keep_undo(job)
        elif isinstance(job.op, OptimStep):
            job.gate = lambda: self._reduced(job, group)
            job.call = lambda engine: self._reduced_step(engine, job)
        elif isinstance(job.op, RestoreGrads):
            job.call = lambda engine: self._restore_grads(engine, job)

    def _params(self, job: Job) -> list:
        return self.scheduler.engines[job.base_model].adapters.get(job.lane).adapter.parameters()

    def _keep_undo(self, job: Job) -> bool:
        """Before a replica's backward pass: keep its run's gradients, to put back if another shard fails."""
        kept = self._undo.get(job.lane)
        if (kept is None or kept[0] != job.request_id) and job.lane in self.scheduler.engines[job.base_model].adapters:
            self._undo[job.lane] = (job.request_id, [None if p.grad is None else p.grad.clone() for p in self._params(job)])
        return True

    def _restore_grads(self, engine, job: Job) -> dict:
        op = job.op
        assert isinstance(op, RestoreGrads)  # _prepare makes this the call of a RestoreGrads job only
        kept = self._undo.pop(job.lane, None)
        if kept is not None and kept[0] == op.request_id:
            for p, g in zip(self._params(job), kept[1]):
                p.grad = g
        return {}

    def _reduced(self, job: Job, group) -> bool:
        """An optim_step's gate: start the all-reduce of its run's gradients; open when it is done."""
        if job.request_id not in self._reduce:
            try:
                params = self._params(job)
            except KeyError:
                return True  # no such adapter here: the step itself fails with the engine's error
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + [torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)])
            work = group.allreduce([flat])
            work.get_future().then(lambda _: self.scheduler.wake())
            self._reduce[job.request_id] = (work, flat)
        return self._reduce[job.request_id][0].is_completed()

    def _reduced_step(self, engine, job: Job):
        """The step on the summed gradients; on failure the replica's own gradients are put back."""
        op = job.op
        assert isinstance(op, OptimStep)  # _prepare makes this the call of an OptimStep job only
        work, flat = self._reduce.pop(job.request_id, (None, None))
        if work is None:
            return engine_work.run(engine, self.ctx, op)
        work.wait()  # raises if the all-reduce failed (a peer stopped)
        params = self._params(job)
        own = [p.grad for p in params]
        had = flat[-len(params):]
        offset = 0
        for p, count in zip(params, had):
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone() if count > 0 else None
            offset += p.numel()
        try:
            return engine_work.run(engine, self.ctx, op)
        except Exception:
            for p, g in zip(params, own):
                p.grad = g
            raise


def _collective_failed(error: Exception) -> bool:
    """Whether an error is a process group's: gloo's own errors are plain RuntimeErrors that name gloo; the store's
    and NCCL's are DistErrors."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or "gloo/" in str(error)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _node_id() -> str:
    """Ray's id of this worker's node (two nodes of one machine share an address)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _measured(engine) -> dict:
    """Engine.memory(), read from the actor's loop while the scheduler thread may be changing the adapter cache: a
    dict that changed size under the read is read again."""
    for _ in range(5):
        try:
            return engine.memory()
        except RuntimeError:
            continue
    return engine.memory()


def activation_bytes_per_token(config) -> int:
    """About what one token of a forward_backward micro-batch holds at its peak: the logits over the vocabulary and
    their gradient, and each layer's activations kept for the backward, in float32. Fitted to the growth of peak
    resident memory over a 1,000-token pass on CPU (2026-12-06): 2.25 MB a token on SmolLM2-135M (this gives 2.28),
    0.38 MB on the tests' tiny stand-in (this gives 0.40); an estimate that errs high. `config`: the model's
    transformers config (the gateway reads it from the model's folder, Cluster._micro_batch_tokens)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return 4 * (2 * config.vocab_size + config.num_hidden_layers * (14 * hidden + 5 * intermediate))


