"""STEPWISE_SAMPLE_DTYPE: the built-in sampler on a bf16 copy of the base weights (engine/lora.py sample_weights).

float32 (the default) must leave every sampled token and logprob exactly what it was; bfloat16 must sample, stay
within a stated distance of the trainer's float32 logprobs on the real model, and be counted in Engine.memory;
a value it cannot take must stop the engine with a message naming the variable.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from helpers import one_lora_layer
from kernel_backend.engine import lora
from kernel_backend.types import Datum, LoraConfig, SamplingParams

# The sampler/trainer gap bf16 sampling weights may open on the real model, per sampled token (measured
# 2026-12-05, bench/decode_profile.py --parts gap: mean |sampler - trainer| 0.02-0.03, exact KL ~8e-4 a token;
# docs/performance.md). Float32 sampling agrees with the trainer to float32 rounding (different batching).
BF16_MEAN_GAP, BF16_MAX_GAP, FP32_MAX_GAP = 0.06, 0.6, 1e-3


def _samples(engine, adapter_id, prompt, seed=3):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
    return engine.sample(adapter_id, prompt, 3, params, prompt_logprobs=True)


@contextlib.contextmanager
def sample_dtype(engine, dtype: str):
    """The engine's sampler on `dtype` weights for the block (STEPWISE_SAMPLE_DTYPE at start-up), then float32."""
    lora.sample_weights(engine.model, dtype)
    engine.reset_decoder()  # its prefix cache holds what the other dtype computed
    try:
        yield
    finally:
        lora.sample_weights(engine.model, "float32")
        engine.reset_decoder()


def test_float32_sampling_is_the_code_before_sampling_copies_bit_for_bit(engine, adapters, monkeypatch):
    """float32 (the default) makes no copies: sampled tokens, their logprobs and prompt logprobs are exactly those
    of the sampler with lora.sampling a no-op (the code before it existed)."""
    assert engine.settings.sample_dtype == "float32" and engine.memory()["sampler_weights_bytes"] == 0
    adapter_id = adapters(rank=4, seed=5)
    for _, b in engine._slot(adapter_id).adapter.weights.values():
        b.data.normal_(0, 0.05)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    now = [_samples(engine, a, prompt) for a in (None, adapter_id)]
    engine.reset_decoder()
    monkeypatch.setattr(lora, "sampling", lambda model: contextlib.nullcontext())
    before = [_samples(engine, a, prompt) for a in (None, adapter_id)]
    for a, b in zip(now, before):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]


