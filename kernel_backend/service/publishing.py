"""Who else may read a checkpoint: publishing one, and copying one into a project.

A checkpoint is its owner's alone until the owner publishes it; then any tenant may read it by its
tinker:// path (create_sampling_client(model_path=...), create_training_client_from_state, weights_info,
copy_weights, the OpenAI endpoint), and its owner's audit log records each such read. Unpublishing
ends that, for samplers already made from it too. Only the owner may list, delete, expire or publish it.

copy_weights makes a new, untrainable training run that owns a copy of a checkpoint, in a project.
Tinker shares the stored bytes between a checkpoint and its copies; here the files are copied (a
LoRA adapter is megabytes), so deleting or overwriting one never changes the other.

Publishing a public checkpoint (or unpublishing a private one) is refused with 400, not Tinker's
documented 409: the SDK retries a 409 for five minutes before it reports it.
"""

from __future__ import annotations

from sqlalchemy import select

from kernel_backend.service import checkpoints, sessions
from kernel_backend.service.core import Service, audit, new_id
from kernel_backend.persistence.database import Base, CheckpointRow, ModelRow, SessionRow, expiry, tinker_path
from kernel_backend.errors import UserError

MAX_IDEMPOTENCY_KEY = 128


def publish(svc: Service, tenant: str, path: str) -> dict:
    row = checkpoints.owned_checkpoint(svc, tenant, path)
    if row.kind == "external":
        raise UserError(f"{path} holds external weights, which are shared by their signed download URLs "
                        "(RestClient.get_external_weights_urls), not published")
    if row.public:
        raise UserError(f"checkpoint {path} is already public")
    svc.store.update(CheckpointRow, row.id, public=True)
    svc.store.add(audit(tenant, "checkpoint_published", tenant, tinker_path=path, model_id=row.model_id))
    return {}


def unpublish(svc: Service, tenant: str, path: str) -> dict:
    row = checkpoints.owned_checkpoint(svc, tenant, path)
    if not row.public:
        raise UserError(f"checkpoint {path} is already private")
    svc.store.update(CheckpointRow, row.id, public=False)
    svc.store.add(audit(tenant, "checkpoint_unpublished", tenant, tinker_path=path, model_id=row.model_id))
    return {}


def copy_weights(svc: Service, tenant: str, source_path: str, destination_project_id: str | None = None,
                 session_id: str | None = None, model_seq_id: int | None = None, ttl_seconds: int | None = None,
                 idempotency_key: str | None = None, access_token: str | None = None) -> dict:
    """Copy a checkpoint the tenant may read into a new training run: in a new session of
    `destination_project_id`, or as run `model_seq_id` of the tenant's `session_id`. A retry with the
    same `idempotency_key` answers the first copy's path."""
    if access_token is not None:
        raise UserError("weights access tokens are not used by this server: a checkpoint is readable by other "
                        "tenants once its owner publishes it (RestClient.publish_checkpoint_from_tinker_path)")
    if idempotency_key is not None:
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise UserError(f"X-Idempotency-Key is longer than {MAX_IDEMPOTENCY_KEY} characters")
        done = _copy_made_with(svc, tenant, idempotency_key)
        if done is not None:
            return {"tinker_path": done}
    source = checkpoints.loadable(svc, tenant, source_path)
    expires = expiry(ttl_seconds, min_s=3600)
    rows: list[Base] = []
    if session_id is not None or model_seq_id is not None:
        if session_id is None or model_seq_id is None or destination_project_id is not None:
            raise UserError("copy_weights takes either destination_project_id, or session_id and model_seq_id")
        session = svc.session(tenant, session_id)
        project = sessions.project_of(session)
        model_id = f"{session.id}:train:{model_seq_id}"
        if svc.store.get(ModelRow, model_id) is not None:
            raise UserError(f"session {session.id} already has a training run {model_seq_id}; pick another model_seq_id")
    else:
        if destination_project_id is None:
            raise UserError("copy_weights needs destination_project_id (or TINKER_PROJECT_ID), or session_id and "
                            "model_seq_id")
        project = sessions.check_project_id(destination_project_id)
        session_id = new_id()[:20]
        model_id = f"{session_id}:train:0"
        # A session that only holds the copy: over as soon as it is made, so it counts against no limit.
        rows.append(SessionRow(id=session_id, tenant=tenant, tags=["copy_weights"], user_metadata={},
                               display_name=f"copy of {source_path}", project_id=destination_project_id,
                               status="finished", finish_reason="success", finish_detail=f"holds a copy of {source_path}"))
    source_run = svc.store.get(ModelRow, source.model_id)
    path = tinker_path(model_id, source.kind, source.name)
    location = svc.storage.copy(source.directory, svc.store.checkpoint_key(tenant, model_id, source.kind, source.name),
                                source_path)
    rows += [
        ModelRow(id=model_id, session_id=session_id, tenant=tenant, base_model=source_run.base_model,
                 lora_config=source_run.lora_config, user_metadata={}, copied_from=source_path,
                 idempotency_key=idempotency_key),
        CheckpointRow(tinker_path=path, model_id=model_id, tenant=tenant, kind=source.kind, name=source.name,
                      directory=location, size_bytes=source.size_bytes, expires_at=expires),
        audit(tenant, "checkpoint_copied", tenant, tinker_path=path, model_id=model_id, source=source_path,
              project_id=project),
    ]
    if source.tenant != tenant:
        rows.append(audit(source.tenant, "checkpoint_read", tenant, tinker_path=source_path, model_id=source.model_id,
                          purpose="copy"))
    try:
        svc.store.add(*rows)
    except Exception:
        svc.storage.delete(location)  # no row points at it
        raise
    return {"tinker_path": path}


def _copy_made_with(svc: Service, tenant: str, idempotency_key: str) -> str | None:
    """The path of the copy an earlier copy_weights with this key made, if any."""
    with svc.store.session() as s:
        path = s.scalar(select(CheckpointRow.tinker_path).join(ModelRow, ModelRow.id == CheckpointRow.model_id)
                        .where(ModelRow.tenant == tenant, ModelRow.idempotency_key == idempotency_key))
    return path
