"""The adapter cache (kernel_backend/engine/adapter_cache.py): what does not fit is evicted by last use and comes
back exactly, a tenant over its share evicts its own adapters, and an adapter a decode request is using is
never evicted under it.

On the tiny random stand-in for the default model (the `engine` fixture, tests/tiny_model.py): eviction is
about bytes and bookkeeping, not what a model learns. Each test shrinks the session engine's cache budget
for its own duration (`tight`), in units of its own adapters' sizes, so the smaller adapters change nothing.
"""

from __future__ import annotations

import contextlib

import pytest

from helpers import new_id, sft_datum, train
from kernel_backend.engine.sampler import SampleRequest
from kernel_backend.types import AdamParams, SamplingParams

DATA = [sft_datum("What is the capital of Zorblax?", "Quimbleton."),
        sft_datum("Name the capital of Zorblax.", "It is Quimbleton.")]


@contextlib.contextmanager
def tight(engine, budget: int, owner_budget: int = 0):
    cache = engine.adapters
    saved = cache.budget, cache.owner_budget
    cache.budget, cache.owner_budget = budget, owner_budget
    try:
        yield cache
    finally:
        cache.budget, cache.owner_budget = saved


def one_adapter_bytes(engine, adapter_id: str) -> int:
    return engine.adapters.entry(adapter_id).nbytes


def test_a_spilled_training_run_comes_back_bit_for_bit(engine, adapters):
    """The same seed and calls, once never evicted and once spilled before every call (gradients pending
    between forward_backward and optim_step included), end at the same weights, gradients and AdamW state."""
    steady = adapters("steady", rank=4, seed=7)
    train(engine, steady, DATA, steps=2)
    engine.forward_backward(steady, DATA)  # gradients pending
    expected = engine.weights_digest(steady)

    evicted, other = adapters("evicted", rank=4, seed=7), adapters("other", rank=4, seed=8)
    with tight(engine, budget=one_adapter_bytes(engine, evicted)) as cache:
        spilled = cache.counts["spills"]
        for call in (lambda: engine.forward_backward(evicted, DATA), lambda: engine.optim_step(evicted, AdamParams(learning_rate=1e-3)),
                     lambda: engine.forward_backward(evicted, DATA), lambda: engine.optim_step(evicted, AdamParams(learning_rate=1e-3)),
                     lambda: engine.forward_backward(evicted, DATA)):
            engine.weights_digest(other)  # `other` comes back: `evicted` is spilled to make room
            assert evicted not in engine.slots and engine.has_adapter(evicted)
            call()
        assert cache.counts["spills"] - spilled >= 5
        assert engine.weights_digest(evicted) == expected


def test_a_dropped_checkpoint_sampler_loads_again_with_the_same_logprobs(engine, adapters, tmp_path):
    run = adapters("run", rank=4, seed=3)
    train(engine, run, DATA, steps=2, learning_rate=1e-2)
    engine.save_weights_for_sampler(run, tmp_path / "ckpt")
    sampler = new_id("sampler")
    adapters.created.append(sampler)
    engine.load_sampler(sampler, tmp_path / "ckpt")
    tokens = DATA[0].tokens
    before = engine.compute_logprobs(sampler, tokens)
    with tight(engine, budget=one_adapter_bytes(engine, run)) as cache:
        dropped = cache.counts["drops"]
        engine.weights_digest(run)  # the run needs all the room: the sampler goes
        assert not engine.has_adapter(sampler) and cache.counts["drops"] == dropped + 1
        engine.load_sampler(sampler, tmp_path / "ckpt")  # what ops.sample_request does on its next request
        assert engine.compute_logprobs(sampler, tokens) == before


def test_a_tenant_over_its_share_evicts_its_own_adapters_first(engine, adapters):
    a1, a2, a3, b1 = (new_id(name) for name in ("a1", "a2", "a3", "b1"))
    adapters.created.extend([a1, a2, a3, b1])
    source = adapters("source", rank=4, seed=1)
    size = one_adapter_bytes(engine, source) // 4  # a frozen snapshot is one copy
    with tight(engine, budget=100 * size, owner_budget=2 * size):
        engine.snapshot_sampler(source, b1, owner="b")  # the oldest of all
        engine.snapshot_sampler(source, a1, owner="a")
        engine.snapshot_sampler(source, a2, owner="a")
        engine.snapshot_sampler(source, a3, owner="a")  # tenant a is over its share: its own a1 goes, not b1
        resident = engine.slots
        assert a1 not in resident and {a2, a3, b1} <= set(resident)
        assert engine.has_adapter(a1)  # spilled, not lost
        logprobs = engine.compute_logprobs(a1, DATA[0].tokens)
        assert logprobs == engine.compute_logprobs(source, DATA[0].tokens)
        assert a2 not in engine.slots and b1 in engine.slots  # a1 came back in place of a's oldest, a2


def test_an_adapter_in_a_decode_request_is_never_evicted(engine, adapters):
    run = adapters("run", rank=4, seed=5)
    train(engine, run, DATA, steps=1, learning_rate=1e-2)
    sampler = new_id("snap")
    adapters.created.append(sampler)
    engine.snapshot_sampler(run, sampler)
    request: SampleRequest = engine.sample_request(sampler, DATA[0].tokens[:8], 2, SamplingParams(max_tokens=6, seed=1))
    engine.decoder.admit(request)
    with tight(engine, budget=1) as cache:
        over = cache.counts["over_budget"]
        engine.weights_digest(run)  # asks for room: everything else goes, but not the decoding snapshot
        assert sampler in engine.slots and all(p.numel() > 0 for p in request.adapter.parameters())
        assert cache.counts["over_budget"] > over
        while request.result is None and request.error is None:
            engine.decoder.step()
    assert request.error is None and len(request.result.sequences) == 2
    again = engine.sample(sampler, DATA[0].tokens[:8], 2, SamplingParams(max_tokens=6, seed=1))
    assert [s.tokens for s in again.sequences] == [s.tokens for s in request.result.sequences]


def test_bad_input_to_a_spilled_run_changes_nothing(engine, adapters):
    run, other = adapters("run", rank=4, seed=2), adapters("other", rank=4, seed=3)
    train(engine, run, DATA, steps=1)
    digest = engine.weights_digest(run)
    with tight(engine, budget=one_adapter_bytes(engine, run)):
        engine.weights_digest(other)  # spills run
        with pytest.raises(Exception, match="outside the vocabulary"):
            bad = sft_datum("x", "y")
            bad.tokens = [10**7] * len(bad.tokens)
            engine.forward_backward(run, [bad])
        assert engine.weights_digest(run) == digest


def test_spill_files_are_removed_with_their_adapter(engine, adapters):
    run, other = adapters("run", rank=4, seed=2), adapters("other", rank=4, seed=3)
    engine.forward_backward(run, DATA)
    with tight(engine, budget=one_adapter_bytes(engine, run)) as cache:
        engine.weights_digest(other)
        path = cache.entry(run).spilled
        assert path.exists()
        engine.delete_adapter(run)
        assert not path.exists() and not engine.has_adapter(run)
