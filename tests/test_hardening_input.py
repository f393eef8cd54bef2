"""Hardening, bad input: what a careless or hostile client sends gets a clear 4xx, and nothing changes.

Each case is sent through the real server (raw HTTP where the SDK would refuse to send it, the
official `tinker` and `openai` clients where they can); each asserts the status, the message, that
no message carries a server path, and that the server is up with the run's weights, its
checkpoints and the ledger exactly as they were. (docs/security.md lists the guarantees.)

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): a refusal and the unchanged state after it are the same for any model.
"""

from __future__ import annotations

import datetime as dt

import httpx
import openai
import pytest
import tinker
from fastapi.testclient import TestClient

from test_service_http import DATA, Api

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def api(tinker_server):
    return Api(tinker_server)


@pytest.fixture(scope="module")
def trained(api):
    """A run one optim_step in (so it has AdamW state), with one checkpoint: (session, model_id, checkpoint path)."""
    session = api.session()
    model_id = api.model(session, 0, seed=7)
    api.forward_backward(model_id, 1, DATA)
    api.wait(api.post("/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}})
             .json()["request_id"])
    path = api.wait(api.post("/save_weights", {"model_id": model_id, "seq_id": 3, "path": "keep"})
                    .json()["request_id"]).json()["path"]
    return session, model_id, path


class Unchanged:
    """Records a run's loss, the tenant's checkpoints and its ledger; `check()` asserts all are as they were
    and the server is up. The loss is measured with a forward pass, which adds a ledger row of its own,
    so the ledger is compared before measuring the loss again."""

    def __init__(self, api: Api, model_id: str, seq: int) -> None:
        self.api, self.model_id, self.seq = api, model_id, seq
        self.loss = api.loss(model_id, seq, DATA)
        self.checkpoints = self._checkpoints()
        self.ledger = self._ledger()

    def _checkpoints(self):
        return sorted((c["tinker_path"], c["size_bytes"], c["expires_at"])
                      for c in self.api.http.get("/checkpoints").json()["checkpoints"])

    def _ledger(self):
        report = self.api.http.get("/usage").json()
        return report["totals"], report["cursor"]

    def check(self) -> None:
        assert self.api.http.get("/healthz").json() == {"status": "ok"}
        assert self._ledger() == self.ledger
        assert self._checkpoints() == self.checkpoints
        assert self.api.loss(self.model_id, self.seq + 1, DATA) == self.loss


def refused(response: httpx.Response, status: int, *needles: str, server=None) -> str:
    """Assert a JSON error answer with this status whose message holds every needle and no server path."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    message = body["detail"] if "detail" in body else body["error"]["message"]
    for needle in needles:
        assert needle in message, (needle, message)
    if server is not None:
        assert str(server.home) not in response.text and "/tmp/" not in response.text, message
    return message


def test_malformed_requests_answer_4xx_and_change_nothing(api, tinker_server, trained):
    session, model_id, path = trained
    before = Unchanged(api, model_id, 100)
    json_type = {"Content-Type": "application/json"}

    # Bodies that do not parse, on routes that read them by hand.
    refused(api.http.post("/forward_backward", content=b"{not json", headers=json_type), 400, "not valid JSON")
    refused(api.http.post(f"/sessions/{session}/finish", content=b"{oops", headers=json_type), 400, "not valid JSON")
    assert api.post("/session_heartbeat", {"session_id": session}).status_code == 200  # the session lives on

    # TTLs: too long for a date, negative, zero.
    for ttl in (10**12, -5, 0):
        refused(api.post("/save_weights", {"model_id": model_id, "seq_id": 10, "path": "t", "ttl_seconds": ttl}),
                400, "ttl_seconds")
    ttl_url = f"/training_runs/{model_id}/checkpoints/weights/keep/ttl"
    refused(api.http.put(ttl_url, json={"ttl_seconds": 10**12}), 400, "ttl_seconds")

    # Checkpoint names: none at all, and names outside the allowed alphabet or length.
    refused(api.post("/save_weights", {"model_id": model_id}), 400, "needs a path")
    for name in ("bad\x00name", "x" * 5000, "../escape", "a/b", ".hidden", "sp ace"):
        refused(api.post("/save_weights", {"model_id": model_id, "seq_id": 11, "path": name}), 400, "not allowed",
                server=tinker_server)

    # Paging out of range on every list route: 422 naming the parameter.
    for route in ("/training_runs", "/sessions", "/checkpoints"):
        for params in ({"limit": 10**20}, {"limit": -1}, {"offset": 10**20}, {"offset": -1}):
            refused(api.http.get(route, params=params), 422, next(iter(params)))
    refused(api.http.get("/usage", params={"after": 10**20}), 422, "after")
    refused(api.http.get("/usage", params={"limit": -1}), 422, "limit")

    # A seed over 64 bits on asample, refused before anything is queued.
    sampler = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": BASE}).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    refused(api.post("/asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": prompt,
                                  "sampling_params": {"max_tokens": 2, "seed": 2**70}}), 400, "64 bits")

    # Sampling options out of range, refused the same way (3 prompt tokens: 2 positions to score).
    def target(data, shape, **sparse):
        return {"target_prompt_logprobs": {"data": data, "dtype": "int64", "shape": shape, **sparse}}

    for options, needle in [
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs must be an integer from 0 to 20"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        ({"prompt_alt_tokens_k": 1000}, "prompt_alt_tokens_k"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "from 1 to len(prompt) - 1 = 2"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": -1}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 1}, "set prompt_logprobs"),
        (target([5, 6, 7], [3, 1]), "len(prompt) - 1 = 2 rows"),
        (target([5] * 42, [2, 21]), "1 to 20 ids per prompt position"),
        (target([-1, -1], [2, 1]), "names no token id"),
        (target([5.5, 1], [2, 1]), "integer token ids"),
        (target([5], [2, 10**6], sparse_crow_indices=[0, 1, 1], sparse_col_indices=[0]), "1 to 20 ids"),
        (target([5], [2, 1], sparse_crow_indices=[0, 2, 1], sparse_col_indices=[0]), "inconsistent sparse CSR"),
    ]:
        refused(api.post("/asample", {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 1, "prompt": prompt,
                                      "sampling_params": {"max_tokens": 2}, **options}), 400, needle)

    before.check()


def test_the_sdk_gets_clear_errors_for_bad_checkpoint_requests(tinker_server):
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    with pytest.raises(tinker.BadRequestError, match="not allowed"):
        tc.save_state("name\x00with-nul").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_weights_for_sampler("fine-name", ttl_seconds=10**12).result()
    assert tc.save_state("fine-name", ttl_seconds=60).result().path.endswith("/weights/fine-name")


def test_openai_bad_input_is_a_400_before_anything_streams(tinker_server):
    oai = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=tinker_server.api_key, max_retries=0)
    ledger = httpx.get(tinker_server.base_url + "/api/v1/usage", headers={"X-API-Key": tinker_server.api_key}).json()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as seed:
        oai.chat.completions.create(model=BASE, messages=messages, max_tokens=2, seed=2**70)
    assert "seed" in str(seed.value.body)
    for stream in (False, True):
        # The stream is refused with a status, not a 200 followed by an error event.
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(model=BASE, messages=messages, max_tokens=10**9, stream=stream)
        assert "max_tokens" in chat.value.body["message"]
        with pytest.raises(openai.BadRequestError) as text:
            oai.completions.create(model=BASE, prompt="hi", max_tokens=10**9, stream=stream)
        assert "max_tokens" in text.value.body["message"]
    after = httpx.get(tinker_server.base_url + "/api/v1/usage", headers={"X-API-Key": tinker_server.api_key}).json()
    assert after["totals"]["requests"] == ledger["totals"]["requests"]


def test_every_5xx_is_json_in_the_routes_error_shape(tmp_path):
    """A bug in a route (here one added to raise) answers JSON in its protocol's error shape, with no
    exception text or server path; the process serves on. In-process: a 5xx cannot be caused from outside."""
    from kernel_backend.api.app import create_app
    from kernel_backend.config import Settings

    app = create_app(Settings(home=tmp_path, local_key="tml-5xx-test"), preload=[])

    def boom():
        raise RuntimeError(f"cannot open {tmp_path}/secret/file")

    app.add_api_route("/api/v1/boom", boom)
    app.add_api_route("/v1/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as http:
        tinker_answer = http.get("/api/v1/boom")
        assert tinker_answer.status_code == 500
        assert tinker_answer.json()["category"] == "server" and "RuntimeError" in tinker_answer.json()["detail"]
        openai_answer = http.get("/v1/boom")
        assert openai_answer.status_code == 500 and openai_answer.json()["error"]["type"] == "server_error"
        for answer in (tinker_answer, openai_answer):
            assert str(tmp_path) not in answer.text and "secret" not in answer.text
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_messages_leaving_the_server_carry_no_absolute_paths():
    from kernel_backend.errors import error_payload
    from kernel_backend.errors import redact_paths

    assert redact_paths("no such file: '/home/me/.cache/stepwise/x/adapter.safetensors'") == \
        "no such file: '<server path>'"
    kept = "tinker://run:train:0/weights/step-1, ratio 1/2, a/b, send it to /v1/messages or /oai/api/v1/models"
    assert redact_paths(kept) == kept
    assert b"/srv" not in error_payload("failed at /srv/models/m/config.json", "server")


def test_the_rest_and_admin_routes_answer_4xx_to_bad_input_and_change_nothing(api, tinker_server, trained):
    """publish, copy_weights, save_weights_external, projects, search, billing, audit, downloads and the
    auth exchange: each bad request is refused with what is wrong, before anything is written."""
    session, model_id, path = trained
    before = Unchanged(api, model_id, 200)
    audit = api.http.get("/audit").json()["entries"]
    runs = api.http.get("/training_runs", params={"limit": 1000}).json()["cursor"]["total_count"]

    refused(api.http.post(f"/training_runs/{model_id}/checkpoints/bogus/keep/publish"), 400, "malformed checkpoint path")
    refused(api.http.delete(f"/training_runs/{model_id}/checkpoints/weights/keep/publish"), 400, "already private")

    copy = {"source_path": path, "destination_project_id": "archive"}
    refused(api.post("/copy_weights", {**copy, "ttl_seconds": 60}), 400, "ttl_seconds", "3600")
    refused(api.post("/copy_weights", {"source_path": path}), 400, "destination_project_id")
    refused(api.post("/copy_weights", {**copy, "destination_project_id": "../up"}), 400, "project_id")
    refused(api.post("/copy_weights", {**copy, "session_id": session}), 400, "either")
    refused(api.http.post("/copy_weights", json=copy, headers={"X-Tinker-Weights-Access-Token": "t"}), 400, "publish")
    refused(api.post("/copy_weights", {**copy, "source_path": "tinker://nope"}), 400, "malformed checkpoint path")
    refused(api.post("/copy_weights", {**copy, "surprise": 1}), 422, "surprise")

    external = {"model_id": model_id, "seq_id": 300, "path": "ext"}
    refused(api.post("/save_weights_external", {**external, "ttl_seconds": 60}), 400, "ttl_seconds")
    refused(api.post("/save_weights_external", {**external, "age_encryption_recipients": ["age1nope"]}), 400,
            "age recipient")
    refused(api.post("/save_weights_external", {**external, "age_encryption_recipients": []}), 400, "1 to 10")
    refused(api.post("/save_weights_external", {**external, "path": "../x"}), 400, "not allowed")

    refused(api.http.put(f"/sessions/{session}/project", json={"project_id": "no spaces"}), 400, "project_id")
    refused(api.http.put(f"/sessions/{session}/project", json=["default"]), 400, "JSON object")
    refused(api.http.post(f"/sessions/{session}/finish", json={"reason": {"type": "bored"}}), 400, "success")
    assert api.post("/session_heartbeat", {"session_id": session}).status_code == 200  # still open
    refused(api.post("/sessions/search", {"limit": 0}), 422, "limit")
    refused(api.post("/sessions/search", {"display_name": ""}), 422, "display_name")
    refused(api.post("/sessions/search", {"project_ids": ["a b"]}), 400, "project_id")
    refused(api.http.get("/training_runs", params={"project_id": "a b"}), 400, "project_id")

    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    windows = {"hour boundary": (hour + dt.timedelta(minutes=1), hour + dt.timedelta(hours=1)),
               "14 days": (hour - dt.timedelta(days=15), hour),
               "in the future": (hour + dt.timedelta(hours=2), hour + dt.timedelta(hours=3)),
               "after starting_on": (hour, hour - dt.timedelta(hours=1))}
    for needle, (start, end) in windows.items():
        refused(api.http.get("/billing/usage/events", params={"starting_on": start.isoformat(),
                                                               "ending_before": end.isoformat()}), 400, needle)
    refused(api.http.get("/billing/usage/events"), 422, "starting_on")
    refused(api.http.get("/billing/usage/checkpoints/current", params={"project_id": "a b"}), 400, "project_id")
    refused(api.http.get("/audit", params={"event_type": "everything"}), 422, "event_type")
    refused(api.http.get("/audit", params={"day": "yesterday"}), 422, "day")

    refused(api.http.get("/downloads/forged.token.here/adapter_model.safetensors"), 404, "invalid or has expired")
    trace_url = api.http.get(f"/sessions/{session}/trace_export").json()["url"]
    token = trace_url.split("/downloads/")[1].split("/")[0]
    refused(api.http.get(f"/downloads/{token}/adapter_model.safetensors"), 404, "invalid or has expired")
    refused(httpx.post(tinker_server.base_url + "/api/v1/auth/token", json={}), 401, "missing API key")

    assert api.http.get("/audit").json()["entries"] == audit
    assert api.http.get("/training_runs", params={"limit": 1000}).json()["cursor"]["total_count"] == runs
    before.check()
