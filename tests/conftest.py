"""Shared fixtures for the tests.

- Every test session gets a fresh STEPWISE_HOME (database, checkpoints, runtime files), but its
  `models` folder is a symlink to ~/.cache/stepwise/models, so the default model's GGUF is
  converted once per machine (about 30 s), not once per run.
- `engine`: one real kernel_backend Engine for the whole session (the default model). Tests that
  use it must not depend on each other: each makes its own adapters with fresh ids (the
  `adapters` fixture does that and deletes them afterwards).
- `tokenizer`: the default model's tokenizer.
- `tinker_server`: a backend process like the embedded one (with `--cluster`: on two Ray engine workers,
  kernel_backend/execution/cluster.py, so the official-SDK tests run against a cluster unchanged); `shared_server`:
  one set up like a server several people share (per-tenant caps on, small limits), for the hardening tests.
- `vllm_python`: the vLLM venv's interpreter (kernel_backend/vllm/venv.py), waiting for a build under
  way (make test starts one in the background), or a skip that says how to build it. Tests marked
  `vllm` run after all the others, to give that build time; so do those marked `clients` (the real
  evaluation clients, tests/client_venvs.py).
Helpers to build data (sft_datum, chat_prompt, ...) live in tests/helpers.py.
"""

from __future__ import annotations

import os

# Before anything imports torch (libgomp reads it once, at load): OpenMP threads that wait by
# sleeping instead of spinning. On a busy 2-core machine (a backend subprocess, a second test
# run) spinning threads make each training step 5-10x slower; on a quiet one this costs ~nothing.
# Subprocesses the tests start (backend servers) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under `make test`'s xdist workers, one per core: each worker and the processes it starts (backend servers, the
# lab's backend, notebook kernels) compute on one torch thread. Two workers' servers with two threads each on two
# cores wait on each other at every parallel op; a decode step under such load ran 1.25x faster on one thread.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

# The backend places the default model's tokenizer in the Hugging Face hub cache, where the SDK's
# SamplingClient.get_tokenizer() looks (kernel_backend/engine/base_models.py). A throwaway cache per test run,
# set before anything imports huggingface_hub (and inherited by the servers), leaves the user's own alone.
_HF_HUB_CACHE = tempfile.mkdtemp(prefix="stepwise-test-hf-hub-")
os.environ["HF_HUB_CACHE"] = _HF_HUB_CACHE
atexit.register(shutil.rmtree, _HF_HUB_CACHE, ignore_errors=True)

import pytest  # noqa: E402

from helpers import default_tokenizer, new_id  # noqa: E402

# JupyterLab + Chromium fixtures for the browser tests (tests/browser.py): one JupyterLab per run.
pytest_plugins = ["browser"]

SHARED_MODELS = Path.home() / ".cache" / "stepwise" / "models"


