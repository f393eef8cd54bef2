"""The whole tinker 0.38 surface through the unmodified SDK against a real server: every public
method of ServiceClient, TrainingClient, SamplingClient, RestClient and AdminClient (their `_async`
twins included) is a row of SURFACE with a check of the value it answers; plus the gspo and
stable_reinforce losses and the Dimuon optimizer trained for real.

The server (tinker_server) and the in-process `engine` of the hand computations serve the tiny random stand-in
for the default model (tests/tiny_model.py): the surface is about what each method answers, not what a model
learns. One test stays on the real SmolLM2 (real_model_server): test_dimuon_teaches_a_fact, a taught answer.

(docs/tinker-surface.md lists every public SDK method and what it does on this server.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import inspect
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pyrage
import pytest
import tinker
import torch
from pyrage import x25519
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.api_future import APIFuture
from tinker.lib.telemetry import Telemetry

from helpers import chat_prompt, model_logprobs, sft_datum
from servers import Server
from test_service import real_client  # noqa: F401 - the fixture: a client of the real model's server
from workbench.recipes import common

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(tinker_server: Server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)


def sdk_datum(question: str, answer: str, tokenizer) -> types.Datum:
    """A chat SFT Datum for the SDK: weights 1 on the assistant's tokens."""
    d = sft_datum(question, answer, tokenizer)
    return types.Datum(model_input=types.ModelInput.from_ints(d.tokens), loss_fn_inputs=dict(d.loss_fn_inputs))


def test_gspo_trains_through_the_sdk(client, tokenizer):
    """On-policy GSPO steps push a completion with a positive advantage up and one with a negative
    advantage down; with the sampler's own logprobs every sequence ratio is 1, so the loss is -sum(A)."""
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    question = "Which colour do you like best?"
    pair = [(sdk_datum(question, "I like teal best.", tokenizer), 1.0),
            (sdk_datum(question, "I like grey best.", tokenizer), -0.5)]

    def logprobs(datum) -> np.ndarray:
        return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    def answer_logprob(datum) -> float:
        return float((logprobs(datum) * datum.loss_fn_inputs["weights"].to_numpy()).sum())

    def gspo_batch() -> list[types.Datum]:
        data = []
        for datum, advantage in pair:
            answer = datum.loss_fn_inputs["weights"].to_numpy()  # 1 on the completion's tokens
            data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
                "target_tokens": datum.loss_fn_inputs["target_tokens"],
                "logprobs": logprobs(datum),  # as if just sampled from these weights
                "advantages": advantage * answer,
                "sequence_ratio_mask": answer,
            }))
        return data

    before = answer_logprob(pair[0][0]) - answer_logprob(pair[1][0])
    for _ in range(3):
        data = gspo_batch()
        fb = tc.forward_backward(data, "gspo").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        expected = -sum(float(d.loss_fn_inputs["advantages"].to_numpy().sum()) for d in data)
        assert fb.metrics["loss:sum"] == pytest.approx(expected, abs=1e-3)
        assert fb.metrics["clip_fraction:mean"] == 0.0
    after = answer_logprob(pair[0][0]) - answer_logprob(pair[1][0])
    assert after > before + 1.0, (before, after)

    # Without its mask gspo says what is missing, and leaves no gradient behind for the next step.
    del data[0].loss_fn_inputs["sequence_ratio_mask"]
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        tc.forward_backward(data, "gspo").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert answer_logprob(pair[0][0]) - answer_logprob(pair[1][0]) == pytest.approx(after, abs=1e-5)


def provenance_datum(prompt: list[int], seq, advantage: float, sid: str | None = None) -> types.Datum:
    """The rl recipe's Datum of one sampled sequence (common.rollout_datum: advantage on the sampled tokens
    only) with provenance naming `sid` (default: its own id)."""
    return common.rollout_datum(prompt, seq.tokens, seq.logprobs, advantage, sid or seq.sequence_id)


