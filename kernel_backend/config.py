"""One settings object for the backend, read from STEPWISE_* environment variables.

Nothing else in kernel_backend reads the environment: pass a Settings where it is needed. Each variable is declared
once, below, with `env(name, default, help)`: its type is its default's, and a value it cannot take raises a
SettingError that names the variable and what it takes. `stepwise serve` warns about a STEPWISE_* variable that
nothing reads (`unknown_variables`: a misspelt one would otherwise be silently ignored), and
`python -m kernel_backend.config` prints the table of them all that docs/configuration.md holds (a test checks it is
current).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

# Read by other parts than the backend's Settings.
OTHER_VARIABLES = {
    "STEPWISE_BASE_URL": "workbench.connect(), `stepwise demo` and the recipes bind to this running backend",
    "STEPWISE_API_KEY": "...with this key",
    "STEPWISE_LOG": "the log file of a backend that workbench.connect() starts (its backend.json names it)",
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class SettingError(ValueError):
    """A STEPWISE_* variable whose value the backend cannot take; the message names it and what it takes."""


def _parse(name: str, raw: str, kind: type):
    try:
        if kind is bool:
            if raw.strip().lower() not in TRUE + FALSE:
                raise ValueError
            return raw.strip().lower() in TRUE
        if kind is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        return kind(raw)
    except ValueError:
        what = {int: "an integer", float: "a number", bool: "one of 1/0, true/false, yes/no, on/off"}.get(kind, "valid")
        raise SettingError(f"STEPWISE_{name}={raw!r} is not {what}: unset it for its default, or see "
                           "docs/configuration.md") from None


def _embedded() -> bool:
    return _parse("EMBEDDED", os.environ.get("STEPWISE_EMBEDDED", ""), bool)


def env(name: str, default, help: str, shared_default=None, shown: str | None = None, choices: tuple = (),
        at_least: float | None = None):
    """A field read from STEPWISE_<name>, of its default's type (int, float, bool, str, Path, or list: comma
    separated). `default` may be a function, called when read; `shown` says it in the docs. `shared_default`: a
    per-tenant cap's default on a server several people share (STEPWISE_EMBEDDED unset). `choices`, `at_least`: the
    values it takes, checked once when the settings are made (Settings.__post_init__), not where it is used."""

    def read():
        value = default() if callable(default) else default
        if shared_default is not None and not _embedded():
            value = shared_default
        raw = os.environ.get(f"STEPWISE_{name}")
        return value if raw is None else _parse(name, raw, type(value))

    if shown is None:
        shown = ",".join(default) if isinstance(default, list) else str(default)
        if shared_default is not None:
            shown += f" (a shared server: {shared_default})"
    return field(default_factory=read, metadata={"variable": f"STEPWISE_{name}", "help": help, "default": shown,
                                                 "choices": choices, "at_least": at_least})


@dataclass
class Settings:
    home: Path = env("HOME", lambda: Path.home() / ".cache" / "stepwise",
                     "where converted models, checkpoints, the database and runtime files live", shown="~/.cache/stepwise")
    base_models: list[str] = env("BASE_MODELS", [], "the base models this backend loads, by name or local HF "
                                 "directory (comma separated; NAME=DIR serves DIR under NAME); empty: the default model")
    device: str = env("DEVICE", "cpu", "the engine's torch device (cpu, cuda, cuda:1, ...)")
    dtype: str = env("DTYPE", "float32", "the base model's dtype (float32, bfloat16); LoRA weights stay float32",
                     choices=("float32", "bfloat16"))
    database_url: str = env("DATABASE_URL", "", "the database, an SQLAlchemy URL: empty for SQLite under the home, or "
                            "PostgreSQL as postgresql+psycopg://USER:PASSWORD@HOST:5432/DBNAME (postgresql:// means "
                            "the same; its driver: pip install 'stepwise[postgres]'; docs/operations.md)")
    max_batch_tokens: int = env("MAX_BATCH_TOKENS", 65536, "the most tokens one forward_backward request may carry "
                                "(bad input beyond it)", at_least=1)
    micro_batch_tokens: int = env("MICRO_BATCH_TOKENS", 4096, "tokens per micro-batch, a prefix rows share counted once "
                                  "(engine/prefix_tree.py): bigger requests are split and their gradients accumulated "
                                  "(exact: losses are sums); about 2.5 MB a token on the default model",
                                  at_least=1)
    share_prefixes: bool = env("SHARE_PREFIXES", True, "rows of one forward_backward that share a prefix compute it once "
                               "(engine/prefix_tree.py, exact); 0: each row alone, the baseline bench/prefix_sharing.py measures")
    prices_path: str = env("PRICES", "", "prices per million tokens (a TOML file); empty: kernel_backend/prices.toml")
    local_key: str = env("LOCAL_KEY", "", "a key registered for tenant \"local\" at start-up (the embedded backend's own)")
    loopback_key: str = env("LOOPBACK_KEY", "tml-local", "the well-known key a server listening on loopback only "
                            "accepts for tenant \"local\" (empty: none; never on another address, runtime.py)")
    session_timeout_s: float = env("SESSION_TIMEOUT_S", 300.0, "a session whose client stops heart-beating this long "
                                   "expires and frees its adapters")
    reap_interval_s: float = env("REAP_INTERVAL_S", 15.0, "how often housekeeping expires sessions, results and checkpoints")
    embedded: bool = env("EMBEDDED", False, "the single-user backend workbench.connect() starts on loopback: no "
                         "per-tenant caps, and get_info reports the local tokenizer folder; unset: a shared server")
    adapter_cache_mb: int = env("ADAPTER_CACHE_MB", 0, "the adapters an engine keeps on its device (runs, samplers); "
                                "past it the least recently used is dropped or spilled (engine/adapter_cache.py); 0: a "
                                "tenth of a GPU's memory, 512 on CPU; a notebook's backend (workbench.connect()) sets "
                                "a quarter of the machine's memory")
    # Per-tenant limits (0: none), counted when work is admitted (kernel_backend/service/admission.py).
    max_sessions_per_tenant: int = env("MAX_SESSIONS_PER_TENANT", 0, "sessions a tenant may have alive at once")
    tokens_per_minute: int = env("TOKENS_PER_MINUTE", 0, "tokens admitted per tenant per minute")
    max_stored_mb_per_tenant: int = env("MAX_STORED_MB_PER_TENANT", 0, "checkpoint storage a tenant may keep (MB)",
                                        shared_default=51200)
    max_adapter_mb_per_tenant: int = env("MAX_ADAPTER_MB_PER_TENANT", 0, "a tenant's share of each engine's adapter "
                                         "cache (MB), enforced by evicting its own least recently used adapters; "
                                         "none on a `serve` that listens on loopback only, unless set",
                                         shared_default=2048)
    max_body_bytes: int = env("MAX_BODY_BYTES", 64 << 20, "the largest request body the server reads (413 beyond it; "
                              "a zstd body may not expand past it either)")
    result_keep_after_retrieval_s: float = env("RESULT_KEEP_AFTER_RETRIEVAL_S", 300.0, "a finished request's result "
                                               "is deleted this long after it is first retrieved (its ledger row stays)")
    result_ttl_s: float = env("RESULT_TTL_S", 86400.0, "...and at the latest this long after it finished")
    encryption_key: str = env("ENCRYPTION_KEY", "", "when set, checkpoint files are encrypted at rest with this "
                              "secret (persistence/crypto.py)")
    encryption_old_keys: str = env("ENCRYPTION_OLD_KEYS", "", "earlier STEPWISE_ENCRYPTION_KEY values, comma-separated: "
                                   "checkpoints sealed with them still open; new ones are sealed with "
                                   "STEPWISE_ENCRYPTION_KEY (rotating the key: docs/operations.md)")
    storage_url: str = env("STORAGE_URL", "", "where checkpoints go: any fsspec URL, e.g. s3://BUCKET/PREFIX (pip install "
                           "'stepwise[s3]'; credentials and endpoint as boto3 finds them: AWS_ACCESS_KEY_ID, "
                           "AWS_ENDPOINT_URL, ...; docs/operations.md); empty: <home>/checkpoints")
    storage_options: str = env("STORAGE_OPTIONS", "", "options for the store's fsspec filesystem, a JSON object, e.g. "
                               '{"endpoint_url": "http://minio:9000", "key": "...", "secret": "..."} for s3fs; empty: '
                               "none beyond the environment's")
    max_sample_tokens: int = env("MAX_SAMPLE_TOKENS", 4096, "the most tokens one sample request may ask for")
    max_stability_tokens: int = env("MAX_STABILITY_TOKENS", 32 << 20, "stable_reinforce's recorded stability info one "
                                    "session may hold (tokens, about 12 bytes each in the database)")
    signing_key: str = env("SIGNING_KEY", "", "the secret that signs auth JWTs and download URLs (persistence/signing.py); "
                           "empty: made once and kept in the database")
    auth_token_ttl_s: int = env("AUTH_TOKEN_TTL_S", 900, "how long an auth JWT stays valid")
    download_url_ttl_s: int = env("DOWNLOAD_URL_TTL_S", 3600, "how long a signed download URL stays valid")
    sampler: str = env("SAMPLER", "batched", "who samples: batched (one continuous batch, engine/sampler.py), serial (one "
                       "request at a time, the benchmarks' baseline) or vllm (a vLLM worker in its own venv)",
                       choices=("batched", "serial", "vllm"))
    matmul: str = env("MATMUL", "auto", "who computes the frozen base layers' products (engine/matmul.py): auto (oneDNN for "
                      "float32 on AMD x86 CPUs with AVX-512, torch's own elsewhere), onednn or torch",
                      choices=("auto", "onednn", "torch"))
    sample_cache_mb: int = env("SAMPLE_CACHE_MB", 4096, "the decoding rows' KV cache (MB; each request reserves its "
                               "rows at their longest); an 8th of it more for the prefix cache", at_least=1)
    sample_dtype: str = env("SAMPLE_DTYPE", "float32", "the built-in sampler's base-weight products: float32 (the "
                            "trainer's own weights, bit for bit, whatever STEPWISE_DTYPE is) or bfloat16 (a copy of the base weights, 2 bytes each: "
                            "faster decoding, logprobs a little off the trainer's; engine/lora.py)",
                            choices=("float32", "bfloat16"))
    prefill_chunk_tokens: int = env("PREFILL_CHUNK_TOKENS", 512, "prompt tokens prefilled per decode step (longer "
                                    "prompts take several steps)", at_least=1)
    vllm_python: str = env("VLLM_PYTHON", "", "an interpreter that has vLLM, used as it is instead of the venv built "
                           "in the cache folder")
    vllm_max_adapters: int = env("VLLM_MAX_ADAPTERS", 8, "checkpoint adapter versions the vLLM worker keeps loaded "
                                 "(least recently used out beyond it)")
    vllm_max_lora_rank: int = env("VLLM_MAX_LORA_RANK", 32, "the largest LoRA rank vLLM serves (it reserves room for "
                                  "it): 8, 16, 32, 64, 128, 256, 320 or 512", choices=(8, 16, 32, 64, 128, 256, 320, 512))
    vllm_kv_cache_gb: int = env("VLLM_KV_CACHE_GB", 1, "vLLM's KV cache on CPU (GiB)")
    vllm_gpu_memory_fraction: float = env("VLLM_GPU_MEMORY_FRACTION", 0.5, "vLLM's share of GPU memory (the trainer "
                                          "uses the rest)")
    vllm_startup_timeout_s: float = env("VLLM_STARTUP_TIMEOUT_S", 600.0, "how long the vLLM worker may take to start")
    vllm_check_logprobs: bool = env("VLLM_CHECK_LOGPROBS", False, "compare each vLLM sample's logprobs with the "
                                    "trainer's (one more forward pass per request) into its ledger metrics")

    # Scale-out on Ray (kernel_backend/execution/cluster.py); neither WORKERS nor RAY_ADDRESS: the engine runs in this process.
    workers: int = env("WORKERS", 0, "a Ray head on loopback and this many engine workers (`stepwise serve --workers N`)",
                       at_least=0)
    ray_address: str = env("RAY_ADDRESS", "", "join this Ray cluster instead (one worker per GPU if WORKERS is 0)")
    worker_devices: list[str] = env("WORKER_DEVICES", [], "each worker's device, comma separated; empty: cuda per "
                                    "worker when Ray gives it a GPU, else cpu")
    worker_threads: int = env("WORKER_THREADS", 0, "torch threads per CPU worker; 0: the cores shared among the workers")
    worker_memory_mb: int = env("WORKER_MEMORY_MB", 0, "the memory a CPU worker places runs and admits batches against "
                                "(MB): a run or a batch that needs more fails at once, naming this; 0: 80% of the "
                                "machine's shared among the workers")
    shard: int = env("SHARD", 1, "workers each base model is sharded over (`stepwise serve --shard N`): the workers form "
                     "groups of this many, each member holding about 1/N of the base weights and running every request "
                     "of the group's runs with the others (engine/sharding.py, execution/cluster_worker.py); 1: none, unless a base "
                     "model's weights exceed half a CPU worker's memory budget: then the fewest workers it fits on",
                     at_least=1)
    group_timeout_s: float = env("GROUP_TIMEOUT_S", 120.0, "a collective of a shard group or a data-parallel run fails "
                                 "after waiting this long (s) for a member (one that hangs); a member that dies fails it "
                                 "at once")
    replicas_per_run: int = env("REPLICAS_PER_RUN", 1, "data parallel: workers each training run spans (a run's "
                                "user_metadata {\"replicas\": \"N\"} asks for its own)", at_least=1)
    snapshot_every: int = env("SNAPSHOT_EVERY", 10, "a run's state is snapshotted every this many optim steps; a run "
                              "whose worker or backend dies comes back from it and its journal (service/recovery.py)")
    journal_mb: int = env("JOURNAL_MB", 256, "...and at the next optim step once its journal since passes this many MB")
    snapshots_kept: int = env("SNAPSHOTS_KEPT", 8, "each run keeps its newest this many snapshots (steps to fork from)")
    step_history: int = env("STEP_HISTORY", 8, "in host memory, each run's state after its last this many steps "
                            "(engine/step_history.py)")
    step_history_mb: int = env("STEP_HISTORY_MB", 512, "...within this many MB for all runs of an engine together")
    heartbeat_s: float = env("HEARTBEAT_S", 1.0, "workers answer a heartbeat this often; one that misses several in a "
                             "row is taken for dead")
    worker_wait_s: float = env("WORKER_WAIT_S", 600.0, "a training run whose worker was lost waits this long (s) for a "
                               "live worker to be restored on (one Ray restarts rejoins); past it, its requests fail "
                               "saying so")
    log_format: str = env("LOG_FORMAT", "text", "the server log's lines: text, or json (one object a line, for a log "
                          "collector; each request's line has its fields: tenant, method, route, status, ms, tokens)",
                          choices=("text", "json"))
    ray_num_cpus: int = env("RAY_NUM_CPUS", 0, "CPUs the Ray head this backend starts offers; 0: the machine's")
    ray_object_store_mb: int = env("RAY_OBJECT_STORE_MB", 256, "that head's object store (MB)")
    # Machine-wide caches that outlive a STEPWISE_HOME, such as the vLLM venv: $XDG_CACHE_HOME/stepwise.
    cache_dir: Path = field(default_factory=lambda: Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stepwise")
    # The STEPWISE_* variables set when these settings were read: the operator's word, which automatic choices leave
    # as it is (execution/cluster.py: a sharded worker's micro-batch).
    given: frozenset[str] = field(default_factory=lambda: frozenset(n for n in os.environ if n.startswith("STEPWISE_")),
                                  repr=False)

    def __post_init__(self) -> None:
        self.home = Path(self.home).expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'stepwise.db'}"
        check(self)

    @property
    def storage_fs_options(self) -> dict:
        """STEPWISE_STORAGE_OPTIONS parsed: the keyword arguments of the store's fsspec filesystem."""
        return json.loads(self.storage_options) if self.storage_options.strip() else {}

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def decryption_keys(self) -> tuple[str, ...]:
        """The keys a sealed checkpoint is opened with, the current one first."""
        return tuple(k.strip() for k in (self.encryption_key, *self.encryption_old_keys.split(",")) if k.strip())

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"


