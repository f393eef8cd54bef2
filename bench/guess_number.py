"""tinker-cookbook's own multi-turn recipe against the backend as it is and as it was before issue 40.

The run issue 40 timed: tinker-cookbook 0.5.8's `multiplayer_rl.guess_number`, unmodified (tests/cookbook_guess_number.py
builds it from the recipe's CLIConfig), batch 4, group 4, 16-token guesses, 2 steps, on the default model
(SmolLM2-135M), against two backends started here one after the other, each in a fresh home:
- before: the backend of commit 1f9da3c (a git worktree of it), the last before shared prefixes. The cookbook sends
  one datum per turn, each holding the whole conversation before it, and that backend computed each datum alone;
  its prefix cache (a 32nd of the sample cache) held about a third of a batch's episodes, so most turns prefilled
  their whole conversation again;
- after: this checkout: the datums' shared prefixes computed once (kernel_backend/engine/prefix_tree.py, exact to float
  rounding), and a prefix cache (an 8th of the sample cache) that holds every episode's last prompt.

Prints each run's wall time (the cookbook's process, start to end), its steps' time/total, the sample requests'
prompt tokens billed and how many the prefix cache served, the ledger's forward_backward rows (tokens billed,
tokens computed) and the ratio before / after.

    .venv/bin/python bench/guess_number.py                # both, ~15 min on 2 cores (before ~10 of them)
    .venv/bin/python bench/guess_number.py --only after   # this checkout's backend alone
    .venv/bin/python bench/guess_number.py --only after --dtype bfloat16   # ... with a bf16 base model (mixed precision)
    .venv/bin/python bench/guess_number.py --before e473113^ --sample-dtype bfloat16   # issue 54's measure: the backend
        # as it was when issue 54 was filed against this one sampling on bf16 copies of the base weights

Needs the cookbook's venv (python tests/client_venvs.py build tinker-cookbook) and git.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchenv import REPO  # noqa: E402 - first: OMP_WAIT_POLICY, sys.path (bench/benchenv.py)

import httpx  # noqa: E402


BEFORE = "1f9da3c"  # the last commit before shared prefixes (9787f3b) and the larger prefix cache
SIDES = ("after", "before")


def worktree(commit: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"stepwise-bench-{commit}-")) / "repo"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                   capture_output=True)
    return path


def run_side(name: str, repo: Path, cookbook_python: Path, steps: int, timeout_s: int, dtype: str = "float32",
             sample_dtype: str = "float32") -> dict:
    from client_venvs import client_env
    from servers import start_server

    home = Path(tempfile.mkdtemp(prefix=f"stepwise-bench-guess-{name}-"))
    (home / "models").symlink_to(Path.home() / ".cache" / "stepwise" / "models", target_is_directory=True)
    env = {"STEPWISE_EMBEDDED": "0", "STEPWISE_LOOPBACK_KEY": "tml-local", "STEPWISE_DTYPE": dtype,
           "STEPWISE_SAMPLE_DTYPE": sample_dtype}
    server = start_server(home, env=env, timeout=600, repo=repo)
    try:
        since = datetime.datetime.now(datetime.timezone.utc).isoformat()
        start = time.perf_counter()
        proc = subprocess.run([str(cookbook_python), str(REPO / "tests" / "cookbook_guess_number.py"),
                               "--base-url", server.base_url, "--api-key", "tml-local",
                               "--tokenizer-dir", server.tokenizer_dir, "--log-path", str(home / "run"),
                               "--steps", str(steps)],
                              cwd=REPO, env=client_env(), capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{name}: the recipe failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        series = httpx.get(f"{server.base_url}/api/v1/usage", params={"since": since, "limit": 10_000},
                           headers={"X-API-Key": "tml-local"}).json()["series"]
        passes = [(r["train_tokens"], r["metrics"].get("computed_tokens")) for r in series
                  if r["request_type"] == "ForwardBackward"]
        samples = [r for r in series if r["request_type"] == "Sample"]
        stats = httpx.get(f"{server.base_url}/api/v1/admin/stats", headers={"X-API-Key": "tml-local"}).json()
        (decoder,) = stats["sampling"]["in-process"].values()
        return {"wall_s": wall, "step_s": summary["seconds"], "reward": summary["reward"], "passes": passes,
                "kl_sample_train": summary["kl_sample_train_v1"],
                "sample_requests": len(samples), "prompt_tokens": sum(r.get("prefill_tokens", 0) for r in samples),
                "sampled_tokens": sum(r.get("sample_tokens", 0) for r in samples),
                "reused_tokens": decoder["prefix_cache"]["reused_tokens"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SIDES, help="run one side")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for each side's recipe run")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the after side's STEPWISE_DTYPE (bfloat16: mixed precision, faster where the CPU has AMX)")
    parser.add_argument("--sample-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the after side's STEPWISE_SAMPLE_DTYPE (bfloat16: the sampler on bf16 copies of the base weights)")
    parser.add_argument("--before", default=BEFORE, help=f"the before side's commit (default {BEFORE})")
    args = parser.parse_args()

    import client_venvs

    cookbook_python = client_venvs.client("tinker-cookbook").python()
    if cookbook_python is None:
        sys.exit("the tinker-cookbook venv is not built: python tests/client_venvs.py build tinker-cookbook")
    results = {}
    for name in [args.only] if args.only else SIDES:
        print(f"{name}: guess_number, batch 4 x group 4, 16-token guesses, {args.steps} steps ...", flush=True)
        repo = REPO if name == "after" else worktree(args.before)
        try:
            dtype = args.dtype if name == "after" else "float32"
            sample_dtype = args.sample_dtype if name == "after" else "float32"
            results[name] = r = run_side(name, repo, cookbook_python, args.steps, args.timeout, dtype, sample_dtype)
        finally:
            if repo != REPO:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(repo)], capture_output=True)
        print(f"  {r['wall_s']:.0f} s wall; steps' time/total {[round(s) for s in r['step_s']]} s; reward {r['reward']}; "
              f"kl_sample_train_v1 {r['kl_sample_train']}")
        print(f"  {r['sample_requests']} sample requests: {r['prompt_tokens']} prompt tokens billed, "
              f"{r['sampled_tokens']} sampled; {r['reused_tokens']} prompt tokens from the prefix cache")
        for billed, computed in r["passes"]:
            print(f"  forward_backward: {billed} tokens billed, {computed} computed")
    if len(results) == 2:
        print(f"before / after: {results['before']['wall_s'] / results['after']['wall_s']:.2f}x "
              f"({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
