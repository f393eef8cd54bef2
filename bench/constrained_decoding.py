"""Constrained decoding (kernel_backend/engine/constraints.py): what a grammar costs.

Two parts, each printing its figures from this one run:

- engines: the grammar engine's costs with the default model's tokenizer (49,152 tokens) on a small JSON schema:
           the tokenizer's one-time preparation, a schema's compile, and the mask plus advance per token over a
           valid reply; llguidance (the engine used) and, when it is importable, xgrammar (the alternative
           measured when one was chosen: `pip install --no-deps --target DIR xgrammar apache-tvm-ffi` and put DIR
           on PYTHONPATH; it also wants triton, which the mask path here does not use).
- decode:  the built-in sampler in this process on the real default model: 8 rows, 64 tokens each at
           temperature 1, every row under a JSON grammar (an array of at least 64 objects, so no row completes
           early) against the same rows unconstrained (stop=[], so every row runs 64 tokens too): tokens/s of
           each and their ratio, rounds alternating, the median of 5.     Target: >= 0.9x.

    python bench/constrained_decoding.py [--parts engines,decode]
"""

from __future__ import annotations

import benchenv  # noqa: F401  (first: the environment every benchmark shares)

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
REPLY = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "bee", "sea"], "ok": True})
LONG = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "score": {"type": "integer"}}, "required": ["name", "score"],
    "additionalProperties": False}}


def engines(tokenizer) -> None:
    import llguidance
    import llguidance.hf

    from kernel_backend import grammars

    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    vocab = len(tokenizer)
    start = time.perf_counter()
    prepared = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(prepared, grammars.json_grammar(SCHEMA, "schema"))
    compiled = time.perf_counter() - start
    executor = llguidance.LLExecutor()
    import numpy as np
    mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    start = time.perf_counter()
    for token in ids:
        executor.unsafe_compute_mask_ptr([(matcher, 0)], mask.ctypes.data, mask.shape[1] * 4, 1)
        assert matcher.consume_token(token)
    per_token = (time.perf_counter() - start) / len(ids)
    print(f"llguidance: tokenizer {setup * 1e3:.0f} ms once, compile {compiled * 1e3:.1f} ms, "
          f"mask + advance {per_token * 1e6:.0f} us/token ({len(ids)} tokens)")
    try:
        import xgrammar
    except ImportError:
        print("xgrammar: not importable here (see the docstring to measure it too)")
        return
    start = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compiled = time.perf_counter() - start
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert matcher.accept_token(token)
    per_token = (time.perf_counter() - start) / len(ids)
    print(f"xgrammar:   tokenizer {setup * 1e3:.0f} ms once, compile {compiled * 1e3:.1f} ms, "
          f"mask + advance {per_token * 1e6:.0f} us/token")


def decode(rounds: int = 5, rows: int = 8, max_tokens: int = 64) -> None:
    from kernel_backend import grammars
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import SampleOptions, SamplingParams

    engine = Engine()
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "List people and scores as JSON."}],
                                                  add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else list(prompt)
    grammar = grammars.json_grammar(LONG, "schema")

    def rate(constrained: bool, seed: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
        options = SampleOptions(grammar=grammar if constrained else None)
        start = time.perf_counter()
        (result,) = engine.run_requests([engine.sample_request(None, prompt, rows, params, options)])
        elapsed = time.perf_counter() - start
        tokens = sum(len(s.tokens) for s in result.sequences)
        assert tokens == rows * max_tokens, tokens  # the same work: no row stopped early
        return tokens / elapsed

    rate(True, 0), rate(False, 0)  # warm-up: the grammar compiled (and cached), the model's first passes
    free, masked = [], []
    for r in range(rounds):
        masked.append(rate(True, r + 1))
        free.append(rate(False, r + 1))
    f, m = statistics.median(free), statistics.median(masked)
    print(f"decode: {rows} rows x {max_tokens} tokens, temperature 1: unconstrained {f:.0f} tokens/s, "
          f"constrained (JSON schema) {m:.0f} tokens/s: ratio {m / f:.2f}x (target >= 0.9x); {benchenv.load_line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="engines,decode")
    parts = parser.parse_args().parts.split(",")
    if "engines" in parts:
        from workbench.recipes.common import local_tokenizer
        engines(local_tokenizer(benchenv.BASE))
    if "decode" in parts:
        decode()


if __name__ == "__main__":
    main()
