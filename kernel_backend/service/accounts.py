"""Accounts: what a tenant's work processed and cost, read from the ledger (one row per completed
request, written with its result) and the checkpoint rows.

`usage_report` and `sessions_report` answer the usage API (kernel_backend/api/usage.py), which the
workbench widgets and the JupyterLab sidebar poll.
"""

from __future__ import annotations

import datetime as dt

from kernel_backend.service.checkpoints import checkpoint_json
from kernel_backend.service.core import Service, iso
from kernel_backend.store import CheckpointRow, ModelRow, SessionRow, UsageRow, now, utc


def usage_report(svc: Service, tenant: str, session_id: str | None = None, training_run_id: str | None = None,
                 since: dt.datetime | None = None, until: dt.datetime | None = None, after: int = 0,
                 limit: int = 1000) -> dict:
    """Totals by kind and cost, plus the per-request series after ledger row `after` (a cursor)."""
    from sqlalchemy import select

    where = [UsageRow.tenant == tenant]
    if session_id:
        where.append(UsageRow.session_id == session_id)
    if training_run_id:
        where.append(UsageRow.model_id == training_run_id)
    if since:
        where.append(UsageRow.created_at >= since)
    if until:
        where.append(UsageRow.created_at < until)
    with svc.store.session() as s:
        per_model = s.execute(_ledger_sums(UsageRow.base_model, *where)).all()
        rows = list(s.scalars(select(UsageRow).where(*where, UsageRow.id > after).order_by(UsageRow.id).limit(limit)))
    return {
        "totals": _totals(svc, per_model),
        "series": [
            {
                "id": r.id, "time": iso(r.created_at), "request_type": r.request_type, "session_id": r.session_id,
                "training_run_id": r.model_id, "sampler_id": r.sampler_id, "base_model": r.base_model, "step": r.step,
                "prefill_tokens": r.prefill_tokens, "sample_tokens": r.sample_tokens, "train_tokens": r.train_tokens,
                "cost": r.cost, "duration_s": r.duration_s, "metrics": r.metrics or {},
            }
            for r in rows
        ],
        "cursor": rows[-1].id if rows else after,
        "currency": "USD",
    }


def _ledger_sums(group, *where):
    """The ledger's sums per value of `group` (a UsageRow column): (group, requests, prefill, sample,
    train, cost) rows."""
    from sqlalchemy import func, select

    return (select(group, func.count(), func.sum(UsageRow.prefill_tokens), func.sum(UsageRow.sample_tokens),
                   func.sum(UsageRow.train_tokens), func.sum(UsageRow.cost))
            .where(*where).group_by(group))


def _totals(svc: Service, per_model) -> dict:
    """Requests, tokens by kind and cost, from _ledger_sums rows per base model; each kind priced at its
    model's rate."""
    by_kind = {kind: {"tokens": 0, "cost": 0.0} for kind in ("prefill", "sample", "train")}
    requests, cost = 0, 0.0
    for base_model, count, prefill, sample, train, model_cost in per_model:
        price = svc.prices.for_model(base_model)
        requests += count
        cost += model_cost or 0.0
        for kind, tokens in (("prefill", prefill), ("sample", sample), ("train", train)):
            by_kind[kind]["tokens"] += int(tokens or 0)
            by_kind[kind]["cost"] += int(tokens or 0) * price[kind] / 1e6
    return {
        "requests": requests,
        "prefill_tokens": by_kind["prefill"]["tokens"],
        "sample_tokens": by_kind["sample"]["tokens"],
        "train_tokens": by_kind["train"]["tokens"],
        "cost": cost,
        "by_kind": by_kind,
    }


def sessions_report(svc: Service, tenant: str, active_only: bool = False, limit: int = 50) -> dict:
    """One row per session, newest first, for dashboards (the JupyterLab sidebar): its run's base model
    and rank, optim steps, last loss, tokens and cost, and checkpoints; plus totals of the active ones.

    Computed from the store and the ledger in a few grouped queries, so polling it every second is cheap.
    """
    from sqlalchemy import func, select

    where = [SessionRow.tenant == tenant] + ([SessionRow.status == "active"] if active_only else [])
    with svc.store.session() as s:
        sessions = list(s.scalars(select(SessionRow).where(*where).order_by(SessionRow.created_at.desc()).limit(limit)))
        ids = [r.id for r in sessions]
        runs = list(s.scalars(select(ModelRow).where(ModelRow.session_id.in_(ids)).order_by(ModelRow.created_at)))
        totals = {row[0]: row[2:] for row in s.execute(_ledger_sums(UsageRow.session_id, UsageRow.session_id.in_(ids)))}
        steps = dict(s.execute(select(UsageRow.session_id, func.count()).where(
            UsageRow.session_id.in_(ids), UsageRow.request_type == "OptimStep").group_by(UsageRow.session_id)).all())
        last_fb = {}  # session -> metrics of its newest forward_backward
        newest = (select(UsageRow.session_id, func.max(UsageRow.id)).where(
            UsageRow.session_id.in_(ids), UsageRow.request_type == "ForwardBackward").group_by(UsageRow.session_id))
        for session_id, row_id in s.execute(newest).all():
            last_fb[session_id] = (s.get(UsageRow, row_id).metrics or {})
        checkpoints = list(s.scalars(select(CheckpointRow).where(
            CheckpointRow.model_id.in_([r.id for r in runs])).order_by(CheckpointRow.created_at.desc())))
        # The running totals cover every active session, not only the `limit` listed.
        active = select(SessionRow.id).where(SessionRow.tenant == tenant, SessionRow.status == "active")
        running = {"sessions": s.scalar(select(func.count()).select_from(active.subquery())),
                   **_totals(svc, s.execute(_ledger_sums(UsageRow.base_model, UsageRow.session_id.in_(active))).all())}

    runs_of = {i: [r for r in runs if r.session_id == i] for i in ids}
    session_of_run = {r.id: r.session_id for r in runs}
    moment = now()
    rows = []
    for session in sessions:
        prefill, sample, train, cost = totals.get(session.id, (0, 0, 0, 0.0))
        first = runs_of[session.id][0] if runs_of[session.id] else None
        row = {
            "session_id": session.id,
            "status": session.status,
            "display_name": session.display_name,
            "created_at": iso(session.created_at),
            "age_s": round((moment - utc(session.created_at)).total_seconds(), 1),
            "base_model": first.base_model if first else None,
            "lora_rank": first.lora_config["rank"] if first else None,
            "training_run_ids": [r.id for r in runs_of[session.id]],
            "steps": int(steps.get(session.id, 0)),
            "last_loss": last_fb.get(session.id, {}).get("loss:sum"),
            "prefill_tokens": int(prefill or 0),
            "sample_tokens": int(sample or 0),
            "train_tokens": int(train or 0),
            "cost": float(cost or 0.0),
            "checkpoints": [
                {**checkpoint_json(c), "training_run_id": c.model_id}
                for c in checkpoints if session_of_run[c.model_id] == session.id
            ],
        }
        rows.append(row)
    return {"sessions": rows, "running": running, "currency": "USD"}
