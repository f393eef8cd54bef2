"""The backend's settings (kernel_backend/config.py): each STEPWISE_* variable declared once, typed, documented.

A bad value names the variable and stops the backend before anything starts; a misspelt variable is warned about
with the name it was probably meant to be; docs/configuration.md is the declarations' own output. No model runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernel_backend import config
from kernel_backend.config import SettingError, Settings
from servers import REPO


def test_each_variable_is_read_with_its_type_and_its_defaults_hold(monkeypatch):
    for name in [n for n in os.environ if n.startswith("STEPWISE_")]:
        monkeypatch.delenv(name)
    defaults = Settings()
    assert (defaults.max_batch_tokens, defaults.session_timeout_s, defaults.share_prefixes) == (65536, 300.0, True)
    assert defaults.max_stored_mb_per_tenant == 51200  # a shared server's cap; the embedded backend has none
    monkeypatch.setenv("STEPWISE_EMBEDDED", "1")
    monkeypatch.setenv("STEPWISE_SHARE_PREFIXES", "off")
    monkeypatch.setenv("STEPWISE_WORKER_DEVICES", "cuda:0, cuda:1")
    monkeypatch.setenv("STEPWISE_HEARTBEAT_S", "0.5")
    read = Settings()
    assert read.max_stored_mb_per_tenant == 0 and read.share_prefixes is False and read.heartbeat_s == 0.5
    assert read.worker_devices == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("name, value, says", [
    ("STEPWISE_MAX_BATCH_TOKENS", "64k", "is not an integer"),
    ("STEPWISE_SESSION_TIMEOUT_S", "five minutes", "is not a number"),
    ("STEPWISE_EMBEDDED", "maybe", "is not one of 1/0, true/false"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=f"{name}='{value}' {says}"):
        Settings()


def test_the_command_line_stops_on_a_bad_value_and_warns_of_a_misspelt_variable(tmp_path):
    env = {**os.environ, "STEPWISE_HOME": str(tmp_path)}
    bad = subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "list"], cwd=REPO, capture_output=True,
                         text=True, env={**env, "STEPWISE_TOKENS_PER_MINUTE": "many"}, timeout=60)
    assert bad.returncode != 0 and "stepwise keys: STEPWISE_TOKENS_PER_MINUTE='many' is not an integer" in bad.stderr
    misspelt = subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "list"], cwd=REPO, capture_output=True,
                              text=True, env={**env, "STEPWISE_TOKEN_PER_MINUTE": "100"}, timeout=60)
    assert misspelt.returncode == 0, misspelt.stderr
    assert ("warning: STEPWISE_TOKEN_PER_MINUTE is set but nothing reads it: did you mean STEPWISE_TOKENS_PER_MINUTE?"
            in misspelt.stderr)


def test_the_configuration_page_is_the_declarations_output():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config.markdown(), "regenerate it: python -m kernel_backend.config > docs/configuration.md"
    for name in config.variables():  # every variable the backend reads has a line of its own, with what it sets
        assert f"| `{name}` |" in page
    assert all(meta["help"] for meta in config.variables().values())


@pytest.mark.parametrize("name, value, says", [
    ("STEPWISE_LOCAL_KEY", "my-secret-key", "STEPWISE_LOCAL_KEY=my-... (13 characters) is not an API key: keys start "
                                            "with 'tml-'"),
    ("STEPWISE_DTYPE", "float8", "STEPWISE_DTYPE must be one of float32, bfloat16, not 'float8'"),
    ("STEPWISE_DEVICE", "gpu", "STEPWISE_DEVICE='gpu' is not a torch device"),
    ("STEPWISE_SAMPLER", "fast", "STEPWISE_SAMPLER must be one of batched, serial, vllm, not 'fast'"),
    ("STEPWISE_MATMUL", "blas", "STEPWISE_MATMUL must be one of auto, onednn, torch, not 'blas'"),
    ("STEPWISE_SAMPLE_DTYPE", "float16", "STEPWISE_SAMPLE_DTYPE must be one of float32, bfloat16, not 'float16'"),
    ("STEPWISE_VLLM_MAX_LORA_RANK", "12", "STEPWISE_VLLM_MAX_LORA_RANK must be one of 8, 16, 32"),
    ("STEPWISE_STORAGE_URL", "bucket/prefix", "STEPWISE_STORAGE_URL='bucket/prefix' is not an fsspec URL"),
    ("STEPWISE_STORAGE_URL", "s4://bucket", "a protocol fsspec knows ('s4' is not one)"),
    ("STEPWISE_DATABASE_URL", "postgres-host:5432", "STEPWISE_DATABASE_URL='postgres-host:5432' is not an SQLAlchemy URL"),
    ("STEPWISE_SHARD", "2", "STEPWISE_SHARD=2 needs Ray workers to shard over"),
    ("STEPWISE_MICRO_BATCH_TOKENS", "0", "STEPWISE_MICRO_BATCH_TOKENS=0 is not 1 or more"),
])
def test_serve_stops_on_a_bad_value_with_one_line_naming_it(tmp_path, name, value, says):
    """Every value is checked as the settings are made (config.check), not where it is first used (a traceback from
    deep inside the server, a worker, or the first request): `serve` stops at once, exit status 2, one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    bad = subprocess.run([sys.executable, "-m", "kernel_backend", "serve", "--port", "1"], cwd=REPO, capture_output=True,
                         text=True, env={**env, "STEPWISE_HOME": str(tmp_path), name: value}, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("stepwise serve: ") and says in bad.stderr, bad.stderr
    assert "my-secret-key" not in bad.stderr  # (a key is a secret even when malformed)


def test_settings_made_in_code_are_checked_too(tmp_path):
    with pytest.raises(SettingError, match="STEPWISE_SHARD=2 is not a divisor of the 3 workers"):
        Settings(home=tmp_path, workers=3, shard=2)
    with pytest.raises(SettingError, match="STEPWISE_WORKER_DEVICES='tpu' is not a torch device"):
        Settings(home=tmp_path, worker_devices=["cpu", "tpu"])
    assert Settings(home=tmp_path, workers=4, shard=2, storage_url="memory://x").shard == 2
