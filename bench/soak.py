"""Soak: a long RL-shaped run through the official tinker SDK against one server process, watched for drift.

Every step, as Tinker's docs write an RL loop: `sample` 16 rows (4 prompts x num_samples 4, max_tokens
16, temperature 1, a seed each) from the current sampling client; rewards computed here (deterministic:
the share of even token ids), advantages = reward - the prompt's group mean; one `forward_backward`
with loss_fn="importance_sampling" (target_tokens, the sampler's logprobs, advantages) and one
`optim_step`; then `save_weights_for_sampler(name=f"step-{i}")` and
`service_client.create_sampling_client(model_path=...)`: the new sampler makes the next step's rollouts.
`save_state` every 20 steps. LoRA rank 8.

Each new sampler scores a fixed sequence (`compute_logprobs`) when it is made; every K steps
(--check-old-every) the sampler of step 1 and a random older one score it again, and must give the same
logprobs (max |difference| <= --tol): old samplers must stay usable and exact after the server evicts
and reloads their adapters.

Printed, each against a baseline taken in the same run: the median step wall time of the last 20 steps
over the first 20 (goal <= 1.1); the server process's resident memory after the last step over after
step 20 (goal within 10 %); the growth per step of the database (stepwise.db and its -wal) and of the
checkpoint folder, against the size of one sampler checkpoint; the old samplers' mismatches (goal 0);
and the operator's GET /api/v1/admin/stats (adapters held, the adapter cache) at the end.

The server starts as bench/*.py start theirs (tests/servers.py, a fresh STEPWISE_HOME with the models
folder linked from ~/.cache/stepwise/models); this process's environment passes through
(STEPWISE_ADAPTER_CACHE_MB=..., ...). STEPWISE_EMBEDDED is the environment's, else 0 (per-tenant caps
on, as a shared server). Exit status: 1 on any exception (the SDK's included, shown), 2 when an old
sampler mismatched, else 0.

    .venv/bin/python bench/soak.py --steps 25
    STEPWISE_EMBEDDED=1 .venv/bin/python bench/soak.py --steps 200 --json /tmp/soak.json

Imported (a test): `start_soak_server()`, `make_clients(server)`, `run_soak(service_client,
training_client, steps, server=server, ...)` -> a dict (keys in run_soak's docstring), `report(result)`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchenv import BASE, load_line  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import numpy as np  # noqa: E402


MODELS = Path.home() / ".cache" / "stepwise" / "models"
QUESTIONS = [
    "What is your favorite color?", "How are you today?", "What should I eat for dinner?", "Tell me about dogs.",
    "What is the weather like in spring?", "Can you recommend a book?", "What is a good hobby?",
    "How do I stay healthy?",
]
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Stepwise keeps every sampler it ever made."
MiB = 1 << 20


# ---- the server and what it holds ---------------------------------------------------------------------------


def start_soak_server(env: dict[str, str] | None = None, timeout: float = 300):
    """A `python -m kernel_backend serve` process on loopback (tests/servers.py's Server), in a fresh
    STEPWISE_HOME whose models folder links to ~/.cache/stepwise/models. This process's environment passes
    through; STEPWISE_EMBEDDED is the environment's (default 0: a shared server's caps); `env` wins over both."""
    from servers import start_server

    MODELS.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="stepwise-soak-"))
    (home / "models").symlink_to(MODELS, target_is_directory=True)
    return start_server(home, env={"STEPWISE_EMBEDDED": os.environ.get("STEPWISE_EMBEDDED", "0"), **(env or {})},
                        timeout=timeout)


def make_clients(server, rank: int = 8, seed: int = 0):
    """(service_client, training_client): a LoRA training client of `rank` on the default model."""
    import tinker

    service_client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    training_client = service_client.create_lora_training_client(base_model=BASE, rank=rank, seed=seed).result()
    return service_client, training_client


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (psutil, else /proc/PID/status VmRSS)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {pid}")


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its descendants (a Ray or vLLM worker), psutil only; else `pid`'s own."""
    try:
        import psutil
    except ImportError:
        return rss_bytes(pid)
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass  # exited meanwhile
    return total


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile (a staging folder)
    return total


