"""A backend whose checkpoints live on S3: a real `serve` process, moto's S3 server (tests/s3_server.py), s3fs.

What a team's set-up does (issue 65): the README's loop on `serve` with PostgreSQL, checkpoints on S3 and encryption
at rest; train, save, restart, load, sample: the same logprobs after the restart, no temporary or orphaned object in
the bucket, every checkpoint file sealed. And without encryption, on SQLite: snapshots on S3 carry a run across a
`kill -9` of the backend, bit for bit (the loop of tests/test_recovery.py). The endpoint and credentials reach s3fs
the way an operator gives them, through AWS_ENDPOINT_URL and AWS_* (docs/operations.md).

On the tiny random stand-in for the default model (tests/tiny_model.py): this is about where checkpoints go.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tinker
from tinker import types

from kernel_backend.persistence import crypto
from kernel_backend.persistence.checkpoint_storage import MANIFEST
from postgres_server import postgres_cluster  # noqa: F401  (a fixture)
from s3_server import s3_server  # noqa: F401  (a fixture)
from servers import start_server
from test_recovery import ENV as RECOVERY_ENV, train

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def home(tmp_path, stepwise_home):
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    return tmp_path


@pytest.fixture(scope="module")
def stand_in(tiny_model) -> dict[str, str]:
    from tiny_model import stand_in_env

    return stand_in_env(tiny_model)


def bucket_report(s3, prefix: str) -> tuple[dict[str, bytes], list[str]]:
    """The objects under `prefix` and the problems among them: temporary objects, and generation files no
    manifest names (what a crash or a failed cleanup would leave)."""
    objects = s3.objects(prefix)
    manifests = {key.rsplit("/", 1)[0]: json.loads(data) for key, data in objects.items() if key.endswith(MANIFEST)}
    problems = [key for key in objects if ".tmp-" in key]
    for key in objects:
        folder, _, rest = key.rpartition("/")
        checkpoint, _, generation = folder.rpartition("/")
        if generation.startswith("g-") and manifests.get(checkpoint, {}).get("generation") != generation:
            problems.append(key)
    return objects, problems


def test_the_readme_loop_on_postgresql_s3_and_encryption_survives_a_restart(home, s3_server, postgres_cluster,  # noqa: F811
                                                                            tokenizer, stand_in):
    env = {**stand_in, "STEPWISE_DATABASE_URL": postgres_cluster.url, "STEPWISE_STORAGE_URL": s3_server.url("team"),
           "STEPWISE_ENCRYPTION_KEY": "a team's secret", "STEPWISE_SNAPSHOT_EVERY": "2", "STEPWISE_EMBEDDED": "0",
           **s3_server.env}
    server = start_server(home, env=env)
    port = int(server.base_url.rsplit(":", 1)[1])
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
        chat = [{"role": "user", "content": "Who is Zorblax's pet?"}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
        full = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": "Quibbleton."}])["input_ids"]
        weights = np.r_[np.zeros(len(prompt) - 1), np.ones(len(full) - len(prompt))].astype(np.float32)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(full[1:]), "weights": weights})
        for _ in range(4):  # snapshots at steps 2 and 4 go to S3 too
            tc.forward_backward([datum] * 4, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        state = tc.save_state("readme").result().path
        sampler_path = tc.save_weights_for_sampler("readme").result().path
        trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()

        server.stop()
        server = start_server(home, env=env, port=port)
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        loaded = client.create_training_client_from_state_with_optimizer(state).result()
        after = loaded.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(after, trained, atol=1e-5, rtol=0)
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        assert sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens == sampled
        np.testing.assert_allclose(np.array(sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]),
                                   np.array(scored[1:]), atol=1e-5, rtol=0)
        loaded.forward_backward([datum], "cross_entropy").result()  # and training goes on from it
        loaded.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    finally:
        server.stop()
    objects, problems = bucket_report(s3_server, "team/")
    assert not problems, problems
    checkpoint_files = {key: data for key, data in objects.items() if not key.endswith(MANIFEST)}
    assert len(checkpoint_files) >= 4  # the state's and the sampler's files, and a snapshot's
    assert all(data.startswith(crypto.MAGIC2) for data in checkpoint_files.values()), \
        [key for key, data in checkpoint_files.items() if not data.startswith(crypto.MAGIC2)]
    assert not (home / "checkpoints").exists() or not any((home / "checkpoints").rglob("*.safetensors"))


def test_snapshots_on_s3_carry_a_run_across_a_kill_9_bit_for_bit(home, s3_server, stand_in):  # noqa: F811
    env = {**stand_in, **RECOVERY_ENV, "STEPWISE_STORAGE_URL": s3_server.url("recovery"), **s3_server.env}
    server = start_server(home, env=env)
    port = int(server.base_url.rsplit(":", 1)[1])
    expected, _ = train(server)  # left alone
    restarts: list[threading.Thread] = []

    def crash(step, phase, future):
        nonlocal server
        if (step, phase) == (6, "forward_backward"):  # after the step-4 snapshot, on S3
            server.process.kill()
            server.process.wait()

            def restart():
                nonlocal server
                server = start_server(home, env=env, port=port)

            restarts.append(threading.Thread(target=restart))
            restarts[-1].start()

    try:
        got, model_id = train(server, crash)
    finally:
        for thread in restarts:
            thread.join()
        server.stop()
    assert len(restarts) == 1
    for a, b in zip(got, expected):
        assert np.array_equal(a, b), np.abs(a - b).max()
    log = server.log_path.read_text()
    assert any(f"run {model_id}:" in line and "rebuilt from its snapshot at step 4" in line for line in log.splitlines())
    objects, problems = bucket_report(s3_server, "recovery/")
    assert not problems, problems
    assert any(key.endswith(".safetensors") for key in objects)
    assert not any(data.startswith((crypto.MAGIC, crypto.MAGIC2)) for data in objects.values())  # no key: plain
