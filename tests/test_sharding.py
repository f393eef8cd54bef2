"""A base model sharded over 2 processes (kernel_backend/engine/sharding.py) computes what the unsharded model
computes, and each process holds about half of it.

Two processes joined by gloo on loopback (torch.multiprocessing, spawn) each load the tiny stand-in model, shard
it, and run the same engine calls; this process runs them on the unsharded model. The calls: LoRA forward, a
forward_backward of two adapters in one batch (the multi-tenant batch), their optim_steps, forward and the
sampler's logprobs and greedy tokens after the step, and the same for a full fine-tuning run.
"""

from __future__ import annotations

import gc
import os
import socket
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from safetensors.torch import load_file

from kernel_backend.engine import lora, optimizers, sharding
from kernel_backend.engine.core import Engine, Pass, _Slot
from kernel_backend.engine.step_history import write_state
from kernel_backend.types import AdamParams, Datum, LoraConfig, SamplingParams
from tiny_model import stand_in_settings, tiny_model_folder

WORLD = 2
TOLERANCE = 1e-5


def _datum(tokens: list[int]) -> Datum:
    return Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)})


def _rows(engine: Engine) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, engine.vocab_size, n).tolist() for n in (22, 14)]  # 21 and 13 input tokens


def _calls(engine: Engine) -> dict:
    """The engine calls both sides run, in the same order, and what they answered."""
    rows = _rows(engine)
    data = [_datum(r) for r in rows]
    engine.create_adapter("a", LoraConfig(rank=4, seed=1))
    engine.create_adapter("b", LoraConfig(rank=8, seed=2, train_unembed=False))
    out: dict = {"forward": _logprobs(engine.forward("a", data))}
    fb = engine.run_passes([Pass("a", data), Pass("b", data[::-1])])  # two runs' rows in one batch
    out["forward_backward"] = [_logprobs(r) for r in fb]
    out["loss"] = [r.metrics["loss:sum"] for r in fb]
    for adapter in ("a", "b"):
        engine.optim_step(adapter, AdamParams(learning_rate=1e-2))
    out["after_step"] = [_logprobs(engine.forward(a, data)) for a in ("a", "b")]
    out["adapter_a"] = {n: p.detach().clone() for n, p in engine._slot("a").adapter.named_parameters()}
    out["prompt_logprobs"] = engine.compute_logprobs("a", rows[0])[1:]
    greedy = engine.sample("a", rows[1], 2, SamplingParams(max_tokens=6, temperature=0.0))
    out["greedy"] = [s.tokens for s in greedy.sequences]
    # A full fine-tuning run: on a sharded model its weights are this process's shards (engine/sharding.py).
    engine.create_adapter("full", LoraConfig(rank=0))
    out["full_forward_backward"] = _logprobs(engine.forward_backward("full", data))
    out["full_grad_norm"] = sharding.grad_norm(engine.model, engine._slot("full").adapter)
    out["full_grad_norm_reported"] = engine.optim_step("full", AdamParams(learning_rate=1e-3))["grad_norm:mean"]
    out["full_after_step"] = _logprobs(engine.forward("full", data))
    out["full_prompt_logprobs"] = engine.compute_logprobs("full", rows[0])[1:]
    return out


def _step(engine: Engine, adapter_id: str) -> np.ndarray:
    """One more training step of a run, and its logprobs after it."""
    data = [_datum(r) for r in _rows(engine)]
    engine.forward_backward(adapter_id, data)
    engine.optim_step(adapter_id, AdamParams(learning_rate=1e-3))
    return _logprobs(engine.forward(adapter_id, data))


def _save_whole(engine: Engine, adapter_id: str, folder: Path, write: bool) -> None:
    """A sharded full run's save_state folder, written whole (weights and AdamW state) by one process."""
    slot = engine._slot(adapter_id)
    run = sharding.whole_weights(engine.model, slot.adapter)
    state = optimizers.state_tensors(slot.optimizer, slot.adapter.named_parameters())
    state = sharding.whole_tensors(engine.model, state)
    if write:
        write_state(folder, run, state, "adamw", slot.steps, engine.base)


def _resume_sharded(engine: Engine, adapter_id: str, folder: Path) -> None:
    """Engine.load_state of a full run's folder, on a sharded model: resharded onto this group."""
    run = sharding.load_full(engine.model, folder, LoraConfig(rank=0))
    optimizer = optimizers.create("adamw", run.parameters(), 0)
    state = sharding.shard_tensors(engine.model, load_file(folder / "optimizer.safetensors"))
    optimizers.load_state_tensors(optimizer, run.named_parameters(), state)
    engine.adapters.add(adapter_id, _Slot(run, optimizer, 1))


def _logprobs(result) -> np.ndarray:
    return np.concatenate([o["logprobs"] for o in result.loss_fn_outputs])


