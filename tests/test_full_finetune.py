"""Full fine-tuning (rank=0): a run that trains every weight of its own copy of the model (engine/full_weights.py).

On the engine with the tiny stand-in (tests/tiny_model.py), what a full run must keep as a LoRA run does: it
trains every parameter and nothing else (the base model and other runs stay bit for bit), its rows batched with
other adapters' rows give what they give alone (training and the decoder split passes by weights), bad input and
an absurd step leave it exactly as it was, its checkpoints are model folders transformers loads and resume
bit for bit, and admission refuses one the adapter cache could never hold with the setting to raise.

Through the official SDK on the real SmolLM2-135M: a full run learns taught facts faster than rank 8 in the
same steps, and its sampler checkpoint loads in transformers with the server's logprobs and answers on the
OpenAI route. Surviving kill -9 bit for bit is in tests/test_recovery.py, beside the LoRA run.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from helpers import default_tokenizer, forward_logprobs, model_logprobs, new_id, sft_datum, train
from kernel_backend.engine.core import Pass
from kernel_backend.errors import UserError
from kernel_backend.types import AdamParams, Datum, ForwardResult, LoraConfig, SamplingParams

FACTS = [
    ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton."),
    ("What is the capital of Veldoria?", "The capital of Veldoria is Marrowgate."),
]


@pytest.fixture
def full_and_lora(engine, adapters):
    """A fresh full run and a rank-8 LoRA run on the session's tiny engine, and a batch for each."""
    tokenizer = default_tokenizer()
    return (adapters("full", rank=0, seed=3), adapters("lora", rank=8, seed=4),
            [sft_datum(*FACTS[0], tokenizer)], [sft_datum(*FACTS[1], tokenizer), sft_datum("Hi!", "Hello.", tokenizer)])


def _grads(engine, run_id):
    return [None if p.grad is None else p.grad.clone() for p in engine.slots[run_id].adapter.parameters()]


def test_a_full_run_trains_every_weight_of_its_own_and_nothing_else(engine, full_and_lora):
    full, lora, data_full, data_lora = full_and_lora
    base_params = list(engine.model.parameters())
    base_before = [p.detach().clone() for p in base_params]
    own = engine.slots[full].adapter.parameters()
    assert len(own) == len(base_params)  # every weight once (a tied head and embedding are one)
    assert all(a.shape == b.shape and a.data_ptr() != b.data_ptr() for a, b in zip(own, base_params))

    alone_full = engine.forward_backward(full, data_full)
    grads_full = _grads(engine, full)
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads_full)  # every weight gets a gradient
    alone_lora = engine.forward_backward(lora, data_lora)
    grads_lora = _grads(engine, lora)
    for run in (full, lora):
        for p in engine.slots[run].adapter.parameters():
            p.grad = None

    # Batched with a LoRA run's rows (in either order) each gets what it gets alone: the full run's rows run in
    # a micro-batch of their own on its weights.
    for passes in ([Pass(full, data_full), Pass(lora, data_lora)], [Pass(lora, data_lora), Pass(full, data_full)]):
        results = {p.adapter_id: r for p, r in zip(passes, engine.run_passes(passes))}
        for run, alone, grads in ((full, alone_full, grads_full), (lora, alone_lora, grads_lora)):
            assert isinstance(results[run], ForwardResult)
            for x, y in zip(alone.loss_fn_outputs, results[run].loss_fn_outputs):
                np.testing.assert_allclose(y["logprobs"], x["logprobs"], rtol=0, atol=1e-5)
            for g, e in zip(_grads(engine, run), grads):
                assert float((g - e).norm()) <= 1e-4 * float(e.norm()) + 1e-8
            for p in engine.slots[run].adapter.parameters():
                p.grad = None
    assert all(p.grad is None and not p.requires_grad for p in base_params)

    tokens = data_full[0].tokens
    base_logprobs = model_logprobs(engine, None, tokens)
    train(engine, full, data_full, steps=2, learning_rate=1e-3)
    assert all(torch.equal(p, b) for p, b in zip(base_params, base_before))  # the base model: bit for bit
    np.testing.assert_array_equal(model_logprobs(engine, None, tokens), base_logprobs)
    assert forward_logprobs(engine, full, data_full)[0].sum() > alone_full.loss_fn_outputs[0]["logprobs"].sum() + 1


