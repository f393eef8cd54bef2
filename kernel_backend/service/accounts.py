"""Accounts: who the caller is, what their work processed and cost, and what they changed.

Read from the ledger (one row per completed request, written with its result), the checkpoint rows
and the audit log:

    usage_report, sessions_report    the usage API (kernel_backend/api/usage.py) that the workbench
                                     widgets and the JupyterLab sidebar poll
    set_budget, delete_budget        the budgets API (kernel_backend/api/budgets.py; the counting is in
                                     kernel_backend/service/budgets.py)
    billing_usage                    AdminClient.get_billing_usage: hourly buckets of tokens and cost
    checkpoint_storage_usage         AdminClient.get_current_checkpoint_storage_usage
    audit_log                        AdminClient.get_audit_log: a UTC day of the audit log
    auth_token                       the short-lived JWT the SDK exchanges its API key for (whoami reads it)

A tenant is one user and one organisation here: `user_urn(tenant)`, org id = tenant.
"""

from __future__ import annotations

import datetime as dt
import math

from sqlalchemy import func, select

from kernel_backend.metering import LOSS_TOKENS
from kernel_backend.service import budgets, sessions
from kernel_backend.persistence import api_keys, signing
from kernel_backend.service.checkpoints import SNAPSHOTS_PER_RUN, checkpoint_json, lineage
from kernel_backend.service.core import Service, audit, iso, user_urn
from kernel_backend.errors import NotFound, UserError
from kernel_backend.persistence.database import AuditRow, CheckpointRow, ModelRow, SamplerRow, SessionRow, UsageRow, now, utc

# The longest window get_billing_usage answers, as Tinker's.
MAX_BILLING_WINDOW = dt.timedelta(days=14)
# Ledger token columns -> the billing event each becomes (forward-only passes are metered as prefill).
BILLING_KINDS = {"train": "training", "prefill": "sampling_prefill", "sample": "sampling_sample"}
AUDIT_EVENT_TYPES = {"all": None, "checkpoints": "checkpoint_", "projects": "project_", "teams": "team_",
                     "organizations": "organization_"}
# The most audit entries one day's answer holds.
MAX_AUDIT_ENTRIES = 100_000
BYTES_PER_GB = 10**9


def usage_report(svc: Service, tenant: str, session_id: str | None = None, training_run_id: str | None = None,
                 since: dt.datetime | None = None, until: dt.datetime | None = None, after: int = 0,
                 limit: int = 1000) -> dict:
    """Totals by kind and cost, plus the per-request series after ledger row `after` (a cursor), and the
    budget of the scope asked for (the run's when training_run_id is given, else the session's when session_id
    is, else the tenant's; None if that scope has none).

    A training run's scope holds its own requests and the sampling done with its weights (its
    rollouts, most of an RL run's work), whichever session the sampler was opened in."""
    where = [UsageRow.tenant == tenant]
    if session_id:
        where.append(UsageRow.session_id == session_id)
    if training_run_id:
        where += budgets.ledger_scope(tenant, "run", training_run_id)
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
        "budget": svc.budgets.report(svc.budgets.get(*(("run", training_run_id) if training_run_id else
                                                       ("session", session_id) if session_id else ("tenant", tenant)))),
        "refusals": svc.refusals.report(tenant, session_id, training_run_id),  # requests refused in the scope, if any
    }


