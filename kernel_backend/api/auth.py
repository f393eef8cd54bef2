"""Who is calling: the credential (X-API-Key, or Authorization: Bearer) and the tenant it belongs to.

Two kinds of credential are accepted on every route:
- an API key, `tml-...`: keys live hashed in the database (kernel_backend/persistence/api_keys.py);
- a short-lived JWT (`eyJ...`) that POST /api/v1/auth/token issued for a key (the SDK exchanges its
  key for one when client/config says pjwt_auth_enabled, and refreshes it before it expires). It
  names its key, so revoking the key ends its JWTs at once.
A missing, malformed, unknown or revoked credential answers 401; an expired or forged JWT answers 401
with `WWW-Authenticate: Bearer error="invalid_token"`, on which the SDK exchanges its key again.
Operator routes (/admin/...) take only a credential of the operator's tenant, "local": the key the
server was started with (STEPWISE_LOCAL_KEY), or one made with `stepwise keys create --tenant local`;
any other answers 403.
A server listening on loopback only also accepts the well-known `tml-local` from loopback clients,
for tenant "local" (`serve` registers it then; kernel_backend/runtime.py); any other server refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException, Request

from kernel_backend.service import budgets
from kernel_backend.persistence import api_keys, signing
from kernel_backend import runtime
from kernel_backend.persistence.api_keys import LOCAL_TENANT


@dataclass
class Caller:
    tenant: str
    key_id: int  # the API key's row, also for a JWT made from it


def api_key_of(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


def caller_of(request: Request) -> Caller:
    key = api_key_of(request)
    if not key:
        raise HTTPException(401, "missing API key: send X-API-Key: tml-... (or Authorization: Bearer tml-...)")
    service = request.app.state.service
    if key.startswith("eyJ"):
        claims = signing.verify(service.signing_key, key, "auth") or {}
        key_id = claims.get("key_id")
        row = api_keys.live_key(service.store, key_id=key_id) if isinstance(key_id, int) else None
        if row is None or row.tenant != claims.get("org_id"):
            raise HTTPException(401, "invalid or expired token: exchange your API key for a new one at "
                                     "/api/v1/auth/token (the tinker SDK does this by itself)",
                                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return _caller(service, row)
    if not key.startswith("tml-"):
        raise HTTPException(401, "malformed API key: keys start with 'tml-'")
    loopback_key = service.settings.loopback_key
    if loopback_key and key == loopback_key and not (
        getattr(request.app.state, "loopback_key", "") and request.client and runtime.is_loopback(request.client.host)
    ):
        raise HTTPException(401, f"{key!r} is accepted only by a backend that listens on loopback (127.0.0.1), "
                                 "from this machine; this one needs a key made with `stepwise keys create --tenant NAME`")
    row = api_keys.live_key(service.store, key)
    if row is None:
        raise HTTPException(401, "unknown or revoked API key; create one with `stepwise keys create --tenant NAME`, or, "
                                 "for the backend a notebook started, connect with `workbench.connect()` (its URL and "
                                 "key are in $STEPWISE_HOME/runtime/backend.json)")
    return _caller(service, row)


def _caller(service, row) -> Caller:
    api_keys.touch(service.store, row.id)  # its last use, for the operator's view (once a minute at most)
    budgets.set_request_key(row.prefix)  # the work this request queues counts against the key's budget
    budgets.note(tenant=row.tenant)  # for the request's log line
    return Caller(row.tenant, row.id)


def tenant_of(request: Request) -> str:
    return caller_of(request).tenant


def operator_of(request: Request) -> str:
    tenant = tenant_of(request)
    if tenant != LOCAL_TENANT:
        raise HTTPException(403, "this route is for the server's operator: use the key the server was started with "
                                 "(STEPWISE_LOCAL_KEY) or one made with `stepwise keys create --tenant local`")
    return tenant
