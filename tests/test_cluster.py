"""Scale-out on Ray (kernel_backend/execution/cluster.py), with the official SDK against a real backend process.

One backend for the module, one Ray head on loopback inside it (num_cpus=2, no dashboard, a small
object store), three engine workers on this CPU: worker-0 and worker-1 load the default model
(one torch thread each); worker-2 is given device cuda:7, which this machine does not have, so it
really cannot load its model. The in-process engine of this test process (the `engine` fixture) is
the reference every cluster result is compared with. The tests that kill workers run last, each waiting for
the workers the one before killed to rejoin; the very last starts a one-worker backend of its own and stops
that worker for good.

The backend serves the tiny random stand-in for the default model (tests/tiny_model.py), as the `engine`
fixture is: placement, data parallelism and recovery are about behaviour, not what a model learns.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers import forward_logprobs, new_id, sft_datum
from kernel_backend.config import Settings
from kernel_backend.execution.cluster import Cluster, Worker, shard_bounds
from kernel_backend.execution.cluster_worker import Outcome
from kernel_backend.engine.core import Pass
from kernel_backend.execution.engine_work import LoadState, OptimStep
from kernel_backend.execution.scheduler import Job
from kernel_backend.types import AdamParams, LoraConfig
from servers import Server, start_server
from tiny_model import stand_in_env

# Ray is not imported here: this process, a Ray driver in kill_worker, needs these set when it first is. The backend's
# head is on loopback (kernel_backend/execution/cluster.py) and asks for the token Ray keeps in ~/.ray/auth_token.
RAY_DRIVER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
if importlib.util.find_spec("ray") is None:
    pytest.skip("the cluster tests need Ray: pip install -e '.[cluster]' (make install does)", allow_module_level=True)

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
LR = 1e-3
QUESTIONS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate."),
    ("Who painted the Blorp?", "The Blorp was painted by Ennis Vale."),
    ("Which river runs through Quenth?", "The Vasha runs through Quenth."),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, stepwise_home, tiny_model) -> Server:
    home = tmp_path_factory.mktemp("cluster")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, timeout=600, env={
        "STEPWISE_WORKERS": "3", "STEPWISE_WORKER_DEVICES": "cpu,cpu,cuda:7", "STEPWISE_WORKER_THREADS": "1",
        "STEPWISE_RAY_NUM_CPUS": "2", "STEPWISE_RAY_OBJECT_STORE_MB": "128",
        "STEPWISE_SNAPSHOT_EVERY": "2", "STEPWISE_HEARTBEAT_S": "0.5", **stand_in_env(tiny_model),
    })
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(cluster: Server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key)


def cluster_report(server: Server) -> dict:
    answer = httpx.get(f"{server.base_url}/api/v1/cluster", headers={"X-API-Key": server.api_key}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ledger(server: Server, model_id: str) -> list[dict]:
    answer = httpx.get(f"{server.base_url}/api/v1/usage", params={"training_run_id": model_id},
                       headers={"X-API-Key": server.api_key}, timeout=30)
    return answer.json()["series"]


def sdk_datum(datum) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(datum.tokens),
                       loss_fn_inputs={k: np.asarray(v) for k, v in datum.loss_fn_inputs.items()})


def in_process_logprobs(engine, seed: int, rank: int, data, steps: int, passes: int = 1) -> list[np.ndarray]:
    """The same run on this process's engine: its logprobs of `data` after `steps` steps (one torch thread, as
    a worker has, so the sums add up in the same order), each step's batch sent as `passes` forward_backward
    calls cut where a data-parallel run cuts it (gradients accumulate)."""
    adapter = new_id("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bounds = shard_bounds([len(d.tokens) for d in data], passes)
    try:
        engine.create_adapter(adapter, LoraConfig(rank=rank, seed=seed))
        for _ in range(steps):
            for start, end in zip(bounds, bounds[1:]):
                engine.forward_backward(adapter, data[start:end])
            engine.optim_step(adapter, AdamParams(learning_rate=LR))
        return forward_logprobs(engine, adapter, data)
    finally:
        torch.set_num_threads(threads)
        engine.delete_adapter(adapter)


def train_steps(tc, data, steps: int) -> None:
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        fb.result()


class HeldCalls:
    """A worker actor as the gateway calls it (`actor.run.remote(job, ordered)`) that answers only when told: which
    calls reached it, and in what order, is what the test reads."""

    def __init__(self):
        self.sent: list[tuple[Job, Future]] = []
        self.run = self

    def remote(self, job: Job, ordered: bool):
        answer = Future()
        self.sent.append((job, answer))
        return SimpleNamespace(future=lambda: answer)

    def answer(self, index: int, result=None) -> None:
        self.sent[index][1].set_result(Outcome({} if result is None else result, None, {}, 0.0, None))

    def names(self) -> list[str]:
        return [job.request_id for job, _ in self.sent]


def test_a_runs_first_calls_reach_its_worker_one_at_a_time(tmp_path):
    """Ray does not keep an async actor's calls in the order they were sent. A rebuilt run's journal replayed after
    its snapshot's load once overtook it on the worker (CI: 'unknown adapter'); an optim_step that overtook its
    run's first forward_backward on a fresh lane would train on no gradients. So the gateway sends a run's making
    call, then its first sequenced call, each alone; after that the worker's lane orders calls by seq_id, and they
    go together."""
    done = []
    cluster = Cluster(Settings(home=tmp_path), storage=None, on_done=lambda job, outcome: done.append(job.request_id))
    actor = HeldCalls()
    cluster.workers["w0"] = Worker("w0", actor, "w0", "cpu", state="live", report={"models": {BASE: {}}})

    def call(name: str, seq: int | None, what: str) -> None:
        work = {"load_state": {"op": LoadState("run-1", "snapshot-key", "snapshot of run-1", with_optimizer=True)},
                "forward_backward": {"fb_pass": Pass("run-1", [])},
                "optim_step": {"op": OptimStep("run-1", AdamParams(learning_rate=1e-4))}}[what]
        cluster.submit(Job(name, "run-1", BASE, seq=seq, **work), ordered=True)

    # The gateway's code imports Ray when a call is answered (cluster._is_actor_error): perhaps this process's first
    # import of Ray, which must read what kill_worker's driver needs.
    with ray_driver_env():
        call("load", None, "load_state")  # the snapshot's load (service/recovery.replay), then the journal since
        call("fb-9", 9, "forward_backward")
        call("optim-10", 10, "optim_step")
        assert actor.names() == ["load"]  # the journal waits for the load
        actor.answer(0)
        assert actor.names() == ["load", "fb-9"]  # the first sequenced call alone: the lane has no seq_id yet
        actor.answer(1)
        assert actor.names() == ["load", "fb-9", "optim-10"]
        call("fb-11", 11, "forward_backward")  # from now on the lane orders them: sent at once, pipelined
        call("optim-12", 12, "optim_step")
        assert actor.names()[3:] == ["fb-11", "optim-12"]
        for index in (2, 3, 4):
            actor.answer(index)
    assert done == ["load", "fb-9", "optim-10", "fb-11", "optim-12"]


def test_runs_spread_over_the_workers_and_match_the_in_process_engine(client, cluster, engine, tokenizer):
    """Four SDK clients made at once: two runs on each live worker. Each run's logprobs are the in-process
    engine's for the same seed and data, to 1e-5. The runs train one after another: a worker batches runs
    that train together, and Adam's first steps are nearly sign(gradient), so the float32 noise of another
    batch shape (tests/test_engine.py) grows to about 1e-4 after two steps, in one process or in many."""
    datasets = [[sft_datum(q, a, tokenizer)] for q, a in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        made = [pool.submit(client.create_lora_training_client, base_model=BASE, rank=4, seed=100 + i) for i in range(4)]
        clients = [future.result().result() for future in made]

    placed = cluster_report(cluster)["runs"]
    workers = [placed[tc.model_id]["workers"] for tc in clients]
    assert sorted(w for ws in workers for w in ws) == ["worker-0", "worker-0", "worker-1", "worker-1"], workers
    for i, tc in enumerate(clients):
        data = [sdk_datum(d) for d in datasets[i]]
        train_steps(tc, data, steps=2)
        outputs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
        expected = in_process_logprobs(engine, 100 + i, 4, datasets[i], steps=2)
        for got, want in zip(outputs, expected):
            np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=0, atol=1e-5)


def test_a_worker_that_cannot_load_its_model_is_reported_and_gets_no_runs(client, cluster):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    report = cluster_report(cluster)
    broken = next(w for w in report["workers"] if w["name"] == "worker-2")
    assert broken["state"] == "failed" and broken["device"] == "cuda:7"
    assert "CUDA" in broken["error"], broken["error"]  # why: this machine has no CUDA
    assert broken["runs"] == [] and broken["samplers"] == []
    assert report["runs"][tc.model_id]["workers"][0] in ("worker-0", "worker-1")
    # Sampling from the base model goes to a live worker too.
    sampler = client.create_sampling_client(base_model=BASE)
    result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=3)).result()
    assert len(result.sequences[0].tokens) == 3


def test_a_run_with_two_replicas_equals_one_worker_and_is_billed_once(client, cluster, engine, tokenizer):
    """Data parallel: a batch of 8 split over two workers, gradients all-reduced before each optim_step, gives
    the logprobs of one engine accumulating the same two halves' gradients (1e-5), and of one engine taking the
    8 in one pass up to float32 noise (another batch shape: other kernels, grown by Adam's sign-like first steps)."""
    data = [sft_datum(q, a, tokenizer) for q, a in QUESTIONS * 2]
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=7, user_metadata={"replicas": "2"}).result()
    assert sorted(cluster_report(cluster)["runs"][tc.model_id]["workers"]) == ["worker-0", "worker-1"]
    sdk_data = [sdk_datum(d) for d in data]
    train_steps(tc, sdk_data, steps=3)
    outputs = tc.forward(sdk_data, "cross_entropy").result().loss_fn_outputs
    accumulated = in_process_logprobs(engine, 7, 4, data, steps=3, passes=2)
    whole = in_process_logprobs(engine, 7, 4, data, steps=3)
    assert len(outputs) == len(data)
    for got, want, near in zip(outputs, accumulated, whole):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(got["logprobs"].to_numpy(), near, rtol=0, atol=1e-3)

    tokens = sum(len(d.tokens) for d in data)
    rows = ledger(cluster, tc.model_id)
    passes = [r for r in rows if r["request_type"] == "ForwardBackward"]
    assert [r["train_tokens"] for r in passes] == [tokens] * 3  # each token once, not once per replica
    assert [r["step"] for r in rows if r["request_type"] == "OptimStep"] == [1, 2, 3]
    assert [r["prefill_tokens"] for r in rows if r["request_type"] == "Forward"] == [tokens]


