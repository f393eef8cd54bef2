"""The wire protocol at the HTTP level: idempotent retries and bad input.

These send raw requests (httpx) the way a retrying or broken client would, which the SDK's
own methods never do on purpose.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): retries and refusals are the wire protocol's, not a model's.
"""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import pytest
from tinker import types
from tinker.proto import response_conv
from tinker.proto.request_conv import forward_backward_request_to_proto

from servers import Server

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Api:
    """A bare-bones protocol client: submit, then poll retrieve_future until the result is in."""

    def __init__(self, server: Server, key: str | None = None) -> None:
        self.http = httpx.Client(base_url=server.base_url + "/api/v1", timeout=60,
                                 headers={"X-API-Key": key or server.api_key})

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        headers = {"X-Idempotency-Key": f"stainless-python-retry-{uuid.uuid4()}"}
        return self.http.post(path, json=body, headers=headers, **kw)

    def wait(self, request_id: str, accept: str | None = "application/x-protobuf") -> httpx.Response:
        """The finished result, polled with `accept` as the Accept header (None: httpx's */*). The default is what
        the 0.38 SDK sends for every poll whose result may be protobuf; tests/test_sdk_versions.py polls as the
        older SDKs do."""
        headers = {} if accept is None else {"Accept": accept}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = self.http.post("/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True},
                               headers=headers)
            r.raise_for_status()
            if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
                continue
            return r
        raise TimeoutError(request_id)

    def session(self) -> str:
        return self.post("/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "test"}).json()["session_id"]

    def model(self, session: str, seq: int, seed: int) -> str:
        r = self.post("/create_model", {"session_id": session, "model_seq_id": seq, "base_model": BASE,
                                        "lora_config": {"rank": 4, "seed": seed}})
        assert self.wait(r.json()["request_id"]).json()["model_id"] == f"{session}:train:{seq}"
        return f"{session}:train:{seq}"

    def fb_body(self, model_id: str, seq_id: int, data, loss_fn="cross_entropy", forward_only=False) -> bytes:
        request = types.ForwardBackwardRequest(
            model_id=model_id, seq_id=seq_id,
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        )
        msg = forward_backward_request_to_proto(request)
        msg.forward_only = forward_only
        return msg.SerializeToString()

    def forward_backward(self, model_id, seq_id, data, loss_fn="cross_entropy", forward_only=False) -> httpx.Response:
        body = self.fb_body(model_id, seq_id, data, loss_fn, forward_only)
        r = self.http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
        r.raise_for_status()
        return self.wait(r.json()["request_id"])

    def loss(self, model_id, seq_id, data) -> float:
        r = self.forward_backward(model_id, seq_id, data, forward_only=True)
        return response_conv.deserialize_forward_backward_output(r.content).metrics["loss:sum"]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


DATA = [datum([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198])]


@pytest.fixture(scope="module")
def api(tinker_server):
    return Api(tinker_server)


def test_optim_step_sent_twice_is_applied_once(api):
    session = api.session()
    twice, once = api.model(session, 0, seed=5), api.model(session, 1, seed=5)
    for model_id in (twice, once):
        api.forward_backward(model_id, 1, DATA)
    step = {"adam_params": {"learning_rate": 1e-2}, "seq_id": 2}
    first = api.post("/optim_step", {**step, "model_id": twice}).json()["request_id"]
    api.wait(first)
    # The same seq_id again, with a new idempotency key, as the SDK's retry layer sends it.
    again = api.post("/optim_step", {**step, "model_id": twice}).json()["request_id"]
    assert again == first
    api.wait(api.post("/optim_step", {**step, "model_id": once}).json()["request_id"])
    assert api.loss(twice, 3, DATA) == api.loss(once, 3, DATA)
    # ...and a model that took two steps would differ.
    api.forward_backward(once, 4, DATA)
    api.wait(api.post("/optim_step", {"adam_params": {"learning_rate": 1e-2}, "seq_id": 5, "model_id": once}).json()["request_id"])
    assert api.loss(twice, 6, DATA) != api.loss(once, 6, DATA)


def test_bad_input_gets_a_clear_error_and_changes_nothing(api, tinker_server):
    session = api.session()
    model_id = api.model(session, 0, seed=6)
    seq = iter(range(1, 1000))
    before = api.loss(model_id, next(seq), DATA)

    # Malformed JSON, wrong types, missing fields: 422 naming the field.
    r = api.http.post("/optim_step", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    r = api.post("/optim_step", {"model_id": model_id, "seq_id": next(seq), "adam_params": {"learning_rate": "fast"}})
    assert r.status_code == 422 and "learning_rate" in r.json()["detail"]
    r = api.post("/create_model", {"session_id": session, "model_seq_id": 5})
    assert r.status_code == 422 and "base_model" in r.json()["detail"]
    # Malformed protobuf.
    r = api.http.post("/forward_backward", content=b"\xff\x00garbage", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "protobuf" in r.json()["detail"].lower()
    # Unknown ids answer 404.
    assert api.post("/get_info", {"model_id": "nope:train:0"}).status_code == 404
    assert api.post("/optim_step", {"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}}).status_code == 404
    assert api.post("/retrieve_future", {"request_id": "no-such-request"}).status_code == 404
    # Unsupported things name what is supported.
    r = api.post("/create_model", {"session_id": session, "model_seq_id": 7, "base_model": "no/such-model"})
    assert r.status_code == 400 and BASE in r.json()["detail"]
    r = api.post("/optim_step", {"model_id": model_id, "seq_id": next(seq),
                                 "optimizer_params": {"type": "lion", "learning_rate": 0.1}})
    assert r.status_code == 400 and "AdamParams or DimuonParams" in r.json()["detail"]
    r = api.post("/optim_step", {"model_id": model_id, "seq_id": next(seq),
                                 "optimizer_params": {"type": "dimuon", "learning_rate": 0.1, "nesterov": True}})
    assert r.status_code == 400 and "nesterov" in r.json()["detail"] and "damping" in r.json()["detail"]

    # Bad data inside a valid request: a failed future with category "user" and a message.
    def failed(data, loss_fn="cross_entropy") -> dict:
        r = api.forward_backward(model_id, next(seq), data, loss_fn)
        body = r.json()
        assert body["category"] == "user", body
        return body["error"]

    assert "vocabulary" in failed([datum([1, 2, 10**6])])
    assert "supported: cispo, cross_entropy, dro, gspo, importance_sampling, ppo, stable_reinforce" in failed(DATA, "kl_magic")
    # Dimuon's params for an AdamW run: the run's optimizer was fixed when it was created.
    r = api.post("/optim_step", {"model_id": model_id, "seq_id": next(seq),
                                 "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}})
    body = api.wait(r.json()["request_id"]).json()
    assert body["category"] == "user" and "takes AdamParams, not DimuonParams" in body["error"]
    assert "advantages" in failed(DATA, "importance_sampling") or "logprobs" in failed(DATA, "importance_sampling")
    long_tokens = list(np.random.default_rng(0).integers(0, 40000, size=3000))
    assert "over the limit" in failed([datum(long_tokens)] * 3)  # the fixture sets the limit to 8192 tokens

    # An image chunk is refused up front.
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
        loss_fn_inputs={"target_tokens": np.array([1], dtype=np.int64)},
    )
    r = api.http.post("/forward_backward", content=api.fb_body(model_id, next(seq), [image]),
                      headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "encoded_text" in r.json()["detail"]

    # Keys: none or malformed answers 401.
    assert httpx.post(tinker_server.base_url + "/api/v1/get_info", json={"model_id": model_id}).status_code == 401
    bad_key = Api(tinker_server, key="not-a-tinker-key")
    assert bad_key.post("/get_info", {"model_id": model_id}).status_code == 401

    # The server is up and the model's weights are exactly as they were.
    assert api.http.get("/healthz").json() == {"status": "ok"}
    assert api.loss(model_id, next(seq), DATA) == before