def record_custom_loss(svc: Service, tenant: str, training_run_id: str, surrogate_loss: float,
                       metrics: dict[str, float]) -> dict:
    """forward_backward_custom runs the user's loss in the client and sends a linear surrogate: the
    client reports the loss its function returned (metrics["loss:sum"]) for the ForwardBackward row
    that carried the surrogate, which the row then keeps as "surrogate_loss:sum"."""
    if "loss:sum" not in metrics or not all(math.isfinite(v) for v in metrics.values()):
        raise UserError("metrics must hold a finite 'loss:sum' (the custom loss), and only finite numbers")
    with svc.store.session.begin() as s:
        recent = s.scalars(select(UsageRow).where(
            UsageRow.tenant == tenant, UsageRow.model_id == training_run_id, UsageRow.request_type == "ForwardBackward",
        ).order_by(UsageRow.id.desc()).limit(8))
        for row in recent:
            loss = (row.metrics or {}).get("loss:sum")
            if (loss is not None and "surrogate_loss:sum" not in row.metrics
                    and math.isclose(loss, surrogate_loss, rel_tol=1e-5, abs_tol=1e-9)):
                row.metrics = {**row.metrics, **metrics, "surrogate_loss:sum": loss}
                return {"usage_id": row.id}
    raise NotFound(f"no recent forward_backward of {training_run_id!r} has the surrogate loss {surrogate_loss}")


