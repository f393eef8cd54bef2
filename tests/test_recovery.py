"""A crash the training loop does not notice: `kill -9` of a real `serve`, restarted on the same home and port.

Through the official SDK: a seeded LoRA run and a full fine-tuning run (rank 0: every weight its own) train 8
steps side by side (forward_backward + optim_step) and then score a fixed batch. Once on a server left alone, once on a server killed three times: between two steps (before
its first snapshot: the run is made again from its creation), while a long forward_backward runs, and just
after an optim_step was accepted (both after the snapshot at step 4: the snapshot plus the journal since).
Each time the server comes back in the background while the loop goes on: the SDK's own retries carry
it across the restart, the requests in flight at the kill are answered by the rebuilt run, and the final
logprobs are bit for bit those of the runs left alone (service/recovery.py). The optim_step in flight at a
kill is applied exactly once: any other count would change the weights.

On the tiny random stand-in for the default model (tests/tiny_model.py), in every server and in the embedded
backend connect() starts (tiny_everywhere): recovery is about bit-identical state, not what a model learns.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from servers import start_server

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
STEPS = 8
ENV = {"STEPWISE_EMBEDDED": "0", "STEPWISE_SNAPSHOT_EVERY": "4"}

pytestmark = pytest.mark.usefixtures("tiny_everywhere")


def batch(tokenizer, rows: int, repeat: int = 1):
    from tinker import types

    data = []
    for i in range(rows):
        tokens = tokenizer.encode(f"Fact {i}: the capital of Zorblax is Quimbleton. " * repeat)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)}))
    return data


def train(server, crash=lambda step, phase, futures: None):
    """The loop; `crash(step, phase, futures)` is called after each of the LoRA run's requests is accepted (the
    full run's just before). Returns the logprobs of a fixed batch after STEPS steps under each run (LoRA's
    first), and the LoRA run's id."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    full = service.create_lora_training_client(base_model=BASE, rank=0, seed=12).result()
    tokenizer = client.get_tokenizer()
    data, long = batch(tokenizer, 4), batch(tokenizer, 8, repeat=12)
    for step in range(1, STEPS + 1):
        full_fb = full.forward_backward(data, "cross_entropy")
        fb = client.forward_backward(long if step == 6 else data, "cross_entropy")
        crash(step, "forward_backward", fb)
        full_optim = full.optim_step(types.AdamParams(learning_rate=1e-4))
        optim = client.optim_step(types.AdamParams(learning_rate=1e-3))
        crash(step, "optim_step", optim)
        fb.result(), optim.result(), full_fb.result(), full_optim.result()
        crash(step, "done", None)
    logprobs = []
    for run in (client, full):
        out = run.forward(batch(tokenizer, 2), "cross_entropy").result()
        logprobs += [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]
    return logprobs, client.model_id


@pytest.fixture
def fresh_home(tmp_path, stepwise_home):
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    return tmp_path


def test_a_killed_backend_comes_back_and_the_run_ends_bit_identical(fresh_home, tmp_path_factory, stepwise_home):
    alone_home = tmp_path_factory.mktemp("alone")
    (alone_home / "models").symlink_to(stepwise_home / "models")
    alone = start_server(alone_home, env=ENV)
    try:
        expected, _ = train(alone)
    finally:
        alone.stop()

    server = start_server(fresh_home, env=ENV)
    port = int(server.base_url.rsplit(":", 1)[1])
    kills, restarts = [], []
    crashes = {(3, "done"), (6, "forward_backward"), (7, "optim_step")}

    def crash(step, phase, future):
        if (step, phase) not in crashes:
            return
        if restarts:
            restarts[-1].join()  # the previous restart has finished
        server.process.kill()
        server.process.wait()
        kills.append((step, phase))

        def restart():
            nonlocal server
            server = start_server(fresh_home, env=ENV, port=port, timeout=300)

        restarts.append(threading.Thread(target=restart))
        restarts[-1].start()

    try:
        got, model_id = train(server, crash)
        assert kills == [(3, "done"), (6, "forward_backward"), (7, "optim_step")]
        for a, b in zip(got, expected):
            assert np.array_equal(a, b), np.abs(a - b).max()
        # Each request billed once, and STEPS optim steps applied: the one in flight at a kill exactly once.
        rows = httpx.get(f"{server.base_url}/api/v1/usage", params={"training_run_id": model_id},
                         headers={"X-API-Key": server.api_key}, timeout=30).json()["series"]
        optims = [r for r in rows if r["request_type"] == "OptimStep"]
        assert len(optims) == STEPS and sorted(r["step"] for r in optims) == list(range(1, STEPS + 1)), optims
        assert sum(r["request_type"] == "ForwardBackward" for r in rows) == STEPS
        log = server.log_path.read_text()
        assert log.count("rebuilt 2 training runs") == 3, log[-3000:]
    finally:
        for thread in restarts:
            thread.join()
        server.stop()


EMBEDDED_SCRIPT = """
import json, os, signal, sys, time
import numpy as np
import workbench
from tinker import types
from kernel_backend.runtime import running_backend
from workbench.client.connection import stepwise_home

service = workbench.connect(progress=False)
client = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=4, seed=3).result()
tokens = client.get_tokenizer().encode("The capital of Zorblax is Quimbleton.")
data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})]
for _ in range(2):
    client.forward_backward(data, "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
before = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
first = running_backend(stepwise_home())
os.kill(first["pid"], signal.SIGKILL)
after = client.forward(data, "cross_entropy").result().metrics["loss:sum"]  # the next call: no exception
client.forward_backward(data, "cross_entropy").result()
client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
again = running_backend(stepwise_home())
print(json.dumps({"before": before, "after": after, "first": first, "again": again,
                  "same_connection": workbench.connect(progress=False) is service}))
"""


def test_the_embedded_backend_of_connect_restarts_itself_and_the_next_call_works(fresh_home):
    """connect()'s backend runs under `serve --supervise` (kernel_backend/supervise.py): killed with SIGKILL, it
    comes back on the same port with the same key and its runs rebuilt; the kernel's next call just works."""
    import json
    import os
    import subprocess
    import sys

    from servers import REPO

    env = {**os.environ, "STEPWISE_HOME": str(fresh_home), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", EMBEDDED_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    log = (fresh_home / "runtime" / "backend.log")
    assert done.returncode == 0, done.stderr[-3000:] + (log.read_text()[-3000:] if log.exists() else "")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["after"] == out["before"]  # the rebuilt run: the same weights as before the kill
    assert out["again"]["pid"] != out["first"]["pid"]
    assert out["again"]["base_url"] == out["first"]["base_url"] and out["again"]["local_key"] == out["first"]["local_key"]
    assert out["same_connection"]
    assert "starting it again" in log.read_text()
