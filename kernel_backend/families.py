"""The model families the packed forward (sampler.flat_forward) runs, and how each one's layer differs from Llama's.

Llama's decoder layer is the pattern: norm, attention with rotary positions, residual add; norm, gated
MLP, residual add. The families people post-train change it in a few places, and only those places are
written here, as switches of one `Family` row per architecture, so that one layer loop serves them all:

- Qwen3 and Gemma 3 normalize each head's queries and keys (an RMSNorm over the head) before the rotation;
- Gemma's norms scale by (1 + weight), in float32, and its embeddings by sqrt(hidden) (its embedding
  module does that itself);
- Gemma 3 also normalizes the attention's and the MLP's outputs before each residual add ("sandwich"),
  rotates its sliding-window layers with a base of their own, and alternates sliding and full layers;
- Mistral (and Qwen with use_sliding_window) let each token see only the last `sliding_window` tokens;
- Phi-3 fuses q, k, v into one qkv_proj and gate, up into one gate_up_proj, and may rotate only part of
  each head (partial_rotary_factor).

Architectures not in FAMILIES (and Gemma 2, whose attention-logit soft-capping the fused attention call
cannot do) run through transformers' own forward instead: padded training, one request at a time sampling.
To add a family: give it a row, add a switch below only for what no row has yet, and add it to the
architectures test_engine checks against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys, before the rotation
    unit_offset_norms: bool = False  # norms scale by (1 + weight), computed in float32
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too
    fused_projections: bool = False  # qkv_proj and gate_up_proj
    rope_by_layer_type: bool = False  # each layer type ("sliding_attention", "full_attention") rotates its own way


FAMILIES = {
    "llama": Family(),
    "qwen2": Family(),
    "mistral": Family(),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(fused_projections=True),
    "gemma": Family(unit_offset_norms=True),
    "gemma3_text": Family(qk_norm=True, unit_offset_norms=True, sandwich_norms=True, rope_by_layer_type=True),
}


def family_of(config) -> Family | None:
    """The config's family, or None when the packed forward cannot run it exactly."""
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return None
    return FAMILIES.get(config.model_type)


def sliding_windows(config) -> list[int | None]:
    """Each layer's sliding window, None where a layer sees the whole sequence. As transformers masks it, a
    query at position p sees the keys at positions p - window < k <= p."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # Qwen and Gemma 3 name each layer's kind (a window set but unused is None already for Qwen)
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * config.num_hidden_layers
    return [window] * config.num_hidden_layers  # Mistral: every layer


def norm(family: Family, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as torch's one fused op instead of its six."""
    if family.unit_offset_norms:  # Gemma: (x * (1 + w)) in float32, then back to x's dtype
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + module.weight.float(), module.eps).type_as(x)
    return F.rms_norm(x, x.shape[-1:], module.weight, module.variance_epsilon)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (tokens, heads, head_dim); only the first cos.shape[-1] dims of each head when the
    model rotates part of it (Phi-3's partial_rotary_factor)."""
    dims = cos.shape[-1]
    rotated, kept = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = rotated * cos + torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1) * sin
    return torch.cat((rotated, kept), dim=-1) if kept.shape[-1] else rotated


def projections(family: Family, attention: torch.nn.Module, x: torch.Tensor, head_dim: int):
    """Queries (tokens, heads, head_dim), keys and values (tokens, kv_heads, head_dim) of one layer."""
    n = len(x)
    if family.fused_projections:
        qkv = attention.qkv_proj(x)
        queries = attention.config.num_attention_heads * head_dim
        keys = attention.config.num_key_value_heads * head_dim
        q, k, v = qkv[:, :queries], qkv[:, queries:queries + keys], qkv[:, queries + keys:]
    else:
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    q, k, v = q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim)
    if family.qk_norm:
        q, k = norm(family, attention.q_norm, q), norm(family, attention.k_norm, k)
    return q, k, v


def gate_and_up(family: Family, mlp: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if family.fused_projections:
        return mlp.gate_up_proj(x).chunk(2, dim=-1)
    return mlp.gate_proj(x), mlp.up_proj(x)


def activation(mlp: torch.nn.Module):
    return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn  # Phi-3 names it activation_fn


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (queries, keys): causal, and within the window if there is one."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen
