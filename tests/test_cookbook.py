"""Acceptance: tinker-cookbook 0.5.8's supervised training runs against our server.

tinker-cookbook 0.5.8 (the newest that installs here) pins transformers<=5.5.4, so it
lives in a venv of its own, built once per machine outside the checkout (tests/client_venvs.py;
`make test` starts the build in the background, about 2 minutes and 1.6 GB the first time).
This test runs in the main venv: it waits for that venv if it is being built, then runs
tests/cookbook_sft.py with the cookbook's python against the `tinker_server` fixture
(from tests/conftest.py: `.base_url`, `.api_key`, `.tokenizer_dir`) and checks what
`tinker_cookbook.supervised.train` wrote: one metrics.jsonl row per step with a finite
`train_mean_nll`, and a final checkpoint record in checkpoints.jsonl.

test_cookbook_multi_turn_recipe_guess_number_runs_to_the_end runs the cookbook's own multi-turn recipe
(tests/cookbook_guess_number.py: multiplayer_rl.guess_number, unchanged, small sizes) two steps to the end.

test_cookbook_rl_train_twice_with_a_sampler_per_step runs tests/cookbook_rl.py
(`tinker_cookbook.rl.train` with save_every=1: a checkpoint, and a sampler made from it, every
step) twice in a row with the same key against `loopback_server`: a backend started the way a
user starts `stepwise serve` on their machine (STEPWISE_EMBEDDED unset, so the per-tenant
defaults of a shared server apply; the README's loopback key `tml-local`). The first run's
session is still active when the second starts (train.main never closes it; it expires only when
its heartbeats have stopped for STEPWISE_SESSION_TIMEOUT_S), so whatever the server holds per
tenant adds up over 2 x (1 training run + 1 sampler per step + the final one). Until the adapter
count quota went (adapters are a cache now), the 9th of them was refused with a 429 ("holds 8
adapters ... the limit is 8"): at 12 steps in the first run already; at the 5 steps run here, in the second.

Both servers serve the tiny random stand-in for the default model (tests/tiny_model.py): these tests
check that the cookbook's trainers run against us end to end (requests, checkpoints, samplers, no 429),
not what they teach; the cookbook itself runs in its own venv, as a client, unchanged.

Environment knobs:
- STEPWISE_COOKBOOK_STEPS (default 3): SFT training steps.
- STEPWISE_COOKBOOK_RL_STEPS (default 5): RL training steps of each of the two runs.
- STEPWISE_COOKBOOK_TIMEOUT (default 600): seconds for each training subprocess.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from client_venvs import client_env

ROOT = Path(__file__).resolve().parents[1]
SFT_SCRIPT = ROOT / "tests" / "cookbook_sft.py"
RL_SCRIPT = ROOT / "tests" / "cookbook_rl.py"
GUESS_NUMBER_SCRIPT = ROOT / "tests" / "cookbook_guess_number.py"
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The key a backend listening on loopback accepts for tenant "local" (README.md, kernel_backend/runtime.py).
LOOPBACK_KEY = "tml-local"

STEPS = int(os.environ.get("STEPWISE_COOKBOOK_STEPS", "3"))
# Each run holds 1 training run and RL_STEPS + 1 samplers (save_every=1, and the final one): with 5 steps the
# two runs hold 2 x 7 = 14 adapters at once, past the 8 that the old per-tenant count quota allowed, so the
# test still fails where adapters are counted and refused rather than cached.
RL_STEPS = int(os.environ.get("STEPWISE_COOKBOOK_RL_STEPS", "5"))
# How a 429 shows in the SDK's output (raised: "tinker.RateLimitError: Error code: 429 - {...}", or
# logged while it retries), but not the digits 429 inside a metric's value.
REFUSED = re.compile(r"RateLimitError|Error code: 429|\b429 Too Many|status(?:_code)?\W{0,3}429\b|the limit is \d")
RUN_TIMEOUT = int(os.environ.get("STEPWISE_COOKBOOK_TIMEOUT", "600"))
VENV_TIMEOUT = 1800  # conftest.wait_for_venv's wait for a build under way


def _tail(text: str | bytes | None, n: int = 4000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    """The cookbook venv's python (tests/client_venvs.py), waiting for a build under way."""
    import client_venvs
    from conftest import wait_for_venv

    return wait_for_venv(client_venvs.client("tinker-cookbook"))


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            cmd, cwd=ROOT, env=client_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout ---\n{_tail(e.stdout)}"
            f"\n--- stderr ---\n{_tail(e.stderr)}"
        )


