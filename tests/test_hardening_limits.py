"""Hardening, limits that hold: what a client could once bypass, against `shared_server`.

- tokens per minute count work when it is admitted, on every route that does model work
  (forward_backward, asample, /v1/completions, /v1/chat/completions);
- optim_step without a seq_id is never deduplicated into another request;
- a step that would make the adapter non-finite is refused, the adapter kept as it was;
- only operator-registered models load, and nothing a tenant sees names a server folder;
- /admin/stats takes only the operator's key; the database file is readable by its owner only.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): the limits count tokens, requests and bytes, which any model's requests have.
"""

from __future__ import annotations

import os
import stat

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from conftest import SHARED_LIMITS
from test_hardening_input import refused
from test_service_http import DATA, Api, datum

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROTO = {"Content-Type": "application/x-protobuf"}
LIMIT = int(SHARED_LIMITS["STEPWISE_TOKENS_PER_MINUTE"])


def test_tokens_per_minute_count_admitted_work_on_every_model_route(shared_server):
    key = shared_server.make_key("rate")
    api = Api(shared_server, key=key)
    session = api.session()
    model_id = api.model(session, 0, seed=0)
    sampler = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": BASE}).json()["sampling_session_id"]
    oai = openai.OpenAI(base_url=shared_server.base_url + "/v1", api_key=key, max_retries=0)

    # Ten back-to-back 101-token calls, none waited for: only what fits the limit is admitted.
    long_datum = [datum(list(range(100, 202)))]
    answers = [api.http.post("/forward_backward", content=api.fb_body(model_id, seq, long_datum, forward_only=True),
                             headers=PROTO) for seq in range(1, 11)]
    admitted = [a for a in answers if a.status_code == 200]
    assert len(admitted) == LIMIT // 101 == 2
    for answer in answers[2:]:
        refused(answer, 429, "would pass the limit of 300 tokens per minute")
        assert int(answer.headers["Retry-After"]) > 0

    # 98 tokens are left this minute: a sampling request that could take more is refused on every route.
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    refused(api.post("/asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": prompt,
                                  "sampling_params": {"max_tokens": 100}}), 429, "tokens per minute")
    with pytest.raises(openai.RateLimitError) as completion:
        oai.completions.create(model=BASE, prompt=[1, 2], max_tokens=100)
    assert "tokens per minute" in completion.value.body["message"]
    assert int(completion.value.response.headers["Retry-After"]) > 0
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    with pytest.raises(openai.RateLimitError):
        oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=100,
                                    stream=True)
    # A request that could never fit is a 400 that says so, not a 429 to retry forever.
    with pytest.raises(openai.BadRequestError, match="split it"):
        oai.completions.create(model=BASE, prompt=[1, 2], max_tokens=LIMIT)
    # A batch of prompts is admitted as one: each of these four would fit alone, together they pass
    # the 98 tokens left, so none runs (the totals below count no Completion for them).
    with pytest.raises(openai.RateLimitError):
        oai.completions.create(model=BASE, prompt=[[1, 2]] * 4, max_tokens=23)
    # What still fits runs.
    assert oai.completions.create(model=BASE, prompt=[1, 2], max_tokens=5, temperature=0).choices

    for answer in admitted:
        assert api.wait(answer.json()["request_id"]).status_code == 200
    totals = api.http.get("/usage").json()["totals"]
    assert totals["prefill_tokens"] == 2 * 101 + 2 and totals["requests"] == 1 + 2 + 1  # create_model, 2 passes, 1 completion


def test_optim_step_without_seq_id_is_never_deduplicated(shared_server):
    api = Api(shared_server, key=shared_server.make_key("no-seq"))
    session = api.session()
    twice, once = api.model(session, 0, seed=5), api.model(session, 1, seed=5)
    step = {"adam_params": {"learning_rate": 1e-2}}  # no seq_id
    ids = []
    for seq in (1, 2):
        api.forward_backward(twice, seq, DATA)
        request_id = api.post("/optim_step", {**step, "model_id": twice}).json()["request_id"]
        assert "metrics" in api.wait(request_id).json()
        ids.append(request_id)
    assert ids[0] != ids[1]
    api.forward_backward(once, 1, DATA)
    api.wait(api.post("/optim_step", {**step, "model_id": once}).json()["request_id"])
    assert api.loss(twice, 10, DATA) != api.loss(once, 10, DATA)  # the second step was applied, not dropped
    kinds = [row["request_type"] for row in api.http.get("/usage", params={"training_run_id": twice}).json()["series"]]
    assert kinds.count("OptimStep") == 2


