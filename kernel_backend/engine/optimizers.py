"""The two optimizers a training run can choose: AdamW (Tinker's default) and Dimuon.

This module owns an adapter's optimizer: building it (`create`), checking a step's
hyperparameters against it and applying them (`configure`), and its per-parameter state as flat
tensors for save_state / load_state (`state_tensors`, `load_state_tensors`). The engine calls
these and never looks inside an optimizer. A run's optimizer is fixed when it is created
(`optimizer=types.DimuonOptimizerConfig()` in the SDK); every optim_step must then pass the
matching params (AdamParams or DimuonParams).

AdamW is torch's (decoupled weight decay, foreach), with the SDK's defaults.

Dimuon is Tinker's optimizer for LoRA matrices. Tinker documents its fields (DimuonParams) but
not its update rule, so the rule below is our reading of those fields, one step per matrix W
(every LoRA parameter is a matrix, one of whose sides is the adapter's rank r):

1. momentum   M <- beta1 * M + (1 - beta1) * G             ("running averages of gradients")
2. precondition, per row i and column j, on M scaled to unit RMS (so `damping` is relative):
              P_ij = M_ij / ((rowmean_i(M^2) + damping)^(1/4) * (colmean_j(M^2) + damping)^(1/4))
                                                            ("damping smooths the row and column
                                                              preconditioner")
3. direction  D = msign(P), by a fixed Newton-Schulz iteration: D has the singular vectors of P
              and singular values ~1, so |D|_F = sqrt(r)  ("a direction with Frobenius norm
              sqrt(rank)"; "matrix-sign iteration count and normalization epsilon are internal
              constants")
4. update     W <- W - lr * (r / 32)^e * D,  e = rank_lr_correction_exponent
              ("learning-rate correction relative to rank 32"). The direction's spectral norm
              is 1 at every rank while the LoRA scale alpha / r shrinks as r grows, so the
              correction raises the step for ranks above 32 (and lowers it below).

Global gradient clipping (grad_clip_norm > 0) happens in the engine before either optimizer.
"""

from __future__ import annotations

import math

import torch

from kernel_backend.types import AdamParams, DimuonParams
from kernel_backend.errors import UserError

KINDS = ("adamw", "dimuon")
PARAMS_CLASS = {"adamw": "AdamParams", "dimuon": "DimuonParams"}

# What each optimizer keeps per parameter (the keys save_state writes, as "{param}.{key}").
STATE_KEYS = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "dimuon": ("step", "momentum")}

# Dimuon's internal constants.
RANK_REFERENCE = 32  # the rank at which the rank correction is 1
NORM_EPS = 1e-7  # keeps the normalisations finite for an all-zero momentum (its update is 0)
# Newton-Schulz for msign: quintic steps (Muon's coefficients) lift small singular values fast
# into about [0.7, 1.2]; cubic steps s <- 1.5 s - 0.5 s^3 then converge them to 1 (to ~1e-3).
QUINTIC = (3.4445, -4.7750, 2.0315)
QUINTIC_STEPS = 5
CUBIC_STEPS = 3


def create(kind: str, parameters: list[torch.nn.Parameter], rank: int) -> torch.optim.Optimizer:
    """A fresh optimizer of `kind` ("adamw" or "dimuon") over an adapter's parameters."""
    check_kind(kind)
    if kind == "dimuon":
        return Dimuon(parameters, rank)
    return torch.optim.AdamW(parameters, foreach=True)


def check_kind(kind: str, full: bool = False) -> None:
    """UserError unless `kind` is an optimizer a run can have (`full`: a full fine-tuning run, rank 0)."""
    if kind not in KINDS:
        raise UserError(f"optimizer {kind!r} is not supported; choose one of: {', '.join(KINDS)}")
    if full and kind == "dimuon":
        # Its rule is for LoRA's matrices (one side the rank, a rank correction); a full run also has vectors
        # (norms) and an embedding, which Muon-style optimizers leave to AdamW.
        raise UserError("Dimuon is an optimizer for LoRA's low-rank matrices; a full fine-tuning run (rank=0) "
                        "trains with AdamW: leave optimizer unset")


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    return "dimuon" if isinstance(optimizer, Dimuon) else "adamw"


def configure(optimizer: torch.optim.Optimizer, params: AdamParams | DimuonParams) -> None:
    """Check a step's params against the run's optimizer, then set them for its next step().

    Raises UserError (and changes nothing) on a mismatch or a bad value.
    """
    kind = kind_of(optimizer)
    if type(params).__name__ != PARAMS_CLASS[kind]:
        raise UserError(
            f"this training run was created with the {kind} optimizer, so optim_step takes "
            f"{PARAMS_CLASS[kind]}, not {type(params).__name__}; the optimizer is fixed when the run is created"
        )
    if isinstance(params, AdamParams):  # (kind == "adamw": the class was checked against it above)
        _check_adam(params)
        hyper = dict(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                     weight_decay=params.weight_decay)
    else:
        _check_dimuon(params)
        hyper = dict(lr=params.learning_rate, beta1=params.beta1, damping=params.damping,
                     rank_lr_correction_exponent=params.rank_lr_correction_exponent)
    for group in optimizer.param_groups:
        group.update(hyper)