def _read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.timeout(VENV_TIMEOUT + RUN_TIMEOUT + 120)
def test_cookbook_supervised_train(cookbook_python: Path, tinker_server, tmp_path: Path) -> None:
    tokenizer_dir = str(tinker_server.tokenizer_dir)
    model_name = getattr(tinker_server, "model_name", None) or DEFAULT_MODEL

    # 1. Offline part: the tokenizer directory loads in transformers 5.5.4 through
    #    register_tokenizer, and the renderer reproduces the chat template.
    check = _run(
        [
            str(cookbook_python),
            str(SFT_SCRIPT),
            "--self-check",
            "--tokenizer-dir",
            tokenizer_dir,
            "--model-name",
            model_name,
        ],
        timeout=180,
    )
    assert check.returncode == 0, (
        f"cookbook self-check failed (exit {check.returncode})\n--- stdout ---\n{_tail(check.stdout)}"
        f"\n--- stderr ---\n{_tail(check.stderr)}"
    )

    # 2. supervised.train against the server.
    log_path = tmp_path / "sft-run"
    proc = _run_script(cookbook_python, SFT_SCRIPT, tinker_server.base_url, tinker_server.api_key, tokenizer_dir,
                       model_name, log_path, STEPS)
    output = f"--- stdout ---\n{_tail(proc.stdout)}\n--- stderr ---\n{_tail(proc.stderr)}"
    assert proc.returncode == 0, f"cookbook supervised.train failed (exit {proc.returncode})\n{output}"

    # 3. What the cookbook wrote.
    metrics_path = log_path / "metrics.jsonl"
    assert metrics_path.exists(), f"no {metrics_path}\n{output}"
    rows = [r for r in _read_jsonl(metrics_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == list(range(STEPS)), (
        f"expected steps 0..{STEPS - 1} in metrics.jsonl, got {[r.get('step') for r in rows]}"
    )
    nlls = [r["train_mean_nll"] for r in rows]
    for step, nll in enumerate(nlls):
        assert isinstance(nll, (int, float)) and math.isfinite(nll), f"step {step}: train_mean_nll={nll!r}"
        # A mean token NLL: positive, and nowhere near 2x uniform over 49k tokens (uniform, ln 49152 = 10.8, is
        # about where the tiny random stand-in is; a mix-up of targets or weights lands far from it).
        assert 0.0 < nll < 25.0, f"step {step}: implausible train_mean_nll={nll!r} (all: {nlls})"
    for r in rows:
        assert r["num_sequences"] == 4 and r["num_tokens"] > 0, r

    checkpoints_path = log_path / "checkpoints.jsonl"
    assert checkpoints_path.exists(), f"no {checkpoints_path}\n{output}"
    final = _read_jsonl(checkpoints_path)[-1]
    assert final["name"] == "final", final
    assert str(final.get("state_path", "")).startswith("tinker://"), final
    assert str(final.get("sampler_path", "")).startswith("tinker://"), final

    print(f"cookbook SFT: {STEPS} steps, train_mean_nll {nlls}", file=sys.stderr)


def _run_script(python: Path, script: Path, base_url: str, api_key: str, tokenizer_dir: str, model_name: str,
                log_path: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """One of the cookbook scripts (tests/cookbook_*.py) with the cookbook venv's python against a server."""
    return _run([str(python), str(script), "--base-url", base_url, "--api-key", api_key, "--tokenizer-dir",
                 tokenizer_dir, "--model-name", model_name, "--log-path", str(log_path), "--steps", str(steps), *extra],
                timeout=RUN_TIMEOUT)


@pytest.fixture(scope="module")
def loopback_server(tmp_path_factory, stepwise_home, tiny_model):
    """A backend as a user runs `stepwise serve` on their own machine, in its own home, on the tiny stand-in.

    Unlike `tinker_server` (started like the embedded backend, STEPWISE_EMBEDDED=1: no per-tenant
    caps at all) it runs with the per-tenant defaults of a server several people share (but, on loopback only,
    no tenant share of the adapter cache), and none of the `shared_server`'s small limits (its 300 tokens a
    minute would throttle any real run).
    Checkpoints (about 8 MB a step here) are deleted afterwards.
    """
    from servers import start_server
    from tiny_model import stand_in_env

    home = tmp_path_factory.mktemp("loopback_server")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_EMBEDDED": "0", "STEPWISE_LOOPBACK_KEY": LOOPBACK_KEY,
                                     **stand_in_env(tiny_model)}, timeout=600)
    yield server
    server.stop()
    shutil.rmtree(home / "checkpoints", ignore_errors=True)


@pytest.mark.timeout(VENV_TIMEOUT + 2 * RUN_TIMEOUT + 120)
def test_cookbook_rl_train_twice_with_a_sampler_per_step(
    cookbook_python: Path, loopback_server, tmp_path: Path
) -> None:
    tokenizer_dir = str(loopback_server.tokenizer_dir)
    model_name = getattr(loopback_server, "model_name", None) or DEFAULT_MODEL
    periodic = [f"{step:06d}" for step in range(1, RL_STEPS + 1)]  # save_every=1: after each step
    seconds = []
    for run in ("first", "second"):  # the same key, so the same tenant; the first session still active
        log_path = tmp_path / f"rl-{run}"
        started = time.monotonic()
        proc = _run_script(cookbook_python, RL_SCRIPT, loopback_server.base_url, LOOPBACK_KEY, tokenizer_dir,
                           model_name, log_path, RL_STEPS, "--save-every", "1")
        seconds.append(round(time.monotonic() - started, 1))
        output = f"--- stdout ---\n{_tail(proc.stdout)}\n--- stderr ---\n{_tail(proc.stderr)}"
        refused = [line for line in f"{proc.stdout}\n{proc.stderr}".splitlines() if REFUSED.search(line)]
        assert not refused, f"{run} run: the server answered 429:\n" + "\n".join(refused[:5]) + f"\n{output}"
        assert proc.returncode == 0, f"{run} run: cookbook rl.train failed (exit {proc.returncode})\n{output}"

        rows = _read_jsonl(log_path / "metrics.jsonl") if (log_path / "metrics.jsonl").exists() else []
        assert [r.get("progress/batch") for r in rows] == list(range(RL_STEPS)), (
            f"{run} run: expected steps 0..{RL_STEPS - 1} in metrics.jsonl\n{output}"
        )
        for r in rows:
            reward = r.get("env/all/reward/total")
            assert isinstance(reward, (int, float)) and -0.1 - 1e-9 <= reward <= 1.0 + 1e-9, r
        checkpoints = _read_jsonl(log_path / "checkpoints.jsonl")
        assert [c["name"] for c in checkpoints] == [*periodic, "final"], checkpoints
        for c in checkpoints:
            assert str(c.get("sampler_path", "")).startswith("tinker://"), c
            assert str(c.get("state_path", "")).startswith("tinker://"), c
        rewards = [round(r["env/all/reward/total"], 3) for r in rows]
        print(f"cookbook RL, {run} run: {RL_STEPS} steps in {seconds[-1]} s, mean reward {rewards}", file=sys.stderr)


@pytest.mark.timeout(VENV_TIMEOUT + RUN_TIMEOUT + 120)
def test_cookbook_multi_turn_recipe_guess_number_runs_to_the_end(cookbook_python: Path, loopback_server,
                                                                 tmp_path: Path) -> None:
    """tinker-cookbook's own multi-turn recipe, `multiplayer_rl.guess_number`, unchanged (tests/cookbook_guess_number.py
    builds its train.Config with the recipe's CLIConfig and build_config): batch 4, group 4, 16-token guesses, 2
    steps to the end. The stand-in never guesses in the format, so every episode runs the recipe's 10 turns. The
    cookbook sends a datum per turn, each holding the conversation before it (it merges turns into one datum only
    where the next prompt extends the tokens sampled, and this env writes the model's turns back as role "player",
    re-rendered): the ledger bills every token sent and shows the model ran under half of them (the prefixes the
    datums share, once: kernel_backend/engine/prefix_tree.py; 3.1x fewer here), and the sampler's logprobs still equal the
    trainer's (the cookbook's own kl_sample_train_v1, about 1e-8)."""
    headers = {"X-API-Key": LOOPBACK_KEY}
    usage_url = f"{loopback_server.base_url}/api/v1/usage"
    since = datetime.datetime.now(datetime.timezone.utc).isoformat()
    log_path = tmp_path / "guess-number"
    proc = _run_script(cookbook_python, GUESS_NUMBER_SCRIPT, loopback_server.base_url, LOOPBACK_KEY,
                       str(loopback_server.tokenizer_dir), DEFAULT_MODEL, log_path, 2)
    output = f"--- stdout ---\n{_tail(proc.stdout)}\n--- stderr ---\n{_tail(proc.stderr)}"
    assert proc.returncode == 0, f"the guess_number recipe failed (exit {proc.returncode})\n{output}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == [0, 1], summary
    assert all(t > 1 for t in summary["turns_per_episode"]), summary  # multi-turn episodes, every step
    assert all(abs(kl) < 1e-3 for kl in summary["kl_sample_train_v1"]), summary

    series = httpx.get(usage_url, params={"since": since, "limit": 10_000}, headers=headers).json()["series"]
    passes = [r for r in series if r["request_type"] == "ForwardBackward"]
    assert len(passes) == 2, [r["request_type"] for r in series]
    for row in passes:
        assert 0 < row["metrics"]["computed_tokens"] < row["train_tokens"] / 2, row
    print(f"cookbook guess_number: {summary}; ledger: " + ", ".join(
        f"{r['train_tokens']} tokens billed, {r['metrics']['computed_tokens']} computed" for r in passes), file=sys.stderr)


def test_a_loopback_serve_gives_its_one_user_the_whole_adapter_cache(loopback_server, shared_server):
    """`stepwise serve` on loopback is one user's: no tenant share of the adapter cache unless one is set (issue
    56: a full fine-tuning run then needs STEPWISE_ADAPTER_CACHE_MB alone). The shared_server, on loopback too,
    keeps the share it sets."""
    from conftest import SHARED_LIMITS

    def owner_budgets(server, key):
        stats = httpx.get(f"{server.base_url}/api/v1/admin/stats", headers={"X-API-Key": key}, timeout=30).json()
        return {engine["owner_budget_bytes"] for worker in stats["adapter_cache"].values() for engine in worker.values()}

    assert owner_budgets(loopback_server, LOOPBACK_KEY) == {0}
    assert owner_budgets(shared_server, shared_server.api_key) == {int(SHARED_LIMITS["STEPWISE_MAX_ADAPTER_MB_PER_TENANT"]) << 20}
