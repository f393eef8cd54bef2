"""Multi-adapter LoRA: many sessions' adapters over one frozen base model.

`attach(model)` replaces every linear layer LoRA can target with a `MultiLoraLinear` that
wraps the frozen original (whose product with the input may go through oneDNN: engine/matmul.py).
Adapters (`Adapter`) hold their own A/B matrices per target; a forward pass runs under
`route(model, adapters_per_row)`, so the rows of one batch may belong to different adapters:
each layer adds `scale * B(A x)` to the rows of each adapter (a grouped LoRA matmul, one small
matmul pair per adapter present), with its own backward in training (`_AddDeltas`). Rows whose
adapter is None see the base model alone.

For sampling, each base layer may also hold a copy of its frozen weight in another dtype (bfloat16:
STEPWISE_SAMPLE_DTYPE, `sample_weights`): inside `sampling(model)` (the sampler's forward passes) the
base products run on that copy, activations and the LoRA deltas staying float32; training never sees it. On a CPU
the copy is prepacked in oneDNN's layout, and layers read from one input (q, k, v; gate, up) share one stacked copy
and one product (`products`), and each adapter's LoRA deltas for them one pair of small products (`SharedCopy`).

Adapters save to and load from PEFT's format (`adapter_config.json` and
`adapter_model.safetensors`), so `peft.PeftModel.from_pretrained` reads what we write.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import weakref
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from kernel_backend.engine import small_products
from kernel_backend.types import LoraConfig
from kernel_backend.errors import UserError

# Tinker's target groups, by the module names Llama-style models use (and Phi-3's fused ones: qkv_proj,
# gate_up_proj; a model has one set or the other).
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
UNEMBED_TARGETS = ("lm_head",)
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS


def targets_of(config: LoraConfig) -> tuple[str, ...]:
    return (
        (ATTN_TARGETS if config.train_attn else ())
        + (MLP_TARGETS if config.train_mlp else ())
        + (UNEMBED_TARGETS if config.train_unembed else ())
    )


class Routing:
    """Which adapter each batch row uses, grouped: [(adapter, rows)], rows being None (every row),
    a slice (a contiguous run of rows) or an index tensor (rows scattered through the batch)."""

    def __init__(self) -> None:
        self.groups: list[tuple[Adapter, slice | torch.Tensor | None]] = []
        self.sampling = False  # inside the sampler's passes (`sampling`): base products may use the sampling copies


class MultiLoraLinear(nn.Module):
    """A frozen nn.Linear plus the LoRA deltas of whichever adapters the current routing names."""

    def __init__(self, base: nn.Linear, name: str, routing: Routing, product=F.linear) -> None:
        super().__init__()
        self.base = base
        self.name = name  # full module name, the key into each adapter's weights
        self.routing = routing
        self.product = product  # F.linear or matmul.onednn_linear: the frozen weight's product
        # The sampler's copy of the frozen weight and bias in another dtype (`sample_weights`), and the weight it
        # copies: a full run's weights swapped in (engine/full_weights.py) are not it, and run as they are.
        self.sample_source: torch.Tensor | None = None
        self.sample_weight: torch.Tensor | None = None
        self.sample_bias: torch.Tensor | None = None
        self.shared_copy: SharedCopy | None = None  # or one copy for the layers read together with it (`products`)

    @property
    def weight(self) -> torch.Tensor:  # generation utilities look at lm_head.weight
        return self.base.weight

    def base_product(self, x2d: torch.Tensor) -> torch.Tensor:
        """The frozen layer's output for (tokens, in_features), in x2d's dtype."""
        if self.routing.sampling and self.sample_source is self.base.weight:
            # The sampler's copy: bf16 x bf16 products (native on CPUs with AVX-512 bf16 / AMX), output cast back.
            if self.shared_copy is not None:  # called alone (not through `products`): its part of the shared product
                return self.shared_copy.part(self, x2d)
            weight = self.sample_weight
            assert weight is not None  # sample_weights gave this layer a copy of its own (it shares none)
            return _copy_product(x2d, weight, self.sample_bias)
        # A full run's weights, swapped in (engine/full_weights.py), train: their product must give them gradients.
        product = F.linear if self.base.weight.requires_grad else self.product
        return product(x2d, self.base.weight, self.base.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        tokens, (out_features, in_features) = x2d.shape[0], self.base.weight.shape
        # A decode step's products are small: on one thread they skip OpenMP's wake-up (engine/small_products.py).
        with small_products.small(tokens * in_features * out_features):
            out = self.base_product(x2d)
        return self.plus_deltas(x, out)

    def plus_deltas(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The layer's output for x: `out`, the base product for x's rows (tokens, out_features), plus the LoRA deltas
        of the adapters the routing names for them, added in place."""
        x2d = x.reshape(-1, x.shape[-1])
        tokens, (out_features, in_features) = x2d.shape[0], self.base.weight.shape
        groups = [(adapter, rows) for adapter, rows in self.routing.groups if self.name in adapter.weights]
        if not groups:
            return out.view(*x.shape[:-1], out.shape[-1])
        rank = max(adapter.config.rank for adapter, _ in groups)
        # Rows index dim 0 of x, whatever its shape: turn each group's rows into rows of x2d.
        per_row = tokens // x.shape[0] if x.dim() > 1 else 1
        spans = [_token_rows(rows, per_row, tokens) for _, rows in groups]
        # Adapters keep float32 weights over a bf16 base (mixed precision); their products run in the input's dtype.
        weights = [w.to(x2d.dtype) for adapter, _ in groups for w in adapter.weights[self.name]]
        scales = [adapter.scale for adapter, _ in groups]
        with small_products.small(tokens * rank * (in_features + out_features)):
            if torch.is_grad_enabled() and (x2d.requires_grad or any(w.requires_grad for w in weights)):
                out = _AddDeltas.apply(out, x2d, spans, scales, *weights)
            else:
                add_deltas(out, x2d, spans, scales, weights)
        return out.view(*x.shape[:-1], out.shape[-1])