# `pytest --cluster`: tinker_server runs its engines on two Ray workers instead of in-process.
CLUSTER_ENV = {"STEPWISE_WORKERS": "2", "STEPWISE_WORKER_THREADS": "1", "STEPWISE_RAY_NUM_CPUS": "2",
               "STEPWISE_RAY_OBJECT_STORE_MB": "128"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the last lines of the logs of the servers it started (tests/servers.py):
    a failure seen once in a loaded run is then explained by what the server said, after pytest has rotated its
    tmp_path away."""
    from servers import STARTED

    if call.when == "setup":
        item.stash[_SERVERS_BEFORE] = len(STARTED)
    report = yield
    if report.failed:
        for server in STARTED[item.stash.get(_SERVERS_BEFORE, len(STARTED)):]:
            try:
                lines = server.log_path.read_text(errors="replace").splitlines()[-60:]
            except OSError as error:
                lines = [f"(unreadable: {error})"]
            report.sections.append((f"server log {server.base_url} (last 60 lines)", "\n".join(lines)))
    return report


_SERVERS_BEFORE = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption("--cluster", action="store_true",
                     help="run tinker_server (the official-SDK service tests) on two Ray engine workers")


# `make test` runs the files on two xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder`), in groups that
# each run whole on one worker, so that their module fixtures (servers) start once. Each file is a group, except:
# - the files that drive the one JupyterLab (tests/browser.py's `lab`): one group, so that it starts once;
# - the files that train or sample the real model on a server (real_model_server, or one of their own): one
#   group, so that at most one such server runs at a time beside the lab's backend (each holds a few GB; two
#   of each do not fit in 24 GB without swap).
LAB_FILES = ("test_notebooks.py", "test_extension_browser.py", "test_browser_after_shutdown.py")
REAL_MODEL_FILES = ("test_recipes.py", "test_vllm.py", "test_rl_insight.py", "test_setup.py", "test_eval_clients.py",
                    "test_service.py", "test_sdk_surface.py", "test_openai.py", "test_compare_probes.py",
                    "test_tool_calls.py")


def xdist_group(path: Path) -> str:
    return "lab" if path.name in LAB_FILES else "real model" if path.name in REAL_MODEL_FILES else str(path)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called only where it runs
def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduler with the groups above. (Not xdist_group marks with --dist loadgroup: xdist 3.8
    groups by rewriting a test's node id, which pytest 9.2 no longer lets it do.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(Path(nodeid.split("::", 1)[0]))

    return Groups(config, log)


def pytest_collection_modifyitems(config, items):
    """The lab's group first and the real model's second (the longest: each worker starts on one); tests marked
    vllm or clients last, to give their venvs' background builds time (a stable sort keeps every other order).
    With --cluster, the tests on real_model_server are left out: that server is never a cluster, so they
    would only run again what the first run ran."""
    if config.getoption("--cluster"):
        off_cluster = [item for item in items if "real_model_server" in getattr(item, "fixturenames", ())]
        if off_cluster:
            config.hook.pytest_deselected(items=off_cluster)
            items[:] = [item for item in items if item not in off_cluster]

    def order(item):
        last = any(item.get_closest_marker(m) is not None for m in ("vllm", "clients"))
        return (last, {"lab": 0, "real model": 1}.get(xdist_group(item.path), 2))

    items.sort(key=order)


@pytest.fixture(scope="session")
def vllm_python():
    from kernel_backend.vllm import venv as vllm_venv
    from kernel_backend.config import Settings

    settings = Settings()
    if settings.vllm_python:
        return vllm_venv.python(settings)
    return wait_for_venv(vllm_venv.venv(settings))


def wait_for_venv(venv):
    """A cached venv's interpreter (kernel_backend/venvs.py), waiting for a build under way (make test
    starts them in the background), or a skip that says how to build it."""
    if venv.building():
        print(f"\nwaiting for the {venv.name} venv build to finish (log: {venv.log_path})", flush=True)
    python = venv.wait(timeout_s=1800)
    if python is None:
        last_build = f" (the last build's log: {venv.log_path})" if venv.log_path.exists() else ""
        pytest.skip(f"the {venv.name} venv is not built on this machine; build it with: {venv.build_command}{last_build}")
    return python


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
def engine(stepwise_home, tiny_model):
    """The session's in-process Engine, on the tiny stand-in for the default model (tests/tiny_model.py)."""
    from kernel_backend.engine.core import Engine
    from tiny_model import stand_in_settings

    return Engine(settings=stand_in_settings(tiny_model))


@pytest.fixture(scope="session")
def real_engine(stepwise_home):
    """An in-process Engine on the real default model, for the tests about what it learns or computes."""
    from kernel_backend.engine.core import Engine

    return Engine()


@pytest.fixture(scope="session")
def tokenizer(stepwise_home):
    return default_tokenizer()


@pytest.fixture
def adapters(engine):
    """make(**lora_config) -> a fresh adapter id on the session engine; all deleted after the test
    (`make.on(other_engine)` makes one on another engine, deleted with the rest)."""
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
def tiny_model(tmp_path_factory, stepwise_home) -> Path:
    """A tiny random stand-in for the default model (tests/tiny_model.py), for the tests about behaviour."""
    from tiny_model import tiny_default_model

    return tiny_default_model(tmp_path_factory.mktemp("tiny-smollm2"), stepwise_home / "models")


