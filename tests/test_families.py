"""The model families beyond Llama, end to end through the official SDK (kernel_backend/engine/families.py).

A tiny random Qwen3 and a tiny random Gemma 3 (built from their configs, with the default model's
tokenizer, since nothing may be downloaded here) are registered with STEPWISE_BASE_MODELS on a backend
of their own. Their numbers are checked against transformers in test_engine; here, that they work as
a user runs them: they train, report their architecture, sample in one batch, and score what they sampled.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from servers import start_server
from test_service_http import datum
from tiny_model import tiny_model_folder

FAMILIES = {
    "tiny-qwen3": ("qwen3", {}),
    # Its first layer slides over the last 16 tokens, as Gemma 3's local layers do (theirs: 1024).
    "tiny-gemma3": ("gemma3_text", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
}


@pytest.fixture(scope="module")
def families_server(tmp_path_factory, stepwise_home):
    home = tmp_path_factory.mktemp("families")
    (home / "models").symlink_to(stepwise_home / "models")
    registered = [f"{name}={tiny_model_folder(home / name, architecture, stepwise_home / 'models', **extra)}"
                  for name, (architecture, extra) in FAMILIES.items()]
    server = start_server(home, env={"STEPWISE_BASE_MODELS": ",".join(registered)})
    yield server
    server.stop()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tiny_family_model_trains_samples_in_one_batch_and_scores_its_samples(families_server, name):
    architecture = FAMILIES[name][0]
    client = tinker.ServiceClient(base_url=families_server.base_url, api_key=families_server.api_key)
    tc = client.create_lora_training_client(base_model=name, rank=8).result()
    assert tc.get_info().model_data.arch == architecture

    # SFT on one repeated batch: the loss falls (the packed training forward, sliding window included).
    data = [datum([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198] * 3)]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses

    # Eight requests at once decode in one batch: the decoder ran eight rows together.
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 9690, 198, 2683, 359])
    params = types.SamplingParams(max_tokens=48, temperature=1.0, stop=[])
    futures = [sampler.sample(prompt, 1, types.SamplingParams(**{**params.model_dump(), "seed": i})) for i in range(8)]
    results = [f.result() for f in futures]
    stats = httpx.get(families_server.base_url + "/api/v1/admin/stats",
                      headers={"X-API-Key": families_server.api_key}).json()["sampling"]["in-process"][name]
    assert stats["decoder"] == "batched" and stats["peak_rows"] >= 8, stats
    assert len({tuple(r.sequences[0].tokens) for r in results}) > 1  # each its own seed

    # compute_logprobs of what was sampled equals the sampler's own logprobs (a prefill vs decode steps).
    seq = results[0].sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt.to_ints() + seq.tokens)).result()
    np.testing.assert_allclose(scored[prompt.length:], seq.logprobs, rtol=0, atol=1e-4)


# ---- each family's LoRA against PEFT's, on tiny random models (no server) ---------------------------


def _tiny(architecture: str, extra: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_engine import FAMILY_CONFIGS

    config = AutoConfig.for_model(architecture, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=256, **{**FAMILY_CONFIGS[architecture], **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _architectures():
    from test_engine import FAMILY_CONFIGS

    return list(FAMILY_CONFIGS)


@pytest.mark.parametrize("architecture", _architectures())
def test_lora_gradients_equal_peft_and_the_exported_adapter_gives_the_same_logits(architecture, tmp_path):
    """Our LoRA, trained through the packed forward, and PEFT's on the same A and B through transformers' own
    forward: the same loss, the same gradient on every A and B; the adapter save_peft writes (what
    save_weights_for_sampler and `stepwise export` write) loads in PEFT on a fresh model with our logits."""
    import warnings

    from peft import PeftModel

    from kernel_backend.engine import families, lora, packed_forward
    from kernel_backend.types import LoraConfig

    model = _tiny(architecture, {}).requires_grad_(False)
    reference = _tiny(architecture, {})
    reference.load_state_dict(model.state_dict())
    lora.attach(model)
    adapter = lora.new_adapter(model, LoraConfig(rank=4, seed=1))  # attention, MLP and unembedding: Tinker's default
    generator = torch.Generator().manual_seed(2)
    for _, b in adapter.weights.values():  # B != 0, so that A gets a gradient and the adapter changes the model
        b.data.normal_(0, 0.05, generator=generator)
    # Phi-3's fused projections; Qwen3-MoE's experts are 3-D parameters, not linear layers: no MLP LoRA there.
    expected_kinds = {"phi3": {"qkv_proj", "gate_up_proj"}, "qwen3_moe": {"q_proj", "v_proj", "lm_head"}}.get(
        architecture, {"q_proj", "v_proj", "gate_proj"})
    assert expected_kinds <= {name.rsplit(".", 1)[-1] for name in adapter.weights}

    rows = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (19, 12)]  # longer than a window of 8
    ids = torch.tensor([t for row in rows for t in row])
    positions = torch.cat([torch.arange(len(row)) for row in rows])
    attend = packed_forward.causal_within_rows(model, [len(r) for r in rows])
    with lora.route(model, [adapter] * len(ids)):
        logits = families.final_logits(model.config, model.lm_head(packed_forward.flat_forward(model, ids, positions, attend)))
    ours = sum(torch.nn.functional.cross_entropy(part[:-1], torch.tensor(row[1:]), reduction="sum")
               for part, row in zip(logits.split([len(r) for r in rows]), rows))
    ours.backward()

    lora.save_peft(adapter, tmp_path / "adapter", architecture)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        peft_model = PeftModel.from_pretrained(reference, tmp_path / "adapter", is_trainable=True)
    theirs = 0
    for part, row in zip(logits.split([len(r) for r in rows]), rows):
        out = peft_model(torch.tensor([row])).logits[0]
        torch.testing.assert_close(part.detach(), out.detach(), rtol=0, atol=1e-5)  # the exported adapter's logits
        theirs = theirs + torch.nn.functional.cross_entropy(out[:-1], torch.tensor(row[1:]), reduction="sum")
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-5)
    state = dict(peft_model.named_parameters())
    for name, (a, b) in adapter.weights.items():
        for ours_param, kind in ((a, "A"), (b, "B")):
            peft_grad = state[f"base_model.model.{name}.lora_{kind}.default.weight"].grad
            assert ours_param.grad is not None and ours_param.grad.abs().max() > 0, name
            # float32 sums in another order: differences of a few 1e-6 on gradients up to about 1
            torch.testing.assert_close(ours_param.grad, peft_grad, rtol=1e-3, atol=1e-5)
