"""The vLLM sampler (STEPWISE_SAMPLER=vllm): sample requests served by vLLM instead of the engine.

Three pieces, from the bottom up:
- `WorkerProcess`: one vLLM worker (kernel_backend/vllm_worker.py) running in the vLLM venv
  (kernel_backend/vllm_venv.py), and the pipe to it: JSON lines, replies matched to requests by id,
  so any number of requests are in flight at once and vLLM batches them.
- `VllmSampler`: one base model's worker plus the LoRA adapters registered with it. An adapter
  version is a folder of PEFT files (what save_weights_for_sampler writes); the service names it by
  its ids (a sampler id, a checkpoint path, an OpenAI lane), and the sampler keys it by its content,
  so the same weights load once under a versioned name (`<first id>@<sha256 prefix>`). Snapshots
  (save_weights_and_get_sampling_client) stay until the service removes them; checkpoint versions
  are kept for the latest STEPWISE_VLLM_MAX_ADAPTERS used, and the one used longest ago is unloaded.
- `VllmSampling`: what the service calls. Sample jobs (Sample, Completion, ChatCompletion) come here
  instead of the scheduler thread; each runs its usual function on a pool thread against an
  `_EngineView`, which answers the engine calls a sample job makes (has_adapter, load_sampler,
  sample) with vLLM, after the engine's own validation. So admission, metering, idempotency, tenancy
  and error categories are the service's, unchanged; only the sampling moved.

CPU and GPU are one code path: `engine_args` is the only place they differ.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernel_backend import engine as engine_module, models, vllm_venv
from kernel_backend.config import Settings
from kernel_backend.scheduler import Job, error_payload
from kernel_backend.types import SampledSequence, SampleResult, SamplingParams, UserError

log = logging.getLogger("stepwise.vllm")

WORKER = Path(__file__).with_name("vllm_worker.py")
# The request types that sample, and so go to vLLM when it is the sampler.
SAMPLE_REQUESTS = ("Sample", "Completion", "ChatCompletion")
# LoRA ranks vLLM accepts for max_lora_rank.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_args(settings: Settings, model_dir: Path, max_context: int) -> dict:
    """vLLM's engine arguments: the same model, dtype and context as the trainer's; CPU and GPU differ only here."""
    args = dict(
        model=str(model_dir), dtype=settings.dtype, max_model_len=max_context, seed=0,
        enable_lora=True, max_lora_rank=settings.vllm_max_lora_rank, max_loras=4, max_cpu_loras=8,
        # The sampled token's logprob from the raw logits, before temperature, top-k and top-p: Tinker's meaning.
        logprobs_mode="raw_logprobs", max_logprobs=20,
    )
    if vllm_venv.flavor(settings) == "cpu":
        args.update(enforce_eager=True)  # no graph capture or compilation on CPU (minutes on 2 cores)
    else:
        args.update(gpu_memory_utilization=settings.vllm_gpu_memory_fraction)  # the trainer shares the GPU
    return args


class WorkerError(RuntimeError):
    pass


class WorkerProcess:
    """A vLLM worker process and the pipe to it (see kernel_backend/vllm_worker.py for the messages)."""

    def __init__(self, python: Path, args: dict, env: dict, log_path: Path) -> None:
        self.python, self.args, self.env, self.log_path = python, args, env, log_path
        self.process: subprocess.Popen | None = None
        self._pending: dict[int, tuple[concurrent.futures.Future, object]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._ready = concurrent.futures.Future()

    def start(self, timeout_s: float) -> dict:
        """Start the worker and wait until its engine is up; returns its ready message."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(
                # -P: the worker's folder stays off sys.path (kernel_backend/types.py would shadow the stdlib's).
                [str(self.python), "-P", str(WORKER), json.dumps(self.args)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log_file, env=self.env, start_new_session=True,
            )
        threading.Thread(target=self._read, name="stepwise-vllm-reader", daemon=True).start()
        try:
            return self._ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise WorkerError(f"the vLLM worker did not start within {timeout_s:.0f} s; its log: {self.log_path}") from None

    def call(self, op: str, on_tokens=None, **fields) -> concurrent.futures.Future:
        """Send one request; the future gets its result (or WorkerError / UserError).
        `on_tokens(list of [row, token, logprob])` sees streamed tokens as they come."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.process is None or self.process.poll() is not None:
                raise WorkerError(f"the vLLM worker is not running; its log: {self.log_path}")
            self._next_id += 1
            self._pending[self._next_id] = (future, on_tokens)
            self.process.stdin.write((json.dumps({"id": self._next_id, "op": op, **fields}) + "\n").encode())
            self.process.stdin.flush()
        return future

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self._ready.set_result(message)
                continue
            with self._lock:
                future, on_tokens = self._pending[message["id"]]
                if "tokens" not in message:
                    del self._pending[message["id"]]
            if "tokens" in message:
                if on_tokens is not None:
                    on_tokens(message["tokens"])
            elif message["ok"]:
                future.set_result(message["result"])
            else:
                future.set_exception((UserError if message["user"] else WorkerError)(message["error"]))
        # The pipe closed: the worker exited. Whatever waits on it fails, with the end of its log.
        last_lines = self.log_path.read_text(errors="replace").splitlines()[-12:]
        error = WorkerError(f"the vLLM worker exited (code {self.process.wait()}); the end of its log "
                            f"({self.log_path}):\n" + "\n".join(last_lines))
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.set_exception(error)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.process.stdin.close()  # the worker shuts its engine down and exits
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, 9)  # its engine process too (same session)
            self.process.wait()


@dataclass
class _Version:
    """One adapter version loaded in the worker."""

    name: str  # the worker's name for it: "<first id>@<digest>"
    digest: str  # a prefix of the SHA-256 of its weights file
    folder: Path  # our copy of its PEFT files (the worker reads them from here)
    pinned: bool  # a snapshot: kept until removed; else a checkpoint version, unloaded when least recently used
    ids: set[str] = field(default_factory=set)  # the service's ids that name it


class VllmSampler:
    """One base model's vLLM worker and the adapter versions registered with it. Thread-safe."""

    def __init__(self, settings: Settings, base_model: str, max_context: int) -> None:
        self.settings = settings
        self.base_model = base_model
        slug = base_model.replace("/", "--")
        self.adapters_dir = settings.home / "vllm" / slug / "adapters"
        model_dir = models.resolve(base_model, settings.models_dir, settings.base_models)[1]
        python = vllm_venv.python(settings)
        if python is None:
            raise RuntimeError(f"STEPWISE_SAMPLER=vllm needs the vLLM venv, which is not built on this machine: "
                               f"{vllm_venv.BUILD_COMMAND}")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_kv_cache_gb)}
        self.worker = WorkerProcess(python, engine_args(settings, model_dir, max_context), env,
                                    settings.home / "vllm" / slug / "worker.log")
        self.startup_s: float | None = None
        self._versions: collections.OrderedDict[str, _Version] = collections.OrderedDict()  # least recently used first
        self._ids: dict[str, _Version] = {}
        self._lock = threading.Lock()
        self._folders = itertools.count()

    def start(self) -> None:
        shutil.rmtree(self.adapters_dir, ignore_errors=True)  # copies left by an earlier process
        self.adapters_dir.mkdir(parents=True)
        start = time.monotonic()
        self.worker.start(self.settings.vllm_startup_timeout_s)
        self.startup_s = time.monotonic() - start
        log.info("vLLM worker for %s ready in %.0f s", self.base_model, self.startup_s)

    def stop(self) -> None:
        self.worker.stop()

    # ---- adapters ---------------------------------------------------------------------------------

    def has_adapter(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._ids

    def add_adapter(self, adapter_id: str, folder: Path, pinned: bool = False) -> str:
        """Register the PEFT folder under `adapter_id` (copied, so the caller may delete it); its version name."""
        folder = Path(folder)
        rank = json.loads((folder / "adapter_config.json").read_text())["r"]
        if rank > self.settings.vllm_max_lora_rank:
            raise UserError(f"this adapter has LoRA rank {rank}, above the vLLM sampler's limit of "
                            f"{self.settings.vllm_max_lora_rank} (STEPWISE_VLLM_MAX_LORA_RANK, one of {VLLM_LORA_RANKS})")
        digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
        with self._lock:
            version = next((v for v in self._versions.values() if v.digest == digest), None)
            if version is None:
                copy = self.adapters_dir / f"{next(self._folders)}-{digest}"
                shutil.copytree(folder, copy)
                version = _Version(f"{adapter_id}@{digest}", digest, copy, pinned)
                self._versions[version.name] = version
                load = True
            else:
                version.pinned |= pinned
                load = False
            self._forget(adapter_id)
            version.ids.add(adapter_id)
            self._ids[adapter_id] = version
            self._versions.move_to_end(version.name)
            evicted = self._evict()
        for old in evicted:
            self._unload(old)
        if load:
            try:
                self.worker.call("add_adapter", name=version.name, path=str(version.folder)).result()
            except Exception:
                with self._lock:
                    self._drop(version)
                shutil.rmtree(version.folder, ignore_errors=True)
                raise
        return version.name

    def remove_adapter(self, adapter_id: str) -> None:
        """The service is done with `adapter_id`; a snapshot no other id names is unloaded."""
        with self._lock:
            version = self._forget(adapter_id)
            gone = version is not None and version.pinned and not version.ids
            if gone:
                self._drop(version)
        if gone:
            self._unload(version)

    def _forget(self, adapter_id: str) -> _Version | None:
        version = self._ids.pop(adapter_id, None)
        if version is not None:
            version.ids.discard(adapter_id)
        return version

    def _drop(self, version: _Version) -> None:
        self._versions.pop(version.name, None)
        for adapter_id in version.ids:
            self._ids.pop(adapter_id, None)

    def _evict(self) -> list[_Version]:
        """Checkpoint versions beyond the latest STEPWISE_VLLM_MAX_ADAPTERS used, oldest first. Lock held."""
        unpinned = [v for v in self._versions.values() if not v.pinned]
        evicted = unpinned[: max(0, len(unpinned) - self.settings.vllm_max_adapters)]
        for version in evicted:
            self._drop(version)
        return evicted

    def _unload(self, version: _Version) -> None:
        try:
            self.worker.call("remove_adapter", name=version.name).result()
        finally:
            shutil.rmtree(version.folder, ignore_errors=True)

    def loaded_versions(self) -> list[str]:
        with self._lock:
            return list(self._versions)

    # ---- sampling ---------------------------------------------------------------------------------

    def sample(self, adapter_id: str | None, prompt: list[int], num_samples: int, params: SamplingParams,
               stop_token_ids: set[int], stop_strings: list[str], prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0, on_token=None) -> SampleResult:
        """Sample on the worker; arguments as Engine.sample's, already validated (stop resolved to ids and strings)."""
        name = None
        if adapter_id is not None:
            with self._lock:
                version = self._ids.get(adapter_id)
                if version is None:
                    raise UserError(f"adapter {adapter_id!r} is not loaded in the vLLM sampler")
                self._versions.move_to_end(version.name)
                name = version.name
        on_tokens = (lambda tokens: [on_token(*t) for t in tokens]) if on_token is not None else None
        reply = self.worker.call(
            "sample", on_tokens=on_tokens, adapter=name, prompt=list(prompt), n=num_samples,
            max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=params.seed, stop_token_ids=sorted(stop_token_ids), stop_strings=list(stop_strings),
            prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs, stream=on_token is not None,
        ).result()
        pairs = lambda rows: [[(int(t), float(lp)) for t, lp in row] for row in rows]  # noqa: E731
        return SampleResult(
            sequences=[
                SampledSequence(tokens=s["tokens"], logprobs=s["logprobs"], stop_reason=s["stop_reason"],
                                top_logprobs=pairs(s["top_logprobs"]) if s["top_logprobs"] is not None else None)
                for s in reply["sequences"]
            ],
            prompt_logprobs=reply.get("prompt_logprobs"),
            topk_prompt_logprobs=[None] + pairs(reply["topk_prompt_logprobs"][1:]) if "topk_prompt_logprobs" in reply else None,
        )