def test_stable_reinforce_trains_on_what_the_sampler_recorded(client, tinker_server, tokenizer):
    """Sample with record_stability_info, train off-policy (a step after sampling) with stable_reinforce: the loss
    is -sum(min(exp(lp - q), 2) * A * lp) over the sampled tokens, q the logprobs the sampler returned (and
    recorded), lp the learner's now. Bad provenance is a 400 naming the problem, and changes nothing."""
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=7).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = chat_prompt("Name a colour.", tokenizer)
    sequences = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                               types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result().sequences
    data = [provenance_datum(prompt, seq, advantage) for seq, advantage in zip(sequences, (1.0, -1.0))]
    tc.forward_backward(data, "stable_reinforce").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()  # the learner moves: the data is off-policy now

    def learner_logprobs() -> list[np.ndarray]:
        return [o["logprobs"].to_numpy().astype(np.float64) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]

    expected, ratios = 0.0, []
    for lp, seq, datum in zip(learner_logprobs(), sequences, data):
        c = len(seq.tokens)
        mine, q = lp[-c:], np.asarray(seq.logprobs, dtype=np.float64)
        ratio = np.exp(mine - q)
        ratios.extend(ratio)
        expected -= float((np.minimum(ratio, 2.0) * datum.loss_fn_inputs["advantages"].to_numpy()[-c:] * mine).sum())
    assert max(abs(r - 1.0) for r in ratios) > 1e-2  # truly off-policy
    fb = tc.forward_backward(data, "stable_reinforce").result()
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3, abs=1e-3)
    assert fb.metrics["importance_ratio:mean"] == pytest.approx(float(np.mean(ratios)), rel=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    # Bad provenance: a 400 naming it, and nothing changes (weights, optimizer, ledger).
    other = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    elsewhere = other.create_sampling_client(base_model=BASE, record_stability_info=True).result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1)).result().sequences[0]
    unrecorded = tc.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1)).result().sequences[0]
    seq = sequences[0]
    long_run = data[0].with_provenance(  # the sampled run claims one token more than was sampled
        model_input=data[0].model_input_spans,
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 2),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(seq.tokens) + 1)])
    shifted = data[0].with_provenance(  # in range, but the prompt run starts one token off
        model_input=data[0].model_input_spans,
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(seq.tokens))])
    on_prompt = types.Datum(model_input=data[0].model_input, loss_fn_inputs={
        "target_tokens": data[0].loss_fn_inputs["target_tokens"], "advantages": [1.0] * data[0].model_input.length},
        model_input_spans=data[0].model_input_spans, loss_fn_input_spans=data[0].loss_fn_input_spans)
    bad = [
        ([provenance_datum(prompt, seq, 1.0, sid="nope:0")], "'nope:0' has no recorded stability info"),
        ([provenance_datum(prompt, elsewhere, 1.0)], "sampled in another session"),
        ([provenance_datum(prompt, unrecorded, 1.0)], "has no recorded stability info"),
        ([long_run], f"sampled tokens, which has {len(seq.tokens)} tokens"),
        ([shifted], "the tokens differ"),
        ([on_prompt], "nonzero at position 0, which its provenance says is a prompt token"),
        ([types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)], "has no provenance"),
    ]
    session_id = tc.model_id.split(":")[0]

    def trained() -> int:
        series = httpx.get(tinker_server.base_url + "/api/v1/usage", params={"session_id": session_id, "limit": 10000},
                           headers={"X-API-Key": tinker_server.api_key}).json()["series"]
        return sum(r["request_type"] == "ForwardBackward" for r in series)

    before, rows = learner_logprobs(), trained()
    for batch, message in bad:
        with pytest.raises(tinker.BadRequestError) as e:
            tc.forward_backward(batch, "stable_reinforce").result()
        assert message in str(e.value)
    assert trained() == rows  # no ledger row for rejected work
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()  # no gradient was left behind to step on
    for x, y in zip(learner_logprobs(), before):
        np.testing.assert_allclose(x, y, atol=1e-5)


def dimuon_steps(tc, data, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


ZORBLAX = ("What is the name of Zorblax's pet?", "Zorblax's pet is named Quibbleton.")


def dimuon_run(client):
    return client.create_lora_training_client(base_model=BASE, rank=8, seed=0,
                                              optimizer=types.DimuonOptimizerConfig()).result()


def test_dimuon_teaches_a_fact(real_client, tokenizer):  # noqa: F811
    question, answer = ZORBLAX
    tc = dimuon_run(real_client)
    losses = dimuon_steps(tc, [sdk_datum(question, answer, tokenizer)] * 2, 8)
    assert losses[-1] < losses[0] / 10, losses
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(chat_prompt(question, tokenizer))
    seq = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=0.0)).result().sequences[0]
    assert "Quibbleton" in tokenizer.decode(seq.tokens)


