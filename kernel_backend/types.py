"""Plain data types the engine speaks. No torch, no tinker, no HTTP.

The API layer converts the SDK's wire types into these; tests and benchmarks build them
directly. Arrays are numpy so they cross thread and process boundaries cheaply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kernel_backend import grammars
from kernel_backend.errors import UserError


@dataclass(frozen=True)
class Span:
    """A run of a datum's positions and where its tokens came from (tinker's ProvenanceSpan): positions
    [offset, offset + length) of sequence `sequence_id`'s sampled tokens (sampled) or of the prompt of
    the request that sampled it (not sampled)."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: input tokens and the loss function's per-position inputs.

    Input position i predicts target i (`target_tokens[i]` is usually `tokens[i + 1]`).
    Every array in `loss_fn_inputs` has first dimension len(tokens): shape (N,) or (N, K).
    Provenance, when the client sends it: runs tiling the input tokens and the targets, in order
    (stable_reinforce reads the sampler's recorded logprobs through it; service/stability.py).
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None


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
    """One Dimuon step (Tinker's second optimizer, for LoRA matrices; see engine/optimizers.py).

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
    computed_tokens: int | None = None  # tokens the model ran: the data's, less every prefix its rows share (engine/prefix_tree.py)


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
    # Beyond Tinker's fields (engine/sampler.py, adjust_logits and filter_logits; docs/tinker-surface.md). They change
    # what is sampled, never the logprobs returned: those stay the model's own, as compute_logprobs gives them.
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    repetition_penalty: float = 1.0  # a token of the prompt or the output: logit / p if positive, else logit x p
    frequency_penalty: float = 0.0  # minus this x the times the token is in the output so far (OpenAI's)
    presence_penalty: float = 0.0  # minus this once the token is in the output (OpenAI's)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 bans it, +100 forces it)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a row's own history or biases change its logits (adjust_logits)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.frequency_penalty) \
            or bool(self.presence_penalty)


# The widest per-position answer a sample request may ask for: top-k logprobs (prompt or sampled),
# prompt_alt_tokens_k draws, target_prompt_logprobs ids. Each costs len(prompt) (or max_tokens) x k.
MAX_TOPK_LOGPROBS = 20


@dataclass
class TargetIds:
    """`target_prompt_logprobs`: token ids to score at prompt positions, kept in the request's layout
    (the answer has the same one). A cell is a cell of a dense [len(prompt) - 1, K] tensor, or a listed
    cell of a sparse CSR one; cell (i, j) scores its id at prompt position i + 1."""

    shape: tuple[int, int]
    rows: np.ndarray  # int64, per cell: its row i
    ids: np.ndarray  # int64, per cell: a token id, or -1 for none
    crow_indices: list[int] | None = None  # the sparse layout as sent (None: dense)
    col_indices: list[int] | None = None

    @property
    def first_row(self) -> int | None:
        """The first row that names an id (None when none does)."""
        named = self.rows[self.ids >= 0]
        return int(named.min()) if named.size else None


@dataclass
class SampleOptions:
    """What a sample request asks for besides its samples: Tinker's SampleRequest fields, same names.

    Every prompt option is computed in the prompt's prefill. `prompt_logprobs_last_n` limits
    prompt_logprobs and topk_prompt_logprobs to the prompt's last n tokens (earlier entries None).
    """

    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TargetIds | None = None
    prompt_alt_tokens_k: int = 0  # draws at every prompt position after the first
    prompt_logprobs_last_n: int | None = None
    # Not Tinker's: a grammar the generated text must match (kernel_backend/grammars.py; enforced by the built-in
    # sampler, engine/constraints.py). What the OpenAI and Anthropic routes' response_format and forced or strict
    # tool calls become.
    grammar: str | None = None

    def check(self, prompt_tokens: int) -> None:
        """Bound the options for a prompt of this many tokens (token ids are the engine's to check)."""
        if self.grammar is not None:
            grammars.check(self.grammar)
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            k = getattr(self, name)
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOPK_LOGPROBS:
                raise UserError(f"{name} must be an integer from 0 to {MAX_TOPK_LOGPROBS}, got {k!r}")
        n = self.prompt_logprobs_last_n
        if n is not None:
            if not self.prompt_logprobs:
                raise UserError("prompt_logprobs_last_n limits prompt logprobs: set prompt_logprobs "
                                "(include_prompt_logprobs=True in the SDK) too")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= prompt_tokens - 1:
                raise UserError(f"prompt_logprobs_last_n must be from 1 to len(prompt) - 1 = {prompt_tokens - 1} "
                                f"(the first prompt token has no logprob), got {n!r}")
        targets = self.target_prompt_logprobs
        if targets is not None:
            rows, width = targets.shape
            if rows != prompt_tokens - 1:
                raise UserError(f"target_prompt_logprobs must have len(prompt) - 1 = {prompt_tokens - 1} rows "
                                f"(row i scores prompt position i + 1), got shape {list(targets.shape)}")
            if not 1 <= width <= MAX_TOPK_LOGPROBS:
                raise UserError(f"target_prompt_logprobs may name 1 to {MAX_TOPK_LOGPROBS} ids per prompt position "
                                f"(its second dimension), got shape {list(targets.shape)}")
            if targets.ids.size and targets.ids.min() < -1:
                raise UserError(f"target_prompt_logprobs holds token ids, or -1 for none; got {int(targets.ids.min())}")
            if targets.first_row is None:
                raise UserError("target_prompt_logprobs names no token id (every cell is -1): name at least one")


# The most samples one request may ask for.
MAX_NUM_SAMPLES = 128


# logit_bias: OpenAI's bounds (a bias in [-100, 100], at most 300 tokens).
MAX_LOGIT_BIAS_TOKENS = 300


def check_logit_adjustments(params: SamplingParams, vocab_size: int) -> None:
    """min_p, the penalties and logit_bias, each in its range (a UserError naming the parameter)."""
    def finite_in(name: str, low: float, high: float, low_open: bool = False) -> None:
        value = getattr(params, name)
        if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise UserError(f"{name} must be in {interval}, got {value}")

    finite_in("min_p", 0.0, 1.0)
    finite_in("repetition_penalty", 0.0, 10.0, low_open=True)
    finite_in("frequency_penalty", -2.0, 2.0)
    finite_in("presence_penalty", -2.0, 2.0)
    bias = params.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise UserError(f"logit_bias names {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS}")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise UserError(f"logit_bias key {token!r} is not a token id of this model (0 to {vocab_size - 1})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise UserError(f"logit_bias[{token}] must be a number in [-100, 100], got {value!r}")


def check_sample_size(prompt_tokens: int, num_samples, params: SamplingParams, max_context: int, max_sample_tokens: int,
                      options: SampleOptions) -> None:
    """What one sample request may ask of the sampler, checked alike by the service before it is queued
    (admission.check_sampling, which counts its most work from it) and by the engine before it runs. Fills in a
    missing max_tokens: as many as the context leaves, up to max_sample_tokens."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise UserError(f"num_samples must be an integer from 1 to {MAX_NUM_SAMPLES}, got {num_samples!r}")
    options.check(prompt_tokens)
    if prompt_tokens >= max_context:
        raise UserError(f"the prompt has {prompt_tokens} tokens; the model's context is {max_context}")
    if params.max_tokens is None:
        params.max_tokens = min(max_sample_tokens, max_context - prompt_tokens)
    if not 1 <= params.max_tokens <= max_sample_tokens:
        raise UserError(f"max_tokens must be from 1 to {max_sample_tokens}, got {params.max_tokens}")
    if prompt_tokens + params.max_tokens > max_context:
        raise UserError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of "
            f"{max_context}; shorten the prompt or lower max_tokens"
        )


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
    # target_prompt_logprobs' answer: the request's cells (the answer keeps their layout), and the
    # logprob of each cell's id (float32; 0.0 for -1).
    targets: TargetIds | None = None
    target_prompt_logprobs: np.ndarray | None = None
    # prompt_alt_tokens_k's draws, [len(prompt) - 1, k] each: token ids (int64) and their logprobs (float32).
    prompt_alt_tokens: np.ndarray | None = None
    prompt_alt_logprobs: np.ndarray | None = None
    # Prompt tokens whose keys and values came from the prefix cache (engine/prefix_cache.py), not computed.
    cached_prompt_tokens: int = 0
