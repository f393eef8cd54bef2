"""Sessions: what a ServiceClient opens, keeps alive with heartbeats, and closes.

A session groups a client's training runs and samplers; when it ends (closed, or expired after
its heartbeats stop) its adapters are freed (`Service.end_session`).
"""

from __future__ import annotations

from kernel_backend.service.core import Gone, Service, new_id
from kernel_backend.store import ModelRow, SamplerRow, SessionRow, now


def create_session(svc: Service, tenant: str, tags, user_metadata, sdk_version, display_name=None) -> dict:
    svc.admission.session(tenant)
    session_id = new_id()[:20]
    svc.store.add(
        SessionRow(
            id=session_id,
            tenant=tenant,
            tags=list(tags or []),
            user_metadata=dict(user_metadata or {}),
            display_name=display_name,
            sdk_version=sdk_version,
        )
    )
    return {"session_id": session_id, "type": "create_session"}


def heartbeat(svc: Service, tenant: str, session_id: str) -> dict:
    if svc.session(tenant, session_id).status != "active":
        raise Gone(f"session {session_id} has ended")  # 410 stops the SDK's heartbeat loop
    svc.store.update(SessionRow, session_id, last_heartbeat=now())
    return {"type": "session_heartbeat"}


def finish_session(svc: Service, tenant: str, session_id: str, reason: str | None) -> dict:
    if svc.session(tenant, session_id).status == "active":
        svc.end_session(session_id, "finished")
    return {}


def get_session(svc: Service, tenant: str, session_id: str) -> dict:
    row = svc.session(tenant, session_id)
    runs = svc.store.list(ModelRow, ModelRow.session_id == session_id, order=ModelRow.created_at)
    samplers = svc.store.list(SamplerRow, SamplerRow.session_id == session_id, order=SamplerRow.created_at)
    return {
        "training_run_ids": [r.id for r in runs],
        "sampler_ids": [s.id for s in samplers],
        "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()},
        "display_name": row.display_name,
        "status": row.status,
    }


def list_sessions(svc: Service, tenant: str, limit: int, offset: int) -> dict:
    rows = svc.store.list(SessionRow, SessionRow.tenant == tenant, order=SessionRow.created_at.desc(), limit=limit,
                          offset=offset)
    return {"sessions": [r.id for r in rows]}
