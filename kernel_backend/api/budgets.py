"""The budgets API: the most a session, a training run, an API key or a tenant may spend (kernel_backend/service/budgets.py).

    GET    /api/v1/budgets                      the caller's budgets, each with what was spent and its state
    PUT    /api/v1/budgets/{scope}/{target}     {"budget_usd": 1.0, "budget_tokens": null}: set or change one
    DELETE /api/v1/budgets/{scope}/{target}     remove one

scope is session | run | key | tenant; target the session id, the training run id, the key's prefix (as
`stepwise keys list` shows it) or the tenant. A tenant's budget is the operator's to set.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel

from kernel_backend.api.auth import tenant_of
from kernel_backend.api.tinker import service
from kernel_backend.persistence.api_keys import LOCAL_TENANT
from kernel_backend.service import Service, accounts

router = APIRouter(prefix="/api/v1/budgets")
Scope = Literal["session", "run", "key", "tenant"]


class BudgetBody(BaseModel):
    # Numbers or numeric strings, as in user_metadata: budgets.parse_limits checks them and says what is wrong.
    budget_usd: float | str | None = None
    budget_tokens: float | str | None = None


def _may_set(tenant: str, scope: str) -> None:
    if scope == "tenant" and tenant != LOCAL_TENANT:
        raise HTTPException(403, "a tenant's budget is the server operator's to set (the key the server was started "
                                 "with); set one on your session, run or key instead")


@router.get("")
def budgets(tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return {"budgets": [svc.budgets.report(b) for b in svc.budgets.of_tenant(tenant)]}


@router.put("/{scope}/{target}")
def set_budget(scope: Scope, target: str, body: BudgetBody, tenant: str = Depends(tenant_of),
               svc: Service = Depends(service)):
    _may_set(tenant, scope)
    return accounts.set_budget(svc, tenant, scope, target, body.budget_usd, body.budget_tokens)


@router.delete("/{scope}/{target}")
def delete_budget(scope: Scope, target: str, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    _may_set(tenant, scope)
    return accounts.delete_budget(svc, tenant, scope, target)
