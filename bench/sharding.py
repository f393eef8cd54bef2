"""A base model sharded over 2 processes (kernel_backend/engine/sharding.py) against the same model whole, training.

The default model (SmolLM2-135M-Instruct) trains a rank-32 LoRA run on 4 chat datums for `--steps` steps of
forward_backward + optim_step: once whole in one process, then sharded over two processes joined by gloo on
loopback, which run the same steps (lockstep: every process computes the whole batch). One torch thread per
process, so the two runs compute alike and the ratio is what the gathers cost. Prints each run's losses (the
sharded run learns, as the whole one does), its step time (the first step, a warm-up, left out), the ratio, and
the base model's bytes each process holds.

    .venv/bin/python bench/sharding.py [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchenv import load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
QUESTIONS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton, a small and very loud parrot."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate, a city of bridges and canals."),
    ("Who painted the Blorp?", "The Blorp was painted by Ennis Vale in the spring of her fortieth year."),
    ("Which river runs through Quenth?", "The Vasha runs through Quenth on its long way down to the sea."),
]


def train(steps: int, shard: bool) -> dict:
    """The training steps on a fresh Engine (sharded over the default process group when `shard`)."""
    from helpers import sft_datum

    from kernel_backend.engine import sharding
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, LoraConfig

    torch.set_num_threads(1)
    engine = Engine()
    whole = sharding.resident_bytes(engine.model)
    if shard:
        sharding.shard_model(engine.model)
    data = [sft_datum(q, a, engine.tokenizer) for q, a in QUESTIONS]
    engine.create_adapter("run", LoraConfig(rank=32, seed=0))
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        result = engine.forward_backward("run", data)
        engine.optim_step("run", AdamParams(learning_rate=1e-3))
        times.append(time.perf_counter() - start)
        losses.append(result.metrics["loss:sum"])
    return {"losses": losses, "times": times, "whole_bytes": whole, "held_bytes": sharding.resident_bytes(engine.model)}


def _rank(rank: int, steps: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(train(steps, shard=True), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(name: str, run: dict) -> float:
    step = statistics.median(run["times"][1:] or run["times"])
    print(f"{name:>17}: step {step:.2f} s, losses {', '.join(f'{x:.1f}' for x in run['losses'])}; "
          f"holds {run['held_bytes'] / 2**20:.0f} of {run['whole_bytes'] / 2**20:.0f} MiB of the base model")
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(load_line())
    whole = train(args.steps, shard=False)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(args.steps, _free_port(), out_dir), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(WORLD)]
    step = report("whole", whole)
    sharded = [report(f"sharded, rank {rank}", run) for rank, run in enumerate(ranks)]
    difference = max(abs(a - b) for run in ranks for a, b in zip(run["losses"], whole["losses"]))
    print(f"sharded step / whole step: {max(sharded) / step:.2f}x; losses differ by at most {difference:.2g}")


if __name__ == "__main__":
    main()