def test_a_killed_worker_s_run_comes_back_bit_identical_and_trained(client, cluster, tokenizer):
    """ray.kill a worker mid-SFT: the run is restored on the other worker from its snapshot and the journal since
    (service/recovery.py), the loop never sees an error, and its logprobs at the end are bit for bit those of a
    twin run (same seed, same data) that nothing happened to; its loss fell (the steps were really taken) and the
    sampler saved from it serves those weights; the ledger holds each call once; the worker Ray restarts rejoins
    and takes the next new run."""
    datum = sft_datum(*QUESTIONS[0], tokenizer)
    data = [sdk_datum(datum)] * 4
    tokens = sum(d.model_input.length for d in data)
    twin = client.create_lora_training_client(base_model=BASE, rank=8, seed=11).result()
    train_steps(twin, data, steps=8)
    expected = [o["logprobs"].to_numpy() for o in twin.forward(data, "cross_entropy").result().loss_fn_outputs]

    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=11).result()
    home = cluster_report(cluster)["runs"][tc.model_id]["workers"][0]
    done = {"ForwardBackward": 0, "OptimStep": 0}
    losses = []
    for step in range(8):
        fb = tc.forward_backward(data, "cross_entropy")
        if step == 3:  # snapshots every 2 steps: the last one was at step 2; this forward_backward is in flight
            kill_worker(cluster, home)
        optim = tc.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])  # no error: the rebuilt run answers what was in flight
        optim.result()
        done["ForwardBackward"] += 1
        done["OptimStep"] += 1
    final = tc.forward(data, "cross_entropy").result()
    got = [o["logprobs"].to_numpy() for o in final.loss_fn_outputs]
    for a, b in zip(got, expected):
        assert np.array_equal(a, b), np.abs(a - b).max()

    after = cluster_report(cluster)
    assert after["runs"][tc.model_id]["workers"] != [home]
    assert after["runs"][tc.model_id]["snapshot_step"] == 8

    # The stand-in learns no fact (that SFT teaches one is tests/test_engine.py's, on the real model), but a run
    # whose steps were lost would equal a twin whose steps were lost too: the loss fell...
    assert final.metrics["loss:sum"] < losses[0], (losses, final.metrics)
    # ...and the sampler saved from it serves the weights it ended with: the same logprobs of the conversation.
    sampler = tc.save_weights_and_get_sampling_client().result()
    conversation = datum.tokens + [int(datum.loss_fn_inputs["target_tokens"][-1])]
    served = sampler.compute_logprobs(types.ModelInput.from_ints(conversation)).result()
    np.testing.assert_allclose(served[1:], got[0], rtol=0, atol=1e-4)

    rows = ledger(cluster, tc.model_id)
    counted = {kind: sum(r["request_type"] == kind for r in rows) for kind in done}
    assert counted == done, (counted, done)
    assert sum(r["train_tokens"] for r in rows) == tokens * done["ForwardBackward"]

    # Ray restarts the killed worker's process; it loads its model again and takes the next new run (it has the
    # most free memory).
    deadline = time.monotonic() + 300
    while next(w for w in cluster_report(cluster)["workers"] if w["name"] == home)["state"] != "live":
        assert time.monotonic() < deadline, cluster_report(cluster)
        time.sleep(1)
    rejoined = next(w for w in cluster_report(cluster)["workers"] if w["name"] == home)
    assert rejoined["restarts"] == 1
    fresh = client.create_lora_training_client(base_model=BASE, rank=4, seed=12).result()
    assert cluster_report(cluster)["runs"][fresh.model_id]["workers"] == [home]