def _token_rows(rows: slice | torch.Tensor | None, per_row: int, tokens: int) -> slice | torch.Tensor:
    """A routing group's batch rows as rows of the flattened (tokens, features) input."""
    if rows is None:
        return slice(0, tokens)
    if isinstance(rows, slice):
        return slice(rows.start * per_row, rows.stop * per_row)
    return (rows[:, None] * per_row + torch.arange(per_row, device=rows.device)).flatten()


def add_deltas(out: torch.Tensor, x2d: torch.Tensor, spans, scales, weights) -> list[torch.Tensor]:
    """out[span] += scale * (x2d[span] A^T) B^T for each group, in place. Returns the rank-sized
    products x2d[span] A^T (backward needs them).

    A run of rows (a slice) takes one in-place addmm on its view: the add and the scaling are
    fused into the matmul, so no output-sized temporaries (lm_head's rows are vocabulary-wide).
    Scattered rows (an index tensor) gather their inputs and add back with index_add_."""
    hidden = []
    for g, span in enumerate(spans):
        a, b = weights[2 * g], weights[2 * g + 1]
        if isinstance(span, slice):
            h = F.linear(x2d[span], a)
            out[span].addmm_(h, b.t(), alpha=scales[g])
        else:
            h = F.linear(x2d.index_select(0, span), a)
            out.index_add_(0, span, F.linear(h, b), alpha=scales[g])
        hidden.append(h)
    return hidden


