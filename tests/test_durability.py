"""A crash loses nothing: kill -9 mid-training, restart on the same database and checkpoint folder (the run
itself comes back bit for bit: tests/test_recovery.py).

Also: sessions that stop heart-beating expire and free their adapters, and a checkpoint exported
with --merged loads in plain transformers with the adapter's behaviour.

On the tiny random stand-in for the default model (tests/tiny_model.py), in every server and in the `stepwise
export` subprocess (tiny_everywhere): these are about what survives a crash, not what a model learns.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers import wait_until
from servers import REPO, start_server
from test_service_http import DATA, Api

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198]

pytestmark = pytest.mark.usefixtures("tiny_everywhere")


@pytest.fixture
def home(tmp_path, stepwise_home):
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    return tmp_path


def forward_logprobs(tc) -> np.ndarray:
    return tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_kill_9_mid_training_and_restart(home):
    server = start_server(home)
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("before-crash").result().path
    saved = forward_logprobs(tc)
    # Queue a pile of work and kill the server while it runs: as soon as the server has taken all of it (each
    # piece takes seconds), not after a guessed sleep.
    db = sqlite3.connect(home / "stepwise.db")

    def taken() -> list[str]:
        return [r[0] for r in db.execute("select status from futures where model_id = ? and request_type = ?",
                                         (tc.model_id, "ForwardBackward"))]

    before = len(taken())
    big = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 1500))),
                       loss_fn_inputs={"target_tokens": np.arange(6, 1501)})] * 4
    pending = [tc.forward_backward(big, "cross_entropy") for _ in range(3)]
    wait_until(lambda: len(taken()) >= before + 3, 60, "the server to take the work", every=0.05)
    server.stop(kill=True)
    assert server.process.returncode == -9
    del pending

    in_flight = [r[0] for r in db.execute("select request_id from futures where status = 'pending'")]
    assert in_flight, "the kill came after all work finished; nothing was in flight"

    restarted = start_server(home)
    try:
        # Every request that completed before the kill has exactly one ledger row: replay does not bill again.
        done = {r[0] for r in db.execute("select request_id from futures where status = 'done'")}
        billed = [r[0] for r in db.execute("select request_id from usage")]
        assert set(done) <= set(billed) and len(billed) == len(set(billed))
        # The requests that were in flight are answered by the rebuilt run (service/recovery.py), each billed once.
        api = Api(restarted)
        for request_id in in_flight:
            assert api.wait(request_id).status_code == 200
        billed = [r[0] for r in db.execute("select request_id from usage")]
        assert set(in_flight) <= set(billed) and len(billed) == len(set(billed))
        # The saved state loads and gives the same logprobs.
        client = tinker.ServiceClient(base_url=restarted.base_url, api_key=restarted.api_key)
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert np.array_equal(forward_logprobs(resumed), saved)
        # The run that lived only in memory is back where it was (its gradients since pending, weights as saved).
        assert api.loss(tc.model_id, 1000, DATA) == resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    finally:
        restarted.stop()


def test_silent_sessions_expire_and_free_their_adapters(home):
    server = start_server(home, env={"STEPWISE_SESSION_TIMEOUT_S": "2", "STEPWISE_REAP_INTERVAL_S": "0.5"})
    try:
        api = Api(server)
        session = api.session()  # raw HTTP: no SDK sends heartbeats for it
        # Heart-beat it until its adapter exists, as a client would: on a busy machine creating the model can take
        # longer than the 2 s timeout, and the session must not expire before the test has seen the adapter.
        beats, stop = [], threading.Event()

        def beat():
            heartbeats = Api(server)
            while not stop.wait(0.2):
                beats.append(heartbeats.post("/session_heartbeat", {"session_id": session}).status_code)
            heartbeats.http.close()

        beating = threading.Thread(target=beat, daemon=True)
        beating.start()
        try:
            model_id = api.model(session, 0, seed=0)
            assert sum(api.http.get("/admin/stats").json()["adapters"].values()) >= 1
        finally:
            stop.set()
            beating.join()
        assert set(beats) <= {200}  # alive all along; from here on nobody heart-beats it
        # Reading the session does not heartbeat it: polling leaves it to expire.
        wait_until(lambda: api.http.get(f"/sessions/{session}").json()["status"] == "expired", 30,
                   "the session to expire", every=0.5)
        assert api.post("/session_heartbeat", {"session_id": session}).status_code == 410
        # The freeing job runs on the scheduler thread: watch for it.
        wait_until(lambda: sum(api.http.get("/admin/stats").json()["adapters"].values()) == 0, 30,
                   "the expired session's adapters to be freed", every=0.1)
        r = api.post("/optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}})
        assert r.status_code == 410 and "checkpoint" in r.json()["detail"]
    finally:
        server.stop()


def test_merged_export_loads_in_plain_transformers(home, tmp_path):
    from transformers import AutoModelForCausalLM

    server = start_server(home)
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
        for _ in range(3):
            tc.forward_backward(DATA, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("export-me").result().path
        expected = forward_logprobs(tc)
        base_lp = forward_logprobs(client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result())
    finally:
        server.stop()

    out = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "kernel_backend", "export", path, "--to", str(out), "--merged"], cwd=REPO,
                   env={**os.environ, "STEPWISE_HOME": str(home)}, check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([TOKENS[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    got = (logits.log_softmax(-1).gather(-1, torch.tensor(TOKENS[1:])[:, None]).squeeze(-1)).numpy()
    assert np.allclose(got, expected, atol=1e-3)
    assert not np.allclose(got, base_lp, atol=1e-2)  # it carries what the adapter learned


def test_encrypted_checkpoints_in_an_fsspec_store_need_the_key(home):
    """Checkpoints go to STEPWISE_STORAGE_URL (here a file:// URL, which takes the same fsspec code path
    as s3:// or gs://: upload under a temporary name, move, download to read), sealed before upload."""
    from kernel_backend.persistence.crypto import MAGIC2, MANIFEST

    store_url = f"file://{home / 'remote-store'}"
    env = {"STEPWISE_STORAGE_URL": store_url, "STEPWISE_ENCRYPTION_KEY": "operator-secret"}
    server = start_server(home, env=env)
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
        tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("secret").result().path
        saved = forward_logprobs(tc)
        sampler_path = tc.save_weights_for_sampler("secret-sampler").result().path
        sampler = client.create_sampling_client(model_path=sampler_path).result()
        prompt = types.ModelInput.from_ints(TOKENS)
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        expected = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result()
        assert sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == expected.sequences[0].tokens
    finally:
        server.stop()
    assert not [p for p in (home / "checkpoints").rglob("*") if p.is_file()]  # nothing in the local default
    files = [p for p in (home / "remote-store").rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"adapter_model.safetensors", "optimizer.safetensors"}
    assert all(p.read_bytes().startswith(MAGIC2) for p in files if p.name != MANIFEST)  # nothing readable at rest
    assert not [p for p in (home / "remote-store").rglob("*.tmp-*")]  # no half-written upload left

    for env_, expected_error in [({"STEPWISE_STORAGE_URL": store_url}, "is encrypted"),
                                 ({**env, "STEPWISE_ENCRYPTION_KEY": "wrong"}, "cannot be decrypted")]:
        server = start_server(home, env=env_)
        try:
            client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
            with pytest.raises(Exception, match=expected_error):
                client.create_training_client_from_state(path).result()
        finally:
            server.stop()
    # The key rotated: the new one seals, the old one (in STEPWISE_ENCRYPTION_OLD_KEYS) still opens what it sealed.
    server = start_server(home, env={**env, "STEPWISE_ENCRYPTION_KEY": "rotated", "STEPWISE_ENCRYPTION_OLD_KEYS": "operator-secret"})
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        loaded = client.create_training_client_from_state(path).result()
        assert np.array_equal(forward_logprobs(loaded), saved)
        resaved = loaded.save_state("sealed-with-the-new-key").result().path
        assert np.array_equal(forward_logprobs(client.create_training_client_from_state(resaved).result()), saved)
    finally:
        server.stop()


def test_a_finished_session_frees_its_adapters_and_the_service_goes_on(home):
    server = start_server(home)
    try:
        api = Api(server)
        session = api.session()
        api.model(session, 0, seed=0)
        assert api.post(f"/sessions/{session}/finish", {"reason": {"type": "success"}}).status_code == 200
        wait_until(lambda: sum(api.http.get("/admin/stats").json()["adapters"].values()) == 0, 30,
                   "the finished session's adapter to be freed", every=0.2)
        # The scheduler is still serving other sessions.
        other = api.session()
        model_id = api.model(other, 0, seed=0)
        assert np.isfinite(api.loss(model_id, 1, DATA))
    finally:
        server.stop()


def test_a_long_run_forks_from_memory_and_disk_and_after_a_kill_9_from_disk(home):
    """Fourteen steps keeping 2 in memory and a snapshot every 4th on disk: a fork anywhere the policy keeps
    matches the parent there bit for bit, a step it does not keep is refused with the kept ones, and after
    kill -9 the snapshots on disk are still steps to fork from."""
    env = {"STEPWISE_STEP_HISTORY": "2", "STEPWISE_SNAPSHOT_EVERY": "4", "STEPWISE_SNAPSHOTS_KEPT": "3"}
    server = start_server(home, env=env)
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    after = {0: forward_logprobs(tc)}
    for k in range(1, 15):
        tc.forward_backward(DATA, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2 / k)).result()
        after[k] = forward_logprobs(tc)

    def fork_at(step: int, server) -> np.ndarray:
        api = Api(server)
        reply = api.http.post(f"/training_runs/{tc.model_id}/steps/{step}/checkpoint", json={"kind": "training"})
        assert reply.status_code == 200, reply.text
        answer = api.wait(reply.json()["request_id"])
        assert "error" not in answer.json(), answer.text
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        return forward_logprobs(client.create_training_client_from_state_with_optimizer(answer.json()["path"]).result())

    # The start and the last two steps in memory; the newest three snapshots (4, 8, 12) on disk.
    listing = Api(server).http.get(f"/training_runs/{tc.model_id}/steps").json()["steps"]
    assert listing == [{"step": 0, "where": "memory"}, {"step": 4, "where": "disk"}, {"step": 8, "where": "disk"},
                       {"step": 12, "where": "disk"}, {"step": 13, "where": "memory"}, {"step": 14, "where": "memory"}]
    for step in (0, 8, 13):
        assert np.array_equal(fork_at(step, server), after[step]), f"fork at step {step}"
    refused = Api(server).http.post(f"/training_runs/{tc.model_id}/steps/6/checkpoint", json={"kind": "sampler"})
    assert refused.status_code == 400 and "it can go back to steps [0, 4, 8, 12, 13, 14]" in refused.text

    server.stop(kill=True)
    restarted = start_server(home, env=env)
    try:
        # Memory went with the process; the snapshots on disk did not.
        assert np.array_equal(fork_at(12, restarted), after[12])
        assert np.array_equal(fork_at(4, restarted), after[4])
    finally:
        restarted.stop()
