"""Scale-out on Ray: one gateway (this process: the API, the store, the ledger), many engine workers
(execution/cluster_worker.py).

    Service.submit ──> Cluster (this process): placement, replicas, heartbeats, recovery
                          │ the Job, its engine-side work plain data (execution/engine_work.py), pickled by Ray
                          ▼
                       EngineWorker, a Ray actor per device: an Engine per base model and the same
                       Scheduler as in-process (seq_id order per run, passes of runs batched, one
                       decode batch), answering each job's Outcome

A worker is a thin actor around the in-process pieces. It runs a job its scheduler's way and
answers the op's plain result (or the exception it raised) with the ledger's facts: usage,
metrics, duration, the run's step. The gateway turns that into the reply and the ledger row
(Service.on_done), as in-process; the store, the ledger and checkpoint rows never leave it.
Checkpoint files go through the checkpoint store every worker reaches (ops.Context).

Placement. A new training run goes to the live worker with the most free memory for adapters
(measured by the worker: the GPU's free memory, or its budget less its base models and adapters on
CPU), preferring workers that hold its base model; its calls follow it there, and the worker's
scheduler runs them in seq_id order. A sampler goes where its weights are (the in-memory snapshot's
worker) or, for the base model or a checkpoint, to the least busy live worker, which loads it.
Memory is admitted, never overrun: a run whose state could not fit its worker's room for adapters fails when it
is made (_admit_run), and a batch whose activations need more than its worker has free fails at the worker
(EngineWorker._refuse_if_too_big), both naming STEPWISE_WORKER_MEMORY_MB; the OS or Ray's memory monitor would
kill the worker instead.

Data parallel. A run with R replicas (STEPWISE_REPLICAS_PER_RUN, or its user_metadata
{"replicas": "R"}) lives on R workers, which share a torch.distributed process group (gloo on CPU,
NCCL on GPU). forward_backward is split into R contiguous shards, one per replica; optim_step
all-reduces the LoRA gradients (a sum: losses are sums over tokens, so the shards' sum is the whole
batch's gradient) and every replica applies the same update. Saves and snapshots are replica 0's;
the others see a no-op in their place, so their seq_id order has no gaps. The client sees one run,
and the ledger one row per call. While a backward pass is out, the run's later calls wait here: if
one shard fails, the others' gradients are put back first (a failed request changes nothing).
The all-reduce never blocks a worker: an optim_step waits at the head of its lane (Job.gate) while
gloo reduces in the background, and the worker runs other runs' jobs meanwhile.

Sharded models. With STEPWISE_SHARD N > 1 the workers form groups of N consecutive ones, each a torch.distributed
process group formed before its members load the base models into shards (engine/sharding.py): each holds about
1/N of them. A group serves as one worker: runs and samplers are placed on its rank 0 only (_serves), whose
scheduler decides every batch and sends it to the others (execution/cluster_worker.py, "a shard group"). A member
lost takes its whole group with it (_lost): the group's runs wait in _restore while Ray restarts the members (the
heartbeats have Ray restart those that still answer), and once all are back _rejoin_group forms the group again and
the runs are reloaded onto it from their snapshots, resharded, then their journals replayed.

Recovery. Each run's state (weights + optimizer) is written to the checkpoint store every
STEPWISE_SNAPSHOT_EVERY optim steps, by its worker, as part of the step. A worker that dies
(RayActorError, a new process of Ray's that answers or refuses a call, or MISSED_HEARTBEATS missed heartbeats) takes
nothing else down: each of its runs is reloaded on a live worker from its newest snapshot (or made again as it was
created, with the same seed, before its first snapshot), then the gateway's journal of its requests since
runs again there (service/recovery.py): those that had been answered silently, those in flight at the loss
as themselves, and the run is the one that was lost, bit for bit. Requests that come meanwhile wait. The
ledger holds each completed request once. (Without a journal, a Cluster made with no `replay`, the
requests in flight fail with an error that names the step the run resumes from.) A worker that Ray restarts
(max_restarts) loads its models again and rejoins: it takes new runs, and the runs lost when every worker died
(they wait for it). A run that no worker can take within STEPWISE_WORKER_WAIT_S is gone: its requests, waiting or
lost in flight, fail saying so; none is left pending.

The gateway's own crash. Its Ray head and workers die with it (Ray ties them to the process that started them; the
few agents that linger, the next gateway of the home ends: _end_previous_head). Started again on the same home, it
starts a new head and workers, then rebuilds every run as the in-process server does (service/recovery.replay: the
run's newest snapshot, recorded in the database by the optim_step that wrote it, then its journal since), before the
API serves; the requests pending at the crash are answered by the replay, and the SDK's retries carry the loop across.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_backend.execution import engine_work
from kernel_backend.engine import sharding
from kernel_backend.engine.base_models import resolve as resolve_model
from kernel_backend.engine.adapter_cache import TRAINING_COPIES
from kernel_backend.execution.cluster_worker import (SHARD, EngineWorker, Outcome, RestoreGrads, ShardGroupLost, ShardRole,
                                                     WorkerLost, WorkerRestarted, activation_bytes_per_token, wire)
from kernel_backend.config import Settings
from kernel_backend.engine.losses import merge_metrics
from kernel_backend.errors import UserError
from kernel_backend.metering import COMPUTED, Usage
from kernel_backend.execution.engine_work import CreateAdapter, LoadState, Noop, OptimStep, Snapshot
from kernel_backend.execution.scheduler import Job
from kernel_backend.persistence.checkpoint_storage import CheckpointStorage
from kernel_backend.types import ForwardResult

log = logging.getLogger("stepwise.cluster")

NAMESPACE = "stepwise"
# The workers' output, which Ray prints on this process's log, without colour codes: the log is a file or a journal.
os.environ.setdefault("RAY_COLOR_PREFIX", "0")
MISSED_HEARTBEATS = 3
# Ray restarts a worker process that dies this many times; it then loads its models again and rejoins.
MAX_RESTARTS = 5
# What a run is estimated to take on a worker until the worker's own measure includes it.
UNKNOWN_ADAPTER_BYTES = 64 << 20
RESTORING = "restoring"
# Of a machine's memory, what its CPU workers share by default (STEPWISE_WORKER_MEMORY_MB, _cpu_budget).
MACHINE_SHARE = 0.8
# With STEPWISE_SHARD left at 1, a CPU worker's base models may take this share of its budget; a model larger than that
# is sharded over as many workers as it needs (auto_shard). The rest is its runs': adapters, optimizer state,
# activations, the sampler's cache.
AUTO_SHARD_SHARE = 0.5
# Of what a sharded CPU worker's shards of the base models leave of its budget, what one micro-batch's activations may
# take when the operator did not set STEPWISE_MICRO_BATCH_TOKENS (Cluster._micro_batch_tokens); the rest is its runs'
# adapters and optimizer state, their kept steps, the sampler's cache and the weight a sharded pass gathers.
MICRO_BATCH_SHARE = 0.5
EVENTS_KEPT = 200  # the cluster view's record of workers lost and rejoined and runs restored: the latest kept


# ---- the gateway's side ----------------------------------------------------------------------------------


@dataclass
class Worker:
    """The gateway's view of one worker."""

    name: str
    actor: Any  # Ray's handle of its EngineWorker actor (methods called as .remote()), which Ray types only as Any
    actor_name: str  # Ray's name for it (ray.get_actor(actor_name, namespace=NAMESPACE))
    device: str
    state: str = "starting"  # starting | live | failed (cannot load its models) | dead (stopped answering)
    error: str | None = None
    incarnation: str | None = None
    report: dict = field(default_factory=dict)  # its last heartbeat
    heartbeat_at: float = 0.0
    missed: int = 0
    restarts: int = 0
    rejoining: bool = False  # Ray restarted its process and _rejoin is loading its models: reports wait
    placed: dict[str, int] = field(default_factory=dict)  # runs placed since its last report -> estimated bytes
    parts: dict[int, "_Part"] = field(default_factory=dict)  # parts of jobs sent to it, not answered yet
    group: list[str] = field(default_factory=list)  # its shard group's workers, rank 0 first (STEPWISE_SHARD); [] none

    def free(self) -> int:
        return self.report.get("memory", {}).get("free", 0) - sum(self.placed.values())