def without_password(url: str) -> str:
    """A database URL fit for a message or a file: its password, if any, written `***`."""
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def check(settings: Settings) -> None:
    """Every value checked once, as the settings are made (a bad one raises SettingError naming the variable, the
    value and what it takes), rather than where it is first used: there it would stop the server with a traceback,
    or a worker, or the first request. Each field's `choices` and `at_least` (env), then the forms and pairings."""
    for f in fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        if meta.get("choices") and value not in meta["choices"]:  # (worded as the engine's own checks were)
            raise SettingError(f"{meta['variable']} must be one of {', '.join(map(str, meta['choices']))}, not "
                               f"{value!r}: unset it for its default, or see docs/configuration.md")
        if meta.get("at_least") is not None and value < meta["at_least"]:
            _bad(meta["variable"], value, f"is not {meta['at_least']} or more")
    for device in [settings.device, *settings.worker_devices]:
        if not re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", device):
            _bad("STEPWISE_WORKER_DEVICES" if device != settings.device else "STEPWISE_DEVICE", device,
                 "is not a torch device: cpu, cuda, or cuda:N for GPU N")
    for name, key in (("STEPWISE_LOCAL_KEY", settings.local_key), ("STEPWISE_LOOPBACK_KEY", settings.loopback_key)):
        if key and not key.startswith("tml-"):  # (the API refuses any other key as malformed: api/auth.py)
            shown = f"{key[:3]}... ({len(key)} characters)"  # a secret all the same: not written out whole
            raise SettingError(f"{name}={shown} is not an API key: keys start with 'tml-' (or leave it empty for "
                               "none): see docs/configuration.md")
    database = without_password(settings.database_url)
    if not re.match(r"(sqlite|postgres(ql)?)(\+\w+)?://", settings.database_url):
        _bad("STEPWISE_DATABASE_URL", database, "is not an SQLAlchemy URL: sqlite:///PATH or "
             "postgresql://USER:PASSWORD@HOST/DATABASE (postgresql+psycopg:// too), or empty for SQLite in the home")
    if settings.database_url.startswith("postgres") and importlib.util.find_spec("psycopg") is None:
        _bad("STEPWISE_DATABASE_URL", database, "needs psycopg, PostgreSQL's driver: pip install "
             "'stepwise[postgres]'")
    if settings.storage_url:
        _check_storage_url(settings.storage_url)
    try:
        if not isinstance(options := settings.storage_fs_options, dict):
            raise ValueError(f"it is a JSON {type(options).__name__}")
    except ValueError as e:  # its value is not shown: it may hold a secret
        _bad("STEPWISE_STORAGE_OPTIONS", "...", f"is not a JSON object ({e}): e.g. "
             '{"endpoint_url": "http://127.0.0.1:9000"}')
    if settings.shard > 1 and not (settings.workers or settings.ray_address or settings.worker_devices):
        _bad("STEPWISE_SHARD", settings.shard, f"needs Ray workers to shard over: STEPWISE_WORKERS={settings.shard} (or "
             "`serve --workers`, a multiple of it), or STEPWISE_RAY_ADDRESS; or 1 for none")
    count = len(settings.worker_devices) or settings.workers
    if settings.shard > 1 and count % settings.shard:
        _bad("STEPWISE_SHARD", settings.shard, f"is not a divisor of the {count} workers (STEPWISE_WORKERS or "
             "STEPWISE_WORKER_DEVICES): each group shards a base model over that many")
    if settings.shard > 1 and settings.replicas_per_run > 1:
        _bad("STEPWISE_REPLICAS_PER_RUN", settings.replicas_per_run, "needs STEPWISE_SHARD=1: data-parallel runs "
             "over shard groups are not built yet")


