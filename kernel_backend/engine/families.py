"""The model families the packed forward (packed_forward.flat_forward) runs, and how each one's layer differs from Llama's.

Llama's decoder layer is the pattern: norm, attention with rotary positions, residual add; norm, gated
MLP, residual add. The families people post-train change it in a few places, and only those places are
written here, as switches of one `Family` row per architecture, so that one layer loop serves them all:

- Qwen3 and Gemma 3 normalize each head's queries and keys (an RMSNorm over the head) before the rotation;
- Gemma's norms scale by (1 + weight), in float32, and its embeddings by sqrt(hidden) (its embedding
  module does that itself);
- Gemma 2 and 3 also normalize the attention's and the MLP's outputs before each residual add
  ("sandwich") and alternate sliding and full layers; Gemma 3 rotates its sliding layers with a base of
  their own; Gemma 2 soft-caps attention scores and final logits (cap * tanh(x / cap)), which the fused
  attention call cannot do, so its attention is written out (`attention`);
- Mistral (and Qwen with use_sliding_window) let each token see only the last `sliding_window` tokens;
- Phi-3 fuses q, k, v into one qkv_proj and gate, up into one gate_up_proj, and may rotate only part of
  each head (partial_rotary_factor);
- Qwen3-MoE routes each token to a few experts: its mixture-of-experts block runs as the model's own
  module (router and experts as transformers runs them). Its experts are 3-D parameters, not linear
  layers, so LoRA there trains attention, lm_head and any dense MLP layers, not the experts.

Architectures not in FAMILIES run through transformers' own forward instead: padded training, one
request at a time sampling.
To add a family: give it a row, add a switch below only for what no row has yet, and add it to the
architectures test_engine checks against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernel_backend.engine import lora, small_products


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
    "gemma2": Family(unit_offset_norms=True, sandwich_norms=True),
    "gemma3_text": Family(qk_norm=True, unit_offset_norms=True, sandwich_norms=True, rope_by_layer_type=True),
    "qwen3_moe": Family(qk_norm=True),
}


def family_of(config) -> Family | None:
    """The config's family, or None when the packed forward does not know its architecture."""
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


def norm(family: Family, module: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as torch's one fused op instead of its six."""
    # module: the model's RMSNorm module, Any: torch types a module's attributes (weight, eps) as Tensor | Module
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


def projections(family: Family, attention: Any, x: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (tokens, heads, head_dim), keys and values (tokens, kv_heads, head_dim) of one layer."""
    # attention: the layer's attention module, Any: torch types its submodules and config as Tensor | Module
    n = len(x)
    if family.fused_projections:
        qkv = attention.qkv_proj(x)
        queries = attention.config.num_attention_heads * head_dim
        keys = attention.config.num_key_value_heads * head_dim
        q, k, v = qkv[:, :queries], qkv[:, queries:queries + keys], qkv[:, queries + keys:]
    else:
        q, k, v = lora.products((attention.q_proj, attention.k_proj, attention.v_proj), x)
    q, k, v = q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim)
    if family.qk_norm:
        q, k = norm(family, attention.q_norm, q), norm(family, attention.k_norm, k)
    return q, k, v


def feed_forward(family: Family, mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """The MLP's output for (tokens, hidden): a gated MLP written out (its LoRA layers apply), or a block
    of the model's own that is not one (a mixture of experts: its router and experts as the model runs them)."""
    # mlp: the layer's MLP module, Any: torch types its submodules as Tensor | Module
    if family.fused_projections:
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    elif hasattr(mlp, "gate_proj"):
        gate, up = lora.products((mlp.gate_proj, mlp.up_proj), x)
    else:
        return mlp(x[None])[0]
    act = mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn  # Phi-3 names it activation_fn
    # Elementwise: one thread was faster than two from a decode step's 32 rows to a prefill's 512
    # (the wake-up of the sleeping workers costs more than the second core saves; engine/small_products.py).
    with small_products.small(gate.numel()):
        gate = act(gate) * up
    return mlp.down_proj(gate)


def attention(q, k, v, *, scale: float, mask=None, causal: bool = False, softcap: float | None = None):
    """Scaled dot-product attention over (..., heads, tokens, head_dim), grouped-query heads included: torch's
    fused call, or, with Gemma 2's soft-capped scores, the same computation written out as transformers does it."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if causal:  # only ever asked with as many queries as keys
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attention_softcap(config) -> float | None:
    return getattr(config, "attn_logit_softcapping", None)


def final_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """lm_head's output as the model returns it: Gemma 2 soft-caps it."""
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (..., queries, keys): causal, and within the window if there is one."""
    seen = key_positions[..., None, :] <= query_positions[..., :, None]
    if window is not None:
        seen &= key_positions[..., None, :] > query_positions[..., :, None] - window
    return seen
