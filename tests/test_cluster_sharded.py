"""A base model sharded over a group of Ray workers (STEPWISE_SHARD, execution/cluster_worker.py), through the SDK.

One backend for the module, started as `serve` is with STEPWISE_WORKERS=2 and STEPWISE_SHARD=2: two engine workers
on this CPU (one torch thread each) that form one shard group, each holding about half of the tiny stand-in for the
default model (tests/tiny_model.py). Rank 0 (worker-0) is where the gateway places every run and sampler; worker-1
runs each unit of work rank 0 sends it. The in-process engine of this test process (the `engine` fixture, the same
tiny model whole) is the reference: a sharded run's losses and logprobs are its own to 1e-5, through LoRA training,
sampling, save_state / load_state, a sampler's checkpoint, and a full fine-tuning run whose checkpoint transformers
loads. Bad input fails as in-process and the group goes on;
a member killed or hung mid-loop costs the loop a delay while the group is formed again and the run resharded from its
snapshot, and the loop's final logprobs are an uninterrupted run's; so does the gateway's own crash (last: the
module's backend is then the one started again).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers import chat_prompt, forward_logprobs, new_id, sft_datum, shifted_datum, wait_until
from kernel_backend.config import SettingError, Settings
from kernel_backend.engine import sharding
from kernel_backend.persistence import crypto
from kernel_backend.execution.cluster import Cluster, Worker, auto_shard, fitting_micro_batch
from kernel_backend.execution.cluster_worker import ShardGroupLost
from kernel_backend.execution.engine_work import SampleOp
from kernel_backend.execution.scheduler import Job, Scheduler, Unit
from kernel_backend.types import AdamParams, LoraConfig, SamplingParams
from servers import Server, start_server
from test_cluster import BASE, LR, QUESTIONS, cluster_report, kill_worker, sdk_datum, wait_live
from tiny_model import stand_in_env, stand_in_settings

TOLERANCE = 1e-5
GROUP = ["worker-0", "worker-1"]


# Checkpoints sealed at rest, as on a shared server: a member that took the writing of a save for its own once failed
# every save and snapshot sealing a folder it had never written, unseen by the client.
SECRET = "sharded-secret"
ENV = {"STEPWISE_WORKERS": "2", "STEPWISE_SHARD": "2", "STEPWISE_WORKER_THREADS": "1", "STEPWISE_RAY_NUM_CPUS": "2",
       "STEPWISE_RAY_OBJECT_STORE_MB": "128", "STEPWISE_SNAPSHOT_EVERY": "2", "STEPWISE_HEARTBEAT_S": "0.5",
       "STEPWISE_GROUP_TIMEOUT_S": "60", "STEPWISE_ENCRYPTION_KEY": SECRET}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, stepwise_home, tiny_model):
    """The module's backend, in a list: the last test replaces it with one started again on its home and port."""
    home = tmp_path_factory.mktemp("sharded")
    (home / "models").symlink_to(stepwise_home / "models")
    servers = [start_server(home, timeout=600, env={**ENV, **stand_in_env(tiny_model)})]
    yield servers
    servers[-1].stop()


@pytest.fixture
def server(sharded) -> Server:
    return sharded[-1]


@pytest.fixture(scope="module")
def client(sharded) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=sharded[0].base_url, api_key=sharded[0].api_key)


class Reference:
    """The same run on this process's unsharded engine, one torch thread as a worker has (the sums then add up in the
    same order): its loss at each step and its logprobs after."""

    def __init__(self, engine, seed: int, rank: int = 4):
        self.engine, self.adapter = engine, new_id("reference")
        engine.create_adapter(self.adapter, LoraConfig(rank=rank, seed=seed))

    def __enter__(self) -> Reference:
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.threads)
        self.engine.delete_adapter(self.adapter)

    def step(self, data) -> float:
        loss = self.engine.forward_backward(self.adapter, data).metrics["loss:sum"]
        self.engine.optim_step(self.adapter, AdamParams(learning_rate=LR))
        return loss

    def logprobs(self, data) -> list[np.ndarray]:
        return forward_logprobs(self.engine, self.adapter, data)


