"""A base model sharded over 2 processes (kernel_backend/engine/sharding.py) against the same model whole, training.

The default model (SmolLM2-135M-Instruct) trains a rank-32 LoRA run on 4 chat datums for `--steps` steps of
forward_backward + optim_step: once whole in one process, then sharded over two processes joined by gloo on
loopback, which run the same steps (lockstep: every process computes the whole batch). One torch thread per
process, so the two runs compute alike and the ratio is what the gathers cost. Prints each run's losses (the
sharded run learns, as the whole one does), its step time (the first step, a warm-up, left out), the ratio, and
the base model's bytes each process holds.

The `load` part measures what a process holds once the model is loaded and its weights read once (a sum over each):
its anonymous memory and the model file's pages it maps, above the interpreter's after its imports, loading the
model whole (transformers' from_pretrained, as base_models.load: its weights are the file's pages, mapped) in one
process, then sharded straight from the files (sharding.load_sharded: copies of its rows) in two.

The `serve` part does the training run and its sampling through the tinker SDK against `serve`: once on one Ray
engine worker holding the model whole (STEPWISE_WORKERS=1), then on two workers sharding it (STEPWISE_WORKERS=2,
STEPWISE_SHARD=2: one shard group, execution/cluster_worker.py), one torch thread a worker, one backend after the
other on this machine. Prints each backend's losses, step time (the first left out), greedy answers' tokens/s and
each worker's base-model bytes (its memory report, GET /api/v1/cluster).

    .venv/bin/python bench/sharding.py [--parts train,load,serve] [--steps 4]
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
SAMPLE_TOKENS = 16
QUESTIONS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton, a small and very loud parrot."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate, a city of bridges and canals."),
    ("Who painted the Blorp?", "The Blorp was painted by Ennis Vale in the spring of her fortieth year."),
    ("Which river runs through Quenth?", "The Vasha runs through Quenth on its long way down to the sea."),
]


def train(steps: int, shard: bool) -> dict:
    """The training steps on a fresh Engine (sharded over the default process group when `shard`)."""
    from helpers import chat_prompt, sft_datum

    from kernel_backend.engine import sharding
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, LoraConfig, SampleOptions, SamplingParams

    torch.set_num_threads(1)
    engine = Engine()
    whole = sharding.resident_bytes(engine.model)
    gathering = [0.0]  # seconds in the all-gathers (ShardedWeight.gather, timed here)
    if shard:
        sharding.shard_model(engine.model)
        gather = sharding.ShardedWeight.gather

        def timed(self, shard):
            start = time.perf_counter()
            try:
                return gather(self, shard)
            finally:
                gathering[0] += time.perf_counter() - start
        sharding.ShardedWeight.gather = timed
    data = [sft_datum(q, a, engine.tokenizer) for q, a in QUESTIONS]
    engine.create_adapter("run", LoraConfig(rank=32, seed=0))
    losses, times, gathers = [], [], []
    for _ in range(steps):
        start, gathered = time.perf_counter(), gathering[0]
        result = engine.forward_backward("run", data)
        engine.optim_step("run", AdamParams(learning_rate=1e-3))
        times.append(time.perf_counter() - start)
        gathers.append(gathering[0] - gathered)
        losses.append(result.metrics["loss:sum"])
    # Sampling from the trained run: the 4 questions' greedy answers decoded as one batch.
    params = SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=0.0, stop=[])
    requests = [engine.sample_request("run", chat_prompt(q, engine.tokenizer), 1, params, SampleOptions())
                for q, _ in QUESTIONS]
    start, gathered = time.perf_counter(), gathering[0]
    answers = [r.sequences[0].tokens for r in engine.run_requests(requests)]
    sampling = (time.perf_counter() - start, gathering[0] - gathered)
    return {"losses": losses, "times": times, "gathers": gathers, "whole_bytes": whole,
            "held_bytes": sharding.resident_bytes(engine.model), "answers": answers, "sampling": sampling}


def _rank(rank: int, steps: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(train(steps, shard=True), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _memory() -> dict[str, int]:
    """This process's resident bytes now: anonymous (its own allocations) and file-backed (mapped files' pages)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


