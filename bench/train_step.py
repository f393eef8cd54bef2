"""One LoRA training step: the Stepwise engine against the same step written by hand with PEFT.

Both sides train the default model (SmolLM2-135M-Instruct, fp32) with a rank-32 LoRA (alpha 32) on
Tinker's default targets: attention (q, k, v, o), MLP (gate, up, down) and the unembedding
(lm_head). One step is forward + backward of a summed token cross-entropy over a batch of
8 x 128 tokens, then one AdamW step (Tinker's defaults: betas 0.9 / 0.95, eps 1e-12).

- ours:     Engine.forward_backward(cross_entropy) + Engine.optim_step
- baseline: transformers + peft, written the idiomatic way: get_peft_model(LoraConfig(...)),
            logits = model(input_ids).logits, F.cross_entropy(..., reduction="sum"), backward,
            torch.optim.AdamW.step, zero_grad.

Both run in the same process on the same data, interleaved step by step so that machine noise
hits both alike; one warm-up step each is not timed. Absolute speeds are noise on a shared
2-core machine: the ratio (ours / baseline, higher is better) is the figure to report.

With --sessions N, another comparison instead: N sessions (each its own adapter) send a forward_backward
of batch / N rows each; the engine runs them as one batch (run_passes, per-row LoRA routing)
against the same passes one after another (one adapter at a time). Each session's loss must be
the same either way; the ratio is batched over one-after-another.

    python bench/train_step.py [--steps 3] [--batch 8] [--seq 128] [--rank 32] [--threads N] [--profile]
    python bench/train_step.py --varied [--batch 32 --seq 64 --rank 8]   # rows of different lengths, as in RL
    python bench/train_step.py --sessions 4 [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)


import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kernel_backend.engine.core import Engine, Pass  # noqa: E402
from kernel_backend.types import AdamParams, Datum, LoraConfig  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def make_batch(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """Token ids (batch, seq + 1); position i predicts i + 1. Random ids cost the same as text."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


class Ours:
    name = "stepwise engine"

    def __init__(self, engine: Engine, rank: int, ids: torch.Tensor, lengths: list[int], adam: AdamParams) -> None:
        self.engine = engine
        self.adapter = "bench"
        engine.create_adapter(self.adapter, LoraConfig(rank=rank, alpha=float(rank), seed=0))
        self.data = [
            Datum(tokens=row[:n].tolist(), loss_fn_inputs={"target_tokens": row[1 : n + 1].numpy().astype(np.int64)})
            for row, n in zip(ids, lengths)
        ]
        self.adam = adam

    def step(self) -> float:
        result = self.engine.forward_backward(self.adapter, self.data, "cross_entropy")
        self.engine.optim_step(self.adapter, self.adam)
        return result.metrics["loss:sum"]


class PeftBaseline:
    name = "transformers+peft"

    def __init__(self, model_dir: Path, rank: int, ids: torch.Tensor, lengths: list[int], adam: AdamParams) -> None:
        import warnings

        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = PeftLoraConfig(
            r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")  # lm_head is tied; fine
            self.model = get_peft_model(base, config)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
            weight_decay=adam.weight_decay, foreach=True,
        )
        # Rows shorter than the batch are right-padded: masked in attention, ignored by the loss.
        real = torch.arange(ids.shape[1] - 1)[None, :] < torch.tensor(lengths)[:, None]
        self.inputs, self.targets = ids[:, :-1].contiguous(), ids[:, 1:].masked_fill(~real, -100)
        self.mask = real.long() if not bool(real.all()) else None

    def step(self) -> float:
        logits = self.model(input_ids=self.inputs, attention_mask=self.mask).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), self.targets.reshape(-1), reduction="sum")
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def bench_sessions(engine: Engine, ids: torch.Tensor, sessions: int, rank: int, steps: int) -> None:
    """N sessions' forward_backward passes in one batch against the same passes one after another."""
    per = len(ids) // sessions
    passes = []
    for i in range(sessions):
        name = f"session{i}"
        engine.create_adapter(name, LoraConfig(rank=rank, alpha=float(rank), seed=i + 1))
        rows = ids[i * per : (i + 1) * per]
        passes.append(Pass(name, [Datum(tokens=row[:-1].tolist(), loss_fn_inputs={"target_tokens": row[1:].numpy().astype(np.int64)})
                                  for row in rows]))

    def clear() -> None:  # gradients accumulate until optim_step: start each side from none
        for p in passes:
            for param in engine.slots[p.adapter_id].adapter.parameters():
                param.grad = None

    sides = {"one batch": lambda: engine.run_passes(passes),
             "one after another": lambda: [engine.run_passes([p])[0] for p in passes]}
    losses = {}
    for name, run in sides.items():  # warm-up; the sessions' losses must agree
        losses[name] = [r.metrics["loss:sum"] for r in run()]
        clear()
    if not np.allclose(losses["one batch"], losses["one after another"], rtol=1e-4):
        sys.exit(f"batched and one-after-another losses differ: {losses}")
    times: dict[str, list[float]] = {name: [] for name in sides}
    load_before = os.getloadavg()[0]
    for i in tqdm(range(steps), desc=f"{sessions} sessions (interleaved)"):
        for name in sides if i % 2 == 0 else reversed(sides):
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
            clear()
    tokens = per * sessions * (ids.shape[1] - 1)
    print(f"\n[sessions] {sessions} sessions x {per} rows, forward_backward only (optim_step is per session either way)")
    for name in sides:
        print(f"  {name:<20}{tokens / statistics.median(times[name]):>8.1f} tokens/s (median)  "
              + " ".join(f"{t:.2f}" for t in times[name]))
    ratio = statistics.median(times["one after another"]) / statistics.median(times["one batch"])
    print(f"  ratio one batch / one after another: {ratio:.3f}   (load average {load_before:.2f} -> {os.getloadavg()[0]:.2f})")


