"""Prefix caching in the batched decoder (kernel_backend/engine/prefix_cache.py).

A prompt that starts like one prefilled before, on the same weights, reuses its keys and values
(and its logprobs, for compute_logprobs): the results equal a cold computation (to float32 rounding), and changed
weights are never served from the cache.

On the tiny random stand-in for the default model (the `engine` fixture, tests/tiny_model.py): reuse and its
exactness are about the decoder's bookkeeping, the same for any weights. One test stays on the real SmolLM2-135M
(`real_engine`): that a seeded sample draws the same tokens after a cached prompt. The stand-in's next-token
distributions are nearly uniform over 49,152 tokens, so the float32 rounding a reused prefix may change (the
products' shapes differ) moves a draw to a neighbouring token id (seen on an AVX-512 Xeon: 32349 -> 32350); a
real model's distributions are peaked, and a draw moves only where two tokens are tied to the last bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import sft_datum, train
from kernel_backend.engine import prefix_cache
from kernel_backend.types import SampleOptions, SamplingParams

# The sampler's guarantee (fp32): a reused prefix changes only the shapes of the products, and with
# them the summation order (oneDNN's blocking depends on the row count, kernel_backend/engine/matmul.py).
ATOL = 1e-4
SYSTEM = "You are a pirate. Always talk like a pirate and say 'Arr!'"
ANSWERS = [" Arr, the sea be blue and deep!", " Ahoy, I like the color red.", " Arr! Gold, matey."]


@pytest.fixture
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is your favorite color?"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def emptied(engine):
    """engine.decoder with an empty prefix cache, before and after the test."""
    engine.reset_decoder()
    yield engine
    engine.reset_decoder()


@pytest.fixture
def fresh(engine):
    yield from emptied(engine)


@pytest.fixture
def fresh_real(real_engine):
    yield from emptied(real_engine)


def sequences(prompt, tokenizer) -> list[list[int]]:
    return [prompt + tokenizer.encode(answer) for answer in ANSWERS]


def cold_logprobs(engine, adapter, tokens) -> list:
    engine.reset_decoder()
    return engine.compute_logprobs(adapter, tokens)


@pytest.mark.parametrize("which", ["base", "adapter"])
def test_compute_logprobs_reuses_the_shared_prompt_and_gives_the_cold_numbers(fresh, tokenizer, adapters, prompt, which):
    engine = fresh
    adapter = None if which == "base" else adapters(rank=8, seed=3)
    if adapter is not None:
        train(engine, adapter, [sft_datum("Hi", "Arr!", tokenizer)], steps=1, learning_rate=1e-2)
    seqs = sequences(prompt, tokenizer)
    warm = [engine.compute_logprobs(adapter, seq) for seq in seqs]
    cache = engine.decoder.prefixes
    assert cache.hits == len(seqs) - 1  # every sequence after the first
    assert cache.reused_tokens >= (len(seqs) - 1) * (len(prompt) - 1)
    for seq, got in zip(seqs, warm):
        expected = cold_logprobs(engine, adapter, seq)
        assert got[0] is None and len(got) == len(seq)
        np.testing.assert_allclose(got[1:], expected[1:], rtol=0, atol=ATOL)


def test_requests_arriving_together_share_through_the_cache(fresh, tokenizer, prompt):
    """Four compute_logprobs-like requests in one batch: the first prefills, the others wait a step
    and reuse its keys, values and logprobs."""
    engine = fresh
    seqs = sequences(prompt, tokenizer) + [prompt + tokenizer.encode(" Blue.")]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests = [engine.sample_request(None, seq, 1, params, SampleOptions(prompt_logprobs=True)) for seq in seqs]
    results = engine.run_requests(requests)
    assert engine.decoder.prefixes.hits == len(seqs) - 1
    for seq, result in zip(seqs, results):
        np.testing.assert_allclose(result.prompt_logprobs[1:], cold_logprobs(engine, None, seq)[1:], rtol=0, atol=ATOL)


def test_sampling_after_a_cached_prompt_draws_the_same_tokens(fresh_real, tokenizer, prompt):
    engine = fresh_real
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, stop=[])
    cold = engine.sample(None, prompt, 3, params)
    engine.compute_logprobs(None, prompt + tokenizer.encode(ANSWERS[0]))  # holds the prompt with its logprobs
    hits = engine.decoder.prefixes.hits
    warm = engine.sample(None, prompt, 3, params)
    assert engine.decoder.prefixes.hits == hits + 1
    assert [s.tokens for s in warm.sequences] == [s.tokens for s in cold.sequences]
    for a, b in zip(warm.sequences, cold.sequences):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=ATOL)


def test_prompt_topk_is_computed_not_copied(fresh, tokenizer, prompt):
    """top-k prompt logprobs are not kept in the cache: the positions that need them are computed."""
    engine = fresh
    seq = sequences(prompt, tokenizer)[1]
    engine.compute_logprobs(None, sequences(prompt, tokenizer)[0])
    params = SamplingParams(max_tokens=1, temperature=0.0)
    warm = engine.sample(None, seq, 1, params, prompt_logprobs=True, topk_prompt_logprobs=3)
    engine.reset_decoder()
    cold = engine.sample(None, seq, 1, params, prompt_logprobs=True, topk_prompt_logprobs=3)
    np.testing.assert_allclose(warm.prompt_logprobs[1:], cold.prompt_logprobs[1:], rtol=0, atol=ATOL)
    for a, b in zip(warm.topk_prompt_logprobs[1:], cold.topk_prompt_logprobs[1:]):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], rtol=0, atol=ATOL)


def test_changed_weights_are_never_served_from_the_cache(fresh, tokenizer, adapters, prompt):
    engine = fresh
    adapter = adapters(rank=8, seed=4)
    first, second = sequences(prompt, tokenizer)[:2]
    engine.compute_logprobs(adapter, first)
    train(engine, adapter, [sft_datum("Hi", "Arr!", tokenizer)], steps=1, learning_rate=5e-2)  # weights move in place
    hits = engine.decoder.prefixes.hits
    after = engine.compute_logprobs(adapter, second)
    assert engine.decoder.prefixes.hits == hits  # the entry is of the old weights
    np.testing.assert_allclose(after[1:], cold_logprobs(engine, adapter, second)[1:], rtol=0, atol=ATOL)


def test_a_prompt_whose_weights_move_during_its_prefill_is_not_kept(fresh, tokenizer, adapters, prompt):
    """A prompt longer than a step's prefill budget is prefilled over several steps. An optimizer step
    in between (a live training adapter) leaves keys of two versions: they must not be cached."""
    engine = fresh
    adapter = adapters(rank=8, seed=5)
    decoder = engine.decoder
    decoder.prefill_tokens = 16  # the prompt takes several steps
    long = sequences(prompt, tokenizer)[0]
    assert len(long) > 2 * decoder.prefill_tokens
    request = lambda: engine.sample_request(adapter, long, 1, SamplingParams(max_tokens=1, temperature=0.0),  # noqa: E731
                                            SampleOptions(prompt_logprobs=True))
    moving = request()
    decoder.admit(moving)
    decoder.step()  # the first chunk, on the weights as they are
    train(engine, adapter, [sft_datum("Hi", "Arr!", tokenizer)], steps=1, learning_rate=5e-2)
    while moving.result is None and moving.error is None:
        decoder.step()
    assert moving.error is None and not decoder.prefixes.entries
    engine.run_requests([request()])  # the same prompt on still weights: kept
    assert [e.tokens for e in decoder.prefixes.entries.values()] == [long]


def test_the_cache_keeps_to_its_budget_and_keeps_the_longer_prompt():
    cache = prefix_cache.PrefixCache(budget_tokens=40)
    kv = lambda n: torch.zeros(1, 1, n, 2)  # noqa: E731
    cache.store(None, 0, list(range(10)), kv(10), kv(10), None)
    cache.store(None, 0, list(range(20)), kv(20), kv(20), None)  # extends the first: replaces it
    assert [len(e.tokens) for e in cache.entries.values()] == [20]
    cache.store(None, 0, list(range(12)), kv(12), kv(12), None)  # already held whole: nothing new
    assert cache.tokens == 20
    # The next turn of a conversation holds all of the last prompt but its generation header (3 tokens): it
    # replaces it. One that differs in more (a sibling answer, 10 tokens) is kept beside it.
    turns = prefix_cache.PrefixCache(budget_tokens=100)
    turns.store(None, 0, list(range(20)), kv(20), kv(20), None)
    turns.store(None, 0, list(range(17)) + [5] * 10, kv(27), kv(27), None)
    assert [len(e.tokens) for e in turns.entries.values()] == [27]
    turns.store(None, 0, list(range(17)) + [6] * 10, kv(27), kv(27), None)
    assert [e.tokens[-1] for e in turns.entries.values()] == [5, 6] and turns.tokens == 54
    cache.store(None, 0, [7] * 15, kv(15), kv(15), None)
    cache.store(None, 0, [9] * 15, kv(15), kv(15), None)  # 50 > 40: the least recently used goes
    assert cache.tokens <= 40 and [e.tokens[0] for e in cache.entries.values()] == [7, 9]
    entry, shared = cache.lookup(None, [7] * 12 + [1])
    assert shared == 12 and entry.tokens == [7] * 15
    assert cache.lookup(None, [7] * 5) == (None, 0)  # under MIN_SHARED_TOKENS
