"""The real clients the tests drive, each in a venv of its own (their pins clash with ours and with
each other's), built once per machine into the cache folder by kernel_backend/venvs.py:

    lm-eval      EleutherAI's lm-evaluation-harness (local-completions, local-chat-completions)
    inspect-ai   inspect-ai and its openai-api provider
    anthropic    the official anthropic SDK
    tinker-cookbook   tinker-cookbook 0.5.8's trainers (tests/test_cookbook.py)

Their pinned requirements are tests/clients/<name>.txt. `make test` starts the builds in the
background before the tests run (a few minutes cold, all four; instant once built); a test that
needs one waits for it (conftest.wait_for_venv).

Released tinker SDKs that frameworks pin (TINKER_SDKS, tests/test_sdk_versions.py) need no venv each: every one of
them, 0.6.3 through 0.38.0, resolves today to the same httpx, pydantic, numpy, protobuf and transformers as our
own venv, so each is only the `tinker` package, installed --no-deps into a folder of its own
(<cache>/tinker-sdk-<version>) and put first on PYTHONPATH in front of our interpreter (seconds, built on first use).

    python tests/client_venvs.py build [--background] [NAME ...]    # all of them when no NAME
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the checkout

from kernel_backend.config import Settings  # noqa: E402
from kernel_backend.venvs import TORCH, Venv  # noqa: E402

REQUIREMENTS = Path(__file__).resolve().with_name("clients")
BUILD_COMMAND = "python tests/client_venvs.py build {name}"
CHECKS = {
    "lm-eval": "import lm_eval.models.openai_completions, transformers",
    "inspect-ai": "import inspect_ai, openai",
    "anthropic": "import anthropic",
    "tinker-cookbook": "import tinker_cookbook.supervised.train, tinker_cookbook.supervised.data, tinker_cookbook.rl.train",
}
# lm-eval and tinker-cookbook import torch: the CPU wheel, before anything pulls a CUDA build.
NEEDS_TORCH = {"lm-eval", "tinker-cookbook"}


def client_env(**extra: str) -> dict[str, str]:
    """The environment a client's python runs in: ours, minus what would leak our venv (or a Tinker endpoint of the
    caller's) into theirs, offline, unbuffered; `extra` on top."""
    leaks = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TINKER_BASE_URL", "TINKER_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in leaks}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def client(name: str) -> Venv:
    return Venv(name, REQUIREMENTS / f"{name}.txt", CHECKS[name], Settings().cache_dir,
                first=[TORCH] if name in NEEDS_TORCH else [], build_command=BUILD_COMMAND.format(name=name))


TINKER_SDKS = ("0.6.3", "0.12.0", "0.16.1", "0.18.2", "0.24.1", "0.30.4", "0.38.0")


def tinker_sdk(version: str) -> Path:
    """The folder holding tinker `version` alone (for PYTHONPATH), installed on first use; one builder at a time."""
    folder = Settings().cache_dir / f"tinker-sdk-{version}"
    stamp = folder / ".stepwise-built"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            shutil.rmtree(folder, ignore_errors=True)  # an install that was interrupted
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                            "--target", str(folder), f"tinker=={version}"], check=True, capture_output=True)
            stamp.touch()
    return folder


def main(argv: list[str]) -> int:
    if argv[:1] != ["build"]:
        print(__doc__)
        return 2
    lock_fd = int(argv[argv.index("--lock-fd") + 1]) if "--lock-fd" in argv else None
    names = [a for a in argv[1:] if not a.startswith("--") and not a.isdigit()] or list(CHECKS)
    for name in names:
        venv = client(name)
        if "--background" in argv:  # one detached builder per venv, each holding its own lock
            print(venv.build_in_background([sys.executable, str(Path(__file__).resolve()), "build", name]))
        else:
            venv.build(lock_fd, say=lambda m: print(m, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