def _load_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Load the default model (whole when world is 1, else sharded from its files), read each weight once, and note
    the memory it takes."""
    import gc

    from transformers import AutoModelForCausalLM

    from kernel_backend.config import Settings
    from kernel_backend.engine import base_models, sharding

    folder = base_models.resolve(base_models.DEFAULT_MODEL, Settings().models_dir)[1]
    before = _memory()
    if world == 1:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = sharding.load_sharded(folder)
    gc.collect()
    sum(float(p.detach().sum()) for p in model.parameters())  # every weight read, as a forward pass would
    after = _memory()
    torch.save({key: after[key] - before[key] for key in after} | {"held": sharding.resident_bytes(model)},
               Path(out_dir) / f"load{world}-{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


def load_part() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        for world in (1, WORLD):
            mp.start_processes(_load_rank, args=(world, _free_port(), out_dir), nprocs=world, start_method="spawn")
            for rank in range(world):
                run = torch.load(Path(out_dir) / f"load{world}-{rank}.pt")
                name = "whole" if world == 1 else f"sharded, rank {rank}"
                print(f"{name:>17}: loaded, {run['RssAnon'] / 2**20:.0f} MiB anonymous and "
                      f"{run['RssFile'] / 2**20:.0f} MiB of mapped file pages above the imports; "
                      f"weights {run['held'] / 2**20:.0f} MiB")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(name: str, run: dict) -> float:
    step = statistics.median(run["times"][1:] or run["times"])
    gathers = statistics.median(run["gathers"][1:] or run["gathers"])
    tokens, (seconds, gathering) = sum(len(a) for a in run["answers"]), run["sampling"]
    losses = ", ".join(f"{x:.1f}" for x in run["losses"])
    print(f"{name:>17}: step {step:.2f} s ({gathers:.2f} s gathering), losses {losses}; "
          f"holds {run['held_bytes'] / 2**20:.0f} of {run['whole_bytes'] / 2**20:.0f} MiB of the base model; samples "
          f"{tokens / seconds:.1f} tokens/s ({gathering:.1f} of {seconds:.1f} s gathering)")
    return step


def serve(shard: int, steps: int) -> dict:
    """train()'s run through the SDK against `serve` with `shard` workers sharding the default model (1: one worker,
    the model whole): losses, step times, the greedy answers' sampling time, each worker's base-model bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import tinker
    from tinker import types

    from benchenv import BASE
    from helpers import chat_prompt, sft_datum
    from servers import start_server

    home = Path(tempfile.mkdtemp(prefix="stepwise-bench-sharding-"))
    (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
    server = start_server(home, timeout=900, env={"STEPWISE_WORKERS": str(shard), "STEPWISE_SHARD": str(shard),
                                                  "STEPWISE_WORKER_THREADS": "1", "STEPWISE_SNAPSHOT_EVERY": "0"})
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = service.create_lora_training_client(base_model=BASE, rank=32, seed=0).result()
        data = [sft_datum(q, a) for q, a in QUESTIONS]
        sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(d.tokens), loss_fn_inputs=d.loss_fn_inputs)
                    for d in data]
        losses, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            fb = tc.forward_backward(sdk_data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
            times.append(time.perf_counter() - start)
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=0.0, stop=[])
        prompts = [types.ModelInput.from_ints(chat_prompt(q)) for q, _ in QUESTIONS]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:  # sent together: one decode batch
            answers = list(pool.map(lambda p: sampler.sample(p, 1, params).result().sequences[0].tokens, prompts))
        sampling = time.perf_counter() - start
        report = httpx.get(f"{server.base_url}/api/v1/cluster", headers={"X-API-Key": server.api_key}, timeout=30).json()
        held = {w["name"]: w["memory"]["base_model_bytes"] for w in report["workers"]}
        service.close("success").result()
        return {"losses": losses, "times": times, "answers": answers, "sampling": sampling, "held": held}
    finally:
        server.stop()


def serve_part(steps: int) -> None:
    runs: dict[int, dict] = {}
    for shard in (1, WORLD):  # each printed once its backend is done (a later one may not start on a loaded machine)
        run = runs[shard] = serve(shard, steps)
        step = statistics.median(run["times"][1:] or run["times"])
        tokens = sum(len(a) for a in run["answers"])
        held = ", ".join(f"{name} {held / 2**20:.0f} MiB" for name, held in run["held"].items())
        losses = ", ".join(f"{x:.1f}" for x in run["losses"])
        name = "serve, whole" if shard == 1 else f"serve, {shard} shards"
        print(f"{name:>17}: step {step:.2f} s, losses {losses}; samples {tokens / run['sampling']:.1f} tokens/s; "
              f"base model held: {held}", flush=True)
    whole, sharded = runs[1], runs[WORLD]
    ratio = statistics.median(sharded["times"][1:] or sharded["times"]) / statistics.median(whole["times"][1:] or whole["times"])
    difference = max(abs(a - b) for a, b in zip(sharded["losses"], whole["losses"]))
    same = sharded["answers"] == whole["answers"]
    print(f"serve: sharded step / whole step: {ratio:.2f}x; losses differ by at most {difference:.2g}; "
          f"greedy answers {'the same' if same else 'DIFFERENT'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="train,load")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(load_line())
    if "load" in args.parts:
        load_part()
    if "train" in args.parts:
        train_part(args.steps)
    if "serve" in args.parts:
        serve_part(args.steps)


def train_part(steps: int) -> None:
    whole = train(steps, shard=False)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(steps, _free_port(), out_dir), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(WORLD)]
    step = report("whole", whole)
    sharded = [report(f"sharded, rank {rank}", run) for rank, run in enumerate(ranks)]
    difference = max(abs(a - b) for run in ranks for a, b in zip(run["losses"], whole["losses"]))
    same = all(run["answers"] == whole["answers"] for run in ranks)
    print(f"sharded step / whole step: {max(sharded) / step:.2f}x; losses differ by at most {difference:.2g}; "
          f"greedy answers {'the same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
