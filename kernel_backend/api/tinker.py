"""The tinker SDK's wire protocol (tinker 0.38.0), as thin FastAPI routes over `kernel_backend.service`.

Request bodies are parsed with the SDK's own pydantic request types, so what the official
client sends is what we accept; forward_backward arrives as protobuf (see `wire`). Queued
work answers an UntypedAPIFuture `{request_id, model_id?, sample_sequence_ids?}` that the
client polls with /retrieve_future. The RestClient's and AdminClient's calls are in `rest`.
"""

from __future__ import annotations

import json
import typing

from fastapi import APIRouter, Depends, Query, Request, Response
from tinker import types as T

from kernel_backend import runtime
from kernel_backend.api import wire
from kernel_backend.api.auth import Caller, caller_of, operator_of, tenant_of
from kernel_backend.service import Service, accounts, checkpoints, sampling, sessions, training
from kernel_backend.service.core import PROTO_TYPE
from kernel_backend.persistence.api_keys import LOCAL_TENANT
from kernel_backend.persistence.database import FutureRow
from kernel_backend.errors import UserError

router = APIRouter(prefix="/api/v1")

# Paging of the list routes: a page holds at most MAX_PAGE rows; offsets fit in SQLite's 64-bit integers.
MAX_PAGE = 1000
MAX_OFFSET = 2**62
Limit = lambda default: Query(default, ge=1, le=MAX_PAGE)  # noqa: E731
Offset = Query(0, ge=0, le=MAX_OFFSET)

# The protobuf body of /forward_backward, described for OpenAPI clients and fuzzers; JSON is accepted too.
PROTOBUF_BODY = {"requestBody": {"required": True, "content": {
    "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
    "application/json": {"schema": {"type": "object", "properties": {
        "model_id": {"type": "string"}, "seq_id": {"type": "integer"},
        "forward_backward_input": {"type": "object"}, "forward_input": {"type": "object"}}}},
}}}


def service(request: Request) -> Service:
    return request.app.state.service


async def json_body(request: Request, default=None):
    """The request's JSON body (`default` when it is empty); 400 naming the problem when it does not parse."""
    body = await request.body()
    if not body:
        return default
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"request body is not valid JSON ({e}); send a JSON object") from None


def future_reply(row: FutureRow) -> dict:
    reply = {"request_id": row.request_id, "model_id": row.model_id}
    reply.update(row.extra or {})
    return reply


# ---- client bootstrap, sessions, telemetry -------------------------------------------------------


@router.get("/healthz")
def healthz():
    return {"status": "ok"}


@router.post("/client/config")
def client_config(tenant: str = Depends(tenant_of)):
    # JWT auth on: the SDK exchanges its key at /auth/token for short-lived JWTs (and whoami() reads them).
    # Plain JSON bodies and unchunked forward_backward are what this server handles best.
    # A 402 here is a budget that refuses more work (kernel_backend/service/budgets.py), not a lapsed payment that
    # may come back: the SDK should not pause and resend for up to an hour, but stop (after one resend).
    return {"pjwt_auth_enabled": True, "proto_compress_fwdbwd": False, "billing_exception_max_pause_duration_sec": 0}


@router.post("/client/dynamic_config")
def client_dynamic_config(tenant: str = Depends(tenant_of)):
    # The flags tinker >= 0.30 re-reads every refresh_interval_sec (a 404 also means its defaults, but reads as an
    # error in a server's log). There is no /cancel_future route here, so the SDK is told not to send any.
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/auth/token")
def auth_token(caller: Caller = Depends(caller_of), svc: Service = Depends(service)):
    """Exchange an API key (or a JWT still valid) for a fresh short-lived JWT."""
    return accounts.auth_token(svc, caller.tenant, caller.key_id)


@router.post("/telemetry")
def telemetry(tenant: str = Depends(tenant_of)):
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(body: T.CreateSessionRequest, request: Request, tenant: str = Depends(tenant_of),
                   svc: Service = Depends(service)):
    # A process on this machine (a plain SDK script) is found by its socket; workbench.connect() says its own pid.
    client = None
    if request.client is not None and "local_pid" not in (body.user_metadata or {}):
        client = runtime.loopback_peer(request.client.host, request.client.port, request.url.port or 80)
    return sessions.create_session(svc, tenant, body.tags, body.user_metadata, body.sdk_version, body.display_name,
                                   body.project_id, client)