@dataclass
class Run:
    """A training run as the gateway places it."""

    id: str
    tenant: str
    base_model: str
    origin: CreateAdapter | LoadState  # how it was made: made again so when it has no snapshot
    workers: list[str]  # its replicas' workers, replica 0 first
    estimate: int  # bytes it takes on a worker
    snapshot: dict | None = None  # its newest automatic snapshot: {"step", "location"}
    gone: str | None = None  # the error its requests get when it could not be restored
    # Its calls held here while one of them must be answered before the next is sent (held_by: that request's id;
    # see Cluster._holds), or while it is restored after its worker died (held_by: RESTORING).
    held: list | None = None
    held_by: str | None = None
    # Its workers' lanes have run none of its sequenced calls yet (it was just made or restored there): nothing
    # orders its first calls on the worker but the order they arrive in (Cluster._holds).
    new_lanes: bool = True
    epoch: int = 0  # its process group's generation
    # Its requests in flight when its worker was lost (request id -> job), for the journal's replay to answer: those
    # the replay does not send again, or all of them if the run cannot be restored, fail (none is left pending).
    replayed: dict[str, Job] = field(default_factory=dict)


@dataclass
class _Part:
    """One worker's share of a job (the whole job unless the run is data parallel)."""

    worker: str
    wire: Job
    outcome: Outcome | Exception | None = None  # the worker's answer, or the error of the call
    done: bool = False
    dispatch: "_Dispatch | None" = None  # set by Cluster._send before the part is sent


@dataclass
class _Dispatch:
    """A job on its way: its parts, and the run it belongs to (None for a sampler's)."""

    job: Job
    run: Run | None
    parts: list[_Part]
    # Lost with a worker, to be answered by the journal's replay instead (Cluster._lost): late answers are dropped.
    abandoned: bool = False


