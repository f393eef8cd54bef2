"""The frozen base weights' matrix products, through oneDNN where MKL is slow.

PyTorch's CPU wheel sends float32 matrix products to MKL. On AMD CPUs MKL runs its AVX2 code even
where the CPU has AVX-512 (it picks its kernels by vendor): about 210 GFLOP/s on two Zen 4 cores.
oneDNN, in the same wheel (it serves bf16 and torch.compile), picks by instruction set, and runs
the same products at 420-500 GFLOP/s there: a base layer's product at a decode step's 32 rows
2.4x faster, a training batch's 2.2x (bench/matmul.py, docs/performance.md).

Only the base weights' products go this way: `linear(x, W, b)` = x W^T + b, and in training its
input gradient g W (the base is frozen, so no weight gradient). The LoRA products, small and
trainable, stay with torch. Results agree with torch's to float32 rounding (summation order).

`choose(setting, device, dtype)` decides once per engine (STEPWISE_MATMUL):
- "auto" (the default): oneDNN for float32 on x86 CPUs whose vendor is AMD and that have AVX-512 (Zen 4 and
  later), where it was measured faster; torch's own product elsewhere (Intel CPUs run MKL's AVX-512 code; an AMD
  CPU with AVX2 only, where MKL's AVX2 code is what oneDNN would run too, and measured 10-20% faster than
  oneDNN's on a 2-core EPYC at 1-512 rows; GPUs; bf16);
- "onednn": oneDNN for float32 on any CPU that has it; "torch": always torch's.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch
from torch.nn import functional as F

SETTINGS = ("auto", "onednn", "torch")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The fused-linear op torch.compile's CPU backend calls; it takes a plain (unpacked) weight,
    # transposed views included, and inputs of any leading shape.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """x W^T + b with oneDNN, differentiable in x (W and b are the frozen base's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return _onednn_linear(grad, weight.t(), None), None, None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a frozen weight, computed by oneDNN (gradients flow to x only)."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("onednn_linear is for frozen weights: it computes no weight gradient")
    if torch.is_grad_enabled() and x.requires_grad:
        return _OneDnnLinear.apply(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def _cpu_info(field: str) -> str:
    """The first `field` line of /proc/cpuinfo ("vendor_id", "flags"), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def choose(setting: str, device: torch.device | str, dtype: torch.dtype):
    """The product the base layers use: onednn_linear or F.linear (see the module docstring)."""
    if setting not in SETTINGS:
        raise ValueError(f"STEPWISE_MATMUL must be one of {', '.join(SETTINGS)}, not {setting!r}")
    usable = (torch.device(device).type == "cpu" and dtype == torch.float32
              and torch.backends.mkldnn.is_available())
    if setting == "onednn" and usable:
        return onednn_linear
    if setting == "auto" and usable and platform.machine().lower() in ("x86_64", "amd64") \
            and _cpu_info("vendor_id") == "AuthenticAMD" and "avx512f" in _cpu_info("flags").split():
        return onednn_linear
    return F.linear
