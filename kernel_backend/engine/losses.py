"""The built-in loss functions, with Tinker's semantics.

This module owns the loss definitions the engine applies to the model's log-probabilities of
the target tokens: cross_entropy, importance_sampling, ppo, cispo, dro, gspo and stable_reinforce.
Each is one record (`Loss`) in one table (`LOSSES`): its function, the `loss_fn_inputs` it needs,
its `loss_fn_config` keys and defaults, the metrics it reports; the engine's checks and the RL
recipe read that table. It also owns how micro-batches' metrics merge, and the log-probabilities themselves (`target_logprobs`: log_softmax and gather, with a lean backward). stable_reinforce's sampler logprobs and sampled-token mask
are not the client's: the service fills them from what the sampler recorded (service/stability.py).

Every loss is a SUM over tokens, never a mean: Tinker does no length normalisation, so a
client that wants a mean puts it into `weights` or `advantages` (see
docs: tinker /losses; reference/peers.md section 7). The engine concatenates all datums of a
batch along dim 0 before calling `compute_loss`, so one call covers the whole batch.

Notation: lp = learner logprob (requires grad), q = sampler logprob (`inputs["logprobs"]`),
A = advantage, r = exp(lp - q) the per-token importance ratio, sg[] = stop-gradient.
A loss with a per-sequence term (gspo) finds each row's datum in `inputs["datum_index"]`,
which compute_loss adds from the datums' lengths.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, cast

import torch

from kernel_backend.errors import UserError
from kernel_backend.types import MAX_TOPK_LOGPROBS

# A loss takes (logprobs, inputs, config) and returns (summed loss, extra metrics).
LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], tuple[torch.Tensor, dict[str, float]]]


def _mean(x: torch.Tensor) -> float:
    # A metric must stay a finite number even for an empty batch.
    return float(x.detach().double().mean()) if x.numel() else 0.0


def _ratio(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logprobs - inputs["logprobs"])


def _kl_sample_train(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor]) -> float:
    # mean(q - lp) over the sampled tokens is the simple (k1) estimator of KL(sampler || learner):
    # it grows when the learner drifts from the policy that generated the data. The policy's tokens
    # are those with an advantage: a prompt's or a tool's tokens carry advantage 0 and a placeholder
    # q of 0 (tinker-cookbook's multi-turn datums), and counting them would report the learner's own
    # -lp as KL (2.05 on guess_number where on-policy it is ~0). A batch with no advantage anywhere
    # (every group tied) has no policy token to tell: all of its tokens count.
    trained = inputs["advantages"] != 0
    on = trained if trained.any() else torch.ones_like(trained)
    return _mean((inputs["logprobs"] - logprobs)[on])


# ---------------------------------------------------------------------------------------------
# The losses


def cross_entropy(logprobs, inputs, config):
    """L = -sum(w * lp). Shapes (T,) or (T, K); weights default to 1 (filled by compute_loss)."""
    loss = -(logprobs * inputs["weights"]).sum()
    return loss, {}


def importance_sampling(logprobs, inputs, config):
    """L = -sum(r * A): REINFORCE corrected for sampler/learner mismatch, ratio unbounded."""
    ratio = _ratio(logprobs, inputs)
    loss = -(ratio * inputs["advantages"]).sum()
    return loss, {"kl_sample_train:mean": _kl_sample_train(logprobs, inputs)}


def ppo(logprobs, inputs, config):
    """L = -sum(min(r * A, clip(r, lo, hi) * A)), per token.

    The min takes the pessimistic branch: a token whose ratio has already moved past the clip
    in the direction its advantage pushes gets the constant clipped value, hence zero gradient.
    """
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    adv = inputs["advantages"]
    ratio = _ratio(logprobs, inputs)
    unclipped = ratio * adv
    clipped = ratio.clamp(lo, hi) * adv
    loss = -torch.minimum(unclipped, clipped).sum()
    # Count the tokens where the clip actually won the min, i.e. whose gradient it removed;
    # a ratio outside [lo, hi] on the side the advantage does not push is not clipped in PPO.
    was_clipped = clipped < unclipped
    return loss, {
        "clip_fraction:mean": _mean(was_clipped.float()),
        "kl_sample_train:mean": _kl_sample_train(logprobs, inputs),
    }


def cispo(logprobs, inputs, config):
    """L = -sum(sg[clip(r, lo, hi)] * A * lp).

    The clipped ratio is a detached weight on a REINFORCE term, so clipping bounds a token's
    step size but never zeroes its gradient (MiniMax-M1). Tinker's default is one-sided: 0 / 4.
    """
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = _ratio(logprobs, inputs).detach()
    weight = ratio.clamp(lo, hi)
    loss = -(weight * inputs["advantages"] * logprobs).sum()
    was_clipped = (ratio < lo) | (ratio > hi)
    return loss, {
        "clip_fraction:mean": _mean(was_clipped.float()),
        "kl_sample_train:mean": _kl_sample_train(logprobs, inputs),
    }


def dro(logprobs, inputs, config):
    """L = -sum(lp * A - (beta / 2) * (lp - q)^2): Direct Reward Optimization (Richemond et al. 2024).

    The quadratic term keeps the learner near the sampler instead of clipping a ratio.
    """
    beta = config["beta"]
    diff = logprobs - inputs["logprobs"]
    loss = -(logprobs * inputs["advantages"] - 0.5 * beta * diff.square()).sum()
    return loss, {"kl_sample_train:mean": _kl_sample_train(logprobs, inputs)}


def gspo(logprobs, inputs, config):
    """L = -sum(min(s_t * A, clip(s_t, lo, hi) * A)): GSPO-token (Zheng et al. 2025), Tinker's variant.

    s = exp(mean over the datum's masked tokens of (lp - q)) is one ratio per sequence (the
    geometric mean of its token ratios; `sequence_ratio_mask` != 0 marks the tokens it averages).
    Every token of the datum carries s's value but its own gradient: s_t = sg[s] * exp(lp - sg[lp]),
    so per-token advantages still work. Clipping that one ratio keeps or drops a whole sequence.
    """
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    adv, index = inputs["advantages"], inputs["datum_index"]
    in_ratio = inputs["sequence_ratio_mask"] != 0
    diff = (logprobs.detach() - inputs["logprobs"])[in_ratio]
    datums = int(index.max()) + 1 if index.numel() else 0
    counts = torch.zeros(datums, dtype=logprobs.dtype, device=logprobs.device).index_add_(
        0, index[in_ratio], torch.ones_like(diff))
    if (counts == 0).any():
        empty = int((counts == 0).nonzero()[0])
        raise UserError(
            f"gspo: loss_fn_inputs['sequence_ratio_mask'] of data[{empty}] marks no token; mark (with 1) "
            "the sampled tokens whose ratios make the sequence ratio"
        )
    sums = torch.zeros_like(counts).index_add_(0, index[in_ratio], diff)
    log_ratio = (sums / counts)[index]  # the datum's sequence log-ratio, on each of its rows
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(lo, hi) * adv
    loss = -torch.minimum(unclipped, clipped).sum()
    return loss, {
        "clip_fraction:mean": _mean((clipped < unclipped).float()),
        "kl_sample_train:mean": _kl_sample_train(logprobs, inputs),
    }


def stable_reinforce(logprobs, inputs, config):
    """L = -sum(m * sg[min(r, C)] * A * lp): REINFORCE with a truncated importance weight (OUR objective).

    Tinker names this loss but does not publish its formula, so this one is ours: truncated
    importance sampling (TIS, Yao et al. 2025; the truncated weights of IMPALA / V-trace). q is the
    logprob the sampler computed for the token when it drew it, recorded by the server at sampling
    time (`record_stability_info`), not sent by the client; r = exp(lp - q) corrects for the learner
    having moved (async RL) or computing differently (other numerics); truncating it at C
    (`clip_high_threshold`, default 2) bounds the variance of one token's step, and the weight is a
    stop-gradient, so the gradient is the REINFORCE one, A * grad(lp), scaled. m (`sampled_mask`,
    from the datum's provenance) is 1 on sampled tokens: only they have a sampler logprob.
    """
    limit = config["clip_high_threshold"]
    sampled = inputs["sampled_mask"] != 0
    ratio = torch.exp((logprobs.detach() - inputs["logprobs"]) * sampled)  # 1 off the sampled tokens
    weight = ratio.clamp(max=limit)
    loss = -(sampled * weight * inputs["advantages"] * logprobs).sum()
    on = ratio[sampled]
    return loss, {
        "importance_ratio:mean": _mean(on),
        "importance_ratio:max": float(on.max()) if on.numel() else 0.0,
        "truncated_fraction:mean": _mean((on > limit).float()),
        "kl_sample_train:mean": _mean((inputs["logprobs"] - logprobs)[sampled]),
    }


# ---------------------------------------------------------------------------------------------
# The table: one record per loss, all that the engine (its input check, check_config, compute_loss) and the RL
# recipe (workbench/recipes/rl.py) know of it. A new loss is its function above and one Loss in LOSSES
# (docs/architecture.md, "Adding a loss").


@dataclass(frozen=True)
class Loss:
    """One loss: its function and all the engine checks before calling it."""

    fn: LossFn
    inputs: tuple[str, ...] = ()  # the loss_fn_inputs it needs besides target_tokens
    optional: dict[str, float] = field(default_factory=dict)  # inputs a caller may leave out: the value that fills them
    config: dict[str, float] = field(default_factory=dict)  # its loss_fn_config keys, with their defaults
    metrics: tuple[str, ...] = ()  # what fn reports besides loss:sum, each "name:reduction" (see merge_metrics)
    check: Callable[[dict[str, float]], None] | None = None  # a further check of the merged config; raises UserError


def _positive_truncation(config: dict[str, float]) -> None:
    if config["clip_high_threshold"] <= 0:
        raise UserError(f"loss_fn_config clip_high_threshold must be positive for stable_reinforce (it truncates the "
                        f"importance weight), got {config['clip_high_threshold']}")


_RL_INPUTS = ("logprobs", "advantages")
_KL = "kl_sample_train:mean"

# The defaults: ppo's and cispo's are Tinker's documented ones. Tinker does not publish a default beta for dro;
# 0.05 is our choice (TuFT uses 0.01), so clients that care should pass beta explicitly. gspo's are the GSPO
# paper's clip range (1 - 3e-4, 1 + 4e-4): a sequence ratio moves far less than a token's, so PPO's 0.8 / 1.2
# would almost never clip. Tinker's page gives gspo's formula but no defaults: pass them to be sure.
# stable_reinforce's truncation C = 2 is ours (TIS uses a small constant; 2 lets the learner double a token's
# probability before its weight stops growing); its logprobs and sampled_mask are filled by the service from the
# datum's provenance (service/stability.py), not sent by the client.
LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(cross_entropy, optional={"weights": 1.0}),
    "importance_sampling": Loss(importance_sampling, _RL_INPUTS, metrics=(_KL,)),
    "ppo": Loss(ppo, _RL_INPUTS, config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                metrics=("clip_fraction:mean", _KL)),
    "cispo": Loss(cispo, _RL_INPUTS, config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
                  metrics=("clip_fraction:mean", _KL)),
    "dro": Loss(dro, _RL_INPUTS, config={"beta": 0.05}, metrics=(_KL,)),
    "gspo": Loss(gspo, (*_RL_INPUTS, "sequence_ratio_mask"),
                 config={"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
                 metrics=("clip_fraction:mean", _KL)),
    "stable_reinforce": Loss(stable_reinforce, (*_RL_INPUTS, "sampled_mask"), config={"clip_high_threshold": 2.0},
                             metrics=("importance_ratio:mean", "importance_ratio:max", "truncated_fraction:mean", _KL),
                             check=_positive_truncation),
}


# ---------------------------------------------------------------------------------------------
# What the engine calls


def _loss(loss_fn: str) -> Loss:
    if loss_fn not in LOSSES:
        raise UserError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(sorted(LOSSES))}")
    return LOSSES[loss_fn]


def known_inputs() -> tuple[str, ...]:
    """Every loss_fn_inputs name some loss reads, target_tokens first: the engine rejects any other by name."""
    names = ["target_tokens"]
    for loss in LOSSES.values():
        names += [name for name in (*loss.optional, *loss.inputs) if name not in names]
    return tuple(names)


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The loss_fn_inputs that must be present besides target_tokens."""
    return _loss(loss_fn).inputs


def optional_inputs(loss_fn: str) -> dict[str, float]:
    """The loss_fn_inputs that may be omitted, each with the value that fills it."""
    return dict(_loss(loss_fn).optional)


# Any loss's loss_fn_config may also ask for each position's k most likely tokens and their logprobs
# (loss_fn_outputs "topk_token_ids" and "topk_logprobs", N x k): what a soft-label or top-k distillation loss
# needs (issue 43). Ours, beyond Tinker's keys; docs/tinker-surface.md. k is bounded as the sampler's top-k is.
TOPK_KEY = "topk_logprobs"


def topk_of(config: dict | None) -> int:
    """The k a loss_fn_config asks for (0: none); a UserError for anything but an integer in [0, MAX_TOPK_LOGPROBS]."""
    k = (config or {}).get(TOPK_KEY, 0)
    # A Real converts and compares as a float does (typeshed's numbers.Real shows mypy neither); a non-finite float
    # is refused before int() would raise on it.
    number = cast(float, k)
    if (isinstance(k, bool) or not isinstance(k, numbers.Real) or isinstance(k, float) and not math.isfinite(k)
            or number != int(number) or not 0 <= number <= MAX_TOPK_LOGPROBS):
        raise UserError(f"loss_fn_config[{TOPK_KEY!r}] must be an integer from 0 to {MAX_TOPK_LOGPROBS}, got {k!r}")
    return int(number)


def check_config(loss_fn: str, config: dict | None) -> dict[str, float]:
    """Merge the caller's loss_fn_config over the defaults, rejecting anything we would ignore (TOPK_KEY is
    every loss's, read by topk_of)."""
    loss = _loss(loss_fn)
    defaults = loss.config
    merged = dict(defaults)
    allowed = ", ".join(sorted([*defaults, TOPK_KEY]))
    for key, value in (config or {}).items():
        if key == TOPK_KEY:
            topk_of(config)
            continue
        if key not in defaults:
            # Silently ignoring a misspelt key would train with the default instead.
            raise UserError(f"unknown loss_fn_config key {key!r} for {loss_fn}; allowed keys: {allowed}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise UserError(f"loss_fn_config[{key!r}] must be a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise UserError(f"loss_fn_config[{key!r}] must be finite, got {value}")
        merged[key] = float(value)
    if "clip_low_threshold" in merged and merged["clip_low_threshold"] > merged["clip_high_threshold"]:
        raise UserError(
            f"loss_fn_config clip_low_threshold ({merged['clip_low_threshold']}) must not exceed "
            f"clip_high_threshold ({merged['clip_high_threshold']})"
        )
    if loss.check:
        loss.check(merged)
    return merged


def compute_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    config: dict[str, float] | None,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Apply `loss_fn` to a batch's target-token logprobs.

    logprobs: shape (T,) or (T, K), the datums of a batch concatenated along dim 0.
    inputs: the loss_fn_inputs other than target_tokens, concatenated the same way.
    config: the caller's loss_fn_config (None or {} for the defaults).
    lengths: each datum's number of rows (summing to T); None means one datum.
    Returns the scalar loss (a sum over all tokens) and metrics keyed "name:reduction",
    always including "loss:sum".
    """
    config = check_config(loss_fn, config)
    full = {}
    for name in required_inputs(loss_fn):
        if name not in inputs:
            raise UserError(f"loss_fn {loss_fn} needs loss_fn_inputs[{name!r}]")
        full[name] = inputs[name]
    for name, fill in optional_inputs(loss_fn).items():
        full[name] = inputs[name] if name in inputs else torch.full_like(logprobs, fill)
    for name, value in full.items():
        if value.shape != logprobs.shape:
            raise UserError(
                f"loss_fn_inputs[{name!r}] has shape {tuple(value.shape)}, "
                f"expected {tuple(logprobs.shape)} (the shape of target_tokens)"
            )
        # Inputs arrive as float32 (or int); compute in the logprobs' dtype and device.
        full[name] = value.to(dtype=logprobs.dtype, device=logprobs.device)
    lengths = [logprobs.shape[0]] if lengths is None else lengths
    if sum(lengths) != logprobs.shape[0]:
        raise ValueError(f"datum lengths {lengths} do not add up to the batch's {logprobs.shape[0]} rows")
    index = torch.arange(len(lengths), device=logprobs.device)
    rows = torch.repeat_interleave(index, torch.tensor(lengths, device=logprobs.device))
    full["datum_index"] = rows.reshape(-1, *[1] * (logprobs.dim() - 1)).expand(logprobs.shape)

    loss, metrics = LOSSES[loss_fn].fn(logprobs, full, config)
    return loss, {"loss:sum": float(loss.detach()), **metrics}


# ---- the losses' input and their metrics across micro-batches -------------------------------


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits).gather(-1, targets), with a leaner backward than autograd's.

    Forward runs the fused log_softmax kernel once and keeps its output; backward turns that
    output into softmax in place: d/dlogits = scatter(g) - softmax * sum(g). No other
    vocabulary-sized tensor is allocated (cross_entropy's backward allocates two, each
    batch x length x vocab floats, plus the zero fill of one).
    With `index` (flat logits, N x V), target row i is read at logits row index[i]: rows that share a
    prefix share its logits (engine/prefix_tree.py), each with its own targets, and their gradients add up.
    With `overwrite`, log_softmax is written over the logits themselves (bit-identical to a fresh output).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                overwrite: bool) -> torch.Tensor:
        logprobs = torch.log_softmax(logits, dim=-1, out=logits) if overwrite else torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(logprobs, targets, index)
        if index is None:
            return logprobs.gather(-1, targets)
        return logprobs[index[:, None], targets]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logprobs, targets, index = ctx.saved_tensors
        grad_logits = logprobs.exp_()  # saved for this backward only: reuse its memory
        if index is None:
            grad_logits.mul_(-grad.sum(-1, keepdim=True))
            grad_logits.scatter_add_(-1, targets, grad)
        else:
            total = torch.zeros(len(grad_logits), dtype=grad.dtype, device=grad.device).index_add_(0, index, grad.sum(-1))
            grad_logits.mul_(-total[:, None])
            grad_logits.index_put_((index[:, None].expand_as(targets), targets), grad, accumulate=True)
        return grad_logits, None, None, None


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's k most likely token ids and their logprobs (log_softmax over the whole vocabulary)."""
    with torch.no_grad():  # log_softmax, as target_logprobs computes them (logsumexp rounds differently, ~1e-5)
        best = torch.topk(logits.log_softmax(-1), k, dim=-1)
        return best.indices, best.values


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None = None,
                    overwrite: bool = False) -> torch.Tensor:
    """logits (..., V), targets (..., K) int64 -> the targets' logprobs, shape (..., K).
    With `index`: logits (N, V), targets (M, K), target row i read at logits row index[i].

    `overwrite=True`: the logits' memory takes their log_softmax, for a caller that reads them no more (autograd's
    version check fails the backward loudly if a node saved them). A training step's logits are vocabulary-wide
    (8 x 128 tokens: 201 MB); a fresh tensor that large is memory glibc maps anew, and the kernel faults it in a page
    at a time: 49,153 faults, about as long as the log_softmax itself (docs/performance.md, "Training after
    sampling")."""
    return _TargetLogprobs.apply(logits, targets, index, overwrite)


def merge_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Combine per-micro-batch metrics: sums add, means weight by token count, min/max reduce."""
    if len(parts) == 1:
        return parts[0][0]
    merged: dict[str, float] = {}
    total = sum(n for _, n in parts) or 1
    for key in parts[0][0]:
        values = [(m[key], n) for m, n in parts]
        reduction = key.rsplit(":", 1)[-1]
        if reduction == "sum":
            merged[key] = sum(v for v, _ in values)
        elif reduction == "min":
            merged[key] = min(v for v, _ in values)
        elif reduction == "max":
            merged[key] = max(v for v, _ in values)
        else:
            merged[key] = sum(v * n for v, n in values) / total
    return merged
