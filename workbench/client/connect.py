"""connect(): bind the notebook kernel to a Stepwise backend and hand back a `tinker.ServiceClient`.

Two ways in:

    service = workbench.connect()                      # the local backend of $STEPWISE_HOME
    service = workbench.connect(base_url, api_key)     # a backend that is already running

It finds or starts the local backend (one per STEPWISE_HOME, shared by the home's kernels and scripts),
announces the backend it uses in $STEPWISE_HOME/runtime/<pid>.json, and puts budgets on the kernel's sessions.
It owns the kernel's connection state (`current()`: the active Connection); widgets only read it.

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/client/connect.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from pathlib import Path



from workbench.client import local_backend
from workbench.client.connection import (HEALTH_PATH, BackendError, Connection, budget_amounts, metadata_amount,
                                         stepwise_home)

START_TIMEOUT_S = 600  # the first start converts the default model (about 20-30 s); slow machines need more

_lock = threading.RLock()  # connect() may be called from threads (e.g. a dashboard's poller); keep state whole
_connections: list["Connection"] = []  # every backend this kernel started or bound, oldest first
_current: "Connection | None" = None
_embedded: "Connection | None" = None


def connection_of(client) -> "Connection | None":
    """The Connection of this process to the backend a tinker client talks to, or None."""
    base_url = (getattr(getattr(client, "holder", None), "_base_url", None) or "").rstrip("/")
    for conn in list(_connections):
        if base_url and conn.base_url.rstrip("/") == base_url:
            return conn
    return None


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

    usd, tokens = budget_amounts(budget_usd, budget_tokens)
    budget = {key: metadata_amount(value) for key, value in (("budget_usd", usd), ("budget_tokens", tokens))
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
            if name:  # the name given, not the notebook's: the sidebar shows it (display_name holds either)
                conn.session_metadata["name"] = name
            conn.clients.append(tinker.ServiceClient(base_url=conn.base_url, api_key=conn.api_key,
                                                     display_name=name or default_name(),
                                                     user_metadata=conn.session_metadata))
        elif budget and any(conn.session_metadata.get(key) != value for key, value in budget.items()):
            conn.set_budget(usd, tokens)  # a re-run cell with another budget: the kernel's sessions get it
        _current = conn
        _write_registry(conn)

    from workbench.client import sdk_hooks, tokenizers
    from workbench.widgets.reprs import enable_reprs

    quiet_long_polls()
    sdk_hooks.install(connection_of)  # custom losses reach the ledger, results remember their datums
    tokenizers.install(connection_of)  # get_tokenizer() from the backend's own files, with no Hub wait
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
    conn.check_key()
    _connections.append(conn)
    return conn


# ---- the local backend of $STEPWISE_HOME ------------------------------------------------------------


def _local_connection(timeout: float, progress: bool) -> Connection:
    """The running local backend (shared), or a new one; one process at a time decides which."""
    global _embedded
    if _embedded is not None and _embedded.healthy():
        return _embedded
    if _embedded is not None and _embedded.process is not None and _embedded.process.poll() is None:
        # Ours, and its supervisor is alive: the backend died and is starting again on the same port and key.
        local_backend.wait_healthy(_embedded, timeout, local_backend.StartProgress(progress), what="the restarting embedded backend")
        return _embedded
    if _embedded is not None:  # it went away (killed, or stopped by a disconnect elsewhere): find or start another
        _connections.remove(_embedded)
        _embedded.close(finish_sessions=False)
        _embedded = None
    from kernel_backend.runtime import running_backend, runtime_dir

    home = stepwise_home()
    show = local_backend.StartProgress(progress)
    try:
        with local_backend.start_lock(runtime_dir(home) / "start.lock", show):
            record = running_backend(home)
            conn = local_backend.join(record, timeout, show) if record else local_backend.start(home, timeout, show)
    except BaseException:
        show.finish("The Stepwise backend did not start (the error below says why).")
        raise
    _connections.append(conn)
    _embedded = conn
    return conn




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
