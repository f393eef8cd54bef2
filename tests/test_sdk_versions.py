"""Every tinker SDK that frameworks pin runs the training loop's core calls against our server (issue 52).

OpenPipe ART pins tinker<0.19; other code stays on whatever release it was written for. Each version in
client_venvs.TINKER_SDKS runs tests/sdk_core_loop.py unchanged (a seeded LoRA client, forward, forward_backward,
optim_step, save_state, a sampler from the trained weights, sample, compute_logprobs, a client from the saved
state) against the `tinker_server` (the tiny stand-in: this is about the protocol, not what a model learns).

What differs between versions is found by running them: before 0.24 the SDK reads ForwardBackwardOutput as JSON
(and before 0.18 SampleResponse too), so retrieve_future answers in the encoding a poll's Accept header asks for.
The same seed on the same server gives the same numbers whichever encoding carried them, which the tests check
against 0.38's protobuf replies.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tinker.proto import response_conv

from client_venvs import TINKER_SDKS, client_env, tinker_sdk
from test_service_http import Api
from kernel_backend.api import wire

SCRIPT = Path(__file__).with_name("sdk_core_loop.py")
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@functools.cache
def core_loop(version: str, base_url: str, api_key: str) -> dict:
    """tests/sdk_core_loop.py's summary with tinker `version` (installed on first use)."""
    env = client_env(PYTHONPATH=str(tinker_sdk(version)), TINKER_BASE_URL=base_url, TINKER_API_KEY=api_key)
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(SCRIPT)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the core loop failed with tinker {version}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", TINKER_SDKS)
def test_the_core_loop_runs_with_every_released_sdk(version, tinker_server):
    run = core_loop(version, tinker_server.base_url, tinker_server.api_key)
    assert run["version"] == version  # the SDK on PYTHONPATH, not our venv's 0.38
    assert -sum(run["after"]) < -sum(run["before"])  # it trained
    # The same seeded run through 0.38's protobuf replies: the same numbers, whatever carried them.
    reference = core_loop("0.38.0", tinker_server.base_url, tinker_server.api_key)
    for key in ("before", "after", "losses", "sampled_logprobs"):
        np.testing.assert_allclose(run[key], reference[key], atol=1e-5, err_msg=key)
    assert run["sampled"] == reference["sampled"]


@dataclass
class Finished:
    """A forward and a sample of the tinker_server, finished, and the raw client that polls their futures."""

    api: Api
    forward: str
    sample: str


@pytest.fixture(scope="module")
def finished(tinker_server) -> Finished:
    api = Api(tinker_server)
    session = api.session()
    model_id = api.model(session, 0, seed=0)
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4, 5], "dtype": "int64", "shape": [4]}}}
    forward = api.post("/forward", {"model_id": model_id, "seq_id": 1, "forward_input": {
        "data": [datum], "loss_fn": "cross_entropy"}}).json()["request_id"]
    sampler = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": BASE}).json()["sampling_session_id"]
    sample = api.post("/asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 2,
                                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                                   "sampling_params": {"max_tokens": 3, "seed": 1},
                                   "prompt_logprobs": True, "topk_prompt_logprobs": 2}).json()["request_id"]
    return Finished(api, forward, sample)


@pytest.mark.parametrize("accept, protobuf", [
    ("application/x-protobuf", True),  # tinker 0.38
    ("application/x-protobuf, application/json", True),  # tinker 0.18-0.30
    ("application/json", False),  # tinker before 0.24 for ForwardBackwardOutput, before 0.18 for SampleResponse
    (None, False),  # silent: httpx's */*
    ("application/x-protobuf;q=0, application/json", False),
])
def test_a_finished_future_answers_in_the_encoding_its_poll_accepts(finished, accept, protobuf):
    for request_id, kind in ((finished.forward, "ForwardBackwardOutput"), (finished.sample, "SampleResponse")):
        reply = finished.api.wait(request_id, accept)
        assert reply.headers["content-type"].startswith("application/x-protobuf" if protobuf else "application/json")
        if protobuf:
            continue
        # The JSON reply holds what the protobuf one does, in the shape the older SDKs' pydantic types declare.
        proto = finished.api.wait(request_id).content
        body = reply.json()
        if kind == "ForwardBackwardOutput":
            decoded = response_conv.deserialize_forward_backward_output(proto)
            out = body["loss_fn_outputs"][0]["logprobs"]
            assert out["dtype"] == "float32" and out["shape"] == [4]
            np.testing.assert_array_equal(np.float32(out["data"]), decoded.loss_fn_outputs[0]["logprobs"].to_numpy())
            assert body["metrics"] == pytest.approx(decoded.metrics)
        else:
            decoded = response_conv.deserialize_sample_response(proto)
            assert body["type"] == "sample" and len(body["sequences"]) == 2
            for got, want in zip(body["sequences"], decoded.sequences):
                assert got["tokens"] == want.tokens and got["stop_reason"] == want.stop_reason
                np.testing.assert_array_equal(np.float32(got["logprobs"]), np.float32(want.logprobs))
            assert body["prompt_logprobs"][0] is None and body["prompt_logprobs"][1:] == pytest.approx(decoded.prompt_logprobs[1:])
            assert [len(row) for row in body["topk_prompt_logprobs"][1:]] == [2, 2]


def test_accept_headers_are_read_by_media_type_and_quality():
    assert wire.accepts_protobuf("application/x-protobuf")
    assert wire.accepts_protobuf("application/json;q=0.9, Application/X-Protobuf;q=0.5")
    assert not wire.accepts_protobuf("application/x-protobuf; q=0")
    assert not wire.accepts_protobuf("*/*")
    assert not wire.accepts_protobuf(None)


def test_a_plain_script_on_this_machine_loads_its_tokenizer_from_the_server_s_folder(shared_server, tmp_path):
    """A non-embedded `serve` tells a loopback client the local model folder as tokenizer_id, so the SDK's
    get_tokenizer() needs no hub (offline, it would retry the hub for ~50 s first). Proved with an empty hub
    cache and HF_HUB_OFFLINE=1, where a hub id could not load at all."""
    script = (
        "import os, tinker\n"
        "sc = tinker.ServiceClient(base_url=os.environ['TINKER_BASE_URL'], api_key=os.environ['TINKER_API_KEY'])\n"
        f"tc = sc.create_lora_training_client(base_model={BASE!r}, rank=4)\n"
        "print(tc.get_info().model_data.tokenizer_id)\n"
        "print(tc.get_tokenizer().encode('hi'))\n"
    )
    env = client_env(TINKER_BASE_URL=shared_server.base_url, TINKER_API_KEY=shared_server.api_key,
                     HF_HUB_CACHE=str(tmp_path / "empty-hub-cache"), PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder, ids = proc.stdout.strip().splitlines()[-2:]
    assert Path(folder).is_dir() and (Path(folder) / "tokenizer.json").exists()
    assert json.loads(ids)