def _gathers_in_one_step(engine: Engine) -> dict:
    """How often a LoRA forward and its backward gather weights, and the shapes autograd saved between them."""
    model = engine.model
    owners = sharding.sharded_weights(model)
    shard_storages = {o.shard.untyped_storage().data_ptr() for o in owners}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in shard_storages:
            saved.append(tuple(t.shape))
        return t

    adapter = engine._slot("a").adapter
    ids = torch.arange(100, 121)[None]  # 21 tokens: no activation is shaped like a weight
    start = sum(o.gathers for o in owners)
    with lora.route(model, [adapter]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    forward = sum(o.gathers for o in owners) - start
    logits.logsumexp(-1).sum().backward()
    backward = sum(o.gathers for o in owners) - start - forward
    for p in adapter.parameters():
        p.grad = None
    return {"forward": forward, "backward": backward, "saved_shapes": saved,
            "weight_shapes": [o.full_shape for o in owners], "linear_layers": len(lora.lora_layers(model))}


# Families whose layers differ from the stand-in's where sharding could notice: q, k, v biases (Qwen2, here with an
# odd MLP width, so that the last shard of gate and up is padded); a scaled embedding, two rotary tables and
# sandwich norms (Gemma 3).
FAMILIES = {"qwen2": {"intermediate_size": 129},
            "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}}


def _families_alike(folders: list[str]) -> dict[str, list[float]]:
    """Each family's logits, sharded (loaded straight into shards, and loaded whole then sharded), against whole."""
    from transformers import AutoModelForCausalLM

    out = {}
    ids = torch.arange(100, 130)[None]  # longer than Gemma's 16-token window
    for folder in folders:
        whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        lora.attach(whole)
        with torch.no_grad():
            reference = whole(input_ids=ids).logits
            loaded = sharding.load_sharded(Path(folder))(input_ids=ids).logits
            sharding.shard_model(whole)
            sharded = whole(input_ids=ids).logits
        out[Path(folder).name] = [float((x - reference).abs().max()) for x in (loaded, sharded)]
    return out


def _rank(rank: int, folder: str, port: int, out_dir: str, families: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on the suite's two cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        engine = Engine(settings=stand_in_settings(Path(folder)))
        whole = sharding.resident_bytes(engine.model)
        embedding = weakref.ref(engine.model.get_input_embeddings().weight)
        sharding.shard_model(engine.model)
        gc.collect()
        # The same shards read straight from the files, the whole model never made (a model bigger than a worker).
        loaded = sharding.load_sharded(Path(folder))
        made_alike = _same_tensors(loaded, engine.model)
        with torch.no_grad():
            logits = [m(input_ids=torch.arange(100, 121)[None]).logits for m in (loaded, engine.model)]
        loaded_logits_difference = float((logits[0] - logits[1]).abs().max())
        del loaded, logits
        out = _calls(engine)
        # A full run's snapshot: gathered whole on every process, written by one, resharded from the files.
        snapshot = Path(out_dir) / "full-sharded"
        _save_whole(engine, "full", snapshot, write=rank == 0)
        dist.barrier()
        _resume_sharded(engine, "resumed", snapshot)
        out["resumed_step"] = _step(engine, "resumed")
        # One process's unusable step is every process's (rank 1 alone finds it).
        out["agreed"] = [sharding.on_any_process(rank == 1, engine.model), sharding.on_any_process(False, engine.model)]
        out.update(made_alike=made_alike, loaded_logits_difference=loaded_logits_difference,
                   families=_families_alike(families))
        out.update(whole_bytes=whole, held_bytes=sharding.resident_bytes(engine.model),
                   engine_memory=engine.memory()["base_model_bytes"],
                   shard_bytes=sum(o.shard.nbytes for o in sharding.sharded_weights(engine.model)),
                   whole_embedding_freed=embedding() is None, gathers=_gathers_in_one_step(engine))
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Both modules hold the same parameters and buffers, by name, bit for bit."""
    ta = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    tb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    return ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory, stepwise_home):
    """{"whole": this process's answers on the unsharded model, 0 and 1: each sharded process's}."""
    out_dir = tmp_path_factory.mktemp("sharding")
    families = [tiny_model_folder(out_dir / name, name, stepwise_home / "models", **extra)
                for name, extra in FAMILIES.items()]
    processes = mp.start_processes(_rank, args=(str(tiny_model), _free_port(), str(out_dir), families), nprocs=WORLD,
                                   start_method="spawn", join=False)
    engine = Engine(settings=stand_in_settings(tiny_model))  # while the processes start (imports take most of it)
    whole = _calls(engine)
    engine.save_weights_for_sampler("full", out_dir / "full-whole")
    while not processes.join():  # raises if one failed
        pass
    answers = {rank: torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)}
    answers["whole"] = whole
    # The sharded run's snapshot loads unsharded (2 processes -> 1), and goes on as the run that wrote it would.
    engine.load_state("resumed", out_dir / "full-sharded")
    whole["resumed_step"] = _step(engine, "resumed")
    whole["full_step"] = _step(engine, "full")
    answers["checkpoints"] = out_dir
    return answers


def _max_difference(a, b) -> float:
    if isinstance(a, dict):
        return max(_max_difference(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and a and not isinstance(a[0], (int, float)):
        return max(_max_difference(x, y) for x, y in zip(a, b, strict=True))
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@pytest.mark.parametrize("key", ["forward", "forward_backward", "loss", "after_step", "adapter_a", "prompt_logprobs",
                                 "full_forward_backward", "full_after_step", "full_prompt_logprobs",
                                 "resumed_step"])
def test_sharded_equals_unsharded(runs, key):
    for rank in range(WORLD):
        difference = _max_difference(runs["whole"][key], runs[rank][key])
        print(f"{key} rank {rank}: max |sharded - unsharded| = {difference:.3g}")
        assert difference <= TOLERANCE, (key, rank, difference)
    # The step changed something: the comparison after it is not of two untouched models.
    assert _max_difference(runs["whole"]["forward"], runs["whole"]["after_step"][0]) > 1e-3
    assert _max_difference(runs["whole"]["full_forward_backward"], runs["whole"]["full_after_step"]) > 1e-3


def test_a_full_run_resumes_from_its_whole_snapshot_on_any_number_of_processes(runs):
    """The snapshot the 2 processes wrote, loaded on 1 (and on 2, test_sharded_equals_unsharded's "resumed_step"),
    goes on as the run that wrote it: its AdamW moments came back with its weights."""
    difference = _max_difference(runs["whole"]["full_step"], runs["whole"]["resumed_step"])
    print(f"resumed from the sharded snapshot vs the run going on: {difference:.3g}")
    assert difference <= TOLERANCE


def test_a_full_runs_gradient_norm_is_summed_over_the_shards(runs):
    whole = runs["whole"]["full_grad_norm"]
    # optim_step's, unsharded: the whole gradient's norm, summed in float32 over 3M squares (grad_norm in float64)
    assert runs["whole"]["full_grad_norm_reported"] == pytest.approx(whole, rel=1e-4)
    for rank in range(WORLD):
        assert runs[rank]["full_grad_norm"] == pytest.approx(whole, rel=1e-6)
        # What the Engine's optim_step reports on a sharded model today: its own shards' norm (a hook to come).
        assert runs[rank]["full_grad_norm_reported"] < 0.99 * runs["whole"]["full_grad_norm_reported"]
        assert runs[rank]["agreed"] == [True, False]


def test_sharded_greedy_tokens_are_the_unsharded_ones(runs):
    assert runs[0]["greedy"] == runs[1]["greedy"] == runs["whole"]["greedy"]


def test_each_process_holds_about_half(runs):
    for rank in range(WORLD):
        whole, held = runs[rank]["whole_bytes"], runs[rank]["held_bytes"]
        print(f"rank {rank}: {held:,} of {whole:,} bytes ({held / whole:.3f})")
        assert 0.45 < held / whole < 0.55
        assert runs[rank]["shard_bytes"] <= held
        assert runs[rank]["whole_embedding_freed"]  # the memory is gone, not only uncounted
        # What the engine reports (GET /api/v1/cluster, a Ray worker's free memory for placement) is the shards.
        assert runs[rank]["engine_memory"] == held


def test_loading_straight_into_shards_gives_the_same_model(runs):
    """load_sharded reads each process's rows from the files: the same shards, norms and rotary tables as loading
    the whole model and sharding it, and the same logits."""
    for rank in range(WORLD):
        assert runs[rank]["made_alike"]
        assert runs[rank]["loaded_logits_difference"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_shard_alike(runs, family):
    for rank in range(WORLD):
        assert runs[rank]["families"][family] == [0, 0]  # loaded into shards, sharded after loading: the same logits


def test_a_weight_is_gathered_on_use_and_again_in_backward(runs):
    for rank in range(WORLD):
        g = runs[rank]["gathers"]
        # Forward: each linear layer once (lm_head's weight is the embedding's; the lookup itself gathers nothing).
        assert g["forward"] == g["linear_layers"]
        # Backward: each linear layer whose input has a gradient (not the first layer's q, k, v: the embedding is
        # frozen), gathered again rather than kept from forward.
        assert g["backward"] == g["linear_layers"] - 3
        assert not set(g["saved_shapes"]) & set(g["weight_shapes"]), "a whole weight was kept for backward"


def test_a_sharded_full_run_saves_a_model_transformers_loads(runs, tiny_model):
    from transformers import AutoModelForCausalLM

    sharded, info = AutoModelForCausalLM.from_pretrained(runs["checkpoints"] / "full-sharded", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    whole = AutoModelForCausalLM.from_pretrained(runs["checkpoints"] / "full-whole").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert sharded.state_dict().keys() == whole.keys()
    difference = max(float((t - whole[n]).abs().max()) for n, t in sharded.state_dict().items())
    print(f"full checkpoint: max |sharded - unsharded| = {difference:.3g}")
    assert difference <= TOLERANCE
    assert max(float((t - base[n]).abs().max()) for n, t in sharded.state_dict().items()) > 1e-4  # it trained