class _AddDeltas(torch.autograd.Function):
    """add_deltas with gradients for x and every A and B, written out.

    Autograd's own handling of an in-place op on a view (CopySlices) copies the whole output's
    gradient for each group in backward: for lm_head a (tokens x vocabulary) copy, 13% of a
    training step. Here backward reads each group's slice of the gradient where it lies. The
    output's own gradient passes through unchanged: the frozen base product's backward needs
    its input and weight, not its output, so changing the output in place is safe.
    """

    @staticmethod
    def forward(ctx, out, x2d, spans, scales, *weights):
        with torch.no_grad():
            hidden = add_deltas(out, x2d, spans, scales, weights)
        ctx.mark_dirty(out)
        ctx.save_for_backward(x2d, *weights, *hidden)
        ctx.spans, ctx.scales = spans, scales
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x2d, *rest = ctx.saved_tensors
        weights, hidden = rest[: 2 * len(ctx.spans)], rest[2 * len(ctx.spans) :]
        grad_x, grad_weights = None, []
        for g, span in enumerate(ctx.spans):
            a, b = weights[2 * g], weights[2 * g + 1]
            scale = ctx.scales[g]
            rows = grad[span] if isinstance(span, slice) else grad.index_select(0, span)
            grad_h = (rows @ b).mul_(scale)  # (tokens, rank)
            inputs = x2d[span] if isinstance(span, slice) else x2d.index_select(0, span)
            grad_weights += [grad_h.t() @ inputs if ctx.needs_input_grad[4 + 2 * g] else None,
                             rows.t() @ hidden[g].mul(scale) if ctx.needs_input_grad[5 + 2 * g] else None]
            if not ctx.needs_input_grad[1]:
                continue
            if isinstance(span, slice) and span == slice(0, len(x2d)):  # the whole batch: no zero-filled buffer
                grad_x = grad_h @ a
                continue
            grad_x = torch.zeros_like(x2d) if grad_x is None else grad_x
            if isinstance(span, slice):
                grad_x[span].addmm_(grad_h, a)
            else:
                grad_x.index_add_(0, span, grad_h @ a)
        return grad, grad_x, None, None, *grad_weights


