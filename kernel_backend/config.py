"""One settings object for the backend, read from STEPWISE_* environment variables.

Nothing else in kernel_backend reads the environment: pass a Settings where it is needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _env(name: str, default: str) -> str:
    return os.environ.get(f"STEPWISE_{name}", default)


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
    # Per-tenant limits (0 = none): sessions alive at once, and tokens processed per minute.
    max_sessions_per_tenant: int = field(default_factory=lambda: int(_env("MAX_SESSIONS_PER_TENANT", "0")))
    tokens_per_minute: int = field(default_factory=lambda: int(_env("TOKENS_PER_MINUTE", "0")))
    # When set, checkpoint files are encrypted at rest with this secret (kernel_backend/crypto.py).
    encryption_key: str = field(default_factory=lambda: _env("ENCRYPTION_KEY", ""))
    # Where checkpoints go: unset, the folder <home>/checkpoints; else any fsspec URL (kernel_backend/storage.py).
    storage_url: str = field(default_factory=lambda: _env("STORAGE_URL", ""))
    max_sample_tokens: int = field(default_factory=lambda: int(_env("MAX_SAMPLE_TOKENS", "4096")))

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
