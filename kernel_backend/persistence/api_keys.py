"""API keys: each belongs to a tenant, and only its SHA-256 is stored.

Keys start with `tml-` because the tinker SDK refuses any other prefix. The plaintext is shown
once, when the key is made (`stepwise keys create --tenant NAME`).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

from sqlalchemy import select, update

from kernel_backend.persistence.database import ApiKeyRow, Store, now

# The tenant of the key the embedded backend registers for itself (STEPWISE_LOCAL_KEY).
LOCAL_TENANT = "local"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create(store: Store, tenant: str, key: str | None = None) -> str:
    """Make (or, given `key`, register) a key for `tenant`; returns the plaintext key."""
    key = key or "tml-" + secrets.token_urlsafe(32)
    if not key.startswith("tml-"):
        raise ValueError("API keys must start with 'tml-' (the tinker SDK refuses others)")
    with store.session.begin() as s:
        row = s.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash(key))).first()
        if row is None:
            s.add(ApiKeyRow(key_hash=key_hash(key), tenant=tenant, prefix=key[:12]))
        elif row.tenant != tenant:
            raise ValueError(f"that key already belongs to another tenant ({row.tenant!r})")
        else:
            row.revoked_at = None  # registering a known key again (a restarted backend's own key) revives it
    return key


def tenant_for(store: Store, key: str) -> str | None:
    """The tenant a live key belongs to, or None for an unknown or revoked key."""
    row = live_key(store, key)
    return row.tenant if row is not None else None


def live_key(store: Store, key: str | None = None, key_id: int | None = None) -> ApiKeyRow | None:
    """The row of a key that is not revoked, by its plaintext or by its id (the JWTs made for a key name
    it by id, so revoking the key ends them too); None for an unknown or revoked key."""
    with store.session() as s:
        if key_id is not None:
            row = s.get(ApiKeyRow, key_id)
        elif key is not None:
            row = s.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash(key))).first()
        else:
            return None
    return row if row is not None and row.revoked_at is None else None


TOUCH_EVERY_S = 60.0  # a key's last use is written at most this often: not a database write per request
_touched: dict[int, float] = {}  # key id -> when (time.monotonic) its last use was last written
_touched_lock = threading.Lock()


def touch(store: Store, key_id: int) -> None:
    """Record that a request came with this key now (for the operator's view), once a minute at most."""
    moment = time.monotonic()
    with _touched_lock:
        if moment - _touched.get(key_id, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        _touched[key_id] = moment
    with store.session.begin() as s:
        s.execute(update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(last_used_at=now()))


def list_keys(store: Store) -> list[ApiKeyRow]:
    return store.list(ApiKeyRow, order=ApiKeyRow.created_at)


def revoke(store: Store, key_or_prefix: str) -> int:
    """Revoke the key with this plaintext or display prefix; returns how many were revoked."""
    revoked = 0
    with store.session.begin() as s:
        for row in s.scalars(select(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None))):
            if row.key_hash == key_hash(key_or_prefix) or row.prefix == key_or_prefix:
                row.revoked_at = now()
                revoked += 1
    return revoked
