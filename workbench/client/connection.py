"""A backend this process talks to: its URL and key, the tinker ServiceClients handed out for it, and
small httpx helpers for the usage and budget APIs (what the widgets read).

workbench/client/connect.py decides which backend that is (and keeps the kernel's current one); a Connection only
talks to it, and stops the process it started (the local backend, workbench/client/local_backend.py) when asked.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx


HEALTH_PATH = "/api/v1/healthz"
BUDGETS_PATH = "/api/v1/budgets"


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
        totals: dict[str, Any] = {"requests": 0, "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 0, "cost": 0.0,
                  "by_kind": {kind: {"tokens": 0, "cost": 0.0} for kind in ("prefill", "sample", "train")}}
        currency, budgets, refused = "USD", [], []
        tenant = self.usage(limit=1)  # the tenant's own budget (an operator's), which refuses any session's work
        budgets += [tenant["budget"]] if tenant.get("budget") else []
        for session_id in self.session_ids():
            report = self.usage(session_id=session_id, limit=1)
            currency = report.get("currency", currency)
            budgets += [report["budget"]] if report.get("budget") else []
            refused.append(report.get("refusals"))
            for key in ("requests", "prefill_tokens", "sample_tokens", "train_tokens", "cost"):
                totals[key] += report["totals"][key]
            for kind, part in report["totals"]["by_kind"].items():
                totals["by_kind"][kind]["tokens"] += part["tokens"]
                totals["by_kind"][kind]["cost"] += part["cost"]
        return {"totals": totals, "series": [], "cursor": 0, "currency": currency, "budget": tightest_budget(budgets),
                "refusals": combined_refusals(refused)}

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
        usd, tokens = budget_amounts(usd, tokens)
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
            return [("run", _known_id(run_id_of(training_run_id), "training run", training_run_id))]
        if session_id is not None:
            return [("session", _known_id(session_id_of(session_id), "session", session_id))]
        return [("session", s) for s in self.session_ids()]

    def _remember_kernel_budget(self, budget: dict) -> None:
        """The kernel's budget in the sessions' user_metadata: what the SDK sends when it opens a session
        (a later one gets it too), and what a re-run connect(budget_usd=...) compares its own with."""
        for key, value in budget.items():
            if value is None:
                self.session_metadata.pop(key, None)
            else:
                self.session_metadata[key] = metadata_amount(value)

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

    def check_key(self) -> None:
        """healthz needs no key; a cheap authenticated read tells a wrong key now, not at the first call."""
        response = self.http.get("/api/v1/usage", params={"limit": 1})
        if response.status_code in (401, 403):
            self.close(finish_sessions=False)
            raise BackendError(f"the backend at {self.base_url} refused the API key: {response.json().get('detail', '')}")

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



BUDGET_STATES = ("ok", "warning", "exhausted")  # kernel_backend/service/budgets.py: "warning" from 80%; "exhausted" refuses


def tightest_budget(budgets: list[dict]) -> dict | None:
    """The budget nearest to refusing work: the worst state, then the largest fraction spent."""
    def severity(budget: dict) -> tuple[int, float]:
        state = budget.get("state")
        return BUDGET_STATES.index(state) if state in BUDGET_STATES else 0, float(budget.get("fraction") or 0)

    return max(budgets, key=severity, default=None)


def combined_refusals(reports: list[dict | None]) -> dict | None:
    """The usage API's `refusals` of several scopes as one: their count, and the newest refusal of them all."""
    given = [r for r in reports if r]
    if not given:
        return None
    return {"count": sum(int(r["count"]) for r in given), "last": max((r["last"] for r in given), key=lambda x: x["at"])}


def refusal_text(refusals: dict | None) -> str:
    """What the service refused, in words: "3 requests refused · the last, a ForwardBackward: 402 <its message>"."""
    if not refusals:
        return ""
    count, last = int(refusals["count"]), refusals["last"]
    return (f"{count} request{'s' * (count != 1)} refused · the last, a {last['request_type']}: "
            f"{last['status']} {last['message']}")


def budget_amounts(usd, tokens) -> tuple[float | None, int | None]:
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


def metadata_amount(value: float | int) -> str:
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


def stepwise_home() -> Path:
    return Path(os.environ.get("STEPWISE_HOME") or Path.home() / ".cache" / "stepwise").expanduser()


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


def _known_id(found: str | None, kind: str, given) -> str:
    """An id run_id_of / session_id_of found for a budget call, or a clear error where they found none
    (the call's URL could not have been built from None)."""
    if found is None:
        raise ValueError(f"no {kind} id found in {given!r}")
    return found


def run_id_of(training_run) -> str | None:
    """A training run id from a string or a tinker.TrainingClient."""
    if training_run is None or isinstance(training_run, str):
        return training_run
    return training_run.model_id
