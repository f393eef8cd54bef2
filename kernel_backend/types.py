"""Plain data types the engine speaks. No torch, no tinker, no HTTP.

The API layer converts the SDK's wire types into these; tests and benchmarks build them
directly. Arrays are numpy so they cross thread and process boundaries cheaply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np


class UserError(ValueError):
    """Bad input from the caller. The message says what is wrong and how to fix it.

    The engine raises it before touching any state, so a session's weights and optimizer
    state are unchanged. The service reports it as a failed future with category "user".
    """


# An absolute filesystem path of two segments or more: a '/' that starts a token (not a URL's '//', a
# ratio like 1/2 or a route like sessions/{id}/finish).
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.}])/(?:[^\s'\"/:,;(){}]+/)+[^\s'\"/:,;(){}]*")


def redact_paths(message: str) -> str:
    """A message fit to leave the server: absolute paths replaced, so no error reveals the server's folders."""
    return _ABSOLUTE_PATH.sub("<server path>", message)


@dataclass
class Datum:
    """One training example: input tokens and the loss function's per-position inputs.

    Input position i predicts target i (`target_tokens[i]` is usually `tokens[i + 1]`).
    Every array in `loss_fn_inputs` has first dimension len(tokens): shape (N,) or (N, K).
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class LoraConfig:
    """An adapter's shape. Tinker's defaults: rank 32, every target trained."""

    rank: int = 32
    alpha: float = 32.0
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class AdamParams:
    """AdamW with decoupled weight decay; defaults are the ones the tinker SDK sends."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 means no clipping


@dataclass
class DimuonParams:
    """One Dimuon step (Tinker's second optimizer, for LoRA matrices; see optimizers.py).

    The SDK has no default learning rate for Dimuon. tinker 0.38 sends the first three
    fields; newer SDKs also send damping and rank_lr_correction_exponent (defaults below).
    """

    learning_rate: float
    grad_clip_norm: float = 0.0  # <= 0 means no clipping
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


@dataclass
class ForwardResult:
    """What forward / forward_backward return: per-datum outputs and summed metrics."""

    loss_fn_outputs: list[dict[str, np.ndarray]]  # each has "logprobs", shaped like target_tokens
    metrics: dict[str, float]  # keys are "name:reduction", always with "loss:sum"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None
    # None: stop at the tokenizer's end-of-sequence tokens. []: never stop.
    # Otherwise a list of strings, or a list of token ids (not mixed).
    stop: list[str] | list[int] | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # the model's own logprob of each sampled token (no temperature)
    stop_reason: str  # "stop" or "length"
    # When asked for: the k most likely (token, logprob) pairs at each sampled position.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # Per prompt position, the logprob of that token given the ones before; None at position 0.
    prompt_logprobs: list[float | None] | None = None
    # Per prompt position, the k most likely (token, logprob) pairs; None at position 0.
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
