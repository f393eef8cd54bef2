"""The packed forward pass: a flat batch of tokens through the model's own modules, no padding.

Llama's layer (embed; per layer: norm, attention with rotary positions, norm, MLP; norm) and the families
that vary it (engine/families.py: Qwen3, Mistral, Phi-3, Gemma, Gemma 2 and 3, Qwen3-MoE), written out
once. Tokens travel as one (tokens, hidden) batch; attention is the only step that knows which tokens
belong together, and the caller says how (`attend`): the decoder reads each row's KV cache
(engine/sampler.py), training runs rows laid end to end or as a tree of shared prefixes
(causal_within_rows, causal_within_paths below; engine/core.py, engine/prefix_tree.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernel_backend.engine import families


def flat_forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
    """Hidden states after the final norm for a flat batch of tokens, (tokens, hidden), for the
    architectures in families.FAMILIES, with the model's own modules (LoRA routing included).
    The decoder's prefill and decode steps use it, and so does training (engine/core.py: rows packed, no padding).

    `attend(layer, q, k, v)` gets this layer's rotated queries (tokens, heads, head_dim), keys and
    values (tokens, kv_heads, head_dim), stores the keys and values if it keeps a cache, and returns
    the attention output (tokens, heads, head_dim): it alone knows which tokens see which.
    """
    inner: Any = model.model  # a transformers decoder, whose modules its family names (torch types them loosely)
    config: Any = model.config
    family = families.family_of(config)
    assert family is not None  # called for the families it knows only (sampler.Decoder.supports)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n = len(ids)
    hidden = inner.embed_tokens(ids)
    layer_types = getattr(config, "layer_types", None) if family.rope_by_layer_type else None
    rotations = {}  # layer type (None: every layer) -> cos, sin broadcast over heads
    for kind in set(layer_types or [None]):
        cos, sin = inner.rotary_emb(hidden, positions[None], *([kind] if kind else []))
        rotations[kind] = cos[0, :, None, :], sin[0, :, None, :]
    for layer_index, layer in enumerate(inner.layers):
        attention, mlp = layer.self_attn, layer.mlp
        cos, sin = rotations[layer_types[layer_index] if layer_types else None]
        x = families.norm(family, layer.input_layernorm, hidden)
        q, k, v = families.projections(family, attention, x, head_dim)
        q, k = families.rotate(q, cos, sin), families.rotate(k, cos, sin)
        out = attention.o_proj(attend(layer_index, q, k, v).reshape(n, -1))
        if family.sandwich_norms:  # Gemma 3: its post_attention_layernorm is on the output; a pre_feedforward one follows
            hidden = hidden + families.norm(family, layer.post_attention_layernorm, out)
            x = families.norm(family, layer.pre_feedforward_layernorm, hidden)
        else:
            hidden = hidden + out
            x = families.norm(family, layer.post_attention_layernorm, hidden)
        out = families.feed_forward(family, mlp, x)
        if family.sandwich_norms:
            out = families.norm(family, layer.post_feedforward_layernorm, out)
        hidden = hidden + out
    return families.norm(family, inner.norm, hidden)


def causal_within_rows(model: torch.nn.Module, lengths: list[int], device=None):
    """An `attend` for flat_forward over whole sequences laid end to end: each token sees the tokens of its
    own row up to itself (causal_within_paths, each row's path its own stretch of the flat batch)."""
    starts = np.cumsum([0, *lengths[:-1]])
    return causal_within_paths(model, [np.arange(s, s + n) for s, n in zip(starts, lengths)], device)


def causal_within_paths(model: torch.nn.Module, paths: list[np.ndarray], device=None):
    """An `attend` for flat_forward in training: `paths` are sequences of flat token indices, and each token
    sees the tokens before it on its path (and, in a sliding-window layer of `model`, only the last `window`
    of them; its scale and any score soft-cap are the model's, engine/families.py). Rows laid end to end are paths
    of consecutive indices; rows that share a prefix share its tokens (engine/prefix_tree.py).

    Each token's query runs once, on the first path that holds it, against that path's keys up to it (causal:
    what it sees is the same on every path through it). A path's own tokens, those no earlier path holds, are
    its end (the paths of a tree), so a path asks `owned` queries against `length` keys: the same causal mask,
    shifted. Paths of like shapes go into one padded batch for a single attention call (_attention_groups)."""
    inner: Any = model.model
    scale, softcap = inner.layers[0].self_attn.scaling, families.attention_softcap(model.config)
    windows = families.sliding_windows(model.config)
    seen = np.zeros(1 + max(int(p.max()) for p in paths), dtype=bool)
    starts = []  # where each path's own tokens begin
    for path in paths:
        fresh = ~seen[path]
        starts.append(int(fresh.argmax()) if fresh.any() else len(path))
        seen[path] = True
    groups = [_AttentionGroup(paths, starts, members, windows, device) for members in _attention_groups(paths, starts)]
    order = np.concatenate([g.owned for g in groups])  # the groups' real query slots, in their order: token ids
    back = _run(torch.from_numpy(np.argsort(order, kind="stable")).to(device))  # token id -> its row in the outputs

    def attend(layer: int, q, k, v):
        outputs = []
        for g in groups:
            q_ = _take(q, g.queries).unflatten(0, g.query_shape).transpose(1, 2)
            k_, v_ = (_take(t, g.keys).unflatten(0, g.key_shape).transpose(1, 2) for t in (k, v))
            mask = g.masks[windows[layer]]
            out = families.attention(q_, k_, v_, mask=mask, causal=mask is None, scale=scale, softcap=softcap)
            outputs.append(_take(out.transpose(1, 2).flatten(0, 1), g.real))
        return _take(outputs[0] if len(outputs) == 1 else torch.cat(outputs), back)
    return attend


def _run(index: torch.Tensor) -> torch.Tensor | slice:
    """An index of consecutive rows as the slice it is: rows laid end to end with nothing shared or padded (a batch of
    equal rows, the usual SFT batch) gather nothing, and a slice is a view, where index_select copies in forward and
    index_adds into a zero-filled tensor in backward (~3% of an 8 x 128 training step; docs/performance.md)."""
    n = len(index)
    if n and int(index[-1]) - int(index[0]) == n - 1 and bool((index.diff() == 1).all()):
        return slice(int(index[0]), int(index[0]) + n)
    return index


def _take(t: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """t's rows `rows` (dim 0), contiguous as index_select gives them: a view where `rows` is a slice of contiguous t."""
    return t[rows].contiguous() if isinstance(rows, slice) else t.index_select(0, rows)


def _attention_groups(paths: list[np.ndarray], starts: list[int], waste: float = 1.25) -> list[list[int]]:
    """The paths as groups of like shapes (queries, keys): sorted by size, a group grows while padding its
    members to its largest costs at most `waste` times their own query x key slots."""
    shape = {n: (len(path) - start, len(path)) for n, (path, start) in enumerate(zip(paths, starts)) if start < len(path)}
    groups: list[list[int]] = []
    current: list[int] = []
    own, longest = 0, 0  # the group's own slots, its most keys
    for n in sorted(shape, key=lambda n: shape[n], reverse=True):
        queries, keys = shape[n]
        if current:
            padded = (len(current) + 1) * shape[current[0]][0] * max(keys, longest)
            if padded > waste * (own + queries * keys):
                groups.append(current)
                current, own, longest = [], 0, 0
        current.append(n)
        own, longest = own + queries * keys, max(longest, keys)
    return groups + [current] if current else groups


class _AttentionGroup:
    """Paths that attend in one padded call: which flat tokens are its queries and keys (padding repeats a
    path's last query, which sees what that one sees, so no row is empty), the mask of each window, and which
    of its output slots are real."""

    def __init__(self, paths, starts, members: list[int], windows, device) -> None:
        queries = max(len(paths[n]) - starts[n] for n in members)
        keys = max(len(paths[n]) for n in members)
        self.query_shape, self.key_shape = (len(members), queries), (len(members), keys)
        query_index = np.zeros((len(members), queries), dtype=np.int64)
        key_index = np.zeros((len(members), keys), dtype=np.int64)
        position = np.zeros((len(members), queries), dtype=np.int64)  # each query's place on its path
        real, owned = [], []
        for row, n in enumerate(members):
            path, start = paths[n], starts[n]
            key_index[row, :len(path)] = path
            query_index[row] = path[-1]
            query_index[row, :len(path) - start] = path[start:]
            position[row] = len(path) - 1
            position[row, :len(path) - start] = np.arange(start, len(path))
            real.append(row * queries + np.arange(len(path) - start))
            owned.append(path[start:])
        self.queries = _run(torch.from_numpy(query_index.reshape(-1)).to(device))
        self.keys = _run(torch.from_numpy(key_index.reshape(-1)).to(device))
        self.real = _run(torch.from_numpy(np.concatenate(real)).to(device))
        self.owned = np.concatenate(owned)
        # Rows that own their whole path (nothing shared before them) and no window shorter than them: the
        # plain causal call. Otherwise a mask: a query sees the keys at or before its place, within the window.
        whole = all(starts[n] == 0 for n in members)
        slots, places = torch.arange(keys, device=device), torch.from_numpy(position).to(device)
        self.masks = {w: None if whole and (w is None or w >= keys) else families.window_mask(places, slots, w)[:, None]
                      for w in set(windows)}
