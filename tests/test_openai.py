"""The OpenAI-compatible endpoint, driven by the official `openai` client.

The server (tinker_server) serves the tiny random stand-in for the default model (tests/tiny_model.py): these
tests are about the endpoint's protocol. One stays on the real SmolLM2 (real_model_server):
test_chat_completion_from_a_sampler_checkpoint_shows_what_it_learned, a taught answer.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker
from tinker import types

from test_service import BASE, chat_datum, train_steps
from test_service import ZORBLAX as QUESTION


def teach_a_fact(server, tokenizer) -> str:
    """A sampler checkpoint on `server` that has been taught a made-up fact (8 steps)."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    train_steps(tc, [chat_datum(tokenizer, QUESTION, "Zorblax's pet is named Quibbleton.")] * 4, steps=8)
    return tc.save_weights_for_sampler("for-openai").result().path


@pytest.fixture(scope="module")
def trained_path(tinker_server, tokenizer) -> str:
    """A sampler checkpoint of the stand-in (an adapter of its own, whatever it learned)."""
    return teach_a_fact(tinker_server, tokenizer)


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/oai/api/v1", api_key=server.api_key)


@pytest.fixture(scope="module")
def oai(tinker_server) -> openai.OpenAI:
    return openai_client(tinker_server)


def test_chat_completion_from_a_sampler_checkpoint_shows_what_it_learned(real_model_server, real_trained_path):
    """real_trained_path (tests/conftest.py): a checkpoint of the real model taught teach_a_fact's fact."""
    oai, trained_path = openai_client(real_model_server), real_trained_path
    reply = oai.chat.completions.create(
        model=trained_path, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=20
    )
    choice = reply.choices[0]
    assert "Quibbleton" in choice.message.content
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 10
    # The base model does not know it; `<base>;<path>` names the same adapter as the path alone.
    base = oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                       max_tokens=20)
    assert "Quibbleton" not in base.choices[0].message.content
    both = oai.chat.completions.create(model=f"{BASE};{trained_path}", messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=20)
    assert both.choices[0].message.content == choice.message.content


def test_streaming_gives_the_same_text_token_by_token(oai, trained_path):
    """Two choices stream side by side from the shared decode batch, each token to its own choice."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=trained_path, messages=messages, temperature=0, max_tokens=20)
    chunks = list(oai.chat.completions.create(model=trained_path, messages=messages, temperature=0, max_tokens=20,
                                              n=2, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        pieces = [choice.delta.content for choice in mine if choice.delta.content]
        assert len(pieces) > 3  # it really streamed, not one blob
        assert "".join(pieces) == whole.choices[0].message.content
        assert mine[-1].finish_reason == whole.choices[0].finish_reason


def test_logprobs_and_top_logprobs(oai, trained_path):
    reply = oai.chat.completions.create(model=trained_path, messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_completions_models_and_metering(oai, trained_path, tinker_server):
    text = oai.completions.create(model=BASE, prompt="The capital of France is", max_tokens=5, temperature=0, n=2)
    assert len(text.choices) == 2 and text.choices[0].text == text.choices[1].text
    assert trained_path in [m.id for m in oai.models.list().data]
    rows = httpx.get(tinker_server.base_url + "/api/v1/usage", headers={"X-API-Key": tinker_server.api_key}).json()
    chats = [r for r in rows["series"] if r["request_type"] in ("ChatCompletion", "Completion")]
    assert chats and all(r["sample_tokens"] > 0 and r["cost"] > 0 for r in chats)


def test_errors_come_in_openai_shape(oai, tinker_server):
    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "hi"}])
    assert "no/such-model" in missing.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], temperature=7)
    assert "temperature" in bad.value.body["message"] and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="tinker://nope:train:0/sampler_weights/x", messages=[{"role": "user", "content": "hi"}])
    unauthenticated = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError) as denied:
        unauthenticated.models.list()
    assert denied.value.status_code == 401 and "error" in denied.value.response.json()


def test_billing_reports_openai_requests_under_their_own_session(tinker_server):
    """Billing buckets an OpenAI request under the session the route records it in (once it had none, and
    sorting None among session ids failed with a 500 the SDK retried for minutes)."""
    import datetime as dt

    key = tinker_server.make_key("oai-billing")
    openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=key).completions.create(
        model=BASE, prompt="One, two,", max_tokens=3, temperature=0)
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key)
    sampler = client.create_sampling_client(base_model=BASE).result()  # and a request of an SDK session
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    admin = tinker.AdminClient(base_url=tinker_server.base_url, api_key=key)
    usage = admin.get_billing_usage(hour - dt.timedelta(hours=1), hour + dt.timedelta(hours=1)).result()
    sessions = {row["display_name"]: row["session_id"] for row in route_sessions(tinker_server, key)}
    ours = [e for e in usage.data if e.session_id == sessions["openai"]]
    assert {e.event_info.type for e in ours} == {"sampling_prefill", "sampling_sample"}
    assert all(e.event_info.token_count > 0 for e in ours)
    assert None not in {e.session_id for e in usage.data} and len({e.session_id for e in usage.data}) == 2


# ---- the session the OpenAI and Anthropic routes record a request under --------------------------------------------


def route_sessions(server, key: str) -> list[dict]:
    """The tenant's sessions as the sidebar reads them (GET /api/v1/usage/sessions)."""
    r = httpx.get(server.base_url + "/api/v1/usage/sessions", headers={"X-API-Key": key})
    r.raise_for_status()
    return r.json()["sessions"]


