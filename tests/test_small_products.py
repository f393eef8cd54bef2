"""small_products.small: small products run on the calling thread alone, and every thread comes back after."""

from __future__ import annotations

import pytest
import torch

from helpers import one_lora_layer
from kernel_backend.engine import lora, small_products
from kernel_backend.types import LoraConfig


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_work_runs_on_one_thread_and_gives_the_threads_back(two_threads):
    with small_products.small(small_products.SMALL_WORK - 1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with small_products.small(small_products.SMALL_WORK):  # large work keeps every thread
        assert torch.get_num_threads() == 2
    with pytest.raises(ValueError), small_products.small(10):
        raise ValueError("boom")
    assert torch.get_num_threads() == 2  # restored on the way out of an error too


def test_a_small_lora_layer_computes_the_same_on_one_thread_as_on_two(two_threads, monkeypatch):
    """A decode-sized batch (8 rows, two adapters) through a MultiLoraLinear: on one thread (the
    default for work this small) and with the rule off (every op on both threads)."""
    torch.manual_seed(0)
    model = one_lora_layer(576, 576)
    adapters = [lora.new_adapter(model, LoraConfig(rank=32, alpha=32.0, seed=s)) for s in (1, 2)]
    for adapter in adapters:
        adapter.weights["q_proj"][1].data.normal_()
    x = torch.randn(8, 576)
    seen = []
    monkeypatch.setattr(torch.nn.functional, "linear", _recording(torch.nn.functional.linear, seen))
    with torch.no_grad(), lora.route(model, adapters[:1] * 4 + adapters[1:] * 4):
        one_thread = model.q_proj(x)
        assert set(seen) == {1}  # every product of this layer ran on one thread
        seen.clear()
        monkeypatch.setattr(small_products, "SMALL_WORK", 0)
        two = model.q_proj(x)
        assert set(seen) == {2}
    torch.testing.assert_close(one_thread, two, rtol=1e-6, atol=1e-6)


def _recording(linear, seen: list):
    def recorded(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return linear(*args, **kwargs)

    return recorded
