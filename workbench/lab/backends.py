"""Which Stepwise backends are running, and what their sessions did: the server extension's data.

Every kernel that called `workbench.connect()` announces the backend it uses in
`$STEPWISE_HOME/runtime/<kernel pid>.json` ({base_url, api_key, pid, started, embedded, ...};
see workbench/connect.py). `find_backends()` reads those files, drops the stale ones (the kernel
that wrote it is gone) and merges kernels bound to the same backend with the same key.
`read_report()` asks each backend's `GET /api/v1/usage/sessions` with its key, concurrently, and
merges the answers into the one report the sidebar and the status bar draw:

    {"sessions": [... each row of the usage API, plus "backend": base_url],
     "running": {"sessions", "prefill_tokens", "sample_tokens", "train_tokens", "cost",
                 "by_kind": {"prefill"|"sample"|"train": {"tokens", "cost"}}},
     "lab": {"since", "sessions", "prefill_tokens", "sample_tokens", "train_tokens", "cost"},
     "backends": [{"base_url", "embedded", "kernel_pids", "started", "sessions", "error"}],
     "currency": "USD", "runtime_dir": str, "message": str | None}

A backend that does not answer is listed with its `error`; `message` says, in words that name the
fix, why there is nothing to show. Keys stay on this side: nothing here returns one.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kernel_backend.runtime import pid_alive
from workbench.connect import stepwise_home

SESSIONS_PATH = "/api/v1/usage/sessions"
TIMEOUT_S = 5.0  # a poll every second or two must not pile up behind a backend that hangs
KINDS = ("prefill", "sample", "train")


@dataclass
class Backend:
    """One backend, and the live kernels that use it with the same key."""

    base_url: str
    api_key: str = field(repr=False)
    embedded: bool
    started: str
    kernel_pids: list[int] = field(default_factory=list)
    log: str | None = None


def runtime_dir(home: Path | None = None) -> Path:
    return (home or stepwise_home()) / "runtime"


def find_backends(home: Path | None = None) -> list[Backend]:
    """The backends announced under `home`/runtime by kernels that are still alive, oldest first."""
    found: dict[tuple[str, str], Backend] = {}
    for path in sorted(runtime_dir(home).glob("*.json")):
        if not path.stem.isdigit():
            continue  # backend.json: the backend's own file, not a client's
        try:
            record = json.loads(path.read_text())
            pid, base_url, api_key = int(record["pid"]), str(record["base_url"]).rstrip("/"), str(record["api_key"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, or not one of ours; connect() writes atomically, so not half-written
        if not pid_alive(pid):
            continue  # the kernel was killed before it could remove its file
        backend = found.setdefault((base_url, api_key), Backend(
            base_url=base_url, api_key=api_key, embedded=bool(record.get("embedded")),
            started=str(record.get("started", "")), log=record.get("log")))
        backend.kernel_pids.append(pid)
    return sorted(found.values(), key=lambda b: b.started)


class LabTotals:
    """What was spent in this lab: every session created since this Jupyter server started, at its
    last known tokens and cost, kept after the session ends or its backend goes away. "running"
    falls when sessions end; this never does."""

    def __init__(self, since: dt.datetime | None = None):
        self.since = since or dt.datetime.now(dt.timezone.utc)
        self._sessions: dict[tuple[str, str], dict] = {}  # (backend, session id) -> its latest numbers

    def update(self, sessions: list[dict]) -> None:
        for row in sessions:
            try:
                created = dt.datetime.fromisoformat(row["created_at"])
            except (KeyError, TypeError, ValueError):
                continue
            if created.tzinfo is None:
                created = created.replace(tzinfo=dt.timezone.utc)
            if created >= self.since:
                self._sessions[(row["backend"], row["session_id"])] = {
                    key: row.get(key, 0) for key in ("prefill_tokens", "sample_tokens", "train_tokens", "cost")}

    def totals(self) -> dict:
        totals = {"since": self.since.isoformat(), "sessions": len(self._sessions), "prefill_tokens": 0,
                  "sample_tokens": 0, "train_tokens": 0, "cost": 0.0}
        for numbers in self._sessions.values():
            for key, value in numbers.items():
                totals[key] += value
        return totals


async def read_report(backends: list[Backend], limit: int = 50, active_only: bool = False,
                      home: Path | None = None, lab: LabTotals | None = None) -> dict:
    """Ask every backend for its sessions and merge the answers (see the module docstring); `lab`
    (the server's LabTotals) learns the sessions seen and adds the lab's totals."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        answers = await asyncio.gather(*(_read_one(client, b, limit, active_only) for b in backends))
    running = {"sessions": 0, "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 0, "cost": 0.0,
               "by_kind": {kind: {"tokens": 0, "cost": 0.0} for kind in KINDS}}
    sessions, listed, currency = [], [], "USD"
    for backend, (answer, error) in zip(backends, answers):
        listed.append({"base_url": backend.base_url, "embedded": backend.embedded, "started": backend.started,
                       "kernel_pids": backend.kernel_pids, "sessions": len(answer["sessions"]) if answer else 0,
                       "error": error})
        if answer is None:
            continue
        currency = answer.get("currency", currency)
        sessions += [{**row, "backend": backend.base_url} for row in answer["sessions"]]
        theirs = answer["running"]
        for key in ("sessions", "prefill_tokens", "sample_tokens", "train_tokens", "cost"):
            running[key] += theirs.get(key, 0)
        for kind in KINDS:
            part = theirs.get("by_kind", {}).get(kind, {})
            running["by_kind"][kind]["tokens"] += part.get("tokens", 0)
            running["by_kind"][kind]["cost"] += part.get("cost", 0.0)
    lab = lab or LabTotals(dt.datetime.min.replace(tzinfo=dt.timezone.utc))
    lab.update(sessions)
    return {"sessions": sessions, "running": running, "lab": lab.totals(), "backends": listed, "currency": currency,
            "runtime_dir": str(runtime_dir(home)), "message": _message(listed, home)}


async def _read_one(client: httpx.AsyncClient, backend: Backend, limit: int,
                    active_only: bool) -> tuple[dict | None, str | None]:
    """(the backend's answer, None), or (None, what went wrong and what to do)."""
    where = f"the backend at {backend.base_url} (kernel pid {', '.join(map(str, backend.kernel_pids))})"
    try:
        response = await client.get(backend.base_url + SESSIONS_PATH,
                                    params={"limit": limit, "active_only": str(active_only).lower()},
                                    headers={"X-API-Key": backend.api_key})
    except httpx.HTTPError as error:
        hint = f"; its log: {backend.log}" if backend.log else ""
        return None, f"{where} did not answer ({type(error).__name__}: {error}); restart it with workbench.connect(){hint}"
    if response.status_code == 404:
        return None, f"{where} has no {SESSIONS_PATH}: it runs an older Stepwise; upgrade it (pip install -U stepwise)"
    if response.status_code in (401, 403):
        return None, f"{where} refused the kernel's API key (it was revoked?); run workbench.connect() again"
    if response.status_code >= 400:
        return None, f"{where} answered {response.status_code}: {response.text[:300]}"
    try:
        answer = response.json()
        if not isinstance(answer.get("sessions"), list) or not isinstance(answer.get("running"), dict):
            raise ValueError("not a sessions report")
    except (ValueError, AttributeError):
        return None, f"{where} answered something that is not a sessions report: {response.text[:200]!r}"
    return answer, None


def _message(listed: list[dict], home: Path | None) -> str | None:
    if not listed:
        return (f"No Stepwise backend is running (none announced in {runtime_dir(home)}). Run "
                "`client = workbench.connect()` in a notebook to start one, or "
                "`workbench.connect(base_url, api_key)` to use a running server.")
    if all(b["error"] for b in listed):
        return "No Stepwise backend answered: " + "; ".join(b["error"] for b in listed)
    return None
