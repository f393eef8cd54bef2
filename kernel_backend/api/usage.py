"""The usage API: what a tenant's sessions and runs processed and cost, read from the ledger.

    GET  /api/v1/usage?session_id=&training_run_id=&since=&until=&after=&limit=
         (a training run's scope includes the sampling done with its weights: its rollouts)
    GET  /api/v1/usage/sessions?active_only=&limit=   one summary row per session (the JupyterLab sidebar)
    POST /api/v1/usage/estimate   price a batch before sending it
    POST /api/v1/usage/custom_loss   the loss a forward_backward_custom's function returned (workbench/client/sdk_hooks.py)

Widgets and the JupyterLab extension poll `series` incrementally: pass the last answer's
`cursor` as `after` to get only the new rows.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from kernel_backend.engine import base_models
from kernel_backend.api.auth import tenant_of
from kernel_backend.api.tinker import service
from kernel_backend.metering import Usage
from kernel_backend.service import Service, accounts

router = APIRouter(prefix="/api/v1/usage")


@router.get("")
def usage(session_id: str | None = None, training_run_id: str | None = None, since: dt.datetime | None = None,
          until: dt.datetime | None = None, after: int = Query(0, ge=0, le=2**62), limit: int = Query(1000, ge=1, le=10000),
          tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return accounts.usage_report(svc, tenant, session_id, training_run_id, since, until, after, limit)


@router.get("/sessions")
def sessions(active_only: bool = False, limit: int = Query(50, ge=1, le=1000),
             tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return accounts.sessions_report(svc, tenant, active_only, limit)


# Counts an estimate may name: far beyond any real plan, small enough that prices stay finite numbers.
MAX_COUNT = 10**15


class EstimateRequest(BaseModel):
    base_model: str = base_models.DEFAULT_MODEL
    # Either counts...
    prefill_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    sample_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    train_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    # ...or the token lists themselves: forward_backward datums, and prompts to sample from.
    datums: list[list[int]] = []
    prompts: list[list[int]] = []
    num_samples: int = Field(1, ge=1, le=10**6)
    max_tokens: int = Field(0, ge=0, le=10**6)  # the most each sample may generate: the estimate is an upper bound


@router.post("/estimate")
def estimate(body: EstimateRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    usage = Usage(
        prefill_tokens=body.prefill_tokens + sum(len(p) for p in body.prompts),
        sample_tokens=body.sample_tokens + len(body.prompts) * body.num_samples * body.max_tokens,
        train_tokens=body.train_tokens + sum(len(d) for d in body.datums),
    )
    price = svc.prices.for_model(body.base_model)
    return {
        "base_model": body.base_model,
        "prefill_tokens": usage.prefill_tokens,
        "sample_tokens": usage.sample_tokens,
        "train_tokens": usage.train_tokens,
        "cost": usage.cost(price),
        "prices_per_million": price,
        "currency": "USD",
    }


class CustomLossReport(BaseModel):
    training_run_id: str = Field(max_length=128)
    surrogate_loss: float  # the loss:sum the server recorded for the surrogate (the SDK returns it)
    metrics: dict[str, float] = Field(max_length=64)  # the user's function's metrics, with its "loss:sum"


@router.post("/custom_loss")
def custom_loss(body: CustomLossReport, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return accounts.record_custom_loss(svc, tenant, body.training_run_id, body.surrogate_loss, body.metrics)