class Adapter:
    """One LoRA adapter: A (rank x in) and B (out x rank) per targeted module, PEFT's layout."""

    full = False  # a full fine-tuning run's weights (engine/full_weights.py) are True

    def __init__(self, config: LoraConfig, weights: dict[str, tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.config = config
        self.weights = weights
        self.scale = config.alpha / config.rank

    def parameters(self) -> list[nn.Parameter]:
        return [p for ab in self.weights.values() for p in ab]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{name}.lora_{ab}", p) for name, pair in self.weights.items() for ab, p in zip("AB", pair)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()}

    def detached(self) -> Adapter:
        """A view on the same tensors that autograd does not track (no copy): for forward-only rows."""
        # Detached views stand in for the parameters (typed as such): the same data, in no autograd graph and
        # given to no optimizer.
        return Adapter(self.config, {n: (cast(nn.Parameter, a.detach()), cast(nn.Parameter, b.detach()))
                                     for n, (a, b) in self.weights.items()})

    def copy(self, trainable: bool = False, device: str | torch.device | None = None) -> Adapter:
        """A detached copy (a sampler snapshot, a kept step): later training of self does not touch it."""
        def kept(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().to(device or t.device, copy=True), trainable)

        return Adapter(self.config, {n: (kept(a), kept(b)) for n, (a, b) in self.weights.items()})


def weights_key(adapter) -> int:
    """Which weights a row runs on: 0 for the base model's (with or without a LoRA adapter, which rows of one
    pass may mix), the run's own id for a full run's. Rows of different keys never share a forward pass."""
    return id(adapter) if adapter is not None and adapter.full else 0


def attach(model: nn.Module, product=F.linear) -> Routing:
    """Wrap every targetable linear layer of `model` once, their base products computed by
    `product` (F.linear's signature). Returns the routing the layers share."""
    routing = Routing()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in ALL_TARGETS and isinstance(child, nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, MultiLoraLinear(child, full, routing, product))
    setattr(model, "_stepwise_routing", routing)  # (nn.Module types an attribute set as Tensor | Module)
    return routing


def lora_layers(model: nn.Module) -> dict[str, MultiLoraLinear]:
    return {m.name: m for m in model.modules() if isinstance(m, MultiLoraLinear)}


SAMPLE_DTYPES = ("float32", "bfloat16")


def sample_weights(model: nn.Module, setting: str) -> int:
    """Give every base layer of `model` the sampler's copy of its frozen weight in `setting`'s dtype
    (STEPWISE_SAMPLE_DTYPE), or none: "float32" (the default) is the trainer's own weights, bit for bit, whatever
    their dtype (a bfloat16 base, STEPWISE_DTYPE, gets no float32 copy), and so is a copy in the weight's own
    dtype. Returns the copies' bytes (what Engine.memory counts). Set once, when the engine starts: a decoder's
    prefix cache keeps what it computed before a change (Engine.reset_decoder drops it)."""
    if setting not in SAMPLE_DTYPES:
        raise ValueError(f"STEPWISE_SAMPLE_DTYPE must be one of {', '.join(SAMPLE_DTYPES)}, not {setting!r}")
    dtype = getattr(torch, setting)
    for layer in lora_layers(model).values():
        weight, bias = layer.base.weight, layer.base.bias
        if setting == "float32" or weight.dtype == dtype:
            layer.sample_source, layer.sample_weight, layer.sample_bias = None, None, None
            continue
        layer.sample_source = weight
        layer.sample_weight = _prepacked(weight.detach().to(dtype).contiguous())
        layer.sample_bias = bias.detach().to(dtype) if bias is not None else None
    _share_copies(model, setting)
    return sample_weights_bytes(model)


def _share_copies(model: nn.Module, setting: str) -> None:
    """Layers read together (READ_TOGETHER) get one stacked copy instead of one each. The packed forward reads them
    through `products` (engine/families.py); a layer called alone (transformers' own forward, for architectures the
    packed forward does not know) computes the whole stacked product and keeps its part: the same numbers, more work."""
    for module in model.modules():
        for names in READ_TOGETHER:
            found = [getattr(module, name, None) for name in names]
            layers = [layer for layer in found if isinstance(layer, MultiLoraLinear)]
            if len(layers) < len(found):
                continue
            copied = all(layer.sample_source is not None for layer in layers)
            shared = SharedCopy(layers, getattr(torch, setting)) if copied else None
            for layer in layers:
                layer.shared_copy = shared
                if shared is not None:
                    layer.sample_weight = layer.sample_bias = None


# Layers the packed forward reads from one input (engine/families.py: projections, feed_forward). In the sampler's
# passes each set shares one copy, its weights stacked, so that a decode step makes one product where it made three
# (q, k, v) or two (gate, up): fewer calls of small products, each busier (bench/sample_products.py).
READ_TOGETHER = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedCopy:
    """The sampling copy of layers read together: their frozen weights (and biases) stacked along the outputs."""

    def __init__(self, layers: list[MultiLoraLinear], dtype: torch.dtype) -> None:
        self.layers = layers
        self.sizes = [layer.base.weight.shape[0] for layer in layers]
        self.starts = dict(zip((id(layer) for layer in layers), itertools.accumulate([0, *self.sizes])))
        self.work = layers[0].base.weight.shape[1] * sum(self.sizes)  # multiply-adds a row
        self.weight = _prepacked(torch.cat([layer.base.weight.detach() for layer in layers]).to(dtype).contiguous())
        biases = [layer.base.bias for layer in layers]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(n, dtype=dtype, device=layers[0].base.weight.device) if b is None else b.detach().to(dtype)
             for b, n in zip(biases, self.sizes)])
        # Each adapter's LoRA weights over the stacked output (`stacked_lora`), with the tensors and versions they
        # were built from; weakly keyed, so a sampler's adapter that is gone takes its entry with it.
        self.lora: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def in_use(self) -> bool:
        """In the sampler's passes, while every layer holds the weight the copy copies (a full run's are not it)."""
        return self.layers[0].routing.sampling and all(layer.sample_source is layer.base.weight for layer in self.layers)

    def product(self, x2d: torch.Tensor) -> torch.Tensor:
        """Every layer's base product for x2d (tokens, in_features), side by side, in x2d's dtype."""
        with small_products.small(len(x2d) * self.work):
            return _copy_product(x2d, self.weight, self.bias)

    def part(self, layer: MultiLoraLinear, x2d: torch.Tensor) -> torch.Tensor:
        start = self.starts[id(layer)]
        return self.product(x2d)[:, start:start + layer.base.weight.shape[0]]

    def stacked_lora(self, adapter: Adapter) -> list[torch.Tensor] | None:
        """`adapter`'s [A, B] for the stacked output: its layers' A stacked (layers x rank, in_features) and their B
        block-diagonal (stacked outputs, layers x rank), so that one pair of small products adds every layer's delta
        (the zero blocks add exact zeros). [] where it trains none of these layers; None where it trains only some,
        or its tensors keep no version counter (inference tensors: a stack built once could go stale unseen).
        A stack is built again when a tensor changes in place (an optimizer step bumps its version) or is swapped
        (adapter_cache's `p.data = ...` moves its memory); writes through `.data` bump no version, as for the prefix
        cache (engine/prefix_cache.py), and are not seen: the sampler's adapters are snapshots (Engine's `copy`)."""
        found = [adapter.weights.get(layer.name) for layer in self.layers]
        pairs = [pair for pair in found if pair is not None]
        if not pairs:
            return []
        if len(pairs) < len(found):
            return None
        tensors = [t for pair in pairs for t in pair]
        try:
            versions = [(t._version, t.data_ptr()) for t in tensors]
        except RuntimeError:
            return None
        cached = self.lora.get(adapter)
        if cached is not None and cached[1] == versions and all(t is c for t, c in zip(tensors, cached[0])):
            return cached[2]
        with torch.no_grad():
            stacked = [torch.cat([a for a, _ in pairs]), torch.block_diag(*(b for _, b in pairs))]
        self.lora[adapter] = (tensors, versions, stacked)
        return stacked

    def plus_deltas(self, x2d: torch.Tensor, out: torch.Tensor) -> bool:
        """Every routed adapter's LoRA deltas added to `out`, the stacked product for x2d, in place, with one pair of
        small products per adapter instead of one per layer (fewer tiny calls, each busier: bench/sample_products.py).
        False, `out` untouched, where some adapter cannot (`stacked_lora`) or gradients are wanted: each layer then
        adds its own (MultiLoraLinear.plus_deltas)."""
        groups = []
        for adapter, rows in self.layers[0].routing.groups:
            stacked = self.stacked_lora(adapter)
            if stacked is None:
                return False
            if stacked:
                groups.append((adapter, rows, stacked))
        if torch.is_grad_enabled() and (x2d.requires_grad or any(w.requires_grad for *_, ws in groups for w in ws)):
            return False
        if groups:
            tokens = len(x2d)
            spans = [_token_rows(rows, 1, tokens) for _, rows, _ in groups]
            weights = [w.to(x2d.dtype) for *_, stacked in groups for w in stacked]
            rank = max(stacked[0].shape[0] for *_, stacked in groups)
            with small_products.small(tokens * rank * (x2d.shape[1] + out.shape[1])):
                add_deltas(out, x2d, spans, [adapter.scale for adapter, *_ in groups], weights)
        return True


