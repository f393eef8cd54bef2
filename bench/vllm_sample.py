"""Sampling: the vLLM sampler (STEPWISE_SAMPLER=vllm) against the built-in one, on the same requests.

Both sample the default model (SmolLM2-135M-Instruct, fp32) in this process's backend pieces:
- built-in: `Engine.sample`, one request after another, as the scheduler thread runs them;
- vLLM:     `VllmSampler.sample` (the worker process in the vLLM venv), every request sent at once
            from a thread pool, as the service's VllmSampling sends them, so vLLM batches them.
The requests: `--requests` chat prompts, each asking `--n` samples of exactly `--max-tokens` tokens
(temperature 1, stop=[] so both sides produce the same token count, fixed seeds), once on the base
model and once through a LoRA adapter of rank `--rank` (all targets, trained two steps so it is not
zero). Start-up is timed separately: the engine's model load, and the vLLM worker's start.
Printed: tokens per second on each side and their ratio (vLLM / built-in, higher is better), and
the sampler-vs-trainer logprob gap (mean and max |vLLM logprob - engine logprob| on vLLM's tokens).
Needs the vLLM venv (python -m kernel_backend.vllm_venv build).

    python bench/vllm_sample.py [--requests 8] [--n 4] [--max-tokens 32] [--rank 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (docs/performance.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kernel_backend.config import Settings  # noqa: E402
from kernel_backend.engine import Engine  # noqa: E402
from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams  # noqa: E402
from kernel_backend.vllm_sampler import VllmSampler  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "How many legs does a spider have?",
             "Write a short greeting.", "What color is the sky?", "Give me a word that rhymes with cat.",
             "What is 2 plus 3?", "Say something about the sea."]


def chat_prompt(engine: Engine, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def run_builtin(engine: Engine, adapter, prompts, n, params) -> tuple[float, list]:
    start = time.perf_counter()
    results = [engine.sample(adapter, p, n, params) for p in tqdm(prompts, desc="built-in", leave=False)]
    return time.perf_counter() - start, results


def run_vllm(engine: Engine, vllm: VllmSampler, adapter, prompts, n, params) -> tuple[float, list]:
    stop_ids, stop_strings = engine._check_sampling(prompts[0], n, params, 0)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: vllm.sample(adapter, p, n, params, stop_ids, stop_strings), prompts))
    return time.perf_counter() - start, results


def logprob_gap(engine: Engine, adapter, prompts, results) -> tuple[float, float]:
    gaps = []
    for prompt, result in zip(prompts, results):
        for seq in result.sequences:
            trainer = engine.compute_logprobs(adapter, prompt + seq.tokens)[len(prompt):]
            gaps.extend(abs(a - b) for a, b in zip(seq.logprobs, trainer))
    return float(np.mean(gaps)), float(np.max(gaps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    settings = Settings()

    start = time.perf_counter()
    engine = Engine(settings=settings)
    engine_s = time.perf_counter() - start
    vllm = VllmSampler(settings, engine.base.name, engine.max_context)
    vllm.start()
    print(f"start-up: built-in engine (model load) {engine_s:.1f} s; vLLM worker {vllm.startup_s:.1f} s   "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)")

    # A LoRA adapter that is not zero: two steps on one example, then the same files to both sides.
    engine.create_adapter("bench", LoraConfig(rank=args.rank, seed=0))
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}]
    tokens = list(engine.tokenizer.apply_chat_template(messages)["input_ids"])
    datum = Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)})
    for _ in range(2):
        engine.forward_backward("bench", [datum])
        engine.optim_step("bench", AdamParams(learning_rate=1e-3))
    with tempfile.TemporaryDirectory() as scratch:
        engine.save_weights_for_sampler("bench", Path(scratch) / "adapter")
        vllm.add_adapter("bench", Path(scratch) / "adapter")

    prompts = [chat_prompt(engine, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, stop=[])
    total = args.requests * args.n * args.max_tokens
    print(f"{args.requests} requests x {args.n} samples x {args.max_tokens} tokens = {total} tokens per side\n")
    print(f"{'':22}{'built-in tok/s':>16}{'vLLM tok/s':>12}{'ratio':>8}{'gap mean':>11}{'gap max':>10}")
    for label, adapter in (("base model", None), (f"LoRA rank {args.rank}", "bench")):
        run_vllm(engine, vllm, adapter, prompts[:1], 1, SamplingParams(max_tokens=2, stop=[]))  # warm-up
        builtin_s, _ = run_builtin(engine, adapter, prompts, args.n, params)
        vllm_s, results = run_vllm(engine, vllm, adapter, prompts, args.n, params)
        assert sum(len(s.tokens) for r in results for s in r.sequences) == total
        mean, worst = logprob_gap(engine, adapter, prompts, results)
        print(f"{label:22}{total / builtin_s:16.1f}{total / vllm_s:12.1f}{builtin_s / vllm_s:8.2f}{mean:11.1e}{worst:10.1e}")
    print(f"\n(load average {os.getloadavg()[0]:.1f} at the end)")
    vllm.stop()


if __name__ == "__main__":
    main()