def test_a_layer_uses_its_copy_only_while_sampling_and_only_for_the_weight_it_copies():
    torch.manual_seed(0)
    model = one_lora_layer(64, 32)
    layer, x = model.q_proj, torch.randn(5, 64)
    exact = layer(x)
    assert lora.sample_weights(model, "bfloat16") == 64 * 32 * 2
    assert torch.equal(layer(x), exact)  # training and every pass outside the sampler: the float32 weights
    with torch.no_grad(), lora.sampling(model):
        rounded = layer(x)
        assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
        torch.testing.assert_close(rounded, exact, rtol=0.02, atol=0.02)
        # Other weights swapped in (a full run's, engine/full_weights.py) are not what the copy copies: they run as they are.
        other = torch.randn(32, 64)
        layer.base._parameters["weight"] = other
        torch.testing.assert_close(layer(x), F.linear(x, other), rtol=1e-5, atol=1e-5)  # float32, not the bf16 copy's 1e-2
    assert lora.sample_weights(model, "float32") == 0
    model.to(torch.bfloat16)  # a bf16 base (STEPWISE_DTYPE): no copy either way, never a float32 one
    assert lora.sample_weights(model, "float32") == 0 and lora.sample_weights(model, "bfloat16") == 0


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_takes_a_matrix_vector_product_that_agrees_with_the_batched_one(bias):
    """A lone row's bf16 product (torch.mv / addmv) is the batched F.linear's, to bf16 rounding, bias included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(64, 48, bias=bias))
    model.requires_grad_(False)
    lora.attach(model)
    lora.sample_weights(model, "bfloat16")
    x = torch.randn(4, 64)
    with torch.no_grad(), lora.sampling(model):
        batched = model.q_proj(x)
        alone = torch.cat([model.q_proj(x[i : i + 1]) for i in range(4)])
    assert alone.shape == batched.shape and alone.dtype == torch.float32
    torch.testing.assert_close(alone, batched, rtol=0.01, atol=0.01)
    torch.testing.assert_close(alone, F.linear(x, model.q_proj.base.weight, model.q_proj.base.bias), rtol=0.05, atol=0.05)


def test_bfloat16_sampling_samples_and_is_counted(engine, stepwise_home, tiny_model):
    """An engine started with STEPWISE_SAMPLE_DTYPE=bfloat16 samples (seeded: the same tokens twice) and its
    copies, 2 bytes a base weight, are in Engine.memory."""
    from kernel_backend.engine.core import Engine

    bf16 = Engine(settings=dataclasses.replace(engine.settings, sample_dtype="bfloat16"))
    layers = lora.lora_layers(bf16.model).values()
    assert bf16.memory()["sampler_weights_bytes"] == sum(2 * layer.base.weight.numel() for layer in layers) > 0
    # The KV cache is bf16 too (attention over it in bf16), so its megabytes hold twice the tokens; float32 keeps
    # the model's dtype.
    assert bf16.decoder.cache_dtype == torch.bfloat16 and engine.decoder.cache_dtype == torch.float32
    assert bf16.decoder.budget_tokens == 2 * engine.decoder.budget_tokens
    prompt = [1, 2, 3, 4, 5]
    first, again = _samples(bf16, None, prompt), _samples(bf16, None, prompt)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(len(s.tokens) > 0 and all(np.isfinite(s.logprobs)) for s in first.sequences)
    exact = _samples(engine, None, prompt)  # float32 sampler, same prompt: logprobs close, not equal
    np.testing.assert_allclose(first.prompt_logprobs[1:], exact.prompt_logprobs[1:], atol=0.1)
    assert first.prompt_logprobs[1:] != exact.prompt_logprobs[1:]


def test_a_sample_dtype_it_cannot_take_stops_the_engine_naming_the_variable(engine):
    from kernel_backend.engine.core import Engine

    with pytest.raises(ValueError, match="STEPWISE_SAMPLE_DTYPE must be one of float32, bfloat16, not 'float16'"):
        Engine(settings=dataclasses.replace(engine.settings, sample_dtype="float16"))


def _gaps(engine, adapter_id: str) -> np.ndarray:
    """sampler logprob - trainer logprob (Engine.forward, float32) of each sampled token, on chat prompts."""
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in ("Tell me about dogs.", "What is a good hobby?")]
    requests = [engine.sample_request(adapter_id, p, 4, SamplingParams(max_tokens=24, temperature=1.0, seed=i))
                for i, p in enumerate(prompts)]
    out = []
    for prompt, result in zip(prompts, engine.run_requests(requests)):
        for seq in result.sequences:
            full = prompt + seq.tokens
            trainer = engine.forward(adapter_id, [Datum(full[:-1], {"target_tokens": np.array(full[1:])})])
            out.append(np.asarray(seq.logprobs) - trainer.loss_fn_outputs[0]["logprobs"][len(prompt) - 1:])
    return np.concatenate(out)


def test_the_sampler_trainer_gap_on_the_real_model(real_engine):
    """SmolLM2-135M-Instruct, a rank-8 adapter with nonzero deltas: float32 sampling agrees with the trainer to
    float32 rounding; bf16 sampling within BF16_MEAN_GAP on average (what RL's importance ratios see)."""
    real_engine.create_adapter("dtype-gap", LoraConfig(rank=8, seed=1))
    try:
        generator = torch.Generator().manual_seed(0)
        for _, b in real_engine._slot("dtype-gap").adapter.weights.values():
            b.data.normal_(0.0, 0.002, generator=generator)
        fp32 = _gaps(real_engine, "dtype-gap")
        assert np.abs(fp32).max() < FP32_MAX_GAP
        with sample_dtype(real_engine, "bfloat16"):
            bf16 = _gaps(real_engine, "dtype-gap")
        assert np.abs(bf16).mean() < BF16_MEAN_GAP and np.abs(bf16).max() < BF16_MAX_GAP
        assert np.abs(bf16).mean() > 10 * np.abs(fp32).mean()  # the copies were used
    finally:
        real_engine.delete_adapter("dtype-gap")


def _qkv_model(bias: bool = False):
    """Three frozen layers read from one input, named as q, k, v are (so they share a copy), wrapped for LoRA."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, out in (("q_proj", 48), ("k_proj", 16), ("v_proj", 16)):
        model.add_module(name, torch.nn.Linear(64, out, bias=bias))
    model.requires_grad_(False)
    model.device = torch.device("cpu")  # lora.route's scattered rows go there
    lora.attach(model)
    return model, (model.q_proj, model.k_proj, model.v_proj)


def _adapter(model, seed: int, rank: int = 4, only: tuple[str, ...] | None = None) -> lora.Adapter:
    """A LoRA adapter whose B is not zero (so its deltas count), on every layer or on those named `only`."""
    adapter = lora.new_adapter(model, LoraConfig(rank=rank, seed=seed))
    if only is not None:
        adapter.weights = {name: pair for name, pair in adapter.weights.items() if name in only}
    for _, b in adapter.weights.values():
        b.data.normal_(0, 0.1)
    return adapter


def test_the_adapters_deltas_on_a_stacked_product_are_each_layer_s_own(monkeypatch):
    """In the sampler's passes, layers that share a copy take each adapter's LoRA deltas as one pair of products on
    the stacked output (A's stacked, B's block-diagonal): the same outputs, to float32 rounding, as each layer adding
    its own, for rows routed as a run and as scattered rows, a rank of their own, and rows with no adapter. An adapter
    that trains only some of the layers makes every layer add its own; a stack whose adapter changed is built again."""
    model, layers = _qkv_model()
    lora.sample_weights(model, "bfloat16")
    shared, x = layers[0].shared_copy, torch.randn(7, 64)
    first, second, partial = _adapter(model, 1), _adapter(model, 2, rank=8), _adapter(model, 3, only=("q_proj",))

    def outputs(adapters, stacked: bool):
        if not stacked:
            monkeypatch.setattr(lora.SharedCopy, "plus_deltas", lambda self, x, out: False)
        with torch.no_grad(), lora.route(model, adapters), lora.sampling(model):
            got = [t.clone() for t in lora.products(layers, x)]
        monkeypatch.undo()
        return got

    for adapters in ([first] * 7, [first] * 3 + [second] * 2 + [None] * 2, [first, second, None, first, second, first, None]):
        for got, expected in zip(outputs(adapters, True), outputs(adapters, False)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert set(shared.lora) == {first, second}  # both stacked, once each
    with torch.no_grad(), lora.route(model, [partial] * 7), lora.sampling(model):
        assert shared.plus_deltas(x, shared.product(x)) is False
    for got, expected in zip(outputs([first, partial] * 3 + [None], True), outputs([first, partial] * 3 + [None], False)):
        assert torch.equal(got, expected)  # every layer its own: exactly the per-layer path
    before = outputs([first] * 7, True)
    with torch.no_grad():
        first.weights["k_proj"][1].mul_(2)  # trained in place, as an optimizer step does: a new version of B
    after = outputs([first] * 7, True)
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])
    for got, expected in zip(after, outputs([first] * 7, False)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_layers_read_together_share_one_copy_and_give_each_layer_s_own_products(bias):
    """q, k, v (and gate, up) share one stacked bf16 copy: one product through `lora.products`, each layer's part
    with its LoRA deltas equal to the layer's own bf16 product plus deltas; a layer called alone gets its part too;
    the stacked copy costs the bytes the separate ones would; float32 leaves none."""
    model, layers = _qkv_model(bias)
    adapter = _adapter(model, seed=1)
    per_byte = 2 * sum(layer.base.weight.numel() + (layer.base.bias.numel() if bias else 0) for layer in layers)
    assert lora.sample_weights(model, "bfloat16") == per_byte
    assert all(layer.shared_copy is layers[0].shared_copy is not None for layer in layers)
    x = torch.randn(5, 64)
    with torch.no_grad(), lora.route(model, [adapter] * 5), lora.sampling(model):
        together = lora.products(layers, x)
        alone = [layer(x) for layer in layers]
    for layer, got, single in zip(layers, together, alone):
        a, b = adapter.weights[layer.name]
        expected = F.linear(x.bfloat16(), layer.base.weight.bfloat16(),
                            layer.base.bias.bfloat16() if bias else None).float() + adapter.scale * (x @ a.t() @ b.t())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # The same sums, the deltas in one stacked product or one per layer: bit for bit where the BLAS's kernel does
        # not depend on the product's width (MKL on the Xeon), within float32 rounding elsewhere (an AMD EPYC).
        torch.testing.assert_close(single, got, rtol=1e-6, atol=1e-6)
    with torch.no_grad(), lora.route(model, [adapter] * 5):  # outside the sampler: the float32 weights, as ever
        assert all(torch.equal(got, layer(x)) for got, layer in zip(lora.products(layers, x), layers))
    assert lora.sample_weights(model, "float32") == 0 and all(layer.shared_copy is None for layer in layers)
