"""Signed tokens: the short-lived JWTs the SDK exchanges its API key for, and signed download URLs.

Both are JWTs (RFC 7519) signed with HS256 (HMAC-SHA256) under one server secret: STEPWISE_SIGNING_KEY
when set, else a random one made the first time a server starts on a database and kept there, so
every gateway of a deployment shares it and tokens survive a restart. A token's `use` claim says
what it is for ("auth" or "download"), so one kind can never stand in for the other.

The SDK reads an auth JWT's claims without checking its signature (tinker/lib/_jwt_auth.py): `sub`
(its whoami user URN), `org_id`, `email`, `iat` and `exp`. The server checks everything.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from sqlalchemy.exc import IntegrityError

from kernel_backend.persistence.database import SecretRow, Store

HEADER = {"alg": "HS256", "typ": "JWT"}
# Issuer of auth JWTs. The SDK's whoami() also accepts a JWT passed as the api_key when its issuer
# starts with "passport-".
ISSUER = "passport-stepwise"


def server_secret(store: Store, configured: str = "") -> bytes:
    """The signing key: `configured` (STEPWISE_SIGNING_KEY) if set, else the one kept in the database."""
    if configured:
        return hashlib.sha256(configured.encode()).digest()
    row = store.get(SecretRow, "signing_key")
    if row is None:
        try:
            store.add(SecretRow(name="signing_key", value=secrets.token_hex(32)))
        except IntegrityError:  # another gateway made it first
            pass
        row = store.get(SecretRow, "signing_key")
    return bytes.fromhex(row.value)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: bytes, use: str, lifetime_s: float, **claims) -> str:
    """A token for `use`, valid `lifetime_s` seconds from now, carrying `claims`."""
    issued = int(time.time())
    payload = {**claims, "use": use, "iat": issued, "exp": issued + int(lifetime_s)}
    head_body = f"{_b64(json.dumps(HEADER).encode())}.{_b64(json.dumps(payload).encode())}"
    signature = hmac.new(key, head_body.encode(), hashlib.sha256).digest()
    return f"{head_body}.{_b64(signature)}"


def verify(key: bytes, token: str, use: str) -> dict | None:
    """The token's claims if it is ours, intact, unexpired and for `use`; None otherwise."""
    try:
        head, body, signature = token.split(".")
        expected = hmac.new(key, f"{head}.{body}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, _unb64(signature)):
            return None
        if json.loads(_unb64(head)) != HEADER:
            return None
        claims = json.loads(_unb64(body))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(claims, dict) or claims.get("use") != use:
        return None
    exp = claims.get("exp")
    if not isinstance(exp, int) or exp <= time.time():
        return None
    return claims