def test_a_step_that_makes_the_adapter_non_finite_is_refused_and_undone(shared_server):
    client = tinker.ServiceClient(base_url=shared_server.base_url, api_key=shared_server.make_key("absurd-lr"))
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    before = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    with pytest.raises(tinker.RequestFailedError, match="non-finite") as absurd:
        tc.optim_step(types.AdamParams(learning_rate=1e30)).result()
    assert "unchanged" in str(absurd.value)
    after = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(after, before)
    # The gradients were kept too: a sensible step right after still learns from them.
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    learned = tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.isfinite(learned).all() and learned.sum() > before.sum()


def test_only_registered_models_load_and_no_server_folder_is_shown(shared_server):
    key = shared_server.make_key("paths")
    api = Api(shared_server, key=key)
    session = api.session()
    folder = shared_server.tokenizer_dir  # a real model folder on the server, with its config.json
    message = refused(api.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": folder}),
                      400, "unknown base model", "STEPWISE_BASE_MODELS")
    assert folder not in message
    model_id = api.model(session, 1, seed=0)
    info = api.post("/get_info", {"model_id": model_id}).json()
    assert info["model_data"]["tokenizer_id"] == BASE
    listed = [m["model_name"] for m in api.http.get("/get_server_capabilities").json()["supported_models"]]
    listed += [m["id"] for m in httpx.get(shared_server.base_url + "/v1/models",
                                          headers={"Authorization": f"Bearer {key}"}).json()["data"]]
    assert BASE in listed and not [name for name in listed if name.startswith("/") or str(shared_server.home) in name]


def test_admin_stats_takes_the_operators_key_only(shared_server):
    tenant = Api(shared_server, key=shared_server.make_key("curious"))
    refused(tenant.http.get("/admin/stats"), 403, "operator")
    refused(tenant.http.get("/cluster"), 403, "operator")
    assert "adapters" in Api(shared_server).http.get("/admin/stats").json()  # STEPWISE_LOCAL_KEY's tenant
    cluster = Api(shared_server).http.get("/cluster").json()  # the in-process engine, as one worker
    assert cluster["mode"] == "in-process" and cluster["workers"][0]["models"] == [BASE]


def test_the_database_is_readable_by_its_owner_only(shared_server):
    for name in ("stepwise.db", "stepwise.db-wal"):
        path = shared_server.home / name
        if path.exists():
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name


def test_recorded_stability_info_is_capped_per_session_when_admitted(tmp_path):
    """A session's recorded tokens (stable_reinforce) are capped: a sample request counts at its most when admitted,
    against what is recorded plus what requests in flight reserved; other sessions have their own cap; what
    a request really recorded replaces its reservation; expired rows no longer count."""
    import datetime as dt
    from types import SimpleNamespace

    from kernel_backend.service import stability
    from kernel_backend.persistence.database import StabilityRow, Store
    from kernel_backend.types import SampledSequence, SampleResult
    from kernel_backend.errors import UserError

    store = Store(f"sqlite:///{tmp_path}/db.sqlite")
    recorder = stability.Recorder(SimpleNamespace(max_stability_tokens=100), store)
    recorder.admit("s1", "r1", stability.most_tokens(prompt_tokens=10, num_samples=2, max_tokens=20))  # 60
    with pytest.raises(UserError, match="holds 60 of its 100 .*STEPWISE_MAX_STABILITY_TOKENS"):
        recorder.admit("s1", "r2", 50)
    recorder.admit("s2", "r3", 100)
    result = SampleResult([SampledSequence([5, 6], [-0.5, -1.0], "stop"), SampledSequence([7], [-2.0], "stop")])
    stability.record(store, "t", "s1", ["r1:0", "r1:1"], list(range(10)), result)
    recorder.settle("r1")
    assert store.stability_tokens("s1") == 23  # two sequences, each with its 10-token prompt
    recorder.admit("s1", "r2", 77)
    with pytest.raises(UserError, match="holds 100 of its 100"):
        recorder.admit("s1", "r4", 1)
    store.keep_stability(["r1:0", "r1:1"], dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1))
    assert store.stability_tokens("s1") == 0 and store.stability_rows(["r1:0"]) == {}
    assert store.delete_stability(StabilityRow.session_id == "s1") == 2
