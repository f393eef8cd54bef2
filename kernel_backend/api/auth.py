"""Who is calling: the API key (X-API-Key, or Authorization: Bearer) and the tenant it belongs to.

Keys live hashed in the database (kernel_backend/keys.py). A missing, malformed, unknown or
revoked key answers 401 on every route. A server listening on loopback only also accepts the
well-known `tml-local` from loopback clients, for tenant "local" (kernel_backend/runtime.py).
"""

from __future__ import annotations

from fastapi import HTTPException, Request

from kernel_backend import keys, runtime


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
    loopback_key = getattr(request.app.state, "loopback_key", "")  # set by `serve` on a loopback address
    if loopback_key and key == loopback_key and request.client and runtime.is_loopback(request.client.host):
        return keys.LOCAL_TENANT
    tenant = keys.tenant_for(request.app.state.service.store, key)
    if tenant is None:
        if key == request.app.state.service.settings.loopback_key:
            raise HTTPException(401, f"{key!r} is accepted only by a backend that listens on loopback (127.0.0.1); "
                                     "this one needs a key made with `stepwise keys create --tenant NAME`")
        raise HTTPException(401, "unknown or revoked API key; create one with `stepwise keys create --tenant NAME`")
    return tenant