def database_bytes(home: Path) -> int:
    """stepwise.db and its -wal under the server's home."""
    return sum((home / name).stat().st_size for name in ("stepwise.db", "stepwise.db-wal") if (home / name).exists())


def sampler_checkpoint_bytes(home: Path, name: str) -> int | None:
    """The size of the sampler checkpoint `name` (checkpoints/.../sampler_weights/NAME), None if not found."""
    found = [p for p in (home / "checkpoints").glob(f"**/sampler_weights/{name}") if p.is_dir()]
    return folder_bytes(found[0]) if found else None


def admin_stats(server) -> dict[str, Any]:
    """The operator's GET /api/v1/admin/stats, whatever it holds ({"error": ...} when it does not answer)."""
    import httpx

    try:
        response = httpx.get(f"{server.base_url}/api/v1/admin/stats", headers={"X-API-Key": server.api_key}, timeout=60)
    except httpx.HTTPError as e:
        return {"error": repr(e)}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:300]}"}
    return response.json()


# ---- the loop -----------------------------------------------------------------------------------------------


def default_prompts(tokenizer, count: int = 4) -> list[list[int]]:
    return [[int(t) for t in _ids(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                                 add_generation_prompt=True))]
            for q in QUESTIONS[:count]]


def _ids(encoded):
    """apply_chat_template answers a list or a BatchEncoding depending on the transformers version."""
    return encoded["input_ids"] if hasattr(encoded, "keys") and "input_ids" in encoded else encoded