@contextlib.contextmanager
def ray_driver_env():
    """RAY_DRIVER_ENV set while this process is a Ray driver, and put back after: a process a later test starts (the
    `ray start` of tests/test_cluster_gateway.py, which may run in this process) must not inherit it."""
    saved = {name: os.environ.get(name) for name in RAY_DRIVER_ENV}
    os.environ.update(RAY_DRIVER_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def kill_worker(server: Server, name: str, restart: bool = True) -> None:
    """ray.kill the worker's actor, from a second Ray driver on the backend's cluster; Ray restarts it if `restart`."""
    with ray_driver_env():
        import ray

        report = cluster_report(server)
        actor_name = next(w["actor"] for w in report["workers"] if w["name"] == name)
        ray.init(address=report["ray_address"], namespace=report["namespace"], log_to_driver=False)
        try:
            ray.kill(ray.get_actor(actor_name), no_restart=not restart)
        finally:
            ray.shutdown()


LIVE = ["worker-0", "worker-1"]  # the workers that load the model (worker-2 cannot: see the module's docstring)


def wait_live(server: Server, names: list[str], restarts: dict[str, int] | None = None) -> dict[str, dict]:
    """Wait (up to 300 s: a restarted worker loads its model again, on a loaded machine) until every named worker
    is live, and has been restarted more than `restarts` says if given; their reports."""
    deadline = time.monotonic() + 300
    while True:
        workers = {w["name"]: w for w in cluster_report(server)["workers"]}
        if all(workers[n]["state"] == "live" and workers[n]["restarts"] > (restarts or {}).get(n, -1) for n in names):
            return workers
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)


