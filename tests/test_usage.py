"""Per-token metering: the ledger counts what the backend processed, once, and prices it.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): the ledger counts and prices tokens, which any model's requests have.
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from kernel_backend.metering import Prices
from kernel_backend.service.checkpoints import SNAPSHOTS_PER_RUN
from test_service_http import DATA, Api, datum
from workbench.client.connection import Connection
from workbench.widgets.cost import CostMeter

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def usage(server, **params) -> dict:
    r = httpx.get(server.base_url + "/api/v1/usage", params=params, headers={"X-API-Key": server.api_key})
    r.raise_for_status()
    return r.json()


def test_ledger_counts_train_and_sample_tokens_and_prices_them(tinker_server):
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    session_id = tc.model_id.split(":")[0]
    data = [datum(list(range(100, 100 + n))) for n in (9, 17, 33)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 9690, 198, 2683])
    result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=7, temperature=1.0, seed=0)).result()

    report = usage(tinker_server, session_id=session_id)
    totals = report["totals"]
    assert totals["train_tokens"] == 3 * sum(d.model_input.length for d in data)
    assert totals["sample_tokens"] == sum(len(s.tokens) for s in result.sequences)
    assert totals["prefill_tokens"] == prompt.length
    price = Prices().for_model(BASE)
    expected = (totals["train_tokens"] * price["train"] + totals["sample_tokens"] * price["sample"]
                + totals["prefill_tokens"] * price["prefill"]) / 1e6
    assert totals["cost"] == pytest.approx(expected, rel=1e-9) and totals["cost"] > 0
    assert sum(k["cost"] for k in totals["by_kind"].values()) == pytest.approx(expected, rel=1e-9)

    # The series is per request, in order, with the loss and the step index, and pages with a cursor.
    series = report["series"]
    fb = [row for row in series if row["request_type"] == "ForwardBackward"]
    assert [row["step"] for row in fb] == [0, 1, 2]
    assert all("loss:sum" in row["metrics"] for row in fb)
    # Billed: every token sent. Run: each prefix the rows share once (the three rows are nested: 32 tokens).
    assert all(row["train_tokens"] == 56 and row["metrics"]["computed_tokens"] == 32 for row in fb), fb
    first = usage(tinker_server, session_id=session_id, limit=2)
    rest = usage(tinker_server, session_id=session_id, after=first["cursor"])
    assert [r["id"] for r in first["series"] + rest["series"]] == [r["id"] for r in series]
    assert rest["cursor"] == series[-1]["id"]
    # A training-run filter sees that run's requests, and the sampling done with its weights.
    run = usage(tinker_server, training_run_id=tc.model_id)
    assert run["totals"]["train_tokens"] == totals["train_tokens"]
    assert run["totals"]["sample_tokens"] == totals["sample_tokens"]


def test_retried_requests_bill_once_and_failed_requests_bill_nothing(tinker_server):
    api = Api(tinker_server)
    session = api.session()
    model_id = api.model(session, 0, seed=9)
    body = api.fb_body(model_id, 1, DATA)
    ids = set()
    for _ in range(3):  # the same (model_id, seq_id) three times, as retries would send it
        r = api.http.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
        ids.add(r.json()["request_id"])
    assert len(ids) == 1
    api.wait(ids.pop())
    failed = api.forward_backward(model_id, 2, [datum([1, 2, 10**6])])  # a token outside the vocabulary
    assert failed.json()["category"] == "user"

    report = usage(tinker_server, session_id=session)
    kinds = [row["request_type"] for row in report["series"]]
    assert kinds == ["CreateModel", "ForwardBackward"]
    assert report["totals"]["train_tokens"] == DATA[0].model_input.length


def test_estimate_prices_a_batch_before_it_is_sent(tinker_server):
    r = httpx.post(tinker_server.base_url + "/api/v1/usage/estimate", headers={"X-API-Key": tinker_server.api_key},
                   json={"base_model": BASE, "datums": [[1] * 100, [2] * 50], "prompts": [[1] * 10], "num_samples": 4,
                         "max_tokens": 20})
    body = r.json()
    price = Prices().for_model(BASE)
    assert (body["train_tokens"], body["prefill_tokens"], body["sample_tokens"]) == (150, 10, 80)
    assert body["cost"] == pytest.approx((150 * price["train"] + 10 * price["prefill"] + 80 * price["sample"]) / 1e6)


def test_sessions_report_summarises_each_session_for_the_sidebar(tinker_server):
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    session_id = tc.model_id.split(":")[0]
    data = [datum(list(range(100, 120)))]
    for _ in range(2):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    last_loss = fb.result().metrics["loss:sum"]
    path = tc.save_weights_for_sampler("two").result().path

    r = httpx.get(tinker_server.base_url + "/api/v1/usage/sessions", params={"limit": 1000},
                  headers={"X-API-Key": tinker_server.api_key})
    r.raise_for_status()
    report = r.json()
    row = next(s for s in report["sessions"] if s["session_id"] == session_id)
    assert (row["status"], row["base_model"], row["lora_rank"], row["steps"]) == ("active", BASE, 4, 2)
    assert row["last_loss"] == pytest.approx(last_loss)
    assert row["training_run_ids"] == [tc.model_id]
    assert [c["tinker_path"] for c in row["checkpoints"]] == [path]
    ledger = usage(tinker_server, session_id=session_id)["totals"]
    assert (row["train_tokens"], row["cost"]) == (ledger["train_tokens"], pytest.approx(ledger["cost"]))
    # "running" adds up every active session (not only the `limit` listed); finishing this one takes it out.
    running = report["running"]
    active = [s for s in report["sessions"] if s["status"] == "active"]
    assert running["sessions"] == len(active)
    assert running["cost"] == pytest.approx(sum(s["cost"] for s in active))
    newest_only = httpx.get(tinker_server.base_url + "/api/v1/usage/sessions", params={"limit": 1},
                            headers={"X-API-Key": tinker_server.api_key}).json()
    assert len(newest_only["sessions"]) == 1 and newest_only["running"] == running
    assert sum(k["cost"] for k in running["by_kind"].values()) == pytest.approx(running["cost"])
    httpx.post(f"{tinker_server.base_url}/api/v1/sessions/{session_id}/finish", headers={"X-API-Key": tinker_server.api_key},
               json={}).raise_for_status()
    after = httpx.get(tinker_server.base_url + "/api/v1/usage/sessions", params={"active_only": True},
                      headers={"X-API-Key": tinker_server.api_key}).json()
    assert session_id not in [s["session_id"] for s in after["sessions"]]
    assert after["running"]["cost"] == pytest.approx(running["cost"] - row["cost"])


def test_a_runs_scope_holds_the_sampling_done_with_its_weights(tinker_server):
    """An RL run's rollouts are most of its cost: sampling through its in-memory snapshot
    (save_weights_and_get_sampling_client) or its saved sampler weights is billed to the run's scope,
    and to no other run's, and the CostMeter of the run shows it."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    other = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()  # same session
    data = [datum(list(range(100, 116)))]
    for run in (tc, other):
        run.forward_backward(data, "cross_entropy")
        run.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    prompt = types.ModelInput.from_ints([1, 9690, 198, 2683])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=0)
    snapshot = tc.save_weights_and_get_sampling_client().result()
    snapshot.sample(prompt, 2, params).result()
    saved = tc.save_weights_for_sampler("rollouts").result().path
    assert saved.startswith(f"tinker://{tc.model_id}/sampler_weights/")
    client.create_sampling_client(model_path=saved).result().sample(prompt, 1, params).result()
    other.save_weights_and_get_sampling_client().result().sample(prompt, 3, params).result()

    session_id = tc.model_id.split(":")[0]
    rows = usage(tinker_server, session_id=session_id)["series"]
    samples = [r for r in rows if r["request_type"] == "Sample"]
    assert len(samples) == 3 and all(r["training_run_id"] is None and r["sampler_id"] for r in samples)
    mine, theirs = samples[:2], samples[2:]  # in the order they were sent
    run = usage(tinker_server, training_run_id=tc.model_id)
    assert run["totals"]["sample_tokens"] == sum(r["sample_tokens"] for r in mine) > 0
    assert run["totals"]["prefill_tokens"] == sum(r["prefill_tokens"] for r in mine) == 2 * prompt.length
    assert {r["id"] for r in run["series"]} >= {r["id"] for r in mine}
    assert not {r["id"] for r in run["series"]} & {r["id"] for r in theirs}
    assert run["totals"]["cost"] == pytest.approx(sum(r["cost"] for r in rows if r["training_run_id"] == tc.model_id)
                                                  + sum(r["cost"] for r in mine), rel=1e-9)
    assert usage(tinker_server, training_run_id=other.model_id)["totals"]["sample_tokens"] == theirs[0]["sample_tokens"]

    meter = CostMeter(training_run_id=tc, connection=Connection(tinker_server.base_url, tinker_server.api_key),
                      poll_interval=None)
    assert meter.sample_tokens == run["totals"]["sample_tokens"] and meter.cost == pytest.approx(run["totals"]["cost"])
    assert dict((kind, tokens) for kind, tokens, _ in meter.rows)["sample"] == f"{meter.sample_tokens:,}"


