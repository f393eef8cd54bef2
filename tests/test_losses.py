"""The built-in loss functions against hand-written per-token float64 references.

Each reference computes the value and the gradient w.r.t. the learner logprobs token by token
with plain Python floats, independently of torch autograd.
"""

import math

import pytest
import torch

from kernel_backend.engine import losses
from kernel_backend.engine.losses import (
    LOSSES,
    Loss,
    check_config,
    compute_loss,
    known_inputs,
    optional_inputs,
    required_inputs,
)
from kernel_backend.errors import UserError

TOL = 1e-10
SUPPORTED = "cispo, cross_entropy, dro, gspo, importance_sampling, ppo, stable_reinforce"


def make_batch(seed, shape=(64,)):
    """Learner logprobs lp, sampler logprobs q with ratios around [0.6, 1.65], advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lp = -3.0 * torch.rand(shape, generator=g, dtype=torch.float64)
    q = lp - (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    weights = torch.rand(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) < 0.7).double()  # gspo's sequence_ratio_mask
    mask.view(-1)[0] = 1.0
    sampled = (torch.rand(shape, generator=g) < 0.8).double()  # stable_reinforce's sampled_mask
    sampled.view(-1)[0] = 1.0
    return lp, {"logprobs": q, "advantages": adv, "weights": weights, "sequence_ratio_mask": mask,
                "sampled_mask": sampled}


def run(loss_fn, lp, inputs, config=None, lengths=None):
    """Call compute_loss on a fresh leaf and return (loss value, grad as list, metrics)."""
    lp = lp.clone().requires_grad_(True)
    loss, metrics = compute_loss(loss_fn, lp, inputs, config, lengths)
    assert loss.dim() == 0
    loss.backward()
    return loss.item(), lp.grad.flatten().tolist(), metrics


def flat(*tensors):
    return [t.flatten().tolist() for t in tensors]


def clip(x, lo, hi):
    return min(max(x, lo), hi)


# ---------------------------------------------------------------------------------------------
# References: (value, per-token gradient of the loss w.r.t. lp)


def ref_cross_entropy(lp, w):
    value = -sum(lt * wt for lt, wt in zip(lp, w))
    grad = [-wt for wt in w]
    return value, grad


def ref_importance_sampling(lp, q, adv):
    value, grad = 0.0, []
    for lt, qt, a in zip(lp, q, adv):
        r = math.exp(lt - qt)
        value -= r * a
        grad.append(-r * a)  # d/dlp of -exp(lp - q) * A
    return value, grad


def ref_ppo(lp, q, adv, lo, hi):
    value, grad = 0.0, []
    for lt, qt, a in zip(lp, q, adv):
        r = math.exp(lt - qt)
        unclipped, clipped = r * a, clip(r, lo, hi) * a
        if clipped < unclipped:
            # The clipped branch wins only when r is outside [lo, hi]: a constant, no gradient.
            value -= clipped
            grad.append(0.0)
        else:
            value -= unclipped
            grad.append(-r * a)
    return value, grad


def ref_cispo(lp, q, adv, lo, hi):
    value, grad = 0.0, []
    for lt, qt, a in zip(lp, q, adv):
        w = clip(math.exp(lt - qt), lo, hi)  # a constant weight (stop-gradient)
        value -= w * a * lt
        grad.append(-w * a)
    return value, grad


def ref_dro(lp, q, adv, beta):
    value, grad = 0.0, []
    for lt, qt, a in zip(lp, q, adv):
        value -= lt * a - 0.5 * beta * (lt - qt) ** 2
        grad.append(-(a - beta * (lt - qt)))
    return value, grad


def ref_gspo(lp, q, adv, mask, lengths, lo, hi):
    """Per datum: s = exp(mean of (lp - q) over its masked tokens); every token then is PPO's
    min(s A, clip(s) A) with d(s_t)/d(lp_t) = s (its own logprob's gradient, s's value)."""
    value, grad, start = 0.0, [], 0
    for n in lengths:
        rows = range(start, start + n)
        marked = [i for i in rows if mask[i] != 0]
        s = math.exp(sum(lp[i] - q[i] for i in marked) / len(marked))
        for i in rows:
            unclipped, clipped = s * adv[i], clip(s, lo, hi) * adv[i]
            if clipped < unclipped:  # the clip won: a constant, no gradient
                value -= clipped
                grad.append(0.0)
            else:
                value -= unclipped
                grad.append(-s * adv[i])
        start += n
    return value, grad


def ref_stable_reinforce(lp, q, adv, sampled, limit):
    """Per sampled token: -min(exp(lp - q), C) * A * lp with the weight a constant; others count nothing."""
    value, grad = 0.0, []
    for lt, qt, a, m in zip(lp, q, adv, sampled):
        w = min(math.exp(lt - qt), limit) if m else 0.0
        value -= w * a * lt
        grad.append(-w * a)
    return value, grad


def assert_close(got_value, got_grad, ref):
    ref_value, ref_grad = ref
    assert got_value == pytest.approx(ref_value, abs=TOL, rel=TOL)
    assert len(got_grad) == len(ref_grad)
    for g, r in zip(got_grad, ref_grad):
        assert g == pytest.approx(r, abs=TOL, rel=TOL)


# ---------------------------------------------------------------------------------------------
# Values and gradients


def test_cross_entropy_1d():
    lp, inputs = make_batch(0)
    value, grad, _ = run("cross_entropy", lp, {"weights": inputs["weights"]})
    assert_close(value, grad, ref_cross_entropy(*flat(lp, inputs["weights"])))


def test_cross_entropy_2d():
    lp, inputs = make_batch(1, shape=(16, 3))
    value, grad, _ = run("cross_entropy", lp, {"weights": inputs["weights"]})
    assert_close(value, grad, ref_cross_entropy(*flat(lp, inputs["weights"])))


def test_cross_entropy_weights_default_to_one():
    lp, _ = make_batch(2, shape=(8, 2))
    assert optional_inputs("cross_entropy") == {"weights": 1.0}
    value, grad, _ = run("cross_entropy", lp, {})
    assert_close(value, grad, ref_cross_entropy(lp.flatten().tolist(), [1.0] * lp.numel()))


def test_importance_sampling():
    lp, inputs = make_batch(3)
    value, grad, _ = run("importance_sampling", lp, inputs)
    assert_close(value, grad, ref_importance_sampling(*flat(lp, inputs["logprobs"], inputs["advantages"])))


def test_ppo_random():
    lp, inputs = make_batch(4)
    r = torch.exp(lp - inputs["logprobs"])
    # The batch must exercise both sides of the clip range.
    assert (r < 0.8).any() and (r > 1.2).any() and ((r > 0.8) & (r < 1.2)).any()
    value, grad, _ = run("ppo", lp, inputs)
    assert_close(value, grad, ref_ppo(*flat(lp, inputs["logprobs"], inputs["advantages"]), 0.8, 1.2))


def test_ppo_clip_cases():
    # Four tokens of each kind, hand-picked so every branch of the min is exercised.
    #   r=1.5, A=+1: clipped (1.2 < 1.5) -> value 1.2, grad 0
    #   r=0.5, A=-1: clipped (-0.8 < -0.5) -> value -0.8, grad 0
    #   r=1.5, A=-1: unclipped (-1.5 < -1.2) -> grad -r*A = 1.5
    #   r=0.5, A=+1: unclipped (0.5 < 0.8) -> grad -0.5
    #   r=1.0, A=+2: inside -> grad -2
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0], dtype=torch.float64)
    q = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=torch.float64)
    lp = q + torch.log(ratios)
    value, grad, metrics = run("ppo", lp, {"logprobs": q, "advantages": adv})
    expected_value = -(1.2 * 1.0 + 0.8 * -1.0 + 1.5 * -1.0 + 0.5 * 1.0 + 1.0 * 2.0)
    assert value == pytest.approx(expected_value, abs=TOL)
    assert grad == pytest.approx([0.0, 0.0, 1.5, -0.5, -2.0], abs=TOL)
    assert_close(value, grad, ref_ppo(*flat(lp, q, adv), 0.8, 1.2))
    # Only the two tokens whose gradient the clip removed count as clipped.
    assert metrics["clip_fraction:mean"] == pytest.approx(2 / 5)


def test_ppo_config_override():
    lp, inputs = make_batch(5)
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}
    value, grad, _ = run("ppo", lp, inputs, cfg)
    assert_close(value, grad, ref_ppo(*flat(lp, inputs["logprobs"], inputs["advantages"]), 0.9, 1.05))
    default_value, _, _ = run("ppo", lp, inputs)
    assert value != pytest.approx(default_value, abs=1e-6)


def test_cispo_random():
    lp, inputs = make_batch(6)
    value, grad, _ = run("cispo", lp, inputs)
    assert_close(value, grad, ref_cispo(*flat(lp, inputs["logprobs"], inputs["advantages"]), 0.0, 4.0))


def test_cispo_gradient_is_detached_clipped_ratio():
    # With a tight clip range some ratios are clipped, yet no token's gradient is zero:
    # the gradient is exactly -clip(r) * A, with no d(r)/d(lp) term.
    lp, inputs = make_batch(7)
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    value, grad, metrics = run("cispo", lp, inputs, cfg)
    r = torch.exp(lp - inputs["logprobs"])
    expected_grad = (-r.clamp(0.9, 1.1) * inputs["advantages"]).tolist()
    assert grad == pytest.approx(expected_grad, abs=TOL)
    assert all(g != 0.0 for g in grad)
    assert_close(value, grad, ref_cispo(*flat(lp, inputs["logprobs"], inputs["advantages"]), 0.9, 1.1))
    clipped = ((r < 0.9) | (r > 1.1)).double().mean().item()
    assert 0 < clipped < 1
    assert metrics["clip_fraction:mean"] == pytest.approx(clipped)


def test_dro_default_and_override():
    lp, inputs = make_batch(8)
    args = flat(lp, inputs["logprobs"], inputs["advantages"])
    value, grad, _ = run("dro", lp, inputs)
    assert_close(value, grad, ref_dro(*args, 0.05))
    value, grad, _ = run("dro", lp, inputs, {"beta": 0.7})
    assert_close(value, grad, ref_dro(*args, 0.7))


def test_stable_reinforce_truncates_a_detached_weight():
    # Ratios from about 0.6 to 1.65 with C = 1.2 truncate some tokens; as in cispo the weight is a
    # constant, so a truncated token keeps a gradient (-C * A) instead of losing it.
    lp, inputs = make_batch(15)
    args = flat(lp, inputs["logprobs"], inputs["advantages"], inputs["sampled_mask"])
    value, grad, metrics = run("stable_reinforce", lp, inputs)
    assert_close(value, grad, ref_stable_reinforce(*args, 2.0))
    value, grad, metrics = run("stable_reinforce", lp, inputs, {"clip_high_threshold": 1.2})
    assert_close(value, grad, ref_stable_reinforce(*args, 1.2))
    on = inputs["sampled_mask"] != 0
    ratio = torch.exp(lp - inputs["logprobs"])[on]
    assert 0 < metrics["truncated_fraction:mean"] < 1
    assert metrics["truncated_fraction:mean"] == pytest.approx((ratio > 1.2).double().mean().item())
    assert metrics["importance_ratio:mean"] == pytest.approx(ratio.mean().item(), abs=TOL)
    assert metrics["importance_ratio:max"] == pytest.approx(ratio.max().item(), abs=TOL)
    assert all(g == 0.0 for g, m in zip(grad, on.tolist()) if not m)  # only sampled tokens train
    with pytest.raises(UserError, match="positive"):
        check_config("stable_reinforce", {"clip_high_threshold": 0.0})


def gspo_args(lp, inputs):
    return flat(lp, inputs["logprobs"], inputs["advantages"], inputs["sequence_ratio_mask"])


def test_gspo_default_clip_range():
    # Three datums; sequence log-ratios of a few tenths lie far outside the default (1 - 3e-4,
    # 1 + 4e-4), so each datum's tokens are clipped or not by the sign of their advantage.
    lp, inputs = make_batch(11)
    lengths = [10, 30, 24]
    value, grad, metrics = run("gspo", lp, inputs, lengths=lengths)
    assert_close(value, grad, ref_gspo(*gspo_args(lp, inputs), lengths, 1 - 3e-4, 1 + 4e-4))
    assert 0 < metrics["clip_fraction:mean"] < 1
    assert any(g == 0.0 for g in grad) and any(g != 0.0 for g in grad)


def test_gspo_ratio_is_per_sequence_with_per_token_gradient():
    # One datum whose sequence ratio is inside a wide range: every token's gradient is -s * A_t,
    # the same s for all (even for tokens outside the mask), not its own token ratio.
    lp, inputs = make_batch(12)
    cfg = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    value, grad, metrics = run("gspo", lp, inputs, cfg)
    in_ratio = inputs["sequence_ratio_mask"] != 0
    s = torch.exp((lp - inputs["logprobs"])[in_ratio].mean())
    assert grad == pytest.approx((-s * inputs["advantages"]).tolist(), abs=TOL)
    assert_close(value, grad, ref_gspo(*gspo_args(lp, inputs), [lp.numel()], 0.1, 10.0))
    assert metrics["clip_fraction:mean"] == 0.0
    # The mask matters: averaging over every token gives another ratio, so another loss.
    everything = {**inputs, "sequence_ratio_mask": torch.ones_like(lp)}
    assert run("gspo", lp, everything, cfg)[0] != pytest.approx(value, abs=1e-6)


def test_gspo_two_datums_differ_from_one():
    # The sequence ratio must not leak across datums: splitting the batch changes the value.
    lp, inputs = make_batch(13)
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    split = run("gspo", lp, inputs, cfg, lengths=[32, 32])
    assert_close(split[0], split[1], ref_gspo(*gspo_args(lp, inputs), [32, 32], 0.5, 2.0))
    assert run("gspo", lp, inputs, cfg)[0] != pytest.approx(split[0], abs=1e-6)


def test_gspo_datum_with_empty_mask_is_a_user_error():
    lp, inputs = make_batch(14, shape=(8,))
    inputs["sequence_ratio_mask"] = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float64)
    with pytest.raises(UserError, match=r"data\[1\].*marks no token"):
        compute_loss("gspo", lp.clone().requires_grad_(True), inputs, None, [4, 4])


def test_float32_inputs_are_cast():
    # Inputs usually arrive as float32; the loss follows the logprobs' dtype.
    lp, inputs = make_batch(9)
    inputs32 = {k: v.float() for k, v in inputs.items()}
    loss, _ = compute_loss("ppo", lp.clone().requires_grad_(True), inputs32, None)
    assert loss.dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Metrics


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_metrics(loss_fn):
    lp, inputs = make_batch(10)
    loss, metrics = compute_loss(loss_fn, lp.clone().requires_grad_(True), inputs, {})
    assert metrics["loss:sum"] == pytest.approx(loss.item(), abs=TOL)
    assert set(metrics) == {"loss:sum", *LOSSES[loss_fn].metrics}  # the record says what its loss reports
    for key, value in metrics.items():
        assert key.count(":") == 1, key
        assert key.split(":")[1] in {"mean", "sum", "min", "max"}, key
        assert isinstance(value, float) and math.isfinite(value)
    if loss_fn != "cross_entropy":
        on = inputs["sampled_mask"] != 0 if loss_fn == "stable_reinforce" else inputs["advantages"] != 0
        kl = (inputs["logprobs"] - lp)[on].mean().item()
        assert metrics["kl_sample_train:mean"] == pytest.approx(kl, abs=TOL)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_kl_sample_train_counts_only_the_policys_tokens(loss_fn):
    """A multi-turn datum as tinker-cookbook builds it: prompt and tool tokens carry advantage 0 and a
    placeholder sampler logprob 0. On-policy (the learner's logprobs equal the sampler's on the policy's
    tokens) the KL is 0, whatever the learner thinks of the placeholders; a tied batch counts every token."""
    lp, inputs = make_batch(11)
    observation = torch.zeros_like(lp, dtype=torch.bool)
    observation[:20] = True
    observation[40:50] = True
    inputs["advantages"][observation] = 0.0
    inputs["logprobs"] = torch.where(observation, torch.zeros_like(lp), lp)  # on-policy on the policy's tokens
    _, metrics = compute_loss(loss_fn, lp.clone().requires_grad_(True), inputs, {})
    assert metrics["kl_sample_train:mean"] == pytest.approx(0.0, abs=TOL)
    inputs["advantages"] = torch.zeros_like(lp)
    _, tied = compute_loss(loss_fn, lp.clone().requires_grad_(True), inputs, {})
    assert tied["kl_sample_train:mean"] == pytest.approx((inputs["logprobs"] - lp).mean().item(), abs=TOL)


# ---------------------------------------------------------------------------------------------
# Names, inputs and config


def test_required_inputs():
    assert required_inputs("cross_entropy") == ()
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        assert set(required_inputs(name)) == {"logprobs", "advantages"}
        assert optional_inputs(name) == {}
    assert set(required_inputs("gspo")) == {"logprobs", "advantages", "sequence_ratio_mask"}
    assert set(required_inputs("stable_reinforce")) == {"logprobs", "advantages", "sampled_mask"}
    assert known_inputs()[0] == "target_tokens"
    assert set(known_inputs()) == {"target_tokens", "weights", "advantages", "logprobs", "sequence_ratio_mask",
                                   "sampled_mask"}


@pytest.mark.parametrize(
    "call",
    [
        lambda: required_inputs("foo"),
        lambda: optional_inputs("foo"),
        lambda: check_config("foo", None),
        lambda: compute_loss("foo", torch.zeros(2, requires_grad=True), {}, None),
    ],
)
def test_unknown_loss(call):
    with pytest.raises(UserError) as e:
        call()
    assert "'foo'" in str(e.value) and SUPPORTED in str(e.value)


def test_check_config_defaults():
    assert check_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert check_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert check_config("dro", None) == {"beta": 0.05}
    assert check_config("gspo", None) == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert check_config("stable_reinforce", None) == {"clip_high_threshold": 2.0}
    assert check_config("cross_entropy", None) == {}
    assert check_config("ppo", {"clip_high_threshold": 2}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}


def test_check_config_unknown_key():
    with pytest.raises(UserError) as e:
        check_config("ppo", {"clip_eps": 0.2})
    assert "clip_eps" in str(e.value) and "clip_high_threshold, clip_low_threshold" in str(e.value)
    with pytest.raises(UserError):
        check_config("cross_entropy", {"beta": 0.1})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None, True])
def test_check_config_bad_values(value):
    with pytest.raises(UserError):
        check_config("dro", {"beta": value})


def test_check_config_low_above_high():
    with pytest.raises(UserError):
        check_config("ppo", {"clip_low_threshold": 1.5})


def test_missing_and_misshaped_inputs():
    lp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(UserError, match="advantages"):
        compute_loss("ppo", lp, {"logprobs": torch.zeros(4)}, None)
    with pytest.raises(UserError, match="shape"):
        compute_loss("cross_entropy", lp, {"weights": torch.ones(5)}, None)


# ---------------------------------------------------------------------------------------------
# A new loss is one record: put in the table, the wire, the engine's checks and compute_loss take it


def scaled_mask(logprobs, inputs, config):
    """A toy loss: L = -scale * sum(toy_mask * lp)."""
    loss = -config["scale"] * (inputs["toy_mask"] * logprobs).sum()
    return loss, {"toy_tokens:sum": float(inputs["toy_mask"].sum())}


TOY = Loss(scaled_mask, inputs=("toy_mask",), config={"scale": 1.0}, metrics=("toy_tokens:sum",))


def toy_body(model_id, loss_fn, inputs, config=None):
    """A JSON forward body as a client sends it: 5 tokens, each input a float32 TensorData."""
    tensors = {name: {"data": values, "dtype": "float32", "shape": [5]} for name, values in inputs.items()}
    tensors["target_tokens"] = {"data": [2, 3, 4, 5, 6], "dtype": "int64", "shape": [5]}
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4, 5]}]}, "loss_fn_inputs": tensors}
    return {"model_id": model_id, "forward_input": {"data": [datum], "loss_fn": loss_fn, "loss_fn_config": config or {}}}


def test_a_new_loss_is_one_record(engine, adapters, monkeypatch):
    from kernel_backend.api import wire

    adapter = adapters("toy")
    mask = [0.0, 1.0, 1.0, 0.0, 1.0]

    def forward(loss_fn, inputs, config=None):
        call = wire.forward_backward_from_json(toy_body(adapter, loss_fn, inputs, config))
        return engine.forward(call.model_id, call.data, call.loss_fn, call.loss_fn_config)

    with pytest.raises(UserError, match="unknown key"):  # before the record: its input is no loss's
        forward("cross_entropy", {"toy_mask": mask})
    with pytest.raises(UserError, match="unknown loss_fn 'toy'"):
        forward("toy", {})

    monkeypatch.setitem(losses.LOSSES, "toy", TOY)
    reference = forward("cross_entropy", {"weights": mask}).metrics["loss:sum"]
    result = forward("toy", {"toy_mask": mask}, {"scale": 3.0})
    assert result.metrics["loss:sum"] == pytest.approx(3 * reference, rel=1e-6)
    assert result.metrics["toy_tokens:sum"] == 3.0
    assert forward("toy", {"toy_mask": mask}).metrics["loss:sum"] == pytest.approx(reference, rel=1e-6)  # its default
    with pytest.raises(UserError, match="missing 'toy_mask', which loss_fn 'toy' needs"):
        forward("toy", {"weights": mask})
    with pytest.raises(UserError, match="unknown loss_fn_config key 'beta' for toy; allowed keys: scale"):
        forward("toy", {"toy_mask": mask}, {"beta": 1.0})
    assert "toy" in str(pytest.raises(UserError, forward, "nope", {}).value)  # and the supported names list it


def test_the_rl_recipe_takes_the_tables_rl_losses():
    """The recipe's losses are read from the table: those its datums carry the inputs of, and stable_reinforce."""
    from workbench.recipes import rl

    assert rl.LOSSES == ("importance_sampling", "ppo", "cispo", "dro", "stable_reinforce")
