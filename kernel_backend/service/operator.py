"""The operator's view of every tenant (GET /api/v1/admin/tenants, `stepwise admin tenants`).

For each tenant: what it spent and on what (the totals its own GET /api/v1/usage answers, computed by the same
function), its sessions and training runs, its checkpoints and the bytes they take in the store, every budget that
covers its work (its own, by session, run or key, and the operator's on the tenant), and its API keys (made, last
used, revoked). A tenant is any name that has a key, a session or a ledger row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import func, select

from kernel_backend.persistence.database import ApiKeyRow, CheckpointRow, ModelRow, SessionRow, UsageRow
from kernel_backend.service import accounts

if TYPE_CHECKING:
    from kernel_backend.service.core import Service


def tenants_report(svc: Service) -> dict:
    with svc.store.session() as s:
        keys = list(s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at)))
        sessions = dict(s.execute(select(SessionRow.tenant, func.count()).group_by(SessionRow.tenant)).all())
        active = dict(s.execute(select(SessionRow.tenant, func.count()).where(SessionRow.status == "active")
                                .group_by(SessionRow.tenant)).all())
        runs = dict(s.execute(select(ModelRow.tenant, func.count()).group_by(ModelRow.tenant)).all())
        checkpoints = {tenant: (int(count), int(size or 0)) for tenant, count, size in s.execute(
            select(CheckpointRow.tenant, func.count(), func.sum(CheckpointRow.size_bytes)).group_by(CheckpointRow.tenant))}
        billed = set(s.scalars(select(UsageRow.tenant).distinct()))
    names = sorted({k.tenant for k in keys} | set(sessions) | billed)
    rows = []
    for tenant in names:
        totals = accounts.usage_report(svc, tenant, limit=0)["totals"]  # what the tenant's own /usage says
        count, size = checkpoints.get(tenant, (0, 0))
        rows.append({
            "tenant": tenant,
            "spend_usd": totals["cost"], "requests": totals["requests"],
            "tokens": {kind: totals[f"{kind}_tokens"] for kind in ("prefill", "sample", "train")},
            "sessions": int(sessions.get(tenant, 0)), "active_sessions": int(active.get(tenant, 0)),
            "training_runs": int(runs.get(tenant, 0)), "checkpoints": count, "storage_bytes": size,
            "budgets": [svc.budgets.report(b) for b in svc.budgets.of_tenant(tenant)],
            "refused_requests": (svc.refusals.report(tenant) or {}).get("count", 0),
            "keys": [{"prefix": k.prefix, "created_at": _iso(k.created_at), "last_used_at": _iso(k.last_used_at),
                      "revoked_at": _iso(k.revoked_at)} for k in keys if k.tenant == tenant],
        })
    return {"tenants": rows, "currency": "USD"}


def _iso(moment) -> str | None:
    return None if moment is None else accounts.iso(moment)
