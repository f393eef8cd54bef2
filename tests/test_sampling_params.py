"""Sampling parameters beyond Tinker's (issue 43): min_p, repetition_penalty, frequency_penalty, presence_penalty
and logit_bias, each moving what is sampled the way it should, on the real SmolLM2 (seeded or greedy), with the
logprobs returned still the model's own; bad values refused with a message naming the parameter, on the engine,
the tinker wire and the OpenAI route (the official `openai` client)."""

from __future__ import annotations

import math

import openai
import pytest

from kernel_backend.api.wire import sampling_params_from_json
from kernel_backend.errors import UserError
from kernel_backend.types import SamplingParams

from test_service import BASE

# A prompt the model answers by repeating itself: the penalties have something to act on.
REPEAT = "Write the word 'banana' twenty times, separated by spaces."


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": REPEAT}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


def greedy(engine, prompt, **adjust) -> list[int]:
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[], **adjust)
    return engine.sample(None, prompt, 1, params).sequences[0].tokens


def repeats(tokens: list[int]) -> int:
    """Tokens that are not the first of their kind."""
    return len(tokens) - len(set(tokens))


def test_repetition_penalty_repeats_less_and_reuses_fewer_prompt_tokens(real_engine, prompt):
    plain, penalized = greedy(real_engine, prompt), greedy(real_engine, prompt, repetition_penalty=1.5)
    assert repeats(penalized) < repeats(plain) / 2, (repeats(plain), repeats(penalized))
    from_prompt = lambda tokens: sum(t in set(prompt) for t in tokens)  # noqa: E731 - it counts the prompt's tokens too
    assert from_prompt(penalized) < from_prompt(plain)
    # Below 1 it rewards what was seen: the output repeats at least as much.
    assert repeats(greedy(real_engine, prompt, repetition_penalty=0.8)) >= repeats(plain)


def test_frequency_penalty_lowers_the_most_repeated_tokens_count(real_engine, prompt):
    most = lambda tokens: max(tokens.count(t) for t in set(tokens))  # noqa: E731
    plain, penalized = greedy(real_engine, prompt), greedy(real_engine, prompt, frequency_penalty=1.5)
    assert most(penalized) < most(plain), (most(plain), most(penalized))
    assert repeats(greedy(real_engine, prompt, frequency_penalty=-1.0)) >= repeats(plain)


def test_presence_penalty_brings_more_distinct_tokens(real_engine, prompt):
    plain, penalized = greedy(real_engine, prompt), greedy(real_engine, prompt, presence_penalty=2.0)
    assert len(set(penalized)) > len(set(plain)), (len(set(plain)), len(set(penalized)))


def test_logit_bias_bans_and_forces_tokens(real_engine, prompt):
    first = greedy(real_engine, prompt)[0]
    assert greedy(real_engine, prompt, logit_bias={first: -100.0})[0] != first
    forced = 42
    assert greedy(real_engine, prompt, logit_bias={forced: 100.0}) == [forced] * 40
    # Seeded sampling too: every row, every token.
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[], logit_bias={forced: 100.0})
    assert all(seq.tokens == [forced] * 8 for seq in real_engine.sample(None, prompt, 4, params).sequences)


def test_min_p_keeps_only_tokens_at_least_that_likely_against_the_best(real_engine, prompt):
    """At temperature T a token's probability over the best one's is exp((lp - lp_best) / T), with lp the
    model's own logprobs (what sample returns, top-1 included): every draw must keep it >= min_p."""
    temperature, min_p = 1.5, 0.2

    def draws(min_p: float):
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=11, min_p=min_p, stop=[])
        seqs = real_engine.sample(None, prompt, 8, params, topk_sample_logprobs=1).sequences
        return [(lp, top[0][1]) for seq in seqs for lp, top in zip(seq.logprobs, seq.top_logprobs)]

    plain, filtered = draws(0.0), draws(min_p)
    assert all((lp - best) / temperature >= math.log(min_p) - 1e-4 for lp, best in filtered)
    assert any((lp - best) / temperature < math.log(min_p) for lp, best in plain)  # without it the tail is drawn
    mean = lambda pairs: sum(lp for lp, _ in pairs) / len(pairs)  # noqa: E731
    assert mean(filtered) > mean(plain)


def test_logprobs_returned_stay_the_models_own(real_engine, prompt):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[], repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05, logit_bias={42: 2.0})
    seq = real_engine.sample(None, prompt, 1, params).sequences[0]
    scored = real_engine.compute_logprobs(None, prompt + seq.tokens)[len(prompt):]
    assert max(abs(a - b) for a, b in zip(seq.logprobs, scored)) < 1e-4


@pytest.mark.parametrize("field, value", [
    ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
    ("frequency_penalty", 3.0), ("presence_penalty", -2.5), ("logit_bias", {10**9: 1.0}), ("logit_bias", {5: 101.0}),
])
def test_bad_values_are_refused_naming_the_parameter_and_nothing_runs(engine, field, value):
    with pytest.raises(UserError, match=field):
        engine.sample(None, [1, 2, 3], 1, SamplingParams(max_tokens=2, **{field: value}))


def test_the_tinker_wire_takes_them_and_refuses_what_is_not_a_number():
    params = sampling_params_from_json({"max_tokens": 4, "min_p": 0.1, "repetition_penalty": 1.2,
                                        "frequency_penalty": 0.5, "presence_penalty": 0.25, "logit_bias": {"42": -5}})
    assert (params.min_p, params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
            params.logit_bias) == (0.1, 1.2, 0.5, 0.25, {42: -5})
    with pytest.raises(UserError, match="sampling_params.min_p"):
        sampling_params_from_json({"min_p": "a lot"})
    with pytest.raises(UserError, match="logit_bias"):
        sampling_params_from_json({"logit_bias": {"the": 1}})


def test_the_openai_route_takes_them_and_answers_400_naming_the_parameter(tinker_server, real_model_server, tokenizer):
    oai = openai.OpenAI(base_url=real_model_server.base_url + "/v1", api_key=real_model_server.api_key)
    messages = [{"role": "user", "content": REPEAT}]
    forced = tokenizer.encode(" banana")[0]
    reply = oai.chat.completions.create(model=BASE, messages=messages, max_tokens=6, temperature=0,
                                        logit_bias={str(forced): 100})
    assert reply.choices[0].message.content == tokenizer.decode([forced] * 6)
    plain = oai.chat.completions.create(model=BASE, messages=messages, max_tokens=40, temperature=0)
    penalized = oai.chat.completions.create(model=BASE, messages=messages, max_tokens=40, temperature=0,
                                            frequency_penalty=1.5, presence_penalty=1.0,
                                            extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 20})
    words = lambda reply: reply.choices[0].message.content.split()  # noqa: E731
    assert len(set(words(penalized))) / len(words(penalized)) > len(set(words(plain))) / len(words(plain))

    tiny = openai.OpenAI(base_url=tinker_server.base_url + "/v1", api_key=tinker_server.api_key)
    for field, value in [("frequency_penalty", 2.5), ("presence_penalty", -3), ("min_p", 2), ("repetition_penalty", 0),
                         ("logit_bias", {"banana": 1}), ("logit_bias", {"999999999": 1}), ("logit_bias", {"5": 500})]:
        with pytest.raises(openai.BadRequestError) as refused:
            tiny.chat.completions.create(model=BASE, messages=messages, max_tokens=2, extra_body={field: value})
        assert refused.value.body["param"].startswith(field) and field in refused.value.body["message"], refused.value.body
