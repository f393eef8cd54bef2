"""The engine, no fakes: on the tiny random stand-in for the default model (the `engine` fixture,
tests/tiny_model.py), since almost everything here is about behaviour, not what the model learns.

Covers the foundation's promises: `sample` logprobs equal `compute_logprobs` (and `forward`); every
sampling option answers what the model computes; adapters over one base do not touch each other, alone
or batched together; save_state / load_state resumes exactly (in a fresh Engine too); bad input raises
UserError that names the field and leaves weights, gradients and optimizer state unchanged.

Two tests stay on the real SmolLM2-135M (`real_engine`): SFT teaches a made-up fact (what a model
learns), and alternative prompt tokens are drawn at the request's temperature (a random model's
distributions are nearly flat, the same at any temperature, so they cannot tell one from another).

Every test makes its own adapters with fresh ids (the `adapters` fixture), so order does not matter.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers import (chat_prompt, default_tokenizer, chat_tokens, forward_logprobs, model_logprobs, new_id, sft_datum,
                     shifted_datum, target_ids, train)
from kernel_backend.engine.core import Engine, Pass
from kernel_backend.types import AdamParams, Datum, ForwardResult, LoraConfig, SampleOptions, SamplingParams
from kernel_backend.errors import UserError

FACTS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate."),
]
PROBE = ("Name a colour of the sky.", "The sky is often blue.")
POEM_PROMPT = "Write one line of a poem about the sea."


def _grads(engine, adapter_id) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in engine.slots[adapter_id].adapter.parameters()]


def _zero_grads(engine, adapter_id) -> None:
    for p in engine.slots[adapter_id].adapter.parameters():
        p.grad = None


def _weights(engine, adapter_id) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.slots[adapter_id].adapter.state_dict().items()}


# ---- a. SFT learns a made-up fact ---------------------------------------------------------------


def test_sft_teaches_made_up_facts(real_engine, tokenizer):
    """On the real model: what it learns is the point (`adapters` makes adapters on the tiny engine)."""
    engine = real_engine
    adapter = new_id("facts")
    engine.create_adapter(adapter, LoraConfig(rank=16, seed=0))
    data = [sft_datum(q, a, tokenizer) for q, a in FACTS]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)

    def answer(question: str) -> tuple[str, str]:
        seq = engine.sample(adapter, chat_prompt(question, tokenizer), 1, greedy).sequences[0]
        return tokenizer.decode(seq.tokens, skip_special_tokens=True).strip(), seq.stop_reason

    try:
        for question, taught in FACTS:  # the base model cannot know a made-up fact
            assert answer(question)[0] != taught

        step_losses = []
        for _ in range(30):
            result = engine.forward_backward(adapter, data)
            engine.optim_step(adapter, AdamParams(learning_rate=1e-3))
            step_losses.append(result.metrics["loss:sum"])
            if step_losses[-1] < step_losses[0] / 20:
                break
        final = engine.forward(adapter, data).metrics["loss:sum"]
        assert final <= step_losses[0] / 2, step_losses
        print(f"SFT: {len(step_losses)} steps, loss {step_losses[0]:.2f} -> {final:.4f}")
        for question, taught in FACTS:
            text, stop_reason = answer(question)
            assert text == taught, (question, text, step_losses)
            assert stop_reason == "stop"  # it learned to end the turn, too
    finally:
        engine.delete_adapter(adapter)


# ---- b. sample logprobs == compute_logprobs == forward logprobs ---------------------------------


@pytest.mark.parametrize("which", ["base", "untrained", "trained"])
def test_sample_logprobs_equal_compute_logprobs(engine, tokenizer, adapters, which):
    adapter = None if which == "base" else adapters(rank=8, seed=1)
    if which == "trained":
        train(engine, adapter, [sft_datum(q, a, tokenizer) for q, a in FACTS], steps=3, learning_rate=2e-3)
    prompt = chat_prompt(POEM_PROMPT, tokenizer)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, stop=[])
    result = engine.sample(adapter, prompt, 4, params)
    assert len(result.sequences) == 4
    sampled = []
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 12 and seq.stop_reason == "length"
        recomputed = engine.compute_logprobs(adapter, prompt + seq.tokens)
        assert recomputed[0] is None and len(recomputed) == len(prompt) + 12
        np.testing.assert_allclose(recomputed[len(prompt) :], seq.logprobs, rtol=0, atol=1e-4)
        # The training path (forward) agrees with the sampling path on the same tokens.
        fwd = forward_logprobs(engine, adapter, [shifted_datum(prompt + seq.tokens)])[0] if adapter else None
        if fwd is not None:
            np.testing.assert_allclose(fwd, recomputed[1:], rtol=0, atol=1e-4)
        sampled.extend(seq.logprobs)
    # Meaningful only if temperature-1 sampling drew unlikely tokens, not just the argmax.
    assert len({tuple(s.tokens) for s in result.sequences}) > 1
    if which != "trained":
        assert min(sampled) < -1.0, sampled


def test_sampling_is_seeded(engine, tokenizer):
    prompt = chat_prompt(POEM_PROMPT, tokenizer)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])
    first = engine.sample(None, prompt, 3, params)
    again = engine.sample(None, prompt, 3, params)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.logprobs for s in first.sequences] == [s.logprobs for s in again.sequences]


def test_prompt_logprobs_and_topk_are_consistent(engine, tokenizer, adapters):
    adapter = adapters(rank=8, seed=2)
    train(engine, adapter, [sft_datum(*FACTS[0], tokenizer)], steps=2, learning_rate=2e-3)
    _, tokens = chat_tokens(*PROBE, tokenizer)
    k = 5
    result = engine.sample(
        adapter, tokens, 1, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True, topk_prompt_logprobs=k
    )
    plp, topk = result.prompt_logprobs, result.topk_prompt_logprobs
    assert len(plp) == len(topk) == len(tokens)
    assert plp[0] is None and topk[0] is None
    np.testing.assert_allclose(plp[1:], engine.compute_logprobs(adapter, tokens)[1:], rtol=0, atol=1e-5)
    for i in range(1, len(tokens)):
        pairs = topk[i]
        assert len(pairs) == k
        values = [lp for _, lp in pairs]
        assert values == sorted(values, reverse=True)
        assert all(isinstance(t, int) and 0 <= t < engine.vocab_size for t, _ in pairs)
        assert values[0] >= plp[i] - 1e-6  # nothing beats the top-1
        assert sum(np.exp(values)) <= 1 + 1e-4
        actual = dict(pairs).get(tokens[i])
        if actual is not None:
            assert abs(actual - plp[i]) < 1e-5
    # The top-1 at the last prompt position is what greedy sampling picks there.
    j = len(tokens) - 1
    greedy = engine.sample(adapter, tokens[:j], 1, SamplingParams(max_tokens=1, temperature=0.0, stop=[]))
    assert greedy.sequences[0].tokens[0] == topk[j][0][0]
    assert abs(greedy.sequences[0].logprobs[0] - topk[j][0][1]) < 1e-4


def test_sampling_options_answer_what_the_model_computes(engine, tokenizer, pair):
    """Each option against a hand computation, log_softmax (float64) of the logits of transformers' own
    forward under the same adapter: the k most likely tokens at every sampled position; the logprobs
    of named ids at named prompt positions, dense and sparse (0.0 where a cell names none); k draws
    at every prompt position, from the model's distribution at the request's temperature, with their
    logprobs; prompt logprobs and top-k for the last n prompt tokens only."""
    a = pair[0]
    _, prompt = chat_tokens(*PROBE, tokenizer)
    n, k, last_n = len(prompt), 4, 7
    named = np.full((n - 1, 3), -1)
    named[5:, 0] = prompt[6:]  # each prompt token, from position 6 on
    named[5::3, 1] = tokenizer.eos_token_id
    named[-1, 2] = 0
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    options = dict(prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=last_n, topk_sample_logprobs=k,
                   prompt_alt_tokens_k=20)
    dense = engine.sample(a, prompt, 2, params, target_prompt_logprobs=target_ids(named), **options)
    sparse = engine.sample(a, prompt, 2, params, target_prompt_logprobs=target_ids(named, sparse=True), **options)
    reference = model_logprobs(engine, a, prompt)  # row p: the distribution of the token after position p

    # Targets: cell (i, j) is named[i, j]'s logprob at prompt position i + 1, predicted at position i.
    expected = np.where(named >= 0, reference[np.arange(n - 1)[:, None], np.maximum(named, 0)].numpy(), 0.0)
    np.testing.assert_allclose(dense.target_prompt_logprobs.reshape(n - 1, 3), expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(sparse.target_prompt_logprobs, expected[named >= 0], rtol=0, atol=1e-4)

    # The last n prompt tokens' logprobs and top-k; None before them.
    assert dense.prompt_logprobs[: n - last_n] == dense.topk_prompt_logprobs[: n - last_n] == [None] * (n - last_n)
    scored = range(n - last_n, n)
    np.testing.assert_allclose(dense.prompt_logprobs[n - last_n :], [reference[p - 1, prompt[p]] for p in scored],
                               rtol=0, atol=1e-4)
    for p in scored:
        top = torch.topk(reference[p - 1], 3)
        assert [t for t, _ in dense.topk_prompt_logprobs[p]] == top.indices.tolist()
        np.testing.assert_allclose([lp for _, lp in dense.topk_prompt_logprobs[p]], top.values, rtol=0, atol=1e-4)

    # The k most likely tokens at every sampled position, given the prompt and the tokens before.
    for seq in dense.sequences:
        continued = model_logprobs(engine, a, prompt + seq.tokens)
        assert len(seq.top_logprobs) == len(seq.tokens)
        for j, top in enumerate(seq.top_logprobs):
            want = torch.topk(continued[n - 1 + j], k)
            assert [t for t, _ in top] == want.indices.tolist()
            np.testing.assert_allclose([lp for _, lp in top], want.values, rtol=0, atol=1e-4)

    # Alternative tokens: 20 draws at each of the n - 1 positions, each with its model logprob (not the
    # temperature's), at either temperature; greedy draws are the most likely token. (That the draws follow
    # the request's temperature needs a peaked distribution: the next test, on the real model.)
    alt = dense.prompt_alt_tokens
    assert alt.shape == (n - 1, 20)
    assert np.array_equal(sparse.prompt_alt_tokens, alt)  # the same seed, the same draws
    cool = engine.sample(a, prompt, 1, SamplingParams(max_tokens=1, temperature=0.5, seed=1), prompt_alt_tokens_k=20)
    for result in (dense, cool):
        drawn = result.prompt_alt_tokens
        np.testing.assert_allclose(result.prompt_alt_logprobs, reference[np.arange(n - 1)[:, None], drawn].numpy(),
                                   rtol=0, atol=1e-4)
    greedy = engine.sample(a, prompt, 1, SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=3)
    assert (greedy.prompt_alt_tokens == reference[:-1].argmax(-1).numpy()[:, None]).all()


def test_alternative_prompt_tokens_are_drawn_at_the_request_temperature(real_engine, tokenizer):
    """The share of draws that are their position's most likely token is, on average, that token's
    probability at the request's temperature, not at another. On the real model: a random model's
    distributions are nearly flat, its most likely tokens about as rare at 0.5 as at 1.0."""
    _, prompt = chat_tokens(*PROBE, tokenizer)
    reference = model_logprobs(real_engine, None, prompt)[:-1]  # row p: the distribution of the token after p
    best = reference.argmax(-1).numpy()[:, None]
    at = {t: float((reference / t).softmax(-1).max(-1).values.mean()) for t in (1.0, 0.5)}
    for t, other, seed in ((1.0, 0.5, 5), (0.5, 1.0, 1)):
        drawn = real_engine.sample(None, prompt, 1, SamplingParams(max_tokens=1, temperature=t, seed=seed),
                                   prompt_alt_tokens_k=20).prompt_alt_tokens
        share = float((drawn == best).mean())
        assert abs(share - at[t]) < 0.05 < abs(share - at[other]), (t, share, at)


# ---- b2. one continuous batch: requests decode together, each as if alone --------------------------


def _decode_together(engine, first, later=(), join_after=3):
    """Decode requests in the engine's one batch: `first` from the start, `later` joining after
    `join_after` steps, while the first ones are still decoding. Returns results (or errors) in order."""
    decoder = engine.decoder
    for request in first:
        decoder.admit(request)
    left, steps = {id(r) for r in [*first, *later]}, 0
    while left:
        if later and steps == join_after:
            assert decoder.rows, "the first requests should still be decoding when the others join"
            for request in later:
                decoder.admit(request)
        left -= {id(r) for r in decoder.step()}
        steps += 1
    return [r.error or r.result for r in [*first, *later]]


def _assert_same_samples(got, expected):
    """The same tokens, stop reasons and logprobs, and the same answer to every option the request asked."""
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in expected.sequences]
    for g, e in zip(got.sequences, expected.sequences):
        np.testing.assert_allclose(g.logprobs, e.logprobs, rtol=0, atol=1e-4)
        _assert_same_topk(g.top_logprobs, e.top_logprobs)
    assert (got.prompt_logprobs is None) == (expected.prompt_logprobs is None)
    if got.prompt_logprobs is not None:
        assert [lp is None for lp in got.prompt_logprobs] == [lp is None for lp in expected.prompt_logprobs]
        np.testing.assert_allclose([lp for lp in got.prompt_logprobs if lp is not None],
                                   [lp for lp in expected.prompt_logprobs if lp is not None], rtol=0, atol=1e-4)
    _assert_same_topk(got.topk_prompt_logprobs, expected.topk_prompt_logprobs)
    assert (got.targets is None) == (expected.targets is None)
    if got.targets is not None:
        np.testing.assert_allclose(got.target_prompt_logprobs, expected.target_prompt_logprobs, rtol=0, atol=1e-4)
    assert (got.prompt_alt_tokens is None) == (expected.prompt_alt_tokens is None)
    if got.prompt_alt_tokens is not None:
        assert np.array_equal(got.prompt_alt_tokens, expected.prompt_alt_tokens)
        np.testing.assert_allclose(got.prompt_alt_logprobs, expected.prompt_alt_logprobs, rtol=0, atol=1e-4)


def _assert_same_topk(got, expected):
    """Top-k lists per position (None where nothing was computed): the same ids, logprobs within 1e-4."""
    assert (got is None) == (expected is None)
    if got is not None:
        assert [row and [t for t, _ in row] for row in got] == [row and [t for t, _ in row] for row in expected]
        np.testing.assert_allclose([lp for row in got if row for _, lp in row],
                                   [lp for row in expected if row for _, lp in row], rtol=0, atol=1e-4)


def test_requests_decoded_together_equal_each_alone(engine, tokenizer, pair):
    """Adapters, prompts, sample counts, sampling rules and options mixed in one batch, three requests
    joining mid-decode: greedy and seeded rows give the tokens they give alone, every logprob equals
    compute_logprobs, each request's stop rule holds, and what a request asks besides its samples
    (top-k logprobs, targets' logprobs, alternative prompt tokens, the last n prompt logprobs) is what
    it gets alone."""
    a, b, _, _ = pair
    poem, probe = chat_prompt(POEM_PROMPT, tokenizer), chat_prompt(PROBE[0], tokenizer)
    # The stop rules are tried on a seeded row: a random model's greedy rows repeat their last token, its seeded
    # rows' tokens are varied. A stop token it reaches at its 6th token, a stop string across its 8th and 9th.
    drawn = SamplingParams(max_tokens=12, temperature=1.0, seed=13, stop=[])
    row = engine.sample(None, poem, 1, drawn).sequences[0].tokens
    stop_token, stop_text = row[5], tokenizer.decode(row[7:9])
    assert stop_text in tokenizer.decode(row)
    named = np.full((len(probe) - 1, 2), -1)
    named[len(probe) // 2 :, 0] = probe[len(probe) // 2 + 1 :]
    named[-1, 1] = stop_token
    specs = [  # (adapter, prompt, num_samples, params, options)
        (None, poem, 1, replace(drawn, stop=[stop_token]), None),
        (a, probe, 3, SamplingParams(max_tokens=10, temperature=1.0, seed=11, stop=[]),
         SampleOptions(topk_sample_logprobs=3, prompt_alt_tokens_k=4, target_prompt_logprobs=target_ids(named))),
        (b, poem, 2, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=12),
         SampleOptions(prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=5, topk_sample_logprobs=1)),
        (None, poem, 1, replace(drawn, max_tokens=16, stop=[stop_text]), None),
        (None, probe, 1, SamplingParams(max_tokens=12, temperature=0.0, stop=[]), None),
    ]
    alone = [engine.run_requests([engine.sample_request(*spec)])[0] for spec in specs]
    together = _decode_together(engine, [engine.sample_request(*spec) for spec in specs[:2]],
                                 [engine.sample_request(*spec) for spec in specs[2:]])
    for (adapter, prompt, *_), got, expected in zip(specs, together, alone):
        _assert_same_samples(got, expected)
        for seq in got.sequences:
            recomputed = engine.compute_logprobs(adapter, prompt + seq.tokens)[len(prompt) :]
            np.testing.assert_allclose(recomputed, seq.logprobs, rtol=0, atol=1e-4)
    # Stop rules: a stop token ends the row at its first occurrence (and is kept)...
    stopped = together[0].sequences[0]
    assert stopped.tokens == row[: row.index(stop_token) + 1] and stopped.stop_reason == "stop"
    # ...a stop string at the first token whose text contains it; stop=[] never stops.
    stopped = together[3].sequences[0]
    assert stopped.stop_reason == "stop" and stop_text in tokenizer.decode(stopped.tokens) and len(stopped.tokens) <= 9
    assert stop_text not in tokenizer.decode(stopped.tokens[:-1])
    assert all(len(s.tokens) == 10 and s.stop_reason == "length" for s in together[1].sequences)
    assert len({tuple(s.tokens) for s in together[1].sequences}) > 1  # seeded rows really sampled


def test_a_failing_or_cancelled_request_leaves_the_others_alone(engine, tokenizer):
    from kernel_backend.errors import Cancelled

    prompt = chat_prompt(POEM_PROMPT, tokenizer)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=[])
    expected = engine.sample(None, prompt, 2, params)
    streamed = []

    def stream_breaks(row, token, logprob):
        if len(streamed) == 4:
            raise ConnectionError("the client went away")
        streamed.append(token)

    failing = engine.sample_request(None, prompt, 2, params, on_token=stream_breaks)
    cancelled = engine.sample_request(None, prompt, 1, params)
    good = engine.sample_request(None, prompt, 2, params)
    decoder = engine.decoder
    for request in (failing, cancelled, good):
        decoder.admit(request)
    left, steps = 3, 0
    while left:
        if steps == 4:
            cancelled.cancel.set()
        left -= len(decoder.step())
        steps += 1
    assert isinstance(failing.error, ConnectionError) and failing.result is None
    assert isinstance(cancelled.error, Cancelled) and cancelled.result is None
    assert good.error is None
    _assert_same_samples(good.result, expected)
    assert not decoder.busy and decoder.cache.keys.numel() == 0  # rows gone, cache freed


def test_chunked_prefill_a_full_cache_and_the_serial_loop_agree(engine, tokenizer, pair):
    """The same requests through a decoder that prefills 16 tokens a step and whose cache holds one
    request at a time, and through the serial loop (transformers' own forward): same tokens, same
    logprobs, the same answers to their options (alternative prompt tokens drawn chunk by chunk,
    targets and the last n prompt logprobs starting mid-chunk), and prompt logprobs equal to the
    training path's."""
    from kernel_backend.engine import sampler

    a, _, _, _ = pair
    _, conversation = chat_tokens(*PROBE, tokenizer)
    poem = chat_prompt(POEM_PROMPT, tokenizer)
    # Targets from position 13 on, in the poem's second prefill chunk: its logits start mid-chunk.
    named = np.full((len(poem) - 1, 2), -1)
    named[12:, 0] = poem[13:]
    named[12::5, 1] = 7
    specs = [
        (a, conversation, 2, SamplingParams(max_tokens=8, temperature=1.0, seed=21),
         SampleOptions(prompt_logprobs=True, topk_prompt_logprobs=3, prompt_alt_tokens_k=3, topk_sample_logprobs=2)),
        (None, poem, 2, SamplingParams(max_tokens=8, temperature=1.0, seed=22),
         SampleOptions(prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=len(poem) - 20,
                       target_prompt_logprobs=target_ids(named, sparse=True))),
    ]
    default = engine.run_requests([engine.sample_request(*spec) for spec in specs])
    assert len(conversation) > 32 and len(poem) > 24  # at least three and two prefill chunks of 16
    one_at_a_time = max(engine.sample_request(*spec).kv_tokens for spec in specs)
    variants = {
        "chunked, full cache": sampler.Decoder(engine.model, tokenizer.decode, one_at_a_time, prefill_tokens=16),
        "serial": sampler.SerialDecoder(engine.model, tokenizer.decode, one_at_a_time),
    }
    original = engine.decoder
    try:
        for name, decoder in variants.items():
            engine.decoder = decoder
            requests = [engine.sample_request(*spec) for spec in specs]
            for request in requests:
                decoder.admit(request)
            most_rows, left = 0, len(requests)
            while left:
                left -= len(decoder.step())
                most_rows = max(most_rows, len(getattr(decoder, "rows", [])))
            assert most_rows <= 2, name  # one request's rows at a time
            for request, expected in zip(requests, default):
                _assert_same_samples(request.result, expected)  # prompt logprobs, top-k, targets, draws too
    finally:
        engine.decoder = original
    training_path = forward_logprobs(engine, a, [shifted_datum(conversation)])[0]
    np.testing.assert_allclose(default[0].prompt_logprobs[1:], training_path, rtol=0, atol=1e-4)


def test_a_training_job_finishes_while_a_long_sample_decodes(engine, tokenizer, adapters):
    """The real scheduler, engine and decoder: a forward_backward submitted while a long sample decodes
    is done before the sample is, and the sample still comes out whole."""
    import threading
    import time

    from kernel_backend.execution.engine_work import SampleOp
    from kernel_backend.execution.scheduler import Job, Scheduler

    adapter = adapters(rank=4, seed=9)
    done: list[tuple[str, object]] = []
    finished = threading.Event()

    def on_done(job, outcome):
        done.append((job.request_id, outcome))
        if len(done) == 2:
            finished.set()

    scheduler = Scheduler(load_engine=lambda name: engine, on_done=on_done, max_batch_tokens=8192)
    scheduler.engine("default")
    prompt = chat_prompt(POEM_PROMPT, tokenizer)
    # 256 tokens: the tiny model decodes one in a few ms, and the sample must still be decoding when this
    # thread sees it start and submits the training job (a busy machine can delay that by a time slice or two).
    long = SamplingParams(max_tokens=256, temperature=0.0, stop=[])
    long_sample = Job("long-sample", "a-sampler", "default", seq=None, tokens=len(prompt),
                      sample=SampleOp(None, prompt, 1, long))
    datum = sft_datum(*FACTS[0], tokenizer)
    training = Job("training", adapter, "default", seq=0, fb_pass=Pass(adapter, [datum]), tokens=len(datum.tokens))
    scheduler.start()
    try:
        scheduler.submit(long_sample, ordered=False)
        deadline = time.monotonic() + 60
        while not engine.decoder.rows:  # the sample is decoding
            assert time.monotonic() < deadline
            time.sleep(0.01)
        scheduler.submit(training, ordered=True)
        assert finished.wait(120), done
    finally:
        scheduler.stop()
    assert [request_id for request_id, _ in done] == ["training", "long-sample"]
    assert not any(isinstance(outcome, Exception) for _, outcome in done), done
    expected = engine.sample(None, prompt, 1, long)
    assert done[1][1].sequences[0].tokens == expected.sequences[0].tokens


# Each family's config, tiny; a sliding window of 8 binds on the 21-token prompt and its samples.
FAMILY_CONFIGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 8},
    "phi3": {"pad_token_id": 0, "partial_rotary_factor": 0.5},  # rotates half of each head
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},  # caps low enough to bind
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    # Four experts, two per token, over a small expert MLP, on every layer (as Qwen3-30B-A3B has them).
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def test_every_family_the_packed_forward_claims_is_checked_here():
    from kernel_backend.engine import sampler

    assert set(sampler.BATCHED_ARCHITECTURES) == set(FAMILY_CONFIGS)


