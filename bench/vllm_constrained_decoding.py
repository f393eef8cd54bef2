"""Constrained decoding through the vLLM sampler (kernel_backend/execution/vllm_sampler.py): what a grammar costs
there. bench/constrained_decoding.py's decode part, with vLLM's structured outputs (guidance backend) instead of the
built-in sampler's mask.

One vLLM worker (kernel_backend/vllm/worker.py, in the vLLM venv: `python -m kernel_backend.vllm.venv build`) on
the default model, as the server starts it: 8 rows, 64 tokens each at temperature 1, every row under the same JSON
grammar (an array of at least 64 objects, so no row completes early) against the same rows unconstrained
(no stop tokens, so every row runs 64 tokens too): tokens/s of each and their ratio, rounds alternating, the
median of 5. Target: >= 0.9x.

    .venv/bin/python bench/vllm_constrained_decoding.py [--rounds 5]
"""

from __future__ import annotations

import benchenv  # noqa: F401  (first: the environment every benchmark shares)

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from constrained_decoding import LONG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from kernel_backend import grammars
    from kernel_backend.config import Settings
    from kernel_backend.engine import base_models
    from kernel_backend.execution.vllm_sampler import WorkerProcess, engine_args
    from kernel_backend.vllm import venv as vllm_venv
    from workbench.recipes.common import local_tokenizer

    settings = Settings()
    model_dir = base_models.resolve(benchenv.BASE, settings.models_dir, settings.base_models)[1]
    python = vllm_venv.python(settings)
    assert python is not None, f"the vLLM venv is not built: {vllm_venv.BUILD_COMMAND}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_kv_cache_gb)}
    worker = WorkerProcess(python, engine_args(settings, model_dir, 1024), env,
                           Path(tempfile.mkdtemp()) / "worker.log")
    ready = worker.start(settings.vllm_startup_timeout_s)
    tokenizer = local_tokenizer(benchenv.BASE)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "List people and scores as JSON."}],
                                           add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else list(prompt)
    grammar = grammars.json_grammar(LONG, "schema")
    rows, max_tokens = 8, 64

    def rate(constrained: bool, seed: int) -> float:
        start = time.perf_counter()
        reply = worker.call(
            "sample", adapter=None, prompt=prompt, n=rows, max_tokens=max_tokens, temperature=1.0, top_k=-1,
            top_p=1.0, seed=seed, logit_bias=None, stop_token_ids=[], stop_strings=[], prompt_logprobs=False,
            topk_prompt_logprobs=0, topk_sample_logprobs=0, grammar=grammar if constrained else None,
        ).result()
        elapsed = time.perf_counter() - start
        tokens = sum(len(s["tokens"]) for s in reply["sequences"])
        assert tokens == rows * max_tokens, tokens  # the same work: no row stopped early
        return tokens / elapsed

    try:
        rate(True, 0), rate(False, 0)  # warm-up: the grammar compiled, the engine's first passes
        free, masked = [], []
        for r in range(args.rounds):
            masked.append(rate(True, r + 1))
            free.append(rate(False, r + 1))
    finally:
        worker.stop()
    f, m = statistics.median(free), statistics.median(masked)
    print(f"vLLM {ready['vllm']} decode: {rows} rows x {max_tokens} tokens, temperature 1: unconstrained {f:.1f} "
          f"tokens/s, constrained (JSON schema) {m:.1f} tokens/s: ratio {m / f:.2f}x (target >= 0.9x); "
          f"{benchenv.load_line()}")


if __name__ == "__main__":
    main()
