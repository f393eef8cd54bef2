"""Tiny random models with the default model's tokenizer, for tests about behaviour rather than learning.

Most of the suite checks what the service does (the wire protocol, bad input, tenants, budgets, crashes
and recovery, the scheduler, the routes), not what the model learns. Those tests run on a tiny random
model of the default model's own architecture and tokenizer: the same code paths (the packed forward,
LoRA on every linear layer, the continuous batch, checkpoints) at a fraction of SmolLM2-135M's cost.
A server stands it in for the default model under the default model's name (STEPWISE_BASE_MODELS, whose
entries win over the registry's), so the tests' requests are unchanged. Tests about quality (a loss that
falls on real text, a taught answer, a reward that rises, agreement with transformers/PEFT on the real
weights, the notebooks a person runs) keep the real model.

Nothing is downloaded: the tokenizer and the architecture's config are the converted default model's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernel_backend.engine import base_models

# A model of a few hundred thousand weights besides its embedding (which the vocabulary fixes).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)


def default_model_dir(models_dir: Path) -> Path:
    """The converted default model (converting its GGUF the first time on this machine)."""
    return base_models.resolve(base_models.DEFAULT_MODEL, Path(models_dir))[1]


def tiny_model_folder(folder, architecture: str, models_dir, **config) -> str:
    """A tiny random model of `architecture` saved as a model folder with the default model's tokenizer
    (nothing can be downloaded here), as STEPWISE_BASE_MODELS registers one; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(models_dir))
    config = AutoConfig.for_model(architecture, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                  **{**TINY, "max_position_embeddings": 1024, **config})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_default_model(folder: Path, models_dir: Path) -> Path:
    """A tiny random stand-in for the default model, saved in `folder`: its config (Llama, tied embeddings, its
    context length and rotary settings) with only the sizes in TINY, its tokenizer and chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = default_model_dir(models_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, **TINY)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return Path(folder)


# The sampler's KV cache in MB that holds as many tokens of the tiny model (512 bytes a token) as the default
# 4096 MB hold of SmolLM2-135M's (46,080 bytes): about 93k, so the requests that overflow it stay the same.
SAMPLE_CACHE_MB = 46


def stand_in_env(folder: Path) -> dict[str, str]:
    """A backend's environment that serves `folder` under the default model's name."""
    return {"STEPWISE_BASE_MODELS": f"{base_models.DEFAULT_MODEL}={folder}", "STEPWISE_SAMPLE_CACHE_MB": str(SAMPLE_CACHE_MB)}


def stand_in_settings(folder: Path):
    """The Settings of an in-process Engine on the stand-in (the same as stand_in_env's)."""
    from kernel_backend.config import Settings

    return Settings(base_models=[f"{base_models.DEFAULT_MODEL}={folder}"], sample_cache_mb=SAMPLE_CACHE_MB)