@router.post("/session_heartbeat")
def session_heartbeat(body: T.SessionHeartbeatRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return sessions.heartbeat(svc, tenant, body.session_id)


@router.post("/sessions/{session_id}/finish", openapi_extra={"requestBody": {"content": {"application/json": {
    "schema": {"type": "object", "properties": {"reason": {"type": "object"}, "detail": {"type": "string"}}}}}}})
async def finish_session(session_id: str, request: Request, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    body = await json_body(request, default={})
    if not isinstance(body, dict):
        raise UserError("the finish body must be a JSON object {reason?, detail?}")
    return sessions.finish_session(svc, tenant, session_id, body.get("reason"), body.get("detail"))


@router.get("/sessions/{session_id}")
def get_session(session_id: str, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return sessions.get_session(svc, tenant, session_id)


@router.get("/sessions")
def list_sessions(limit: int = Limit(20), offset: int = Offset, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return sessions.list_sessions(svc, tenant, limit, offset)


@router.get("/admin/stats")
def admin_stats(tenant: str = Depends(operator_of), svc: Service = Depends(service)):
    """What the backend holds in memory (the operator's key only): adapters held per base model; each engine's
    adapter cache (resident and spilled adapters, their bytes against the budget, evictions) and sampler (rows
    decoding, requests waiting, the prefix cache's entries and reuse), by worker; and the vLLM workers' adapter
    versions and start-up times when vLLM samples."""
    return {"adapters": svc.executor.adapter_counts(), "adapter_cache": svc.executor.adapter_cache_stats(),
            "sampling": svc.executor.sampling_stats(),
            "vllm": svc.ctx.sampler.stats()}


@router.get("/cluster")
def cluster(tenant: str = Depends(operator_of), svc: Service = Depends(service)):
    """Where the engines run (the operator's key only): with Ray workers (kernel_backend/execution/cluster.py) each worker's
    state, device, memory, runs, samplers and queue, and where each run lives; else the in-process engine."""
    return svc.executor.report()


@router.get("/get_server_capabilities")
def capabilities(tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return training.capabilities(svc)


# ---- training -------------------------------------------------------------------------------------


@router.post("/create_model")
def create_model(body: T.CreateModelRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    lora = body.lora_config.model_dump() if body.lora_config else None
    row = training.create_model(svc, tenant, body.session_id, body.model_seq_id, body.base_model, lora,
                                body.optimizer_config.type, body.user_metadata)
    return future_reply(row)


@router.post("/get_info")
def get_info(body: T.GetInfoRequest, request: Request, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    # The server's own user on this machine (its local or loopback key, over loopback): another tenant of a shared
    # server never sees a server path, whatever address it comes from.
    local = tenant == LOCAL_TENANT and request.client is not None and runtime.is_loopback(request.client.host)
    return training.get_info(svc, tenant, body.model_id, client_is_local=local)


@router.post("/forward_backward", openapi_extra=PROTOBUF_BODY)
@router.post("/forward", openapi_extra=PROTOBUF_BODY)
async def forward_backward(request: Request, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    limit = svc.settings.max_body_bytes
    if request.headers.get("content-type", "").startswith("application/json"):
        call = wire.forward_backward_from_json(await json_body(request), forward_only=request.url.path.endswith("/forward"))
    else:
        call = wire.decode_forward_backward(await request.body(), request.headers.get("content-encoding"), limit)
    row = training.forward_backward(svc, tenant, call.model_id, call.seq_id, call.data, call.loss_fn,
                                    call.loss_fn_config, call.forward_only, wire.encode_forward_backward_output)
    return future_reply(row)


@router.post("/optim_step")
def optim_step(body: T.OptimStepRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return future_reply(training.optim_step(svc, tenant, body.model_id, body.seq_id, wire.optim_params(body.optim_params)))


@router.post("/save_weights")
def save_weights(body: T.SaveWeightsRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    row = checkpoints.save_weights(svc, tenant, body.model_id, body.seq_id, body.path, "training", body.overwrite,
                                   body.ttl_seconds, body.user_metadata)
    return future_reply(row)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: T.SaveWeightsForSamplerRequest, tenant: str = Depends(tenant_of),
                             svc: Service = Depends(service)):
    if body.path is None:
        if body.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a path, or a sampling_session_seq_id for an ephemeral sampler")
        return future_reply(checkpoints.snapshot_for_sampler(svc, tenant, body.model_id, body.seq_id,
                                                        body.sampling_session_seq_id))
    row = checkpoints.save_weights(svc, tenant, body.model_id, body.seq_id, body.path, "sampler", True,
                                   body.ttl_seconds, body.user_metadata)
    return future_reply(row)


@router.post("/save_weights_external")
def save_weights_external(body: T.SaveWeightsExternalRequest, tenant: str = Depends(tenant_of),
                          svc: Service = Depends(service)):
    row = checkpoints.save_weights(svc, tenant, body.model_id, body.seq_id, body.path, "external", True,
                                   body.ttl_seconds, age_recipients=body.age_encryption_recipients)
    return future_reply(row)


@router.post("/load_weights")
def load_weights(body: T.LoadWeightsRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    row = checkpoints.load_weights(svc, tenant, body.path, body.optimizer, body.model_id, body.seq_id, body.session_id,
                                   body.model_seq_id, body.user_metadata,
                                   body.optimizer_config.type if body.optimizer_config else None)
    return future_reply(row)


# ---- sampling ----------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
def create_sampling_session(body: T.CreateSamplingSessionRequest, tenant: str = Depends(tenant_of),
                            svc: Service = Depends(service)):
    return sampling.create_sampling_session(svc, tenant, body.session_id, body.sampling_session_seq_id, body.base_model,
                                            body.model_path)


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    return sampling.get_sampler(svc, tenant, sampler_id)


class SamplingParamsBody(T.SamplingParams):
    """asample's sampling_params: the SDK's, and the extras we take beyond them (min_p, repetition_penalty, ...:
    wire.sampling_params_from_json reads and checks them), which the SDK's type would drop unread."""

    model_config = {**T.SamplingParams.model_config, "extra": "allow"}


class SampleBody(T.SampleRequest):
    """asample's body: the SDK's SampleRequest (unknown fields still refused), plus `constraint`, ours
    (grammars.constraint: a JSON schema, a regex or a Lark grammar the samples must match)."""

    sampling_params: SamplingParamsBody
    constraint: typing.Any = None


@router.post("/asample")
def asample(body: SampleBody, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    if body.sampling_session_id is None or body.seq_id is None:
        raise UserError("asample needs sampling_session_id and seq_id; create a sampling client first")
    prompt = wire.model_input_tokens(body.prompt.model_dump(mode="json"))
    params = wire.sampling_params_from_json(body.sampling_params.model_dump(mode="json"))
    row = sampling.sample(svc, tenant, body.sampling_session_id, body.seq_id, prompt, body.num_samples, params,
                          wire.sample_options(body), wire.encode_sample_response, bool(body.record_stability_info))
    return future_reply(row)


# ---- futures -----------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(body: T.FutureRetrieveRequest, request: Request, tenant: str = Depends(tenant_of),
                          svc: Service = Depends(service)):
    row = await svc.retrieve(tenant, body.request_id)
    if row is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    if row.status == "interrupted":  # 410: the SDK submits the request again
        return Response(content=row.result, media_type=row.content_type, status_code=410)
    # Content negotiation: a reply stored as protobuf goes as JSON to a client that did not ask for protobuf
    # (tinker before 0.24 for ForwardBackwardOutput, before 0.18 for SampleResponse).
    if row.content_type == PROTO_TYPE and row.result is not None and not wire.accepts_protobuf(request.headers.get("accept")):
        return wire.proto_reply_as_json(row.result, row.request_type)
    return Response(content=row.result, media_type=row.content_type)