def _check_storage_url(url: str) -> None:
    """An fsspec URL whose protocol fsspec knows, with its package installed (s3fs for s3://)."""
    protocol = url.split("://", 1)[0] if "://" in url else ""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", protocol):
        _bad("STEPWISE_STORAGE_URL", url, "is not an fsspec URL such as s3://BUCKET/PREFIX or file:///PATH, or empty for "
             "the home's checkpoints folder")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        _bad("STEPWISE_STORAGE_URL", url, f"is not an fsspec URL of a protocol fsspec knows ({protocol!r} is not one)")
    except ImportError as e:
        _bad("STEPWISE_STORAGE_URL", url, f"needs the package that serves {protocol}:// ({e}): for s3://, "
             "pip install 'stepwise[s3]'")


def _bad(variable: str, value, what: str):
    """SettingError: `variable`'s `value` and `what` is wrong with it ("is not ...", "needs ...")."""
    raise SettingError(f"{variable}={value!r} {what}: unset it for its default, or see docs/configuration.md")


def variables() -> dict[str, dict]:
    """Every STEPWISE_* variable Settings reads: its field's metadata (variable, help, default) by name."""
    return {f.metadata["variable"]: dict(f.metadata) for f in fields(Settings) if "variable" in f.metadata}


def unknown_variables(environ=os.environ) -> list[str]:
    """A warning for each STEPWISE_* variable set here that nothing reads (a misspelt one would be silently
    ignored), naming the closest one that exists."""
    import difflib

    known = [*variables(), *OTHER_VARIABLES]
    warnings = []
    for name in sorted(n for n in environ if n.startswith("STEPWISE_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        warnings.append(f"{name} is set but nothing reads it" + (f": did you mean {close[0]}?" if close else
                                                                    " (docs/configuration.md lists every variable)"))
    return warnings


def markdown() -> str:
    """docs/configuration.md: the table of every variable, from the declarations above."""
    rows = [f"| `{name}` | {meta['default'] or '(empty)'} | {meta['help']} |" for name, meta in variables().items()]
    rows += [f"| `{name}` | | {help} |" for name, help in OTHER_VARIABLES.items()]
    return ("# Configuration\n\n"
            "The backend reads these environment variables (kernel_backend/config.py, where each is declared once; "
            "this page is\nits output: `python -m kernel_backend.config > docs/configuration.md`). A value a "
            "variable cannot take stops\nthe backend with a message that names it; `stepwise serve` warns about a "
            "STEPWISE_* variable that nothing reads.\nEvery value is checked once, at start (choices, forms, pairings "
            "such as STEPWISE_SHARD with the workers): `stepwise serve`\nstops with one line on stderr naming the "
            "variable, its value and what it takes, exit status 2.\n\n"
            "| variable | default | what it sets |\n|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.stdout.write(markdown())
