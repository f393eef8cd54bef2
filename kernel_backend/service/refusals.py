"""Requests the service refused at admission, remembered so that whoever sent them sees them.

A budget (402) or a rate limit (429) refuses a request before anything is queued, and the ledger bills nothing for
it, so without this record a refused request leaves no trace the workbench could show: a loop that does not await its
forward_backward goes on to an optim_step that "succeeds" on no gradient, and the sidebar counted that step as merely
skipped. `Service.admit` records each refusal here; the sessions report (service/accounts.py) counts a run's refused
steps apart from its skipped ones and gives each session its refusals, and the usage report gives its scope's, which
the CostMeter and the JupyterLab extension show in red with the server's message.

Kept in memory, the newest `KEEP` of the whole service: a refusal changed nothing, so there is nothing to recover
after a restart; what was refused before it is no longer shown.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import threading

KEEP = 10_000  # refusals remembered (a few hundred bytes each)


@dataclasses.dataclass(frozen=True)
class Refusal:
    tenant: str
    session_id: str | None
    run_id: str | None
    request_type: str  # the ledger's name for the request ("ForwardBackward", "Sample", ...)
    step: int | None  # a training request's ledger step: the optimizer steps its run had taken
    status: int  # the HTTP status the caller got
    message: str  # the server's own message, as the caller got it
    at: dt.datetime
    dedupe_key: str | None = None  # the request's: the SDK sends a refused request again once, still one refusal

    def public(self) -> dict:
        return {"status": self.status, "request_type": self.request_type, "message": self.message,
                "at": self.at.isoformat()}


class Refusals:
    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._kept: collections.deque[Refusal] = collections.deque(maxlen=keep)

    def record(self, refusal: Refusal) -> None:
        with self._lock:
            if refusal.dedupe_key is not None and any(r.dedupe_key == refusal.dedupe_key for r in self._kept):
                self._kept = collections.deque((r for r in self._kept if r.dedupe_key != refusal.dedupe_key),
                                               maxlen=self._kept.maxlen)
            self._kept.append(refusal)

    def of(self, tenant: str, session_id: str | None = None, run_id: str | None = None) -> list[Refusal]:
        """A tenant's refusals, oldest first; only a session's or a run's when one is given."""
        with self._lock:
            kept = list(self._kept)
        return [r for r in kept if r.tenant == tenant and (session_id is None or r.session_id == session_id)
                and (run_id is None or r.run_id == run_id)]

    def report(self, tenant: str, session_id: str | None = None, run_id: str | None = None) -> dict | None:
        """{"count", "last"} for the scope (`last`: the newest, Refusal.public), or None when it has none."""
        mine = self.of(tenant, session_id, run_id)
        return {"count": len(mine), "last": mine[-1].public()} if mine else None

    def refused_steps(self, tenant: str, run_id: str | None) -> dict[int, Refusal]:
        """A run's ledger steps whose forward_backward was refused, each with its newest refusal."""
        return {r.step: r for r in self.of(tenant, run_id=run_id)
                if r.request_type == "ForwardBackward" and r.step is not None}
