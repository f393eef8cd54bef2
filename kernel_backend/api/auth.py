"""Who is calling: the API key (X-API-Key, or Authorization: Bearer) and the tenant it belongs to.

Today every well-formed key (`tml-...`, the prefix the tinker SDK insists on) belongs to the
single local tenant "local"; per-tenant keys stored hashed are the next step (issue 5).
"""

from __future__ import annotations

from fastapi import HTTPException, Request

LOCAL_TENANT = "local"


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
    return LOCAL_TENANT