@pytest.fixture(scope="session")
def tinker_server(stepwise_home, tiny_model, pytestconfig):
    """A real backend process on a free loopback port, shared by the session's protocol tests. It serves the
    tiny stand-in under the default model's name: those tests check what the service does, not what a model
    learns (real_model_server is for that).

    Its batch limit is lowered to 8192 tokens so the oversize-batch test stays small.
    """
    from servers import start_server
    from tiny_model import stand_in_env

    cluster = CLUSTER_ENV if pytestconfig.getoption("--cluster") else {}
    server = start_server(stepwise_home, env={"STEPWISE_MAX_BATCH_TOKENS": "8192", **stand_in_env(tiny_model),
                                              **cluster}, timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def real_model_server(tmp_path_factory, stepwise_home):
    """A backend serving the real default model (SmolLM2-135M-Instruct), for the tests about quality: a loss
    that falls on real text, a taught answer, a reward that rises, the clients' evaluations."""
    from servers import start_server

    home = tmp_path_factory.mktemp("real_model_server")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_MAX_BATCH_TOKENS": "8192", **REAL_MODEL_ENV}, timeout=600)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def real_trained_path(real_model_server, tokenizer) -> str:
    """A sampler checkpoint of the real model taught a made-up fact (tests/test_openai.py's teach_a_fact), made once
    for the OpenAI client's and the anthropic SDK's tests (a module fixture imported into a second module would
    train it twice)."""
    from test_openai import teach_a_fact

    return teach_a_fact(real_model_server, tokenizer)


# What a backend needs to serve the real default model even where tiny_everywhere set the stand-in.
REAL_MODEL_ENV = {"STEPWISE_BASE_MODELS": "", "STEPWISE_SAMPLE_CACHE_MB": "4096"}


@pytest.fixture(scope="module")
def tiny_everywhere(tiny_model):
    """For a module whose backends are started by the code under test (workbench.connect(), `stepwise export`,
    subprocesses), not by a fixture: the stand-in's environment (tiny_model.stand_in_env) for the module's
    duration. Use it with `pytestmark = pytest.mark.usefixtures("tiny_everywhere")`."""
    from tiny_model import stand_in_env

    env = stand_in_env(tiny_model)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# The shared_server's limits: small, so the hardening tests reach them with small requests.
SHARED_LIMITS = {
    "STEPWISE_EMBEDDED": "0",  # per-tenant adapter caps at their shared-server defaults
    "STEPWISE_TOKENS_PER_MINUTE": "300",
    "STEPWISE_MAX_STORED_MB_PER_TENANT": "8",
    "STEPWISE_MAX_BODY_BYTES": str(1 << 20),
    "STEPWISE_RESULT_KEEP_AFTER_RETRIEVAL_S": "1",
    "STEPWISE_REAP_INTERVAL_S": "0.5",
    # A tenant's share of the adapter cache: a rank-512 run of the tiny stand-in (about 420 MB) passes it, as
    # one of the real model passes the shared default of 2048 MB.
    "STEPWISE_MAX_ADAPTER_MB_PER_TENANT": "256",
}


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, stepwise_home, tiny_model):
    """A backend configured like a server several people share (SHARED_LIMITS), in its own home, on the tiny
    stand-in for the default model (the limits are about requests and bytes, not what a model learns).

    Tests make their own tenants on it (`server.make_key(tenant)`), so the limits one test reaches
    are its own. Before it starts, the leftovers of an interrupted checkpoint write are planted in its
    checkpoint folder (`server.planted`), which the start-up must remove.
    """
    from servers import start_server
    from tiny_model import stand_in_env

    home = tmp_path_factory.mktemp("shared_server")
    (home / "models").symlink_to(stepwise_home / "models")
    staging = home / "checkpoints" / ".staging" / "0123abcd"
    old_copy = home / "checkpoints" / "t" / "run_train_0" / "weights" / ".ckpt.old-1234abcd"
    for folder in (staging, old_copy):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"half-written")
    server = start_server(home, env={**SHARED_LIMITS, **stand_in_env(tiny_model)})
    server.planted = [staging, old_copy]
    yield server
    server.stop()