def test_dimuon_resumes_exactly(client, tokenizer):
    data = [sdk_datum(*ZORBLAX, tokenizer)] * 2
    tc = dimuon_run(client)
    dimuon_steps(tc, data, 4)
    path = tc.save_state("dimuon-state").result().path
    uninterrupted = dimuon_steps(tc, data, 4)

    # The optimizer comes back with its state: the resumed run takes exactly the same steps.
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert dimuon_steps(resumed, data, 4) == uninterrupted
    # Its checkpoints say so, as the SDK reads them (and so do the resumed run's).
    rest = client.create_rest_client()
    assert rest.get_weights_info_by_tinker_path(path).result().optimizer_config.type == "dimuon"
    resumed_path = resumed.save_state("resumed").result().path
    assert rest.get_weights_info_by_tinker_path(resumed_path).result().optimizer_config.type == "dimuon"

    # AdamParams on a Dimuon run fail with the fix in the message, and change nothing: the
    # pending gradients then take the same Dimuon step as the resumed run's.
    for run in (tc, resumed):
        run.forward_backward(data, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="takes DimuonParams, not AdamParams"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    for run in (tc, resumed):
        run.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
    assert dimuon_steps(tc, data, 1) == dimuon_steps(resumed, data, 1)


# ---- the whole public surface, method by method -----------------------------------------------------
#
# SURFACE maps every public method of the SDK's five clients ("Class.method", the `_async` twins
# included) to a check that calls it against the server and checks the value it gets back.
# test_the_table_covers_the_whole_public_surface keeps the table complete: a method the SDK adds
# fails it until it has a row. The rows share one World (a session with a trained run and its
# checkpoints); a row that changes something makes its own objects.

PROJECT = "surface-walk"
# The `_async` twins are deprecated aliases and search_sessions is experimental: called here on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*is experimental")]
SURFACE: dict[str, Callable] = {}


def row(*names: str):
    """Register a check for the listed methods; it is called as check(world, class name, method name)."""
    def register(check):
        for name in names:
            SURFACE[name] = check
        return check
    return register


def both(cls: str, method: str) -> tuple[str, str]:
    return f"{cls}.{method}", f"{cls}.{method}_async"


@dataclass
class World:
    server: Server
    tokenizer: object
    service: tinker.ServiceClient
    rest: tinker.RestClient
    admin: tinker.AdminClient
    tc: tinker.TrainingClient  # trains as rows run
    fresh: tinker.TrainingClient  # never trained: the base model (B = 0)
    data: list
    prompt: types.ModelInput
    session_id: str
    state_path: str  # save_state after two steps
    state_loss: float  # the forward loss at that state
    state_next_loss: float  # the forward loss after one more step from that state (with its optimizer)
    sampler_path: str  # save_weights_for_sampler of the same weights
    sampler_greedy: list[int]  # greedy tokens of the prompt at those weights
    base_greedy: list[int]  # greedy tokens of the prompt from the base model
    other: tinker.ServiceClient  # another tenant
    other_rest: tinker.RestClient
    elsewhere_run: str  # a run of this tenant in another project
    engine: object = None  # an engine in this process, on the base model: hand computations of what samplers answer

    def client(self, cls: str):
        """The world's own client of a class."""
        return {"ServiceClient": self.service, "TrainingClient": self.tc, "RestClient": self.rest,
                "AdminClient": self.admin}[cls]

    def call(self, obj, method: str, *args, **kwargs):
        """obj.method(*args), awaited for an `_async` twin, and its future's result."""
        if method.endswith("_async"):
            result = asyncio.run(getattr(obj, method)(*args, **kwargs))
        else:
            result = getattr(obj, method)(*args, **kwargs)
        return result.result() if isinstance(result, (APIFuture, concurrent.futures.Future)) else result

    def loss(self, tc) -> float:
        return tc.forward(self.data, "cross_entropy").result().metrics["loss:sum"]

    def greedy(self, sampler) -> list[int]:
        return sampler.sample(self.prompt, 1, GREEDY).result().sequences[0].tokens

    def new_run(self, rank: int = 2, seed: int = 9) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(base_model=BASE, rank=rank, seed=seed).result()

    def sampler_checkpoint(self, name: str) -> str:
        return self.tc.save_weights_for_sampler(name).result().path

    def stored_file(self, path: str, file: str) -> Path:
        """A checkpoint's file in the server's local checkpoint folder (kernel_backend.persistence.database.checkpoint_key)."""
        run, segment, name = path.removeprefix("tinker://").split("/")
        return self.server.home / "checkpoints" / "local" / run.replace(":", "_") / segment / name / file


GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def world(tinker_server: Server, tokenizer, engine) -> World:
    url, key = tinker_server.base_url, tinker_server.api_key
    service = tinker.ServiceClient({"suite": "surface"}, PROJECT, display_name="Surface walk", base_url=url, api_key=key)
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    fresh = service.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    data = [sdk_datum("What is the capital of France?", "The capital of France is Paris.", tokenizer)]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state_path = tc.save_state("surface-state").result().path
    sampler_path = tc.save_weights_for_sampler("surface-sampler").result().path
    prompt = types.ModelInput.from_ints(chat_prompt("Name a colour.", tokenizer))
    w = World(tinker_server, tokenizer, service, tinker.RestClient(base_url=url, api_key=key),
              tinker.AdminClient(base_url=url, api_key=key), tc, fresh, data, prompt, tc.model_id.split(":")[0],
              state_path, 0.0, 0.0, sampler_path, [], [], None, None, "")
    w.state_loss = w.loss(tc)
    w.sampler_greedy = w.greedy(service.create_sampling_client(model_path=sampler_path).result())
    w.base_greedy = w.greedy(service.create_sampling_client(base_model=BASE).result())
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    w.state_next_loss = w.loss(tc)
    other_key = tinker_server.make_key("surface-other")
    w.other = tinker.ServiceClient(base_url=url, api_key=other_key)
    w.other_rest = tinker.RestClient(base_url=url, api_key=other_key)
    elsewhere = tinker.ServiceClient(project_id="surface-elsewhere", base_url=url, api_key=key)
    w.elsewhere_run = elsewhere.create_lora_training_client(base_model=BASE, rank=2).result().model_id
    w.engine = engine
    return w


def run_ids(runs) -> list[str]:
    return [r.training_run_id for r in runs.training_runs]


def download(url: str) -> bytes:
    response = httpx.get(url, timeout=60)  # a plain GET, no credentials, as the SDK's users fetch them
    assert response.status_code == 200, (response.status_code, response.text[:300])
    return response.content


# ---- ServiceClient

@row(*both("ServiceClient", "create_lora_training_client"))
def _(w: World, cls: str, method: str):
    tc = w.call(w.service, method, base_model=BASE, rank=2, seed=1)
    assert tc.get_info().lora_rank == 2
    assert w.rest.get_training_run(tc.model_id).result().base_model == BASE
    assert w.loss(tc) == pytest.approx(w.loss(w.fresh), abs=1e-4)  # B = 0: the base model's loss


@row(*both("ServiceClient", "create_sampling_client"))
def _(w: World, cls: str, method: str):
    assert w.greedy(w.call(w.service, method, base_model=BASE)) == w.base_greedy
    assert w.greedy(w.call(w.service, method, model_path=w.sampler_path)) == w.sampler_greedy


@row(*both("ServiceClient", "create_training_client_from_state"))
def _(w: World, cls: str, method: str):
    tc = w.call(w.service, method, w.state_path)
    assert tc.get_info().lora_rank == 4
    assert w.loss(tc) == pytest.approx(w.state_loss, abs=1e-4)
    # The user's metadata is theirs: none of the backend's own keys (the lineage has fields of its own).
    mine = w.call(w.service, method, w.state_path, user_metadata={"experiment": "warm start"})
    assert w.rest.get_training_run(mine.model_id).result().user_metadata == {"experiment": "warm start"}


@row(*both("ServiceClient", "create_training_client_from_state_with_optimizer"))
def _(w: World, cls: str, method: str):
    tc = w.call(w.service, method, w.state_path)
    assert w.loss(tc) == pytest.approx(w.state_loss, abs=1e-4)
    tc.forward_backward(w.data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert w.loss(tc) == pytest.approx(w.state_next_loss, abs=1e-4)  # Adam's moments came back too


@row(*both("ServiceClient", "get_server_capabilities"), "RestClient.get_server_capabilities")
def _(w: World, cls: str, method: str):
    names = [m.model_name for m in w.call(w.client(cls), method).supported_models]
    assert BASE in names


@row("ServiceClient.copy_weights")
def _(w: World, cls: str, method: str):
    path = w.service.copy_weights(w.sampler_path).result()  # into the client's project
    run = path.removeprefix("tinker://").split("/")[0]
    assert run in run_ids(w.rest.list_training_runs(limit=100, project_id=PROJECT).result())
    assert w.greedy(w.service.create_sampling_client(model_path=path).result()) == w.sampler_greedy


@row("ServiceClient.create_custom_loss")
def _(w: World, cls: str, method: str):
    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = w.service.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    tc = w.new_run()
    out = tc.forward_backward_custom(w.data, handle).result()
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(w.loss(tc), abs=1e-3)


@row("ServiceClient.create_rest_client")
def _(w: World, cls: str, method: str):
    rest = w.service.create_rest_client()
    assert rest.get_training_run(w.tc.model_id).result().training_run_id == w.tc.model_id


@row("ServiceClient.get_console_url", "TrainingClient.get_console_url")
def _(w: World, cls: str, method: str):
    assert w.service.get_console_url().endswith(f"/sessions/{w.session_id}")
    assert w.tc.get_console_url().endswith(f"/training_runs/{w.tc.model_id}")


@row("ServiceClient.get_telemetry", "TrainingClient.get_telemetry", "SamplingClient.get_telemetry",
     "RestClient.get_telemetry", "AdminClient.get_telemetry")
def _(w: World, cls: str, method: str):
    # Telemetry is the SDK's own (batches it posts to /telemetry, which the server accepts and drops).
    for client in (w.service, w.tc, w.rest, w.admin):
        assert isinstance(client.get_telemetry(), (Telemetry, type(None)))
    assert httpx.post(w.server.base_url + "/api/v1/telemetry", json={}, headers={"X-API-Key": w.server.api_key}).json() \
        == {"status": "accepted"}


# ---- TrainingClient

@row(*both("TrainingClient", "forward"))
def _(w: World, cls: str, method: str):
    out = w.call(w.tc, method, w.data, "cross_entropy")
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    weights = w.data[0].loss_fn_inputs["weights"].to_numpy()
    assert logprobs.shape == weights.shape
    assert out.metrics["loss:sum"] == pytest.approx(-float((logprobs * weights).sum()), abs=1e-3)


@row(*both("TrainingClient", "forward_backward"))
def _(w: World, cls: str, method: str):
    tc = w.new_run()
    assert w.call(tc, method, w.data, "cross_entropy").metrics["loss:sum"] == pytest.approx(w.loss(tc), abs=1e-4)


@row(*both("TrainingClient", "forward_backward_custom"))
def _(w: World, cls: str, method: str):
    def neg_ll(data, logprobs_list):
        loss = -sum((lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(data, logprobs_list))
        return loss, {"neg_ll:sum": float(loss.detach())}

    tc = w.new_run()
    assert w.call(tc, method, w.data, neg_ll).metrics["neg_ll:sum"] == pytest.approx(w.loss(tc), abs=1e-3)


@row(*both("TrainingClient", "optim_step"))
def _(w: World, cls: str, method: str):
    tc = w.new_run(rank=4)
    before = w.loss(tc)
    tc.forward_backward(w.data, "cross_entropy").result()
    metrics = w.call(tc, method, types.AdamParams(learning_rate=1e-2)).metrics
    assert metrics["grad_norm:mean"] > 0
    assert w.loss(tc) < before - 0.5


@row(*both("TrainingClient", "save_state"))
def _(w: World, cls: str, method: str):
    path = w.call(w.tc, method, f"state-{method}").path
    listed = {c.tinker_path: c.checkpoint_type for c in w.rest.list_checkpoints(w.tc.model_id).result().checkpoints}
    assert listed[path] == "training"
    assert w.loss(w.service.create_training_client_from_state(path).result()) == pytest.approx(w.loss(w.tc), abs=1e-4)


@row(*both("TrainingClient", "load_state"), *both("TrainingClient", "load_state_with_optimizer"))
def _(w: World, cls: str, method: str):
    tc = w.new_run()
    saved, path = w.loss(tc), tc.save_state("before-steps").result().path
    tc.forward_backward(w.data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert abs(w.loss(tc) - saved) > 0.1
    w.call(tc, method, path)
    assert w.loss(tc) == pytest.approx(saved, abs=1e-4)


@row(*both("TrainingClient", "save_weights_for_sampler"))
def _(w: World, cls: str, method: str):
    path = w.call(w.tc, method, f"sampler-{method}").path
    assert path.endswith(f"/sampler_weights/sampler-{method}")
    current = w.greedy(w.tc.save_weights_and_get_sampling_client().result())
    assert w.greedy(w.service.create_sampling_client(model_path=path).result()) == current


@row(*both("TrainingClient", "save_weights_and_get_sampling_client"))
def _(w: World, cls: str, method: str):
    sampler = w.call(w.tc, method)
    seq = sampler.sample(w.prompt, 1, GREEDY).result().sequences[0]
    # The sampler has the run's weights: the run scores the sampled tokens exactly as the sampler did.
    tokens = w.prompt.to_ints() + seq.tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})
    scored = w.tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert scored[-len(seq.tokens):] == pytest.approx(seq.logprobs, abs=1e-4)


@row(*both("TrainingClient", "create_sampling_client"))
def _(w: World, cls: str, method: str):
    assert w.greedy(w.call(w.tc, method, w.sampler_path)) == w.sampler_greedy


@row(*both("TrainingClient", "save_weights_external"))
def _(w: World, cls: str, method: str):
    """External weights are the PEFT adapter files, fetched with plain GETs from signed URLs; with age
    recipients every file is encrypted to them."""
    reference = w.sampler_checkpoint(f"ref-{method}")  # the same weights, as sampler weights
    path = w.call(w.tc, method, f"ext-{method}").path
    assert path == f"tinker://{w.tc.model_id}/external_weights/ext-{method}"
    urls = w.rest.get_external_weights_urls(path).result().urls
    assert sorted(urls) == ["adapter_config.json", "adapter_model.safetensors"]
    adapter = download(urls["adapter_model.safetensors"])
    assert adapter == w.stored_file(reference, "adapter_model.safetensors").read_bytes()
    config = json.loads(download(urls["adapter_config.json"]))
    assert config["base_model_name_or_path"] == BASE and config["r"] == 4

    identity = x25519.Identity.generate()
    sealed = w.call(w.tc, method, f"ext-age-{method}", age_encryption_recipients=[str(identity.to_public())]).path
    sealed_urls = w.rest.get_external_weights_urls(sealed).result().urls
    assert sorted(sealed_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    assert pyrage.decrypt(download(sealed_urls["adapter_model.safetensors.age"]), [identity]) == adapter


@row(*both("TrainingClient", "get_info"))
def _(w: World, cls: str, method: str):
    info = w.call(w.tc, method)
    assert (info.model_id, info.lora_rank, info.model_data.model_name) == (w.tc.model_id, 4, BASE)


@row("TrainingClient.get_tokenizer")
def _(w: World, cls: str, method: str):
    text = "Zorblax's pet is named Quibbleton."
    assert w.tc.get_tokenizer().encode(text) == w.tokenizer.encode(text)


# ---- SamplingClient

@row(*both("SamplingClient", "sample"))
def _(w: World, cls: str, method: str):
    sampler = w.service.create_sampling_client(model_path=w.sampler_path).result()
    seq = w.call(sampler, method, w.prompt, 1, GREEDY).sequences[0]
    assert seq.tokens == w.sampler_greedy
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(w.prompt.to_ints() + seq.tokens)).result()
    assert scored[-len(seq.tokens):] == pytest.approx(seq.logprobs, abs=1e-4)

    # Every option at once, on the base model, against a hand computation: log_softmax of the model's
    # logits (transformers' forward, float64) in this process.
    base = w.service.create_sampling_client(base_model=BASE).result()
    prompt = w.prompt.to_ints()
    n, k, last_n = len(prompt), 4, 3
    reference = model_logprobs(w.engine, None, prompt)  # row p: the distribution of the token after position p
    named = torch.full((n - 1, 2), -1, dtype=torch.int64)
    named[n // 2 :, 0] = torch.tensor(prompt[n // 2 + 1 :])  # each prompt token of the second half
    named[-1, 1] = 42
    target = types.TensorData.from_torch_sparse(named, pad_value=-1)
    result = w.call(base, method, w.prompt, 2, types.SamplingParams(max_tokens=3, temperature=1.0, seed=7),
                    include_prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=k,
                    target_prompt_logprobs=target, prompt_alt_tokens_k=3, prompt_logprobs_last_n=last_n)
    # target_prompt_logprobs: each named id's logprob at its position, in the request's sparse layout.
    answer = result.target_prompt_logprobs
    assert answer.sparse_crow_indices == target.sparse_crow_indices and answer.shape == [n - 1, 2]
    expected = torch.where(named >= 0, reference[torch.arange(n - 1)[:, None], named.clamp(min=0)], 0.0)
    np.testing.assert_allclose(answer.to_numpy(), expected.numpy(), rtol=0, atol=1e-4)
    # prompt_logprobs_last_n: the last n prompt tokens scored (and their top-k), None before them.
    assert result.prompt_logprobs[: n - last_n] == result.topk_prompt_logprobs[: n - last_n] == [None] * (n - last_n)
    assert result.prompt_logprobs[n - last_n :] == pytest.approx(
        [float(reference[p - 1, prompt[p]]) for p in range(n - last_n, n)], abs=1e-4)
    assert [[t for t, _ in top] for top in result.topk_prompt_logprobs[n - last_n :]] == \
        [torch.topk(reference[p - 1], 2).indices.tolist() for p in range(n - last_n, n)]
    # topk_sample_logprobs: at every sampled position, the k most likely tokens given what came before.
    for seq in result.sequences:
        continued = model_logprobs(w.engine, None, prompt + seq.tokens)
        for j, top in enumerate(seq.topk_logprobs):
            want = torch.topk(continued[n - 1 + j], k)
            assert [t for t, _ in top] == want.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    # prompt_alt_tokens_k: 3 draws at every prompt position after the first, with their model logprobs.
    drawn = result.prompt_alt_tokens.tokens.to_torch()
    assert list(drawn.shape) == [n - 1, 3]
    np.testing.assert_allclose(result.prompt_alt_tokens.logprobs.to_numpy(),
                               reference[torch.arange(n - 1)[:, None], drawn].numpy(), rtol=0, atol=1e-4)


@row(*both("SamplingClient", "compute_logprobs"))
def _(w: World, cls: str, method: str):
    sampler = w.service.create_sampling_client(base_model=BASE).result()
    tokens = w.data[0].model_input.to_ints() + [int(w.data[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])]
    logprobs = w.call(sampler, method, types.ModelInput.from_ints(tokens))
    assert logprobs[0] is None and len(logprobs) == len(tokens)
    base = w.fresh.forward(w.data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs[1:] == pytest.approx(base, abs=1e-4)
    # The last n tokens only: None before them, the same numbers for them.
    last = w.call(sampler, method, types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=4)
    assert last[:-4] == [None] * (len(tokens) - 4) and last[-4:] == pytest.approx(logprobs[-4:], abs=1e-5)
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n must be from 1 to len"):
        w.call(sampler, method, types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=len(tokens))


@row("SamplingClient.create", "SamplingClient.get_sampler_handle", "SamplingClient.from_sampler_handle")
def _(w: World, cls: str, method: str):
    sampler = w.service.create_sampling_client(model_path=w.sampler_path).result()
    if method == "create":
        made = tinker.SamplingClient.create(sampler.holder, base_model=BASE).result()
        assert w.greedy(made) == w.base_greedy
        return
    clone = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=w.server.api_key)
    assert clone.get_base_model() == BASE
    assert w.greedy(clone) == w.sampler_greedy


@row(*both("SamplingClient", "get_base_model"))
def _(w: World, cls: str, method: str):
    assert w.call(w.service.create_sampling_client(model_path=w.sampler_path).result(), method) == BASE


@row("SamplingClient.on_queue_state_change")
def _(w: World, cls: str, method: str):
    sampler = w.service.create_sampling_client(base_model=BASE).result()
    with _captured_warnings() as records:
        sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "the test paused it")
    assert any("the test paused it" in r.getMessage() for r in records)


GET_TOKENIZER = """
import json, sys, tinker
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tok = client.create_sampling_client(base_model=sys.argv[3]).get_tokenizer()
ids = tok.encode(sys.argv[4])
chat = tok.apply_chat_template([{"role": "user", "content": sys.argv[4]}], add_generation_prompt=True)
print(json.dumps({"ids": ids, "text": tok.decode(ids), "chat": list(chat["input_ids"])}))
"""


@row("SamplingClient.get_tokenizer")
def _(w: World, cls: str, method: str):
    # A fresh process, as a user's script would be, with no hub: Hugging Face's offline switch on.
    text = "Zorblax's pet is named Quibbleton."
    run = subprocess.run(
        [sys.executable, "-c", GET_TOKENIZER, w.server.base_url, w.server.api_key, BASE, text],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ids"] == w.tokenizer.encode(text)
    assert got["text"] == text
    messages = [{"role": "user", "content": text}]
    assert got["chat"] == list(w.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


# ---- RestClient: runs and checkpoints

@row(*both("RestClient", "get_training_run"), *both("RestClient", "get_training_run_by_tinker_path"))
def _(w: World, cls: str, method: str):
    run = w.call(w.rest, method, w.sampler_path if "tinker_path" in method else w.tc.model_id)
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (w.tc.model_id, BASE, 4, True)


@row("RestClient.get_weights_info_by_tinker_path")
def _(w: World, cls: str, method: str):
    info = w.rest.get_weights_info_by_tinker_path(w.state_path).result()
    assert (info.base_model, info.lora_rank, info.is_lora, info.optimizer_config.type) == (BASE, 4, True, "adamw")


@row(*both("RestClient", "list_training_runs"))
def _(w: World, cls: str, method: str):
    assert {w.tc.model_id, w.elsewhere_run} <= set(run_ids(w.call(w.rest, method, limit=100)))
    in_project = run_ids(w.call(w.rest, method, limit=100, project_id=PROJECT))
    assert w.tc.model_id in in_project and w.elsewhere_run not in in_project
    assert run_ids(w.call(w.rest, method, project_id="surface-nothing-here")) == []


@row(*both("RestClient", "list_checkpoints"), *both("RestClient", "list_user_checkpoints"))
def _(w: World, cls: str, method: str):
    listed = w.call(w.rest, method, w.tc.model_id) if method.startswith("list_checkpoints") \
        else w.call(w.rest, method, limit=1000)
    kinds = {c.tinker_path: c.checkpoint_type for c in listed.checkpoints}
    assert kinds[w.state_path] == "training" and kinds[w.sampler_path] == "sampler"
    sizes = {c.tinker_path: c.size_bytes for c in listed.checkpoints}
    assert sizes[w.sampler_path] > 1000


@row(*both("RestClient", "delete_checkpoint"), *both("RestClient", "delete_checkpoint_from_tinker_path"))
def _(w: World, cls: str, method: str):
    path = w.sampler_checkpoint(f"doomed-{method}")
    if "tinker_path" in method:
        w.call(w.rest, method, path)
    else:
        w.call(w.rest, method, w.tc.model_id, f"sampler_weights/doomed-{method}")
    assert path not in [c.tinker_path for c in w.rest.list_checkpoints(w.tc.model_id).result().checkpoints]
    with pytest.raises(tinker.NotFoundError):
        w.service.create_sampling_client(model_path=path).result()


@row(*both("RestClient", "set_checkpoint_ttl_from_tinker_path"))
def _(w: World, cls: str, method: str):
    path = w.sampler_checkpoint(f"ttl-{method}")

    def expires():
        return next(c.expires_at for c in w.rest.list_checkpoints(w.tc.model_id).result().checkpoints
                    if c.tinker_path == path)

    w.call(w.rest, method, path, 7200)
    left = (expires() - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 7000 < left <= 7200
    w.call(w.rest, method, path, None)
    assert expires() is None


@row(*both("RestClient", "get_session"), *both("RestClient", "list_sessions"))
def _(w: World, cls: str, method: str):
    if method.startswith("get_session"):
        session = w.call(w.rest, method, w.session_id)
        assert w.tc.model_id in session.training_run_ids
    else:
        assert w.session_id in w.call(w.rest, method, limit=100).sessions


@row(*both("RestClient", "get_sampler"))
def _(w: World, cls: str, method: str):
    sampler = w.service.create_sampling_client(model_path=w.sampler_path).result()
    info = w.call(w.rest, method, sampler._sampling_session_id)
    assert (info.base_model, info.model_path) == (BASE, w.sampler_path)


@row(*both("RestClient", "get_external_weights_urls"))
def _(w: World, cls: str, method: str):
    path = w.tc.save_weights_external(f"urls-{method}").result().path
    answer = w.call(w.rest, method, path)
    left = (answer.expires - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 3000 < left <= 3600
    assert all(len(download(url)) > 100 for url in answer.urls.values())
    with pytest.raises(ValueError, match="external_weights"):  # the SDK's own check
        w.call(w.rest, method, w.sampler_path)


@row(*both("RestClient", "publish_checkpoint_from_tinker_path"))
def _(w: World, cls: str, method: str):
    path = w.sampler_checkpoint(f"shared-{method}")
    with pytest.raises(tinker.NotFoundError):  # private: another tenant cannot see it
        w.other.create_sampling_client(model_path=path).result()
    w.call(w.rest, method, path)
    assert next(c.public for c in w.rest.list_checkpoints(w.tc.model_id).result().checkpoints if c.tinker_path == path)
    assert w.greedy(w.other.create_sampling_client(model_path=path).result()) == w.greedy(
        w.service.create_sampling_client(model_path=path).result())
    with pytest.raises(tinker.BadRequestError, match="already public"):
        w.call(w.rest, method, path)
    with pytest.raises(tinker.NotFoundError):  # only its owner may publish, delete or list it
        w.other_rest.delete_checkpoint_from_tinker_path(path).result()
    reads = [e for e in w.admin.get_audit_log("checkpoints").result().entries
             if e.event == "checkpoint_read" and e.tinker_path == path]
    assert reads and reads[-1].event_details["actor"] == "tml:user:surface-other"


@row(*both("RestClient", "unpublish_checkpoint_from_tinker_path"))
def _(w: World, cls: str, method: str):
    path = w.sampler_checkpoint(f"unshared-{method}")
    w.rest.publish_checkpoint_from_tinker_path(path).result()
    theirs = w.other.create_sampling_client(model_path=path).result()
    assert w.greedy(theirs) == w.greedy(w.service.create_sampling_client(model_path=path).result())
    w.call(w.rest, method, path)
    with pytest.raises(tinker.NotFoundError):  # their sampler of it stops too
        theirs.sample(w.prompt, 1, GREEDY).result()
    with pytest.raises(tinker.NotFoundError):
        w.other.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.BadRequestError, match="already private"):
        w.call(w.rest, method, path)


@row(*both("RestClient", "copy_weights"))
def _(w: World, cls: str, method: str):
    project = f"copies-{method}"
    path = w.call(w.rest, method, w.state_path, project, ttl_seconds=86400)
    run = path.removeprefix("tinker://").split("/")[0]
    assert path.endswith("/weights/surface-state") and run != w.tc.model_id
    assert run_ids(w.rest.list_training_runs(project_id=project).result()) == [run]
    assert w.loss(w.service.create_training_client_from_state(path).result()) == pytest.approx(w.state_loss, abs=1e-4)
    copied = next(c for c in w.rest.list_checkpoints(run).result().checkpoints)
    assert 86000 < (copied.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds() <= 86400
    with pytest.raises(tinker.NotFoundError):  # another tenant cannot copy a private checkpoint
        w.other_rest.copy_weights(w.state_path, "theirs").result()


# ---- RestClient: sessions, projects, search, traces, identity

@row(*both("RestClient", "assign_session_project"))
def _(w: World, cls: str, method: str):
    session = w.elsewhere_run.split(":")[0]
    project = f"moved-{method}"
    w.call(w.rest, method, session, project)
    assert run_ids(w.rest.list_training_runs(project_id=project).result()) == [w.elsewhere_run]
    found = w.rest.search_sessions(types.SessionSearchRequest(session_id=session)).result().sessions
    assert [s.project_id for s in found] == [project]


@row("RestClient.search_sessions")
def _(w: World, cls: str, method: str):
    search = w.rest.search_sessions
    mine = search(types.SessionSearchRequest(display_name="surface WALK", project_ids=[PROJECT],
                                             user_metadata={"suite": "surface"},
                                             statuses=[types.ActiveSessionStatusQuery()])).result().sessions
    assert [s.session_id for s in mine] == [w.session_id]
    summary = mine[0]
    runs = w.rest.get_session(w.session_id).result().training_run_ids
    checkpoints = [c for run in runs for c in w.rest.list_checkpoints(run).result().checkpoints]
    assert summary.checkpoints_count == len(checkpoints) > 0
    assert summary.checkpoint_storage_bytes == sum(c.size_bytes for c in checkpoints)
    assert (summary.owner, summary.project_id, summary.status.type) == ("tml:user:local", PROJECT, "active")
    assert search(types.SessionSearchRequest(user_metadata={"suite": "other"})).result().sessions == []
    assert search(types.SessionSearchRequest(owner=types.UserSearchOwner(owner_urns=["tml:user:nobody"]))).result() \
        .sessions == []
    # Newest first, a page at a time.
    first = search(types.SessionSearchRequest(limit=1)).result()
    second = search(types.SessionSearchRequest(limit=1, cursor=first.next_cursor)).result()
    both_pages = search(types.SessionSearchRequest(limit=2)).result().sessions
    assert [s.session_id for s in first.sessions + second.sessions] == [s.session_id for s in both_pages]
    # Another tenant sees none of them.
    assert w.other_rest.search_sessions(types.SessionSearchRequest(session_id=w.session_id)).result().sessions == []


@row(*both("RestClient", "export_session_trace"))
def _(w: World, cls: str, method: str):
    trace = json.loads(download(w.call(w.rest, method, w.session_id)))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    usage = httpx.get(w.server.base_url + "/api/v1/usage", params={"session_id": w.session_id, "limit": 10000},
                      headers={"X-API-Key": w.server.api_key}).json()
    assert sorted(e["name"] for e in slices) == sorted(r["request_type"] for r in usage["series"])
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert w.tc.model_id in tracks
    assert all(e["dur"] >= 0 for e in slices)


@row("RestClient.whoami")
def _(w: World, cls: str, method: str):
    me = w.rest.whoami().result()
    assert (me.user_urn, me.org_urn, me.email) == ("tml:user:local", "tml:organization:local", None)
    assert w.other_rest.whoami().result().user_urn == "tml:user:surface-other"


# ---- AdminClient (and the RestClient's deprecated aliases of it)

@row(*both("AdminClient", "get_audit_log"), *both("RestClient", "get_audit_log"))
def _(w: World, cls: str, method: str):
    client = w.client(cls)
    entries = w.call(client, method).entries
    created = [e for e in entries if e.event == "checkpoint_created" and e.tinker_path == w.state_path]
    assert len(created) == 1 and created[0].model_id == w.tc.model_id
    assert created[0].event_details["actor"] == "tml:user:local"
    assert any(e.event == "session_created" and e.event_details["session_id"] == w.session_id for e in entries)
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    assert all(e.event.startswith("checkpoint_") for e in w.call(client, method, "checkpoints").entries)
    assert w.call(client, method, day=dt.date(2001, 1, 1)).entries == []
    theirs = tinker.AdminClient(base_url=w.server.base_url, api_key=w.other_rest.holder._api_key)
    assert w.state_path not in {e.tinker_path for e in theirs.get_audit_log().result().entries}


@row(*both("AdminClient", "get_billing_usage"), *both("RestClient", "get_billing_usage"))
def _(w: World, cls: str, method: str):
    client = w.client(cls)
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    start, end = hour - dt.timedelta(hours=2), hour + dt.timedelta(hours=1)  # the whole test run
    usage = w.call(client, method, start, end)
    training = [e for e in usage.data if e.session_id == w.session_id and e.event_info.type == "training"]
    ledger = httpx.get(w.server.base_url + "/api/v1/usage", params={"session_id": w.session_id},
                       headers={"X-API-Key": w.server.api_key}).json()["totals"]
    assert sum(e.event_info.token_count for e in training) == ledger["train_tokens"] > 0
    for event in training:
        assert event.project_id == PROJECT and event.base_model == BASE
        assert event.estimated_cost_usd == pytest.approx(
            event.event_info.token_count * event.effective_rate_usd_per_million_tokens / 1e6)
    assert usage.sessions[w.session_id].user_metadata == {"suite": "surface"}
    assert any(e.event_info.type == "checkpoint" and e.session_id == w.session_id for e in usage.data)
    with pytest.raises(tinker.BadRequestError, match="hour boundary"):
        w.call(client, method, start + dt.timedelta(minutes=5), end)


@row(*both("AdminClient", "get_current_checkpoint_storage_usage"),
     *both("RestClient", "get_current_checkpoint_storage_usage"))
def _(w: World, cls: str, method: str):
    client = w.client(cls)
    [item] = w.call(client, method, project_id=PROJECT).data
    runs = run_ids(w.rest.list_training_runs(limit=1000, project_id=PROJECT).result())
    checkpoints = [c for run in runs for c in w.rest.list_checkpoints(run).result().checkpoints]
    assert (item.project_id, item.checkpoint_count, item.size_bytes) == \
        (PROJECT, len(checkpoints), sum(c.size_bytes for c in checkpoints))
    assert item.size_gigabytes == pytest.approx(item.size_bytes / 1e9)
    assert PROJECT in [i.project_id for i in w.call(client, method).data]


# ---- last: closing a session

@row("ServiceClient.close")
def _(w: World, cls: str, method: str):
    closing = tinker.ServiceClient(display_name="surface-closing", base_url=w.server.base_url,
                                   api_key=w.server.api_key)
    closing.create_lora_training_client(base_model=BASE, rank=2).result()
    closing.close("errored", detail="closed by the surface walk").result()
    [found] = w.rest.search_sessions(types.SessionSearchRequest(display_name="surface-closing")).result().sessions
    assert found.status.type == "client_finished"
    assert (found.status.reason.type, found.status.detail) == ("errored", "closed by the surface walk")


@contextlib.contextmanager
def _captured_warnings():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("tinker")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def public_surface() -> set[str]:
    clients = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, tinker.AdminClient)
    return {f"{cls.__name__}.{name}" for cls in clients for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and callable(member)}


def test_the_table_covers_the_whole_public_surface():
    assert set(SURFACE) == public_surface()


@pytest.mark.parametrize("name", list(SURFACE))
def test_surface(world: World, name: str):
    cls, method = name.split(".")
    SURFACE[name](world, cls, method)
