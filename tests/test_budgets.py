"""Budgets the server enforces (kernel_backend/service/budgets.py), through the official tinker SDK and the openai client.

Each test works as a tenant of its own (a key made as an operator makes one), so its budgets and its
ledger are its own on the shared test server. Costs here are real prices of real token counts: a
forward_backward's cost is known before it is sent (its datums' tokens), so the budget can be set to
fall between two steps and the refusal must come at exactly that step.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): budgets count tokens and dollars, which any model's requests have.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
import tinker
from tinker import types

from kernel_backend.metering import Prices
from test_service_http import datum

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
PRICE = Prices().for_model(BASE)
DATA = [datum([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198]),
        datum([1, 9690, 198, 2683, 359, 253, 5356, 2, 198])]
TRAIN_TOKENS = sum(d.model_input.length for d in DATA)
STEP_COST = TRAIN_TOKENS * PRICE["train"] / 1e6  # one forward_backward of DATA
PROBE = [datum([1, 9690, 198, 2683, 359, 253])]
PROBE_COST = PROBE[0].model_input.length * PRICE["prefill"] / 1e6  # a forward-only pass is metered as prefill


def rest(server, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"X-API-Key": key}, timeout=60, **kwargs)


def probe_logprobs(tc) -> list[float]:
    return list(tc.forward(PROBE, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())


def test_a_session_budget_stops_the_loop_at_the_step_that_would_pass_it_and_raising_it_goes_on(tinker_server):
    key = tinker_server.make_key("budget-session")
    # Three steps, one probe, and half a step: the 4th forward_backward would pass it.
    budget = 3 * STEP_COST + PROBE_COST + STEP_COST / 2
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key,
                                  user_metadata={"budget_usd": repr(budget)})
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    session_id = tc.model_id.split(":")[0]
    for _ in range(3):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    before = probe_logprobs(tc)

    report = rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": session_id}).json()
    assert report["budget"]["state"] == "warning"  # 3 steps + a probe of 3.5 steps' worth: past 80%
    assert report["budget"]["fraction"] == pytest.approx((3 * STEP_COST + PROBE_COST) / budget)

    started = time.monotonic()
    with pytest.raises(tinker.APIStatusError) as refused:
        tc.forward_backward(DATA, "cross_entropy").result()
    assert refused.value.status_code == 402
    message = str(refused.value)
    assert f"the budget of session {session_id} is" in message and "spent" in message
    assert f"/api/v1/budgets/session/{session_id}" in message
    detail = refused.value.body["detail"]  # every amount in plain decimals ($0.0000336, never $3.36e-05)
    assert detail.startswith("over budget:") and not re.search(r"\$[\d.,]*e[-+]", detail), detail
    # The SDK does not retry it for long: the server's client/config turns the SDK's billing pause off
    # (one resend, 5 s later, then it raises).
    assert time.monotonic() - started < 30

    # Nothing beyond the budget was spent, the refused call left no ledger row, and the weights are as they were.
    report = rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": session_id}).json()
    assert report["totals"]["cost"] <= budget
    assert report["totals"]["cost"] == pytest.approx(3 * STEP_COST + PROBE_COST, rel=1e-9)
    assert [r["request_type"] for r in report["series"]].count("ForwardBackward") == 3
    assert report["budget"]["state"] == "exhausted"  # what is left is too little for the work asked

    # Raising it (the REST route the sidebar and workbench.set_budget use) lets the same loop go on.
    raised = rest(tinker_server, key, "PUT", f"/api/v1/budgets/session/{session_id}", json={"budget_usd": 1.0})
    assert raised.status_code == 200 and raised.json()["state"] == "ok"
    assert probe_logprobs(tc) == before  # the refused call changed nothing, gradients included
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert probe_logprobs(tc) != before
    rows = rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": session_id}).json()["series"]
    assert [r["step"] for r in rows if r["request_type"] == "ForwardBackward"] == [0, 1, 2, 3]
    listed = rest(tinker_server, key, "GET", "/api/v1/budgets").json()["budgets"]
    assert [(b["scope"], b["target"], b["budget_usd"]) for b in listed] == [("session", session_id, 1.0)]


def test_sampling_counts_its_upper_bound_and_a_run_budget_covers_its_rollouts(tinker_server):
    """A sample is admitted at max_tokens per sample, settled to what it produced; the run's budget counts the
    sampling done with its weights, and the refusal names the run."""
    key = tinker_server.make_key("budget-run")
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key)
    prompt = types.ModelInput.from_ints([1, 9690, 198, 2683])
    most = (prompt.length * PRICE["prefill"] + 2 * 16 * PRICE["sample"]) / 1e6  # 2 samples of up to 16 tokens
    tc = client.create_lora_training_client(base_model=BASE, rank=4,
                                            user_metadata={"budget_usd": str(STEP_COST + 1.5 * most)}).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=1)
    sampler.sample(prompt, 2, params).result()  # fits: one step + one bound of 1.5 left
    spent = rest(tinker_server, key, "GET", "/api/v1/usage", params={"training_run_id": tc.model_id}).json()
    assert spent["totals"]["cost"] <= STEP_COST + most
    with pytest.raises(tinker.APIStatusError) as refused:
        # The ledger may hold less than `most` for the first sample (it stopped at EOS), but the second
        # sample's bound still passes what is left.
        sampler.sample(prompt, 2, params).result()
    assert refused.value.status_code == 402 and f"the budget of run {tc.model_id} is" in str(refused.value)
    # A smaller request that fits what is left is admitted: the budget counts bounds, not calls.
    left = STEP_COST + 1.5 * most - spent["totals"]["cost"]
    small = types.SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    assert (prompt.length * PRICE["prefill"] + PRICE["sample"]) / 1e6 < left
    sampler.sample(prompt, 1, small).result()
    final = rest(tinker_server, key, "GET", "/api/v1/usage", params={"training_run_id": tc.model_id}).json()
    assert final["totals"]["cost"] <= STEP_COST + 1.5 * most


def client_session(server, key: str, name: str) -> str:
    """The id of the session the OpenAI and Anthropic routes record the requests of client `name` under."""
    (row,) = [r for r in rest(server, key, "GET", "/api/v1/usage/sessions").json()["sessions"]
              if r["display_name"] == name and r["user_metadata"].get("api_client") == name]
    return row["session_id"]


def test_the_openai_routes_are_refused_with_402_in_openai_shape_by_their_session_and_run_budgets(tinker_server):
    """An OpenAI request on a checkpoint is recorded under the client's own session ("openai" here), not the
    run's (the notebook's): a budget on that session works as any session's; the run's budget still covers it."""
    key = tinker_server.make_key("budget-openai")
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    notebook = tc.model_id.split(":")[0]
    path = tc.save_weights_for_sampler("budget-oai").result().path
    oai = openai.OpenAI(base_url=tinker_server.base_url + "/oai/api/v1", api_key=key)
    ask = dict(model=path, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    oai.chat.completions.create(**ask)
    session_id = client_session(tinker_server, key, "openai")
    one = rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": session_id}).json()["totals"]["cost"]
    assert one > 0  # the client's session was charged for the OpenAI request, and so was the checkpoint's run
    assert rest(tinker_server, key, "GET", "/api/v1/usage",
                params={"training_run_id": tc.model_id}).json()["totals"]["cost"] == pytest.approx(one, rel=1e-12)
    assert rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": notebook}).json()["totals"]["cost"] == 0
    # A budget of what was spent: no room for another request's upper bound.
    assert rest(tinker_server, key, "PUT", f"/api/v1/budgets/session/{session_id}",
                json={"budget_usd": one}).status_code == 200
    with pytest.raises(openai.APIStatusError) as refused:
        oai.chat.completions.create(**ask)
    assert refused.value.status_code == 402
    assert f"the budget of session {session_id} is" in refused.value.response.json()["error"]["message"]
    assert refused.value.response.json()["error"]["type"] == "insufficient_quota"
    streamed = openai.OpenAI(base_url=tinker_server.base_url + "/oai/api/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.APIStatusError):  # a stream is refused before it starts
        list(streamed.chat.completions.create(**ask, stream=True))
    assert rest(tinker_server, key, "GET", "/api/v1/usage",
                params={"session_id": session_id}).json()["totals"]["cost"] == pytest.approx(one, rel=1e-12)
    # Another client's session has its own (no) budget; the run's budget covers every client's sampling of it,
    # the Anthropic route's too, refused in Anthropic's shape.
    other = openai.OpenAI(base_url=tinker_server.base_url + "/oai/api/v1", api_key=key,
                          default_headers={"X-Stepwise-Session": "second client"})
    other.chat.completions.create(**ask)
    spent = rest(tinker_server, key, "GET", "/api/v1/usage", params={"training_run_id": tc.model_id}).json()
    assert spent["totals"]["cost"] > one
    assert rest(tinker_server, key, "PUT", f"/api/v1/budgets/run/{tc.model_id}",
                json={"budget_usd": spent["totals"]["cost"]}).status_code == 200
    with pytest.raises(openai.APIStatusError, match=f"the budget of run {tc.model_id} is"):
        other.chat.completions.create(**ask)
    message = rest(tinker_server, key, "POST", "/v1/messages", json={
        "model": path, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
    assert message.status_code == 402 and message.json()["error"]["type"] == "billing_error"
    assert f"the budget of run {tc.model_id} is" in message.json()["error"]["message"]


def test_a_tenant_budget_refuses_the_openai_and_anthropic_routes(tinker_server):
    """The routes' own sessions are within the tenant's budget (the operator's), as every request is."""
    key = tinker_server.make_key("budget-openai-tenant")
    oai = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=key, max_retries=0)
    ask = dict(model=BASE, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    oai.chat.completions.create(**ask)
    spent = rest(tinker_server, key, "GET", "/api/v1/usage").json()["totals"]["cost"]
    assert spent > 0
    assert rest(tinker_server, tinker_server.api_key, "PUT", "/api/v1/budgets/tenant/budget-openai-tenant",
                json={"budget_usd": spent}).status_code == 200
    for named in ({}, {"X-Stepwise-Session": "a client of its own"}):
        with pytest.raises(openai.APIStatusError) as refused:
            oai.chat.completions.create(**ask, extra_headers=named)
        assert refused.value.status_code == 402
        assert "the budget of tenant budget-openai-tenant is" in refused.value.response.json()["error"]["message"]
    message = rest(tinker_server, key, "POST", "/v1/messages", json={
        "model": BASE, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
    assert message.status_code == 402 and message.json()["error"]["type"] == "billing_error"
    assert rest(tinker_server, key, "GET", "/api/v1/usage").json()["totals"]["cost"] == pytest.approx(spent, rel=1e-12)


def test_a_loop_that_does_not_await_its_forward_backward_is_told_its_steps_were_refused(tinker_server):
    """The README's loop (a forward_backward not awaited, then optim_step) against an exhausted tenant budget: every
    forward_backward is refused with 402 and every optim_step still "succeeds" on no gradient. The workbench's SDK
    hook warns at each such step with the server's message; the sessions report (the sidebar's) counts those steps
    as refused, not skipped, with the refusal; the usage report, the CostMeter and the Dashboard say so in words."""
    import warnings

    import workbench
    from workbench.widgets.cost import CostMeter
    from workbench.widgets.dashboard import Dashboard

    tenant = "budget-unawaited"
    key = tinker_server.make_key(tenant)
    client = workbench.connect(tinker_server.base_url, key, name="unawaited", progress=False)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    session_id = tc.model_id.split(":")[0]
    tc.forward_backward(DATA, "cross_entropy").result()  # one real step
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    spent = rest(tinker_server, key, "GET", "/api/v1/usage").json()["totals"]["cost"]
    assert rest(tinker_server, tinker_server.api_key, "PUT", f"/api/v1/budgets/tenant/{tenant}",
                json={"budget_usd": spent}).status_code == 200

    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        passes = []
        for _ in range(3):
            passes.append(tc.forward_backward(DATA, "cross_entropy"))  # not awaited, as the README's loop once did
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        for future in passes:
            with pytest.raises(tinker.APIStatusError, match=f"the budget of tenant {tenant} is"):
                future.result()
        deadline = time.monotonic() + 10  # the warning comes from the SDK's thread once each pass has failed
        while time.monotonic() < deadline and len([w for w in heard if "stepped on no gradient" in str(w.message)]) < 3:
            time.sleep(0.05)
    said = [str(w.message) for w in heard if "stepped on no gradient" in str(w.message)]
    assert len(said) == 3 and all(f"the budget of tenant {tenant} is" in m and tc.model_id in m for m in said), said

    sessions = rest(tinker_server, key, "GET", "/api/v1/usage/sessions").json()
    (session,) = [row for row in sessions["sessions"] if row["session_id"] == session_id]
    (run,) = session["runs"]
    assert (run["steps"], run["refused_steps"], run["skipped_steps"]) == (4, 3, 0), run
    assert run["last_refusal"]["status"] == 402 and run["last_refusal"]["request_type"] == "ForwardBackward"
    assert f"the budget of tenant {tenant} is" in run["last_refusal"]["message"]
    assert session["refusals"]["count"] == 3 and sessions["budget"]["state"] == "exhausted"  # the tenant's budget
    usage = rest(tinker_server, key, "GET", "/api/v1/usage", params={"session_id": session_id}).json()
    assert usage["refusals"]["count"] == 3 and usage["totals"]["cost"] == pytest.approx(spent, rel=1e-12)

    meter = CostMeter(session=client, poll_interval=None)
    kernel_meter = CostMeter(connection=meter.connection, poll_interval=None)
    dashboard = Dashboard(session=client, poll_interval=None)
    try:
        assert meter.refused_text.startswith("3 requests refused · the last, a ForwardBackward: 402 ")
        assert f"the budget of tenant {tenant} is" in meter.refused_text
        assert kernel_meter.refusals["count"] >= 3 and kernel_meter.budget["state"] == "exhausted"  # the tenant's
        assert "3 requests refused" in dashboard.refused.value and "402" in dashboard.refused.value
    finally:
        for widget in (meter, kernel_meter, dashboard):
            widget.close()


def test_a_key_budget_covers_every_request_sent_with_that_key_and_counts_what_is_in_flight(tinker_server):
    key = tinker_server.make_key("budget-key")
    other = tinker_server.make_key("budget-key")  # the same tenant's second key
    prefix = key[:12]  # how `stepwise keys list` shows a key
    assert rest(tinker_server, key, "PUT", f"/api/v1/budgets/key/{prefix}",
                json={"budget_usd": 2.5 * STEP_COST}).status_code == 200
    tc = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key).create_lora_training_client(
        base_model=BASE, rank=4).result()
    # Sent back to back, without waiting: the first two are admitted while nothing is in the ledger yet, so
    # only counting what is in flight keeps the third out.
    futures = [tc.forward_backward(DATA, "cross_entropy") for _ in range(3)]
    futures[0].result(), futures[1].result()
    with pytest.raises(tinker.APIStatusError) as refused:
        futures[2].result()
    assert refused.value.status_code == 402 and f"the budget of key {prefix} is" in str(refused.value)
    budget = rest(tinker_server, key, "GET", "/api/v1/budgets").json()["budgets"][0]
    assert budget["spent_usd"] == pytest.approx(2 * STEP_COST, rel=1e-9) and budget["pending_usd"] == 0
    # The tenant's other key has its own (no) budget.
    tc2 = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=other).create_lora_training_client(
        base_model=BASE, rank=4).result()
    tc2.forward_backward(DATA, "cross_entropy").result()


def test_budget_input_is_checked_and_a_bad_one_changes_nothing(tinker_server):
    key = tinker_server.make_key("budget-input")
    lavish = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key, user_metadata={"budget_usd": "lots"})
    with pytest.raises(tinker.BadRequestError, match="budget_usd must be a number"):  # the SDK opens its session lazily
        lavish.create_lora_training_client(base_model=BASE, rank=4)
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key, user_metadata={"budget_usd": "0.5"})
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    budgets = rest(tinker_server, key, "GET", "/api/v1/budgets").json()["budgets"]
    assert [(b["scope"], b["budget_usd"], b["state"]) for b in budgets] == [("session", 0.5, "ok")]
    target = budgets[0]["target"]
    for body, says in (({"budget_usd": -1}, "budget_usd must be a number from 0"),
                       ({"budget_usd": "nan"}, "budget_usd must be a number"),
                       ({"budget_tokens": 1.5}, "budget_tokens must be a whole number"),
                       ({}, "give budget_usd, budget_tokens or both")):
        r = rest(tinker_server, key, "PUT", f"/api/v1/budgets/session/{target}", json=body)
        assert r.status_code in (400, 422) and says in r.text, (body, r.text)
    assert [b["budget_usd"] for b in rest(tinker_server, key, "GET", "/api/v1/budgets").json()["budgets"]] == [0.5]
    # Someone else's session is not found; a tenant budget is the operator's.
    assert rest(tinker_server, tinker_server.make_key("budget-stranger"), "PUT", f"/api/v1/budgets/session/{target}",
                json={"budget_usd": 9}).status_code == 404
    assert rest(tinker_server, key, "PUT", "/api/v1/budgets/tenant/budget-input", json={"budget_usd": 9}).status_code == 403
    # The operator's tenant budget (in tokens here) covers all of the tenant's work.
    assert rest(tinker_server, tinker_server.api_key, "PUT", "/api/v1/budgets/tenant/budget-input",
                json={"budget_tokens": TRAIN_TOKENS}).status_code == 200
    tc.forward_backward(DATA, "cross_entropy").result()
    with pytest.raises(tinker.APIStatusError, match="the budget of tenant budget-input is"):
        tc.forward_backward(DATA, "cross_entropy").result()
    assert rest(tinker_server, key, "DELETE", f"/api/v1/budgets/session/{target}").status_code == 200


def test_money_is_written_in_plain_decimals():
    """What the refusals and the budget reports say: cents for real amounts, three significant digits for the
    tiny ones of a small model, never an exponent."""
    from kernel_backend.service.budgets import usd

    assert [usd(x) for x in (0, 2e-05, 3.36e-06, 0.000108, 0.5, 1234.5)] == [
        "$0", "$0.00002", "$0.00000336", "$0.000108", "$0.5000", "$1,234.5000"]
