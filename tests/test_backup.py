"""`stepwise backup` and `stepwise restore` (kernel_backend/backup.py): a backup of a running server's home, restored
into a new home, serves the same keys, ledger and checkpoints: a training state loads with the same logprobs, bit for
bit, and sampler weights sample. A restore into a database that is not empty is refused and changes nothing.

The servers serve the tiny stand-in for the default model (tests/tiny_model.py): what is kept is what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import tinker
from tinker import types

from servers import REPO, start_server
from test_service_http import datum
from tiny_model import stand_in_env

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198]


def stepwise(home, env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernel_backend", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env, "STEPWISE_HOME": str(home)})


def logprobs(tc) -> list[float]:
    return list(tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())


def test_a_backup_restored_into_a_new_home_serves_the_same_keys_ledger_and_checkpoints(tmp_path, stepwise_home,
                                                                                      tiny_model):
    env = stand_in_env(tiny_model)
    first, second, saved = tmp_path / "first", tmp_path / "second", tmp_path / "backup"
    for home in (first, second):
        home.mkdir()
        (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(first, env=env)
    try:
        key = server.make_key("team-a")
        tc = tinker.ServiceClient(base_url=server.base_url, api_key=key).create_lora_training_client(
            base_model=BASE, rank=4, seed=0).result()
        for _ in range(3):
            tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("before-backup").result().path
        weights = tc.save_weights_for_sampler("before-backup").result().path
        trained = logprobs(tc)
        usage = httpx.get(f"{server.base_url}/api/v1/usage", headers={"X-API-Key": key}, timeout=60).json()["totals"]
        made = stepwise(first, env, "backup", "--to", str(saved))  # while the server runs
        assert made.returncode == 0, made.stderr
    finally:
        server.stop()
    summary = json.loads((saved / "backup.json").read_text())
    assert summary["tables"]["checkpoints"] == 2 and summary["tables"]["api_keys"] >= 2 and not summary["checkpoints_missing"]
    assert (saved / "tables" / "usage.jsonl").exists() and (saved / "checkpoints").is_dir()

    restored = stepwise(second, env, "restore", "--from", str(saved))
    assert restored.returncode == 0, restored.stderr
    assert "restored" in restored.stdout and "missing" not in restored.stdout, restored.stdout
    again = stepwise(second, env, "restore", "--from", str(saved))
    assert again.returncode != 0 and "is not empty" in again.stderr, again.stderr

    server = start_server(second, env=env)
    try:
        assert httpx.get(f"{server.base_url}/api/v1/usage", headers={"X-API-Key": key},
                         timeout=60).json()["totals"] == usage  # the same key, the same ledger
        client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        loaded = client.create_training_client_from_state(state).result()
        assert logprobs(loaded) == trained  # bit for bit
        sampler = client.create_sampling_client(model_path=weights)
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        sample = sampler.sample(types.ModelInput.from_ints(TOKENS[:6]), 1, types.SamplingParams(max_tokens=4, seed=0))
        assert len(sample.result().sequences[0].tokens) >= 1
    finally:
        server.stop()
