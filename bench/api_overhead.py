"""What the service costs over calling the engine in-process.

Runs, in one script: the same training step (forward_backward + optim_step, batch 8 x 128
tokens, LoRA rank 32 on every linear layer) through the official tinker SDK against a server
process on loopback, and through `Engine` in this process; then the median round trip of a
tiny request (get_info). Prints both ratios. Targets: step ratio <= 1.05, round trip <= 5 ms.

    .venv/bin/python bench/api_overhead.py --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchenv import BASE  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np
from tqdm import tqdm


BATCH, LENGTH, RANK = 8, 128, 32


def batch(vocab: int = 49152) -> list[tuple[list[int], np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(BATCH):
        tokens = rng.integers(0, vocab, size=LENGTH + 1)
        rows.append((tokens[:-1].tolist(), tokens[1:].astype(np.int64)))
    return rows


def time_steps(step, steps: int, label: str) -> float:
    step()  # warm-up
    times = []
    for _ in tqdm(range(steps), desc=label):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sdk_step_time(base_url: str, api_key: str, steps: int) -> tuple[float, str]:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=RANK, seed=0).result()
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": targets})
        for tokens, targets in batch()
    ]

    def step():
        fb = tc.forward_backward(data, "cross_entropy")
        optim = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(), optim.result()

    return time_steps(step, steps, "SDK -> server"), tc.model_id


def engine_step_time(steps: int) -> float:
    from kernel_backend.engine.core import Engine
    from kernel_backend.types import AdamParams, Datum, LoraConfig

    engine = Engine(BASE)
    engine.create_adapter("bench", LoraConfig(rank=RANK, seed=0))
    data = [Datum(tokens, {"target_tokens": targets}) for tokens, targets in batch()]

    def step():
        engine.forward_backward("bench", data, "cross_entropy")
        engine.optim_step("bench", AdamParams(learning_rate=1e-4))

    return time_steps(step, steps, "in-process engine")


def round_trip_ms(base_url: str, api_key: str, model_id: str, calls: int = 200) -> float:
    import httpx

    with httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}) as http:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            http.post("/api/v1/get_info", json={"model_id": model_id}).raise_for_status()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    from servers import start_server

    home = Path(tempfile.mkdtemp(prefix="stepwise-bench-"))
    (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models")
    server = start_server(home)
    try:
        sdk, model_id = sdk_step_time(server.base_url, server.api_key, args.steps)
        rtt = round_trip_ms(server.base_url, server.api_key, model_id)
    finally:
        server.stop()
    local = engine_step_time(args.steps)
    tokens = BATCH * LENGTH
    print(f"training step, median of {args.steps}: SDK->server {sdk:.3f} s ({tokens / sdk:.0f} tok/s), "
          f"in-process {local:.3f} s ({tokens / local:.0f} tok/s)")
    print(f"step ratio (server / in-process): {sdk / local:.3f}   target <= 1.05")
    print(f"loopback round trip (get_info), median of 200: {rtt:.2f} ms   target <= 5 ms")


if __name__ == "__main__":
    main()