def products(layers, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's output for one input x (tokens, features), as [layer(x) for layer in layers]; in the sampler's
    passes, where the layers share a copy (READ_TOGETHER), with one base product for them all and each adapter's LoRA
    deltas added by one pair of products for them all (SharedCopy.plus_deltas), or else each layer's to its part."""
    shared = getattr(layers[0], "shared_copy", None)
    if shared is None or not shared.in_use():
        return [layer(x) for layer in layers]
    out = shared.product(x)
    if shared.plus_deltas(x, out):
        return list(out.split(shared.sizes, dim=-1))
    return [layer.plus_deltas(x, part) for layer, part in zip(layers, out.split(shared.sizes, dim=-1))]


def _prepacked(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight in oneDNN's blocked layout for its product, where the CPU build has oneDNN: reordered once here
    instead of on every product, 1.1-2x faster at a decode step's 1-32 rows than F.linear on the plain copy, and
    the same results (bench/sample_products.py, docs/performance.md). Elsewhere (a GPU, or a CPU whose oneDNN has no
    bf16 path: no AVX-512 or AVX-NE-CONVERT, e.g. an AMD EPYC of the Zen 2/3 kind, where the reorder raises) the plain
    copy, whose F.linear torch computes on any CPU."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available() \
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _copy_product(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d W^T + b with a sampling copy (a layer's own or a stacked one): bf16 x bf16 products (native on CPUs with
    AVX-512 bf16 / AMX), the input cast to the copy's dtype and the output back to x2d's."""
    x = x2d.to(weight.dtype)
    if weight.is_mkldnn:  # oneDNN's own layout (`_prepacked`): any row count, F.linear's results
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    elif len(x) == 1:  # one row (a lone request's decode step): torch.mv, 1.3-2x faster than F.linear's bf16
        # matrix-vector path on a 2-core Xeon (same results there), where F.linear's was slower than float32
        out = (torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0]))[None]
    else:
        out = F.linear(x, weight, bias)
    return out.to(x2d.dtype)


def sample_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's sampling copies (`sample_weights`), None when it has none (float32, the default)."""
    for layer in lora_layers(model).values():
        if layer.sample_source is not None:
            weight = layer.sample_weight if layer.shared_copy is None else layer.shared_copy.weight
            assert weight is not None  # a copied layer has a copy of its own where it shares none
            return weight.dtype
    return None


def sample_weights_bytes(model: nn.Module) -> int:
    """The bytes of the sampler's weight copies (an lm_head tied to the embedding has a copy of its own)."""
    layers = lora_layers(model).values()
    shared = {id(layer.shared_copy): layer.shared_copy for layer in layers if layer.shared_copy is not None}
    return sum(t.nbytes for t in [*(t for layer in layers for t in (layer.sample_weight, layer.sample_bias)),
                                  *(t for copy in shared.values() for t in (copy.weight, copy.bias))] if t is not None)


@contextlib.contextmanager
def sampling(model: nn.Module):
    """The sampler's forward passes: base products run on the layers' sampling copies where they have one."""
    routing: Routing = getattr(model, "_stepwise_routing")  # attach's (nn.Module types its attributes loosely)
    previous, routing.sampling = routing.sampling, True
    try:
        yield
    finally:
        routing.sampling = previous


def new_adapter(model: nn.Module, config: LoraConfig) -> Adapter:
    """A fresh adapter, initialised like PEFT: A ~ kaiming-uniform(a=sqrt(5)), B = 0 (so it starts as a no-op)."""
    if config.rank < 1:
        raise UserError(f"LoRA rank must be a positive integer, got {config.rank}")
    targets = targets_of(config)
    if not targets:
        raise UserError("the adapter trains nothing: set at least one of train_attn, train_mlp, train_unembed")
    generator = torch.Generator().manual_seed(config.seed if config.seed is not None else torch.seed() % 2**63)
    weights = {}
    for name, layer in lora_layers(model).items():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        base = layer.base.weight
        a = torch.empty(config.rank, base.shape[1], dtype=torch.float32)
        bound = 1 / math.sqrt(base.shape[1])  # what kaiming_uniform_(a=sqrt(5)) gives
        a.uniform_(-bound, bound, generator=generator)
        b = torch.zeros(base.shape[0], config.rank, dtype=torch.float32)
        # float32 whatever the base's dtype: bf16 would round away AdamW's small updates (a master copy, as in
        # mixed-precision training); the layer casts them to the activations' dtype for its products.
        weights[name] = (nn.Parameter(a.to(base.device)), nn.Parameter(b.to(base.device)))
    return Adapter(config, weights)


@contextlib.contextmanager
def route(model: nn.Module, adapters: list):
    """Run the model with row i of the batch under adapters[i] (None: base model only). A full fine-tuning run's
    weights (engine/full_weights.py) replace the model's own for the pass, so its rows must be the whole batch."""
    routing: Routing = getattr(model, "_stepwise_routing")  # attach's (nn.Module types its attributes loosely)
    distinct = list({id(a): a for a in adapters if a is not None}.values())
    if any(a.full for a in distinct):
        if len(distinct) != 1 or any(a is None for a in adapters):
            raise ValueError("a full run's rows run in a forward pass of their own (split batches by weights_key)")
        previous, routing.groups = routing.groups, []
        try:
            with distinct[0].swapped(model):
                yield
        finally:
            routing.groups = previous
        return
    groups: list[tuple[Adapter, slice | torch.Tensor | None]]
    if len(distinct) == 1 and all(a is distinct[0] for a in adapters):
        groups = [(distinct[0], None)]  # the common case: the whole batch is one adapter
    else:
        groups = []
        for adapter in distinct:
            rows = [i for i, a in enumerate(adapters) if a is adapter]
            if rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run: views, no copies
                groups.append((adapter, slice(rows[0], rows[-1] + 1)))
            else:
                device: Any = model.device  # a transformers model's (torch types module attributes loosely)
                groups.append((adapter, torch.tensor(rows, device=device)))
    previous, routing.groups = routing.groups, groups
    try:
        yield
    finally:
        routing.groups = previous


# ---- PEFT format ---------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def save_peft(adapter: Adapter, directory: Path, base_model_name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": adapter.config.rank,
        "lora_alpha": adapter.config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in adapter.weights}),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        # No keys of our own here: PEFT warns about unknown keys ("saved with a higher version").
        # rank, alpha and the target groups are all read back from the PEFT keys above.
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for name, (a, b) in adapter.weights.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().float().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().float().cpu().contiguous()
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})