def _ledger_sums(group, *where):
    """The ledger's sums per value of `group` (a UsageRow column): (group, requests, prefill, sample,
    train, cost) rows."""
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
    """One row per session, newest first, for dashboards (the JupyterLab sidebar): its base model and
    rank, each training run's steps and last loss, tokens and cost, its checkpoints and in-memory
    sampler snapshots; plus totals of the active ones.

    Computed from the store and the ledger in a few grouped queries, so polling it every second is cheap.
    """
    where = [SessionRow.tenant == tenant] + ([SessionRow.status == "active"] if active_only else [])
    with svc.store.session() as s:
        sessions = list(s.scalars(select(SessionRow).where(*where).order_by(SessionRow.created_at.desc()).limit(limit)))
        ids = [r.id for r in sessions]
        runs = list(s.scalars(select(ModelRow).where(ModelRow.session_id.in_(ids)).order_by(ModelRow.created_at)))
        run_ids = [r.id for r in runs]
        totals = {row[0]: row[2:] for row in s.execute(_ledger_sums(UsageRow.session_id, UsageRow.session_id.in_(ids)))}
        run_cost = {row[0]: float(row[5] or 0.0) for row in s.execute(_ledger_sums(UsageRow.model_id,
                                                                               UsageRow.model_id.in_(run_ids)))}
        steps = dict(s.execute(select(UsageRow.model_id, func.count()).where(
            UsageRow.model_id.in_(run_ids), UsageRow.request_type == "OptimStep").group_by(UsageRow.model_id)).all())
        last_fb = {}  # run -> metrics of its newest forward_backward
        last_loss = {}  # run -> its newest step's loss: its step, and per token where every pass of it counted its tokens
        newest = (select(UsageRow.model_id, func.max(UsageRow.id)).where(
            UsageRow.model_id.in_(run_ids), UsageRow.request_type == "ForwardBackward").group_by(UsageRow.model_id))
        for run_id, row_id in s.execute(newest).all():
            row = s.get_one(UsageRow, row_id)  # (just found by its id, in this transaction)
            last_fb[run_id] = (row.metrics or {})
            last_loss[run_id] = _step_loss(s, row)
        # Optimizer steps with no forward_backward before them (an RL step whose groups all tied): a forward_backward's
        # ledger step is the optimizer steps taken before it, so step k trained on something if one has step k - 1.
        # A step whose forward_backward the service refused (a budget, a rate limit: service/refusals.py) is counted
        # as refused, not skipped: the loop sent the work and was told no.
        skipped, refused = {}, {}
        for run_id, taken in steps.items():
            trained = set(s.scalars(select(func.distinct(UsageRow.step)).where(
                UsageRow.model_id == run_id, UsageRow.request_type == "ForwardBackward", UsageRow.step < taken)))
            untrained = set(range(int(taken))) - trained
            refused[run_id] = {step: r for step, r in svc.refusals.refused_steps(tenant, run_id).items()
                               if step in untrained}
            skipped[run_id] = len(untrained) - len(refused[run_id])
        checkpoints = list(s.scalars(select(CheckpointRow).where(
            CheckpointRow.model_id.in_(run_ids)).order_by(CheckpointRow.created_at.desc())))
        snapshots = list(s.scalars(select(SamplerRow).where(  # made in their run's session (indexed)
            SamplerRow.session_id.in_(ids), SamplerRow.source_model_id.in_(run_ids))
            .order_by(SamplerRow.created_at.desc())))
        # The running totals cover every active session, not only the `limit` listed.
        active = select(SessionRow.id).where(SessionRow.tenant == tenant, SessionRow.status == "active")
        running = {"sessions": s.scalar(select(func.count()).select_from(active.subquery())),
                   **_totals(svc, s.execute(_ledger_sums(UsageRow.base_model, UsageRow.session_id.in_(active))).all())}

    limits = {(b.scope, b.target): b for b in svc.budgets.of_tenant(tenant)}

    def budget(scope: str, target: str) -> dict | None:
        return svc.budgets.report(limits.get((scope, target)))

    runs_of = {i: [r for r in runs if r.session_id == i] for i in ids}
    session_of_run: dict[str | None, str] = {r.id: r.session_id for r in runs}  # (a checkpoint's run may be None)
    moment = now()
    rows = []
    for session in sessions:
        prefill, sample, train, cost = totals.get(session.id, (0, 0, 0, 0.0))
        mine = runs_of[session.id]
        first = mine[0] if mine else None
        # Each run on its own: a session's runs are separate models, their steps are not one count.
        # Its user_metadata carries its name; a fork's lineage is in fields of its own (checkpoints.lineage).
        run_rows = [{"training_run_id": r.id, "base_model": r.base_model, "lora_rank": r.lora_config["rank"],
                 **lineage(r), "steps": int(steps.get(r.id, 0)), "last_loss": last_fb.get(r.id, {}).get("loss:sum"),
                 **last_loss.get(r.id, {"loss_step": None, "loss_per_token": None}),
                 "skipped_steps": skipped.get(r.id, 0),
                 "refused_steps": len(refused.get(r.id, {})),
                 "last_refusal": max(refused[r.id].values(), key=lambda x: x.at).public() if refused.get(r.id) else None,
                 "cost": run_cost.get(r.id, 0.0),  # its own training work (its rollouts are in the run scope of usage)
                 "budget": budget("run", r.id),
                 "user_metadata": {k: str(v) for k, v in (r.user_metadata or {}).items()}} for r in mine]
        rows.append({
            "session_id": session.id,
            "status": session.status,
            "display_name": session.display_name or session.client_name,  # a plain SDK script: its file's name
            # The user's own: workbench.connect(name=...) puts the name it was given there ({"name": ...}), which the
            # sidebar shows rather than the notebook's file name.
            "user_metadata": {k: str(v) for k, v in (session.user_metadata or {}).items()},
            # The process that opened it, on this machine (workbench.connect() sets it; a plain SDK client's is found
            # by its socket): the JupyterLab server extension finds the notebook a kernel runs now from it, after a
            # rename too, so a notebook that uses the SDK alone is listed under its notebook as well.
            "kernel_pid": session.local_pid,
            "created_at": iso(session.created_at),
            "age_s": round((moment - utc(session.created_at)).total_seconds(), 1),
            "base_model": first.base_model if first else None,
            "lora_rank": first.lora_config["rank"] if first else None,
            "worker": svc.executor.worker_of(first.id) if first else None,  # with Ray workers: where its first run lives
            "training_run_ids": [r.id for r in mine],
            "runs": run_rows,
            "steps": sum(run["steps"] for run in run_rows),
            # the newest run's that has one (what a single-number summary shows)
            "last_loss": next((run["last_loss"] for run in reversed(run_rows) if run["last_loss"] is not None), None),
            "prefill_tokens": int(prefill or 0),
            "sample_tokens": int(sample or 0),
            "train_tokens": int(train or 0),
            "cost": float(cost or 0.0),
            "budget": budget("session", session.id),
            "refusals": svc.refusals.report(tenant, session.id),  # what the service refused it (service/refusals.py)
            "checkpoints": [
                {**checkpoint_json(c), "training_run_id": c.model_id}
                for c in checkpoints if session_of_run[c.model_id] == session.id
            ],
            "sampler_snapshots": _kept_snapshots(
                [r for r in snapshots if session_of_run[r.source_model_id] == session.id]),
        })
    return {"sessions": rows, "running": running, "currency": "USD", "budget": budget("tenant", tenant)}


