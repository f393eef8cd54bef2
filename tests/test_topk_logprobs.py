"""Top-k logprobs for custom losses (issue 43): forward and forward_backward take loss_fn_config
{"topk_logprobs": k} and return each position's k most likely tokens and their logprobs, which match
transformers' own softmax on the real model; those ids, sent back as (N, k) target_tokens, give a custom
loss differentiable logprobs of the whole top-k (tests/test_recipes.py runs the distillation recipe on it)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from kernel_backend.errors import UserError
from kernel_backend.types import Datum, LoraConfig

from test_service import BASE

TEXT = "The capital of France is Paris. The capital of Spain is Madrid, and the capital of Italy is"


def datum(tokens: list[int]) -> Datum:
    return Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": np.asarray(tokens[1:]),
                                                      "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def test_topk_matches_transformers_softmax_and_the_targets_own_logprobs(real_engine, tokenizer):
    from transformers import AutoModelForCausalLM

    tokens = tokenizer.encode(TEXT)
    real_engine.create_adapter("topk-check", LoraConfig(rank=4))
    try:
        out = real_engine.forward("topk-check", [datum(tokens)], "cross_entropy", {"topk_logprobs": 5}).loss_fn_outputs[0]
        ids, lps = out["topk_token_ids"], out["topk_logprobs"]
        assert ids.shape == lps.shape == (len(tokens) - 1, 5) and ids.dtype == np.int64
        # A fresh adapter adds nothing (B = 0): transformers' own model on the same weights gives the same top-k.
        model = AutoModelForCausalLM.from_pretrained(real_engine.base.path, dtype=torch.float32)
        with torch.no_grad():
            reference = model(torch.tensor([tokens[:-1]])).logits[0].log_softmax(-1)
        best = torch.topk(reference, 5, dim=-1)
        assert np.array_equal(ids, best.indices.numpy())
        # Float32 rounding through 30 layers summed in another order (our stacked products; the BLAS's blocking
        # follows the shapes): ~1e-6 on MKL's Xeon kernels, up to ~3e-5 on an AMD EPYC's. A wrong logprob is off by far more.
        assert np.abs(lps - best.values.numpy()).max() < 1e-4
        # Sent back as (N, 5) targets, the same ids score the same logprobs (what a custom loss then differentiates).
        again = Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": ids, "weights": np.ones_like(lps)})
        scored = real_engine.forward("topk-check", [again]).loss_fn_outputs[0]["logprobs"]
        assert np.abs(scored - lps).max() < 1e-5
    finally:
        real_engine.delete_adapter("topk-check")


@pytest.mark.parametrize("k", [21, -1, 2.5, "5", True, float("nan"), float("inf"), 10**400])
def test_a_bad_k_is_refused_naming_the_key_and_nothing_changes(engine, k):
    engine.create_adapter("topk-bad", LoraConfig(rank=2))
    try:
        before = engine.weights_digest("topk-bad")
        with pytest.raises(UserError, match="topk_logprobs"):
            engine.forward_backward("topk-bad", [datum([1, 2, 3, 4])], "cross_entropy", {"topk_logprobs": k})
        assert engine.weights_digest("topk-bad") == before
        assert all(p.grad is None or not p.grad.any() for p in engine.adapters.entry("topk-bad").slot.adapter.parameters())
    finally:
        engine.delete_adapter("topk-bad")


def test_the_sdk_gets_topk_from_forward_and_differentiates_it_in_a_custom_loss(tinker_server, tokenizer):
    """Through the official SDK: forward with the key; then forward_backward_custom on the top-k ids as
    (N, k) targets, with a soft-label loss over them; the server's gradients follow (the loss falls)."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokens = tokenizer.encode(TEXT)[:16]
    plain = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    out = tc.forward([plain], "cross_entropy", {"topk_logprobs": 4}).result().loss_fn_outputs[0]
    ids, lps = out["topk_token_ids"].to_numpy(), out["topk_logprobs"].to_numpy()
    assert ids.shape == lps.shape == (len(tokens) - 1, 4) and (np.diff(lps, axis=1) <= 0).all()
    # A soft label: make the 4th most likely token of each position as likely as the first.
    target = np.zeros_like(lps)
    target[:, [0, 3]] = 0.5
    soft = types.Datum(model_input=plain.model_input,
                       loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(ids),
                                       "weights": types.TensorData.from_numpy(np.ones_like(lps))})

    def soft_label_loss(data, logprobs_list):
        return sum(-(torch.from_numpy(target) * lp).sum() for lp in logprobs_list), {}

    losses = []
    for _ in range(4):
        losses.append(tc.forward_backward_custom([soft], soft_label_loss).result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0], losses
