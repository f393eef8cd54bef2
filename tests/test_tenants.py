"""Isolation: another tenant's ids and paths answer 404 on every route, and bad keys answer 401.

The server serves the tiny random stand-in for the default model (tests/tiny_model.py): isolation is about
who may touch what, not what a model learns.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import httpx
import pytest

from servers import REPO, start_server
from test_service_http import DATA, Api

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory, stepwise_home, tiny_model):
    from tiny_model import stand_in_env

    home = tmp_path_factory.mktemp("tenants")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_MAX_SESSIONS_PER_TENANT": "3", **stand_in_env(tiny_model)})
    key_b = server.make_key("tenant-b")
    yield server, Api(server), Api(server, key=key_b), home
    server.stop()


def test_another_tenants_ids_answer_404_and_change_nothing(two_tenants):
    server, a, b, _ = two_tenants
    session = a.session()
    model_id = a.model(session, 0, seed=1)
    a.forward_backward(model_id, 1, DATA)
    a.wait(a.post("/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {}}).json()["request_id"])
    ckpt = a.wait(a.post("/save_weights", {"model_id": model_id, "seq_id": 3, "path": "mine"}).json()["request_id"]).json()["path"]
    sampler_ckpt = a.wait(a.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 4, "path": "s"}).json()["request_id"]).json()["path"]
    sampler = a.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                  "model_path": sampler_ckpt}).json()["sampling_session_id"]
    external = a.wait(a.post("/save_weights_external", {"model_id": model_id, "seq_id": 5, "path": "ext"})
                      .json()["request_id"]).json()["path"]
    assert external == f"tinker://{model_id}/external_weights/ext"
    request_id = a.post("/optim_step", {"model_id": model_id, "seq_id": 6, "adam_params": {}}).json()["request_id"]
    a.wait(request_id)
    before = a.loss(model_id, 7, DATA)
    other_session = b.session()
    audit_before = a.http.get("/audit").json()["entries"]

    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    posts = {
        "/get_info": {"model_id": model_id},
        "/optim_step": {"model_id": model_id, "seq_id": 8, "adam_params": {"learning_rate": 1.0}},
        "/save_weights": {"model_id": model_id, "seq_id": 8, "path": "stolen"},
        "/save_weights_for_sampler": {"model_id": model_id, "seq_id": 8, "path": "stolen"},
        "/save_weights_external": {"model_id": model_id, "seq_id": 8, "path": "stolen"},
        "/load_weights": {"model_id": model_id, "seq_id": 8, "path": ckpt, "optimizer": True},
        "/create_model": {"session_id": session, "model_seq_id": 9, "base_model": BASE},
        "/create_sampling_session": {"session_id": session, "sampling_session_seq_id": 9, "base_model": BASE},
        "/asample": {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": prompt,
                     "sampling_params": {"max_tokens": 2}},
        "/retrieve_future": {"request_id": request_id},
        "/session_heartbeat": {"session_id": session},
        f"/sessions/{session}/finish": {"reason": {"type": "success"}},
        "/weights_info": {"tinker_path": ckpt},
        "/copy_weights": {"source_path": ckpt, "destination_project_id": "loot"},
        f"/training_runs/{model_id}/checkpoints/weights/mine/publish": {},
    }
    for path, body in posts.items():
        assert b.post(path, body).status_code == 404, path
    # Paths of tenant A's checkpoints, used from tenant B's own session.
    assert b.post("/load_weights", {"session_id": other_session, "model_seq_id": 0, "path": ckpt, "optimizer": True}).status_code == 404
    assert b.post("/create_sampling_session", {"session_id": other_session, "sampling_session_seq_id": 0,
                                               "model_path": sampler_ckpt}).status_code == 404
    fb = b.http.post("/forward_backward", content=b.fb_body(model_id, 8, DATA), headers={"Content-Type": "application/x-protobuf"})
    assert fb.status_code == 404
    gets = [f"/training_runs/{model_id}", f"/training_runs/{model_id}/checkpoints", f"/sessions/{session}",
            f"/samplers/{sampler}", f"/sessions/{session}/trace_export",
            f"/training_runs/{model_id}/checkpoints/external_weights/ext/external_weights_urls"]
    for path in gets:
        assert b.http.get(path).status_code == 404, path
    assert b.http.delete(f"/training_runs/{model_id}/checkpoints/weights/mine").status_code == 404
    assert b.http.delete(f"/training_runs/{model_id}/checkpoints/weights/mine/publish").status_code == 404
    assert b.http.put(f"/sessions/{session}/project", json={"project_id": "loot"}).status_code == 404
    assert model_id not in str(b.http.get("/training_runs").json())
    assert b.http.get("/checkpoints").json()["checkpoints"] == []
    assert b.http.get("/usage", params={"training_run_id": model_id}).json()["totals"]["requests"] == 0
    # The listings that reach across a tenant's things show none of A's.
    assert b.post("/sessions/search", {"session_id": session}).json()["sessions"] == []
    assert b.http.get("/billing/usage/checkpoints/current").json()["data"] == []
    assert model_id not in str(b.http.get("/audit").json())
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    billing = b.http.get("/billing/usage/events", params={"starting_on": hour.isoformat(),
                                                           "ending_before": (hour + dt.timedelta(hours=1)).isoformat()}).json()
    assert session not in str(billing)
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {b.http.headers['X-API-Key']}"},
                      json={"model": sampler_ckpt, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 404 and "error" in chat.json()

    # Tenant A's run is as it was: same loss, same checkpoints (still private), its session alive, in
    # its project, and nothing in its audit log but its own doings.
    assert a.loss(model_id, 9, DATA) == before
    listed = a.http.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert len(listed) == 3 and not any(c["public"] for c in listed)
    assert a.post("/session_heartbeat", {"session_id": session}).status_code == 200
    assert a.post("/sessions/search", {"session_id": session}).json()["sessions"][0]["project_id"] == "default"
    assert a.http.get("/audit").json()["entries"] == audit_before


ROUTES = [
    ("post", "/create_session"), ("post", "/session_heartbeat"), ("post", "/create_model"), ("post", "/get_info"),
    ("post", "/forward_backward"), ("post", "/optim_step"), ("post", "/save_weights"),
    ("post", "/save_weights_for_sampler"), ("post", "/load_weights"), ("post", "/create_sampling_session"),
    ("post", "/asample"), ("post", "/retrieve_future"), ("post", "/weights_info"), ("get", "/training_runs"),
    ("get", "/training_runs/x:train:0"), ("get", "/checkpoints"), ("get", "/sessions"), ("get", "/usage"),
    ("post", "/usage/estimate"), ("get", "/get_server_capabilities"), ("post", "/client/config"),
    ("post", "/auth/token"), ("post", "/copy_weights"), ("post", "/save_weights_external"), ("post", "/sessions/search"),
    ("put", "/sessions/x/project"), ("get", "/sessions/x/trace_export"), ("get", "/audit"),
    ("post", "/training_runs/x:train:0/checkpoints/weights/y/publish"), ("get", "/billing/usage/checkpoints/current"),
    ("get", "/training_runs/x:train:0/checkpoints/external_weights/y/external_weights_urls"),
    ("get", "/billing/usage/events?starting_on=2026-01-01T00:00:00Z&ending_before=2026-01-01T01:00:00Z"),
]


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "tml-not-a-real-key"}, {"X-API-Key": "sk-wrong-prefix"}],
                         ids=["no-key", "unknown-key", "malformed-key"])
def test_every_route_needs_a_valid_key(two_tenants, headers):
    server = two_tenants[0]
    for method, path in ROUTES:
        r = httpx.request(method, server.base_url + "/api/v1" + path, headers=headers, json={})
        assert r.status_code == 401, (path, r.status_code, r.text)
    for path in ("/oai/api/v1/models", "/v1/models"):
        bearer = {"Authorization": f"Bearer {headers['X-API-Key']}"} if headers else {}
        r = httpx.get(server.base_url + path, headers=bearer)
        assert r.status_code == 401 and "error" in r.json()


def test_a_revoked_key_stops_working_and_so_do_its_jwts(two_tenants):
    server, _, _, home = two_tenants
    key = server.make_key("tenant-c")
    api = Api(server, key=key)
    assert api.session()
    jwt = api.post("/auth/token", {}).json()["jwt"]
    assert Api(server, key=jwt).session()  # a JWT answers like its key
    subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "revoke", key], cwd=REPO, check=True,
                   env={**os.environ, "STEPWISE_HOME": str(home)}, capture_output=True)
    assert api.post("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "t"}).status_code == 401
    refused = Api(server, key=jwt).post("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "t"})
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    assert Api(server, key=jwt).post("/auth/token", {}).status_code == 401  # nor can it be renewed


def test_forged_expired_and_misused_tokens_answer_401_invalid_token(two_tenants):
    """Only the server's own, unexpired auth JWTs pass; the SDK re-exchanges its key on this 401."""
    from kernel_backend.persistence import signing

    server, a, _, home = two_tenants
    claims = dict(iss=signing.ISSUER, sub="tml:user:local", org_id="local", email="",
                  key_id=signing.verify(_server_key(home), a.post("/auth/token", {}).json()["jwt"], "auth")["key_id"])
    tokens = {
        "forged": signing.sign(b"not the server's key", "auth", 600, **claims),
        "expired": signing.sign(_server_key(home), "auth", -1, **claims),
        "a download token": signing.sign(_server_key(home), "download", 600, **claims),
        "another tenant's claim": signing.sign(_server_key(home), "auth", 600, **{**claims, "org_id": "tenant-b"}),
        "garbage": "eyJhbGciOiJIUzI1NiJ9.bm90IGpzb24.c2ln",
    }
    assert Api(server, key=signing.sign(_server_key(home), "auth", 600, **claims)).session()  # the same, made right
    for what, token in tokens.items():
        r = httpx.get(server.base_url + "/api/v1/sessions", headers={"X-API-Key": token})
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"', what


def _server_key(home) -> bytes:
    """The signing key the server made and keeps in its database (kernel_backend/persistence/signing.py)."""
    from kernel_backend.persistence import signing
    from kernel_backend.persistence.database import Store

    return signing.server_secret(Store(f"sqlite:///{home / 'stepwise.db'}"))


def test_over_the_session_limit_answers_429_with_retry_after(two_tenants):
    server, _, _, home = two_tenants
    api = Api(server, key=server.make_key("tenant-d"))
    for _ in range(3):
        api.session()
    r = api.post("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "t"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0 and "limit" in r.json()["detail"]
