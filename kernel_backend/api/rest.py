"""The SDK's RestClient and AdminClient calls, as thin FastAPI routes over `kernel_backend.service`:
training runs and checkpoints (listing, TTL, delete, publish, copies, external weights' download URLs),
sessions' projects, search and traces, billing, storage usage and the audit log, and the signed
downloads those URLs point at.

Every route but the downloads takes a credential (kernel_backend/api/auth.py); a download URL is its
own credential, signed and expiring (kernel_backend/service/downloads.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.background import BackgroundTask
from tinker import types as T

from kernel_backend.api.auth import tenant_of
from kernel_backend.api.tinker import Limit, Offset, future_reply, json_body, service
from kernel_backend.service import Service, accounts, checkpoints, downloads, publishing, past_steps, sessions, training
from kernel_backend.errors import UserError

router = APIRouter(prefix="/api/v1")

# Extra query parameters the SDK sends that change nothing here: a tenant sees its own runs and sessions.
AccessScope = Query(None, max_length=32)


def _path(model_id: str, segment: str, name: str) -> str:
    return f"tinker://{model_id}/{segment}/{name}"


# ---- training runs and their checkpoints --------------------------------------------------------------


@router.get("/training_runs")
def training_runs(limit: int = Limit(20), offset: int = Offset, project_id: str | None = Query(None, max_length=128),
                  access_scope: str | None = AccessScope, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return training.training_runs(svc, tenant, limit, offset, project_id)


@router.get("/training_runs/{model_id}")
def training_run(model_id: str, access_scope: str | None = AccessScope, tenant: str = Depends(tenant_of),
                 svc: Service = Depends(service)):
    return training.training_run(svc, tenant, model_id)


@router.get("/training_runs/{model_id}/steps")
def run_steps(model_id: str, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return past_steps.kept(svc, tenant, model_id)


@router.post("/training_runs/{model_id}/steps/{step}/checkpoint")
def checkpoint_step(model_id: str, step: int, body: dict, tenant: str = Depends(tenant_of),
                    svc: Service = Depends(service)):
    """A checkpoint of the run's state after a past step (service/past_steps.py): a future, polled like the SDK's."""
    return future_reply(past_steps.save(svc, tenant, model_id, step, body.get("kind", "training")))


@router.get("/training_runs/{model_id}/checkpoints")
def run_checkpoints(model_id: str, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return checkpoints.checkpoints(svc, tenant, model_id)


@router.delete("/training_runs/{model_id}/checkpoints/{segment}/{name}")
def delete_checkpoint(model_id: str, segment: str, name: str, tenant: str = Depends(tenant_of),
                      svc: Service = Depends(service)):
    return checkpoints.delete_checkpoint(svc, tenant, model_id, segment, name)


@router.put("/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
def set_checkpoint_ttl(model_id: str, segment: str, name: str, body: dict, tenant: str = Depends(tenant_of),
                       svc: Service = Depends(service)):
    return checkpoints.set_ttl(svc, tenant, _path(model_id, segment, name), body.get("ttl_seconds"))


@router.post("/training_runs/{model_id}/checkpoints/{segment}/{name}/publish")
def publish_checkpoint(model_id: str, segment: str, name: str, tenant: str = Depends(tenant_of),
                       svc: Service = Depends(service)):
    return publishing.publish(svc, tenant, _path(model_id, segment, name))


@router.delete("/training_runs/{model_id}/checkpoints/{segment}/{name}/publish")
def unpublish_checkpoint(model_id: str, segment: str, name: str, tenant: str = Depends(tenant_of),
                         svc: Service = Depends(service)):
    return publishing.unpublish(svc, tenant, _path(model_id, segment, name))


@router.get("/training_runs/{model_id}/checkpoints/external_weights/{name}/external_weights_urls")
def external_weights_urls(model_id: str, name: str, request: Request, tenant: str = Depends(tenant_of),
                          svc: Service = Depends(service)):
    return downloads.external_weights_urls(svc, tenant, model_id, name, str(request.base_url))


@router.get("/checkpoints")
def all_checkpoints(limit: int = Limit(100), offset: int = Offset, tenant: str = Depends(tenant_of),
                    svc: Service = Depends(service)):
    return checkpoints.checkpoints(svc, tenant, None, limit, offset)


@router.post("/weights_info")
def weights_info(body: dict, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    if not isinstance(body.get("tinker_path"), str):
        raise UserError("weights_info needs {'tinker_path': 'tinker://...'}")
    return checkpoints.weights_info(svc, tenant, body["tinker_path"])


@router.post("/copy_weights")
def copy_weights(body: T.CopyWeightsRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service),
                 x_idempotency_key: str | None = Header(None),
                 x_tinker_weights_access_token: str | None = Header(None)):
    return publishing.copy_weights(svc, tenant, body.source_path, body.destination_project_id, body.session_id,
                                   body.model_seq_id, body.ttl_seconds, x_idempotency_key,
                                   x_tinker_weights_access_token or body.weights_access_token)


# ---- sessions: projects, search, traces ---------------------------------------------------------------


@router.put("/sessions/{session_id}/project")
async def assign_session_project(session_id: str, request: Request, tenant: str = Depends(tenant_of),
                                 svc: Service = Depends(service)):
    body = await json_body(request, default={})
    if not isinstance(body, dict):
        raise UserError("the body must be a JSON object {'project_id': '...'}")
    return sessions.assign_project(svc, tenant, session_id, body.get("project_id"))


@router.post("/sessions/search")
def search_sessions(body: T.SessionSearchRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return sessions.search_sessions(svc, tenant, body)


@router.get("/sessions/{session_id}/trace_export")
def export_session_trace(session_id: str, request: Request, tenant: str = Depends(tenant_of),
                         svc: Service = Depends(service)):
    return downloads.trace_export(svc, tenant, session_id, str(request.base_url))


@router.get("/downloads/{token}/{file}")
def download(token: str, file: str, svc: Service = Depends(service)):
    """A signed download URL's file: no credential, the URL is one."""
    stack = contextlib.ExitStack()
    opened = stack.enter_context(downloads.opened(svc, token, file))
    if isinstance(opened, dict):  # a session trace
        stack.close()
        return JSONResponse(opened, headers={"Content-Disposition": f'attachment; filename="{file}"'})
    return FileResponse(opened, filename=file, background=BackgroundTask(stack.close))


# ---- billing, storage, audit (the AdminClient) --------------------------------------------------------


@router.get("/billing/usage/events")
def billing_usage(starting_on: dt.datetime, ending_before: dt.datetime, tenant: str = Depends(tenant_of),
                  svc: Service = Depends(service)):
    return accounts.billing_usage(svc, tenant, starting_on, ending_before)


@router.get("/billing/usage/checkpoints/current")
def checkpoint_storage_usage(project_id: str | None = Query(None, max_length=128), tenant: str = Depends(tenant_of),
                             svc: Service = Depends(service)):
    return accounts.checkpoint_storage_usage(svc, tenant, project_id)


@router.get("/audit")
def audit_log(event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
              day: dt.date | None = None, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return accounts.audit_log(svc, tenant, event_type, day)
