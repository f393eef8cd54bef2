"""Which Stepwise backends are running, and what their sessions did: the server extension's data.

Every kernel that called `workbench.connect()` announces the backend it uses in
`$STEPWISE_HOME/runtime/<kernel pid>.json` ({base_url, api_key, pid, started, embedded, ...};
see workbench/client/connect.py). `find_backends()` reads those files, drops the stale ones (the kernel
that wrote it is gone) and merges kernels bound to the same backend with the same key.
`read_report()` asks each backend's `GET /api/v1/usage/sessions` with its key, concurrently, and
merges the answers into the one report the sidebar and the status bar draw.

How it works, and why: docs/extension.md, "How it finds the backends", workbench/lab/backends.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kernel_backend.runtime import pid_alive
from workbench.client.connection import stepwise_home

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


# The most sessions a lab remembers (the newest are kept): a bound for a server left running for months.
MAX_REMEMBERED = 1000


class LabMemory:
    """Every session this Jupyter server has seen, at its last known row, kept after it ends or its
    backend goes away; and what was spent in this lab: the sessions created since the server started
    ("running" falls when sessions end; this never does)."""

    def __init__(self, since: dt.datetime | None = None, most: int = MAX_REMEMBERED):
        self.since = since or dt.datetime.now(dt.timezone.utc)
        self.most = most
        # session id -> its latest row. By id alone: a home's backend that stopped and came back (a kernel
        # restarted after it exited unused) is at another URL, and lists the same sessions from the same database.
        self._rows: dict[str, dict] = {}

    def notebook_of(self, session_id: str) -> str | None:
        """The notebook the session's kernel last ran, as last seen (its kernel may be gone now)."""
        return self._rows.get(session_id, {}).get("notebook")

    def update(self, rows: list[dict]) -> None:
        """Learn the rows a poll read (each with its "backend")."""
        for row in rows:
            self._rows[row["session_id"]] = row
        if len(self._rows) > self.most:
            newest = sorted(self._rows.items(), key=lambda item: str(item[1].get("created_at", "")), reverse=True)
            self._rows = dict(newest[:self.most])

    def remembered(self, read: set[str], stopped: set[str], announced: set[str]) -> list[dict]:
        """The sessions seen before that this poll did not read (`read`: their ids), as they stand
        now. A backend that is announced and has not `stopped` is alive: it merely listed them no more
        (past its `limit`) or answered badly this once, so they are as last seen. One that stopped,
        or that no kernel announces any more, took its active sessions down with it."""
        rows = []
        for session_id, row in self._rows.items():
            if session_id in read:
                continue
            backend = row["backend"]
            row = {**row, "remembered": True}
            if backend in stopped or backend not in announced:
                row["sampler_snapshots"] = []  # in-memory, in the backend that went away
                if row.get("status") == "active":
                    row["status"] = "unreachable" if backend in announced else "ended"
            rows.append(row)
        return rows

    def totals(self) -> dict:
        totals: dict[str, Any] = {"since": self.since.isoformat(), "sessions": 0, "prefill_tokens": 0, "sample_tokens": 0,
                  "train_tokens": 0, "cost": 0.0}
        for row in self._rows.values():
            try:
                created = dt.datetime.fromisoformat(row["created_at"])
            except (KeyError, TypeError, ValueError):
                continue
            if created.tzinfo is None:
                created = created.replace(tzinfo=dt.timezone.utc)
            if created >= self.since:
                totals["sessions"] += 1
                for key in ("prefill_tokens", "sample_tokens", "train_tokens", "cost"):
                    totals[key] += row.get(key, 0)
        return totals