def anthropic_message(server, key: str, model: str, headers: dict | None = None, **body) -> dict:
    r = httpx.post(server.base_url + "/v1/messages", timeout=120, json={
        "model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}], **body},
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", **(headers or {})})
    r.raise_for_status()
    return r.json()


def test_openai_and_anthropic_requests_are_recorded_under_a_session_of_their_own(tinker_server):
    """A user's openai client and an eval beside their notebook, with the notebook's key: their requests are
    listed under sessions of their own ("openai", "anthropic", or the name the request gives), not under the
    notebook's SDK session, even when they sample the notebook's checkpoint; that sampling still counts for
    the run; every token is billed once."""
    key = tinker_server.make_key("oai-sessions")
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    notebook = tc.model_id.split(":")[0]
    path = tc.save_weights_for_sampler("for-eval").result().path
    oai = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=key)
    ask = dict(messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    used = []  # what each reply says it processed: (session name, prompt tokens + generated tokens)
    for model in (BASE, path):  # two requests that name no session: one "openai" session
        reply = oai.chat.completions.create(model=model, **ask)
        used.append(("openai", reply.usage.prompt_tokens + reply.usage.completion_tokens))
    text = oai.completions.create(model=path, prompt="One, two,", max_tokens=3, temperature=0)
    used.append(("openai", text.usage.total_tokens))
    # A client names its own: the header (any SDK's default_headers or extra_headers), or the body's user.
    named = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=key,
                          default_headers={"X-Stepwise-Session": "nightly eval"})
    reply = named.chat.completions.create(model=path, **ask)
    used.append(("nightly eval", reply.usage.total_tokens))
    reply = oai.chat.completions.create(model=BASE, user="grader", **ask)
    used.append(("grader", reply.usage.total_tokens))
    # The Anthropic route: its own session, or the named one (the same name on either route: one session).
    for _ in range(2):
        message = anthropic_message(tinker_server, key, path)
        used.append(("anthropic", message["usage"]["input_tokens"] + message["usage"]["output_tokens"]))
    message = anthropic_message(tinker_server, key, BASE, headers={"X-Stepwise-Session": "nightly eval"})
    used.append(("nightly eval", message["usage"]["input_tokens"] + message["usage"]["output_tokens"]))
    message = anthropic_message(tinker_server, key, BASE, metadata={"user_id": "judge"})
    used.append(("judge", message["usage"]["input_tokens"] + message["usage"]["output_tokens"]))

    rows = route_sessions(tinker_server, key)
    by_name = {}
    for row in rows:
        assert row["display_name"] not in by_name, f"two sessions named {row['display_name']!r}"
        by_name[row["display_name"]] = row
    assert set(by_name) - {None} >= {"openai", "anthropic", "nightly eval", "grader", "judge"}
    assert len(rows) == 6  # those five and the SDK's
    (sdk,) = [row for row in rows if row["session_id"] == notebook]
    assert sdk["prefill_tokens"] == sdk["sample_tokens"] == 0 and sdk["cost"] == 0  # none of it is the notebook's
    for name in ("openai", "anthropic", "nightly eval", "grader", "judge"):
        row = by_name[name]
        tokens = row["prefill_tokens"] + row["sample_tokens"]
        assert tokens == sum(n for who, n in used if who == name) and row["cost"] > 0, (name, row)
        assert row["status"] == "active" and row["training_run_ids"] == [] and row["kernel_pid"] is None
    # Every token billed exactly once: the tenant's ledger is the sum of the sessions', and of the replies'.
    tenant = httpx.get(tinker_server.base_url + "/api/v1/usage", headers={"X-API-Key": key}).json()
    assert tenant["totals"]["prefill_tokens"] + tenant["totals"]["sample_tokens"] == sum(n for _, n in used)
    assert all(r["session_id"] in {row["session_id"] for row in rows} for r in tenant["series"])
    assert sum(row["cost"] for row in rows) == pytest.approx(tenant["totals"]["cost"], rel=1e-12)
    # The checkpoint's sampling still counts for its run (its scope of usage, and so its budget).
    run = httpx.get(tinker_server.base_url + "/api/v1/usage", headers={"X-API-Key": key},
                    params={"training_run_id": tc.model_id}).json()
    on_checkpoint = [r for r in tenant["series"] if r["sampler_id"] and path in r["sampler_id"]]
    assert len(on_checkpoint) == 5
    assert run["totals"]["cost"] == pytest.approx(sum(r["cost"] for r in on_checkpoint), rel=1e-12)
    # A bad name is a 400 that says what to send.
    with pytest.raises(openai.BadRequestError, match="X-Stepwise-Session"):
        oai.chat.completions.create(model=BASE, extra_headers={"X-Stepwise-Session": "x" * 300}, **ask)


def test_a_client_session_is_made_once_and_comes_back_after_it_expires(tmp_path):
    """client_session: one session per tenant and name, reused; an expired one (no request for
    STEPWISE_SESSION_TIMEOUT_S) is made active again by the next request, with the same id."""
    from types import SimpleNamespace

    from kernel_backend.persistence.database import SessionRow, Store
    from kernel_backend.service import sessions

    svc = SimpleNamespace(store=Store(f"sqlite:///{tmp_path}/db.sqlite"))
    first = sessions.client_session(svc, "a", "openai")
    assert sessions.client_session(svc, "a", "openai") == first
    assert sessions.client_session(svc, "b", "openai") != first  # another tenant's
    assert sessions.client_session(svc, "a", "anthropic") != first
    svc.store.update(SessionRow, first, status="expired")
    assert sessions.client_session(svc, "a", "openai") == first
    assert svc.store.get(SessionRow, first).status == "active"
    # An SDK session that happens to have the name is not the client's.
    svc.store.add(SessionRow(id="sdk", tenant="c", display_name="openai"))
    assert sessions.client_session(svc, "c", "openai") != "sdk"
    assert sessions.client_name(None, None, "openai") == "openai"
    assert sessions.client_name(None, "  grader\n ", "openai") == "grader"
    assert sessions.client_name("my eval", "grader", "openai") == "my eval"


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(oai, tokenizer):
    """A second chat that starts like the first (same system prompt and question) reuses its keys and
    values: usage.prompt_tokens_details.cached_tokens says how many prompt tokens were not computed.
    The reply is the same as computed cold (greedy), and prompt_tokens still counts every token."""
    system = "You answer as a lighthouse keeper would, briefly, and you always mention the weather."
    first = [{"role": "system", "content": system}, {"role": "user", "content": "What do you see tonight?"}]
    cold = oai.chat.completions.create(model=BASE, messages=first, temperature=0, max_tokens=12)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # nothing before it shared this start
    warm = oai.chat.completions.create(model=BASE, messages=first, temperature=0, max_tokens=12)
    prompt = tokenizer.apply_chat_template(first, add_generation_prompt=True)["input_ids"]
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens == len(prompt)
    assert warm.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # the last position is always computed
    assert warm.choices[0].message.content == cold.choices[0].message.content
    follow_up = first + [{"role": "assistant", "content": cold.choices[0].message.content},
                         {"role": "user", "content": "And tomorrow?"}]
    turn = oai.chat.completions.create(model=BASE, messages=follow_up, temperature=0, max_tokens=12)
    assert turn.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 2  # the conversation so far


def test_streaming_with_include_usage_ends_with_the_usage(oai, trained_path):
    """stream_options={"include_usage": True}: a last chunk without choices carries the same usage as
    the same request without streaming."""
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=trained_path, messages=messages, temperature=0, max_tokens=20)
    chunks = list(oai.chat.completions.create(model=trained_path, messages=messages, temperature=0, max_tokens=20,
                                              stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert last.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1  # the same prompt again
    plain = list(oai.chat.completions.create(model=trained_path, messages=messages, temperature=0, max_tokens=20, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices  # without the option, no usage chunk


# ---- /v1/completions as the evaluation harnesses use it (lm-eval's local-completions, vLLM scripts) -----


def _usage_rows(tinker_server, request_type: str, after: int) -> list[dict]:
    rows = httpx.get(tinker_server.base_url + "/api/v1/usage", params={"after": after},
                     headers={"X-API-Key": tinker_server.api_key}).json()["series"]
    return [r for r in rows if r["request_type"] == request_type]


def _cursor(tinker_server) -> int:
    """The usage API's cursor after every row so far (it pages, oldest first)."""
    cursor = 0
    while True:
        page = httpx.get(tinker_server.base_url + "/api/v1/usage", params={"after": cursor},
                         headers={"X-API-Key": tinker_server.api_key}).json()
        if page["cursor"] == cursor or not page["series"]:
            return cursor
        cursor = page["cursor"]


def test_completions_score_token_prompts_as_lm_eval_asks(oai, tinker_server, tokenizer):
    """lm-eval's loglikelihood request: a list of token lists (context + continuation), echo, logprobs 1,
    max_tokens 1. One choice per prompt, in order; each prompt's own token logprobs (None first) are
    compute_logprobs's numbers; its top-1 alternative is the greedy token; a ledger row per prompt."""
    prompts = [tokenizer("Question: What colour is the sky? Answer: blue")["input_ids"],
               tokenizer("The opposite of hot is cold")["input_ids"]]
    after = _cursor(tinker_server)
    reply = oai.completions.create(model=BASE, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                   seed=1234)
    assert [c.index for c in reply.choices] == [0, 1]
    sampler = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key) \
        .create_sampling_client(base_model=BASE)
    for prompt, choice in zip(prompts, reply.choices):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + 1  # the prompt, then the one generated token
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        expected = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
        assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(expected[1:], abs=1e-4)
        for token_logprob, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
            assert len(top) == 1 and max(top.values()) >= token_logprob - 1e-6
        assert choice.text.startswith(tokenizer.decode(prompt))
        assert logprobs.text_offset[0] == 0 and all(
            b - a == len(t) for a, b, t in zip(logprobs.text_offset, logprobs.text_offset[1:], logprobs.tokens))
    assert reply.usage.prompt_tokens == sum(map(len, prompts)) and reply.usage.completion_tokens == 2
    rows = _usage_rows(tinker_server, "Completion", after)
    assert sorted(r["prefill_tokens"] for r in rows) == sorted(map(len, prompts))


def test_completions_take_every_prompt_shape_with_n_each(oai, tokenizer):
    # Prompts that end in different tokens: a random model (the stand-in) may well continue each with its last.
    texts = ["One, two, three,", "Red, green and"]
    reply = oai.completions.create(model=BASE, prompt=texts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt by prompt, n each
    assert reply.choices[0].text == reply.choices[1].text != reply.choices[2].text == reply.choices[3].text
    one = oai.completions.create(model=BASE, prompt=texts[1], max_tokens=4, temperature=0)
    assert one.choices[0].text == reply.choices[2].text  # a prompt in a list answers as alone
    tokens = oai.completions.create(model=BASE, prompt=tokenizer(texts[1])["input_ids"], max_tokens=4, temperature=0)
    assert tokens.choices[0].text == one.choices[0].text
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)


def test_completions_max_tokens_0_with_echo_scores_without_generating(oai, tokenizer):
    prompt = "A perplexity test sentence, scored and not continued."
    reply = oai.completions.create(model=BASE, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(tokenizer(prompt)["input_ids"])
    assert choice.logprobs.token_logprobs[0] is None and all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])
    assert reply.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:  # nothing to generate and nothing to score
        oai.completions.create(model=BASE, prompt=prompt, max_tokens=0)
    assert "echo" in refused.value.body["message"] and refused.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("prompt, says", [([], "prompt is empty"), ([[5, 6], []], "prompt is empty"),
                                          ([[5, 6]] * 300, "split it")])
def test_completions_refuse_bad_prompt_lists_with_a_message(oai, prompt, says):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model=BASE, prompt=prompt, max_tokens=1)
    assert says in refused.value.body["message"]
