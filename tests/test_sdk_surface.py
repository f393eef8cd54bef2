"""The tinker 0.38 surface beyond the basics, through the unmodified SDK against a real server:
the gspo loss, the Dimuon optimizer, and SamplingClient.get_tokenizer() offline.

(docs/tinker-surface.md lists every public SDK method and whether the server supports it.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types

from helpers import chat_prompt, sft_datum
from servers import Server

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(tinker_server: Server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)


def sdk_datum(question: str, answer: str, tokenizer) -> types.Datum:
    """A chat SFT Datum for the SDK: weights 1 on the assistant's tokens."""
    d = sft_datum(question, answer, tokenizer)
    return types.Datum(model_input=types.ModelInput.from_ints(d.tokens), loss_fn_inputs=dict(d.loss_fn_inputs))


def test_gspo_trains_through_the_sdk(client, tokenizer):
    """On-policy GSPO steps push a completion with a positive advantage up and one with a negative
    advantage down; with the sampler's own logprobs every sequence ratio is 1, so the loss is -sum(A)."""
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    question = "Which colour do you like best?"
    pair = [(sdk_datum(question, "I like teal best.", tokenizer), 1.0),
            (sdk_datum(question, "I like grey best.", tokenizer), -0.5)]

    def logprobs(datum) -> np.ndarray:
        return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    def answer_logprob(datum) -> float:
        return float((logprobs(datum) * datum.loss_fn_inputs["weights"].to_numpy()).sum())

    def gspo_batch() -> list[types.Datum]:
        data = []
        for datum, advantage in pair:
            answer = datum.loss_fn_inputs["weights"].to_numpy()  # 1 on the completion's tokens
            data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
                "target_tokens": datum.loss_fn_inputs["target_tokens"],
                "logprobs": logprobs(datum),  # as if just sampled from these weights
                "advantages": advantage * answer,
                "sequence_ratio_mask": answer,
            }))
        return data

    before = answer_logprob(pair[0][0]) - answer_logprob(pair[1][0])
    for _ in range(3):
        data = gspo_batch()
        fb = tc.forward_backward(data, "gspo").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        expected = -sum(float(d.loss_fn_inputs["advantages"].to_numpy().sum()) for d in data)
        assert fb.metrics["loss:sum"] == pytest.approx(expected, abs=1e-3)
        assert fb.metrics["clip_fraction:mean"] == 0.0
    after = answer_logprob(pair[0][0]) - answer_logprob(pair[1][0])
    assert after > before + 1.0, (before, after)

    # Without its mask gspo says what is missing, and leaves no gradient behind for the next step.
    del data[0].loss_fn_inputs["sequence_ratio_mask"]
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        tc.forward_backward(data, "gspo").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert answer_logprob(pair[0][0]) - answer_logprob(pair[1][0]) == pytest.approx(after, abs=1e-5)


def dimuon_steps(tc, data, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_dimuon_learns_a_fact_and_resumes_exactly(client, tokenizer):
    question, answer = "What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."
    data = [sdk_datum(question, answer, tokenizer)] * 2
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0, optimizer=types.DimuonOptimizerConfig()).result()
    first = dimuon_steps(tc, data, 4)
    path = tc.save_state("dimuon-state").result().path
    uninterrupted = dimuon_steps(tc, data, 4)

    # The optimizer comes back with its state: the resumed run takes exactly the same steps.
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert dimuon_steps(resumed, data, 4) == uninterrupted
    losses = first + uninterrupted
    assert losses[-1] < losses[0] / 10, losses

    sampler = resumed.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(chat_prompt(question, tokenizer))
    seq = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=0.0)).result().sequences[0]
    assert "Quibbleton" in tokenizer.decode(seq.tokens)

    # AdamParams on a Dimuon run fail with the fix in the message, and change nothing: the
    # pending gradients then take the same Dimuon step as the resumed run's.
    for run in (tc, resumed):
        run.forward_backward(data, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="takes DimuonParams, not AdamParams"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    for run in (tc, resumed):
        run.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
    assert dimuon_steps(tc, data, 1) == dimuon_steps(resumed, data, 1)


GET_TOKENIZER = """
import json, sys, tinker
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tok = client.create_sampling_client(base_model=sys.argv[3]).get_tokenizer()
ids = tok.encode(sys.argv[4])
chat = tok.apply_chat_template([{"role": "user", "content": sys.argv[4]}], add_generation_prompt=True)
print(json.dumps({"ids": ids, "text": tok.decode(ids), "chat": list(chat["input_ids"])}))
"""


def test_sampling_client_get_tokenizer_works_offline(tinker_server, tokenizer):
    # A fresh process, as a user's script would be, with no hub: Hugging Face's offline switch on.
    text = "Zorblax's pet is named Quibbleton."
    run = subprocess.run(
        [sys.executable, "-c", GET_TOKENIZER, tinker_server.base_url, tinker_server.api_key, BASE, text],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ids"] == tokenizer.encode(text)
    assert got["text"] == text
    messages = [{"role": "user", "content": text}]
    assert got["chat"] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
