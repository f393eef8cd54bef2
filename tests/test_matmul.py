"""The base layers' products through oneDNN (kernel_backend/engine/matmul.py) give torch's numbers.

oneDNN sums in another order than MKL, so results agree to float32 rounding, not bit for bit:
checked on single products (forward and input gradient) and on the real model (logprobs, a
training step's LoRA gradients). That test stays on the real SmolLM2-135M (`real_engine`), not the
tiny stand-in: the agreement it checks is at the real model's widths (576 and 1536) and 30 layers deep.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from helpers import new_id, sft_datum, train
from kernel_backend.engine import lora, matmul
from kernel_backend.types import LoraConfig

onednn_only = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@onednn_only
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_onednn_linear_matches_torch_forward_and_input_gradient(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(rows, 64, generator=generator, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, expected = matmul.onednn_linear(x, weight, bias), F.linear(x_ref, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    grad = torch.randn(rows, 96, generator=generator)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-4)


def test_onednn_linear_refuses_a_trainable_weight():
    with pytest.raises(ValueError, match="frozen"):
        matmul.onednn_linear(torch.randn(2, 4), torch.randn(3, 4, requires_grad=True))


def test_choose():
    assert matmul.choose("torch", "cpu", torch.float32) is F.linear
    assert matmul.choose("onednn", "cpu", torch.bfloat16) is F.linear  # float32 only
    assert matmul.choose("auto", "cuda", torch.float32) is F.linear
    if torch.backends.mkldnn.is_available():
        assert matmul.choose("onednn", "cpu", torch.float32) is matmul.onednn_linear
    with pytest.raises(ValueError, match="auto, onednn, torch"):
        matmul.choose("mkl", "cpu", torch.float32)


@pytest.mark.parametrize("vendor, flags, expected", [
    ("AuthenticAMD", "fma avx2 avx512f avx512bw", "onednn"),  # Zen 4: oneDNN's AVX-512 code beats MKL's AVX2
    ("AuthenticAMD", "fma avx2", "torch"),                      # Zen 2/3: both run AVX2, MKL's is faster
    ("GenuineIntel", "fma avx2 avx512f", "torch"),              # MKL's own AVX-512 code
])
def test_auto_picks_onednn_only_on_an_amd_cpu_with_avx512(monkeypatch, vendor, flags, expected):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(matmul.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(matmul, "_cpu_info", lambda field: {"vendor_id": vendor, "flags": flags}[field])
    want = matmul.onednn_linear if expected == "onednn" else F.linear
    assert matmul.choose("auto", "cpu", torch.float32) is want


@onednn_only
def test_the_real_model_computes_the_same_logprobs_and_gradients_either_way(real_engine, tokenizer):
    engine = real_engine
    adapter_id = new_id("onednn")
    engine.create_adapter(adapter_id, LoraConfig(rank=8, seed=2))
    datum = sft_datum("What is your favorite color?", "Blue, like the sea.", tokenizer)
    tokens = datum.tokens + [int(datum.loss_fn_inputs["target_tokens"][-1])]
    layers = lora.lora_layers(engine.model).values()
    previous = [layer.product for layer in layers]

    def run(product):
        for layer in layers:
            layer.product = product
        logprobs = engine.compute_logprobs(adapter_id, tokens)
        loss = engine.forward_backward(adapter_id, [datum]).metrics["loss:sum"]
        adapter = engine._slot(adapter_id).adapter
        grads = [p.grad.clone() for p in adapter.parameters()]
        for p in adapter.parameters():
            p.grad = None
        return logprobs, loss, grads

    try:
        train(engine, adapter_id, [datum], steps=1, learning_rate=1e-2)  # B moves off zero: A gets gradients too
        ours, theirs = run(matmul.onednn_linear), run(F.linear)
    finally:
        for layer, product in zip(layers, previous):
            layer.product = product
        engine.delete_adapter(adapter_id)
    np.testing.assert_allclose(ours[0][1:], theirs[0][1:], rtol=0, atol=1e-4)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-5)
    # Float32 sums in another order: an element near zero differs by a share of the tensor's scale, not of its own
    # value. Measured on an AVX2-only AMD EPYC (MKL's AVX2 kernels vs oneDNN's): at most 1.6e-5 of the largest
    # gradient (one element in 4608), past the 1e-5 set on another machine.
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=3e-5 * float(b.abs().max()))
