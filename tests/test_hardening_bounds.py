"""Hardening, bounded work: a request's cost is bounded before any work is done.

Against `shared_server` (a server configured for several people, with a 1 MiB body limit): sparse
tensors whose shape costs nothing to send, oversize and zstd-bomb bodies, absurd num_samples and
LoRA ranks are refused before they are decoded, queued or stored; adapters are never capped by count,
stored checkpoints are;
finished results do not pile up in the database; leftovers of interrupted checkpoint writes are
removed at start-up. Every refusal leaves the run's weights and the ledger as they were.

shared_server serves the tiny random stand-in for the default model (tests/tiny_model.py): the bounds are about
requests and bytes, not what a model learns; where a size matters, the test says how it is scaled.
"""

from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from conftest import SHARED_LIMITS
from test_hardening_input import refused
from test_service_http import DATA, Api

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def api(shared_server):
    return Api(shared_server, key=shared_server.make_key("bounds"))


def futures_stored(server) -> int:
    with sqlite3.connect(server.home / "stepwise.db") as db:
        return db.execute("select count(*) from futures").fetchone()[0]


def sparse_targets_body(model_id: str, seq_id: int, tokens: list[int], shape: list[int]) -> bytes:
    """A protobuf forward_backward whose target_tokens is CSR with one target per row and this shape."""
    rows = len(tokens)
    targets = pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape, sparse_csr=pb.SparseCsr(
        values=np.arange(rows, dtype="<i8").tobytes(),
        crow_indices=np.arange(rows + 1, dtype="<i8").tobytes(),
        col_indices=np.zeros(rows, dtype="<i8").tobytes()))
    datum = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=np.array(tokens, "<i4").tobytes()))],
                     loss_fn_inputs={"target_tokens": targets})
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy",
                                     data=[datum]).SerializeToString()


def test_leftovers_of_interrupted_checkpoint_writes_are_removed_at_start_up(shared_server):
    assert shared_server.planted and not any(folder.exists() for folder in shared_server.planted)


def test_sparse_targets_are_bounded_before_they_are_densified(api, shared_server):
    session = api.session()
    model_id = api.model(session, 0, seed=1)
    loss = api.loss(model_id, 1, DATA)
    billed = api.http.get("/usage").json()["totals"]
    tokens = [1, 9690, 198]

    # 3 tokens that would densify to 3 x 16,777,216 targets: refused as it is decoded, nothing queued.
    stored = futures_stored(shared_server)
    body = sparse_targets_body(model_id, 2, tokens, [3, 1 << 24])
    assert len(body) < 1000
    refused(api.http.post("/forward_backward", content=body, headers=PROTO), 400, "K must be from 1 to 1024")
    refused(api.http.post("/forward_backward", content=sparse_targets_body(model_id, 2, tokens, [1 << 20, 2]),
                          headers=PROTO), 400, "model_input has 3 tokens")
    huge_json = {"model_id": model_id, "seq_id": 2, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {"target_tokens": {"data": [5, 6, 7], "dtype": "int64", "shape": [3, 1 << 24],
                                             "sparse_crow_indices": [0, 1, 2, 3], "sparse_col_indices": [0, 0, 0]}}}]}}
    refused(api.post("/forward_backward", huge_json), 400, "K must be from 1 to 1024")
    assert futures_stored(shared_server) == stored

    # A sparse (N, K) within the bounds is still accepted and trains.
    ok = api.http.post("/forward_backward", content=sparse_targets_body(model_id, 2, tokens, [3, 4]), headers=PROTO)
    assert ok.status_code == 200 and api.wait(ok.json()["request_id"]).headers["content-type"] == "application/x-protobuf"
    after = api.http.get("/usage").json()["totals"]
    assert after["train_tokens"] == billed["train_tokens"] + 3 and after["requests"] == billed["requests"] + 1
    assert api.loss(model_id, 3, DATA) == loss  # forward_backward alone does not move the weights


def test_a_body_over_the_limit_is_refused_before_it_is_read(api, shared_server):
    session = api.session()
    model_id = api.model(session, 0, seed=2)
    loss = api.loss(model_id, 1, DATA)
    limit = int(SHARED_LIMITS["STEPWISE_MAX_BODY_BYTES"])
    big = sparse_targets_body(model_id, 2, [1, 2, 3], [3, 4]) + b"\x00" * (2 * limit)
    refused(api.http.post("/forward_backward", content=big, headers=PROTO), 413, "STEPWISE_MAX_BODY_BYTES")

    def chunks():  # no Content-Length: the limit holds as the bytes stream in
        for _ in range(4):
            yield b"\x00" * limit

    refused(api.http.post("/forward_backward", content=chunks(), headers=PROTO), 413, str(limit))
    refused(api.http.post("/create_session", content=b"[" * (2 * limit), headers={"Content-Type": "application/json"}),
            413, "smaller requests")
    # A small zstd body that would expand past the limit.
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (3 * limit))
    assert len(bomb) < 1000
    refused(api.http.post("/forward_backward", content=bomb, headers={**PROTO, "Content-Encoding": "zstd"}),
            400, "expands past")
    assert api.http.get("/healthz").status_code == 200
    assert api.loss(model_id, 3, DATA) == loss