async def read_report(backends: list[Backend], limit: int = 50, active_only: bool = False,
                      home: Path | None = None, lab: LabMemory | None = None,
                      notebooks: dict[int, str] | None = None) -> dict:
    """Ask every backend for its sessions and merge the answers (docs/extension.md, "How it finds the backends").

    `lab` (the server's LabMemory) learns the sessions read, adds the ones it remembers and the lab's
    totals; `notebooks` maps the pid of each live kernel to the path of its notebook now (the Jupyter
    server's sessions), so that a session follows its notebook when it is renamed."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        answers = await asyncio.gather(*(_read_one(client, b, limit, active_only) for b in backends))
    lab = lab or LabMemory(dt.datetime.min.replace(tzinfo=dt.timezone.utc))
    notebooks = notebooks or {}
    running: dict[str, Any] = {"sessions": 0, "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 0, "cost": 0.0,
               "by_kind": {kind: {"tokens": 0, "cost": 0.0} for kind in KINDS}}
    sessions: list[dict] = []
    listed: list[dict[str, Any]] = []  # one row per backend
    currency = "USD"
    listed_ids: set[str] = set()  # the sessions already in `sessions`
    for backend, (answer, error, stopped) in zip(backends, answers):
        listed.append({"base_url": backend.base_url, "embedded": backend.embedded, "started": backend.started,
                       "kernel_pids": backend.kernel_pids, "sessions": len(answer["sessions"]) if answer else 0,
                       "error": error, "stopped": stopped,
                       # The budget of the tenant its key belongs to (an operator's), which refuses any of its work.
                       "budget": answer.get("budget") if answer else None})
        if answer is None:
            continue
        currency = answer.get("currency", currency)
        for row in answer["sessions"]:
            if row["session_id"] in listed_ids:
                continue  # two backends of one home's database, for a moment: listed once
            listed_ids.add(row["session_id"])
            # Only a running session has a kernel: an ended one's pid may be another process's by now.
            live = notebooks.get(row.get("kernel_pid")) if row.get("status") == "active" else None
            notebook = live or lab.notebook_of(row["session_id"])
            sessions.append({**row, "backend": backend.base_url, "notebook": notebook, "remembered": False})
        theirs = answer["running"]
        for key in ("sessions", "prefill_tokens", "sample_tokens", "train_tokens", "cost"):
            running[key] += theirs.get(key, 0)
        for kind in KINDS:
            part = theirs.get("by_kind", {}).get(kind, {})
            running["by_kind"][kind]["tokens"] += part.get("tokens", 0)
            running["by_kind"][kind]["cost"] += part.get("cost", 0.0)
    lab.update(sessions)
    remembered = lab.remembered({r["session_id"] for r in sessions},
                                {b["base_url"] for b in listed if b["stopped"]}, {b.base_url for b in backends})
    sessions += [r for r in remembered if r["status"] == "active"] if active_only else remembered
    return {"sessions": sessions, "running": running, "lab": lab.totals(), "backends": listed, "currency": currency,
            "runtime_dir": str(runtime_dir(home)), "message": _message(listed, home)}


async def _read_one(client: httpx.AsyncClient, backend: Backend, limit: int,
                    active_only: bool) -> tuple[dict | None, str | None, bool]:
    """(the backend's answer, None, False), or (None, what went wrong and what to do, whether the
    backend stopped: nothing listens at its address any more)."""
    where = f"the backend at {backend.base_url} (kernel pid {', '.join(map(str, backend.kernel_pids))})"
    hint = f"; its log: {backend.log}" if backend.log else ""
    try:
        response = await client.get(backend.base_url + SESSIONS_PATH,
                                    params={"limit": limit, "active_only": str(active_only).lower()},
                                    headers={"X-API-Key": backend.api_key})
    except httpx.TimeoutException as error:
        return None, (f"{where} did not answer within {TIMEOUT_S:g} s ({type(error).__name__}): busy or hung; "
                      f"its sessions show as last read{hint}"), False
    except httpx.TransportError as error:  # refused, reset, closed: the process is gone
        return None, (f"Backend stopped: {where} does not answer ({type(error).__name__}: {error}); its sessions "
                      f"stay listed with their checkpoints. workbench.connect() starts it again{hint}"), True
    if response.status_code == 404:
        return None, f"{where} has no {SESSIONS_PATH}: it runs an older Stepwise; upgrade it (pip install -U stepwise)", False
    if response.status_code in (401, 403):
        return None, f"{where} refused the kernel's API key (it was revoked?); run workbench.connect() again", False
    if response.status_code >= 400:
        return None, f"{where} answered {response.status_code}: {response.text[:300]}", False
    try:
        answer = response.json()
        if not isinstance(answer.get("sessions"), list) or not isinstance(answer.get("running"), dict):
            raise ValueError("not a sessions report")
    except (ValueError, AttributeError):
        return None, f"{where} answered something that is not a sessions report: {response.text[:200]!r}", False
    return answer, None, False


def _message(listed: list[dict], home: Path | None) -> str | None:
    if not listed:
        return (f"No Stepwise backend is running (none announced in {runtime_dir(home)}). Run "
                "`client = workbench.connect()` in a notebook to start one, or "
                "`workbench.connect(base_url, api_key)` to use a running server.")
    if all(b["error"] for b in listed):
        return "No Stepwise backend answered: " + "; ".join(b["error"] for b in listed)
    return None