def reward(tokens: list[int]) -> float:
    """Deterministic: the share of even token ids in the completion."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


def rollout_datum(prompt: list[int], completion: list[int], logprobs, advantage: float):
    """An importance_sampling Datum over prompt + completion: prompt positions carry logprob 0 and advantage 0."""
    from tinker import types

    tokens = list(prompt) + list(completion)
    n, start = len(tokens) - 1, len(prompt) - 1
    sampler_logprobs = np.zeros(n, dtype=np.float32)
    advantages = np.zeros(n, dtype=np.float32)
    sampler_logprobs[start:] = np.asarray(logprobs, dtype=np.float32)
    advantages[start:] = advantage
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                                       "logprobs": sampler_logprobs, "advantages": advantages})


def _max_diff(a: list, b: list) -> float:
    if len(a) != len(b):
        return float("inf")
    diffs = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    if any((x is None) != (y is None) for x, y in zip(a, b)):
        return float("inf")
    return max(diffs, default=0.0)


def run_soak(service_client, training_client, steps: int = 200, *, server=None, prompts: list[list[int]] | None = None,
             num_samples: int = 4, max_tokens: int = 16, learning_rate: float = 1e-5, save_state_every: int = 20,
             check_old_every: int = 10, tol: float = 1e-6, window: int = 20, seed: int = 0,
             on_step: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """`steps` RL steps (module docstring) on `training_client`; raises whatever the SDK raises.

    `server` (tests/servers.py's Server, optional) adds the server-side figures: its process's RSS, its
    home's database and checkpoint sizes, its admin stats. `prompts` default to 4 chat prompts (the training
    client's tokenizer); each step samples len(prompts) x num_samples rows. Every `check_old_every` steps
    (0: never) the samplers of step 1 and of a random older step re-score the probe sequence; a max |diff|
    over `tol` against their first scoring is a mismatch. `window` (20, at most steps // 2) is how many
    steps the first/last medians take. `on_step(i, row)` is called after each step.

    Returns a dict: steps, window, rows_per_step, step_s (per step wall seconds), phases (per phase lists:
    sample, train, save, create, probe, state), first_median_s, last_median_s, step_ratio; rss_first,
    rss_last, rss_ratio, rss_tree_first, rss_tree_last (bytes, None without a server); db_bytes and
    checkpoint_bytes (per step lists), db_growth_per_step, checkpoint_growth_per_step,
    sampler_checkpoint_bytes; checks (list of {step, sampler_step, max_diff}), check_count, mismatches,
    max_check_diff; rewards (mean per step); sampler_paths; admin_stats (at the end); wall_s.
    """
    from tinker import types

    if prompts is None:
        prompts = default_prompts(training_client.get_tokenizer())
    window = max(1, min(window, steps // 2)) if steps >= 2 else 1
    probe = types.ModelInput.from_ints(list(prompts[0]) + [int(t) for t in
                                                           _probe_tokens(training_client, prompts[0])])
    rng = random.Random(seed)
    samplers: dict[int, Any] = {}
    recorded: dict[int, list] = {}
    paths: dict[int, str] = {}
    out: dict[str, Any] = {"steps": steps, "window": window, "rows_per_step": len(prompts) * num_samples,
                           "step_s": [], "phases": {k: [] for k in ("sample", "train", "save", "create", "probe", "state")},
                           "rss": [], "rss_tree": [], "db_bytes": [], "checkpoint_bytes": [], "checks": [],
                           "rewards": []}
    pid = server.process.pid if server is not None else None
    started = time.perf_counter()

    def new_sampler(i: int) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        paths[i] = training_client.save_weights_for_sampler(name=f"step-{i}").result().path
        t1 = time.perf_counter()
        samplers[i] = service_client.create_sampling_client(model_path=paths[i]).result()
        t2 = time.perf_counter()
        recorded[i] = samplers[i].compute_logprobs(probe).result()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    new_sampler(0)
    for i in range(1, steps + 1):
        phase: dict[str, float] = {}
        t0 = time.perf_counter()
        current = samplers[i - 1]
        futures = [current.sample(types.ModelInput.from_ints(prompt), num_samples,
                                  types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i * 1000 + j))
                   for j, prompt in enumerate(prompts)]
        results = [f.result() for f in futures]
        t1 = time.perf_counter()
        phase["sample"] = t1 - t0
        data, step_rewards = [], []
        for prompt, result in zip(prompts, results):
            rewards = np.array([reward(list(seq.tokens)) for seq in result.sequences])
            step_rewards += rewards.tolist()
            for seq, advantage in zip(result.sequences, rewards - rewards.mean()):
                if seq.tokens:
                    data.append(rollout_datum(prompt, list(seq.tokens), seq.logprobs, float(advantage)))
        fb = training_client.forward_backward(data, "importance_sampling")
        optim = training_client.optim_step(types.AdamParams(learning_rate=learning_rate))
        fb.result(), optim.result()
        phase["train"] = time.perf_counter() - t1
        phase["save"], phase["create"], phase["probe"] = new_sampler(i)
        t2 = time.perf_counter()
        if save_state_every and i % save_state_every == 0:
            training_client.save_state(f"state-{i}").result()
        phase["state"] = time.perf_counter() - t2
        # The step's wall time leaves the probe out (it is this bench's own check, not the RL loop's).
        out["step_s"].append(time.perf_counter() - t0 - phase["probe"])
        for key, seconds in phase.items():
            out["phases"][key].append(seconds)
        out["rewards"].append(float(np.mean(step_rewards)) if step_rewards else 0.0)

        if check_old_every and i % check_old_every == 0 and i >= 2:
            older = [s for s in samplers if s < i and s != 1]  # step 0's sampler is always there
            for old in (1, rng.choice(older)):
                diff = _max_diff(samplers[old].compute_logprobs(probe).result(), recorded[old])
                out["checks"].append({"step": i, "sampler_step": old, "max_diff": diff})

        if server is not None:
            out["rss"].append(rss_bytes(pid))
            out["rss_tree"].append(tree_rss_bytes(pid))
            out["db_bytes"].append(database_bytes(server.home))
            out["checkpoint_bytes"].append(folder_bytes(server.home / "checkpoints"))
        if on_step is not None:
            on_step(i, {"step_s": out["step_s"][-1], **phase, "reward": out["rewards"][-1],
                        "rss": out["rss"][-1] if out["rss"] else None,
                        "checks": [c for c in out["checks"] if c["step"] == i]})

    out["wall_s"] = time.perf_counter() - started
    out["first_median_s"] = statistics.median(out["step_s"][:window])
    out["last_median_s"] = statistics.median(out["step_s"][-window:])
    out["step_ratio"] = out["last_median_s"] / out["first_median_s"]
    out["check_count"] = len(out["checks"])
    out["mismatches"] = sum(1 for c in out["checks"] if not c["max_diff"] <= tol)
    out["max_check_diff"] = max((c["max_diff"] for c in out["checks"]), default=None)
    out["tol"] = tol
    out["sampler_paths"] = paths
    if server is not None:
        w = window - 1  # the index of step `window`
        out["rss_first"], out["rss_last"] = out["rss"][w], out["rss"][-1]
        out["rss_ratio"] = out["rss_last"] / out["rss_first"]
        out["rss_tree_first"], out["rss_tree_last"] = out["rss_tree"][w], out["rss_tree"][-1]
        span = max(1, steps - window)
        out["db_growth_per_step"] = (out["db_bytes"][-1] - out["db_bytes"][w]) / span
        out["checkpoint_growth_per_step"] = (out["checkpoint_bytes"][-1] - out["checkpoint_bytes"][w]) / span
        out["sampler_checkpoint_bytes"] = sampler_checkpoint_bytes(server.home, "step-1")
        out["admin_stats"] = admin_stats(server)
    else:
        for key in ("rss_first", "rss_last", "rss_ratio", "rss_tree_first", "rss_tree_last", "db_growth_per_step",
                    "checkpoint_growth_per_step", "sampler_checkpoint_bytes", "admin_stats"):
            out[key] = None
    return out


def _probe_tokens(training_client, prompt: list[int]) -> list[int]:
    """The probe's continuation: PROBE_TEXT in the training client's tokenizer (fixed ids if it has none)."""
    try:
        return list(training_client.get_tokenizer().encode(PROBE_TEXT, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer-less backend still gets a fixed probe
        return [(7919 * k) % 40000 + 100 for k in range(20)]


# ---- the report ---------------------------------------------------------------------------------------------


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:8.1f} MiB"


def _kib(n: float | None) -> str:
    return "-" if n is None else f"{n / 1024:8.1f} KiB"


def report(result: dict[str, Any]) -> str:
    """The printed table: first/last window medians and their ratios, storage growth, the old samplers' checks."""
    w, phases = result["window"], result["phases"]
    lines = [f"\n[soak] {result['steps']} steps, {result['rows_per_step']} rows a step, importance_sampling; "
             f"wall {result['wall_s'] / 60:.1f} min   ({load_line()})",
             f"  {'':<28} {'first ' + str(w):>12} {'last ' + str(w):>12} {'ratio':>7}   goal"]

    def row(label: str, first: float, last: float, unit: str = "s", goal: str = "") -> None:
        if unit == "s":
            a, b = f"{first:10.3f} s", f"{last:10.3f} s"
        else:
            a, b = _mib(first), _mib(last)
        lines.append(f"  {label:<28} {a:>12} {b:>12} {last / first if first else float('nan'):7.3f}   {goal}")

    row("step wall (median)", result["first_median_s"], result["last_median_s"], goal="<= 1.1")
    for key in ("sample", "train", "save", "create", "probe"):
        values = phases[key]
        row(f"  {key} (median)", statistics.median(values[:w]), statistics.median(values[-w:]))
    if result["rss_first"] is not None:
        row(f"server RSS (step {w}, last)", result["rss_first"], result["rss_last"], unit="b", goal="<= 1.10")
        if result["rss_tree_last"] != result["rss_last"]:
            row("  with its children", result["rss_tree_first"], result["rss_tree_last"], unit="b")
        one = result["sampler_checkpoint_bytes"]
        lines.append(f"  database growth per step    {_kib(result['db_growth_per_step'])}   "
                     f"(now {_kib(result['db_bytes'][-1])})")
        lines.append(f"  checkpoints growth per step {_kib(result['checkpoint_growth_per_step'])}   "
                     f"(one sampler checkpoint {_kib(one)}; ratio "
                     f"{result['checkpoint_growth_per_step'] / one if one else float('nan'):.2f}; "
                     f"now {_mib(result['checkpoint_bytes'][-1])})")
    worst = result["max_check_diff"]
    lines.append(f"  old samplers re-scored: {result['check_count']} checks, {result['mismatches']} mismatches "
                 f"(max |diff| {'-' if worst is None else f'{worst:.1e}'}, tolerance {result['tol']:.0e})   goal 0")
    bad = [c for c in result["checks"] if not c["max_diff"] <= result["tol"]]
    for c in bad[:10]:
        lines.append(f"    at step {c['step']}: the sampler of step {c['sampler_step']} differs by {c['max_diff']:.2e}")
    rewards = result["rewards"]
    lines.append(f"  mean reward: first {w} {statistics.mean(rewards[:w]):.3f}, last {w} {statistics.mean(rewards[-w:]):.3f}")
    stats = result["admin_stats"]
    if stats is not None:
        shown = {k: stats[k] for k in ("adapters", "adapter_cache") if k in stats} or stats
        lines.append("  admin stats: " + json.dumps(shown, default=str))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step (each sampled --num-samples times)")
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--save-state-every", type=int, default=20, help="0: never")
    parser.add_argument("--check-old-every", type=int, default=10, help="re-score old samplers every K steps (0: never)")
    parser.add_argument("--tol", type=float, default=1e-6, help="an old sampler's max |logprob diff| allowed")
    parser.add_argument("--window", type=int, default=20, help="steps in the first/last medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result here (JSON)")
    parser.add_argument("--keep-home", action="store_true", help="keep the server's home folder (its path is printed)")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    server = None
    try:
        server = start_soak_server()
        print(f"server {server.base_url}, home {server.home}, pid {server.process.pid}, "
              f"STEPWISE_EMBEDDED={os.environ.get('STEPWISE_EMBEDDED', '0')}", flush=True)
        service_client, training_client = make_clients(server, rank=args.rank, seed=args.seed)
        from transformers import AutoTokenizer

        prompts = default_prompts(AutoTokenizer.from_pretrained(server.tokenizer_dir), args.prompts)
        bar = tqdm(total=args.steps, desc="soak steps")

        def on_step(i: int, row: dict) -> None:
            bar.update(1)
            postfix = {"step": f"{row['step_s']:.2f}s", "rss": f"{row['rss'] / MiB:.0f}M" if row["rss"] else "-"}
            if row["checks"]:
                postfix["old"] = f"{max(c['max_diff'] for c in row['checks']):.0e}"
            bar.set_postfix(postfix)

        result = run_soak(service_client, training_client, args.steps, server=server, prompts=prompts,
                          num_samples=args.num_samples, max_tokens=args.max_tokens, learning_rate=args.lr,
                          save_state_every=args.save_state_every, check_old_every=args.check_old_every, tol=args.tol,
                          window=args.window, seed=args.seed, on_step=on_step)
        bar.close()
    except BaseException as e:  # noqa: BLE001 - an SDK error (or ^C) ends the soak with its traceback
        traceback.print_exc()
        print(f"\nsoak FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        if server is not None and server.log_path.exists():
            print(f"server log ({server.log_path}), last lines:\n" + server.log_path.read_text()[-3000:], file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
            if not args.keep_home:
                import shutil

                shutil.rmtree(server.home, ignore_errors=True)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.keep_home:
        print(f"  server home kept: {server.home}")
    return 2 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