def read_peft_config(directory: Path) -> LoraConfig:
    raw = json.loads((directory / "adapter_config.json").read_text())
    if "stepwise" in raw:  # written by an earlier version of save_peft
        return LoraConfig(**raw["stepwise"])
    # Settings that change what the weights mean; loading them as plain LoRA would be wrong.
    plain = {
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": [],
    }
    unsupported = [key for key, off in plain.items() if raw.get(key) not in (None, off)]
    if raw.get("peft_type", "LORA") != "LORA" or unsupported:
        raise UserError(
            f"{directory} holds a PEFT adapter this backend cannot load exactly "
            f"(peft_type {raw.get('peft_type')!r}, unsupported settings: {unsupported or 'none'}); "
            "only plain LoRA with one rank and alpha is supported"
        )
    targets = raw["target_modules"]
    targets = {targets} if isinstance(targets, str) else set(targets)
    return LoraConfig(
        rank=raw["r"],
        alpha=raw["lora_alpha"],
        train_attn=bool(targets & set(ATTN_TARGETS)),
        train_mlp=bool(targets & set(MLP_TARGETS)),
        train_unembed=bool(targets & set(UNEMBED_TARGETS)),
    )


def load_peft(model: nn.Module, directory: Path, trainable: bool = True) -> Adapter:
    config = read_peft_config(directory)
    tensors = load_file(directory / "adapter_model.safetensors")
    layers = lora_layers(model)
    weights = {}
    for name, layer in layers.items():
        key = f"{PEFT_PREFIX}{name}.lora_A.weight"
        if key not in tensors:
            continue
        device = layer.base.weight.device  # float32 over any base (new_adapter says why)
        a = tensors[key].to(device, torch.float32)
        b = tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"].to(device, torch.float32)
        expected_a = (config.rank, layer.base.weight.shape[1])
        expected_b = (layer.base.weight.shape[0], config.rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise UserError(
                f"{directory}: LoRA weights of {name} have shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                f"expected {expected_a} and {expected_b} (rank {config.rank} on this base model)"
            )
        weights[name] = (nn.Parameter(a, trainable), nn.Parameter(b, trainable))
    if not weights:
        raise UserError(f"{directory} holds no LoRA weights for this base model's layers")
    return Adapter(config, weights)
