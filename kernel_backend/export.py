"""Getting weights out: a saved checkpoint as a PEFT adapter folder, or merged into the base model.

The merged model is a plain Hugging Face folder (config, tokenizer, safetensors) that
`transformers.AutoModelForCausalLM.from_pretrained` loads with no Stepwise or PEFT installed:
each targeted weight becomes W + (alpha / rank) * B @ A. A full fine-tuning run's checkpoint is such a
folder already (engine/full_weights.py): exported either way, it is copied without its optimizer state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from kernel_backend.engine import base_models, full_weights, lora
from kernel_backend.engine.step_history import OPTIMIZER_FILES
from kernel_backend.config import Settings
from kernel_backend.persistence import crypto
from kernel_backend.persistence.checkpoint_storage import CheckpointStorage
from kernel_backend.persistence.database import Store, parse_tinker_path
from kernel_backend.errors import UserError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def checkpoint_location(store: Store, path: str) -> str:
    """A tinker:// path (looked up in the store) or a checkpoint folder on disk."""
    if path.startswith("tinker://"):
        parse_tinker_path(path)
        row = store.checkpoint_by_path(path)
        if row is None:
            raise UserError(f"no checkpoint at {path}")
        return row.directory
    folder = Path(path)
    if not (folder / "adapter_model.safetensors").exists() and not full_weights.is_checkpoint(folder):
        raise UserError(f"{folder} is not a checkpoint folder (no adapter_model.safetensors or model.safetensors)")
    return str(folder)


def export_checkpoint(store: Store, settings: Settings, path: str, to: str | Path, merged: bool = False) -> Path:
    storage = CheckpointStorage(settings.checkpoints_dir, settings.storage_url, settings.storage_fs_options)
    with storage.open(checkpoint_location(store, path), settings.decryption_keys) as source:
        return _export(source, settings, Path(to), merged)


def _export(source: Path, settings: Settings, target: Path, merged: bool) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    if full_weights.is_checkpoint(source):
        for item in source.iterdir():
            if item.is_file() and item.name not in (*OPTIMIZER_FILES, crypto.MANIFEST):
                shutil.copy2(item, target / item.name)
        return target
    if not merged:
        for name in ADAPTER_FILES:
            shutil.copy2(source / name, target / name)
        return target

    import json

    base_name = json.loads((source / "adapter_config.json").read_text())["base_model_name_or_path"]
    _, base_dir = base_models.resolve(base_name, settings.models_dir, settings.base_models)
    config = lora.read_peft_config(source)
    scale = config.alpha / config.rank
    weights = load_file(base_dir / "model.safetensors")
    adapter = load_file(source / "adapter_model.safetensors")
    for key in [k for k in adapter if k.endswith(".lora_A.weight")]:
        module = key.removeprefix(lora.PEFT_PREFIX).removesuffix(".lora_A.weight")
        a, b = adapter[key].double(), adapter[key.replace("lora_A", "lora_B")].double()
        name = f"{module}.weight"
        if module == "lm_head" and name not in weights:
            # Tied embeddings: the merged head is no longer the embedding, so it gets its own weight.
            weights[name] = weights["model.embed_tokens.weight"].clone()
        weights[name] = (weights[name].double() + scale * (b @ a)).to(weights[name].dtype).contiguous()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    for item in base_dir.iterdir():
        if item.name not in ("model.safetensors", "stepwise.json") and item.is_file():
            shutil.copy2(item, target / item.name)
    if "lm_head.weight" in weights:
        config_path = target / "config.json"
        hf_config = json.loads(config_path.read_text())
        hf_config["tie_word_embeddings"] = False
        config_path.write_text(json.dumps(hf_config, indent=2))
    return target