def sdk_logprobs(tc, data) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]


def sdk_step(tc, data) -> float:
    fb = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    return fb.result().metrics["loss:sum"]


def assert_close(got, want) -> float:
    difference = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
                     for g, w in zip(got, want, strict=True))
    assert difference <= TOLERANCE, difference
    return difference


def test_settings_a_shard_group_cannot_serve_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Checked with the settings (config.check), the command line's --workers and --shard with them: one line and
    exit status 2. What only the cluster knows (the workers a joined Ray cluster has) is refused as it forms them."""
    from kernel_backend.__main__ import main

    for name in ("STEPWISE_WORKERS", "STEPWISE_RAY_ADDRESS", "STEPWISE_SHARD", "STEPWISE_WORKER_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for argv, says in ((["serve", "--shard", "2"], "STEPWISE_SHARD=2 needs Ray workers to shard over"),
                       (["serve", "--workers", "2", "--shard", "0"], "STEPWISE_SHARD=0 is not 1 or more"),
                       (["serve", "--workers", "3", "--shard", "2"], "STEPWISE_SHARD=2 is not a divisor of the 3 workers")):
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert says in line and "(the command line: --" in line, line
    with pytest.raises(SettingError, match="STEPWISE_REPLICAS_PER_RUN=2 needs STEPWISE_SHARD=1"):
        Settings(home=tmp_path, workers=3, shard=3, replicas_per_run=2)
    cluster = Cluster(Settings(home=tmp_path, shard=2, ray_address="127.0.0.1:1"), storage=None, on_done=None)
    cluster.workers = {f"worker-{i}": Worker(f"worker-{i}", None, f"w{i}", "cpu") for i in range(3)}
    with pytest.raises(RuntimeError, match="there are 3 .* give a multiple of 2"):
        cluster._form_shard_groups()


def test_a_model_larger_than_a_worker_s_budget_is_sharded_without_being_asked(tmp_path, tiny_model):
    """STEPWISE_SHARD left at 1: the fewest workers (dividing their number) whose shards of the base model fit half a
    worker's budget (cluster.auto_shard); none at all, an error naming the settings. The model's size is read from its
    files' headers: the stand-in's weights take 12,879,104 bytes in float32 (its rotary table, made, not read, 64
    more), half that in bfloat16."""
    mib = 1 << 20
    assert sharding.weight_bytes(tiny_model) == 12_879_104
    assert sharding.weight_bytes(tiny_model, torch.bfloat16) == 12_879_104 // 2
    assert auto_shard(12_879_104, 48 * mib, 2) == 1  # fits (test_cluster.py's 48 MB worker stays whole)
    assert auto_shard(12_879_104, 20 * mib, 2) == 2
    assert auto_shard(30 * mib, 20 * mib, 6) == 3  # 15 MiB a worker of 2 is over 10; 10 of 3 fits; 4 does not divide 6
    with pytest.raises(RuntimeError, match="even sharded over all 2 workers: raise STEPWISE_WORKER_MEMORY_MB"):
        auto_shard(50 * mib, 20 * mib, 2)
    settings = dataclasses.replace(stand_in_settings(tiny_model), home=tmp_path)
    cluster = Cluster(settings, storage=None, on_done=None)
    cluster.models = [BASE]
    assert cluster._shard_size(20 * mib, ["cpu", "cpu"]) == 2
    assert cluster._shard_size(100 * mib, ["cpu", "cpu"]) == 1
    assert cluster._shard_size(20 * mib, ["cuda", "cuda"]) == 1  # a GPU's room is measured, not assumed
    cluster.models = ["no-such-model"]  # files this node does not hold: the workers load (or fail) as they would
    assert cluster._shard_size(20 * mib, ["cpu", "cpu"]) == 1
    told = Cluster(dataclasses.replace(settings, shard=2, workers=2), storage=None, on_done=None)
    assert told._shard_size(100 * mib, ["cpu", "cpu"]) == 2  # the operator's word stands

    # The micro-batch that comes with a shard group (Cluster._micro_batch_tokens): the largest whose activations take
    # half of what a worker's shard of the weights leaves; the default (4096) where it fits; the operator's word.
    told.models = [BASE]
    assert told._micro_batch_tokens(24 * mib, ["cpu", "cpu"]) == 16  # (24 - 6.1) / 2 MiB at 0.39 MiB a token: 23
    assert told._micro_batch_tokens(4096 * mib, ["cpu", "cpu"]) == 4096
    operator = Cluster(dataclasses.replace(told.settings, micro_batch_tokens=4096,
                                           given=told.settings.given | {"STEPWISE_MICRO_BATCH_TOKENS"}), None, None)
    operator.models = [BASE]
    assert operator._micro_batch_tokens(24 * mib, ["cpu", "cpu"]) == 4096
    # The default model on 900 MB workers (the report of issue 65: 538 MB of weights, 2.28 MB a token): 144 tokens,
    # where its 8 x 128 rows are micro-batches of one row (292 MB) and four 62-token datums of two (283 MB).
    assert fitting_micro_batch(int((900 * mib - 538_000_000 // 2) * 0.5), 2_282_496) == 144


def test_only_a_shard_groups_rank_0_with_every_member_live_is_given_work(tmp_path):
    cluster = Cluster(Settings(home=tmp_path, workers=4, shard=2), storage=None, on_done=None)
    group = ["worker-0", "worker-1"]
    cluster.workers = {name: Worker(name, None, name, "cpu", state="live", group=group) for name in group}
    cluster.workers["worker-2"] = Worker("worker-2", None, "worker-2", "cpu", state="live")  # (unsharded)
    assert [w.name for w in cluster.workers.values() if cluster._serves(w)] == ["worker-0", "worker-2"]
    cluster.workers["worker-1"].state = "dead"  # rank 0 would wait for it in its first collective
    assert [w.name for w in cluster.workers.values() if cluster._serves(w)] == ["worker-2"]


def test_a_unit_rank_0_cannot_send_runs_nowhere_and_fails_what_it_held(engine):
    """A shard group's rank 0 whose group is lost cannot send its next unit (its mirror raises): the unit's jobs fail
    unrun, and so do the requests decoding, whose decode steps could never be sent; the scheduler then idles rather
    than trying the decode step again and again."""
    done: dict[str, object] = {}
    scheduler = Scheduler(lambda base: engine, lambda job, outcome: done.update({job.request_id: outcome}), 10_000)
    sent: list[Unit] = []

    def mirror(unit: Unit) -> None:
        if sent:  # the first unit (the request's admission and first decode step) went; the group is lost after it
            raise ShardGroupLost("the shard group of engine workers worker-0, worker-1 lost a member")
        sent.append(unit)

    scheduler.mirror = mirror
    scheduler.start()
    try:
        prompt = SampleOp(None, [1, 2, 3], 1, SamplingParams(max_tokens=50, temperature=0.0, stop=[]))
        scheduler.submit(Job("decoding", "sampler-a", BASE, seq=None, sample=prompt, tokens=3), ordered=False)
        wait_until(lambda: "decoding" in done, timeout=60, what="the decoding request to fail")
        assert isinstance(done["decoding"], ShardGroupLost), done
        scheduler.submit(Job("later", "sampler-b", BASE, seq=None, sample=prompt, tokens=3), ordered=False)
        wait_until(lambda: "later" in done, timeout=60, what="a later request to fail unrun")
        assert isinstance(done["later"], ShardGroupLost) and len(sent) == 1
        idle = scheduler.idle_passes
        wait_until(lambda: scheduler.idle_passes > idle, timeout=10, what="the scheduler to idle")
    finally:
        scheduler.stop()


def test_the_workers_form_one_shard_group_each_holding_about_half(server, engine):
    report = cluster_report(server)
    assert report["shard"] == 2
    workers = {w["name"]: w for w in report["workers"]}
    whole = engine.memory()["base_model_bytes"]
    for name in GROUP:
        assert workers[name]["state"] == "live" and workers[name]["shard_group"] == GROUP
        held = workers[name]["memory"]["base_model_bytes"]  # what the worker's engine measures (Engine.memory)
        print(f"{name}: {held:,} of {whole:,} base-model bytes ({held / whole:.3f})")
        assert 0.45 < held / whole < 0.55


def test_a_sharded_run_trains_samples_and_saves_as_the_unsharded_engine(client, server, engine, tokenizer):
    datum = sft_datum(*QUESTIONS[0], tokenizer)
    data = [sdk_datum(datum)]
    prompt = chat_prompt(QUESTIONS[1][0], tokenizer)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    assert cluster_report(server)["runs"][tc.model_id]["workers"] == ["worker-0"]  # rank 0 serves the group
    with Reference(engine, seed=11) as reference:
        losses = [sdk_step(tc, data) for _ in range(3)]
        expected = [reference.step([datum]) for _ in range(3)]
        print(f"losses {losses} vs unsharded {expected}")
        assert_close(losses, expected)
        assert losses[-1] < losses[0]  # it trained
        after = sdk_logprobs(tc, data)
        print(f"logprobs after 3 steps: max |sharded - unsharded| = {assert_close(after, reference.logprobs([datum])):.3g}")

        # Sampling from the run's weights: the prompt's logprobs, greedy tokens, and a sample drawn without a seed,
        # whose logprobs are the model's own for the tokens drawn: a member drawing its own seed would feed the group
        # other tokens, and rank 0's lookups would be summed with the other member's of different ones.
        sampler = tc.save_weights_and_get_sampling_client().result()
        model_input = types.ModelInput.from_ints(prompt)
        got = sampler.compute_logprobs(model_input).result()[1:]
        assert_close([got], [engine.compute_logprobs(reference.adapter, prompt)[1:]])
        greedy = sampler.sample(model_input, 2, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
        want = engine.sample(reference.adapter, prompt, 2, SamplingParams(max_tokens=6, temperature=0.0))
        assert [s.tokens for s in greedy.sequences] == [s.tokens for s in want.sequences]
        drawn = sampler.sample(model_input, 1, types.SamplingParams(max_tokens=8, temperature=1.0)).result().sequences[0]
        recomputed = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + drawn.tokens)).result()[len(prompt):]
        assert_close([drawn.logprobs], [recomputed])

        # save_state, one step more, then a run made from the saved state (its optimizer's too): it is where the
        # first was saved, and goes on as the reference.
        saved = tc.save_state("after-3").result().path
        sdk_step(tc, data)
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(sdk_logprobs(tc, data), after)) > 1e-3
        tc = client.create_training_client_from_state_with_optimizer(saved).result()
        assert_close(sdk_logprobs(tc, data), after)
        assert_close([sdk_step(tc, data)], [reference.step([datum])])
        # A sampler's checkpoint (save_weights_for_sampler), loaded from the store by every member of the group.
        path = tc.save_weights_for_sampler("after-4").result().path
        from_checkpoint = client.create_sampling_client(model_path=path).result()
        assert_close([from_checkpoint.compute_logprobs(model_input).result()[1:]],
                     [engine.compute_logprobs(reference.adapter, prompt)[1:]])


def test_two_runs_batched_together_match_their_unsharded_runs(client, engine, tokenizer):
    """Two runs' forward passes sent at once: the group's rank 0 may batch them into one pass (the multi-tenant
    batch), and every member runs that batch; each run's logprobs are still its own."""
    runs = [(client.create_lora_training_client(base_model=BASE, rank=4, seed=20 + i).result(), sft_datum(*QUESTIONS[2 + i], tokenizer))
            for i in range(2)]
    for tc, datum in runs:
        sdk_step(tc, [sdk_datum(datum)])
    futures = [tc.forward([sdk_datum(datum)] * 3, "cross_entropy") for tc, datum in runs for _ in range(2)]
    answers = [[o["logprobs"].to_numpy() for o in f.result().loss_fn_outputs] for f in futures]
    for i, (_, datum) in enumerate(runs):
        with Reference(engine, seed=20 + i) as reference:
            reference.step([datum])
            want = reference.logprobs([datum]) * 3
        for got in answers[2 * i:2 * i + 2]:
            assert_close(got, want)


