"""Sessions: what a ServiceClient opens, keeps alive with heartbeats, and closes; their projects,
search, and a trace of what they ran.

A session groups a client's training runs and samplers; when it ends (closed, or expired after
its heartbeats stop) its adapters are freed (`Service.end_session`). Every session is in one project
(`DEFAULT_PROJECT` unless the client names one): a label of the tenant's own that the RestClient
filters training runs, searches and storage usage by.

The OpenAI and Anthropic routes have no ServiceClient: their requests are recorded under a session per
(tenant, client name) that the first request makes (`client_session`): named by the request's
X-Stepwise-Session header (or the OpenAI body's `user`, the Anthropic body's `metadata.user_id`), else after
the route ("openai", "anthropic"). Each request is its heartbeat: it is active while requests come, expires
as any session does once they stop for STEPWISE_SESSION_TIMEOUT_S, and the next request makes it active again.
"""

from __future__ import annotations

import datetime as dt
import re
import threading

from sqlalchemy import and_, func, or_, select

from kernel_backend.service import budgets
from kernel_backend.service.core import DEFAULT_PROJECT, Service, audit, iso, new_id, user_urn
from kernel_backend.errors import Gone, UserError
from kernel_backend.persistence.database import CheckpointRow, ModelRow, SamplerRow, SessionRow, UsageRow, now, utc

PROJECT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}")
FINISH_REASONS = ("success", "errored", "interrupted")
MAX_DETAIL = 4096
# Sessions a search reads from the database at a time, while it filters them.
SEARCH_BATCH = 500
# The most requests a session trace shows (its newest).
MAX_TRACE_EVENTS = 100_000
# What names the session of a request on the OpenAI and Anthropic routes (client_session).
CLIENT_HEADER = "X-Stepwise-Session"
MAX_CLIENT_NAME = 256  # SessionRow.display_name's length
# A client session's user_metadata key that marks it as one (its value: the client's name).
CLIENT_KEY = "api_client"
# A request refreshes its client session's heartbeat when the last one is older than this.
CLIENT_TOUCH_S = 5.0
_client_lock = threading.Lock()


def check_project_id(project_id) -> str:
    if not isinstance(project_id, str) or not PROJECT_ID.fullmatch(project_id):
        raise UserError(f"project_id {project_id!r} is not allowed: use 1 to 128 letters, digits, '_', '.', ':' or '-', "
                        "starting with a letter, digit or '_'")
    return project_id


def project_of(row: SessionRow) -> str:
    return row.project_id or DEFAULT_PROJECT


def project_column():
    """A session's project in SQL (sessions made before projects have none: the default one)."""
    return func.coalesce(SessionRow.project_id, DEFAULT_PROJECT)


def create_session(svc: Service, tenant: str, tags, user_metadata, sdk_version, display_name=None,
                   project_id: str | None = None, client: tuple[int, str] | None = None) -> dict:
    """`client`: (pid, name) of the local process that asked (runtime.loopback_peer), when known."""
    if project_id is not None:
        check_project_id(project_id)
    svc.admission.session(tenant)
    session_id = new_id()[:20]
    budget = budgets.from_metadata(tenant, "session", session_id, user_metadata)  # {"budget_usd": "0.5"}
    svc.store.add(
        *([budget] if budget else []),
        SessionRow(
            id=session_id,
            tenant=tenant,
            tags=list(tags or []),
            user_metadata=dict(user_metadata or {}),
            display_name=display_name,
            sdk_version=sdk_version,
            project_id=project_id,
            client_pid=client[0] if client else None,
            client_name=client[1] if client else None,
        ),
        audit(tenant, "session_created", tenant, session_id=session_id, project_id=project_id or DEFAULT_PROJECT),
    )
    return {"session_id": session_id, "type": "create_session"}


def client_name(header: str | None, field, route: str) -> str:
    """The session name a request on the OpenAI or Anthropic routes gives (client_session): its
    X-Stepwise-Session header, else `field` (the OpenAI body's `user`, the Anthropic body's
    `metadata.user_id`: cut to MAX_CLIENT_NAME), else the route's name. Whitespace runs read as one space."""
    if header is not None:
        name = " ".join(header.split())
        if not name or len(name) > MAX_CLIENT_NAME:
            raise UserError(f"the {CLIENT_HEADER} header names the session to record the request under: 1 to "
                            f"{MAX_CLIENT_NAME} characters, got {len(name)}")
        return name
    name = " ".join(field.split())[:MAX_CLIENT_NAME] if isinstance(field, str) else ""
    return name or route


