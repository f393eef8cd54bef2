"""bf16 against fp32 on this machine's CPU: speed, and how far the logprobs move.

Two engines on the default model, one with fp32 weights (the default) and one with bf16 weights
(STEPWISE_DTYPE=bfloat16), carrying the same LoRA adapter (rank 32, trained 2 steps so it is not a
no-op). Interleaved in one run:

- sampling: 8 requests x 4 samples x 32 tokens (temperature 1) through the batched decoder:
  sampled tokens/s; then, on the bf16 samples, |bf16 sampled logprob - bf16 compute_logprobs| (does
  bf16 keep sample == compute_logprobs?) and |bf16 - fp32 compute_logprobs| (how far from fp32);
- training: forward_backward + optim_step on 8 x 128 tokens: tokens/s; |bf16 - fp32| of the
  forward pass's target logprobs on the same data and weights.

    .venv/bin/python bench/precision.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402

from kernel_backend.config import Settings  # noqa: E402
from kernel_backend.engine.core import Engine  # noqa: E402
from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is your favorite color?", "How are you today?", "What should I eat for dinner?", "Tell me about dogs.",
    "What is the weather like in spring?", "Can you recommend a book?", "What is a good hobby?",
    "How do I stay healthy?",
]


def describe(differences: np.ndarray) -> str:
    return f"mean {differences.mean():.2e}, p99 {np.quantile(differences, 0.99):.2e}, max {differences.max():.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    engines = {"fp32": Engine(), "bf16": Engine(settings=Settings(dtype="bfloat16"))}
    fp32, bf16 = engines["fp32"], engines["bf16"]
    tokenizer = fp32.tokenizer
    rng = np.random.default_rng(0)
    train_data = []
    for _ in range(8):
        tokens = rng.integers(0, fp32.vocab_size, size=129)
        train_data.append(Datum(tokens=tokens[:-1].tolist(), loss_fn_inputs={"target_tokens": tokens[1:].astype(np.int64)}))
    fp32.create_adapter("a", LoraConfig(rank=32, seed=0))
    for _ in range(2):
        fp32.forward_backward("a", train_data[:2])
        fp32.optim_step("a", AdamParams(learning_rate=1e-3))
    with tempfile.TemporaryDirectory() as tmp:  # the same weights in both (load casts to the engine's dtype)
        fp32.save_state("a", Path(tmp) / "a")
        bf16.load_state("a", Path(tmp) / "a")

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]

    def sample(engine):
        requests = [engine.sample_request("a", p, 4, SamplingParams(max_tokens=32, temperature=1.0, seed=i))
                    for i, p in enumerate(prompts)]
        return engine.run_requests(requests)

    def train(engine):
        engine.forward_backward("a", train_data)
        engine.optim_step("a", AdamParams(learning_rate=0.0))  # no change: both keep the same weights

    rates = {(kind, name): [] for kind in ("sample", "train") for name in engines}
    samples = {}
    for name, engine in engines.items():  # warm-up
        sample(engine)
        train(engine)
    for i in range(args.rounds):
        for name in engines if i % 2 == 0 else reversed(list(engines)):
            start = time.perf_counter()
            samples[name] = sample(engines[name])
            rates[("sample", name)].append(sum(len(s.tokens) for r in samples[name] for s in r.sequences)
                                           / (time.perf_counter() - start))
            start = time.perf_counter()
            train(engines[name])
            rates[("train", name)].append(8 * 128 / (time.perf_counter() - start))

    self_diff, fp32_diff = [], []
    for prompt, result in zip(prompts, samples["bf16"]):
        for seq in result.sequences:
            n = len(seq.tokens)
            bf16_lp = np.array(bf16.compute_logprobs("a", prompt + seq.tokens)[-n:])
            fp32_lp = np.array(fp32.compute_logprobs("a", prompt + seq.tokens)[-n:])
            self_diff.append(np.abs(np.array(seq.logprobs) - bf16_lp))
            fp32_diff.append(np.abs(bf16_lp - fp32_lp))
    forward = {name: np.concatenate([o["logprobs"] for o in e.forward("a", train_data).loss_fn_outputs])
               for name, e in engines.items()}

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus; medians of {args.rounds} rounds")
    for kind in ("sample", "train"):
        r32, r16 = statistics.median(rates[(kind, "fp32")]), statistics.median(rates[(kind, "bf16")])
        print(f"{kind:<7} fp32 {r32:7.1f} tokens/s   bf16 {r16:7.1f} tokens/s   bf16 / fp32 {r16 / r32:.2f}")
    print("bf16 sampled logprob vs bf16 compute_logprobs: " + describe(np.concatenate(self_diff)))
    print("bf16 vs fp32 compute_logprobs (same tokens):   " + describe(np.concatenate(fp32_diff)))
    print("bf16 vs fp32 training forward logprobs:        " + describe(np.abs(forward["bf16"] - forward["fp32"])))


if __name__ == "__main__":
    main()