def _finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_adam(p: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        if not _finite_number(getattr(p, name)):
            raise UserError(f"adam_params.{name} must be a finite number, got {getattr(p, name)!r}")
    for name in ("learning_rate", "weight_decay", "grad_clip_norm"):
        if getattr(p, name) < 0:
            raise UserError(f"adam_params.{name} must be >= 0, got {getattr(p, name)}")
    if p.eps <= 0:
        raise UserError(f"adam_params.eps must be > 0, got {p.eps}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(p, name) < 1:
            raise UserError(f"adam_params.{name} must be in [0, 1), got {getattr(p, name)}")


def _check_dimuon(p: DimuonParams) -> None:
    for name in ("learning_rate", "grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent"):
        if not _finite_number(getattr(p, name)):
            raise UserError(f"optimizer_params.{name} must be a finite number, got {getattr(p, name)!r}")
    if p.learning_rate < 0:
        raise UserError(f"optimizer_params.learning_rate must be >= 0, got {p.learning_rate}")
    if not 0 <= p.beta1 < 1:
        raise UserError(f"optimizer_params.beta1 must be in [0, 1), got {p.beta1}")
    if p.damping <= 0:
        raise UserError(f"optimizer_params.damping must be > 0, got {p.damping}")


# ---- save_state / load_state --------------------------------------------------------------------


def state_tensors(optimizer: torch.optim.Optimizer,
                  named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as flat float32 tensors keyed "{param}.{key}"."""
    out = {}
    for name, p in named:
        state = optimizer.state.get(p)
        if not state:
            continue  # a parameter that has not been stepped yet has no state
        for key in STATE_KEYS[kind_of(optimizer)]:
            out[f"{name}.{key}"] = torch.as_tensor(state[key]).float().cpu().reshape(-1).contiguous()
    return out


def load_state_tensors(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]],
                       tensors: dict[str, torch.Tensor]) -> None:
    """Put state_tensors() output back into a fresh optimizer over the same parameters."""
    for name, p in named:
        if f"{name}.step" not in tensors:
            continue
        state = {}
        for key in STATE_KEYS[kind_of(optimizer)]:
            value = tensors[f"{name}.{key}"]
            # step is a float32 scalar in torch's optimizers; moments have the parameter's shape.
            state[key] = value.reshape(()).clone() if key == "step" else value.reshape(p.shape).to(p.device, p.dtype)
        optimizer.state[p] = state


# ---- Dimuon ---------------------------------------------------------------------------------------


class Dimuon(torch.optim.Optimizer):
    """Momentum, a damped row/column preconditioner, then the matrix sign (see the module doc)."""

    def __init__(self, params, rank: int) -> None:
        defaults = dict(lr=0.0, beta1=0.9, damping=1e-4, rank_lr_correction_exponent=0.175)
        super().__init__(params, defaults)
        self.rank = rank

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr = group["lr"] * (self.rank / RANK_REFERENCE) ** group["rank_lr_correction_exponent"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum"] = torch.zeros_like(p)
                state["step"] += 1
                state["momentum"].lerp_(p.grad, 1 - group["beta1"])
                direction = matrix_sign(precondition(state["momentum"], group["damping"]))
                p.add_(direction, alpha=-lr)


def precondition(m: torch.Tensor, damping: float) -> torch.Tensor:
    """Scale rows and columns of m (taken at unit RMS) by their damped mean square ^ -1/4."""
    x = m / (m.square().mean().sqrt() + NORM_EPS)
    rows = x.square().mean(dim=1, keepdim=True)
    cols = x.square().mean(dim=0, keepdim=True)
    return x / ((rows + damping) * (cols + damping)).pow(0.25)


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """U V^T of x = U S V^T (the orthogonal polar factor), by Newton-Schulz; 0 for x = 0."""
    wide = x.shape[0] <= x.shape[1]
    y = x if wide else x.T  # iterate on the (small x small) Gram matrix of the short side
    y = y / (y.norm() + NORM_EPS)  # singular values now in [0, 1]
    a, b, c = QUINTIC
    for _ in range(QUINTIC_STEPS):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    for _ in range(CUBIC_STEPS):
        y = 1.5 * y - 0.5 * (y @ y.T) @ y
    return y if wide else y.T
