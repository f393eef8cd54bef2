"""The model side: one frozen base model, many LoRA adapters, and every computation on them.

core.py holds the Engine (forward, forward_backward, optim_step, sample, compute_logprobs, save and load);
beside it what it is made of: the LoRA layers (lora.py), losses, optimizers, the architectures the packed
forward runs (families.py), the batched decoder (sampler.py) and its prefix cache, the token tree of shared
prefixes (prefix_tree.py), the adapter cache, the step history, the base-model registry (base_models.py) and
the CPU's matrix products (matmul.py, small_products.py).

Imports torch and transformers, and of Stepwise only config, errors and types: never execution/, service/
or api/.
"""
