"""Long runs through the official SDK against a real `serve`: a sampler per step for tens of steps.

The loop of Tinker's docs (bench/soak.py's `run_soak`: sample 16 rows, importance_sampling
forward_backward, optim_step, save_weights_for_sampler + create_sampling_client(model_path) every step)
for 30 steps, on a server configured as a shared one (per-tenant caps on) whose adapter cache holds a
training run and only a few samplers. Nothing is refused; the old samplers, long evicted, load again
and score a fixed sequence exactly as they did when they were made; what stays resident is bounded.

On the tiny random stand-in for the default model (tests/tiny_model.py): this is about the adapter cache and
old samplers' exactness, not what a model learns. The cache's size is computed from the stand-in's adapters.
"""

from __future__ import annotations

import sys

import pytest

from servers import REPO, start_server

sys.path.insert(0, str(REPO / "bench"))
import soak  # noqa: E402


@pytest.fixture(scope="module")
def adapter_bytes(engine) -> dict[str, int]:
    """What the adapter cache counts for a rank-8 training run (its weights, gradients and AdamW's two moments)
    and for a sampler of it (its weights alone), measured on an engine of the same model as the server's."""
    from kernel_backend.engine.adapter_cache import TRAINING_COPIES
    from kernel_backend.types import LoraConfig

    from helpers import new_id

    run_id = new_id("long-runs")
    engine.create_adapter(run_id, LoraConfig(rank=8))
    try:
        run = engine.adapters.entry(run_id).nbytes
    finally:
        engine.delete_adapter(run_id)
    return {"run": run, "sampler": run // TRAINING_COPIES}


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory, stepwise_home, tiny_model, adapter_bytes):
    """A shared server whose adapter cache holds the training run and 4 samplers (room for 5, in whole MB, rounded
    down): as 100 MB held a rank-8 run of SmolLM2 (about 45 MB) and 4 of its samplers (about 11 MB each)."""
    from tiny_model import stand_in_env

    cache_mb = (adapter_bytes["run"] + 5 * adapter_bytes["sampler"]) >> 20
    home = tmp_path_factory.mktemp("long_runs")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_EMBEDDED": "0", "STEPWISE_ADAPTER_CACHE_MB": str(cache_mb),
                                     **stand_in_env(tiny_model)})
    server.cache_bytes = cache_mb << 20
    yield server
    server.stop()


def caches(server) -> list[dict]:
    """The server's adapter caches (AdapterCache.stats), one per base model."""
    return list(soak.admin_stats(server)["adapter_cache"]["in-process"].values())


def test_a_sampler_per_step_for_30_steps_on_a_cache_of_a_few_adapters(small_cache_server, adapter_bytes):
    server = small_cache_server
    budget = server.cache_bytes
    service_client, training_client = soak.make_clients(server, rank=8)
    # After every step, when no request is decoding, what is resident is within the budget: the cache holds more
    # only while decoding requests hold their adapters, and gives it back on its next use.
    resident_after_step = []

    def on_step(step: int, row: dict) -> None:
        [cache] = caches(server)
        assert cache["budget_bytes"] == budget
        resident_after_step.append(cache["resident_bytes"])

    # 8 rows of 8 tokens a step (the bench's 16 rows of 16 would double the test's time and teach it nothing more).
    result = soak.run_soak(service_client, training_client, steps=30, server=server, num_samples=2, max_tokens=8,
                           check_old_every=5, window=5, save_state_every=10, on_step=on_step)

    # Every step ran (an SDK error would have raised), and 30 samplers were made from paths.
    assert len(result["step_s"]) == 30 and len(result["sampler_paths"]) == 31
    # Old samplers (step 1's among them) answered again, each time the same logprobs as when made.
    assert result["check_count"] >= 10 and {c["sampler_step"] for c in result["checks"]} >= {1}
    assert result["mismatches"] == 0, result["checks"]

    [cache] = result["admin_stats"]["adapter_cache"]["in-process"].values()
    assert cache["drops"] >= 20, cache  # the samplers really were evicted and loaded again
    # What stays resident is bounded: by the budget after every step, and in count by the run and what fits.
    assert len(resident_after_step) == 30 and max(resident_after_step) <= budget, (resident_after_step, budget)
    assert cache["resident"] <= 2 + budget // adapter_bytes["sampler"], cache

    # The same tenant goes on: a second run, its samplers, nothing left over from the first is in the way.
    again_service, again_training = soak.make_clients(server, rank=8, seed=1)
    second = soak.run_soak(again_service, again_training, steps=3, server=server, num_samples=2, max_tokens=8,
                           check_old_every=0, window=1)
    assert len(second["step_s"]) == 3
    assert all(c["resident_bytes"] <= budget for c in caches(server)), caches(server)
