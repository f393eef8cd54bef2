"""The vLLM sampler (STEPWISE_SAMPLER=vllm): sample requests served by vLLM instead of the engine.

Three pieces, from the bottom up:
- `WorkerProcess`: one vLLM worker (kernel_backend/vllm/worker.py) running in the vLLM venv
  (kernel_backend/vllm/venv.py), and the pipe to it: JSON lines, replies matched to requests by id,
  so any number of requests are in flight at once and vLLM batches them.
- `VllmSampler`: one base model's worker plus the LoRA adapters registered with it. An adapter
  version is a folder of PEFT files (what save_weights_for_sampler writes); the service names it by
  its ids (a sampler id, a checkpoint path, an OpenAI lane), and the sampler keys it by its content,
  so the same weights load once under a versioned name (`<first id>@<sha256 prefix>#<load number>`). Snapshots
  (save_weights_and_get_sampling_client) stay until the service removes them; of the other versions
  the latest STEPWISE_VLLM_MAX_ADAPTERS used are kept, and the one used longest ago is unloaded.
- `VllmSampling`: the sampler the in-process executor puts on the Context (engine_work.Context.sampler, in the
  built-in sampler's place, with its methods): the options it refuses at admission, its stats, the adapters the
  engine-side work tells it of. Sample jobs (Sample, Completion, ChatCompletion) come here instead of the
  scheduler thread (InProcess.submit); each runs its usual function (engine_work.sample_request) on a pool
  thread against an `_EngineView`, which answers the engine calls a sample job makes (has_adapter, load_sampler,
  sample) with vLLM, after the engine's own validation. So admission, metering, idempotency, tenancy
  and error categories are the service's, unchanged; only the sampling moved.

Of the sampling options, vLLM serves prompt logprobs and top-k logprobs (prompt and sampled), and
prompt_logprobs_last_n (its prompt logprobs, with the entries before the last n dropped here).
target_prompt_logprobs and prompt_alt_tokens_k have no vLLM counterpart (vLLM's prompt logprobs name
the top k ids, not given ones, and it draws no tokens at prompt positions): they are refused with a 400.

A grammar (SampleOptions.grammar: response_format, forced, required and strict tool calls, the tinker wire's
`constraint`) goes to vLLM's structured outputs as it is: the worker runs vLLM with its `guidance` backend,
which is llguidance, the engine the built-in sampler uses (engine/constraints.py), so the same Lark text
(grammars.py: `%json` schemas, regexes, tool-call grammars) means the same thing. vLLM masks a constrained row's
logits before its draw, as the built-in sampler does, and the logprobs returned are the model's own, unmasked,
as there (vLLM alone would give the masked distribution's: the worker keeps the logits from before the mask for
them, worker.keep_model_logprobs_under_grammars; a vLLM where it cannot is refused a grammar with a 400).
Where it differs:
- the end: once the grammar is complete vLLM allows only end-of-sequence, so the row ends with that token (kept,
  as a stop token is); the built-in sampler stops the row at the grammar's last token. The text is the same.
- stopping: where the grammar accepts, vLLM allows its end-of-sequence token only, not the request's other stop
  token ids (the built-in sampler allows all of them there). A request whose stop set has no end-of-sequence
  (stop=[]) cannot end a constrained row the way it asks (the built-in sampler stops it when the grammar is
  complete, vLLM would draw end-of-sequence and go on): it is refused with a 400 naming that.
A grammar vLLM's llguidance (the vLLM venv's version) refuses is a 400 with its message.

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
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kernel_backend.engine import base_models, core as engine_module
from kernel_backend.execution import engine_work
from kernel_backend.vllm import venv as vllm_venv
from kernel_backend.config import Settings
from kernel_backend.metering import Usage
from kernel_backend.execution.scheduler import Job, Scheduler, log_failure
from kernel_backend.types import SampledSequence, SampleOptions, SampleResult, SamplingParams
from kernel_backend.errors import UserError

log = logging.getLogger("stepwise.vllm")

WORKER = Path(__file__).parents[1] / "vllm" / "worker.py"
# LoRA ranks vLLM accepts for max_lora_rank.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_args(settings: Settings, model_dir: Path, max_context: int) -> dict:
    """vLLM's engine arguments: the same model, dtype and context as the trainer's; CPU and GPU differ only here."""
    args = dict(
        model=str(model_dir), dtype=settings.dtype, max_model_len=max_context, seed=0,
        enable_lora=True, max_lora_rank=settings.vllm_max_lora_rank, max_loras=4, max_cpu_loras=8,
        # The sampled token's logprob from the raw logits, before temperature, top-k and top-p: Tinker's meaning.
        logprobs_mode="raw_logprobs", max_logprobs=20,
        # Our grammars are llguidance's Lark (grammars.py): the guidance backend reads them as the built-in sampler
        # does, where "auto" would hand a grammar to xgrammar, which reads GBNF.
        structured_outputs_config={"backend": "guidance"},
    )
    if vllm_venv.flavor(settings) == "cpu":
        args.update(enforce_eager=True)  # no graph capture or compilation on CPU (minutes on 2 cores)
    else:
        args.update(gpu_memory_utilization=settings.vllm_gpu_memory_fraction)  # the trainer shares the GPU
    return args


class WorkerError(RuntimeError):
    pass


class WorkerProcess:
    """A vLLM worker process and the pipe to it (see kernel_backend/vllm/worker.py for the messages)."""

    def __init__(self, python: Path, args: dict, env: dict, log_path: Path) -> None:
        self.python, self.args, self.env, self.log_path = python, args, env, log_path
        self.process: subprocess.Popen[bytes] | None = None  # start() makes it, with pipes for stdin and stdout
        # id -> (its reply's future, its streamed tokens' callback)
        self._pending: dict[int, tuple[concurrent.futures.Future[dict], Callable[[list], object] | None]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._ready: concurrent.futures.Future[dict] = concurrent.futures.Future()
        self.ready: dict = {}  # its ready message, once started

    def live(self) -> subprocess.Popen[bytes] | None:
        """The process while it runs; None before it starts and once it has exited."""
        return self.process if self.process is not None and self.process.poll() is None else None

    def running(self) -> bool:
        return self.live() is not None

    def start(self, timeout_s: float) -> dict:
        """Start the worker and wait until its engine is up; returns its ready message."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():  # a restart: the log of the process that exited stays beside the new one
            self.log_path.replace(self.log_path.with_suffix(".previous.log"))
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(
                # -P: the worker's folder stays off sys.path (kernel_backend/types.py would shadow the stdlib's).
                [str(self.python), "-P", str(WORKER), json.dumps(self.args)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log_file, env=self.env, start_new_session=True,
            )
        threading.Thread(target=self._read, name="stepwise-vllm-reader", daemon=True).start()
        try:
            self.ready = self._ready.result(timeout=timeout_s)
            return self.ready
        except concurrent.futures.TimeoutError:
            self.stop()
            raise WorkerError(f"the vLLM worker did not start within {timeout_s:.0f} s; its log: {self.log_path}") from None

    def call(self, op: str, on_tokens: Callable[[list], object] | None = None, **fields) -> concurrent.futures.Future[dict]:
        """Send one request; the future gets its result (or WorkerError / UserError).
        `on_tokens(list of [row, token, logprob])` sees streamed tokens as they come."""
        future: concurrent.futures.Future[dict] = concurrent.futures.Future()
        with self._lock:
            process = self.live()
            if process is None:
                raise WorkerError(f"the vLLM worker is not running; its log: {self.log_path}")
            assert process.stdin is not None  # a pipe (start)
            self._next_id += 1
            self._pending[self._next_id] = (future, on_tokens)
            process.stdin.write((json.dumps({"id": self._next_id, "op": op, **fields}) + "\n").encode())
            process.stdin.flush()
        return future

    def _read(self) -> None:
        process = self.process  # start() made it, with a pipe for stdout, before it started this thread
        assert process is not None and process.stdout is not None
        for line in process.stdout:
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
        error = WorkerError(f"the vLLM worker exited (code {process.wait()}); the end of its log "
                            f"({self.log_path}):\n" + "\n".join(last_lines))
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.set_exception(error)

    def stop(self) -> None:
        process = self.live()
        if process is None:
            return
        assert process.stdin is not None  # a pipe (start)
        try:
            process.stdin.close()  # the worker shuts its engine down and exits
            process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(process.pid, 9)  # its engine process too (same session)
            process.wait()


@dataclass
class _Version:
    """One adapter version loaded in the worker."""

    name: str  # the worker's name for it: "<first id>@<digest>#<load number>"
    digest: str  # a prefix of the SHA-256 of its weights file
    folder: Path  # our copy of its PEFT files (the worker reads them from here)
    ids: set[str] = field(default_factory=set)  # the service's ids that name it
    snapshots: set[str] = field(default_factory=set)  # those of them that are snapshots: while any is, it stays
    in_flight: int = 0  # sample requests using it now: it is unloaded from the worker only once they are done


class VllmSampler:
    """One base model's vLLM worker and the adapter versions registered with it. Thread-safe."""

    def __init__(self, settings: Settings, base_model: str, max_context: int) -> None:
        self.settings = settings
        self.base_model = base_model
        slug = base_model.replace("/", "--")
        self.adapters_dir = settings.home / "vllm" / slug / "adapters"
        model_dir = base_models.resolve(base_model, settings.models_dir, settings.base_models)[1]
        python = vllm_venv.python(settings)
        if python is None:
            raise RuntimeError(f"STEPWISE_SAMPLER=vllm needs the vLLM venv, which is not built on this machine: "
                               f"{vllm_venv.BUILD_COMMAND}")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_kv_cache_gb)}
        self.worker = WorkerProcess(python, engine_args(settings, model_dir, max_context), env,
                                    settings.home / "vllm" / slug / "worker.log")
        self.startup_s: float | None = None
        self.restarts = 0
        self._restart_lock = threading.Lock()
        self._versions: collections.OrderedDict[str, _Version] = collections.OrderedDict()  # least recently used first
        self._ids: dict[str, _Version] = {}
        self._lock = threading.Lock()
        self._loads = itertools.count(1)  # numbers each load, so a name is never reused

    def start(self) -> None:
        # Plain copies of adapter files (vLLM reads files), like the checkpoint store's staging folder:
        # readable by this user only, removed when unloaded and, left by an earlier process, here.
        shutil.rmtree(self.adapters_dir, ignore_errors=True)
        self.adapters_dir.mkdir(parents=True)
        os.chmod(self.settings.home / "vllm", 0o700)
        start = time.monotonic()
        self.worker.start(self.settings.vllm_startup_timeout_s)
        self.startup_s = time.monotonic() - start
        log.info("vLLM worker for %s ready in %.0f s", self.base_model, self.startup_s)

    def stop(self) -> None:
        self.worker.stop()

    def ensure_running(self) -> None:
        """Start the worker again if its process exited (a crash, the OOM killer), with every adapter version
        it held. The requests it had in flight failed, naming its log; the next ones wait for the restart."""
        with self._restart_lock:
            if self.worker.running():
                return
            log.warning("the vLLM worker for %s exited (code %s); starting it again", self.base_model,
                        self.worker.process.poll() if self.worker.process else None)
            old = self.worker
            self.worker = WorkerProcess(old.python, old.args, old.env, old.log_path)
            start = time.monotonic()
            self.worker.start(self.settings.vllm_startup_timeout_s)
            with self._lock:
                for version in self._versions.values():
                    self.worker.call("add_adapter", name=version.name, path=str(version.folder)).result()
            self.restarts += 1
            log.info("vLLM worker for %s ready again in %.0f s (%d adapter versions)", self.base_model,
                     time.monotonic() - start, len(self._versions))

    # ---- adapters ---------------------------------------------------------------------------------

    def has_adapter(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._ids

    def add_adapter(self, adapter_id: str, folder: Path, snapshot: bool = False) -> str:
        """Register the PEFT folder under `adapter_id` (copied: the caller may delete it); returns the version's name.

        A snapshot's version stays until remove_adapter; a checkpoint's is unloaded when it is the least
        recently used of more than STEPWISE_VLLM_MAX_ADAPTERS (a later sample loads it again)."""
        folder = Path(folder)
        if not (folder / "adapter_config.json").exists():  # a full fine-tuning run's weights: a model of its own
            raise UserError("the vLLM sampler serves LoRA adapters over its base model, not a full fine-tuning run's "
                            "own weights (rank=0); sample this run on a server with STEPWISE_SAMPLER=batched")
        rank = json.loads((folder / "adapter_config.json").read_text())["r"]
        if rank > self.settings.vllm_max_lora_rank:
            raise UserError(f"this adapter has LoRA rank {rank}, above the vLLM sampler's limit of "
                            f"{self.settings.vllm_max_lora_rank} (STEPWISE_VLLM_MAX_LORA_RANK, one of {VLLM_LORA_RANKS})")
        digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()[:16]
        with self._lock:  # held across the worker calls too, so no sample sees a version before vLLM has it
            version = next((v for v in self._versions.values() if v.digest == digest), None)
            if version is None:
                load = next(self._loads)
                copy = self.adapters_dir / f"{load}-{digest}"
                shutil.copytree(folder, copy)
                version = _Version(f"{adapter_id}@{digest}#{load}", digest, copy)
                try:
                    self.worker.call("add_adapter", name=version.name, path=str(copy)).result()
                except Exception:
                    shutil.rmtree(copy, ignore_errors=True)
                    raise
                self._versions[version.name] = version
            self._forget(adapter_id)
            version.ids.add(adapter_id)
            if snapshot:
                version.snapshots.add(adapter_id)
            self._ids[adapter_id] = version
            self._versions.move_to_end(version.name)
            unnamed = [v for v in self._versions.values() if not v.ids]
            unpinned = [v for v in self._versions.values() if v.ids and not v.snapshots]
            for old in unnamed + unpinned[: max(0, len(unpinned) - self.settings.vllm_max_adapters)]:
                self._unload(old)
        return version.name

    def remove_adapter(self, adapter_id: str) -> None:
        """The service is done with `adapter_id` (a dropped snapshot, an ended session's sampler)."""
        with self._lock:
            version = self._forget(adapter_id)
            if version is not None and not version.ids:  # nothing names it any more
                self._unload(version)

    def _forget(self, adapter_id: str) -> _Version | None:
        version = self._ids.pop(adapter_id, None)
        if version is not None:
            version.ids.discard(adapter_id)
            version.snapshots.discard(adapter_id)
        return version

    def _unload(self, version: _Version) -> None:
        """Forget a version, and unload it from the worker unless requests still use it (then the last
        one does, see sample). Lock held."""
        self._versions.pop(version.name, None)
        for adapter_id in version.ids:
            self._ids.pop(adapter_id, None)
        if not version.in_flight:
            self._release(version)

    def _release(self, version: _Version) -> None:
        try:
            self.worker.call("remove_adapter", name=version.name).result()
        except WorkerError:  # the worker exited: it holds nothing, and its restart loads only kept versions
            pass
        finally:
            shutil.rmtree(version.folder, ignore_errors=True)

    def loaded_versions(self) -> list[str]:
        with self._lock:
            return list(self._versions)

    # ---- sampling ---------------------------------------------------------------------------------

    def sample(self, adapter_id: str | None, prompt: list[int], num_samples: int, params: SamplingParams,
               stop_token_ids: set[int], stop_strings: list[str], options: SampleOptions | None = None,
               on_token=None, then=None) -> SampleResult:
        """Sample on the worker; arguments as Engine.sample_request's, already validated (stop resolved to ids
        and strings; options without target_prompt_logprobs or prompt_alt_tokens_k, see VllmSampling.check_options).
        `then(result, folder)`, if given, runs while the adapter version is still held: its files (`folder`, None
        for the base model) stay until it returns, even if newer versions unloaded this one meanwhile."""
        options = options or SampleOptions()
        if options.grammar is not None and not self.worker.ready.get("model_logprobs_under_grammars"):
            # The worker could not keep the model's own logprobs under a grammar (a vLLM other than the one it knows):
            # refused rather than answered with logprobs of another meaning.
            raise UserError(f"constrained decoding is not supported by this server's sampler (vLLM "
                            f"{self.worker.ready.get('vllm')}, STEPWISE_SAMPLER=vllm): its logprobs would be the "
                            "masked distribution's, not the model's; use a server with the built-in sampler "
                            "(STEPWISE_SAMPLER=batched, the default), or leave the constraint out")
        version = None
        if adapter_id is not None:
            with self._lock:
                version = self._ids.get(adapter_id)
                if version is None:
                    raise UserError(f"adapter {adapter_id!r} is not loaded in the vLLM sampler")
                self._versions.move_to_end(version.name)
                version.in_flight += 1
        on_tokens = (lambda tokens: [on_token(*t) for t in tokens]) if on_token is not None else None
        try:
            reply = self.worker.call(
                "sample", on_tokens=on_tokens, adapter=version.name if version else None, prompt=list(prompt),
                n=num_samples, max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, seed=params.seed, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                logit_bias=params.logit_bias, stop_token_ids=sorted(stop_token_ids),
                stop_strings=list(stop_strings), prompt_logprobs=options.prompt_logprobs,
                topk_prompt_logprobs=options.topk_prompt_logprobs, topk_sample_logprobs=options.topk_sample_logprobs,
                grammar=options.grammar, stream=on_token is not None,
            ).result()
            result = self._result(reply, prompt, options)
            if then is not None:
                then(result, version.folder if version is not None else None)
        finally:
            if version is not None:
                with self._lock:
                    version.in_flight -= 1
                    if not version.in_flight and version.name not in self._versions:  # unloaded meanwhile
                        self._release(version)
        return result

    @staticmethod
    def _result(reply: dict, prompt: list[int], options: SampleOptions) -> SampleResult:
        pairs = lambda rows: [[(int(t), float(lp)) for t, lp in row] for row in rows]  # noqa: E731
        result = SampleResult(
            sequences=[
                SampledSequence(tokens=s["tokens"], logprobs=s["logprobs"], stop_reason=s["stop_reason"],
                                top_logprobs=pairs(s["top_logprobs"]) if s["top_logprobs"] is not None else None)
                for s in reply["sequences"]
            ],
            prompt_logprobs=reply.get("prompt_logprobs"),
            topk_prompt_logprobs=[None] + pairs(reply["topk_prompt_logprobs"][1:]) if "topk_prompt_logprobs" in reply else None,
            cached_prompt_tokens=reply.get("cached_prompt_tokens", 0),
        )
        if options.prompt_logprobs_last_n:  # vLLM scored the whole prompt: keep the last n
            unscored = len(prompt) - options.prompt_logprobs_last_n
            for entries in (result.prompt_logprobs, result.topk_prompt_logprobs):
                if entries is not None:
                    entries[:unscored] = [None] * unscored
        return result


class VllmSampling:
    """The service's side of STEPWISE_SAMPLER=vllm: sample jobs run here, one vLLM worker per base model.

    `submit(job)` runs the job's usual function on a pool thread (so many requests are in vLLM's batch
    at once) against an `_EngineView`, then hands the outcome to the service's `on_done` as the
    scheduler would. The engine stays the trainer: snapshots are still taken there, and the logprob
    check (STEPWISE_VLLM_CHECK_LOGPROBS) runs there, on the scheduler thread that owns it.
    """

    def __init__(self, settings: Settings, scheduler: Scheduler, on_done) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self._on_done = on_done
        self.samplers: dict[str, VllmSampler] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="stepwise-vllm")

    def start(self, base_models: list[str]) -> None:
        """Start the workers of these (loaded) base models now rather than at their first request."""
        for name in base_models:
            self.sampler(name)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sampler in self.samplers.values():
            sampler.stop()

    def sampler(self, base_model: str, engine: engine_module.Engine | None = None) -> VllmSampler:
        """The base model's sampler, its worker started on first use (pass the engine on the scheduler thread)."""
        with self._lock:
            if base_model not in self.samplers:
                engine = engine or self._engine(base_model)
                sampler = VllmSampler(self.settings, base_model, engine.max_context)
                sampler.start()
                self.samplers[base_model] = sampler
            sampler = self.samplers[base_model]
        sampler.ensure_running()
        return sampler

    def stats(self) -> dict:
        return {name: {"startup_s": s.startup_s, "adapters": s.loaded_versions(), "restarts": s.restarts,
                       "pid": process.pid if (process := s.worker.live()) is not None else None}
                for name, s in self.samplers.items()}

    @staticmethod
    def check_options(options: SampleOptions, params: SamplingParams | None = None) -> None:
        """Refuse, before anything is queued, the sampling options vLLM cannot serve (module docstring), a grammar
        with stop=[] among them (`params`: the service's admission and the sample job's own check, _EngineView)."""
        for name in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
            if getattr(options, name):
                raise UserError(f"{name} is not supported by this server's sampler (vLLM, STEPWISE_SAMPLER=vllm); "
                                "use a server with the built-in sampler (STEPWISE_SAMPLER=batched, the default), "
                                "or leave it out")
        # stop=[] is the one stop set without end-of-sequence (Engine._check_sampling), which vLLM's grammar ends on.
        if options.grammar is not None and params is not None and params.stop == []:
            raise UserError("a constraint (grammar) with stop=[] is not supported by this server's sampler (vLLM, "
                            "STEPWISE_SAMPLER=vllm): vLLM ends a constrained sample with end-of-sequence, which "
                            "stop=[] does not stop at; leave stop out or name stop strings or tokens, or use a server "
                            "with the built-in sampler (STEPWISE_SAMPLER=batched, the default)")

    # ---- adapters, from the service's jobs on the scheduler thread ----------------------------------

    def add_snapshot(self, engine: engine_module.Engine, base_model: str, sampler_id: str) -> None:
        """save_weights_and_get_sampling_client: the engine's new snapshot, registered with vLLM too."""
        with tempfile.TemporaryDirectory() as scratch:
            engine.save_weights_for_sampler(sampler_id, Path(scratch) / "adapter")
            self.sampler(base_model, engine).add_adapter(sampler_id, Path(scratch) / "adapter", snapshot=True)

    def add_checkpoint(self, engine: engine_module.Engine, base_model: str, path: str, folder: Path) -> None:
        """save_weights_for_sampler: the checkpoint's version, registered before any sampler asks for it."""
        self.sampler(base_model, engine).add_adapter(path, folder)

    def remove(self, adapter_id: str) -> None:
        for sampler in list(self.samplers.values()):
            sampler.remove_adapter(adapter_id)

    # ---- sample jobs ----------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self._pool.submit(self._run, job)

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            view = _EngineView(self, self._engine(job.base_model), job.base_model)
            # The job's usual function, with the view as its engine: its sample_request samples with vLLM right away.
            assert job.sample is not None  # the executor sends sample jobs only here (InProcess.submit)
            result = engine_work.sample_request(view, self.scheduler.context(), job.sample, job.on_token, job.cancel)
            job.usage = Usage(prefill_tokens=job.tokens, sample_tokens=sum(len(s.tokens) for s in result.sequences))
        except Exception as e:  # as the scheduler does: bad input is the user's, anything else is logged
            log_failure(job.request_id, e)
            self._on_done(job, e)
            return
        job.duration_s = time.perf_counter() - start
        job.metrics.update(view.metrics)
        self._on_done(job, result)

    def _engine(self, base_model: str) -> engine_module.Engine:
        """The base model's engine (it validates requests and is the trainer), loaded if need be."""
        engine = self.scheduler.engines.get(base_model)
        return engine if engine is not None else self._on_scheduler(base_model, lambda engine: engine)

    def _on_scheduler(self, base_model: str, fn):
        """fn(engine) on the scheduler thread, the engine's owner; waits for its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run(engine):
            try:
                done.set_result(fn(engine))
            except Exception as e:
                done.set_exception(e)
            return {}

        # No request: the service keeps no future and no ledger row for it.
        self.scheduler.submit(Job(uuid.uuid4().hex, f"vllm:{base_model}", base_model, seq=None, call=run), ordered=False)
        return done.result(timeout=self.settings.vllm_startup_timeout_s)

    def logprob_gap(self, base_model: str, adapter_id: str | None, folder: Path | None, prompt: list[int],
                    result: SampleResult) -> dict:
        """The trainer's logprobs of the sampled tokens against vLLM's: mean and max |difference|. `folder`:
        the adapter version's files that vLLM loaded (held by VllmSampler.sample while this runs)."""

        def trainer_logprobs(engine):
            if adapter_id is not None and not engine.has_adapter(adapter_id):
                engine.load_sampler(adapter_id, folder)  # a checkpoint's sampler: the same files vLLM loaded
            return [engine.compute_logprobs(adapter_id, prompt + s.tokens)[len(prompt):] for s in result.sequences]

        trainer = self._on_scheduler(base_model, trainer_logprobs)
        gaps = [abs(a - b) for s, lps in zip(result.sequences, trainer) for a, b in zip(s.logprobs, lps)]
        if not gaps:
            return {}
        return {"sampler_logprob_gap:mean": sum(gaps) / len(gaps), "sampler_logprob_gap:max": max(gaps)}


