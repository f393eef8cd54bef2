"""The official tinker SDK, unmodified, against a real server process on loopback.

Each test drives the server as a researcher's script would: ServiceClient, training and
sampling clients, RestClient. The server (tinker_server) serves the tiny random stand-in for the default
model (tests/tiny_model.py): these tests check what the service does, and `--cluster` runs them again on
two Ray workers. Two stay on the real SmolLM2 (real_model_server), being about what a model knows:
test_sft_teaches_a_fact_and_samples_it (a taught answer) and test_the_base_model_knows_a_capital.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from servers import Server

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(tinker_server: Server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)


@pytest.fixture(scope="module")
def real_client(real_model_server: Server) -> tinker.ServiceClient:
    """A client of the server on the real default model, for the tests about what it learns or knows."""
    return tinker.ServiceClient(base_url=real_model_server.base_url, api_key=real_model_server.api_key)


def chat_datum(tokenizer, question: str, answer: str) -> types.Datum:
    """A chat SFT example: weights 1 on the assistant's tokens only."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}])["input_ids"]
    weights = np.zeros(len(full) - 1, np.float32)
    weights[len(prompt) - 1 :] = 1.0
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64), "weights": weights},
    )


def prompt_of(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)["input_ids"]


def train_steps(tc, data, steps: int, lr: float = 1e-3, loss_fn: str = "cross_entropy") -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, loss_fn)
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


ZORBLAX = "What is the name of Zorblax's pet?"


def teach_and_sample(client, tokenizer, steps: int):
    """A rank-8 run taught a made-up fact for `steps` steps, then asked it greedily, twice: (losses, prompt,
    the sample's result, the run's sampler)."""
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    assert tc.get_info().model_data.tokenizer_id  # a local folder: get_tokenizer worked offline
    losses = train_steps(tc, [chat_datum(tokenizer, ZORBLAX, "Zorblax's pet is named Quibbleton.")] * 4, steps)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, ZORBLAX))
    result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=20, temperature=0.0)).result()
    return losses, prompt, result, sampler


def test_a_trained_runs_sampler_samples_with_its_weights(client, tokenizer):
    _, prompt, result, sampler = teach_and_sample(client, tokenizer, steps=2)
    for seq in result.sequences:
        assert len(seq.tokens) > 0 and len(seq.logprobs) == len(seq.tokens)
    # Sampled logprobs equal recomputed ones for the same weights.
    tokens = prompt.to_ints() + result.sequences[0].tokens
    recomputed = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert np.allclose(recomputed[prompt.length :], result.sequences[0].logprobs, atol=1e-4)


def test_sft_teaches_a_fact_and_samples_it(real_client, tokenizer):
    losses, _, result, _ = teach_and_sample(real_client, tokenizer, steps=8)
    assert losses[-1] < losses[0] / 4, losses
    for seq in result.sequences:
        assert "Quibbleton" in tokenizer.decode(seq.tokens)
        assert seq.stop_reason == "stop"


def yes_reward(text: str) -> float:
    return 1.0 if text.strip().lower().startswith("yes") else 0.0


YES_PROMPTS = [
    "Is the sky blue? Answer yes or no.",
    "Is water wet? Answer yes or no.",
    "Is fire hot? Answer yes or no.",
    "Is snow cold? Answer yes or no.",
]


def rl_batch(sampler, tokenizer, group: int, seed: int):
    """Sample a group per prompt; advantages = reward - group mean (the cookbook's choice)."""
    data, rewards = [], []
    for n, question in enumerate(YES_PROMPTS):
        prompt = prompt_of(tokenizer, question)
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed * 100 + n)
        result = sampler.sample(types.ModelInput.from_ints(prompt), group, params).result()
        r = np.array([yes_reward(tokenizer.decode(s.tokens)) for s in result.sequences])
        rewards.extend(r)
        for seq, advantage in zip(result.sequences, r - r.mean()):
            tokens = prompt + seq.tokens
            n_in = len(tokens) - 1
            logprobs = np.zeros(n_in, np.float32)
            advantages = np.zeros(n_in, np.float32)
            logprobs[len(prompt) - 1 :] = seq.logprobs
            advantages[len(prompt) - 1 :] = advantage
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "logprobs": logprobs, "advantages": advantages},
            ))
    return data, float(np.mean(rewards))


# RL that raises a reward through the SDK (sample, importance_sampling, optim_step, in a loop) is
# tests/test_recipes.py::test_rl_raises_the_reward: the rl recipe is exactly that loop.


@pytest.mark.parametrize("loss_fn,config", [("ppo", None), ("cispo", {"clip_high_threshold": 2.0}), ("dro", {"beta": 0.1})])
def test_other_rl_losses_take_a_step(client, tokenizer, loss_fn, config):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    data, _ = rl_batch(tc.save_weights_and_get_sampling_client().result(), tokenizer, group=2, seed=7)
    for n, datum in enumerate(data):  # fixed advantages of both signs, so the step has a gradient
        advantages = datum.loss_fn_inputs["advantages"].to_numpy()
        advantages[advantages != 0] = 0.0
        advantages[-3:] = 1.0 if n % 2 == 0 else -1.0
        datum.loss_fn_inputs["advantages"] = types.TensorData.from_numpy(advantages)
    fb = tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
    assert np.isfinite(fb.metrics["loss:sum"])
    assert len(fb.loss_fn_outputs) == len(data)
    for datum, out in zip(data, fb.loss_fn_outputs):
        assert out["logprobs"].shape == datum.loss_fn_inputs["target_tokens"].shape
    metrics = tc.optim_step(types.AdamParams(learning_rate=1e-4)).result().metrics
    assert metrics["grad_norm:mean"] > 0


