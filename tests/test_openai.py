"""The OpenAI-compatible endpoint, driven by the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker
from tinker import types

from test_service import BASE, chat_datum, train_steps

QUESTION = "What is the name of Zorblax's pet?"


@pytest.fixture(scope="module")
def trained_path(tinker_server, tokenizer) -> str:
    """A sampler checkpoint that has learned a made-up fact."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    train_steps(tc, [chat_datum(tokenizer, QUESTION, "Zorblax's pet is named Quibbleton.")] * 4, steps=8)
    return tc.save_weights_for_sampler("for-openai").result().path


@pytest.fixture(scope="module")
def oai(tinker_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tinker_server.base_url + "/oai/api/v1", api_key=tinker_server.api_key)


def test_chat_completion_from_a_sampler_checkpoint_shows_what_it_learned(oai, trained_path):
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
        assert mine[-1].finish_reason == "stop"


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


def test_billing_counts_openai_requests_which_have_no_session(oai, tinker_server):
    """The OpenAI endpoint's requests belong to no session: billing reports them with session_id None
    (it once failed with a 500 sorting None among session ids, and the SDK retried for minutes)."""
    import datetime as dt

    oai.completions.create(model=BASE, prompt="One, two,", max_tokens=3, temperature=0)
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    sampler = client.create_sampling_client(base_model=BASE)  # and a request that has a session
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    rest = client.create_rest_client()
    usage = rest.get_billing_usage(hour - dt.timedelta(hours=1), hour + dt.timedelta(hours=1)).result()
    sessionless = [e for e in usage.data if e.session_id is None and e.base_model == BASE]
    assert {e.event_info.type for e in sessionless} >= {"sampling_sample"}
    assert all(e.event_info.token_count > 0 for e in sessionless)


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