def test_bad_input_fails_clearly_and_the_group_goes_on(client, engine, tokenizer):
    datum = sft_datum(*QUESTIONS[3], tokenizer)
    data = [sdk_datum(datum)]
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=31).result()
    before = sdk_logprobs(tc, data)
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10_000_000]),
                      loss_fn_inputs={"target_tokens": np.asarray([2, 3, 4], dtype=np.int64)})
    with pytest.raises(Exception) as refused:
        tc.forward_backward([bad], "cross_entropy").result()
    assert "outside the vocabulary" in str(refused.value), refused.value
    assert_close(sdk_logprobs(tc, data), before)  # nothing changed, and both members still run in step
    with Reference(engine, seed=31) as reference:
        assert_close([sdk_step(tc, data)], [reference.step([datum])])
        assert_close(sdk_logprobs(tc, data), reference.logprobs([datum]))


def test_a_sharded_full_fine_tuning_run_trains_as_unsharded_and_saves_a_model_transformers_loads(
        client, server, engine, tokenizer):
    """rank 0: the run's own copy of every weight, sharded as the base is (each member holds its rows, and its AdamW
    moments'); its checkpoint is gathered whole and written by rank 0."""
    from transformers import AutoModelForCausalLM

    datum = sft_datum(*QUESTIONS[1], tokenizer)
    data = [sdk_datum(datum)]
    tc = client.create_lora_training_client(base_model=BASE, rank=0, seed=51).result()
    with Reference(engine, seed=51, rank=0) as reference:
        assert_close([sdk_step(tc, data) for _ in range(2)], [reference.step([datum]) for _ in range(2)])
        want = reference.logprobs([datum])
    assert_close(sdk_logprobs(tc, data), want)
    tc.save_weights_for_sampler("full-sharded").result()
    [folder] = {p.parent for p in (server.home / "checkpoints").rglob("model.safetensors") if "full-sharded" in str(p)}
    with crypto.opened(folder, SECRET) as plain:  # (sealed at rest: the module's STEPWISE_ENCRYPTION_KEY)
        model, info = AutoModelForCausalLM.from_pretrained(plain, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    tokens = datum.tokens + [int(datum.loss_fn_inputs["target_tokens"][-1])]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    theirs = logits[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    np.testing.assert_allclose(theirs, want[0], rtol=0, atol=1e-4)  # transformers' own forward, not the engine's


def worker_log(server: Server, name: str) -> Path:
    """The file Ray writes the worker's stderr to (its log, tracebacks included): read at once, where the gateway's
    log gets the lines later, forwarded by Ray."""
    pid = next(w["pid"] for w in cluster_report(server)["workers"] if w["name"] == name)
    return max(Path("/tmp/ray").glob(f"session_*/logs/worker-*-{pid}.err"), key=lambda p: p.stat().st_mtime)


def test_a_shard_group_saves_once_and_no_member_fails_a_save_rank_0_reports_done(client, server, tokenizer):
    """save_state, save_weights_for_sampler, the automatic snapshots and a refused save, sealed at rest: rank 0 writes
    each checkpoint once, worker-1 takes part in the engine's side only, and no member logs an error or a traceback
    (each once failed on worker-1 while the client saw success). What was saved loads: a run made from the state goes
    on where the first is, and a sampler loaded by both members gives the run's logprobs."""
    follower, leader = worker_log(server, "worker-1"), worker_log(server, "worker-0")
    logs = {path: path.stat().st_size for path in (follower, leader, server.log_path)}
    datum = sft_datum(*QUESTIONS[2], tokenizer)
    data = [sdk_datum(datum)]
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=71).result()
    for _ in range(2):  # step 2 snapshots the run (STEPWISE_SNAPSHOT_EVERY=2)
        sdk_step(tc, data)
    assert cluster_report(server)["runs"][tc.model_id]["snapshot_step"] == 2
    state = tc.save_state("once").result().path
    weights = tc.save_weights_for_sampler("once").result().path
    with pytest.raises(Exception, match="already exists"):  # rank 0 refuses before the unit goes: the others never look
        tc.save_state("once").result()
    now = sdk_logprobs(tc, data)  # (a collective: worker-1 has run every unit before it)
    assert_close(sdk_logprobs(client.create_training_client_from_state_with_optimizer(state).result(), data), now)
    prompt = types.ModelInput.from_ints(datum.tokens)
    from_store = client.create_sampling_client(model_path=weights).result().compute_logprobs(prompt).result()[1:]
    in_memory = tc.save_weights_and_get_sampling_client().result()  # (a snapshot of the weights, on every member)
    assert_close([from_store], [in_memory.compute_logprobs(prompt).result()[1:]])
    run = next(p.parent.parent for p in (server.home / "checkpoints").rglob("once"))  # <run>/weights/once
    folders = sorted(str(p.parent.relative_to(run)) for p in run.rglob(crypto.MANIFEST) if crypto.is_sealed(p.parent))
    assert folders == ["sampler_weights/once", "snapshot-000002", "weights/once"], folders
    for path, start in logs.items():
        with open(path, errors="replace") as f:
            f.seek(start)
            written = f.read()
        assert "Traceback" not in written and "failed:" not in written, f"{path}:\n{written[-3000:]}"


def test_the_automatic_shard_choice_picks_a_micro_batch_that_trains(tmp_path, stepwise_home, tiny_model, tokenizer):
    """Two workers of STEPWISE_WORKER_MEMORY_MB=24 and no STEPWISE_SHARD: the stand-in's weights (12 MiB) exceed half
    a worker's budget, so the gateway shards them over both, and since the default micro-batch's activations (4096
    tokens) could never fit what a worker's half of the weights leaves, it picks micro-batches that do and says so.
    A step of a few datums of 20 tokens, which the admission would refuse whole (its estimate printed below), trains,
    with nobody setting STEPWISE_MICRO_BATCH_TOKENS. (The stand-in holds far more activations a token beside its
    weights than the default model: its 24 MiB workers stand for the default model's 900 MB, which get 144 tokens and
    train the README's datums and 8 x 128 rows: the test above.)"""
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    env = {key: value for key, value in ENV.items() if key != "STEPWISE_SHARD"}
    server = start_server(tmp_path, timeout=600, env={**env, "STEPWISE_WORKER_MEMORY_MB": "24",
                                                        **stand_in_env(tiny_model)})
    try:
        log = server.log_path.read_text()
        assert "sharded over groups of 2 workers" in log and "2 of 2 workers live, in shard groups of 2" in log, log
        assert "micro-batches of 16 tokens, not 4096 (STEPWISE_MICRO_BATCH_TOKENS unset)" in log, log
        report = cluster_report(server)
        assert report["shard"] == 2
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=81).result()
        data = [sdk_datum(shifted_datum(sft_datum(*qa, tokenizer).tokens[:21])) for qa in QUESTIONS[:3]]
        memory = next(w for w in cluster_report(server)["workers"] if w["name"] == "worker-0")["memory"]
        whole = 3 * 20 * memory["activation_bytes_per_token"][BASE]
        print(f"the batch whole needs {whole >> 20} MiB of the {memory['free'] >> 20} MiB free")
        assert whole > memory["free"]  # refused in one micro-batch of 4096 tokens
        losses = [sdk_step(tc, data) for _ in range(2)]
        assert losses[1] < losses[0], losses
    finally:
        server.stop()
    log = server.log_path.read_text()
    print("workers' lines:", [line for line in log.splitlines() if "pid=" in line][:3])
    assert "\x1b[" not in log  # the workers' lines, as Ray prints them, and the gateway's: no colour codes