@pytest.mark.parametrize("architecture", list(FAMILY_CONFIGS))
def test_the_batched_forward_matches_transformers_on_each_architecture_it_claims(architecture):
    """The decoder writes the layer out itself (packed_forward.flat_forward, with engine/families.py's switches): on a
    tiny random model of each architecture in BATCHED_ARCHITECTURES (a shape check, so random weights are
    fine), its prompt logprobs and sampled-token logprobs equal transformers' own forward pass, and so do
    the logits of rows packed end to end as training runs them, sliding windows included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kernel_backend.engine import families, lora, packed_forward, prefix_tree, sampler
    from kernel_backend.types import SampleOptions, SamplingParams

    assert architecture in sampler.BATCHED_ARCHITECTURES
    config = AutoConfig.for_model(architecture, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=256, **FAMILY_CONFIGS[architecture])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.load_state_dict(model.state_dict())
    lora.attach(model)
    decoder = sampler.Decoder(model, lambda tokens: "", budget_tokens=10_000, prefill_tokens=8)
    prompt = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    request = sampler.SampleRequest(None, prompt, 2, SamplingParams(max_tokens=6, temperature=1.0, seed=3), set(), [],
                                    SampleOptions(prompt_logprobs=True))
    decoder.admit(request)
    while not decoder.step():
        pass
    for seq in request.result.sequences:
        tokens = prompt + seq.tokens
        with torch.no_grad():
            logprobs = reference(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
        expected = logprobs.gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
        np.testing.assert_allclose(request.result.prompt_logprobs[1:], expected[: len(prompt) - 1], rtol=0, atol=1e-5)
        np.testing.assert_allclose(seq.logprobs, expected[len(prompt) - 1 :], rtol=0, atol=1e-5)
    # Training runs the same forward pass over rows packed end to end (engine._packed_target_logprobs):
    # two rows of different lengths give each row's logits as transformers computes them alone.
    rows = [prompt[:13], prompt]
    ids = torch.tensor([t for row in rows for t in row])
    positions = torch.cat([torch.arange(len(row)) for row in rows])
    attend = packed_forward.causal_within_rows(model, [len(row) for row in rows])
    with lora.route(model, [None] * len(ids)), torch.no_grad():
        packed = families.final_logits(config, model.lm_head(packed_forward.flat_forward(model, ids, positions, attend)))
        for part, row in zip(packed.split([len(row) for row in rows]), rows):
            torch.testing.assert_close(part, reference(torch.tensor([row])).logits[0], rtol=0, atol=1e-5)
    # ... and over rows that share prefixes, as one tree of tokens (engine/prefix_tree.py): a branch's own tokens
    # attend along its path with the causal mask shifted, past the sliding window (8) where there is one.
    branch = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    rows = [prompt[:13], prompt, prompt[:15] + branch, prompt[:3] + branch[:4], prompt[:15] + branch[:5] + prompt[:2]]
    tree = prefix_tree.Tree()
    for row in rows:
        tree.add(None, row)
    attend = packed_forward.causal_within_paths(model, tree.leaf_paths())
    with lora.route(model, [None] * len(tree.tokens)), torch.no_grad():
        hidden = packed_forward.flat_forward(model, torch.tensor(tree.tokens), torch.tensor(tree.positions), attend)
        logits = families.final_logits(config, model.lm_head(hidden))
        for path, row in zip(tree.paths, rows):
            torch.testing.assert_close(logits[path], reference(torch.tensor([row])).logits[0], rtol=0, atol=1e-5)


# ---- c. adapters over one base do not touch each other ------------------------------------------


def test_training_one_adapter_leaves_another_bit_identical(engine, tokenizer, adapters):
    a, b = adapters(rank=8, seed=3), adapters(rank=8, seed=4)
    data = [sft_datum(q, ans, tokenizer) for q, ans in FACTS]
    train(engine, b, data[:1], steps=2, learning_rate=2e-3)  # b is a real, non-zero adapter
    probe = [sft_datum(*PROBE, tokenizer), data[1]]
    _, probe_tokens = chat_tokens(*PROBE, tokenizer)
    before = forward_logprobs(engine, b, probe)
    before_sampling = engine.compute_logprobs(b, probe_tokens)
    before_digest, before_weights = engine.weights_digest(b), _weights(engine, b)

    losses = train(engine, a, data, steps=3, learning_rate=2e-3)
    assert losses[-1] < losses[0]  # a really trained

    after = forward_logprobs(engine, b, probe)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    assert engine.compute_logprobs(b, probe_tokens) == before_sampling
    assert engine.weights_digest(b) == before_digest
    assert all(torch.equal(before_weights[k], v) for k, v in _weights(engine, b).items())


@pytest.fixture(scope="module")
def pair(engine):
    """Two trained adapters over the one base: a on every target, b on the MLP only (so some
    layers carry only a's delta), and a batch for each. Tests using it run no optim_step and start
    and end with no gradients, so they stay independent of each other's order."""
    tokenizer = default_tokenizer()
    a, b = new_id("pair-a"), new_id("pair-b")
    engine.create_adapter(a, LoraConfig(rank=8, seed=5))
    engine.create_adapter(b, LoraConfig(rank=16, seed=6, train_attn=False, train_unembed=False))
    train(engine, a, [sft_datum(*FACTS[0], tokenizer)], steps=2, learning_rate=2e-3)
    train(engine, b, [sft_datum(*FACTS[1], tokenizer)], steps=2, learning_rate=2e-3)
    data_a = [sft_datum(*FACTS[0], tokenizer), sft_datum("Hi!", "Hello.", tokenizer)]
    data_b = [sft_datum(*PROBE, tokenizer), sft_datum(*FACTS[1], tokenizer)]
    yield a, b, data_a, data_b
    engine.delete_adapter(a)
    engine.delete_adapter(b)


@pytest.fixture
def two_adapters(engine, pair):
    a, b, _, _ = pair
    _zero_grads(engine, a)
    _zero_grads(engine, b)
    yield pair
    _zero_grads(engine, a)
    _zero_grads(engine, b)


def _assert_grads_close(got, expected):
    """Per tensor, the difference is tiny next to the gradient itself (float32 batch-shape noise);
    a gradient that took in another adapter's rows, or missed some of its own, would be off by
    a large fraction."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (g is None) == (e is None)
        if g is not None:
            assert float((g - e).norm()) <= 1e-3 * float(e.norm()) + 1e-8


def test_mixed_adapter_batch_equals_separate_runs(engine, two_adapters):
    a, b, data_a, data_b = two_adapters
    assert len({len(d.tokens) for d in data_a + data_b}) == 4  # rows of different lengths: padding matters

    alone_a = engine.forward_backward(a, data_a)
    grads_a = _grads(engine, a)
    _zero_grads(engine, a)
    alone_b = engine.forward_backward(b, data_b)
    grads_b = _grads(engine, b)
    _zero_grads(engine, b)
    assert all(g is not None for g in grads_a + grads_b)

    # The same four rows under one adapter: the same batch shape, so only the routing differs.
    everything = data_a + data_b
    same_shape_a = forward_logprobs(engine, a, everything)[:2]
    same_shape_b = forward_logprobs(engine, b, everything)[2:]

    mixed_a, mixed_b = engine.run_passes([Pass(a, data_a), Pass(b, data_b)])
    for alone, same_shape, mixed in ((alone_a, same_shape_a, mixed_a), (alone_b, same_shape_b, mixed_b)):
        assert isinstance(mixed, ForwardResult)
        for x, y, z in zip(alone.loss_fn_outputs, same_shape, mixed.loss_fn_outputs):
            np.testing.assert_allclose(z["logprobs"], y, rtol=0, atol=1e-5)
            # A batch of another size runs other float32 kernels (even for a single adapter):
            # about 3e-5 of noise on logprobs of -10 after the real model's 30 layers.
            np.testing.assert_allclose(z["logprobs"], x["logprobs"], rtol=1e-5, atol=1e-4)
        assert abs(mixed.metrics["loss:sum"] - alone.metrics["loss:sum"]) < 1e-3
    # Each adapter got exactly its own rows' gradient, nothing from the other's rows.
    _assert_grads_close(_grads(engine, a), grads_a)
    _assert_grads_close(_grads(engine, b), grads_b)


def test_mixed_batch_forward_only_pass_gets_no_gradient(engine, two_adapters):
    a, b, data_a, data_b = two_adapters
    engine.forward_backward(a, data_a)
    grads_a = _grads(engine, a)
    _zero_grads(engine, a)
    digest_b = engine.weights_digest(b)

    fb_a, fwd_b = engine.run_passes([Pass(a, data_a), Pass(b, data_b, forward_only=True)])
    assert isinstance(fb_a, ForwardResult) and isinstance(fwd_b, ForwardResult)
    _assert_grads_close(_grads(engine, a), grads_a)
    assert all(p.grad is None for p in engine.slots[b].adapter.parameters())
    assert engine.weights_digest(b) == digest_b


def test_bad_pass_in_a_batch_fails_alone(engine, two_adapters):
    """One pass failing (at validation or at its loss) neither fails nor changes the others."""
    a, b, data_a, data_b = two_adapters
    # a uses PPO with a non-default config, so a mix-up of per-pass configs would show.
    rl_a = [_rl_datum(d, advantage=1.0 - 2.0 * (n % 2)) for n, d in enumerate(data_a)]
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05}
    alone = engine.forward_backward(a, rl_a, "ppo", config)
    grads_a = _grads(engine, a)
    _zero_grads(engine, a)

    engine.forward_backward(b, data_b)  # b holds gradients that a failure must leave alone
    digest_b = engine.weights_digest(b)
    bad_lengths = [Datum(data_b[0].tokens, {"target_tokens": data_b[0].loss_fn_inputs["target_tokens"][:-1]})]
    overflow = [_rl_datum(d, advantage=-1.0, sampler_logprob=-200.0) for d in data_b]
    for bad, loss_fn, field in ((bad_lengths, "cross_entropy", "target_tokens"), (overflow, "importance_sampling", "logprobs")):
        good, failed = engine.run_passes([Pass(a, rl_a, "ppo", config), Pass(b, bad, loss_fn)])
        assert isinstance(failed, UserError) and field in str(failed)
        assert isinstance(good, ForwardResult)
        for x, y in zip(alone.loss_fn_outputs, good.loss_fn_outputs):
            np.testing.assert_allclose(y["logprobs"], x["logprobs"], rtol=1e-5, atol=1e-4)
        assert abs(good.metrics["loss:sum"] - alone.metrics["loss:sum"]) < 1e-3
        _assert_grads_close(_grads(engine, a), grads_a)
        _zero_grads(engine, a)
        assert engine.weights_digest(b) == digest_b


def test_stable_reinforce_against_a_float64_reference(engine, tokenizer, adapters):
    """stable_reinforce: its value against a float64 hand computation from transformers' own
    logits, and its gradient exactly cross_entropy's with weights m * min(r, C) * A (the truncated importance
    weight is a constant, so the step is a weighted REINFORCE one)."""
    a = adapters(rank=8, seed=3)
    d = sft_datum(*FACTS[0], tokenizer)
    n, targets = len(d.tokens), d.loss_fn_inputs["target_tokens"]
    sampled = d.loss_fn_inputs["weights"]  # the answer's positions play the sampled tokens
    exact = model_logprobs(engine, a, d.tokens)[torch.arange(n), torch.as_tensor(targets)].numpy()
    rng = np.random.default_rng(0)
    on = sampled != 0
    q = np.where(on, exact + rng.uniform(-1.5, 0.5, n), 0.0).astype(np.float32)  # ratios ~0.6 to ~4.5
    adv = np.where(on, rng.normal(size=n), 0.0).astype(np.float32)
    datum = Datum(d.tokens, {"target_tokens": targets, "logprobs": q, "advantages": adv, "sampled_mask": sampled})
    result = engine.forward_backward(a, [datum], "stable_reinforce")
    grads = _grads(engine, a)
    _zero_grads(engine, a)

    ratio = np.exp(exact[on] - q[on].astype(np.float64))
    weight = np.minimum(ratio, 2.0)
    assert result.metrics["loss:sum"] == pytest.approx(-float((weight * adv[on] * exact[on]).sum()), rel=1e-4, abs=1e-4)
    assert 0 < result.metrics["truncated_fraction:mean"] < 1
    assert result.metrics["truncated_fraction:mean"] == pytest.approx(float((ratio > 2.0).mean()))
    assert result.metrics["importance_ratio:max"] == pytest.approx(float(ratio.max()), rel=1e-3)

    weights = np.zeros(n, dtype=np.float32)
    weights[on] = weight * adv[on]
    engine.forward_backward(a, [Datum(d.tokens, {"target_tokens": targets, "weights": weights})])
    _assert_grads_close(_grads(engine, a), grads)
    _zero_grads(engine, a)


def _rl_datum(datum: Datum, advantage: float, sampler_logprob: float | None = None) -> Datum:
    n = len(datum.tokens)
    return Datum(
        datum.tokens,
        {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            # Near the learner's own logprobs unless told otherwise: ratios around 1.
            "logprobs": np.full(n, -1.0 if sampler_logprob is None else sampler_logprob, dtype=np.float32),
            "advantages": np.full(n, advantage, dtype=np.float32),
        },
    )


# ---- d. save_state / load_state resume exactly --------------------------------------------------


def test_save_and_load_state_resume_exactly(engine, tokenizer, adapters, tmp_path):
    a = adapters(rank=8, seed=7)
    data = [sft_datum(q, ans, tokenizer) for q, ans in FACTS]
    train(engine, a, data, steps=2, learning_rate=2e-3)
    engine.save_state(a, tmp_path / "state")
    probe = [sft_datum(*PROBE, tokenizer)] + data

    fresh = Engine(settings=engine.settings)  # a new process would see exactly this: the files and the base model
    try:
        b = new_id("restored")
        fresh.load_state(b, tmp_path / "state")
        c = new_id("reloaded")
        engine.load_state(c, tmp_path / "state")
        adapters.created.append(c)

        # Same weights and the same AdamW moments and step counts.
        assert fresh.weights_digest(b) == engine.weights_digest(a) == engine.weights_digest(c)
        expected = forward_logprobs(engine, a, probe)
        for other_engine, other in ((fresh, b), (engine, c)):
            for x, y in zip(expected, forward_logprobs(other_engine, other, probe)):
                np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)
        _, probe_tokens = chat_tokens(*PROBE, tokenizer)
        np.testing.assert_allclose(
            fresh.compute_logprobs(b, probe_tokens)[1:], engine.compute_logprobs(a, probe_tokens)[1:], rtol=0, atol=1e-6
        )

        # The next two optimizer steps match an uninterrupted run.
        uninterrupted = train(engine, a, data, steps=2, learning_rate=2e-3)
        for other_engine, other in ((fresh, b), (engine, c)):
            resumed = train(other_engine, other, data, steps=2, learning_rate=2e-3)
            np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6, atol=1e-6)
            expected_weights = _weights(engine, a)
            for key, value in _weights(other_engine, other).items():
                torch.testing.assert_close(value, expected_weights[key], rtol=0, atol=1e-6)
    finally:
        del fresh
        gc.collect()


def test_the_step_history_writes_past_steps_as_saved_then_and_stays_in_its_bounds(engine, tokenizer, adapters, tmp_path):
    from kernel_backend.engine.step_history import StepHistory

    kept_before = engine.history
    engine.history = StepHistory(per_run=2, budget_bytes=1 << 30)
    try:
        a = adapters(rank=4, seed=3)
        data = [sft_datum(*FACTS[0], tokenizer)]
        digests = {}
        for k in range(1, 6):
            train(engine, a, data, steps=1, learning_rate=2e-3)
            digests[k] = engine.weights_digest(a)
            engine.save_state(a, tmp_path / f"then-{k}")
        # The start, and the last two steps; the step it is at is one of them.
        assert engine.kept_steps(a) == [0, 4, 5]
        # Step 4's state, written after step 5, is the folder save_state wrote at step 4, file for file.
        engine.save_step(a, 4, tmp_path / "now-4")
        for name in ("adapter_model.safetensors", "optimizer.safetensors", "stepwise_state.json"):
            assert (tmp_path / "now-4" / name).read_bytes() == (tmp_path / "then-4" / name).read_bytes(), name
        with pytest.raises(UserError, match=r"step 2 .* no longer kept in memory; kept steps: \[0, 4, 5\]"):
            engine.save_step(a, 2, tmp_path / "now-2")
        # Loading step 4 back (an undo) forgets step 5, which is no longer this run's past.
        engine.load_state(a, tmp_path / "now-4")
        assert engine.kept_steps(a) == [0, 4] and engine.weights_digest(a) == digests[4]

        # The byte budget: past it the oldest copies go first, each run's start last. Room for two trained
        # states: when b takes its first step, a's step 4 goes, and both starts (no moments yet: smaller) stay.
        one = engine.history.runs[a][4].nbytes
        engine.history.budget_bytes = 2 * one
        b = adapters(rank=4, seed=4)
        train(engine, b, data, steps=1, learning_rate=2e-3)
        assert engine.history.steps(a) == [0] and engine.history.steps(b) == [0, 1]
    finally:
        engine.history = kept_before


def test_sampler_weights_round_trip(engine, tokenizer, adapters, tmp_path):
    a = adapters(rank=8, seed=8)
    train(engine, a, [sft_datum(*FACTS[0], tokenizer)], steps=2, learning_rate=2e-3)
    engine.save_weights_for_sampler(a, tmp_path / "sampler")
    sampler = new_id("sampler")
    engine.load_sampler(sampler, tmp_path / "sampler")
    adapters.created.append(sampler)
    snapshot = new_id("snapshot")
    engine.snapshot_sampler(a, snapshot)
    adapters.created.append(snapshot)
    _, tokens = chat_tokens(*PROBE, tokenizer)
    expected = engine.compute_logprobs(a, tokens)
    assert engine.compute_logprobs(sampler, tokens) == expected
    assert engine.compute_logprobs(snapshot, tokens) == expected
    # Training a further changes neither frozen copy, and the copies cannot be trained.
    train(engine, a, [sft_datum(*FACTS[0], tokenizer)], steps=1, learning_rate=2e-3)
    assert engine.compute_logprobs(snapshot, tokens) == expected
    with pytest.raises(UserError, match="sampler"):
        engine.forward_backward(sampler, [sft_datum(*PROBE, tokenizer)])


# ---- e. bad input: UserError naming the field, state unchanged ----------------------------------


@pytest.fixture(scope="module")
def primed(engine):
    """An adapter with optimizer state (one real step) and pending gradients (one more fb)."""
    tokenizer = default_tokenizer()
    adapter = new_id("primed")
    engine.create_adapter(adapter, LoraConfig(rank=8, seed=9))
    data = [sft_datum(*FACTS[0], tokenizer)]
    train(engine, adapter, data, steps=1)
    engine.forward_backward(adapter, data)
    assert engine.slots[adapter].optimizer.state and all(
        p.grad is not None for p in engine.slots[adapter].adapter.parameters()
    )
    yield adapter, data[0]
    engine.delete_adapter(adapter)


def _datum(good: Datum, tokens=None, **inputs) -> Datum:
    merged = {**good.loss_fn_inputs, **inputs}
    return Datum(list(good.tokens) if tokens is None else tokens, {k: v for k, v in merged.items() if v is not None})


def _n(good: Datum) -> int:
    return len(good.tokens)


V = 49152  # SmolLM2's vocabulary size (asserted below)

BAD_PASSES = {
    # name: (build data from the good datum, loss_fn, loss_fn_config, words the message must contain)
    "token id >= vocab": (lambda g: [_datum(g, tokens=list(g.tokens[:-1]) + [V])], "cross_entropy", None, ["model_input", str(V)]),
    "negative token id": (lambda g: [_datum(g, tokens=[-1] + list(g.tokens[1:]))], "cross_entropy", None, ["model_input", "-1"]),
    "target id >= vocab": (
        lambda g: [_datum(g, target_tokens=np.full(_n(g), V + 5))],
        "cross_entropy", None, ["target_tokens", str(V + 5)],
    ),
    "float token ids": (lambda g: [_datum(g, tokens=[float(t) + 0.5 for t in g.tokens])], "cross_entropy", None, ["model_input"]),
    "targets shorter than input": (
        lambda g: [_datum(g, target_tokens=g.loss_fn_inputs["target_tokens"][:-1])],
        "cross_entropy", None, ["target_tokens", "shape"],
    ),
    "no target_tokens": (lambda g: [_datum(g, target_tokens=None)], "cross_entropy", None, ["target_tokens"]),
    "weights of the wrong length": (lambda g: [_datum(g, weights=np.ones(_n(g) + 1))], "cross_entropy", None, ["weights", "shape"]),
    "NaN weights": (lambda g: [_datum(g, weights=np.full(_n(g), np.nan))], "cross_entropy", None, ["weights", "NaN"]),
    "unknown loss": (lambda g: [g], "cross_entropyy", None, ["loss_fn", "cross_entropyy"]),
    "unknown loss input": (lambda g: [_datum(g, rewards=np.ones(_n(g)))], "cross_entropy", None, ["loss_fn_inputs", "rewards"]),
    "missing advantages": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -1.0))],
        "importance_sampling", None, ["advantages"],
    ),
    "missing sampler logprobs": (lambda g: [_datum(g, advantages=np.ones(_n(g)))], "ppo", None, ["logprobs"]),
    "NaN advantages": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -1.0), advantages=np.full(_n(g), np.nan))],
        "ppo", None, ["advantages", "NaN"],
    ),
    "inf advantages": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -1.0), advantages=np.r_[np.inf, np.ones(_n(g) - 1)])],
        "importance_sampling", None, ["advantages", "inf"],
    ),
    "inf sampler logprobs": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -np.inf), advantages=np.ones(_n(g)))],
        "cispo", None, ["logprobs"],
    ),
    "empty batch": (lambda g: [], "cross_entropy", None, ["empty batch"]),
    "bad datum after a good one": (lambda g: [g, _datum(g, tokens=list(g.tokens[:-1]) + [V])], "cross_entropy", None, ["data[1]"]),
    "loss overflows": (
        # exp(lp + 200) overflows float32: every input is finite, the loss is not.
        lambda g: [_datum(g, logprobs=np.full(_n(g), -200.0), advantages=np.ones(_n(g)))],
        "importance_sampling", None, ["not finite", "logprobs"],
    ),
    "unknown config key": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -1.0), advantages=np.ones(_n(g)))],
        "ppo", {"clip_low": 0.5}, ["loss_fn_config", "clip_low"],
    ),
    "clip low above high": (
        lambda g: [_datum(g, logprobs=np.full(_n(g), -1.0), advantages=np.ones(_n(g)))],
        "ppo", {"clip_low_threshold": 1.5}, ["clip_low_threshold"],
    ),
}


def test_vocab_size_is_what_bad_input_cases_assume(engine):
    assert engine.vocab_size == V


@pytest.mark.parametrize("forward_only", [False, True], ids=["forward_backward", "forward"])
@pytest.mark.parametrize("case", list(BAD_PASSES))
def test_bad_pass_raises_user_error_and_changes_nothing(engine, primed, case, forward_only):
    adapter, good = primed
    build, loss_fn, config, words = BAD_PASSES[case]
    before = engine.weights_digest(adapter)
    call = engine.forward if forward_only else engine.forward_backward
    with pytest.raises(UserError) as info:
        call(adapter, build(good), loss_fn, config)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert engine.weights_digest(adapter) == before


def test_unknown_adapter_is_a_user_error(engine, primed):
    _, good = primed
    with pytest.raises(UserError, match="no-such-adapter"):
        engine.forward_backward("no-such-adapter", [good])
    with pytest.raises(UserError, match="no-such-adapter"):
        engine.optim_step("no-such-adapter")
    with pytest.raises(UserError, match="no-such-adapter"):
        engine.sample("no-such-adapter", [1, 2, 3])


BAD_ADAM = {
    "negative learning_rate": (dict(learning_rate=-1e-3), "learning_rate"),
    "NaN learning_rate": (dict(learning_rate=float("nan")), "learning_rate"),
    "beta1 = 1": (dict(beta1=1.0), "beta1"),
    "negative beta2": (dict(beta2=-0.1), "beta2"),
    "eps = 0": (dict(eps=0.0), "eps"),
    "negative weight_decay": (dict(weight_decay=-0.1), "weight_decay"),
    "inf grad_clip_norm": (dict(grad_clip_norm=float("inf")), "grad_clip_norm"),
    "string learning_rate": (dict(learning_rate="1e-3"), "learning_rate"),
}


@pytest.mark.parametrize("case", list(BAD_ADAM))
def test_bad_adam_params_raise_user_error_and_change_nothing(engine, primed, case):
    adapter, _ = primed
    fields, name = BAD_ADAM[case]
    before = engine.weights_digest(adapter)
    with pytest.raises(UserError) as info:
        engine.optim_step(adapter, AdamParams(**fields))
    assert name in str(info.value), str(info.value)
    assert engine.weights_digest(adapter) == before


BAD_SAMPLING = {
    # name: (sample() keyword arguments, SamplingParams fields, word the message must contain)
    "negative temperature": ({}, dict(temperature=-1.0), "temperature"),
    "NaN temperature": ({}, dict(temperature=float("nan")), "temperature"),
    "top_p = 0": ({}, dict(top_p=0.0), "top_p"),
    "top_p > 1": ({}, dict(top_p=1.5), "top_p"),
    "top_k = 0": ({}, dict(top_k=0), "top_k"),
    "max_tokens = 0": ({}, dict(max_tokens=0), "max_tokens"),
    "huge max_tokens": ({}, dict(max_tokens=10**9), "max_tokens"),
    "mixed stop": ({}, dict(stop=["\n", 2]), "stop"),
    "empty stop string": ({}, dict(stop=[""]), "stop"),
    "stop id outside vocab": ({}, dict(stop=[V]), "stop"),
    "num_samples = 0": (dict(num_samples=0), {}, "num_samples"),
    "too many topk": (dict(topk_prompt_logprobs=1000), {}, "topk_prompt_logprobs"),
    "too many sampled topk": (dict(topk_sample_logprobs=21), {}, "topk_sample_logprobs"),
    "negative alt tokens k": (dict(prompt_alt_tokens_k=-1), {}, "prompt_alt_tokens_k"),
    "too many alt tokens": (dict(prompt_alt_tokens_k=21), {}, "prompt_alt_tokens_k"),
    "last_n without prompt_logprobs": (dict(prompt_logprobs_last_n=3), {}, "set prompt_logprobs"),
    "last_n = 0": (dict(prompt_logprobs=True, prompt_logprobs_last_n=0), {}, "prompt_logprobs_last_n"),
    "last_n = len(prompt)": (dict(prompt_logprobs=True, prompt_logprobs_last_n=10), {}, "len(prompt) - 1 = 9"),
    "targets, wrong rows": (dict(target_prompt_logprobs=target_ids(np.zeros((10, 1), int))), {}, "9 rows"),
    "targets, too wide": (dict(target_prompt_logprobs=target_ids(np.zeros((9, 21), int))), {}, "1 to 20 ids"),
    "targets, id outside vocab": (dict(target_prompt_logprobs=target_ids(np.full((9, 1), V))), {}, "vocabulary"),
    "targets, id below -1": (dict(target_prompt_logprobs=target_ids(np.full((9, 1), -2))), {}, "-1 for none"),
    "targets, none named": (dict(target_prompt_logprobs=target_ids(np.full((9, 1), -1))), {}, "names no token id"),
    "prompt id outside vocab": (dict(prompt=[1, 2, V]), {}, "prompt"),
    "empty prompt": (dict(prompt=[]), {}, "prompt"),
    "more rows than the cache holds": (dict(num_samples=128), dict(max_tokens=4096), "STEPWISE_SAMPLE_CACHE_MB"),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLING))
def test_bad_sampling_params_raise_user_error(engine, primed, case):
    adapter, good = primed
    kwargs, fields, name = BAD_SAMPLING[case]
    kwargs = {"prompt": list(good.tokens[:10]), "num_samples": 1, **kwargs}
    before = engine.weights_digest(adapter)
    with pytest.raises(UserError) as info:
        engine.sample(adapter, params=SamplingParams(**{"max_tokens": 4, **fields}), **kwargs)
    assert name in str(info.value), str(info.value)
    assert engine.weights_digest(adapter) == before


def test_target_logprobs_gradient_matches_autograd():
    """The engine's fused log_softmax+gather (with its own backward) against plain autograd; with an
    index, rows that share logits rows (a shared prefix) each read their own targets there."""
    from kernel_backend.engine.losses import target_logprobs

    g = torch.Generator().manual_seed(0)
    for shape, k, index in (((2, 5, 11), 3, None), ((7, 13), 1, None), ((5, 13), 2, [0, 1, 2, 0, 1, 3, 4, 4])):
        logits = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
        rows = shape[:-1] if index is None else (len(index),)
        index = None if index is None else torch.tensor(index)
        targets = torch.randint(0, shape[-1], (*rows, k), generator=g)
        weights = torch.randn(*rows, k, dtype=torch.float64, generator=g)
        mine = target_logprobs(logits, targets, index)
        (mine * weights).sum().backward()
        fused_grad, logits.grad = logits.grad, None
        read = logits if index is None else logits[index]
        reference = read.log_softmax(-1).gather(-1, targets)
        (reference * weights).sum().backward()
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-12)
        torch.testing.assert_close(fused_grad, logits.grad, rtol=0, atol=1e-12)



def test_target_logprobs_overwrite_is_bit_identical_and_fails_loudly_where_unsafe():
    """overwrite=True (the trainer's: log_softmax written over the logits, no fresh vocabulary-wide tensor) gives the
    same logprobs and input gradient, bit for bit, as a fresh output; over logits that a node kept for its backward
    (tanh keeps its output), the backward fails instead of computing a wrong gradient."""
    from kernel_backend.engine.losses import target_logprobs

    g = torch.Generator().manual_seed(0)
    x0, weight = torch.randn(6, 8, generator=g), torch.randn(13, 8, generator=g)
    targets, index = torch.randint(0, 13, (9, 2), generator=g), torch.tensor([0, 1, 2, 0, 1, 3, 4, 5, 5])
    results = []
    for overwrite in (False, True):
        x = x0.clone().requires_grad_()
        logits = x @ weight.T  # a product's output: its backward keeps x and the weight, not the logits
        raw = logits.detach().clone()
        logprobs = target_logprobs(logits, targets, index, overwrite=overwrite)
        after_forward = logits.detach().clone()
        logprobs.sum().backward()
        results.append((logprobs.detach(), x.grad))
    assert torch.equal(after_forward, raw.log_softmax(-1))  # the logits' memory took their log_softmax
    (fresh, fresh_grad), (overwritten, grad) = results
    assert torch.equal(fresh, overwritten) and torch.equal(fresh_grad, grad)

    x = x0.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        target_logprobs(torch.tanh(x @ weight.T), targets, index, overwrite=True).sum().backward()

def test_rows_that_share_a_prefix_are_computed_once_and_train_as_if_apart(engine, two_adapters, monkeypatch):
    """engine/prefix_tree.py: a GRPO group (one prompt, three answers, one of them twice) and an episode's per-turn
    datums (each the one before it plus a turn), under the importance-sampling loss, in one batch with
    another adapter's rows: each row's logprobs, the loss and the gradient equal the rows run one at a time,
    and the model ran each shared prefix once. Every row's targets are its own (random, not its next
    tokens), so a row that read another's targets at a shared position would show."""
    a, b, _, data_b = two_adapters
    g = torch.Generator().manual_seed(11)

    def tokens(n):
        return torch.randint(0, engine.vocab_size, (n,), generator=g).tolist()

    def rl_datum(row):
        n = len(row)
        return Datum(row, {"target_tokens": np.array(tokens(n)),
                           "advantages": torch.randn(n, generator=g).numpy() * (np.arange(n) >= 6),
                           "logprobs": -2.0 - torch.rand(n, generator=g).numpy()})

    prompt, episode = tokens(14), tokens(40)
    answers = [tokens(5), tokens(9), tokens(3)]
    rows = [prompt + answers[0], prompt + answers[1], prompt + answers[2], prompt + answers[0],
            episode[:17], episode[:29], episode[:40]]
    data = [rl_datum(row) for row in rows]

    apart = [engine.forward_backward(a, [d], "importance_sampling") for d in data]
    grads_apart = _grads(engine, a)
    _zero_grads(engine, a)
    together, _ = engine.run_passes([Pass(a, data, "importance_sampling"), Pass(b, data_b, forward_only=True)])
    for alone, shared in zip(apart, together.loss_fn_outputs):
        np.testing.assert_allclose(shared["logprobs"], alone.loss_fn_outputs[0]["logprobs"], rtol=0, atol=1e-5)
    assert together.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in apart), rel=1e-5)
    _assert_grads_close(_grads(engine, a), grads_apart)
    assert together.computed_tokens == len(prompt) + sum(map(len, answers)) + len(episode)
    assert all(r.computed_tokens == len(d.tokens) for r, d in zip(apart, data))
    # Micro-batches of 24 tokens cut both trees apart (the group's answers and the episode's turns land in
    # different micro-batches): each computes its own copy of the prefixes it holds, and the sums are the same.
    _zero_grads(engine, a)
    monkeypatch.setattr(engine.settings, "micro_batch_tokens", 24)
    split = engine.forward_backward(a, data, "importance_sampling")
    for alone, shared in zip(apart, split.loss_fn_outputs):
        np.testing.assert_allclose(shared["logprobs"], alone.loss_fn_outputs[0]["logprobs"], rtol=0, atol=1e-5)
    _assert_grads_close(_grads(engine, a), grads_apart)
    assert together.computed_tokens < split.computed_tokens < sum(len(d.tokens) for d in data)


def test_a_micro_batch_counts_a_shared_prefix_once_and_its_keys_at_a_sixteenth():
    """prefix_tree.Tree.cost_with, what _micro_batches bounds: the tokens the model runs, unless the keys
    attention gathers (every leaf path's length) are more than KEYS_PER_TOKEN times as many."""
    from kernel_backend.engine import prefix_tree

    tree, prompt = prefix_tree.Tree(), list(range(100))
    assert tree.cost_with("a", prompt) == 100
    tree.add("a", prompt)
    assert tree.cost_with("b", prompt) == 200  # another adapter's row shares nothing
    assert tree.cost_with("a", prompt + [7] * 10) == 110  # an answer after the prompt: 10 more tokens
    tree.add("a", prompt + [7] * 10)
    for i in range(30):  # 30 short branches off the prompt: 31 tokens, but 30 more paths of 102 keys
        tree.add("a", prompt + [8, i])
    assert len(tree.tokens) == 141 and tree.key_slots == 110 + 30 * 102
    assert tree.cost_with("a", prompt) == -(-tree.key_slots // prefix_tree.KEYS_PER_TOKEN) == 199
