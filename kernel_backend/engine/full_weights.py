"""Full fine-tuning: a run that trains every parameter of its own copy of the base model's weights.

A LoRA run (engine/lora.py) adds small matrices to a frozen base; a full run (`rank=0`, the convention of
Tinker-compatible services that offer it) owns a copy of every weight: embeddings, norms, every linear
layer, the head. It is not a second model: its tensors are swapped into the one loaded model for the
forward passes that run on them (`swapped`), so training, the batched decoder and the checks after a
step all run the model's own modules, and the base model's weights are never touched. Because a
forward pass can hold one set of weights, rows of a full run never share a pass with other rows: the
engine's micro-batches and the decoder's steps split by weights (engine/core.py, engine/sampler.py),
and `lora.route` swaps a full run's weights in for the rows that route to it.

A full run behaves as an adapter everywhere else: `FullWeights` has `lora.Adapter`'s surface
(parameters, named_parameters, detached, copy), so the adapter cache, the optimizers, the step
history and save/load treat both alike. Its memory is the model's size once per copy: weights,
gradients and AdamW's two moments make four (SmolLM2-135M: 4 x 0.54 GB), admitted and counted by the
adapter cache like any adapter's (engine/adapter_cache.py, service/admission.py).

Checkpoints are Hugging Face model folders: the base model's config and tokenizer files and the
weights in `model.safetensors` under transformers' names (tied embeddings written once, as
`save_pretrained` does), so `AutoModelForCausalLM.from_pretrained(folder)` loads one directly.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kernel_backend.errors import UserError
from kernel_backend.types import LoraConfig

WEIGHTS_FILE = "model.safetensors"
# What a full checkpoint folder holds besides the weights: the base model folder's other files (config,
# generation config, tokenizer), copied, so the folder is a model transformers and vLLM load as it is.
SKIPPED_BASE_FILES = (WEIGHTS_FILE, "stepwise.json", "model.safetensors.index.json")


def is_checkpoint(directory: Path) -> bool:
    """Does `directory` hold a full run's weights (rather than a LoRA adapter's)?"""
    return (Path(directory) / WEIGHTS_FILE).exists() and not (Path(directory) / "adapter_model.safetensors").exists()


def _hf_name(name: str) -> str:
    """A parameter's name in transformers' state dict: lora.attach wraps each linear layer as `<layer>.base`."""
    return name.replace(".base.", ".")


def _places(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each distinct parameter of `model` by its first name, with every (module, attribute) that holds it: a
    tied head and embedding are one parameter held twice."""
    first: dict[int, str] = {}
    places: dict[str, list[tuple[nn.Module, str]]] = {}
    for module_name, module in model.named_modules():
        for attribute, param in module.named_parameters(recurse=False):
            name = first.setdefault(id(param), f"{module_name}.{attribute}" if module_name else attribute)
            places.setdefault(name, []).append((module, attribute))
    return places


def _held(module: nn.Module, attribute: str) -> nn.Parameter:
    """The parameter `module` holds as `attribute`, one of _places' (module, attribute) pairs."""
    param = module._parameters[attribute]
    assert param is not None  # _places lists only the parameters named_parameters yields, never a None entry
    return param


class FullWeights:
    """Every weight of the base model, a run's own (rank 0). lora.Adapter's surface; it has no LoRA matrices."""

    full = True  # lora.Adapter's is False

    def __init__(self, config: LoraConfig, tensors: dict[str, nn.Parameter]) -> None:
        self.config = config
        self.tensors = tensors

    def parameters(self) -> list[nn.Parameter]:
        return list(self.tensors.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.tensors.items())

    def detached(self) -> FullWeights:
        """A view on the same tensors that autograd does not track (no copy): for forward-only rows."""
        # Detached views stand in for the parameters (typed as such): the same data, in no autograd graph and
        # given to no optimizer.
        return FullWeights(self.config, {n: cast(nn.Parameter, p.detach()) for n, p in self.tensors.items()})

    def copy(self, trainable: bool = False, device: str | torch.device | None = None) -> FullWeights:
        """A detached copy (a sampler snapshot, a kept step): later training of self does not touch it."""
        return FullWeights(self.config, {n: nn.Parameter(p.detach().to(device or p.device, copy=True), trainable)
                                         for n, p in self.tensors.items()})

    @contextlib.contextmanager
    def swapped(self, model: nn.Module):
        """Run `model` on these weights: each of its parameters is replaced by this run's (in every place that
        holds it) for the duration, then put back."""
        places = _places_of(model)
        saved = []
        try:
            for name, tensor in self.tensors.items():
                for module, attribute in places[name]:
                    saved.append((module, attribute, module._parameters[attribute]))
                    module._parameters[attribute] = tensor
            yield
        finally:
            for module, attribute, original in reversed(saved):
                module._parameters[attribute] = original

    def save(self, directory: Path, base_folder: Path) -> None:
        """A Hugging Face model folder: the base's config and tokenizer files, these weights as model.safetensors."""
        directory.mkdir(parents=True, exist_ok=True)
        for item in Path(base_folder).iterdir():
            if item.is_file() and item.name not in SKIPPED_BASE_FILES:
                shutil.copy2(item, directory / item.name)
        tensors = {_hf_name(n): p.detach().cpu().contiguous() for n, p in self.tensors.items()}
        save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def _places_of(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """_places, computed once per model (its modules never change after lora.attach)."""
    cached: dict[str, list[tuple[nn.Module, str]]] | None = getattr(model, "_stepwise_places", None)
    if cached is None:
        cached = _places(model)
        setattr(model, "_stepwise_places", cached)  # (nn.Module types an attribute set as Tensor | Module)
    return cached


def new(model: nn.Module, config: LoraConfig) -> FullWeights:
    """A full run starting at the base model's weights: a trainable copy of each of them."""
    return FullWeights(config, {name: nn.Parameter(_held(module, attribute).detach().clone(), True)
                                for name, [(module, attribute), *_] in _places_of(model).items()})


def load(model: nn.Module, directory: Path, config: LoraConfig, trainable: bool = True) -> FullWeights:
    """A full run's weights from a checkpoint folder (FullWeights.save's, or any transformers folder of this
    architecture). UserError when a weight is missing or has another shape."""
    tensors = load_file(Path(directory) / WEIGHTS_FILE)
    out = {}
    for name, [(module, attribute), *_] in _places_of(model).items():
        base = _held(module, attribute)
        saved = tensors.get(_hf_name(name))
        if saved is None and _hf_name(name) == "lm_head.weight":  # a tied head saved once, as the embedding
            saved = tensors.get("model.embed_tokens.weight")
        if saved is None or tuple(saved.shape) != tuple(base.shape):
            found = "missing" if saved is None else f"shape {tuple(saved.shape)}"
            raise UserError(f"{directory} does not hold this base model's weights: {_hf_name(name)} is {found}, "
                            f"expected shape {tuple(base.shape)}")
        out[name] = nn.Parameter(saved.to(base.device, base.dtype), trainable)
    return FullWeights(config, out)
