"""The optimizers (kernel_backend/engine/optimizers.py): Dimuon's step against a float64 reference, and
both optimizers through the engine: Dimuon's state resumes bit-identically, and mismatched or bad
params change nothing.

Through the engine on the tiny random stand-in for the default model (the `engine` fixture,
tests/tiny_model.py): those are about behaviour. That Dimuon trains a made-up fact is about learning
and stays on the real SmolLM2-135M (`real_engine`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import new_id, sft_datum
from kernel_backend.engine import optimizers
from kernel_backend.engine.optimizers import Dimuon, matrix_sign
from kernel_backend.types import AdamParams, DimuonParams, LoraConfig
from kernel_backend.errors import UserError

FACT = ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton.")


def reference_step(w, momentum, g, lr, beta1, damping, exponent, rank):
    """One Dimuon step in float64 with the exact polar factor (SVD) in place of Newton-Schulz."""
    m = beta1 * momentum + (1 - beta1) * g
    x = m / np.sqrt((m**2).mean())
    p = x / ((x**2).mean(axis=1, keepdims=True) + damping) ** 0.25 / ((x**2).mean(axis=0, keepdims=True) + damping) ** 0.25
    u, _, vt = np.linalg.svd(p, full_matrices=False)
    return w - lr * (rank / 32) ** exponent * (u @ vt), m


@pytest.mark.parametrize("shape", [(4, 24), (24, 4)])  # LoRA A is rank x in, B is out x rank
def test_dimuon_steps_match_a_float64_reference(shape):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=g)
    param = torch.nn.Parameter(w0.clone())
    opt = Dimuon([param], rank=4)
    params = DimuonParams(learning_rate=0.01, beta1=0.8, damping=1e-3, rank_lr_correction_exponent=0.5)
    w, momentum = w0.double().numpy(), np.zeros(shape)
    for _ in range(3):  # the second and third steps use the momentum of the first
        grad = torch.randn(shape, generator=g)
        param.grad = grad.clone()
        optimizers.configure(opt, params)
        opt.step()
        w, momentum = reference_step(w, momentum, grad.double().numpy(), 0.01, 0.8, 1e-3, 0.5, rank=4)
        # Newton-Schulz reaches the polar factor to ~1e-3 of the step (0.01 * (4/32)^0.5 per unit).
        np.testing.assert_allclose(param.detach().double().numpy(), w, rtol=0, atol=2e-5)
    assert float(opt.state[param]["step"]) == 3


def test_matrix_sign_gives_unit_singular_values_and_zero_for_zero():
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(1))
    d = matrix_sign(x)
    s = torch.linalg.svdvals(d)
    assert float(s.min()) > 0.99 and float(s.max()) < 1.01  # so |D|_F = sqrt(8), the rank
    assert float((d.T @ x).trace()) > 0  # the direction of x, not its opposite
    assert torch.equal(matrix_sign(torch.zeros(8, 96)), torch.zeros(8, 96))


def test_rank_correction_scales_the_step():
    def step_size(rank: int, exponent: float) -> float:
        p = torch.nn.Parameter(torch.zeros(4, 16))
        p.grad = torch.ones(4, 16)
        opt = Dimuon([p], rank=rank)
        optimizers.configure(opt, DimuonParams(learning_rate=1.0, rank_lr_correction_exponent=exponent))
        opt.step()
        return float(p.detach().norm())

    assert step_size(64, 0.175) / step_size(32, 0.175) == pytest.approx(2**0.175, rel=1e-6)
    assert step_size(8, 0.175) / step_size(32, 0.175) == pytest.approx(0.25**0.175, rel=1e-6)
    assert step_size(8, 0.0) == pytest.approx(step_size(32, 0.0), rel=1e-6)


# ---- through the engine ------------------------------------------------------------------------------


def dimuon_train(engine, adapter_id, data, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(engine.forward_backward(adapter_id, data).metrics["loss:sum"])
        engine.optim_step(adapter_id, DimuonParams(learning_rate=lr))
    return losses


def weights(engine, adapter_id) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.slots[adapter_id].adapter.state_dict().items()}


def test_dimuon_learns_a_fact(real_engine, tokenizer):
    """On the real model: six steps cut the loss of a made-up fact to under a quarter."""
    adapter = new_id("dimuon-learns")
    real_engine.create_adapter(adapter, LoraConfig(rank=8, seed=0), optimizer="dimuon")
    try:
        losses = dimuon_train(real_engine, adapter, [sft_datum(*FACT, tokenizer)], steps=6)
        assert losses[-1] < losses[0] / 4, losses
    finally:
        real_engine.delete_adapter(adapter)


def test_dimuon_state_resumes_bit_identically(engine, tokenizer, tmp_path):
    data = [sft_datum(*FACT, tokenizer)]
    a, b = new_id("dimuon"), new_id("dimuon-resumed")
    engine.create_adapter(a, LoraConfig(rank=8, seed=0), optimizer="dimuon")
    try:
        dimuon_train(engine, a, data, steps=3)
        engine.save_state(a, tmp_path / "state")
        engine.load_state(b, tmp_path / "state")
        assert optimizers.kind_of(engine.slots[b].optimizer) == "dimuon"
        assert engine.weights_digest(b) == engine.weights_digest(a)  # weights, momentum and step counts

        # Both take the same next steps: the weights stay exactly equal, bit for bit.
        uninterrupted = dimuon_train(engine, a, data, steps=3)
        resumed = dimuon_train(engine, b, data, steps=3)
        assert resumed == uninterrupted
        expected = weights(engine, a)
        assert all(torch.equal(v, expected[k]) for k, v in weights(engine, b).items())

        # Weights alone start a fresh optimizer of the kind asked for (AdamW by default)...
        c = new_id("weights-only")
        engine.load_state(c, tmp_path / "state", with_optimizer=False)
        assert optimizers.kind_of(engine.slots[c].optimizer) == "adamw" and not engine.slots[c].optimizer.state
        engine.delete_adapter(c)
        # ...and the saved state cannot be poured into another optimizer.
        with pytest.raises(UserError, match="dimuon optimizer state"):
            engine.load_state(c, tmp_path / "state", optimizer="adamw")
    finally:
        engine.delete_adapter(a)
        engine.delete_adapter(b)


@pytest.mark.parametrize("kind,params,message", [
    ("dimuon", AdamParams(learning_rate=1e-3), "takes DimuonParams, not AdamParams"),
    ("adamw", DimuonParams(learning_rate=1e-3), "takes AdamParams, not DimuonParams"),
    ("dimuon", DimuonParams(learning_rate=-1.0), "learning_rate"),
    ("dimuon", DimuonParams(learning_rate=1e-3, beta1=1.0), "beta1"),
    ("dimuon", DimuonParams(learning_rate=1e-3, damping=0.0), "damping"),
    ("dimuon", DimuonParams(learning_rate=float("nan")), "learning_rate"),
    ("dimuon", DimuonParams(learning_rate=1e-3, grad_clip_norm="big"), "grad_clip_norm"),
])
def test_wrong_or_bad_params_raise_user_error_and_change_nothing(engine, tokenizer, kind, params, message):
    adapter = new_id(f"bad-{kind}")
    engine.create_adapter(adapter, LoraConfig(rank=2, seed=1), optimizer=kind)
    try:
        engine.forward_backward(adapter, [sft_datum(*FACT, tokenizer)])  # pending gradients
        before = engine.weights_digest(adapter)
        with pytest.raises(UserError, match=message):
            engine.optim_step(adapter, params)
        assert engine.weights_digest(adapter) == before
    finally:
        engine.delete_adapter(adapter)


def test_unknown_optimizer_is_a_user_error(engine):
    with pytest.raises(UserError, match="adamw, dimuon"):
        engine.create_adapter(new_id("lion"), LoraConfig(rank=2), optimizer="lion")
