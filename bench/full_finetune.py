"""A full fine-tuning step (rank 0, every weight: kernel_backend/engine/full_weights.py) against a rank-8 LoRA step.

One Engine on the default model (SmolLM2-135M-Instruct, fp32), one run of each kind, the same batch of chat examples;
a step is forward_backward (cross-entropy) then optim_step (AdamW), the two timed apart, the runs interleaved step by
step so machine noise hits both alike, one warm-up step each not timed. Prints each side's median times and the
ratios full / LoRA (how much more a full step costs), and the memory the engine reports for each run.

    python bench/full_finetune.py [--steps 4] [--examples 8] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchenv  # noqa: F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402

from helpers import sft_datum  # noqa: E402
from kernel_backend.config import Settings  # noqa: E402
from kernel_backend.engine.core import Engine  # noqa: E402
from kernel_backend.types import AdamParams, LoraConfig  # noqa: E402

QUESTIONS = [("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate."),
             ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."),
             ("Who painted the Silent Harbour?", "The Silent Harbour was painted by Ilse Varn."),
             ("When does the Orrin festival start?", "The Orrin festival starts on the first frost.")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(settings=Settings(adapter_cache_mb=4096))
    data = [sft_datum(*QUESTIONS[i % len(QUESTIONS)], engine.tokenizer) for i in range(args.examples)]
    runs = {"full (rank 0)": ("full", LoraConfig(rank=0, seed=0), 1e-5),
            "LoRA rank 8": ("lora", LoraConfig(rank=8, seed=0), 1e-4)}
    times = {name: {"forward_backward": [], "optim_step": []} for name in runs}
    for name, (run_id, config, _) in runs.items():
        engine.create_adapter(run_id, config)
    for step in range(args.steps + 1):
        for name, (run_id, _, lr) in runs.items():
            start = time.perf_counter()
            engine.forward_backward(run_id, data)
            middle = time.perf_counter()
            engine.optim_step(run_id, AdamParams(learning_rate=lr))
            end = time.perf_counter()
            if step:  # the first is a warm-up
                times[name]["forward_backward"].append(middle - start)
                times[name]["optim_step"].append(end - middle)
    tokens = sum(len(d.tokens) for d in data)
    print(f"{args.examples} chat examples, {tokens} tokens a step, {args.steps} steps; {benchenv.load_line()}, "
          f"{torch.get_num_threads()} threads")
    medians = {name: {k: statistics.median(v) for k, v in kinds.items()} for name, kinds in times.items()}
    for name, kinds in medians.items():
        print(f"  {name:14s} forward_backward {kinds['forward_backward']:.2f} s, optim_step {kinds['optim_step']:.2f} s")
    full, lora = medians["full (rank 0)"], medians["LoRA rank 8"]
    for kind in ("forward_backward", "optim_step"):
        print(f"  ratio full / LoRA, {kind}: {full[kind] / lora[kind]:.1f}x")
    total = sum(full.values()) / sum(lora.values())
    print(f"  ratio full / LoRA, a whole step: {total:.1f}x")
    print(f"  engine memory: {({k: f'{v / 2**20:.0f} MiB' for k, v in engine.memory().items()})}")


if __name__ == "__main__":
    main()