def _step_loss(s, newest: UsageRow) -> dict:
    """The loss of a run's newest forward_backward's step (`newest`: that row): the step it counts for (the
    optimizer steps before it, plus one, as the Dashboard numbers steps) and the loss per token of the step's
    passes since the optimizer step before it (gradient accumulation: their loss:sum over their loss_tokens,
    metering.LOSS_TOKENS). None per token where a pass did not count its tokens (a ledger row from before) or
    ran a custom loss (forward_backward_custom: the loss is the user's function's, over tokens it does not say)."""
    if newest.step is None:
        return {"loss_step": None, "loss_per_token": None}
    since = s.scalar(select(func.max(UsageRow.id)).where(
        UsageRow.model_id == newest.model_id, UsageRow.request_type == "OptimStep", UsageRow.id < newest.id)) or 0
    passes = [r.metrics or {} for r in s.scalars(select(UsageRow).where(
        UsageRow.model_id == newest.model_id, UsageRow.request_type == "ForwardBackward", UsageRow.id > since,
        UsageRow.step == newest.step))]
    per_token = None
    if all("loss:sum" in m and LOSS_TOKENS in m and "surrogate_loss:sum" not in m for m in passes):
        tokens = sum(m[LOSS_TOKENS] for m in passes)
        per_token = sum(m["loss:sum"] for m in passes) / tokens if tokens > 0 else None
    return {"loss_step": newest.step + 1, "loss_per_token": per_token}


def _kept_snapshots(samplers: list[SamplerRow]) -> list[dict]:
    """The in-memory sampler snapshots (save_weights_and_get_sampling_client) a session's runs still
    hold, newest first: each run keeps its newest SNAPSHOTS_PER_RUN (ops.snapshot drops older ones),
    while the backend runs. They have no tinker:// path; save_weights_for_sampler(name) makes one."""
    kept: list[dict] = []
    per_run: dict[str | None, int] = {}
    for row in samplers:  # newest first
        per_run[row.source_model_id] = per_run.get(row.source_model_id, 0) + 1
        if per_run[row.source_model_id] <= SNAPSHOTS_PER_RUN:
            kept.append({"sampler_id": row.id, "training_run_id": row.source_model_id, "time": iso(row.created_at)})
    return kept


# ---- budgets --------------------------------------------------------------------------------------


def budget_owner(svc: Service, tenant: str, scope: str, target: str) -> str:
    """Whose budget (scope, target) is, once it is clear that `tenant` may see it: its own session, run or
    key; a tenant's budget is the tenant's (only the operator sets it: api/budgets.py)."""
    if scope == "session":
        svc.session(tenant, target)
    elif scope == "run":
        svc.run(tenant, target)
    elif scope == "key":
        if not any(k.prefix == target and k.tenant == tenant and k.revoked_at is None for k in api_keys.list_keys(svc.store)):
            raise NotFound(f"no live API key of yours has the prefix {target!r} (`stepwise keys list` shows them)")
    else:
        return target
    return tenant


def set_budget(svc: Service, tenant: str, scope: str, target: str, usd, tokens) -> dict | None:
    """Set or change a budget; from the next request on, admission counts against the new one."""
    owner = budget_owner(svc, tenant, scope, target)
    row = svc.budgets.set(owner, scope, target, usd, tokens)
    svc.store.add(audit(owner, "budget_set", tenant, scope=scope, target=target, budget_usd=row.usd,
                        budget_tokens=row.tokens))
    return svc.budgets.report(row)