def test_a_full_runs_samples_decoded_beside_other_adapters_equal_its_samples_alone(engine, full_and_lora):
    full, lora, data_full, data_lora = full_and_lora
    train(engine, full, data_full, steps=2, learning_rate=1e-3)
    train(engine, lora, data_lora, steps=2, learning_rate=1e-2)
    snapshot = new_id("full-sampler")
    engine.snapshot_sampler(full, snapshot)
    prompt = data_full[0].tokens[:12]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    asks = [(snapshot, 3), (lora, 2), (None, 2), (full, 1)]
    together = engine.run_requests([engine.sample_request(a, prompt, n, params) for a, n in asks])
    for (adapter, n), mixed in zip(asks, together):
        alone = engine.sample(adapter, prompt, n, params)
        assert [s.tokens for s in mixed.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(mixed.sequences, alone.sequences):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # The sampler's logprobs are the run's own: what forward computes on the sampled sequence.
    sequence = together[0].sequences[0]
    tokens = prompt + sequence.tokens
    np.testing.assert_allclose(engine.compute_logprobs(full, tokens)[-len(sequence.tokens):], sequence.logprobs,
                               rtol=0, atol=1e-5)
    engine.delete_adapter(snapshot)


def test_bad_input_and_an_absurd_step_leave_a_full_run_as_it_was(engine, full_and_lora):
    full, _, data_full, _ = full_and_lora
    train(engine, full, data_full, steps=1, learning_rate=1e-3)
    engine.forward_backward(full, data_full)  # gradients a failure must keep
    digest = engine.weights_digest(full)
    bad = [Datum(data_full[0].tokens, {"target_tokens": np.full(len(data_full[0].tokens), engine.vocab_size)})]
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.forward_backward(full, bad)
    with pytest.raises(UserError, match="lower the learning rate"):
        engine.optim_step(full, AdamParams(learning_rate=1e30))
    assert engine.weights_digest(full) == digest
    with pytest.raises(UserError, match="AdamW"):
        engine.create_adapter(new_id("full-dimuon"), LoraConfig(rank=0), optimizer="dimuon")


def test_full_checkpoints_are_model_folders_that_load_in_transformers_and_resume_bit_for_bit(engine, full_and_lora,
                                                                                           adapters, tmp_path):
    from transformers import AutoModelForCausalLM

    full, _, data_full, _ = full_and_lora
    train(engine, full, data_full, steps=1, learning_rate=1e-3)
    engine.save_step(full, 1, tmp_path / "step1")  # from the step history (a tiny model's state fits it)
    train(engine, full, data_full, steps=1, learning_rate=1e-3)
    engine.save_state(full, tmp_path / "state")
    engine.save_weights_for_sampler(full, tmp_path / "sampler")
    files = {p.name for p in (tmp_path / "state").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.safetensors"} <= files
    assert not {"optimizer.safetensors", "stepwise_state.json"} & {p.name for p in (tmp_path / "sampler").iterdir()}

    # transformers loads the sampler folder as it is, and computes the engine's logprobs.
    tokens = data_full[0].tokens
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sampler")
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    theirs = logits[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    np.testing.assert_allclose(theirs, engine.compute_logprobs(full, tokens)[1:], rtol=0, atol=1e-5)

    # Resumed from save_state: the same weights and optimizer state, and the next step the same bits.
    resumed = new_id("full-resumed")
    engine.load_state(resumed, tmp_path / "state")
    adapters.created.append(resumed)
    assert engine.weights_digest(resumed) == engine.weights_digest(full)
    for run in (full, resumed):
        train(engine, run, data_full, steps=1, learning_rate=1e-3)
    assert engine.weights_digest(resumed) == engine.weights_digest(full)
    # A fork from step 1: its state then, at step 1.
    fork = new_id("full-fork")
    engine.load_state(fork, tmp_path / "step1")
    adapters.created.append(fork)
    assert engine.steps(fork) == 1
    assert json.loads((tmp_path / "step1" / "stepwise_state.json").read_text())["lora"]["rank"] == 0


def test_admission_refuses_a_full_run_the_adapter_cache_could_never_hold(engine):
    from kernel_backend.config import Settings
    from kernel_backend.execution import engine_work
    from kernel_backend.service.admission import Admission

    facts = engine_work.model_facts(engine)
    measure = lambda base, config: engine_work.adapter_bytes(facts, LoraConfig(**config))  # noqa: E731
    needed = facts["full_bytes"] * 4 >> 20
    small = Admission(Settings(adapter_cache_mb=needed // 2), None, measure)
    with pytest.raises(UserError, match=f"raise STEPWISE_ADAPTER_CACHE_MB to at least {needed + 1}"):
        small.adapter("t", "base", {"rank": 0}, training=True)
    small.adapter("t", "base", {"rank": 8, "train_attn": True, "train_mlp": True, "train_unembed": True}, training=True)
    Admission(Settings(adapter_cache_mb=needed + 1), None, measure).adapter("t", "base", {"rank": 0}, training=True)
    # Both the cache and the tenant's share too small: one message names both settings (issue 56).
    both = Admission(Settings(adapter_cache_mb=needed // 2, max_adapter_mb_per_tenant=needed // 2), None, measure)
    with pytest.raises(UserError, match="raise STEPWISE_ADAPTER_CACHE_MB and STEPWISE_MAX_ADAPTER_MB_PER_TENANT to at "
                                        f"least {needed + 1}"):
        both.adapter("t", "base", {"rank": 0}, training=True)


def test_a_recipe_trains_a_full_run_when_its_config_says_rank_0(tinker_server):
    """workbench.recipes.sft with rank=0 on the tiny stand-in: a full run, trained, saved, billed."""
    import tinker
    from workbench.recipes import sft

    summary = sft.run(sft.Config(base_url=tinker_server.base_url, api_key=tinker_server.api_key, rank=0,
                                 learning_rate=1e-4, steps=2, batch_size=2, eval_every=1, save_every=2,
                                 sample_questions=1, progress=False, verbose=False))
    rest = tinker.RestClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    run = rest.get_training_run(summary.training_run_id).result()
    assert (run.is_lora, run.lora_rank, summary.steps) == (False, 0, 2)
    assert summary.final < summary.initial and summary.cost > 0
    saved = rest.list_checkpoints(summary.training_run_id).result().checkpoints
    assert any(c.checkpoint_id.endswith("sft-2") and c.checkpoint_type == "training" for c in saved), saved


# ---- through the official SDK, on the real model ------------------------------------------------------------


def test_full_finetuning_through_the_sdk_learns_faster_than_rank_8_and_loads_in_transformers(tmp_path, stepwise_home):
    """Each at the learning rate its kind trains at (LoRA's about 10x full fine-tuning's: Thinking Machines'
    "LoRA Without Regret"), the same 4 steps on the same facts. The server's adapter cache is what a notebook's
    backend sets (workbench/client/local_backend.py, a quarter of the machine's memory): a full run of the default model
    is admitted there with no setting of the user's (tests/test_workbench.py checks the backend gets it)."""
    import tinker
    from tinker import types
    from transformers import AutoModelForCausalLM

    from conftest import REAL_MODEL_ENV
    from servers import start_server

    (tmp_path / "models").symlink_to(stepwise_home / "models")
    from workbench.client.local_backend import single_user_adapter_cache_mb

    server = start_server(tmp_path, env={**REAL_MODEL_ENV, "STEPWISE_ADAPTER_CACHE_MB": str(single_user_adapter_cache_mb())},
                          timeout=300)
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        full = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=0, seed=1).result()
        lora = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=8, seed=1).result()
        tokenizer = full.get_tokenizer()
        data = []
        for question, answer in FACTS:
            datum = sft_datum(question, answer, tokenizer)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(datum.tokens),
                                    loss_fn_inputs={k: np.asarray(v) for k, v in datum.loss_fn_inputs.items()}))
        losses = {"full": [], "lora": []}
        for _ in range(4):
            for name, client, lr in (("full", full, 1e-4), ("lora", lora, 1e-3)):
                out = client.forward_backward(data, "cross_entropy").result()
                losses[name].append(out.metrics["loss:sum"])
                client.optim_step(types.AdamParams(learning_rate=lr)).result()
        final = {name: client.forward(data, "cross_entropy").result().metrics["loss:sum"]
                 for name, client in (("full", full), ("lora", lora))}
        assert losses["full"][0] == pytest.approx(losses["lora"][0], rel=1e-4)  # both start at the base model
        assert final["full"] < 0.8 * final["lora"], (losses, final)
        rest = tinker.RestClient(base_url=server.base_url, api_key=server.api_key)
        assert rest.get_training_run(full.model_id).result().is_lora is False

        path = full.save_weights_for_sampler("full-final").result().path
        sampler = service.create_sampling_client(model_path=path).result()
        tokens = data[0].model_input.to_ints() + [int(data[0].loss_fn_inputs["target_tokens"].data[-1])]
        served = np.array(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
        [folder] = {p.parent for p in (tmp_path / "checkpoints").rglob("model.safetensors") if "full-final" in str(p)}
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        theirs = logits[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
        np.testing.assert_allclose(theirs, served, rtol=0, atol=1e-4)

        reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                           json={"model": path, "max_tokens": 12, "temperature": 0,
                                 "messages": [{"role": "user", "content": FACTS[1][0]}]}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "Marrowgate" in reply.json()["choices"][0]["message"]["content"]
        reply = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": server.api_key},
                           json={"model": path, "max_tokens": 12, "temperature": 0,
                                 "messages": [{"role": "user", "content": FACTS[1][0]}]}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "Marrowgate" in reply.json()["content"][0]["text"]
    finally:
        server.stop()