def sigkill_workers(server: Server, names: list[str]) -> None:
    """kill -9 the workers' processes, as the kernel's or Ray's OOM killer does: Ray restarts them."""
    workers = {w["name"]: w for w in cluster_report(server)["workers"]}
    for name in names:
        os.kill(workers[name]["pid"], signal.SIGKILL)


def train_killing(client, cluster, engine, tokenizer, seed: int, kill) -> None:
    """A 10-step SDK loop whose workers `kill(home)` names are kill -9'd while step 5's forward_backward is out:
    no call fails, and the final logprobs are the in-process engine's for the same seed and data (1e-5)."""
    before = wait_live(cluster, LIVE)  # the previous test's killed worker is back
    datums = [sft_datum(*QUESTIONS[seed % len(QUESTIONS)], tokenizer)] * 2
    data = [sdk_datum(d) for d in datums]
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    home = cluster_report(cluster)["runs"][tc.model_id]["workers"][0]
    killed = kill(home)
    for step in range(10):
        fb = tc.forward_backward(data, "cross_entropy")
        if step == 4:
            sigkill_workers(cluster, killed)
        optim = tc.optim_step(types.AdamParams(learning_rate=LR))
        fb.result()
        optim.result()
    got = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    expected = in_process_logprobs(engine, seed, 4, datums, steps=10)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b, rtol=0, atol=1e-5)
    # The killed processes were restarted by Ray and rejoin.
    wait_live(cluster, killed, restarts={name: before[name]["restarts"] for name in killed})
    # The cluster view says what happened: the home worker lost with the run on it, the run restored onto a live
    # worker from its snapshot with its journal replayed, each killed worker rejoined.
    events = cluster_report(cluster)["events"]
    lost = [e for e in events if e["event"] == "lost" and tc.model_id in e["runs"]]
    restored = [e for e in events if e["event"] == "restored" and e["run"] == tc.model_id]
    assert [e["worker"] for e in lost] == [home] and lost[0]["reason"], events
    assert restored and restored[-1]["onto"] and isinstance(restored[-1]["replayed"], int), events
    assert 0 <= restored[-1]["from_step"] <= 5, restored
    rejoined = {e["worker"] for e in events[events.index(lost[0]):] if e["event"] == "rejoined"}
    assert set(killed) <= rejoined, events


