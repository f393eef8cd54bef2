"""Memory: where the embedded backend's resident memory goes, at start, after one run, after a long run.

One `python -m kernel_backend serve` (STEPWISE_EMBEDDED=1, the backend workbench.connect() starts on a laptop)
per side, driven through the official tinker SDK:

- start: the server answered /healthz and sat idle 3 s (no model loaded yet);
- one run: a LoRA rank-8 SFT run of 10 steps (8 datums of ~128 tokens a step), then a sampler and 8 samples of
  32 tokens, as a quickstart notebook does; then idle 3 s;
- long run: bench/soak.py's RL loop for --steps steps (default 200) with a sampler per step, on a second run;
  then idle 3 s.

At each point: the server's RSS idle, and the highest RSS seen while the phase ran (sampled every 0.2 s);
and, where the backend reports it (GET /api/v1/cluster, Engine.memory()), what holds it: the base model, the
resident adapters (the adapter cache's count: a run's weights, gradients and AdamW state; samplers' weights),
the copies of recent steps (engine/step_history.py), the sampler's KV cache and prefix cache. The rest is the
interpreter and its libraries (torch alone is ~220 MB), tokenizers, the database, and memory the allocator
keeps.

Sides: "before" is the backend of commit BEFORE (a git worktree), "after" this checkout, one after the other
in this script.

    .venv/bin/python bench/memory.py                    # both sides, 200 steps each: ~45 minutes on 2 cores
    .venv/bin/python bench/memory.py --steps 20 --only after
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchenv import BASE, REPO, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import httpx  # noqa: E402

BEFORE = "65c81cd"  # the last commit before the memory work of issue 42
SIDES = ("before", "after")
MODELS = Path.home() / ".cache" / "stepwise" / "models"
MiB = 1 << 20
IDLE_S = 3.0


class PeakWatcher:
    """The highest RSS of a process while a phase runs (polled every 0.2 s)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        from soak import rss_bytes

        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def breakdown(server) -> dict[str, int] | None:
    """The engine's own account (Engine.memory(), summed over base models), None where the backend has none."""
    reply = httpx.get(f"{server.base_url}/api/v1/cluster", headers={"X-API-Key": server.api_key}, timeout=30)
    if reply.status_code != 200:
        return None
    total: dict[str, int] = {}
    for worker in reply.json().get("workers", []):
        for engine in (worker.get("memory") or {}).values():
            for what, nbytes in engine.items():
                total[what] = total.get(what, 0) + nbytes
    return total or None


def point(server, name: str, peak: int | None) -> dict:
    from soak import rss_bytes

    time.sleep(IDLE_S)
    row = {"point": name, "rss": rss_bytes(server.process.pid), "peak": peak, "held": breakdown(server)}
    held = row["held"] or {}
    parts = ", ".join(f"{k.removesuffix('_bytes')} {v / MiB:.0f}" for k, v in held.items())
    peak_text = f"{peak / MiB:.0f}" if peak else "-"
    print(f"  {name:<10} idle {row['rss'] / MiB:6.0f} MiB   peak {peak_text:>6} MiB   {parts}", flush=True)
    return row


def one_run(service_client) -> None:
    """A quickstart-sized SFT run, a sampler, a few samples."""
    from tinker import types

    training_client = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    tokenizer = training_client.get_tokenizer()
    text = " ".join(f"Fact {i}: the number after {i} is {i + 1}." for i in range(12))
    ids = tokenizer.encode(text)[:129]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    for _ in range(10):
        training_client.forward_backward([datum] * 8, "cross_entropy").result()
        training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = training_client.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints(ids[:16]), 8, types.SamplingParams(max_tokens=32, temperature=1.0)).result()


def run_side(name: str, repo: Path, steps: int) -> list[dict]:
    import tinker
    from servers import start_server
    from soak import make_clients, run_soak

    MODELS.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix=f"stepwise-memory-{name}-"))
    (home / "models").symlink_to(MODELS, target_is_directory=True)
    server = start_server(home, env={"STEPWISE_EMBEDDED": "1"}, timeout=300, repo=repo)
    print(f"{name}: {repo} (pid {server.process.pid})", flush=True)
    try:
        rows = [point(server, "start", None)]
        service_client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        with PeakWatcher(server.process.pid) as watch:
            one_run(service_client)
        rows.append(point(server, "one run", watch.peak))
        with PeakWatcher(server.process.pid) as watch:
            service_client, training_client = make_clients(server)
            run_soak(service_client, training_client, steps, server=server, check_old_every=0)
        rows.append(point(server, f"{steps} steps", watch.peak))
        return rows
    finally:
        server.stop()


def worktree(commit: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"stepwise-bench-{commit}-")) / "repo"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                   capture_output=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SIDES, help="run one side")
    parser.add_argument("--steps", type=int, default=200, help="the long run's steps")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    results = {}
    for name in [args.only] if args.only else SIDES:
        repo = REPO if name == "after" else worktree(BEFORE)
        try:
            results[name] = run_side(name, repo, args.steps)
        finally:
            if name == "before":
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(repo)], capture_output=True)
    if len(results) == 2:
        print(f"\nafter / before, idle RSS ({load_line()}):")
        for before, after in zip(results["before"], results["after"]):
            print(f"  {after['point']:<10} {before['rss'] / MiB:6.0f} -> {after['rss'] / MiB:6.0f} MiB = "
                  f"{after['rss'] / before['rss']:.2f}" + (f"   peak {before['peak'] / MiB:.0f} -> {after['peak'] / MiB:.0f} MiB"
                                                          if before["peak"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
