"""What keeping every step costs: one training step with the step history on against the same step with it off.

The engine copies a run's adapter and optimizer state after each optim_step (kernel_backend/engine/step_history.py),
so that any recent step can be forked from. This measures that copy where it hurts most, a rank-32 LoRA
on every target of the default model (SmolLM2-135M-Instruct, fp32, AdamW), at two batch sizes: a
full one (8 x 128 tokens) and a tiny one (1 x 32), where the step is short and the copy weighs most.
Two adapters, one with the history and one without, take their steps interleaved on the same data in
the same process; one warm-up step each is not timed. The ratio (with / without, lower is better,
1.00 is free) is the figure to report.

    python bench/step_history.py [--steps 5] [--rank 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchenv  # noqa: E402, F401 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kernel_backend.engine.core import Engine  # noqa: E402
from kernel_backend.engine.step_history import StepHistory  # noqa: E402
from kernel_backend.types import AdamParams, Datum, LoraConfig  # noqa: E402


def batch(rows: int, seq: int, rng) -> list[Datum]:
    tokens = rng.integers(5, 20000, size=(rows, seq + 1))
    return [Datum(tokens=list(map(int, t[:-1])), loss_fn_inputs={"target_tokens": t[1:]}) for t in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    engine = Engine()
    kept, plain = StepHistory(per_run=8, budget_bytes=1 << 34), StepHistory(per_run=0, budget_bytes=0)
    config = LoraConfig(rank=args.rank, seed=0, train_unembed=True)
    rng = np.random.default_rng(0)
    for rows, seq in ((8, 128), (1, 32)):
        data = batch(rows, seq, rng)
        times = {"history on": [], "history off": []}
        ids = {"history on": f"on-{rows}", "history off": f"off-{rows}"}
        for history, name in ((kept, "history on"), (plain, "history off")):
            engine.history = history
            engine.create_adapter(ids[name], config)
        for step in tqdm(range(args.steps + 1), desc=f"{rows} x {seq}"):
            for history, name in ((kept, "history on"), (plain, "history off")):
                engine.history = history
                start = time.perf_counter()
                engine.forward_backward(ids[name], data)
                engine.optim_step(ids[name], AdamParams(learning_rate=1e-4))
                if step:  # the first step of each is a warm-up
                    times[name].append(time.perf_counter() - start)
        on, off = statistics.median(times["history on"]), statistics.median(times["history off"])
        copy = kept.runs[ids["history on"]][max(kept.runs[ids["history on"]])].nbytes
        print(f"batch {rows} x {seq}, rank {args.rank}: step with history {on * 1000:.0f} ms, without "
              f"{off * 1000:.0f} ms, ratio {on / off:.3f} (a kept step is {copy / 2**20:.0f} MB)")


if __name__ == "__main__":
    main()
