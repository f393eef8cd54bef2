"""A sharded base model: each of N processes holds about 1/N of the frozen base weights (issue 55).

This module owns the sharding of a model over a torch.distributed process group (gloo on CPU, NCCL on GPU):
`shard_model(model, group)` replaces every base linear layer's weight (the layers lora.attach wrapped) and the
input embedding (with a head tied to it) by this process's rows of it, `load_sharded` makes such a model straight
from its files without ever holding it whole, and `resident_bytes` measures what a process holds. The semantics
are FSDP's (torch.distributed.fsdp.fully_shard, reshard_after_forward=True): a layer's whole weight is
all-gathered just before its product and freed right after; backward gathers it again for the input gradient, so
no gathered weight lives from forward to backward. The input embedding is never gathered: each process looks up
the ids its rows hold and an all-reduce sums the lookups. Norms, biases, rotary tables and anything lora.attach
does not wrap (a mixture of experts' 3-D experts, its router) stay whole on every process: they are
small, or not yet sharded.

Why not fully_shard itself: its hooks sit on a module's forward and need one root module whose forward runs first
("FSDP requires a single root module"); our packed forward (engine/packed_forward.py) and the decoder call the
layers one by one, never the model's forward, and a full fine-tuning run swaps the model's parameters
(engine/full_weights.py) where FSDP2 swaps them too. So the gather is a product (`lora.MultiLoraLinear.product`),
an autograd Function that saves the shard, never the gathered weight, and the embedding a module of our own.

Every process must run the same passes in the same order, on the same data: each gather is a collective, and
the processes meet at each one. So LoRA adapters are replicated and every process computes the same gradients
and takes the same optimizer step, bit for bit: nothing is reduced, and the adapters never drift apart. That is
the memory half of FSDP (weights 1/N a process); the throughput half (each process on its own part of the batch,
gradients reduced) is the data-parallel replicas' (docs/architecture.md, "Scale-out on Ray"), run over groups.

A full fine-tuning run's weights are this process's shards too (`full_weights.new` copies the model's parameters,
which are now the shards): its gradients are the gathered weight's, cut to this process's rows, and its AdamW
state 1/N as well. Its checkpoint is written whole (`whole_weights`, `whole_tensors` for its optimizer state: the
model folder transformers loads, which any number of processes can load again: `load_full`, `shard_tensors`); its
global gradient norm (grad_clip_norm) sums the shards' over the group (`grad_norm`), and a step one process finds
unusable is undone on all (`on_any_process`). The Engine made with a group (Engine(group=...), engine/core.py) loads
its model with `load_sharded` and makes these calls itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from kernel_backend.engine import full_weights, lora
from kernel_backend.errors import UserError
from kernel_backend.types import LoraConfig


class ShardedWeight(nn.Module):
    """One frozen weight, this process's rows of it: rows [rank * rows, (rank + 1) * rows) of dim 0, the last
    process's padded with zero rows so that every shard has one shape (all_gather needs it). Dim 0 is the
    output features of a linear layer and the vocabulary of an embedding, as FSDP2 shards (Shard(0)).

    `weight` is what the layer and its readers see in the weight's place: the full shape, dtype and device (an
    adapter's A and B are shaped by it, lm_head.weight.shape is the vocabulary) and no values, a one-element
    tensor expanded; the products never read it. The bias, small, stays whole."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, read_rows=None) -> None:
        """`read_rows(start, stop)`: those rows of the weight, read from its files where `weight` has no values (a
        meta tensor: load_sharded); by default `weight`'s own."""
        super().__init__()
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.full_shape = tuple(weight.shape)
        self.rows = -(-self.full_shape[0] // self.world)  # ceil: the last shard is the one padded
        read_rows = read_rows or (lambda start, stop: weight.detach()[start:stop])
        mine = read_rows(self.rank * self.rows, (self.rank + 1) * self.rows)
        shard = mine.new_zeros((self.rows, *self.full_shape[1:]))
        shard[:len(mine)] = mine
        self.shard = nn.Parameter(shard, requires_grad=False)
        self.bias = bias
        self.weight = shard.new_zeros(()).expand(self.full_shape)
        self.gathers = 0  # all-gathers made (the tests count them: forward and backward each gather once a use)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole weight from every process's `shard` (this one's: the parameter now in its place, which a full
        fine-tuning run's swap may have replaced). A collective: every process of the group must call it."""
        self.gathers += 1
        full = shard.new_empty((self.world * self.rows, *self.full_shape[1:]))
        dist.all_gather_single(full, shard.detach().contiguous(), group=self.group)
        return full[:self.full_shape[0]]

    def my_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor shaped like the whole weight (its gradient), padded like the shard."""
        out = full.new_zeros((self.rows, *self.full_shape[1:]))
        mine = full[self.rank * self.rows:(self.rank + 1) * self.rows]
        out[:len(mine)] = mine
        return out


class _GatheredLinear(torch.autograd.Function):
    """inner(x, W, b) with W gathered from its shards for the product and freed after it; backward gathers W again
    for x's gradient. Only the shard is saved (and x where the shard trains: a full fine-tuning run)."""

    @staticmethod
    def forward(ctx, x, shard, bias, owner: ShardedWeight, inner):
        weight = owner.gather(shard)
        ctx.save_for_backward(x if shard.requires_grad else None, shard)
        ctx.owner, ctx.inner, ctx.has_bias = owner, inner, bias is not None
        return inner(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, shard = ctx.saved_tensors
        grad_x = grad_shard = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = ctx.owner.gather(shard)  # gathered again, not kept from forward: FSDP's memory saving
            grad_x = ctx.inner(grad, weight.t(), None)  # grad W, by the same product as the unsharded layer's
            del weight
        if ctx.needs_input_grad[1]:  # every process ran the same rows: the whole gradient is the same everywhere
            grad_shard = ctx.owner.my_rows(grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_shard, grad_bias, None, None


def gathered_product(owner: ShardedWeight, inner):
    """A MultiLoraLinear's product (F.linear's signature) over `owner`'s shards: the `weight` it is handed is the
    layer's stand-in (ShardedWeight.weight); the values come from the shard in owner's place at the call."""

    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shard = owner.shard
        # A full run's shard, swapped in, trains: its product is F.linear's, as MultiLoraLinear.base_product gives an
        # unsharded full run's weights (AdamW's first steps turn the products' last-bit differences into lr-sized ones).
        return _GatheredLinear.apply(x, shard, bias, owner, F.linear if shard.requires_grad else inner)
    return product


class _ShardedLookup(torch.autograd.Function):
    """F.embedding over a vocabulary sharded by rows, never gathered: each process looks up the ids its rows hold
    (zeros for the others) and an all-reduce sums them, so (tokens x hidden) crosses the group instead of the table
    (Megatron's vocabulary-parallel embedding). Exact: each position's sum is its one row plus zeros. A gradient (a
    full run's) is this process's rows', from its own positions."""

    @staticmethod
    def forward(ctx, ids, shard, owner: ShardedWeight, padding_idx):
        local = ids - owner.rank * owner.rows
        mine = (local >= 0) & (local < owner.rows)
        local = local.clamp(0, owner.rows - 1)
        out = F.embedding(local, shard).masked_fill_(~mine[..., None], 0)
        dist.all_reduce(out, group=owner.group)
        ctx.save_for_backward(*((local, mine) if shard.requires_grad else (None, None)))
        ctx.owner, ctx.padding_idx = owner, padding_idx
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        local, mine = ctx.saved_tensors
        owner = ctx.owner
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx - owner.rank * owner.rows
        padding = padding if 0 <= padding < owner.rows else -1  # the padding row's gradient stays 0, if it is ours
        grad = grad.masked_fill(~mine[..., None], 0)
        return None, torch.ops.aten.embedding_dense_backward(grad, local, owner.rows, padding, False), None, None


class ShardedEmbedding(nn.Module):
    """An input embedding over a ShardedWeight (shared with lm_head where the model ties them: the head gathers it
    for its product, the lookup needs no gather). Keeps the original's padding index and, for Gemma's scaled
    embedding, its scale."""

    def __init__(self, original: nn.Embedding, owner: ShardedWeight) -> None:
        super().__init__()
        self.sharded = owner
        self.padding_idx = original.padding_idx
        scale = getattr(original, "embed_scale", None)
        self.register_buffer("embed_scale", scale, persistent=False)  # None (no buffer) but for Gemma's

    @property
    def weight(self) -> torch.Tensor:  # what model.get_input_embeddings().weight reads: the full shape, no values
        return self.sharded.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = _ShardedLookup.apply(ids, self.sharded.shard, self.sharded, self.padding_idx)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


def shard_model(model: PreTrainedModel, group=None, read_rows=None) -> None:
    """Shard `model`'s base linear layers (lora.attach's, lm_head included) and its input embedding over `group`:
    afterwards this process holds its rows of each, and the whole weights are freed (nothing else may hold them).
    Every process of the group must call it on the same model, and from then on run the same passes in order.
    `read_rows(name, start, stop)` reads rows of the weight `name` (transformers' name) from the model's files,
    for a model made without values (load_sharded); by default each weight's own rows are kept.

    The model must not have the sampler's bf16 copies (STEPWISE_SAMPLE_DTYPE=bfloat16): they are whole weights."""
    layers = lora.lora_layers(model)
    if not layers:
        raise ValueError("shard_model shards the layers lora.attach made: attach first")
    if any(layer.sample_weight is not None or layer.shared_copy is not None for layer in layers.values()):
        raise ValueError("a sharded model samples on its own weights: STEPWISE_SAMPLE_DTYPE must be float32")
    owners: dict[int, ShardedWeight] = {}  # by the original weight's id: a tied head and embedding share one shard

    def owner_of(weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> ShardedWeight:
        if id(weight) not in owners:
            rows = (lambda start, stop: read_rows(name, start, stop)) if read_rows else None
            owners[id(weight)] = ShardedWeight(weight, bias, group, rows)
        return owners[id(weight)]

    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Embedding):  # Gemma's scaled embedding is one
        raise ValueError(f"cannot shard an input embedding of type {type(embedding).__name__}")
    embedding_name = next(name for name, module in model.named_modules() if module is embedding)
    # The embedding first: a head tied to it is read from the embedding's name, the one its files hold.
    sharded = ShardedEmbedding(embedding, owner_of(embedding.weight, None, f"{embedding_name}.weight"))
    for layer in layers.values():
        owner = owner_of(layer.base.weight, layer.base.bias, f"{layer.name}.weight")
        layer.product = gathered_product(owner, layer.product)
        layer.base = owner  # type: ignore[assignment]  # in the nn.Linear's place: .weight, .bias
    model.set_input_embeddings(sharded)


def weight_bytes(folder: Path, dtype: torch.dtype = torch.float32) -> int:
    """What the model in `folder` holds loaded in `dtype`: its weights' elements, from the safetensors files' headers
    (no tensor is read), times `dtype`'s size. The gateway sizes shard groups by it (execution/cluster.py)."""
    from safetensors import safe_open

    elements = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt", device="cpu") as handle:
            elements += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    return elements * dtype.itemsize


def load_sharded(folder: Path, group=None, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 product=F.linear) -> PreTrainedModel:
    """The model in `folder` (a transformers folder of safetensors files), frozen, with lora.attach's layers (their
    products `product`) and sharded over `group`, each process reading from the files only its rows of the sharded
    weights and the small tensors whole: no process ever holds the whole model, as one bigger than a worker needs.
    What base_models.load and shard_model give together, without the whole model in between."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # shapes, no values
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    # What no file holds (rotary tables, Gemma's embedding scale), made as transformers makes it.
    for module in model.modules():
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            for attribute, buffer in list(module.named_buffers(recurse=False)):
                module._buffers[attribute] = torch.empty_like(buffer, device=device)
            model._init_weights(module)
    lora.attach(model, product)
    files = {}  # weight name -> its open safetensors file
    for file in sorted(Path(folder).glob("*.safetensors")):
        handle = safe_open(file, "pt", device="cpu")
        files.update(dict.fromkeys(handle.keys(), handle))

    def read_rows(name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if name not in files:
            raise UserError(f"{folder} does not hold the weight {name}")
        # The mapped file's rows: ShardedWeight copies them; a view kept would keep the mapping alive, and its pages.
        return files[name].get_slice(name)[start:stop].to(device, dtype)

    shard_model(model, group, read_rows)
    for module_name, module in model.named_modules():  # the rest, whole: norms, biases
        for attribute, param in module.named_parameters(recurse=False):
            if param.is_meta:
                name = full_weights._hf_name(f"{module_name}.{attribute}")
                module._parameters[attribute] = nn.Parameter(read_rows(name).clone(), requires_grad=False)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"load_sharded cannot make {', '.join(left)} of {type(model).__name__}")
    return model


def sharded_weights(model: nn.Module) -> list[ShardedWeight]:
    """The model's sharded weights, each once."""
    return list({id(m): m for m in model.modules() if isinstance(m, ShardedWeight)}.values())


def resident_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers this process holds, each storage once (a tied weight is
    one; a stand-in `weight` is no parameter): a sharded model's shards and its whole small tensors."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# ---- what a full run's optim_step must agree on across the group ----------------------------------------------


def grad_norm(model: nn.Module, run) -> float:
    """The run's global gradient norm (what grad_clip_norm clips to, and optim_step reports): on a sharded model a
    full run's shards hold a part of each weight's gradient each, so their squares are summed over the group; its
    whole tensors (norms, biases) and a LoRA adapter's, alike on every process, are counted once."""
    shard_names = _shard_names(model)
    # The squares' sums, in float64 (millions of squares): [this process's shards, the tensors every process holds].
    parts = [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    for name, p in run.named_parameters():
        if p.grad is not None:
            parts[name not in shard_names] += p.grad.detach().double().pow(2).sum()
    owners = sharded_weights(model)
    if owners:
        dist.all_reduce(parts[0], group=owners[0].group)
    return float((parts[0] + parts[1]).sqrt())


def on_any_process(flag: bool, model: nn.Module) -> bool:
    """Whether `flag` holds on any process of the model's group: a step one process finds unusable (a non-finite
    shard) must be undone on every one, or the processes' weights part ways."""
    owners = sharded_weights(model)
    if not owners:
        return flag
    t = torch.tensor(float(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=owners[0].group)
    return bool(t)


# ---- a full run's checkpoint: written whole, so that it loads on any number of processes -----------------------


def _shard_names(model: nn.Module) -> dict[str, tuple[str, ShardedWeight]]:
    """{a shard's parameter name: (the whole weight's name in the unsharded model, its ShardedWeight)}. The shard's
    module stands where the nn.Linear stood (`layer.base`) or inside the embedding (`.sharded`)."""
    return {f"{name}.shard": (name.removesuffix(".sharded") + ".weight", module)
            for name, module in model.named_modules() if isinstance(module, ShardedWeight)}


def _parameter_and_key(name: str, params) -> tuple[str | None, str]:
    """A tensor's parameter and what of it the tensor is: ("p", "") for parameter p itself, ("p", "exp_avg") for its
    optimizer state "p.exp_avg" (optimizers.state_tensors' names), (None, "") for neither of `params`."""
    if name in params:
        return name, ""
    head, _, key = name.rpartition(".")
    return (head, key) if head in params else (None, "")


def whole_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sharded full run's tensors (its weights, or its optimizer state: flat moments and a step each), each
    whole and under the unsharded model's names. A collective: every process calls it, and gets them all."""
    names = _shard_names(model)
    out = {}
    for name, tensor in tensors.items():
        param, key = _parameter_and_key(name, names)
        if param is None:  # a norm, a bias: whole already
            out[name] = tensor.detach()
            continue
        whole_name, owner = names[param]
        if key == "step":
            out[f"{whole_name}.step"] = tensor.detach()
            continue
        whole = owner.gather(tensor.detach().reshape(owner.rows, *owner.full_shape[1:]))  # a moment is saved flat
        out[f"{whole_name}.{key}" if key else whole_name] = whole.reshape(-1) if key else whole
    return out


def shard_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """whole_tensors' inverse: whole tensors under the unsharded names, as this process's rows under the shards'
    names (a whole checkpoint, written from any number of processes, resharded onto this group)."""
    names = {whole_name: (shard_name, owner) for shard_name, (whole_name, owner) in _shard_names(model).items()}
    out = {}
    for name, tensor in tensors.items():
        param, key = _parameter_and_key(name, names)
        if param is None:
            out[name] = tensor
            continue
        shard_name, owner = names[param]
        if key == "step":
            out[f"{shard_name}.step"] = tensor
            continue
        mine = owner.my_rows(tensor.reshape(owner.full_shape))
        out[f"{shard_name}.{key}" if key else shard_name] = mine.reshape(-1) if key else mine
    return out


def whole_weights(model: nn.Module, run: full_weights.FullWeights) -> full_weights.FullWeights:
    """A full run's weights on a sharded model, whole and under the unsharded model's names, so that FullWeights.save
    writes the model folder transformers loads (one process writes it). A collective, as whole_tensors."""
    whole = whole_tensors(model, dict(run.named_parameters()))
    return full_weights.FullWeights(run.config, {n: nn.Parameter(t, requires_grad=False) for n, t in whole.items()})


def load_full(model: nn.Module, directory: Path, config: LoraConfig,
              trainable: bool = True) -> full_weights.FullWeights:
    """full_weights.load for a sharded model: a full run's checkpoint (whole, from any number of processes, or any
    transformers folder of this architecture) as this process's shards. UserError when a weight is missing or has
    another shape."""
    saved = load_file(Path(directory) / full_weights.WEIGHTS_FILE)
    names = _shard_names(model)
    whole = {}
    for name, [(module, attribute), *_] in full_weights._places_of(model).items():
        whole_name, owner = names.get(name, (name, None))
        current = module._parameters[attribute]
        assert current is not None  # _places lists the parameters a module holds
        hf_name = full_weights._hf_name(whole_name)
        tensor = saved.get(hf_name)
        if tensor is None and hf_name == "lm_head.weight":  # a tied head saved once, as the embedding
            tensor = saved.get("model.embed_tokens.weight")
        shape = owner.full_shape if owner is not None else tuple(current.shape)
        if tensor is None or tuple(tensor.shape) != shape:
            found = "missing" if tensor is None else f"shape {tuple(tensor.shape)}"
            raise UserError(f"{directory} does not hold this base model's weights: {hf_name} is {found}, "
                            f"expected shape {shape}")
        whole[whole_name] = tensor.to(current.dtype)
    return full_weights.FullWeights(config, {n: nn.Parameter(t, trainable)
                                             for n, t in shard_tensors(model, whole).items()})
