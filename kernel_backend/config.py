"""One settings object for the backend, read from STEPWISE_* environment variables.

Nothing else in kernel_backend reads the environment: pass a Settings where it is needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _env(name: str, default: str) -> str:
    return os.environ.get(f"STEPWISE_{name}", default)


def _embedded() -> bool:
    return _env("EMBEDDED", "") not in ("", "0", "false")


def _tenant_cap(name: str, shared_default: str) -> int:
    """A per-tenant cap: the env var if set; else unlimited (0) on the embedded single-user backend,
    and `shared_default` on a server that several people share."""
    return int(_env(name, "0" if _embedded() else shared_default))


@dataclass
class Settings:
    # Where converted models, checkpoints, the database and runtime files live.
    home: Path = field(default_factory=lambda: Path(_env("HOME", str(Path.home() / ".cache" / "stepwise"))))
    # The base models this backend loads, by name or local HF directory (comma separated).
    base_models: list[str] = field(
        default_factory=lambda: [m for m in _env("BASE_MODELS", "").split(",") if m.strip()]
    )
    device: str = field(default_factory=lambda: _env("DEVICE", "cpu"))
    dtype: str = field(default_factory=lambda: _env("DTYPE", "float32"))
    # SQLAlchemy URL; default is SQLite under home.
    database_url: str = field(default_factory=lambda: _env("DATABASE_URL", ""))
    # Largest number of tokens one forward_backward request may carry (bad input beyond that).
    max_batch_tokens: int = field(default_factory=lambda: int(_env("MAX_BATCH_TOKENS", "65536")))
    # Tokens per micro-batch: bigger requests are split and gradients accumulated (exact: losses are sums).
    micro_batch_tokens: int = field(default_factory=lambda: int(_env("MICRO_BATCH_TOKENS", "4096")))
    # Rows of one forward_backward that share a prefix compute it once (prefix_tree.py; exact). 0: each row
    # alone, the baseline bench/prefix_sharing.py measures against.
    share_prefixes: bool = field(default_factory=lambda: _env("SHARE_PREFIXES", "1") != "0")
    # Prices per million tokens (TOML); empty means kernel_backend/prices.toml.
    prices_path: str = field(default_factory=lambda: _env("PRICES", ""))
    # A key registered for tenant "local" at start-up (the embedded backend's own key).
    local_key: str = field(default_factory=lambda: _env("LOCAL_KEY", ""))
    # The well-known key a server listening on loopback only accepts for tenant "local" (empty: none).
    # A server on any other address never accepts it (kernel_backend/runtime.py).
    loopback_key: str = field(default_factory=lambda: _env("LOOPBACK_KEY", "tml-local"))
    # Sessions whose client stops heart-beating for this long expire and free their adapters.
    session_timeout_s: float = field(default_factory=lambda: float(_env("SESSION_TIMEOUT_S", "300")))
    reap_interval_s: float = field(default_factory=lambda: float(_env("REAP_INTERVAL_S", "15")))
    # The single-user backend workbench.connect() starts on loopback (STEPWISE_EMBEDDED=1): no per-tenant
    # caps, and get_info reports the local tokenizer folder. Unset: a server several people share.
    embedded: bool = field(default_factory=_embedded)
    # The adapters an engine keeps on its device (training runs, samplers), in MB; past it the least recently
    # used one is dropped (a checkpoint's sampler) or spilled to disk or host memory (kernel_backend/adapter_cache.py).
    # 0: a tenth of a GPU's memory, 1024 MB on CPU.
    adapter_cache_mb: int = field(default_factory=lambda: int(_env("ADAPTER_CACHE_MB", "0")))
    # Per-tenant limits (0 = none). Sessions alive at once, tokens admitted per minute, checkpoint storage kept
    # (MB): counted when work is admitted (kernel_backend/admission.py). The share of each engine's adapter cache
    # a tenant may keep resident (MB): enforced by evicting that tenant's own least recently used adapters.
    max_sessions_per_tenant: int = field(default_factory=lambda: int(_env("MAX_SESSIONS_PER_TENANT", "0")))
    tokens_per_minute: int = field(default_factory=lambda: int(_env("TOKENS_PER_MINUTE", "0")))
    max_stored_mb_per_tenant: int = field(default_factory=lambda: _tenant_cap("MAX_STORED_MB_PER_TENANT", "51200"))
    max_adapter_mb_per_tenant: int = field(default_factory=lambda: _tenant_cap("MAX_ADAPTER_MB_PER_TENANT", "2048"))
    # Largest request body the server reads (413 beyond it; a zstd body may not expand past it either).
    max_body_bytes: int = field(default_factory=lambda: int(_env("MAX_BODY_BYTES", str(64 << 20))))
    # A finished request's result is deleted this long after it is first retrieved, and at the latest
    # this long after it finished (its ledger row stays).
    result_keep_after_retrieval_s: float = field(default_factory=lambda: float(_env("RESULT_KEEP_AFTER_RETRIEVAL_S", "300")))
    result_ttl_s: float = field(default_factory=lambda: float(_env("RESULT_TTL_S", "86400")))
    # When set, checkpoint files are encrypted at rest with this secret (kernel_backend/crypto.py).
    encryption_key: str = field(default_factory=lambda: _env("ENCRYPTION_KEY", ""))
    # Where checkpoints go: unset, the folder <home>/checkpoints; else any fsspec URL (kernel_backend/storage.py).
    storage_url: str = field(default_factory=lambda: _env("STORAGE_URL", ""))
    max_sample_tokens: int = field(default_factory=lambda: int(_env("MAX_SAMPLE_TOKENS", "4096")))
    # The most tokens (prompt + sampled, per sequence) of stability info one session may hold recorded for
    # stable_reinforce (about 12 bytes each in the database); counted when a sample request is admitted.
    max_stability_tokens: int = field(default_factory=lambda: int(_env("MAX_STABILITY_TOKENS", str(32 << 20))))
    # The secret that signs auth JWTs and download URLs (kernel_backend/signing.py); unset, the server makes
    # one and keeps it in the database. How long an auth JWT and a signed download URL stay valid.
    signing_key: str = field(default_factory=lambda: _env("SIGNING_KEY", ""))
    auth_token_ttl_s: int = field(default_factory=lambda: int(_env("AUTH_TOKEN_TTL_S", "900")))
    download_url_ttl_s: int = field(default_factory=lambda: int(_env("DOWNLOAD_URL_TTL_S", "3600")))
    # Who samples: "batched" (every request in one continuous batch on the engine, kernel_backend/sampler.py),
    # "serial" (one request at a time: the loop before the batched decoder, kept as a baseline), or "vllm"
    # (a vLLM worker process in its own venv, kernel_backend/vllm_sampler.py, built by kernel_backend/vllm_venv.py).
    sampler: str = field(default_factory=lambda: _env("SAMPLER", "batched"))
    # Who computes the frozen base layers' products (kernel_backend/matmul.py): "auto" (oneDNN for float32
    # on AMD x86 CPUs, where MKL runs its slower AVX2 code; torch's own elsewhere), "onednn" or "torch".
    matmul: str = field(default_factory=lambda: _env("MATMUL", "auto"))
    # The decoding rows' KV cache may hold at most this many MB (each request reserves its rows at
    # their longest); and prompt tokens prefilled per decode step (longer prompts take several steps).
    sample_cache_mb: int = field(default_factory=lambda: int(_env("SAMPLE_CACHE_MB", "4096")))
    prefill_chunk_tokens: int = field(default_factory=lambda: int(_env("PREFILL_CHUNK_TOKENS", "512")))
    # Machine-wide caches that outlive a STEPWISE_HOME: the vLLM venv (default ~/.cache/stepwise).
    cache_dir: Path = field(default_factory=lambda: Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stepwise")
    # An interpreter that has vLLM, used as it is instead of the venv built in cache_dir.
    vllm_python: str = field(default_factory=lambda: _env("VLLM_PYTHON", ""))
    # Checkpoint adapter versions the vLLM worker keeps loaded; the least recently used one beyond this
    # is unloaded (snapshots from save_weights_and_get_sampling_client stay while their run keeps them).
    vllm_max_adapters: int = field(default_factory=lambda: int(_env("VLLM_MAX_ADAPTERS", "8")))
    # The largest LoRA rank vLLM serves (it reserves room for it): one of 8, 16, 32, 64, 128, 256, 320, 512.
    vllm_max_lora_rank: int = field(default_factory=lambda: int(_env("VLLM_MAX_LORA_RANK", "32")))
    # vLLM's KV cache on CPU (GiB), and its share of GPU memory on a GPU (the trainer uses the rest).
    vllm_kv_cache_gb: int = field(default_factory=lambda: int(_env("VLLM_KV_CACHE_GB", "1")))
    vllm_gpu_memory_fraction: float = field(default_factory=lambda: float(_env("VLLM_GPU_MEMORY_FRACTION", "0.5")))
    vllm_startup_timeout_s: float = field(default_factory=lambda: float(_env("VLLM_STARTUP_TIMEOUT_S", "600")))
    # Compare each vLLM sample's logprobs with the trainer's on the same tokens (one extra forward pass
    # per request, on the engine): the gap goes into the request's ledger metrics. For tests and audits.
    vllm_check_logprobs: bool = field(default_factory=lambda: _env("VLLM_CHECK_LOGPROBS", "") not in ("", "0", "false"))

    # Scale-out on Ray (kernel_backend/cluster.py). STEPWISE_WORKERS=N (`stepwise serve --workers N`): a Ray head on
    # loopback and N engine workers; STEPWISE_RAY_ADDRESS: join that cluster instead (one worker per GPU if N is 0).
    # Neither: the engine runs in this process.
    workers: int = field(default_factory=lambda: int(_env("WORKERS", "0")))
    ray_address: str = field(default_factory=lambda: _env("RAY_ADDRESS", ""))
    # Each worker's device, comma separated (default: "cuda" per worker when Ray gives it a GPU, else "cpu").
    worker_devices: list[str] = field(
        default_factory=lambda: [d.strip() for d in _env("WORKER_DEVICES", "").split(",") if d.strip()]
    )
    # torch threads per CPU worker (0: the machine's cores shared among the workers).
    worker_threads: int = field(default_factory=lambda: int(_env("WORKER_THREADS", "0")))
    # The memory a CPU worker places adapters against, in MB (0: the machine's memory shared among the workers;
    # a GPU worker measures its device).
    worker_memory_mb: int = field(default_factory=lambda: int(_env("WORKER_MEMORY_MB", "0")))
    # Data parallel: workers each training run spans (a run's user_metadata {"replicas": "N"} asks for its own).
    replicas_per_run: int = field(default_factory=lambda: int(_env("REPLICAS_PER_RUN", "1")))
    # A run's state (weights + optimizer) is snapshotted to the checkpoint store every this many optim steps, with
    # or without Ray workers: a run whose worker or backend dies is rebuilt from its newest snapshot and the journal
    # of its requests since (service/recovery.py; docs/performance.md measures the cost).
    snapshot_every: int = field(default_factory=lambda: int(_env("SNAPSHOT_EVERY", "10")))
    # ...and at the next optim step whatever its number once the run's journal since its snapshot passes this
    # many MB (kernel_backend/service/recovery.py: a run is its snapshot plus the journal of requests since).
    journal_mb: int = field(default_factory=lambda: int(_env("JOURNAL_MB", "256")))
    # Of those snapshots, each run keeps its newest this many (older steps to fork from: kernel_backend/step_history.py).
    snapshots_kept: int = field(default_factory=lambda: int(_env("SNAPSHOTS_KEPT", "8")))
    # In host memory, each run's state after its last this many steps (and its start), within this many MB for all
    # runs of an engine together (kernel_backend/step_history.py).
    step_history: int = field(default_factory=lambda: int(_env("STEP_HISTORY", "8")))
    step_history_mb: int = field(default_factory=lambda: int(_env("STEP_HISTORY_MB", "1024")))
    # Workers answer a heartbeat this often; one that misses MISSED_HEARTBEATS in a row is taken for dead.
    heartbeat_s: float = field(default_factory=lambda: float(_env("HEARTBEAT_S", "1.0")))
    # The Ray head this backend starts: CPUs it offers, its object store (MB).
    ray_num_cpus: int = field(default_factory=lambda: int(_env("RAY_NUM_CPUS", "0")))
    ray_object_store_mb: int = field(default_factory=lambda: int(_env("RAY_OBJECT_STORE_MB", "256")))

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'stepwise.db'}"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"
