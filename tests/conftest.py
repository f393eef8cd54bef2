"""Shared fixtures for the tests.

- Every test session gets a fresh STEPWISE_HOME (database, checkpoints, runtime files), but its
  `models` folder is a symlink to ~/.cache/stepwise/models, so the default model's GGUF is
  converted once per machine (about 30 s), not once per run.
- `engine`: one real kernel_backend Engine for the whole session (the default model). Tests that
  use it must not depend on each other: each makes its own adapters with fresh ids (the
  `adapters` fixture does that and deletes them afterwards).
- `tokenizer`: the default model's tokenizer.
Helpers to build data (sft_datum, chat_prompt, ...) live in tests/helpers.py.
"""

from __future__ import annotations

import os

# Before anything imports torch (libgomp reads it once, at load): OpenMP threads that wait by
# sleeping instead of spinning. On a busy 2-core machine (a backend subprocess, a second test
# run) spinning threads make each training step 5-10x slower; on a quiet one this costs ~nothing.
# Subprocesses the tests start (backend servers) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from helpers import default_tokenizer, new_id  # noqa: E402

# JupyterLab + Chromium fixtures for the browser tests (tests/browser.py): one JupyterLab per run.
pytest_plugins = ["browser"]

SHARED_MODELS = Path.home() / ".cache" / "stepwise" / "models"


@pytest.fixture(scope="session", autouse=True)
def stepwise_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("stepwise_home")
    SHARED_MODELS.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(SHARED_MODELS, target_is_directory=True)
    previous = os.environ.get("STEPWISE_HOME")
    os.environ["STEPWISE_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("STEPWISE_HOME", None)
    else:
        os.environ["STEPWISE_HOME"] = previous


@pytest.fixture(scope="session")
def engine(stepwise_home):
    from kernel_backend.engine import Engine

    return Engine()


@pytest.fixture(scope="session")
def tokenizer(stepwise_home):
    return default_tokenizer()


@pytest.fixture
def adapters(engine):
    """make(**lora_config) -> a fresh adapter id on the session engine; all deleted after the test."""
    from kernel_backend.types import LoraConfig

    made: list[str] = []

    def make(prefix: str = "adapter", **config) -> str:
        adapter_id = new_id(prefix)
        engine.create_adapter(adapter_id, LoraConfig(**config))
        made.append(adapter_id)
        return adapter_id

    make.created = made  # tests that add ids themselves (load_state, samplers) append here
    yield make
    for adapter_id in made:
        engine.delete_adapter(adapter_id)


@pytest.fixture(scope="session")
def tinker_server(stepwise_home):
    """A real backend process on a free loopback port, shared by the session's protocol tests.

    Its batch limit is lowered to 8192 tokens so the oversize-batch test stays small.
    """
    from servers import start_server

    server = start_server(stepwise_home, env={"STEPWISE_MAX_BATCH_TOKENS": "8192"})
    yield server
    server.stop()