def stop_worker(server: Server, name: str) -> None:
    """SIGSTOP the worker's process: alive, holding its sockets, answering nothing (a hung member)."""
    pid = next(w["pid"] for w in cluster_report(server)["workers"] if w["name"] == name)
    os.kill(pid, signal.SIGSTOP)


@pytest.mark.parametrize("lose", [kill_worker, stop_worker], ids=["killed", "hung"])
def test_a_member_lost_mid_loop_costs_a_delay_and_the_run_goes_on_resharded(client, server, engine, tokenizer, lose):
    """worker-1 lost during step 5 of a 10-step loop: killed (another Ray driver's ray.kill; Ray restarts it), or hung
    (SIGSTOP: rank 0 would wait in its collective until STEPWISE_GROUP_TIMEOUT_S, but the member misses its heartbeats
    first, and the gateway has Ray replace it). The group cannot go on without it, so the gateway takes both members
    for lost, has Ray restart the one still answering, forms the group again once both are back, and reloads the run
    from its snapshot onto it, resharded, then its journal since. The loop sees a delay, no failed call, and ends where
    an uninterrupted run ends."""
    datum = sft_datum(*QUESTIONS[0], tokenizer)
    data = [sdk_datum(datum)]
    restarts = {w["name"]: w["restarts"] for w in cluster_report(server)["workers"]}
    reformed = sum(e["event"] == "group_reformed" for e in cluster_report(server)["events"])
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=41).result()
    for _ in range(4):
        sdk_step(tc, data)
    losing = threading.Timer(0.2, lose, (server, "worker-1"))  # while step 5 is on its way
    losing.start()
    started = time.monotonic()
    for _ in range(6):
        sdk_step(tc, data)
    losing.join()
    print(f"steps 5-10 took {time.monotonic() - started:.1f} s across the loss of worker-1 ({lose.__name__})")
    wait_live(server, GROUP, restarts)
    with Reference(engine, seed=41) as reference:
        for _ in range(10):
            reference.step([datum])
        assert_close(sdk_logprobs(tc, data), reference.logprobs([datum]))
    # Restored from a snapshot taken after step 4 or later (STEPWISE_SNAPSHOT_EVERY=2: the tiny model's steps are
    # quick, the loss may come a step or two after step 5 was sent), not made again from scratch.
    events = cluster_report(server)["events"]
    assert sum(e["event"] == "group_reformed" for e in events) > reformed, events
    assert any(e["event"] == "restored" and e["run"] == tc.model_id and e["from_step"] >= 4 for e in events), events


