"""Scale-out: four training clients on one engine worker against the same four on two (kernel_backend/execution/cluster.py).

Two parts, each printing a ratio measured in this one run:

- throughput: four concurrent official-SDK training clients (rank 32, each its own data: 4 chat datums
              a step), warmed up with one step, then `--steps` steps of forward_backward + optim_step each;
              aggregate train tokens/s on a backend with one Ray worker, then on one with two (one torch
              thread per worker in both), started one after the other on this machine.
                                                                          Target: >= 1.6x on 2 cores.
- snapshot:   what an automatic snapshot (engine_work.optim_step's save of weights + AdamW state to the checkpoint
              store, which recovery restores from) costs against a training step, in this process on the
              engine: rank 32, a step of 4 x ~128 tokens. Prints what snapshots every 1, 5 and 10 steps cost
              and the interval that keeps it under 1% of training time (STEPWISE_SNAPSHOT_EVERY's default).

    .venv/bin/python bench/cluster.py [--parts throughput,snapshot] [--steps 3]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchenv import BASE  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

from tqdm import tqdm  # noqa: E402


QUESTIONS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton, a small and very loud parrot."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate, a city of bridges and canals."),
    ("Who painted the Blorp?", "The Blorp was painted by Ennis Vale in the spring of her fortieth year."),
    ("Which river runs through Quenth?", "The Vasha runs through Quenth on its long way down to the sea."),
]


def home() -> Path:
    """A fresh backend home sharing this machine's converted models."""
    folder = Path(tempfile.mkdtemp(prefix="stepwise-bench-cluster-"))
    (folder / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
    return folder


def client_data(i: int):
    from tinker import types

    from helpers import sft_datum

    data = [sft_datum(q, a) for q, a in QUESTIONS[i:] + QUESTIONS[:i]]
    return [types.Datum(model_input=types.ModelInput.from_ints(d.tokens), loss_fn_inputs=d.loss_fn_inputs) for d in data]


def throughput(workers: int, steps: int) -> float:
    """Aggregate train tokens/s of four concurrent clients on a backend with `workers` Ray workers."""
    import tinker
    from tinker import types

    from servers import start_server

    server = start_server(home(), timeout=900, env={"STEPWISE_WORKERS": str(workers), "STEPWISE_WORKER_THREADS": "1",
                                                    "STEPWISE_SNAPSHOT_EVERY": "0"})
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        clients = [service.create_lora_training_client(base_model=BASE, rank=32, seed=i).result() for i in range(4)]
        datasets = [client_data(i) for i in range(4)]
        tokens = sum(d.model_input.length for data in datasets for d in data) * steps

        def train(i: int, n: int) -> None:
            for _ in range(n):
                fb = clients[i].forward_backward(datasets[i], "cross_entropy")
                clients[i].optim_step(types.AdamParams(learning_rate=1e-4)).result()
                fb.result()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: train(i, 1), range(4)))  # warm-up
            start = time.perf_counter()
            list(pool.map(lambda i: train(i, steps), range(4)))
            elapsed = time.perf_counter() - start
        service.close("success").result()  # its heartbeats stop before the server does
        return tokens / elapsed
    finally:
        server.stop()


def snapshot_cost(repeats: int) -> tuple[float, float]:
    """(seconds of one training step, seconds of one automatic snapshot), medians, on this process's engine."""
    from kernel_backend.execution import engine_work
    from kernel_backend.config import Settings
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, LoraConfig

    from helpers import sft_datum

    settings = Settings(home=home())
    engine, ctx = Engine(settings=settings), engine_work.Context.of(settings)
    engine.create_adapter("run", LoraConfig(rank=32, seed=0))
    data = [sft_datum(q, a + " " + a + " " + a) for q, a in QUESTIONS]  # about 128 tokens each
    params = AdamParams(learning_rate=1e-4)
    steps, snapshots = [], []
    for _ in tqdm(range(repeats), desc="snapshot vs step"):
        start = time.perf_counter()
        engine.forward_backward("run", data)
        engine_work.optim_step(engine, ctx, "run", params)
        steps.append(time.perf_counter() - start)
        engine.forward_backward("run", data)
        start = time.perf_counter()
        engine_work.optim_step(engine, ctx, "run", params, snapshot_key="t/run/snapshot", snapshot_every=1)
        with_snapshot = time.perf_counter() - start
        start = time.perf_counter()
        engine_work.optim_step(engine, ctx, "run", params)  # no gradients: the step alone, to subtract
        snapshots.append(with_snapshot - (time.perf_counter() - start))
    return statistics.median(steps), statistics.median(snapshots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="throughput,snapshot")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parts = args.parts.split(",")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    if "throughput" in parts:
        rates = {}
        for workers in tqdm([1, 2], desc="backends (1 worker, 2 workers)"):
            rates[workers] = throughput(workers, args.steps)
        print(f"throughput: four clients, {args.steps} steps each: one worker {rates[1]:.0f} train tokens/s, "
              f"two workers {rates[2]:.0f} train tokens/s: {rates[2] / rates[1]:.2f}x")
    if "snapshot" in parts:
        step_s, snapshot_s = snapshot_cost(args.repeats)
        costs = ", ".join(f"every {n}: {snapshot_s / (n * step_s):.1%}" for n in (1, 5, 10))
        every = math.ceil(snapshot_s / (0.01 * step_s))
        print(f"snapshot: a training step {step_s:.2f} s, an automatic snapshot {snapshot_s * 1000:.0f} ms; of training "
              f"time, snapshots {costs}; every {every} steps or more keeps it under 1%")


if __name__ == "__main__":
    main()
