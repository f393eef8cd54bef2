"""Hardening, checkpoint integrity: every checkpoint carries a SHA-256 per file, checked on every load.

A damaged checkpoint (a flipped byte, a truncated or replaced file, broken JSON, a missing
manifest) is refused with an error that names the checkpoint and no server folder, on every path
that loads one: training state, a sampling client, the OpenAI endpoint. Nothing is billed, and once
the files are whole again the checkpoint loads with the weights it was saved with.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): a damaged file is refused whatever the weights in it say.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from test_service_http import DATA

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = types.ModelInput.from_ints([1, 9690, 198, 2683, 359])
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def saved(tinker_server):
    """A trained run's state and sampler checkpoints, their folders, and the run's logprobs on DATA."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("intact").result().path
    sampler = tc.save_weights_for_sampler("intact-sampler").result().path
    run = tinker_server.home / "checkpoints" / "local" / tc.model_id.replace(":", "_")
    logprobs = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    return client, state, run / "weights" / "intact", sampler, run / "sampler_weights" / "intact-sampler", logprobs


def ledger(server) -> dict:
    return httpx.get(server.base_url + "/api/v1/usage", headers={"X-API-Key": server.api_key}).json()["totals"]


def test_the_manifest_holds_a_sha256_per_file(saved):
    _, _, folder, _, sampler_folder, _ = saved
    for checkpoint, expected in ((folder, {"adapter_config.json", "adapter_model.safetensors",
                                           "optimizer.safetensors", "stepwise_state.json"}),
                                 (sampler_folder, {"adapter_config.json", "adapter_model.safetensors"})):
        digests = json.loads((checkpoint / "manifest.json").read_text())["sha256"]
        assert set(digests) == expected
        for name, digest in digests.items():
            assert hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() == digest


DAMAGES = {
    "a flipped byte": ("adapter_model.safetensors", lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:]),
    "a truncated file": ("adapter_model.safetensors", lambda b: b[: len(b) // 2]),
    "garbage": ("optimizer.safetensors", lambda b: b"\x00garbage" * 100),
    "broken JSON": ("adapter_config.json", lambda b: b[:-3]),
    "a missing manifest": ("manifest.json", None),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_state_checkpoint_is_refused_naming_it(saved, tinker_server, damage):
    client, path, folder, _, _, logprobs = saved
    name, change = DAMAGES[damage]
    original = (folder / name).read_bytes()
    billed = ledger(tinker_server)
    try:
        if change is None:
            (folder / name).unlink()
        else:
            (folder / name).write_bytes(change(original))
        with pytest.raises(tinker.RequestFailedError) as refused:
            client.create_training_client_from_state_with_optimizer(path).result()
        message = str(refused.value)
        assert path in message and ("damaged" in message or "no manifest" in message), message
        assert str(tinker_server.home) not in message and "/tmp/" not in message
    finally:
        (folder / name).write_bytes(original)
    assert ledger(tinker_server) == billed  # a refused load bills nothing
    # Whole again, it loads with the weights it was saved with.
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    got = resumed.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(got, logprobs)


def test_a_damaged_sampler_checkpoint_is_refused_by_sampling_and_openai(saved, tinker_server):
    client, _, _, path, folder, _ = saved
    weights = folder / "adapter_model.safetensors"
    original = weights.read_bytes()
    oai = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=tinker_server.api_key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        weights.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
        with pytest.raises(tinker.RequestFailedError, match="damaged") as sampling:
            client.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result()
        assert path in str(sampling.value)
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(model=path, messages=messages, max_tokens=2)
        assert path in chat.value.body["message"] and "damaged" in chat.value.body["message"]
        assert str(tinker_server.home) not in chat.value.body["message"]
    finally:
        weights.write_bytes(original)
    assert client.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result().sequences[0].tokens
    assert oai.chat.completions.create(model=path, messages=messages, max_tokens=2).choices
