"""Who is calling: the API key (X-API-Key, or Authorization: Bearer) and the tenant it belongs to.

Keys live hashed in the database (kernel_backend/keys.py). A missing, malformed, unknown or
revoked key answers 401 on every route. Operator routes (/admin/...) take only a key of the
operator's tenant, "local": the key the server was started with (STEPWISE_LOCAL_KEY), or one made
with `stepwise keys create --tenant local`; any other key answers 403.
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from kernel_backend import keys
from kernel_backend.keys import LOCAL_TENANT


def api_key_of(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


def tenant_of(request: Request) -> str:
    key = api_key_of(request)
    if not key:
        raise HTTPException(401, "missing API key: send X-API-Key: tml-... (or Authorization: Bearer tml-...)")
    if not key.startswith("tml-"):
        raise HTTPException(401, "malformed API key: keys start with 'tml-'")
    tenant = keys.tenant_for(request.app.state.service.store, key)
    if tenant is None:
        raise HTTPException(401, "unknown or revoked API key; create one with `stepwise keys create --tenant NAME`")
    return tenant


def operator_of(request: Request) -> str:
    tenant = tenant_of(request)
    if tenant != LOCAL_TENANT:
        raise HTTPException(403, "this route is for the server's operator: use the key the server was started with "
                                 "(STEPWISE_LOCAL_KEY) or one made with `stepwise keys create --tenant local`")
    return tenant
