"""Long runs through the official SDK against a real `serve`: a sampler per step for tens of steps.

The loop of Tinker's docs (bench/soak.py's `run_soak`: sample 16 rows, importance_sampling
forward_backward, optim_step, save_weights_for_sampler + create_sampling_client(model_path) every step)
for 30 steps, on a server configured as a shared one (per-tenant caps on) whose adapter cache holds a
training run and only a few samplers. Nothing is refused; the old samplers, long evicted, load again
and score a fixed sequence exactly as they did when they were made; what stays resident is bounded.
"""

from __future__ import annotations

import sys

import pytest

from servers import REPO, start_server

sys.path.insert(0, str(REPO / "bench"))
import soak  # noqa: E402

CACHE_MB = 100  # a rank-8 run counts about 45 MB here, a sampler about 11 MB: the run and ~4 samplers


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory, stepwise_home):
    home = tmp_path_factory.mktemp("long_runs")
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_EMBEDDED": "0", "STEPWISE_ADAPTER_CACHE_MB": str(CACHE_MB)})
    yield server
    server.stop()


def test_a_sampler_per_step_for_30_steps_on_a_cache_of_a_few_adapters(small_cache_server):
    server = small_cache_server
    service_client, training_client = soak.make_clients(server, rank=8)
    # 8 rows of 8 tokens a step (the bench's 16 rows of 16 would double the test's time and teach it nothing more).
    result = soak.run_soak(service_client, training_client, steps=30, server=server, num_samples=2, max_tokens=8,
                           check_old_every=5, window=5, save_state_every=10)

    # Every step ran (an SDK error would have raised), and 30 samplers were made from paths.
    assert len(result["step_s"]) == 30 and len(result["sampler_paths"]) == 31
    # Old samplers (step 1's among them) answered again, each time the same logprobs as when made.
    assert result["check_count"] >= 10 and {c["sampler_step"] for c in result["checks"]} >= {1}
    assert result["mismatches"] == 0, result["checks"]

    [cache] = result["admin_stats"]["adapter_cache"]["in-process"].values()
    assert cache["drops"] >= 20, cache  # the samplers really were evicted and loaded again
    # What stays resident is bounded: the budget, or over it only by what decoding requests held.
    assert cache["resident_bytes"] <= CACHE_MB << 20 or cache["over_budget"] > 0, cache
    assert cache["resident"] <= 2 + (CACHE_MB << 20) // (11 << 20), cache

    # The same tenant goes on: a second run, its samplers, nothing left over from the first is in the way.
    again_service, again_training = soak.make_clients(server, rank=8, seed=1)
    second = soak.run_soak(again_service, again_training, steps=3, server=server, num_samples=2, max_tokens=8,
                           check_old_every=0, window=1)
    assert len(second["step_s"]) == 3
    stats = soak.admin_stats(server)["adapter_cache"]["in-process"]
    assert all(c["resident_bytes"] <= CACHE_MB << 20 for c in stats.values()), stats
