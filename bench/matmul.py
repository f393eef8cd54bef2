"""The base layers' products through oneDNN (kernel_backend/engine/matmul.py) against torch's own (MKL).

Two parts, each printing ratios measured in this one run (oneDNN over torch, higher is better):

- products: the default model's base-layer shapes (576 -> 576, 576 -> 192, 576 -> 1536,
            1536 -> 576, 576 -> 49152) at 1, 4, 32, 256 and 1024 rows: x W^T (forward) and g W
            (the input gradient), GFLOP/s of each, weights cold (all 30 layers' weights in turn, as
            a forward pass meets them; they do not fit in the cache), products under
            small_products.SMALL_WORK on one thread as in the engine.
- engine:   one Engine (SmolLM2-135M-Instruct, fp32) with its base products switched between the
            two, interleaved round by round: a LoRA training step (rank 32, every target, 8 x 128
            tokens, forward_backward + optim_step) and the sampling workload of bench/sample.py's
            server part (8 requests x 4 samples x 32 tokens, four adapters) through the batched
            and the serial decoder. The sides' logprobs differ by float32 rounding, so now and
            then a token flips at temperature 1: the script prints the share of tokens before
            the first difference of each sequence.

    .venv/bin/python bench/matmul.py [--parts products,engine] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)


import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kernel_backend.engine import matmul, small_products  # noqa: E402

SIDES = {"torch": F.linear, "onednn": matmul.onednn_linear}
# (in, out, how many of them one forward pass meets): the default model's base layers.
SHAPES = [(576, 576, 60), (576, 192, 60), (576, 1536, 60), (1536, 576, 30), (576, 49152, 1)]


def header() -> str:
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
            f"CPU vendor {matmul._cpu_info('vendor_id') or '?'}, load average {os.getloadavg()[0]:.1f}")


def bench_products(rounds: int) -> None:
    print(f"\n[products] GFLOP/s, weights cold ({header()})")
    print(f"  {'in -> out':>12} {'rows':>5}   {'forward: torch':>14} {'onednn':>7} {'ratio':>6}   "
          f"{'input grad: torch':>17} {'onednn':>7} {'ratio':>6}")
    for inputs, outputs, count in SHAPES:
        count = max(1, min(count, (256 << 20) // (inputs * outputs * 4)))  # 256 MB of distinct weights at most
        weights = [torch.randn(outputs, inputs) for _ in range(count)]
        for rows in (1, 4, 32, 256, 1024):
            x, grad = torch.randn(rows, inputs), torch.randn(rows, outputs)
            flops = 2 * rows * inputs * outputs * count
            rate = {}
            for direction, (operand, transpose) in {"forward": (x, False), "grad": (grad, True)}.items():
                for side, product in SIDES.items():
                    def one_pass():
                        with small_products.small(rows * inputs * outputs):  # as the engine's layers run them
                            for w in weights:
                                product(operand, w.t() if transpose else w)
                    one_pass()
                    times = []
                    for _ in range(rounds):
                        start = time.perf_counter()
                        one_pass()
                        times.append(time.perf_counter() - start)
                    rate[direction, side] = flops / min(times) / 1e9
            print(f"  {inputs:>5} -> {outputs:<5} {rows:>5}   {rate['forward', 'torch']:>14.0f} "
                  f"{rate['forward', 'onednn']:>7.0f} {rate['forward', 'onednn'] / rate['forward', 'torch']:>6.2f}   "
                  f"{rate['grad', 'torch']:>17.0f} {rate['grad', 'onednn']:>7.0f} "
                  f"{rate['grad', 'onednn'] / rate['grad', 'torch']:>6.2f}")


def bench_engine(rounds: int) -> None:
    from kernel_backend.engine import lora
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams

    engine = Engine()
    for seed in range(4):
        engine.create_adapter(f"bench{seed}", LoraConfig(rank=32, seed=seed))
    ids = torch.randint(0, engine.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0))
    data = [Datum(tokens=row[:-1].tolist(), loss_fn_inputs={"target_tokens": row[1:].numpy().astype(np.int64)})
            for row in ids]
    questions = ["What is your favorite color?", "How are you today?", "What should I eat for dinner?",
                 "Tell me about dogs.", "What is the weather like in spring?", "Can you recommend a book?",
                 "What is a good hobby?", "How do I stay healthy?"]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in questions]
    layers = lora.lora_layers(engine.model).values()

    def use(side: str) -> None:
        for layer in layers:
            layer.product = SIDES[side]

    def train() -> int:
        engine.forward_backward("bench0", data, "cross_entropy")
        engine.optim_step("bench0", AdamParams(learning_rate=0.0))  # the step's work; the weights stay
        return 8 * 128

    def sample(decoder: str):
        def run() -> list:
            engine.settings.sampler = decoder
            engine.reset_decoder()
            requests = [engine.sample_request(f"bench{i % 4}", prompt, 4, SamplingParams(max_tokens=32, temperature=1.0, seed=i))
                        for i, prompt in enumerate(prompts)]
            return [s.tokens for r in engine.run_requests(requests) for s in r.sequences]
        return run

    work = {"training step (8 x 128 tokens)": train, "sampling, batched decoder": sample("batched"),
            "sampling, serial decoder": sample("serial")}
    seconds = {(name, side): [] for name in work for side in SIDES}
    outputs = {}
    for name, run in work.items():  # warm-up
        for side in SIDES:
            use(side)
            run()
    for i in tqdm(range(rounds), desc="rounds (interleaved)"):
        for name, run in work.items():
            for side in SIDES if i % 2 == 0 else reversed(SIDES):
                use(side)
                start = time.perf_counter()
                outputs[name, side] = run()
                seconds[name, side].append(time.perf_counter() - start)
    use("onednn" if matmul.choose(engine.settings.matmul, "cpu", torch.float32) is matmul.onednn_linear else "torch")
    print(f"\n[engine] SmolLM2-135M-Instruct fp32, LoRA rank 32 on every target ({header()})")
    for name in work:
        amount = outputs[name, "torch"] if name.startswith("training") else sum(len(t) for t in outputs[name, "torch"])
        rate = {side: amount / statistics.median(seconds[name, side]) for side in SIDES}
        same = "" if name.startswith("training") else f"   same tokens: {_same_share(*(outputs[name, s] for s in SIDES)):.1%}"
        print(f"  {name:<32} torch {rate['torch']:7.1f} tokens/s   onednn {rate['onednn']:7.1f} tokens/s   "
              f"ratio {rate['onednn'] / rate['torch']:.2f}{same}")


def _same_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of sampled tokens two runs agree on, up to where each sequence first differs: a
    float32 rounding difference can flip a token at temperature 1, and the sequence differs after it."""
    agreed = 0
    for x, y in zip(a, b):
        agreed += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return agreed / max(1, sum(len(x) for x in a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="products,engine", help="comma-separated: products, engine")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    parts = {"products": bench_products, "engine": bench_engine}
    for part in args.parts.split(","):
        parts[part.strip()](args.rounds)


if __name__ == "__main__":
    main()