def test_sessions_report_lists_each_run_and_the_sampler_snapshots(tinker_server):
    """Three runs of one session: each with its own steps and last loss (not one summed count); the
    in-memory sampler snapshots listed beside the saved checkpoints, the newest kept ones only."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    runs = [client.create_lora_training_client(base_model=BASE, rank=4, seed=i).result() for i in range(3)]
    losses = {}
    for n, tc in enumerate(runs):
        for _ in range(n + 1):  # 1, 2 and 3 steps
            fb = tc.forward_backward([datum(list(range(100 + n, 120)))], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        losses[tc.model_id] = fb.result().metrics["loss:sum"]
    snapshots = [runs[0].save_weights_and_get_sampling_client().result() for _ in range(SNAPSHOTS_PER_RUN + 1)]
    saved = runs[1].save_weights_for_sampler("final").result().path

    report = httpx.get(tinker_server.base_url + "/api/v1/usage/sessions", params={"limit": 1000},
                       headers={"X-API-Key": tinker_server.api_key}).json()
    (row,) = [s for s in report["sessions"] if s["session_id"] == runs[0].model_id.split(":")[0]]
    assert [(r["training_run_id"], r["steps"], r["lora_rank"]) for r in row["runs"]] == \
        [(tc.model_id, n + 1, 4) for n, tc in enumerate(runs)]
    assert [r["last_loss"] for r in row["runs"]] == pytest.approx([losses[tc.model_id] for tc in runs])
    assert row["steps"] == 6 and row["last_loss"] == pytest.approx(losses[runs[2].model_id])
    assert [c["tinker_path"] for c in row["checkpoints"]] == [saved]
    kept = row["sampler_snapshots"]
    assert len(kept) == SNAPSHOTS_PER_RUN and {k["training_run_id"] for k in kept} == {runs[0].model_id}
    newest_first = [s._sampling_session_id for s in reversed(snapshots)][:SNAPSHOTS_PER_RUN]
    assert [k["sampler_id"] for k in kept] == newest_first


def test_a_plain_sdk_scripts_session_is_named_after_it_and_ends_when_it_exits(shared_server, tmp_path):
    """A script that uses the tinker SDK alone (no workbench.connect()): the backend finds its process by its
    loopback socket, lists the session under the script's name, and ends it once the script has exited
    (within the reaper's interval, 0.5 s here), not after the 5-minute heartbeat timeout."""
    import subprocess
    import sys
    import time

    script = tmp_path / "my_training_script.py"
    script.write_text(
        "import sys, tinker\n"
        f"client = tinker.ServiceClient(base_url={shared_server.base_url!r}, api_key={shared_server.api_key!r})\n"
        f"tc = client.create_lora_training_client(base_model={BASE!r}, rank=4).result()\n"
        "print(tc.model_id.split(':')[0], flush=True)\n"
        "sys.stdin.readline()\n")
    process = subprocess.Popen([sys.executable, str(script), "--lr", "1e-4"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)

    def row(session_id):
        r = httpx.get(shared_server.base_url + "/api/v1/usage/sessions", params={"limit": 1000},
                      headers={"X-API-Key": shared_server.api_key})
        return next(s for s in r.json()["sessions"] if s["session_id"] == session_id)

    try:
        session_id = process.stdout.readline().strip()
        listed = row(session_id)
        assert (listed["display_name"], listed["status"], listed["kernel_pid"]) == ("my_training_script.py", "active",
                                                                                    process.pid)
    finally:
        process.communicate(timeout=60)  # stdin closes: the script ends
    deadline = time.monotonic() + 20
    while row(session_id)["status"] == "active" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert row(session_id)["status"] == "finished"