def test_the_gateway_killed_mid_loop_comes_back_with_its_shard_group(sharded, tiny_model, engine, tokenizer):
    """kill -9 of the gateway (the `serve` process: its Ray head and both members go with it) once step 5's requests
    are journaled, started again on its home and port while the loop waits: it forms the shard group again, and
    rebuilds the run on it from its snapshot and journal before it serves. The loop finishes with no failed call, and
    its logprobs are an uninterrupted run's. Last: it replaces the module's backend."""
    from test_cluster_gateway import journaled

    server = sharded[-1]
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    datum = sft_datum(*QUESTIONS[2], tokenizer)
    data = [sdk_datum(datum)]
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=61).result()
    port = int(server.base_url.rsplit(":", 1)[1])
    restart = None
    for step in range(10):
        fb = tc.forward_backward(data, "cross_entropy")
        optim = tc.optim_step(types.AdamParams(learning_rate=LR))
        if step == 4:  # step 5's two requests accepted (journaled), perhaps answered: kill -9 the gateway
            wait_until(lambda: journaled(server.home, tc.model_id) == 2, timeout=60, what="step 5 to be journaled")
            server.stop(kill=True)
            restart = threading.Thread(target=lambda: sharded.append(
                start_server(server.home, env={**ENV, **stand_in_env(tiny_model)}, port=port, timeout=600)))
            restart.start()
        fb.result()  # the SDK retries while the gateway is away; the rebuilt run answers
        optim.result()
    assert restart is not None
    restart.join()
    assert len(sharded) == 2 and "rebuilt from its snapshot at step 4 and 2 journaled requests" in sharded[-1].log_path.read_text()
    assert cluster_report(sharded[-1])["runs"][tc.model_id]["workers"] == ["worker-0"]
    with Reference(engine, seed=61) as reference:
        for _ in range(10):
            reference.step([datum])
        assert_close(sdk_logprobs(tc, data), reference.logprobs([datum]))