def test_num_samples_is_bounded_before_anything_is_queued(api, shared_server):
    session = api.session()
    sampler = api.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": BASE}).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    stored = futures_stored(shared_server)
    for num_samples in (10**6, 0):
        refused(api.post("/asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": num_samples,
                                      "prompt": prompt, "sampling_params": {"max_tokens": 2}}), 400, "num_samples")
    refused(api.post("/asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "prompt": prompt,
                                  "sampling_params": {"max_tokens": 10**9}}), 400, "max_tokens")
    assert futures_stored(shared_server) == stored


def test_adapters_are_a_cache_and_storage_is_the_quota_on_a_shared_server(shared_server):
    """How many adapters a tenant makes is never refused: past the old limit of 8 every run is made and trains
    (the adapter cache evicts what does not fit). An adapter too large to ever be resident is a 400; a tenant
    over its stored checkpoints (8 MB on this server) gets a 429 that names the checkpoints to delete."""
    api = Api(shared_server, key=shared_server.make_key("adapters"))
    operator = Api(shared_server)
    held = sum(operator.http.get("/admin/stats").json()["adapters"].values())
    session = api.session()

    def create(seq_id: int, rank: int):
        return api.post("/create_model", {"session_id": session, "model_seq_id": seq_id, "base_model": BASE,
                                          "lora_config": {"rank": rank, "seed": 0}})

    # A rank-512 adapter (about 420 MB with its AdamW state on the stand-in) could never fit this server's share
    # per tenant, 256 MB (SHARED_LIMITS), as one of the real model (about 2.9 GB) never fits the default 2048 MB.
    share = SHARED_LIMITS["STEPWISE_MAX_ADAPTER_MB_PER_TENANT"]
    refused(create(0, rank=512), 400, "smaller LoRA rank", f"the {share} MB of adapter memory")
    runs = [api.model(session, seq + 1, seed=seq) for seq in range(12)]
    assert all(np.isfinite(api.loss(run, 1, DATA)) for run in runs)
    assert sum(operator.http.get("/admin/stats").json()["adapters"].values()) == held + 12

    # The checkpoints of a rank-32 run: about 6.5 MB each on the stand-in (about 205 KB a rank), as a rank-4 one
    # of the real model is about 5 MB. The first is under 8 MB, so the second is stored too, and passes it.
    assert api.wait(create(13, rank=32).json()["request_id"]).status_code == 200
    stored = f"{session}:train:13"

    def save(seq_id: int, name: str):
        return api.post("/save_weights_for_sampler", {"model_id": stored, "path": name, "seq_id": seq_id})

    for seq_id, name in ((1, "first"), (2, "second")):
        assert api.wait(save(seq_id, name).json()["request_id"]).status_code == 200
    third = save(3, "third")
    message = refused(third, 429, "in 2 checkpoints", "the limit is 8 MB", "delete", "first")
    assert message.index("sampler_weights/first") < message.index("sampler_weights/second")  # oldest first
    assert int(third.headers["Retry-After"]) > 0
    assert api.post(f"/sessions/{session}/finish", {}).status_code == 200


def test_finished_results_expire_once_retrieved_and_the_ledger_keeps_them(api, shared_server):
    session = api.session()
    model_id = api.model(session, 0, seed=3)
    request_id = api.http.post("/forward_backward", content=api.fb_body(model_id, 1, DATA, forward_only=True),
                               headers=PROTO).json()["request_id"]
    assert api.wait(request_id).status_code == 200
    deadline = time.monotonic() + 30  # kept 1 s after retrieval here; the reaper runs every 0.5 s
    while (again := api.http.post("/retrieve_future", json={"request_id": request_id})).status_code == 200:
        assert time.monotonic() < deadline, "the retrieved result was never deleted"
        time.sleep(0.5)
    refused(again, 404, "kept 1 s after it is first retrieved")
    with sqlite3.connect(shared_server.home / "stepwise.db") as db:
        assert db.execute("select count(*) from usage where request_id = ?", (request_id,)).fetchone()[0] == 1