def client_session(svc: Service, tenant: str, name: str) -> str:
    """The id of the session that requests of the client `name` on the OpenAI and Anthropic routes are recorded
    under (the usage ledger's session_id, the sidebar's row, a session budget's scope): the tenant's one of that
    name, made by its first request and used by every later one. Each request is its heartbeat, so it shows as
    active while requests come and expires like any session (Service.reap) once they stop; the next request makes
    it active again, with its totals and budget. It holds no adapters (a checkpoint's sampler is the route's own
    lane), so it is not counted against STEPWISE_MAX_SESSIONS_PER_TENANT, which is about adapters' sessions."""
    with _client_lock:  # two first requests at once make one session
        rows = [r for r in svc.store.list(SessionRow, SessionRow.tenant == tenant, SessionRow.display_name == name,
                                          order=SessionRow.created_at)
                if (r.user_metadata or {}).get(CLIENT_KEY) == name]
        if not rows:
            session_id = new_id()[:20]
            svc.store.add(
                SessionRow(id=session_id, tenant=tenant, tags=["api-client"], user_metadata={CLIENT_KEY: name},
                           display_name=name),
                audit(tenant, "session_created", tenant, session_id=session_id, project_id=DEFAULT_PROJECT,
                      api_client=name),
            )
            return session_id
        row = rows[0]
        stale = (now() - utc(row.last_heartbeat)).total_seconds() > CLIENT_TOUCH_S
        if row.status != "active":
            svc.store.update(SessionRow, row.id, status="active", last_heartbeat=now(), finish_reason=None,
                             finish_detail=None)
        elif stale:
            svc.store.update(SessionRow, row.id, last_heartbeat=now())
        return row.id


def heartbeat(svc: Service, tenant: str, session_id: str) -> dict:
    if svc.session(tenant, session_id).status != "active":
        raise Gone(f"session {session_id} has ended")  # 410 stops the SDK's heartbeat loop
    svc.store.update(SessionRow, session_id, last_heartbeat=now())
    return {"type": "session_heartbeat"}


def finish_session(svc: Service, tenant: str, session_id: str, reason: dict | None, detail: str | None = None) -> dict:
    """ServiceClient.close(status, detail): the first finish wins; finishing an ended session changes nothing."""
    kind = (reason or {}).get("type") if isinstance(reason, dict) or reason is None else None
    if reason is not None and kind not in FINISH_REASONS:
        raise UserError(f"reason must be {{'type': one of {list(FINISH_REASONS)}}}, got {reason!r}")
    if detail is not None and (not isinstance(detail, str) or len(detail) > MAX_DETAIL):
        raise UserError(f"detail must be a string of at most {MAX_DETAIL} characters")
    if svc.session(tenant, session_id).status == "active":
        svc.store.update(SessionRow, session_id, finish_reason=kind, finish_detail=detail)
        svc.end_session(session_id, "finished")
        svc.store.add(audit(tenant, "session_finished", tenant, session_id=session_id, reason=kind))
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


def assign_project(svc: Service, tenant: str, session_id: str, project_id) -> dict:
    """RestClient.assign_session_project: move a session (and so its runs and checkpoints) into a project."""
    check_project_id(project_id)
    row = svc.session(tenant, session_id)
    svc.store.update(SessionRow, session_id, project_id=project_id)
    svc.store.add(audit(tenant, "project_session_assigned", tenant, session_id=session_id, project_id=project_id,
                        previous_project_id=project_of(row)))
    return {}


# ---- search ---------------------------------------------------------------------------------------


def status_json(row: SessionRow) -> dict | None:
    """A session's status as the SDK's SessionStatus; None for one that expired (neither finished nor running)."""
    if row.status == "active":
        return {"type": "active"}
    if row.status == "finished" and row.finish_reason:
        return {"type": "client_finished", "reason": {"type": row.finish_reason}, "detail": row.finish_detail}
    return None


def _matches(row: SessionRow, query) -> bool:
    """Whether a session (already in the query's projects and page) passes the query's other filters."""
    if query.session_id is not None or query.display_name is not None:
        by_id = query.session_id is not None and row.id == query.session_id
        name = (row.display_name or "").lower()
        by_name = query.display_name is not None and all(w in name for w in query.display_name.lower().split())
        if not (by_id or by_name):
            return False
    metadata = row.user_metadata or {}
    if any(str(metadata.get(k)) != v or k not in metadata for k, v in query.user_metadata.items()):
        return False
    if query.statuses is not None:
        status = status_json(row)
        if status is None or not any(_status_matches(status, wanted) for wanted in query.statuses):
            return False
    return True