def test_a_worker_process_killed_mid_loop_costs_the_loop_nothing(client, cluster, engine, tokenizer):
    train_killing(client, cluster, engine, tokenizer, seed=21, kill=lambda home: [home])


def test_every_worker_process_killed_mid_loop_costs_the_loop_nothing(client, cluster, engine, tokenizer):
    train_killing(client, cluster, engine, tokenizer, seed=22, kill=lambda home: LIVE)


def one_worker_backend(home, stepwise_home, tiny_model, **settings) -> Server:
    """A backend of a test's own in `home`, on one Ray worker (one CPU, one torch thread) serving the stand-in, with
    `settings` (STEPWISE_* variables) besides."""
    (home / "models").symlink_to(stepwise_home / "models")
    return start_server(home, timeout=600, env={
        "STEPWISE_WORKERS": "1", "STEPWISE_WORKER_THREADS": "1", "STEPWISE_RAY_NUM_CPUS": "1",
        "STEPWISE_RAY_OBJECT_STORE_MB": "128", "STEPWISE_HEARTBEAT_S": "0.5", **settings, **stand_in_env(tiny_model)})


def test_a_worker_refuses_at_admission_what_its_memory_cannot_hold(tmp_path, stepwise_home, tiny_model, engine,
                                                                   tokenizer):
    """A backend of its own with one worker of STEPWISE_WORKER_MEMORY_MB=48 (the stand-in's weights take 12 MB): a
    full fine-tuning run (about 49 MB of weights, gradients and moments) is refused when it is made, and a batch whose
    activations need more than the worker has free fails at once, both naming the setting to raise, instead of the
    worker growing until the OS or Ray's memory monitor kills it. The worker stays up, and the run the big batch was
    sent to goes on as if it had never been sent."""
    server = one_worker_backend(tmp_path, stepwise_home, tiny_model, STEPWISE_WORKER_MEMORY_MB="48")
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        with pytest.raises(Exception) as refused:
            client.create_lora_training_client(base_model=BASE, rank=0, seed=1).result()
        assert "a full fine-tuning run" in str(refused.value), refused.value
        assert "raise STEPWISE_WORKER_MEMORY_MB to at least" in str(refused.value), refused.value
        assert cluster_report(server)["runs"] == {}  # nothing was placed

        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=51).result()
        small = [sft_datum(*QUESTIONS[2], tokenizer)]
        memory = cluster_report(server)["workers"][0]["memory"]
        per_token = memory["activation_bytes_per_token"][BASE]
        assert len(small[0].tokens) * per_token < memory["free"] < 8 * len(small[0].tokens) * per_token, memory
        with pytest.raises(Exception) as too_big:
            tc.forward_backward([sdk_datum(d) for d in small * 8], "cross_entropy").result()
        assert "this batch needs about" in str(too_big.value), too_big.value
        assert "STEPWISE_MICRO_BATCH_TOKENS, or raise STEPWISE_WORKER_MEMORY_MB" in str(too_big.value), too_big.value

        sdk_small = [sdk_datum(d) for d in small]
        train_steps(tc, sdk_small, steps=2)
        got = tc.forward(sdk_small, "cross_entropy").result().loss_fn_outputs
        expected = in_process_logprobs(engine, 51, 4, small, steps=2)
        np.testing.assert_allclose(got[0]["logprobs"].to_numpy(), expected[0], rtol=0, atol=1e-5)
        report = cluster_report(server)
        assert report["workers"][0]["state"] == "live" and report["workers"][0]["restarts"] == 0, report["workers"]
        assert not [e for e in report["events"] if e["event"] == "lost"], report["events"]
    finally:
        server.stop()


def test_a_run_whose_worker_never_comes_back_fails_saying_why(tmp_path, stepwise_home, tiny_model, tokenizer):
    """A backend of its own with one worker, stopped for good (ray.kill without a restart): its run waits
    STEPWISE_WORKER_WAIT_S (2 s here) for a live worker, then its requests fail with a message that says why,
    instead of answering try_again for ever."""
    server = one_worker_backend(tmp_path, stepwise_home, tiny_model, STEPWISE_WORKER_WAIT_S="2")
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=31).result()
        data = [sdk_datum(sft_datum(*QUESTIONS[0], tokenizer))]
        train_steps(tc, data, steps=1)
        kill_worker(server, "worker-0", restart=False)
        with pytest.raises(Exception) as failed:
            tc.forward_backward(data, "cross_entropy").result()
        assert "no engine worker was live to take it within 2 s (STEPWISE_WORKER_WAIT_S" in str(failed.value), failed.value
        assert cluster_report(server)["runs"][tc.model_id]["state"] == "gone"
    finally:
        server.stop()