def profile(runner, label: str, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()
    print(f"\n--- profile: {label} ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (after 1 warm-up step)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one step of each side")
    parser.add_argument("--varied", action="store_true",
                        help="rows of random lengths from seq/2 to seq (padded for PEFT), as RL batches are")
    parser.add_argument("--sessions", type=int, default=0,
                        help="instead: N sessions' passes in one batch against one after another")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    adam = AdamParams(learning_rate=1e-4)
    engine = Engine()
    ids = make_batch(engine.vocab_size, args.batch, args.seq, args.seed)
    if args.sessions:
        bench_sessions(engine, ids, args.sessions, args.rank, args.steps)
        return
    lengths = (np.random.default_rng(args.seed).integers(args.seq // 2, args.seq + 1, args.batch).tolist()
               if args.varied else [args.seq] * args.batch)
    tokens = sum(lengths)
    ours = Ours(engine, args.rank, ids, lengths, adam)
    baseline = PeftBaseline(engine.base.path, args.rank, ids, lengths, adam)
    runners = [ours, baseline]

    print(
        f"model {engine.base.name} fp32 | LoRA rank {args.rank} on {'+'.join(TARGETS)} | "
        f"batch {args.batch} x {'up to ' if args.varied else ''}{args.seq} = {tokens} tokens/step | torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )
    # Warm-up (not timed). Every LoRA B starts at zero, so both first losses are the base
    # model's summed cross-entropy on the same tokens: a check that both compute the same thing.
    first = {r.name: r.step() for r in tqdm(runners, desc="warm-up", leave=False)}
    print("warm-up loss (same data, B = 0): " + ", ".join(f"{k} {v:.3f}" for k, v in first.items()))
    if abs(first[ours.name] - first[baseline.name]) > 1e-3 * abs(first[baseline.name]):
        sys.exit("the two sides disagree on the loss: the comparison would be meaningless")

    times: dict[str, list[float]] = {r.name: [] for r in runners}
    load_before = os.getloadavg()[0]
    for i in tqdm(range(args.steps), desc="timed steps (interleaved)"):
        for r in runners if i % 2 == 0 else reversed(runners):
            start = time.perf_counter()
            r.step()
            times[r.name].append(time.perf_counter() - start)
    load_after = os.getloadavg()[0]

    def rate(name: str, pick) -> float:
        return tokens / pick(times[name])

    print(f"\n{'':<20}{'tokens/s (mean)':>18}{'tokens/s (median)':>20}  step times (s)")
    for r in runners:
        print(
            f"{r.name:<20}{rate(r.name, statistics.mean):>18.1f}{rate(r.name, statistics.median):>20.1f}  "
            + " ".join(f"{t:.2f}" for t in times[r.name])
        )
    mean_ratio = rate(ours.name, statistics.mean) / rate(baseline.name, statistics.mean)
    median_ratio = rate(ours.name, statistics.median) / rate(baseline.name, statistics.median)
    print(f"ratio ours / baseline: {mean_ratio:.3f} (mean step), {median_ratio:.3f} (median step)")
    print(f"load average 1 min: {load_before:.2f} before, {load_after:.2f} after (over {os.cpu_count()} cpus)")

    if args.profile:
        for r in runners:
            profile(r, r.name)


if __name__ == "__main__":
    main()