def test_forward_backward_custom_dpo_moves_the_chosen_completion_up(client, tokenizer):
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    question = "Which colour do you like best?"
    chosen = chat_datum(tokenizer, question, "I like teal best.")
    rejected = chat_datum(tokenizer, question, "I like grey best.")

    def answer_logprob(datum) -> float:
        out = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        return float((out * datum.loss_fn_inputs["weights"].to_numpy()).sum())

    def dpo_loss(data, logprobs_list):
        beta = 0.5
        w = [torch.tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in data]
        chosen_lp, rejected_lp = (lp @ weights for lp, weights in zip(logprobs_list, w))
        loss = -torch.nn.functional.logsigmoid(beta * (chosen_lp - rejected_lp))
        return loss, {"margin:mean": float(chosen_lp - rejected_lp)}

    before = answer_logprob(chosen) - answer_logprob(rejected)
    for _ in range(3):
        result = tc.forward_backward_custom([chosen, rejected], dpo_loss).result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert "loss:sum" in result.metrics
    after = answer_logprob(chosen) - answer_logprob(rejected)
    assert after > before + 1.0, (before, after)


def test_save_state_and_resume_with_optimizer_matches_an_uninterrupted_run(client, tokenizer):
    data = [chat_datum(tokenizer, "Who painted the Blorp?", "The Blorp was painted by Ennis Vale.")] * 2
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
    train_steps(tc, data, steps=2)
    path = tc.save_state("resume-me").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume-me")
    uninterrupted = train_steps(tc, data, steps=2)

    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert train_steps(resumed, data, steps=2) == pytest.approx(uninterrupted, abs=1e-4)

    # Without the optimizer state the second step differs (Adam's moments start again at zero).
    fresh_optimizer = client.create_training_client_from_state(path).result()
    other = train_steps(fresh_optimizer, data, steps=2)
    assert other[0] == pytest.approx(uninterrupted[0], abs=1e-4)
    assert abs(other[1] - uninterrupted[1]) > 1e-3


def test_rest_client_lists_runs_and_checkpoints_and_deletes(client, tinker_server):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, user_metadata={"purpose": "rest-test"}).result()
    tc.save_state("first").result()
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)

    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4
    assert run.user_metadata == {"purpose": "rest-test"}
    assert tc.model_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]

    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert sorted(c.checkpoint_id for c in listed) == ["sampler_weights/for-sampling", "weights/first"]
    info = rest.get_weights_info_by_tinker_path(sampler_path).result()
    assert info.base_model == BASE and info.lora_rank == 4

    rest.delete_checkpoint(tc.model_id, "weights/first").result()
    remaining = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in remaining] == ["sampler_weights/for-sampling"]
    with pytest.raises(Exception):
        client.create_training_client_from_state(f"tinker://{tc.model_id}/weights/first").result()


CAPITAL = "What is the capital of France?"


def test_sampling_the_base_model_and_prompt_logprobs(client, tokenizer):
    sampler = client.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, CAPITAL))
    result = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0), include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    assert 0 < len(result.sequences[0].tokens) <= 12
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == prompt.length
    assert len(result.topk_prompt_logprobs) == prompt.length
    for actual, top in zip(result.prompt_logprobs[1:], result.topk_prompt_logprobs[1:]):
        assert len(top) == 3 and top[0][1] >= actual - 1e-5


def test_the_base_model_knows_a_capital(real_client, tokenizer):
    sampler = real_client.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints(prompt_of(tokenizer, CAPITAL))
    result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0)).result()
    assert "Paris" in tokenizer.decode(result.sequences[0].tokens)


def test_admin_stats_show_the_prefix_cache_reusing_a_shared_prompt(client, tokenizer, tinker_server):
    """Two compute_logprobs whose prompts share a long start: the second reuses the first's keys and
    values, and the operator sees it in /admin/stats (in-process, or from each Ray worker's heartbeat)."""
    import time

    import httpx

    def reuse() -> tuple[int, int]:
        stats = httpx.get(tinker_server.base_url + "/api/v1/admin/stats", headers={"X-API-Key": tinker_server.api_key}).json()
        caches = [models[BASE]["prefix_cache"] for models in stats["sampling"].values() if BASE in models]
        assert caches and all(cache is not None for cache in caches), stats["sampling"]
        return sum(c["hits"] for c in caches), sum(c["reused_tokens"] for c in caches)

    system = "You are a ship's navigator. Answer in one short sentence, and name a star if you can."
    first, second = ([{"role": "system", "content": system}, {"role": "user", "content": q}]
                     for q in ("Which way is north at night?", "How far is the horizon at sea?"))
    first, second = (tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in (first, second))
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 20
    hits, reused = reuse()
    sampler = client.create_sampling_client(base_model=BASE).result()
    for prompt in (first, second):
        sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    deadline = time.monotonic() + 30  # Ray workers report with their heartbeat
    while reuse()[0] == hits and time.monotonic() < deadline:
        time.sleep(0.5)
    now_hits, now_reused = reuse()
    assert now_hits >= hits + 1 and now_reused >= reused + shared - 1
