"""Signed download URLs: the files of external weights (get_external_weights_urls) and session traces
(export_session_trace).

The SDK fetches these with plain GETs and no credentials, so each URL carries a signed token
(kernel_backend/persistence/signing.py) that names what it opens and expires after STEPWISE_DOWNLOAD_URL_TTL_S.
This backend serves them itself at /api/v1/downloads/{token}/{file}, from any checkpoint store
(decrypting files sealed at rest), so the same URLs work for a local folder and an object store.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from pathlib import Path

from kernel_backend.persistence import signing
from kernel_backend.service import checkpoints, sessions
from kernel_backend.service.core import Service, audit, iso
from kernel_backend.errors import NotFound
from kernel_backend.persistence.database import now


def _url(svc: Service, base_url: str, file: str, **claims) -> str:
    token = signing.sign(svc.signing_key, "download", svc.settings.download_url_ttl_s, file=file, **claims)
    return f"{base_url.rstrip('/')}/api/v1/downloads/{token}/{file}"


def _expires(svc: Service) -> str:
    return iso(now() + dt.timedelta(seconds=svc.settings.download_url_ttl_s))


def external_weights_urls(svc: Service, tenant: str, model_id: str, name: str, base_url: str) -> dict:
    """One signed URL per file of the tenant's external weights `tinker://{model_id}/external_weights/{name}`."""
    path = f"tinker://{model_id}/external_weights/{name}"
    row = checkpoints.owned_checkpoint(svc, tenant, path)
    files = svc.storage.files(row.directory)
    svc.store.add(audit(tenant, "checkpoint_read", tenant, tinker_path=path, model_id=model_id, purpose="download"))
    return {"urls": {file: _url(svc, base_url, file, what="checkpoint", tenant=tenant, path=path) for file in files},
            "expires": _expires(svc)}


def trace_export(svc: Service, tenant: str, session_id: str, base_url: str) -> dict:
    """RestClient.export_session_trace's poll: the trace is made when it is downloaded, so it is ready at once."""
    svc.session(tenant, session_id)
    url = _url(svc, base_url, f"session-{session_id}.json", what="trace", tenant=tenant, session_id=session_id)
    return {"status": "ready", "url": url, "error": None}


@contextlib.contextmanager
def opened(svc: Service, token: str, file: str):
    """What a download URL names: a local file (bytes of a checkpoint) or a dict (a trace), while the block runs.
    NotFound for a forged or expired token, or a checkpoint deleted since."""
    claims = signing.verify(svc.signing_key, token, "download")
    if claims is None or claims.get("file") != file:
        raise NotFound("this download link is invalid or has expired; ask for a new one")
    if claims.get("what") == "trace":
        yield sessions.session_trace(svc, claims["tenant"], claims["session_id"])
        return
    row = svc.store.checkpoint_by_path(claims["path"], claims["tenant"])
    if row is None or row.tenant != claims["tenant"]:
        raise NotFound(f"checkpoint {claims['path']} was deleted")
    with svc.storage.open(row.directory, svc.settings.decryption_keys, claims["path"]) as folder:
        if not (Path(folder) / file).is_file():
            raise NotFound(f"checkpoint {claims['path']} has no file {file}")
        yield Path(folder) / file