def _status_matches(status: dict, wanted) -> bool:
    if status["type"] != wanted.type:
        return False
    reasons = getattr(wanted, "reasons", None)
    return reasons is None or status["reason"]["type"] in reasons


def search_sessions(svc: Service, tenant: str, query) -> dict:
    """RestClient.search_sessions(SessionSearchRequest): the tenant's sessions that match, newest first, a
    page of `query.limit` with a cursor to the next. A tenant is one user here, so owners other than the
    caller match nothing."""
    if query.owner.type == "user" and user_urn(tenant) not in query.owner.owner_urns:
        return {"sessions": [], "next_cursor": None}
    if query.project_ids is not None:
        for project_id in query.project_ids:
            check_project_id(project_id)
    where = [SessionRow.tenant == tenant]
    if query.project_ids is not None:
        where.append(project_column().in_(query.project_ids))
    if query.cursor is not None:
        last = utc(query.cursor.last_created_at).astimezone(dt.timezone.utc)
        where.append(or_(SessionRow.created_at < last,
                         and_(SessionRow.created_at == last, SessionRow.id < query.cursor.last_session_id)))
    found: list[SessionRow] = []
    offset = 0
    with svc.store.session() as s:
        while len(found) <= query.limit:  # one more than a page: is there a next page?
            batch = list(s.scalars(select(SessionRow).where(*where).order_by(SessionRow.created_at.desc(),
                                                                                SessionRow.id.desc())
                                   .offset(offset).limit(SEARCH_BATCH)))
            found += [row for row in batch if _matches(row, query)]
            if len(batch) < SEARCH_BATCH:
                break
            offset += SEARCH_BATCH
    page, more = found[:query.limit], len(found) > query.limit
    counts = _checkpoint_totals(svc, [row.id for row in page])
    return {
        "sessions": [{
            "session_id": row.id,
            "created_at": iso(row.created_at),
            "owner": user_urn(row.tenant),
            "project_id": project_of(row),
            "status": status_json(row),
            "checkpoints_count": counts.get(row.id, (0, 0))[0],
            "display_name": row.display_name,
            "user_metadata": {k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
            "checkpoint_storage_bytes": counts.get(row.id, (0, 0))[1],
        } for row in page],
        "next_cursor": {"last_created_at": iso(page[-1].created_at), "last_session_id": page[-1].id} if more else None,
    }


def _checkpoint_totals(svc: Service, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    """session id -> (checkpoints, their stored bytes)."""
    with svc.store.session() as s:
        rows = s.execute(select(ModelRow.session_id, func.count(CheckpointRow.id), func.sum(CheckpointRow.size_bytes))
                         .join(CheckpointRow, CheckpointRow.model_id == ModelRow.id)
                         .where(ModelRow.session_id.in_(session_ids)).group_by(ModelRow.session_id)).all()
    return {session_id: (int(count), int(size or 0)) for session_id, count, size in rows}


# ---- trace ------------------------------------------------------------------------------------------


def session_trace(svc: Service, tenant: str, session_id: str) -> dict:
    """What a session ran, as a Chrome trace-event JSON (ui.perfetto.dev and chrome://tracing open it):
    one slice per completed request, on one track per training run or sampler, with its tokens, cost,
    step and metrics. Read from the ledger, which holds every completed request."""
    svc.session(tenant, session_id)
    rows = svc.store.list(UsageRow, UsageRow.session_id == session_id, order=UsageRow.id.desc(),
                          limit=MAX_TRACE_EVENTS)[::-1]
    lanes: dict[str, int] = {}
    events = []
    for row in rows:
        lane = row.model_id or row.sampler_id or session_id
        if lane not in lanes:
            lanes[lane] = len(lanes) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": lanes[lane], "args": {"name": lane}})
        end_us = utc(row.created_at).timestamp() * 1e6
        duration_us = max(row.duration_s, 0.0) * 1e6
        events.append({
            "name": row.request_type, "ph": "X", "pid": 1, "tid": lanes[lane],
            "ts": round(end_us - duration_us), "dur": round(duration_us),
            "args": {"request_id": row.request_id, "step": row.step, "prefill_tokens": row.prefill_tokens,
                     "sample_tokens": row.sample_tokens, "train_tokens": row.train_tokens, "cost_usd": row.cost,
                     **(row.metrics or {})},
        })
    metadata = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"session {session_id}"}}
    return {"traceEvents": [metadata, *events], "displayTimeUnit": "ms"}
