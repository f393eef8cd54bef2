"""Virtual environments built once per machine into a cache folder, outside any checkout.

Some programs we run cannot share the backend's venv: vLLM pins an older transformers
(kernel_backend/vllm/venv.py), and the real clients the tests drive (lm-eval, inspect-ai, the
`anthropic` SDK, tinker-cookbook: tests/client_venvs.py) bring their own pins. Each gets a venv

    $XDG_CACHE_HOME/stepwise/<name>-<key>/      (default ~/.cache/stepwise/...)

whose `key` hashes its pinned requirements and the Python version, so a changed pin builds a new
venv beside the old one, and a clean clone (CI) finds a built one again. The file `.stepwise-built`
inside says the build finished; builders hold `<venv>.lock`, so two test runs on one machine build it
once (the second waits), and `build_in_background` lets `make test` build while other tests run.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STAMP = ".stepwise-built"
TORCH = "torch==2.13.0"  # the CPU wheel on this machine's disk; a bare `torch` pulls a multi-GB CUDA build


@dataclass
class Venv:
    """A cached venv: `requirements` (a pinned requirements file) installed into it, then `check` (Python
    source) run in it to prove the build works. `first` is installed before the rest (torch's CPU
    wheel) and held there by a constraint; `no_deps` installs a fully pinned set without a resolver run."""

    name: str
    requirements: Path
    check: str
    cache_dir: Path
    first: list[str] = field(default_factory=list)
    no_deps: bool = False
    build_command: str = ""  # how a person builds it, for messages

    @property
    def key(self) -> str:
        digest = hashlib.sha256(self.requirements.read_bytes())
        digest.update(" ".join(self.first).encode())
        digest.update(f"python{sys.version_info.major}.{sys.version_info.minor}".encode())
        return digest.hexdigest()[:12]

    @property
    def folder(self) -> Path:
        return self.cache_dir / f"{self.name}-{self.key}"

    @property
    def log_path(self) -> Path:
        return self.folder.with_name(self.folder.name + ".log")

    @property
    def _lock_path(self) -> Path:
        return self.folder.with_name(self.folder.name + ".lock")

    def python(self) -> Path | None:
        """The venv's interpreter once it is completely built, else None."""
        stamp = self.folder / STAMP
        return self.folder / "bin" / "python" if stamp.exists() and stamp.read_text().strip() == self.key else None

    def building(self) -> bool:
        """Whether a build (this machine's, any process) is under way now."""
        if not self._lock_path.exists():
            return False
        with open(self._lock_path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
        return False

    def wait(self, timeout_s: float, on_wait=None) -> Path | None:
        """The interpreter, waiting up to `timeout_s` for a build under way; None if there is none."""
        deadline = time.monotonic() + timeout_s
        while self.building() and time.monotonic() < deadline:
            if on_wait is not None:
                on_wait()
            time.sleep(2)
        return self.python()

    def build(self, lock_fd: int | None = None, say=print) -> Path:
        """Build the venv unless it is there; returns its interpreter. Holds the lock while it works."""
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        lock = os.fdopen(lock_fd, "w") if lock_fd is not None else open(self._lock_path, "w")
        with lock:
            if lock_fd is None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the stamp
            if (ready := self.python()) is not None:
                return ready
            start = time.monotonic()
            shutil.rmtree(self.folder, ignore_errors=True)  # a build that was interrupted
            say(f"building the {self.name} venv in {self.folder}")
            _run([sys.executable, "-m", "venv", str(self.folder)])
            python = str(self.folder / "bin" / "python")
            pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            constraints = []
            if self.first:
                _run(pip + self.first)
                (self.folder / "constraints.txt").write_text("\n".join(self.first) + "\n")
                constraints = ["-c", str(self.folder / "constraints.txt")]  # the resolver keeps them as they are
            _run(pip + constraints + (["--no-deps"] if self.no_deps else []) + ["-r", str(self.requirements)])
            _run([python, "-c", self.check])
            (self.folder / STAMP).write_text(self.key)
            say(f"{self.name} venv ready in {time.monotonic() - start:.0f} s: {self.folder}")
        return self.folder / "bin" / "python"

    def build_in_background(self, command: list[str]) -> str:
        """Start `command --lock-fd N` (a command line that calls build(N)) detached, unless built or
        building; says what it did."""
        if self.python() is not None:
            return f"{self.name} venv: ready ({self.folder})"
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self._lock_path, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"{self.name} venv: a build is already under way (log: {self.log_path})"
        # The child inherits the locked file, so the build counts as under way from this moment on
        # (a test that starts right after this returns waits for it, see wait()).
        with open(self.log_path, "w") as log:
            subprocess.Popen([*command, "--lock-fd", str(lock.fileno())],
                             pass_fds=[lock.fileno()], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        lock.close()
        return f"{self.name} venv: building in the background (log: {self.log_path})"


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(command)}\n{(done.stdout + done.stderr)[-4000:]}")