def delete_budget(svc: Service, tenant: str, scope: str, target: str) -> dict:
    owner = budget_owner(svc, tenant, scope, target)
    if not svc.budgets.delete(scope, target):
        raise NotFound(f"{scope} {target} has no budget")
    svc.store.add(audit(owner, "budget_deleted", tenant, scope=scope, target=target))
    return {"deleted": True, "scope": scope, "target": target}


# ---- billing ----------------------------------------------------------------------------------------


def _hour(t: dt.datetime, name: str) -> dt.datetime:
    t = utc(t).astimezone(dt.timezone.utc)
    if (t.minute, t.second, t.microsecond) != (0, 0, 0):
        raise UserError(f"{name} must be on a UTC hour boundary (like 2026-01-31T14:00:00Z), got {t.isoformat()}")
    return t


def billing_usage(svc: Service, tenant: str, starting_on: dt.datetime, ending_before: dt.datetime) -> dict:
    """Hourly buckets of the tenant's training, prefill and sampled tokens (per base model and session) with
    their cost at today's prices, and of checkpoints saved, in [starting_on, ending_before)."""
    start, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
    if start > now():
        raise UserError(f"starting_on {start.isoformat()} is in the future")
    if not start < end <= start + MAX_BILLING_WINDOW:
        raise UserError(f"ending_before must be after starting_on and at most {MAX_BILLING_WINDOW.days} days later")
    tokens: dict[tuple, int] = {}  # (hour, base model, session, kind) -> tokens
    with svc.store.session() as s:
        rows = s.execute(select(UsageRow.created_at, UsageRow.base_model, UsageRow.session_id, UsageRow.train_tokens,
                                UsageRow.prefill_tokens, UsageRow.sample_tokens)
                         .where(UsageRow.tenant == tenant, UsageRow.created_at >= start, UsageRow.created_at < end))
        for created, base_model, session_id, train, prefill, sample in rows:
            hour = utc(created).replace(minute=0, second=0, microsecond=0)
            for kind, count in (("train", train), ("prefill", prefill), ("sample", sample)):
                if count:
                    key = (hour, base_model, session_id, kind)
                    tokens[key] = tokens.get(key, 0) + count
        saved = s.execute(select(AuditRow.created_at, AuditRow.details).where(
            AuditRow.tenant == tenant, AuditRow.event == "checkpoint_created",
            AuditRow.created_at >= start, AuditRow.created_at < end)).all()
    checkpoints: dict[tuple, int] = {}  # (hour, session) -> checkpoints saved
    for created, details in saved:
        slot = (utc(created).replace(minute=0, second=0, microsecond=0), str(details.get("model_id", "")).split(":")[0])
        checkpoints[slot] = checkpoints.get(slot, 0) + 1
    session_rows = {r.id: r for r in svc.store.list(SessionRow, SessionRow.tenant == tenant, SessionRow.id.in_(
        sorted({k[2] for k in tokens if k[2]} | {k[1] for k in checkpoints if k[1]})))}

    def envelope(hour, base_model, session_id) -> dict:
        session = session_rows.get(session_id)
        return {"bucket_start": iso(hour), "bucket_end": iso(hour + dt.timedelta(hours=1)), "base_model": base_model,
                "user_id": user_urn(tenant), "user_name": tenant, "session_id": session.id if session else None,
                "project_id": sessions.project_of(session) if session else None}

    events = []
    for (hour, base_model, session_id, kind), count in tokens.items():
        rate = svc.prices.for_model(base_model)[kind]
        info = {"type": BILLING_KINDS[kind], "token_count": count} | ({"cached": False} if kind == "prefill" else {})
        events.append({**envelope(hour, base_model, session_id), "estimated_cost_usd": count * rate / 1e6,
                       "effective_rate_usd_per_million_tokens": rate, "event_info": info})
    for (hour, session_id), count in checkpoints.items():
        events.append({**envelope(hour, None, session_id), "event_info": {"type": "checkpoint", "count": count}})
    events.sort(key=lambda e: (e["bucket_start"], -e["event_info"].get("token_count", 0)))
    return {
        "data": events,
        "sessions": {r.id: {"user_metadata": {k: str(v) for k, v in (r.user_metadata or {}).items()} or None}
                     for r in session_rows.values()},
        "cost_data_through": None,  # every estimate uses today's price table (kernel_backend/prices.toml)
    }