class _EngineView:
    """The engine as a sample job's function sees it when vLLM samples: the same calls (has_adapter,
    load_sampler, sample_request), validated by the engine exactly as Engine.sample_request does, sampled by vLLM."""

    def __init__(self, sampling: VllmSampling, engine: engine_module.Engine, base_model: str) -> None:
        self._sampling, self._engine, self._base_model = sampling, engine, base_model
        self._vllm = sampling.sampler(base_model, engine)
        self.metrics: dict[str, float] = {}

    def has_adapter(self, adapter_id: str) -> bool:
        return self._vllm.has_adapter(adapter_id)

    def load_sampler(self, adapter_id: str, directory: Path, owner: str = "") -> None:
        self._vllm.add_adapter(adapter_id, Path(directory))

    def sample_request(self, adapter_id: str | None, prompt: list[int], num_samples: int = 1,
                       params: SamplingParams | None = None, options: SampleOptions | None = None, on_token=None,
                       cancel=None) -> SampleResult:
        """Engine.sample_request's checks, then vLLM samples now: the result itself, not a decoder request
        (`cancel` is not watched: vLLM finishes the request)."""
        params = params or SamplingParams()
        options = options or SampleOptions()
        # Engine.sample's own checks (they read the engine's fixed facts only: vocabulary, context, eos).
        prompt = engine_module._check_tokens(prompt, self._engine.vocab_size, "prompt")
        stop_ids, stop_strings = self._engine._check_sampling(prompt, num_samples, params, options)
        VllmSampling.check_options(options, params)
        def check(result: SampleResult, folder: Path | None) -> None:
            self.metrics = self._sampling.logprob_gap(self._base_model, adapter_id, folder, prompt, result)
        return self._vllm.sample(adapter_id, prompt, num_samples, params, stop_ids, stop_strings, options, on_token,
                                 then=check if self._sampling.settings.vllm_check_logprobs else None)
