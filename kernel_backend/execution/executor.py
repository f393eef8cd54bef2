"""Where the service's jobs run: one interface, two executors. The service holds one and never asks which.

- `InProcess`, the embedded default: this process's engines (one per base model), run by one scheduler thread
  (execution/scheduler.py); with STEPWISE_SAMPLER=vllm, sample requests go to vLLM workers instead (execution/vllm_sampler.py). Runs a
  crash cut off come back from their snapshots and journals, replayed (service/recovery.py) after the engines load
  and before the thread takes any job.
  The sampler it runs sits on the Context it shares with the service (engine_work.Context.sampler): what the
  service asks of a sampler (the options it refuses, its stats) is asked there, of whichever it is; `submit` is
  the one place that tells them apart, sending sample requests to vLLM's workers or to the scheduler.
- `cluster.Cluster` (STEPWISE_WORKERS or STEPWISE_RAY_ADDRESS): the engines in Ray workers; the gateway restores a
  lost worker's runs from the snapshots it keeps. Its workers sample with their engines' decoders, so the service's
  Context keeps its default sampler (engine_work.BuiltinSampler).

Both take `on_done(job, outcome)` (the op's result, or the exception it raised) and a `replay` hook at construction.
"""

from __future__ import annotations

from typing import Callable, Protocol

from kernel_backend.engine.core import Engine
from kernel_backend.execution.engine_work import FreeAdapters
from kernel_backend.execution.scheduler import Job, Scheduler
from kernel_backend.execution.vllm_sampler import VllmSampling

class Executor(Protocol):
    # True: it decides when a run snapshots and restores the runs a lost worker held by itself (the cluster); False:
    # the service asks for each run's snapshot on its optim_steps. Either way the service replays the runs a crash
    # of this process cut off (service/recovery.py).
    restores_runs: bool

    def start(self, base_models: list[str]) -> None:
        """Load the base models, then take jobs."""

    def stop(self) -> None: ...

    def submit(self, job: Job, ordered: bool) -> None:
        """Queue a job; `ordered`: its lane's jobs run in their sequence numbers' order."""

    def facts(self) -> dict[str, dict]:
        """The loaded base models' facts (ops.model_facts): context length, LoRA bytes per rank."""

    def adapter_counts(self) -> dict[str, int]:
        """Adapters held per base model, on every engine."""

    def adapter_cache_stats(self) -> dict[str, dict[str, dict]]:
        """Each engine's adapter cache (AdapterCache.stats), by worker, then base model."""

    def sampling_stats(self) -> dict[str, dict[str, dict]]:
        """Each engine's decoder (Decoder.stats), by worker, then base model."""

    def worker_of(self, lane: str) -> str | None:
        """The engine worker a run or sampler lives on (None in process)."""

    def report(self) -> dict:
        """The operator's view of where the engines run (GET /api/v1/cluster)."""


class InProcess:
    """This process's engines on one scheduler thread (the module docstring)."""

    restores_runs = False

    def __init__(self, settings, ctx, on_done, replay: Callable[[], None]) -> None:
        """`replay()`: run again what a crash cut off, before any new job (service/recovery.py)."""
        self.settings, self._replay = settings, replay
        self.scheduler = Scheduler(load_engine=lambda name: Engine(name, settings), on_done=on_done,
                                   max_batch_tokens=settings.max_batch_tokens, ctx=ctx)
        if settings.sampler == "vllm":  # the VllmSampling that answers sample requests, on the ctx the work reaches
            ctx.sampler = VllmSampling(settings, self.scheduler, on_done)
        self.sampler = ctx.sampler  # else the engines' own decoders (engine_work.BuiltinSampler)

    @property
    def engines(self) -> dict[str, Engine]:
        return self.scheduler.engines

    def start(self, base_models: list[str]) -> None:
        for name in base_models:
            self.scheduler.engine(name)
        self._replay()
        self.scheduler.start()
        self.sampler.start(list(self.engines))

    def stop(self) -> None:
        self.scheduler.stop()
        self.sampler.stop()

    def submit(self, job: Job, ordered: bool) -> None:
        if isinstance(self.sampler, VllmSampling) and job.sample is not None:
            self.sampler.submit(job)
        elif isinstance(job.op, FreeAdapters) and job.base_model not in self.engines:
            return  # a model never loaded holds no adapter (and is not loaded to free none)
        else:
            self.scheduler.submit(job, ordered=ordered)

    def facts(self) -> dict[str, dict]:
        return self.scheduler.facts()

    def adapter_counts(self) -> dict[str, int]:
        return {name: len(engine.adapters.entries) for name, engine in self.engines.items()}

    def adapter_cache_stats(self) -> dict[str, dict[str, dict]]:
        return {"in-process": {name: engine.adapters.stats() for name, engine in self.engines.items()}}

    def sampling_stats(self) -> dict[str, dict[str, dict]]:
        return {"in-process": {name: engine.decoder.stats() for name, engine in self.engines.items()}}

    def worker_of(self, lane: str) -> str | None:
        return None

    def report(self) -> dict:
        return {"mode": "in-process", "workers": [{
            "name": "in-process", "state": "live", "device": self.settings.device, "models": sorted(self.engines),
            "adapters": sum(self.adapter_counts().values()), "queue_depth": self.scheduler.queue_depth(),
            "memory": {name: engine.memory() for name, engine in self.engines.items()}}], "runs": {}}