def checkpoint_storage_usage(svc: Service, tenant: str, project_id: str | None = None) -> dict:
    """The tenant's checkpoints now, counted and sized per project."""
    project = sessions.project_column()
    query = (select(project, func.count(CheckpointRow.id), func.sum(CheckpointRow.size_bytes))
             .join(ModelRow, ModelRow.id == CheckpointRow.model_id).join(SessionRow, SessionRow.id == ModelRow.session_id)
             .where(CheckpointRow.tenant == tenant).group_by(project).order_by(project))
    if project_id is not None:
        query = query.where(project == sessions.check_project_id(project_id))
    with svc.store.session() as s:
        rows = s.execute(query).all()
    return {
        "effective_rate_usd_per_gigabyte_month": None,  # storage is not priced here
        "data": [{"project_id": pid, "org_user_urn": user_urn(tenant), "user_email": None, "user_name": tenant,
                  "checkpoint_count": int(count), "size_bytes": int(size or 0),
                  "size_gigabytes": int(size or 0) / BYTES_PER_GB, "estimated_monthly_cost_usd": None}
                 for pid, count, size in rows],
    }


# ---- the audit log and who is calling ----------------------------------------------------------------


def audit_log(svc: Service, tenant: str, event_type: str = "all", day: dt.date | None = None) -> dict:
    """One UTC day (today by default) of the tenant's audit log, oldest first; `event_type` keeps one
    resource's events (this server has no teams or organisations to change, so those are empty)."""
    if event_type not in AUDIT_EVENT_TYPES:
        raise UserError(f"event_type must be one of {list(AUDIT_EVENT_TYPES)}, got {event_type!r}")
    start = dt.datetime.combine(day or now().date(), dt.time(), dt.timezone.utc)
    prefix = AUDIT_EVENT_TYPES[event_type]
    where = [AuditRow.tenant == tenant, AuditRow.created_at >= start, AuditRow.created_at < start + dt.timedelta(days=1)]
    if prefix is not None:
        where.append(AuditRow.event.startswith(prefix))
    rows = svc.store.list(AuditRow, *where, order=AuditRow.id, limit=MAX_AUDIT_ENTRIES)
    entries = []
    for row in rows:
        details = row.details or {}
        on_checkpoint = row.event.startswith("checkpoint_")
        entries.append({"timestamp": iso(row.created_at), "event": row.event, "event_details": details,
                        "model_id": details.get("model_id") if on_checkpoint else None,
                        "tinker_path": details.get("tinker_path") if on_checkpoint else None,
                        "purpose": details.get("purpose") if row.event == "checkpoint_read" else None})
    return {"entries": entries}


def auth_token(svc: Service, tenant: str, key_id: int) -> dict:
    """A JWT for the caller's API key, valid STEPWISE_AUTH_TOKEN_TTL_S: what the SDK sends instead of the key
    once client/config enables JWT auth, and what its whoami() decodes (user_urn = sub, org = org_id)."""
    jwt = signing.sign(svc.signing_key, "auth", svc.settings.auth_token_ttl_s, iss=signing.ISSUER,
                       sub=user_urn(tenant), org_id=tenant, email="", key_id=key_id)
    return {"jwt": jwt}
