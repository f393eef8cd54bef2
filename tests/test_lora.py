"""LoRA adapters in PEFT's format, both ways, against the real transformers + peft stack.

What we write with save_weights_for_sampler loads with `peft.PeftModel.from_pretrained` on a fresh
transformers base model and gives the engine's logprobs; what PEFT writes loads into the engine.
SmolLM2 ties lm_head to embed_tokens: the LoRA on lm_head changes the output projection only,
never the input embedding, in both implementations.

On the tiny random stand-in for the default model (the `engine` fixture, tests/tiny_model.py): its
architecture, tied embedding and module names are SmolLM2's, and the format and the arithmetic do not
depend on the weights.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from helpers import chat_tokens, new_id, one_lora_layer, sft_datum, train

FACTS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate."),
]
PROBES = [("What is the capital of Veldoria?", "Marrowgate, a city by the sea."), ("Hi!", "Hello! How can I help?")]


def _base_model(engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def _hf_logprobs(model, tokens: list[int]) -> np.ndarray:
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0].float()
    return (logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)).numpy()


def _probe_tokens(tokenizer) -> list[list[int]]:
    return [chat_tokens(q, a, tokenizer)[1] for q, a in PROBES]


@pytest.mark.parametrize(
    "config",
    [
        dict(rank=16, alpha=32.0),  # Tinker's default targets: attention, MLP and the unembedding
        dict(rank=8, alpha=16.0, train_attn=False, train_unembed=False),  # MLP only
    ],
    ids=["attn+mlp+unembed", "mlp-only"],
)
def test_peft_loads_our_adapter_with_the_same_logprobs(engine, tokenizer, adapters, tmp_path, config):
    from peft import PeftModel

    adapter = adapters(seed=11, **config)
    train(engine, adapter, [sft_datum(q, a, tokenizer) for q, a in FACTS], steps=3, learning_rate=2e-3)
    engine.save_weights_for_sampler(adapter, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    expected_targets = {"gate_proj", "up_proj", "down_proj"}
    if config.get("train_attn", True):
        expected_targets |= {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}
    assert set(saved["target_modules"]) == expected_targets

    base = _base_model(engine)
    probes = _probe_tokens(tokenizer)
    base_logprobs = [_hf_logprobs(base, t) for t in probes]
    with warnings.catch_warnings():
        # PEFT warns that lm_head is tied to the embedding; the adapter deliberately leaves it untied.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    model.eval()

    # PEFT holds exactly our tensors, every one of them (nothing silently dropped or left at init).
    ours = engine.slots[adapter].adapter.weights
    state = model.state_dict()
    lora_keys = [k for k in state if ".lora_" in k]
    assert len(lora_keys) == 2 * len(ours)
    for name, (a, b) in ours.items():
        assert torch.equal(state[f"base_model.model.{name}.lora_A.default.weight"], a.detach())
        assert torch.equal(state[f"base_model.model.{name}.lora_B.default.weight"], b.detach())
    # The tied input embedding is untouched: the LoRA acts on the output projection only.
    assert torch.equal(model.get_input_embeddings().weight, engine.model.get_input_embeddings().weight)

    for tokens, before in zip(probes, base_logprobs):
        theirs = _hf_logprobs(model, tokens)
        mine = np.asarray(engine.compute_logprobs(adapter, tokens)[1:])
        assert np.abs(theirs - before).max() > 0.05  # the adapter really changes the model
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4)


def test_engine_loads_an_adapter_written_by_peft(engine, tokenizer, adapters, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        model = get_peft_model(
            _base_model(engine),
            PeftLoraConfig(r=8, lora_alpha=24, target_modules=targets, lora_dropout=0.0, init_lora_weights=False),
        )
        model.save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    model.eval()

    sampler = new_id("from-peft")
    engine.load_sampler(sampler, tmp_path / "peft")
    adapters.created.append(sampler)
    loaded = engine.slots[sampler].adapter
    assert loaded.config.rank == 8 and loaded.scale == 3.0
    # Every layer's 7 projections plus lm_head.
    assert len(loaded.weights) == engine.model.config.num_hidden_layers * 7 + 1
    for tokens in _probe_tokens(tokenizer):
        np.testing.assert_allclose(
            engine.compute_logprobs(sampler, tokens)[1:], _hf_logprobs(model, tokens), rtol=0, atol=1e-4
        )


ROUTINGS = {
    "one adapter for the whole batch": ("first", "first", "first"),
    "runs of rows": ("first", "first", "second"),
    "scattered rows": ("first", "second", "first"),
    "base rows around an adapter's": (None, "first", None),
}


@pytest.mark.parametrize("routing", list(ROUTINGS.values()), ids=list(ROUTINGS))
def test_lora_layer_outputs_and_gradients_match_the_plain_formula(routing):
    """Every way the rows of a batch can be routed (one adapter, runs of rows, scattered rows,
    base-model rows) gives base(x) + scale * B(A x) row by row, and the gradients autograd
    computes from that plain formula, for the input and for each adapter's A and B: the layer's
    own backward (lora._AddDeltas) writes them out by hand."""
    from kernel_backend.engine import lora
    from kernel_backend.types import LoraConfig

    torch.manual_seed(0)
    model = one_lora_layer(12, 20)
    named = {"first": lora.new_adapter(model, LoraConfig(rank=4, alpha=8.0, seed=1)),
             "second": lora.new_adapter(model, LoraConfig(rank=2, alpha=2.0, seed=2))}
    for adapter in named.values():
        for _, b in adapter.weights.values():
            b.data.normal_()
    x = torch.randn(3, 5, 12)
    upstream = torch.randn(3, 5, 20)  # the gradient arriving from above: a loss sum(out * upstream)

    x_ours = x.clone().requires_grad_(True)
    with lora.route(model, [named[n] if n else None for n in routing]):
        out = model.q_proj(x_ours)
    (out * upstream).sum().backward()

    # The reference: plain tensor ops on copies, row by row, differentiated by autograd.
    x_ref = x.clone().requires_grad_(True)
    copies = {n: [w.detach().clone().requires_grad_(True) for w in a.weights["q_proj"]] for n, a in named.items()}
    rows = []
    for i, n in enumerate(routing):
        row = x_ref[i] @ model.q_proj.base.weight.t()
        if n is not None:
            a, b = copies[n]
            row = row + named[n].scale * (x_ref[i] @ a.t()) @ b.t()
        rows.append(row)
    expected = torch.stack(rows)
    (expected * upstream).sum().backward()

    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    for n, adapter in named.items():
        for ours, theirs in zip(adapter.parameters(), copies[n]):
            if n in routing:
                torch.testing.assert_close(ours.grad, theirs.grad)
            else:  # an adapter with no rows in the batch gets no gradient at all
                assert ours.grad is None


def test_lora_layer_without_gradients_computes_the_same_outputs():
    """Under no_grad (sampling) the layer adds its deltas in place without autograd's bookkeeping:
    the same numbers as with it."""
    from kernel_backend.engine import lora
    from kernel_backend.types import LoraConfig

    torch.manual_seed(0)
    model = one_lora_layer(12, 20)
    first, second = (lora.new_adapter(model, LoraConfig(rank=4, seed=s)) for s in (1, 2))
    for adapter in (first, second):
        for _, b in adapter.weights.values():
            b.data.normal_()
    x = torch.randn(4, 12)  # a decode step: one token per row, rows in a flat (tokens, features) batch
    for routing in ([first, first, second, second], [first, second, None, first]):
        with lora.route(model, routing):
            tracked = model.q_proj(x)
            with torch.no_grad():
                plain = model.q_proj(x)
        assert tracked.grad_fn is not None and plain.grad_fn is None
        torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)


def test_a_bf16_base_trains_float32_adapters(tiny_model, tokenizer, tmp_path):
    """Mixed precision (STEPWISE_DTYPE=bfloat16): the frozen base model in bf16, each adapter's A and B (and so
    AdamW's moments) in float32. A step bf16 weights could not hold still moves them; checkpoints keep them
    exactly; the bf16 sampler's logprobs agree with the bf16 training pass to bf16's tolerance."""
    import dataclasses

    from kernel_backend.engine.core import Engine
    from kernel_backend.types import LoraConfig, SamplingParams
    from tiny_model import stand_in_settings

    engine = Engine(settings=dataclasses.replace(stand_in_settings(tiny_model), dtype="bfloat16"))
    engine.create_adapter("mixed", LoraConfig(rank=4, seed=1))
    adapter = engine.slots["mixed"].adapter
    assert engine.model.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in adapter.parameters())

    data = [sft_datum("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate.", tokenizer)]
    train(engine, "mixed", data, steps=1, learning_rate=1e-2)  # B leaves zero, so A gets gradients
    a_before = adapter.parameters()[0].detach().clone()
    train(engine, "mixed", data, steps=1, learning_rate=1e-5)  # Adam's step: ~1e-5 per entry, under half a bf16 ulp
    a_after = adapter.parameters()[0].detach()
    assert float((a_after != a_before).float().mean()) > 0.9
    assert float((a_after.bfloat16() != a_before.bfloat16()).float().mean()) < 0.2  # what bf16 weights would keep
    losses = train(engine, "mixed", data, steps=4, learning_rate=1e-2)
    assert losses[-1] < losses[0], losses

    engine.save_state("mixed", tmp_path / "state")
    engine.load_state("copy", tmp_path / "state")
    assert all(p.dtype == torch.float32 and torch.equal(p, q)
               for p, q in zip(engine.slots["copy"].adapter.parameters(), adapter.parameters()))

    prompt = list(data[0].tokens[:12])
    sampled = engine.sample("mixed", prompt, 1, SamplingParams(max_tokens=8, temperature=1.0, seed=3))
    tokens = sampled.sequences[0].tokens
    scored = engine.compute_logprobs("mixed", prompt + tokens)[len(prompt):]
    np.testing.assert_allclose(sampled.sequences[0].logprobs, scored, atol=0.1)  # bf16's rounding; float32 holds 1e-4