class Cluster:
    """Placement, replicas, heartbeats and recovery, on the gateway: an executor (execution/executor.py). `on_done(job,
    outcome)` as the scheduler's."""

    restores_runs = True  # a lost worker's runs come back from the snapshots the gateway keeps

    def __init__(self, settings: Settings, storage: CheckpointStorage, on_done, replay=None, rebuild=None) -> None:
        """`replay(run_id, snapshot_location)`: run a restored run's journaled requests since that snapshot (None:
        since its creation) again, answering those lost in flight (service/recovery.py). Without it, those fail.
        `rebuild()`: after a crash of this gateway, rebuild every run it had from its snapshot and journal
        (service/recovery.replay), once the workers are live and before any new request (start)."""
        self.settings, self.storage, self._on_done, self._replay = settings, storage, on_done, replay
        self._rebuild = rebuild
        self.workers: dict[str, Worker] = {}
        self.runs: dict[str, Run] = {}
        self.lanes: dict[str, str] = {}  # sampler lanes -> their worker
        self.lost_lanes: dict[str, str] = {}  # sampler lanes whose worker died -> its name
        self.models: list[str] = []
        # What happened to the workers and their runs, oldest first (the cluster view's "events"): an operator
        # asking why a loop paused reads which worker was lost, why, and where each of its runs was restored.
        self.events: collections.deque[dict] = collections.deque(maxlen=EVENTS_KEPT)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified at each worker's report: a restore waits on it
        self._stopping = threading.Event()
        self._started_ray = False
        self._forming: set[str] = set()  # shard groups (their rank 0's name) being formed again (_rejoin_group)
        self._heartbeats = threading.Thread(target=self._beat_forever, name="stepwise-heartbeats", daemon=True)

    # ---- starting and stopping ------------------------------------------------------------------------

    def start(self, base_models: list[str]) -> None:
        """Start (or join) Ray and the workers, and load the base models on each; raises if none can."""
        if not self.settings.ray_address:
            # Ray maps 127.0.0.1 to the machine's address unless told that this is no cluster: a head of our own
            # stays on loopback (read when ray is first imported).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise RuntimeError("STEPWISE_WORKERS and STEPWISE_RAY_ADDRESS need Ray: pip install 'stepwise[cluster]'") from None

        self.models = list(base_models)
        own_head = not ray.is_initialized() and not self.settings.ray_address
        if not ray.is_initialized():
            self._started_ray = True
            if self.settings.ray_address:
                ray.init(address=self.settings.ray_address, namespace=NAMESPACE)
            else:  # a head on loopback, just for this backend
                _end_previous_head(self.settings.home)
                self._start_own_head(ray)
                _record_head(self.settings.home)  # (again once the workers run: a crash may come before)
        devices, explicit = self._devices(ray), bool(self.settings.worker_devices)
        budget = self._cpu_budget(devices)
        self.settings = dataclasses.replace(self.settings, shard=self._shard_size(budget, devices))
        self.settings = dataclasses.replace(self.settings, micro_batch_tokens=self._micro_batch_tokens(budget, devices))
        actor_class = ray.remote(EngineWorker)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        log.info("cluster: Ray at %s, %d nodes alive", ray.get_runtime_context().gcs_address, len(nodes))
        for i, device in enumerate(devices):
            name = f"worker-{i}"
            settings = dataclasses.replace(self.settings, device=device,
                                           worker_threads=self.settings.worker_threads or max(1, (os.cpu_count() or 1) // len(devices)))
            actor_name = f"stepwise-{name}-{uuid.uuid4().hex[:6]}"
            actor = actor_class.options(
                # A listed device is the operator's to assign; otherwise Ray gives each GPU worker its own GPU.
                name=actor_name, num_cpus=0,
                num_gpus=1 if device.startswith("cuda") and not explicit else 0,
                max_restarts=MAX_RESTARTS, max_concurrency=1000,
                scheduling_strategy=_spread(device, i, nodes),
            ).remote(name, settings, budget)
            self.workers[name] = Worker(name, actor, actor_name, device)
        roles = self._form_shard_groups()
        reports = [w.actor.start.remote(self.models, roles.get(w.name)) for w in self.workers.values()]
        for worker, ref in zip(list(self.workers.values()), reports):
            try:
                self._update(worker, ray.get(ref))
            except Exception as e:  # the actor itself could not start
                worker.state, worker.error = "failed", f"{type(e).__name__}: {e}"
        live = sum(w.state == "live" for w in self.workers.values())  # a shard group's members each count
        serving = [w.name for w in self.workers.values() if self._serves(w)]
        groups = f", in shard groups of {self.settings.shard} ({len(serving)} of {len(self.workers) // self.settings.shard} " \
            "with every member live)" if self.settings.shard > 1 else ""
        log.info("cluster: %d of %d workers live%s (%s)", live, len(self.workers), groups,
                 ", ".join(f"{w.name}: {w.state} on {w.device}" for w in self.workers.values()))
        if not serving:
            raise RuntimeError("no engine worker could load the base models: " +
                               "; ".join(f"{w.name}: {w.error}" for w in self.workers.values()))
        # The runs a crash of the gateway cut off died with its workers (Ray kills a driver's actors with it): they
        # come back here as in-process, their snapshot loaded on a worker, then their journal since, the requests
        # pending at the crash answered as themselves. Before the API serves: no new request can overtake them.
        if self._rebuild is not None:
            self._rebuild()
        if own_head:
            _record_head(self.settings.home)
        self._heartbeats.start()

    # ---- shard groups (STEPWISE_SHARD: execution/cluster_worker.py's docstring) ------------------------------

    def _shard_size(self, budget: int, devices: list[str]) -> int:
        """STEPWISE_SHARD as the operator set it; left at 1 on CPU workers, what the largest base model needs to fit
        each worker's `budget` (auto_shard), read from its files' headers. (A GPU worker's room is its device's,
        measured once it runs: not sized here.)"""
        if self.settings.shard != 1 or any(d.startswith("cuda") for d in devices):
            return self.settings.shard
        dtype = getattr(torch, self.settings.dtype)
        try:
            need = max(sharding.weight_bytes(resolve_model(name, self.settings.models_dir, self.settings.base_models)[1],
                                             dtype) for name in self.models)
        except (UserError, OSError) as e:  # the workers' nodes may hold files this one does not: they load as before
            log.warning("cluster: the base models' size cannot be read here (%s): not sharded automatically", e)
            return 1
        size = auto_shard(need, budget, len(devices))
        if size > 1:
            log.info("cluster: the base model's weights (%d MiB) exceed %.0f%% of a worker's budget (%d MiB): sharded "
                     "over groups of %d workers", need >> 20, AUTO_SHARD_SHARE * 100, budget >> 20, size)
        return size

    def _micro_batch_tokens(self, budget: int, devices: list[str]) -> int:
        """STEPWISE_MICRO_BATCH_TOKENS as the operator set it, or its default where that fits; on sharded CPU
        workers (a model sharded because it is large for them leaves them little room), when the default's
        activations would not fit, the largest micro-batch that does (fitting_micro_batch): its activations, by the
        admission's own measure (cluster_worker.activation_bytes_per_token), take MICRO_BATCH_SHARE of what each
        worker's shards of the base models leave of its `budget`. Else a step that fits when cut finely would be
        refused at admission (EngineWorker._refuse_if_too_big) until the operator set the micro-batch by hand."""
        chosen = self.settings.micro_batch_tokens
        if (self.settings.shard <= 1 or any(d.startswith("cuda") for d in devices)
                or "STEPWISE_MICRO_BATCH_TOKENS" in self.settings.given):
            return chosen
        from transformers import AutoConfig

        dtype = getattr(torch, self.settings.dtype)
        try:
            folders = [resolve_model(name, self.settings.models_dir, self.settings.base_models)[1] for name in self.models]
            shards = sum(sharding.weight_bytes(folder, dtype) for folder in folders) // self.settings.shard
            per_token = max(activation_bytes_per_token(AutoConfig.from_pretrained(folder)) for folder in folders)
        except (UserError, OSError, ValueError) as e:  # (as in _shard_size: the workers load as before)
            log.warning("cluster: the base models' size cannot be read here (%s): micro-batches stay at %d tokens", e,
                        chosen)
            return chosen
        room = int((budget - shards) * MICRO_BATCH_SHARE)
        fitting = fitting_micro_batch(room, per_token)
        if fitting >= chosen:
            return chosen
        log.info("cluster: micro-batches of %d tokens, not %d (STEPWISE_MICRO_BATCH_TOKENS unset): at about %.2f MB a "
                 "token their activations take at most %.0f%% of the %d MiB a worker's shard of the base models "
                 "(%d MiB) leaves of its budget; set STEPWISE_MICRO_BATCH_TOKENS to choose", fitting, chosen,
                 per_token / 2**20, MICRO_BATCH_SHARE * 100, (budget - shards) >> 20, shards >> 20)
        return fitting

    def _form_shard_groups(self) -> dict[str, ShardRole]:
        """With STEPWISE_SHARD N > 1: the workers in groups of N consecutive ones, each group's process group formed
        (before its members load their shards of the base models); each member's role in it. Raises on settings
        that cannot be served."""
        size, names = self.settings.shard, list(self.workers)
        if size <= 1:
            return {}
        if len(names) % size:
            raise RuntimeError(f"STEPWISE_SHARD={size} shards each base model over {size} workers, but there are "
                               f"{len(names)} (STEPWISE_WORKERS or STEPWISE_WORKER_DEVICES): give a multiple of {size}")
        if self.settings.replicas_per_run > 1:
            raise RuntimeError("STEPWISE_REPLICAS_PER_RUN > 1 with STEPWISE_SHARD > 1 (data-parallel runs over shard "
                               "groups) is not built yet: set one of them to 1")
        roles: dict[str, ShardRole] = {}
        for start in range(0, len(names), size):
            roles.update(self._form_shard_group(names[start:start + size]))
        return roles

    def _form_shard_group(self, names: list[str]) -> dict[str, ShardRole]:
        """One shard group over `names` (rank 0 first), its process group formed; each member's role."""
        for name in names:
            self.workers[name].group = list(names)
        self._join_group(SHARD, names, f"shard:{names[0]}#{uuid.uuid4().hex[:6]}")
        actors = [self.workers[name].actor for name in names]
        return {name: ShardRole(rank, list(names), actors[1:] if rank == 0 else []) for rank, name in enumerate(names)}

    def _serves(self, worker: Worker) -> bool:
        """Whether runs and samplers may be placed on a worker: live, and unsharded or its shard group's rank 0 with
        every member live (the others run what rank 0 sends them; a member that could not start or was lost leaves
        rank 0 nobody to meet in its collectives)."""
        if not worker.group:
            return worker.state == "live"
        return worker.group[0] == worker.name and all(self.workers[name].state == "live" for name in worker.group)

    def _rejoin_group(self, worker: Worker) -> None:
        """A shard group's member is back in a new process. Its group went with it (_lost took every member for lost,
        and the heartbeats had Ray restart those that still answered): once every member is back, the last one's
        thread forms the group again and starts its members together, each loading its shard anew. Its runs, waiting
        in _restore meanwhile, are then reloaded from their snapshots onto the new group and their journals replayed:
        recovery by resharding from the snapshot."""
        import ray

        with self._lock:
            members = [self.workers[name] for name in worker.group]
            if not all(m.rejoining for m in members) or worker.group[0] in self._forming:
                return  # (rejoining stays set: the heartbeats leave it to the thread that forms the group)
            self._forming.add(worker.group[0])
        try:
            roles = self._form_shard_group(worker.group)
            reports = ray.get([m.actor.start.remote(self.models, roles[m.name]) for m in members])
            for member, report in zip(members, reports):
                self._update(member, report, revive=True)
            log.info("shard group %s formed again: %s", worker.group, [m.state for m in members])
            self._event("group_reformed", worker.group[0], members=list(worker.group),
                        states=[m.state for m in members])
        except Exception as e:
            for member in members:
                self._lost(member, f"forming its shard group again failed: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._forming.discard(worker.group[0])
                for member in members:
                    member.rejoining = False

    def _start_own_head(self, ray, tries: int = 3) -> None:
        """A Ray head on loopback for this backend alone: address "local", so that neither RAY_ADDRESS nor a cluster
        `ray start` left on this machine is joined instead (STEPWISE_RAY_ADDRESS is the way to join one). Ray gives
        its raylet 30 s to register, which a loaded machine can miss: the half-started head is ended and started
        again."""
        import psutil  # (a dependency of Ray's)

        for attempt in range(1, tries + 1):
            try:
                ray.init(address="local", num_cpus=self.settings.ray_num_cpus or os.cpu_count(),
                         include_dashboard=False, object_store_memory=self.settings.ray_object_store_mb << 20,
                         namespace=NAMESPACE)
                return
            except Exception as e:
                if "timed out during startup" not in str(e) or attempt == tries:
                    raise
                log.warning("the Ray head did not start in time (%s); starting it again (%d of %d)", e, attempt + 1,
                            tries)
                ray.shutdown()
                for process in psutil.Process().children(recursive=True):  # this gateway's only children: Ray's
                    try:
                        process.kill()
                    except psutil.Error:
                        pass

    def _devices(self, ray) -> list[str]:
        if self.settings.worker_devices:
            return list(self.settings.worker_devices)
        count = self.settings.workers or max(1, int(ray.cluster_resources().get("GPU", 0)))
        gpu = ray.cluster_resources().get("GPU", 0) >= count
        return ["cuda" if gpu else "cpu"] * count

    def _cpu_budget(self, devices: list[str]) -> int:
        """What each CPU worker admits runs and batches against (STEPWISE_WORKER_MEMORY_MB): by default the
        MACHINE_SHARE of this machine's memory, split among them. The rest is the gateway's, Ray's and the
        system's: Ray's memory monitor kills workers once the machine is 95% full (RAY_memory_usage_threshold),
        and the workers refuse work before they reach their budgets."""
        if self.settings.worker_memory_mb:
            return self.settings.worker_memory_mb << 20
        cpu_workers = max(1, sum(1 for d in devices if not d.startswith("cuda")))
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MACHINE_SHARE) // cpu_workers

    def stop(self) -> None:
        import ray

        self._stopping.set()
        for worker in self.workers.values():
            try:
                ray.kill(worker.actor)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()
            _forget_head(self.settings.home)

    # ---- what the service asks ------------------------------------------------------------------------

    def facts(self) -> dict[str, dict]:
        """The base models live workers hold, and their facts (ops.model_facts)."""
        facts: dict[str, dict] = {}
        for worker in list(self.workers.values()):
            if worker.state == "live":
                facts.update(worker.report.get("models", {}))
        return facts

    def worker_of(self, lane: str) -> str | None:
        """Where a run (its first replica) or a sampler lives now."""
        with self._lock:
            run = self.runs.get(lane)
            return run.workers[0] if run and run.workers else self.lanes.get(lane)

    def adapter_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for worker in list(self.workers.values()):
            for model, ids in worker.report.get("adapters", {}).items():
                counts[model] = counts.get(model, 0) + len(ids)
        return counts

    def sampling_stats(self) -> dict[str, dict[str, dict]]:
        """Each worker's decoders as of its last heartbeat (Decoder.stats), by worker, then base model."""
        return {w.name: w.report.get("sampling", {}) for w in list(self.workers.values())}

    def adapter_cache_stats(self) -> dict[str, dict[str, dict]]:
        """Each worker's adapter caches as of its last heartbeat (AdapterCache.stats), by worker, then base model."""
        return {w.name: w.report.get("adapter_cache", {}) for w in list(self.workers.values())}

    def report(self) -> dict:
        """The operator's view (GET /api/v1/cluster): each worker's state, device, memory, runs and queue."""
        moment = time.monotonic()
        with self._lock:
            workers = [{
                "name": w.name, "actor": w.actor_name, "state": w.state, "error": w.error, "device": w.device,
                "node": w.report.get("node"), "node_id": w.report.get("node_id"), "pid": w.report.get("pid"),
                "restarts": w.restarts, "shard_group": w.group or None,
                "models": sorted(w.report.get("models", {})),
                "memory": w.report.get("memory"),
                "runs": sorted(r.id for r in self.runs.values() if w.name in r.workers),
                "samplers": sorted(lane for lane, name in self.lanes.items() if name == w.name),
                "adapters": sum(len(ids) for ids in w.report.get("adapters", {}).values()),
                "queue_depth": w.report.get("queue_depth", 0),
                "in_flight": len(w.parts),
                "last_heartbeat_s": round(moment - w.heartbeat_at, 1) if w.heartbeat_at else None,
            } for w in self.workers.values()]
            runs = {r.id: {"workers": list(r.workers), "snapshot_step": r.snapshot["step"] if r.snapshot else None,
                           "state": "gone" if r.gone else RESTORING if r.held_by == RESTORING else "live"}
                    for r in self.runs.values()}
        import ray

        return {"mode": "ray", "ray_address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE,
                "workers": workers, "runs": runs, "snapshot_every": self.settings.snapshot_every,
                "replicas_per_run": self.settings.replicas_per_run, "shard": self.settings.shard,
                "events": list(self.events)}

    def _event(self, event: str, worker: str, **facts) -> None:
        """Record one thing that happened to a worker or its runs (report()'s "events"). Lock held or not."""
        self.events.append({"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "event": event, "worker": worker, **facts})

    # ---- submitting ---------------------------------------------------------------------------------

    def submit(self, job: Job, ordered: bool) -> None:
        try:
            with self._lock:
                run = self._run_of(job)
                if run is not None and run.held is not None:  # a data-parallel backward pass is out, or a restore
                    run.replayed.pop(job.request_id, None)  # (the replay sending a lost request again)
                    run.held.append((job, ordered))
                    return
                parts = self._parts(job, run)
        except Exception as e:
            self._on_done(job, e)
            return
        self._send(job, ordered, parts, run)

    def _run_of(self, job: Job) -> Run | None:
        """The job's training run, registered (and placed) when the job makes it. Lock held."""
        run = self.runs.get(job.lane)
        op = job.op
        if run is None and isinstance(op, (CreateAdapter, LoadState)) and job.seq is None:  # the job makes the run
            run = self._new_run(job, op)
        if run is not None and run.gone:
            raise WorkerLost(run.gone)
        return run

    def _new_run(self, job: Job, origin: CreateAdapter | LoadState) -> Run:
        """`origin`: the job's op (a create_adapter always has a seed, training.create_model: replicas start alike)."""
        replicas = max(1, job.replicas or self.settings.replicas_per_run)
        if replicas > 1 and self.settings.shard > 1:
            raise UserError(f"this server shards its base models over {self.settings.shard} workers (STEPWISE_SHARD); "
                            "data-parallel replicas of a run over shard groups are not built yet: ask for 1 replica")
        estimate = self._estimate(job.base_model, origin)
        workers = self._place(job.base_model, replicas, estimate)
        if not workers:
            raise RuntimeError(f"no live engine worker for {job.base_model}; GET /api/v1/cluster shows why")
        self._admit_run(job, workers)
        # (A run rebuilt after a crash is made by the service's own LoadState job, which names the owner.)
        run = Run(job.lane, origin.owner, job.base_model, origin, workers, estimate)
        self.runs[run.id] = run
        for name in workers:
            self.workers[name].placed[run.id] = estimate
        if len(workers) > 1:
            self._form_group(run)
        return run

    def _estimate(self, base_model: str, origin: CreateAdapter | LoadState) -> int:
        facts = self.facts().get(base_model)
        if facts is None or not isinstance(origin, CreateAdapter):
            return UNKNOWN_ADAPTER_BYTES
        return engine_work.adapter_bytes(facts, origin.config) * TRAINING_COPIES

    def _admit_run(self, job: Job, workers: list[str]) -> None:
        """Refuse a new run whose state (weights, gradients, optimizer) could not fit on the workers it was placed on
        even with every other adapter spilled (their `adapter_room`), rather than let it grow a worker past its
        memory until the OS or Ray's memory monitor kills it. (The workers with the most room were chosen.) A run
        loaded from a checkpoint, whose size is not known here, is not checked. Lock held."""
        facts = self.facts().get(job.base_model)
        if not isinstance(job.op, CreateAdapter) or facts is None:
            return
        config = job.op.config
        need = engine_work.adapter_bytes(facts, config) * TRAINING_COPIES
        short = [name for name in workers if need > self.workers[name].report.get("memory", {}).get("adapter_room", need)]
        if not short:
            return
        memory = self.workers[short[0]].report["memory"]
        full = config.rank == 0
        what = ("a full fine-tuning run (rank 0: its own copy of every weight, with gradients and AdamW's two moments)"
                if full else f"a rank-{config.rank} LoRA run (its weights, gradients and AdamW's two moments)")
        gpu = self.workers[short[0]].device.startswith("cuda")
        budget = "its GPU" if gpu else "its STEPWISE_WORKER_MEMORY_MB budget"
        raise UserError(
            f"{what} needs about {need >> 20} MB on an engine worker; engine worker {short[0]} has room for "
            f"{memory['adapter_room'] >> 20} MB ({memory['total'] >> 20} MB, {budget}, less "
            f"{(memory['base_model_bytes'] + memory['other_bytes']) >> 20} MB for the base model and its caches): "
            + ("" if gpu else f"raise STEPWISE_WORKER_MEMORY_MB to at least "
                              f"{(memory['total'] + need - memory['adapter_room']) // 2**20 + 1} (and restart the "
                              "server), or ")
            + ("train a LoRA adapter instead (rank 1 or more)" if full else "use a smaller LoRA rank"))

    def _place(self, base_model: str, count: int, estimate: int, keep: Sequence[str] = ()) -> list[str]:
        """`keep` plus the live workers with the most free memory, up to `count`, preferring those holding the model."""
        live = [w for w in self.workers.values() if self._serves(w) and w.name not in keep]
        holding = [w for w in live if base_model in w.report.get("models", {})] or live
        ranked = sorted(holding, key=lambda w: (-w.free(), sum(w.name in r.workers for r in self.runs.values()), w.name))
        return list(keep) + [w.name for w in ranked[:max(0, count - len(keep))]]

    def _parts(self, job: Job, run: Run | None) -> list[_Part]:
        """Which workers do what of a job. Lock held."""
        if run is None:
            return [_Part(name, wire(job)) for name in self._lane_workers(job)]
        sent = wire(job)
        if isinstance(job.op, OptimStep):
            key = f"{run.tenant}/{run.id.replace(':', '_')}/snapshot"
            sent.op = dataclasses.replace(job.op, snapshot_key=key, snapshot_every=self.settings.snapshot_every)
        if len(run.workers) == 1:
            return [_Part(run.workers[0], sent)]
        if job.fb_pass is not None:
            return [_Part(name, shard) for name, shard in zip(run.workers, _shards(sent, len(run.workers)))]
        if isinstance(job.op, (CreateAdapter, LoadState, OptimStep)):  # done on every replica
            parts = [_Part(run.workers[0], sent)]
            if isinstance(sent.op, OptimStep):  # one replica snapshots
                sent = dataclasses.replace(sent, op=job.op)
            return parts + [_Part(name, dataclasses.replace(sent)) for name in run.workers[1:]]
        noop = dataclasses.replace(sent, op=Noop(), fb_pass=None, sample=None)
        return [_Part(run.workers[0], sent)] + [_Part(name, dataclasses.replace(noop)) for name in run.workers[1:]]

    def _lane_workers(self, job: Job) -> list[str]:
        """Where a job that is not a run's goes: a sampler's worker (where it is, where its snapshot was taken, or
        the least busy live one), or, to free an adapter, every worker holding it. Lock held."""
        if job.lane.startswith("free:"):
            adapter_id = job.lane[len("free:"):]
            run = self.runs.pop(adapter_id, None)
            if run is not None and run.snapshot:
                self.storage.delete(run.snapshot["location"])
            self.lost_lanes.pop(adapter_id, None)
            where = run.workers if run else [self.lanes.pop(adapter_id)] if adapter_id in self.lanes else []
            return [name for name in where if self.workers[name].state == "live"]
        name = self.lanes.get(job.lane)
        if name is None and job.lane in self.lost_lanes and job.sample is not None and job.sample.adapter_id \
                and job.sample.location is None:
            raise UserError(f"sampler {job.lane} sampled from an in-memory snapshot of engine worker "
                            f"{self.lost_lanes[job.lane]}, which stopped; its weights went with it: call "
                            "save_weights_and_get_sampling_client again")
        if name is None or not self._serves(self.workers[name]):
            live = [w for w in self.workers.values() if self._serves(w)]
            holding = [w for w in live if job.base_model in w.report.get("models", {})] or live
            if not holding:
                raise RuntimeError(f"no live engine worker for {job.base_model}; GET /api/v1/cluster shows why")
            busy = lambda w: (w.report.get("queue_depth", 0) + len(w.parts), w.name)  # noqa: E731
            name = self.lanes[job.lane] = min(holding, key=busy).name
        return [name]

    def _send(self, job: Job, ordered: bool, parts: list[_Part], run: Run | None) -> None:
        if not parts:  # freeing what no live worker holds
            self._on_done(job, {})
            return
        dispatch = _Dispatch(job, run, parts)
        with self._lock:
            if run is not None and self._holds(job, run):
                run.held, run.held_by = [], job.request_id  # the run's next calls wait until this one has answered
            for part in parts:
                part.dispatch = dispatch
                self.workers[part.worker].parts[id(part)] = part
        for part in parts:
            try:
                ref = self.workers[part.worker].actor.run.remote(part.wire, ordered)
            except Exception as e:  # the actor is gone, or the job does not pickle
                self._answered(part, e)
                continue
            ref.future().add_done_callback(lambda f, part=part: self._answered(part, _result_of(f)))

    def _holds(self, job: Job, run: Run) -> bool:
        """Whether the run's next calls wait here until `job` has answered. Lock held.

        A data-parallel backward pass: until every shard is in (a failed shard's gradients are put back first).
        A call to lanes that have run none of the run's sequenced calls (its making, then its first sequenced call;
        after a restore, the first call replayed): Ray does not keep an async actor's calls in the order they were
        sent, and such a lane has no seq_id yet to put them back in order by. A replayed forward_backward that
        overtook the load of the run's snapshot would fail with 'unknown adapter'; an optim_step that overtook the
        forward_backward before it would silently train on the wrong gradients."""
        if len(run.workers) > 1 and job.fb_pass is not None and not job.fb_pass.forward_only:
            return True
        if run.new_lanes:
            run.new_lanes = job.seq is None  # once a sequenced call is through, the lanes order the rest by seq_id
            return True
        return False

    def _answered(self, part: _Part, outcome) -> None:
        """A worker answered one part, or the call failed (`outcome` is Ray's error); when every part is in, the
        job is done."""
        worker, dispatch = self.workers[part.worker], part.dispatch
        assert dispatch is not None  # answered only once _send has sent it
        if _is_actor_error(outcome):
            cause = outcome.result if isinstance(outcome, Outcome) else outcome  # (a shard group's failed collective)
            self._lost(worker, f"{type(cause).__name__}: {cause}")
            outcome = WorkerLost(self._lost_message(dispatch.run, worker.name))
        elif isinstance(outcome, Exception) and not isinstance(outcome, WorkerLost):
            outcome = RuntimeError(f"engine worker {worker.name} could not run this request ({type(outcome).__name__}: "
                                   f"{outcome})")
        with self._lock:
            if part.done or dispatch.abandoned:
                part.done = True
                worker.parts.pop(id(part), None)
                return
            part.done, part.outcome = True, outcome
            worker.parts.pop(id(part), None)
            if not all(p.done for p in dispatch.parts):
                return
        self._complete(dispatch)

    def _complete(self, dispatch: _Dispatch) -> None:
        job, run, parts = dispatch.job, dispatch.run, dispatch.parts
        outcomes = [p.outcome for p in parts]
        errors = [o.result if isinstance(o, Outcome) else o for o in outcomes
                  if not isinstance(o, Outcome) or isinstance(o.result, Exception)]
        holder = run if run is not None and run.held_by == job.request_id else None  # the run this job holds
        if errors:
            lost = [e for e in errors if isinstance(e, WorkerLost)]
            result = lost[0] if lost else errors[0]
            if holder is not None and not lost and len(parts) > 1:  # put back the gradients of the shards that ran
                self._undo_shards(job, parts, holder)
        else:
            answers = [o for o in outcomes if isinstance(o, Outcome)]  # all of them: no part failed
            first = answers[0]
            job.usage, job.metrics, job.duration_s, job.step = first.usage, first.metrics, first.duration_s, first.step
            result = first.result
            if job.fb_pass is not None and len(parts) > 1:
                result = _merge_shards(job, parts, answers)
            self._observe(job, run, result)
        if holder is not None:
            self._release(holder)
        if job.on_token is not None and not isinstance(result, Exception):
            _replay_tokens(job.on_token, result)
        self._on_done(job, result)

    def _observe(self, job: Job, run: Run | None, result) -> None:
        """What the gateway learns from a job done: snapshots and their places, a run's new origin."""
        if run is None:
            return
        with self._lock:
            if isinstance(job.op, OptimStep) and result.get("snapshot"):
                run.snapshot = result["snapshot"]
            elif isinstance(job.op, Snapshot):
                self.lanes[job.op.sampler_id] = run.workers[0]
            elif isinstance(job.op, LoadState) and job.seq is not None:
                run.origin, run.snapshot = job.op, None  # its state is that checkpoint's now

    # ---- data parallel --------------------------------------------------------------------------------

    def _form_group(self, run: Run) -> None:
        """A process group over the run's workers, replica 0 its rank 0. Lock held; waits for every rank."""
        run.epoch += 1
        self._join_group(run.id, run.workers, f"{run.id}#{run.epoch}")

    def _join_group(self, group_id: str, names: list[str], key: str) -> None:
        """A process group over the workers `names`, the first its rank 0, which each keeps as `group_id` (a run's
        id, or SHARD); `key`: this generation's, unique. Waits for every rank."""
        import ray

        actors = [self.workers[name].actor for name in names]
        host, port = ray.get(actors[0].open_group.remote(group_id, len(actors)))
        ray.get([actor.join_group.remote(group_id, key, host, port, rank, len(actors))
                 for rank, actor in enumerate(actors)])

    def _undo_shards(self, job: Job, parts: list[_Part], run: Run) -> None:
        """A shard failed: the replicas whose shard ran put their gradients back before the run goes on."""
        import ray

        restore = RestoreGrads(job.request_id)
        refs = [self.workers[p.worker].actor.run.remote(
            Job(f"{job.request_id}:undo", run.id, run.base_model, seq=None, op=restore), True)
            for p in parts if isinstance(p.outcome, Outcome) and not isinstance(p.outcome.result, Exception)]
        try:
            ray.get(refs, timeout=self.settings.group_timeout_s)
        except Exception:
            log.exception("putting back the gradients of run %s failed", run.id)

    def _release(self, run: Run) -> None:
        with self._lock:
            held, run.held, run.held_by = run.held, None, None
        assert held is not None  # a release ends a hold (_send's or _lost's), which made the list
        # In seq_id order: a restore's replayed requests were held after newer ones that came meanwhile, and a
        # worker's lane runs the first it is sent when it has nothing to wait for.
        for job, ordered in sorted(held, key=lambda held_job: (held_job[0].seq is not None, held_job[0].seq or 0)):
            self.submit(job, ordered)

    # ---- heartbeats and recovery ------------------------------------------------------------------------

    def _beat_forever(self) -> None:
        while not self._stopping.wait(self.settings.heartbeat_s):
            try:
                self.heartbeat()
            except Exception:
                log.exception("cluster heartbeat failed; will try again")

    def heartbeat(self) -> None:
        """Ask every worker for its report; a worker that errs or misses MISSED_HEARTBEATS is lost, one that Ray
        restarted is lost and then started again (it rejoins)."""
        import ray

        workers = list(self.workers.values())
        refs = [w.actor.report.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.settings.heartbeat_s * 2)
        for worker, ref in zip(workers, refs):
            if ref not in ready:
                worker.missed += 1
                if worker.missed >= MISSED_HEARTBEATS and worker.state == "live":
                    self._lost(worker, f"missed {worker.missed} heartbeats")
                    ray.kill(worker.actor, no_restart=False)  # a hung process is replaced; it rejoins when it is back
                continue
            try:
                report = ray.get(ref)
            except Exception as e:  # it died; if Ray restarts it, a later report has a new incarnation
                if worker.state == "live":
                    self._lost(worker, f"{type(e).__name__}: {e}")
                continue
            worker.missed = 0
            if worker.incarnation is not None and report["incarnation"] != worker.incarnation:
                self._lost(worker, "its process restarted")
                worker.restarts += 1
                worker.incarnation, worker.state, worker.rejoining = report["incarnation"], "starting", True
                threading.Thread(target=self._rejoin, args=(worker,), daemon=True).start()
                continue
            if worker.rejoining:  # _rejoin takes its state from start's answer
                continue
            if worker.state == "dead":  # taken for dead, yet it answers: its runs moved; start it afresh
                ray.kill(worker.actor, no_restart=False)
            else:  # (a report asked for before a rejoin ended may say "starting": the next one says "live")
                self._update(worker, report)
                broken = (report.get("shard") or {}).get("broken")
                if broken and worker.state == "live":  # (its requests learn it too; this is for a group gone idle)
                    self._lost(worker, broken)

    def _rejoin(self, worker: Worker) -> None:
        import ray

        if worker.group:
            self._rejoin_group(worker)
            return
        try:
            self._update(worker, ray.get(worker.actor.start.remote(self.models)), revive=True)
            log.info("worker %s rejoined: %s", worker.name, worker.state)
            self._event("rejoined", worker.name, state=worker.state, restarts=worker.restarts)
        except Exception as e:
            self._lost(worker, f"{type(e).__name__}: {e}")
        finally:
            worker.rejoining = False

    def _update(self, worker: Worker, report: dict, revive: bool = False) -> None:
        """A worker's report. Its state follows the report, except that a dead worker stays dead until it has
        started again (`revive`: its models loaded in its new process)."""
        with self._lock:
            worker.report, worker.heartbeat_at = report, time.monotonic()
            worker.incarnation = report["incarnation"]
            if revive or worker.state != "dead":
                worker.state, worker.error = report["state"], report["error"]
            held = {adapter for ids in report.get("adapters", {}).values() for adapter in ids}
            worker.placed = {run: b for run, b in worker.placed.items() if run not in held}
            self._changed.notify_all()  # a run waiting for a live worker may have one now

    def _lost(self, worker: Worker, reason: str) -> None:
        """A worker stopped: its runs are restored elsewhere, its samplers move, its unanswered parts fail."""
        with self._lock:
            if worker.state == "dead":
                return
            log.warning("worker %s lost: %s", worker.name, reason)
            worker.state, worker.error = "dead", reason
            # (A run being restored already, here or elsewhere, is its restore's: it picks its workers anew.)
            runs = [r for r in self.runs.values() if worker.name in r.workers and r.held_by != RESTORING]
            self._event("lost", worker.name, reason=reason, runs=sorted(r.id for r in runs),
                        in_flight=len(worker.parts))
            for run in runs:  # their next calls wait for the restore (those in flight fail: they were lost)
                run.held, run.held_by = run.held or [], RESTORING
            for lane in [lane for lane, name in self.lanes.items() if name == worker.name]:
                self.lost_lanes[lane] = self.lanes.pop(lane)
            unanswered = list(worker.parts.values())
            # A request of a run that is being restored waits for the journal's replay, which answers it.
            for part in unanswered:
                dispatch = part.dispatch
                assert dispatch is not None  # a worker's parts are listed by _send, which set it
                if self._replay is not None and dispatch.run in runs and dispatch.job.request is not None:
                    dispatch.abandoned = True
                    dispatch.run.replayed[dispatch.job.request_id] = dispatch.job
        for run in runs:
            threading.Thread(target=self._restore, args=(run, worker.name), daemon=True).start()
        for part in unanswered:  # a hung worker never answers them (a dead one's errors come too: ignored)
            assert part.dispatch is not None  # (as above)
            self._answered(part, WorkerLost(self._lost_message(part.dispatch.run, worker.name)))
        for name in worker.group:  # a shard group's engines cannot go on without any of its members
            self._lost(self.workers[name], f"its shard group member {worker.name} was lost ({reason})")

    def _lost_message(self, run: Run | None, worker: str) -> str:
        if run is None:
            return (f"engine worker {worker} stopped before it answered this request; send it again (its sampler "
                    "moves to a live worker; an in-memory snapshot was lost with it: call "
                    "save_weights_and_get_sampling_client again)")
        step = run.snapshot["step"] if run.snapshot else 0
        where = f"its automatic snapshot at step {step}" if run.snapshot else "how it was created (step 0)"
        return (f"engine worker {worker} stopped; training run {run.id} is restored on a live worker from {where}, "
                f"and its requests after that are lost. Resume from step {step}: redo the forward_backward and "
                f"optim_step calls after optim step {step} (snapshots are taken every {self.settings.snapshot_every} "
                "optim steps, STEPWISE_SNAPSHOT_EVERY)")

    def _restore(self, run: Run, dead: str) -> None:
        """Reload a run whose worker died: its snapshot (or its origin) on live workers, then its journal since; its
        requests wait meanwhile. With no live worker (all were lost) it waits for one, such as a worker Ray restarts
        once it has rejoined, up to STEPWISE_WORKER_WAIT_S; past that, or when the restore itself fails three times,
        the run is gone, and every request of it that waits fails saying why."""
        deadline = time.monotonic() + self.settings.worker_wait_s
        why = self.workers[dead].error  # (a shard group's rank 0 is lost for its member's reason: it names it)
        lost, failures, gone = {dead}, 0, None
        while True:
            with self._lock:  # (a rejoined worker lost the run's state: it is a new place, not a survivor)
                survivors = [name for name in run.workers if name not in lost and self.workers[name].state == "live"]
                workers = self._place(run.base_model, len(run.workers), run.estimate, keep=survivors)
                if not workers:
                    if time.monotonic() >= deadline:
                        gone = (f"training run {run.id} was lost with engine worker {dead} ({why}), and no engine worker was "
                                f"live to take it within {self.settings.worker_wait_s:g} s (STEPWISE_WORKER_WAIT_S; GET "
                                "/api/v1/cluster shows the workers); create a new run from a checkpoint: "
                                "create_training_client_from_state_with_optimizer")
                        break
                    self._changed.wait(deadline - time.monotonic())
                    continue
            try:
                self._load_run(run, survivors, workers)
            except Exception as e:
                log.warning("restoring run %s on %s failed (%s); trying again", run.id, workers, e)
                fallen = {name for name in workers if self.workers[name].state != "live"}
                lost |= fallen
                failures += not fallen  # a worker lost meanwhile is no failure of the restore: try elsewhere
                if failures == 3:
                    gone = (f"training run {run.id} was lost with engine worker {dead} ({why}) and could not be restored "
                            f"({type(e).__name__}: {e}); create a new run from a checkpoint: "
                            "create_training_client_from_state_with_optimizer")
                    break
                continue
            step = run.snapshot["step"] if run.snapshot else 0
            log.info("run %s restored on %s at step %s", run.id, workers, step)
            replayed: int | str | None = None
            if self._replay is not None:  # then the requests since, which wait in run.held behind the restore
                try:
                    replayed = self._replay(run.id, run.snapshot["location"] if run.snapshot else None)
                    log.info("run %s: %d journaled requests run again", run.id, replayed)
                except Exception as e:
                    log.exception("replaying the journal of run %s failed", run.id)
                    replayed = f"failed: {type(e).__name__}: {e}"
            self._event("restored", dead, run=run.id, onto=workers, from_step=step, replayed=replayed)
            break
        with self._lock:
            run.gone = gone
            unanswered, run.replayed = list(run.replayed.values()), {}
        if gone:
            log.warning("%s", gone)
            self._event("run_gone", dead, run=run.id, reason=gone)
        self._release(run)
        for job in unanswered:  # lost in flight and not sent again by the replay (or no replay came)
            self._on_done(job, WorkerLost(gone or self._lost_message(run, dead)))

    def _load_run(self, run: Run, survivors: list[str], workers: list[str]) -> None:
        """A restore's work: the survivors' stale state dropped, the run loaded on `workers` (survivors first)."""
        for name in survivors:  # their queued requests and adapter were the old state's
            self._ask(name, self.workers[name].actor.reset_run.remote(run.id, run.base_model))
        if len(workers) > 1:
            run.workers = workers
            self._form_group(run)
        op = run.origin if run.snapshot is None else LoadState(
            run.id, run.snapshot["location"], f"the automatic snapshot of {run.id} at step {run.snapshot['step']}",
            with_optimizer=True)
        refs = {name: self.workers[name].actor.run.remote(Job(uuid.uuid4().hex, run.id, run.base_model, seq=None, op=op),
                                                          True) for name in workers}
        for name, ref in refs.items():
            answer = self._ask(name, ref)
            if isinstance(answer.result, Exception):
                raise answer.result
        with self._lock:
            run.workers, run.new_lanes = workers, True  # (a survivor's lane was reset: reset_run)
            for name in workers:
                self.workers[name].placed[run.id] = run.estimate

    def _ask(self, name: str, ref):
        """A worker's answer to the gateway's own call; a worker that died meanwhile is lost there and then, so
        that nothing is placed on it until it has rejoined."""
        import ray

        try:
            return ray.get(ref)
        except Exception as e:
            if _is_actor_error(e):
                self._lost(self.workers[name], f"{type(e).__name__}: {e}")
            raise


# ---- the gateway's own Ray head, across a crash of the gateway ---------------------------------------------
#
# The Ray head a gateway starts (gcs_server, raylet, and the engine workers under it) dies with the gateway, even
# killed with SIGKILL: Ray ties them to it. Ray's agents (DashboardAgent, RuntimeEnvAgent) notice their raylet gone
# within seconds, but then try to tell the dead head why before they exit, a minute or more. A gateway started
# again at once would run beside them, so it ends them first: it finds them in the file its predecessor wrote.

HEAD_FILE = "ray-head.json"  # in $STEPWISE_HOME/runtime: {"gateway": pid, "processes": [{"pid", "started"}]}


def _head_file(home):
    from kernel_backend import runtime

    return runtime.runtime_dir(home) / HEAD_FILE


def _record_head(home) -> None:
    """Write down the processes of the Ray head this gateway started (its descendants, the workers among them)."""
    import psutil  # (a dependency of Ray's)

    from kernel_backend import runtime

    processes = [{"pid": p.pid, "started": p.create_time()} for p in psutil.Process().children(recursive=True)]
    runtime.write_private_json(_head_file(home), {"gateway": os.getpid(), "processes": processes})


def _end_previous_head(home) -> None:
    """Kill what is left of the Ray head of this home's previous gateway, if that gateway died without stopping it.
    A process is only killed if it is the very one recorded (its pid and start time), never a pid reused since."""
    import json

    import psutil

    from kernel_backend import runtime

    try:
        record = json.loads(_head_file(home).read_text())
    except (OSError, ValueError):
        return
    if runtime.pid_alive(int(record.get("gateway") or 0)):
        return  # its gateway runs (or its pid was reused): not ours to end
    ended = []
    for entry in record.get("processes", []):
        try:
            process = psutil.Process(entry["pid"])
            if process.create_time() == entry["started"]:
                process.kill()
                ended.append(f"{process.pid} {process.name()}")
        except (psutil.Error, KeyError, TypeError):
            continue  # gone already
    if ended:
        log.warning("ended %d processes of the Ray head of a gateway that died (pid %s): %s", len(ended),
                    record.get("gateway"), ", ".join(ended))
    _forget_head(home)


def _forget_head(home) -> None:
    try:
        _head_file(home).unlink()
    except OSError:
        pass


# ---- helpers --------------------------------------------------------------------------------------------


def auto_shard(need: int, budget: int, workers: int) -> int:
    """How many workers a base model of `need` bytes is sharded over when the operator did not say (STEPWISE_SHARD
    1): 1 if it fits AUTO_SHARD_SHARE of a worker's `budget`, else the fewest workers, a divisor of `workers` (the
    groups must split them evenly), over which its shards do. Raises, naming the settings, if none does."""
    room = budget * AUTO_SHARD_SHARE
    for size in range(1, workers + 1):
        if workers % size == 0 and need / size <= room:
            return size
    raise RuntimeError(f"the base model's weights ({need >> 20} MiB) do not fit {AUTO_SHARD_SHARE:.0%} of a worker's "
                       f"memory budget ({budget >> 20} MiB) even sharded over all {workers} workers: raise "
                       "STEPWISE_WORKER_MEMORY_MB or add workers (STEPWISE_WORKERS)")


def fitting_micro_batch(room: int, per_token: int) -> int:
    """The largest micro-batch, in tokens, whose activations of `per_token` bytes a token fit `room` bytes: a multiple
    of 16, and 16 at the least (a longer row is a micro-batch of its own whatever this is)."""
    return max(16, room // max(1, per_token) // 16 * 16)


def _spread(device: str, index: int, nodes: list[str]):
    """Where worker `index` runs: CPU workers round the cluster's nodes (a node lost costs fewer workers, and each
    has more of a node's cores), GPU workers where Ray finds a free GPU. Pinned to the node: Ray's SPREAD, and a
    soft affinity (Ray 2.60), leave actors that ask for no CPU on the head. A worker whose node is gone is lost for
    good, its runs restored on the others' (Cluster._restore)."""
    if device.startswith("cuda") or len(nodes) < 2:
        return "DEFAULT"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=nodes[index % len(nodes)], soft=False)


def shard_bounds(lengths: list[int], count: int) -> list[int]:
    """Where to cut a batch of datums of these token lengths into `count` contiguous shards of about equal
    tokens: `count + 1` indices, the first 0 and the last len(lengths) (a shard may be empty)."""
    total, bounds, acc = sum(lengths), [0], 0
    for i, length in enumerate(lengths):
        acc += length
        if len(bounds) < count and acc >= total * len(bounds) / count and i + 1 < len(lengths):
            bounds.append(i + 1)
    return bounds + [len(lengths)] * (count + 1 - len(bounds))


def _shards(job: Job, count: int) -> list[Job]:
    """A forward(_backward) job split into `count` shards (a replica whose shard is empty gets a no-op, keeping
    its seq_id order whole)."""
    fb_pass = job.fb_pass
    assert fb_pass is not None  # _parts shards forward(_backward) jobs only
    data = fb_pass.data
    bounds = shard_bounds([len(d.tokens) for d in data], count)
    shards = []
    for start, end in zip(bounds, bounds[1:]):
        piece = data[start:end]
        if piece:
            shards.append(dataclasses.replace(job, fb_pass=dataclasses.replace(fb_pass, data=piece),
                                              tokens=sum(len(d.tokens) for d in piece)))
        else:
            shards.append(dataclasses.replace(job, fb_pass=None, op=Noop(), tokens=0))
    return shards


def _merge_shards(job: Job, parts: list[_Part], outcomes: list[Outcome]) -> ForwardResult:
    """The shards' results as one: outputs in datum order, metrics combined (sums add, means by tokens)."""
    results = [(p, o) for p, o in zip(parts, outcomes) if p.wire.fb_pass is not None]
    passes: list[ForwardResult] = []  # theirs, in order
    computed = 0  # the tokens the model ran, summed
    for _, o in results:
        # A pass's answer (none failed: _complete), whose computed tokens Engine.run_passes counts.
        assert isinstance(o.result, ForwardResult) and o.result.computed_tokens is not None
        passes.append(o.result)
        computed += o.result.computed_tokens
    job.duration_s = max(o.duration_s for _, o in results)
    job.usage = Usage(**{kind: sum(getattr(o.usage, kind) for _, o in results)
                         for kind in ("prefill_tokens", "sample_tokens", "train_tokens")})
    outputs = [out for result in passes for out in result.loss_fn_outputs]
    metrics = merge_metrics([(result.metrics, p.wire.tokens) for (p, _), result in zip(results, passes)])
    job.metrics = {**metrics, COMPUTED: computed}
    return ForwardResult(loss_fn_outputs=outputs, metrics=metrics, computed_tokens=computed)


def _replay_tokens(on_token: Callable, result) -> None:
    """A streaming request's tokens (`on_token`: its job's), all at once: a worker's decoder cannot call back into this
    process."""
    for row, sequence in enumerate(result.sequences):
        for token, logprob in zip(sequence.tokens, sequence.logprobs):
            on_token(row, token, logprob)


def _result_of(future):
    try:
        return future.result()
    except Exception as e:
        return e


def _is_actor_error(outcome) -> bool:
    """Ray's errors for a worker that died or restarted, a restarted worker's refusal, and a shard group's rank 0
    answering that a collective failed (not an error of the request: the group lost a member)."""
    if isinstance(outcome, WorkerRestarted) or isinstance(getattr(outcome, "cause", None), WorkerRestarted):
        return True
    if isinstance(outcome, Outcome) and isinstance(outcome.result, ShardGroupLost):
        return True
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:
        return False
    return isinstance(outcome, (ActorDiedError, ActorUnavailableError, RayActorError))
