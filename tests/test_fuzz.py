"""Hardening, fuzzed: no generated request makes the server answer 5xx.

Schemathesis generates requests for every operation in the app's own OpenAPI schema (valid and
invalid bodies, parameters and headers, a few examples each) and sends them to `shared_server`
with a tenant's key. The protobuf routes (/forward_backward, /forward) are described in the schema
as `application/x-protobuf`; their bodies come from a strategy below that mixes random bytes with
ForwardBackwardRequests of random shapes, dtypes, sparse indices and tokens, so the decoder's
bounds are fuzzed too. Bounded: a small max_examples per operation keeps the run to about a minute.

The servers serve the tiny random stand-in for the default model (tests/tiny_model.py, same architecture,
tokenizer and chat template): what is checked is the server's answer to a request, never a model's output.
"""

from __future__ import annotations

import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from tinker.proto import tinker_public_pb2 as pb

MAX_EXAMPLES = 8

_ints = st.integers(min_value=-(2**40), max_value=2**40)
_small = st.integers(min_value=-2, max_value=8)


@st.composite
def _tensor(draw) -> pb.Tensor:
    dtype = draw(st.sampled_from([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32,
                                  pb.DTYPE_BFLOAT16, 99]))
    shape = draw(st.lists(st.one_of(_small, _ints), max_size=3))
    if draw(st.booleans()):
        return pb.Tensor(dtype=dtype, shape=shape, dense=draw(st.binary(max_size=64)))
    crow = draw(st.lists(_small, max_size=6))
    col = draw(st.lists(st.one_of(_small, _ints), max_size=6))
    return pb.Tensor(dtype=dtype, shape=shape, sparse_csr=pb.SparseCsr(
        values=draw(st.binary(max_size=48)), crow_indices=np.asarray(crow, "<i8").tobytes(),
        col_indices=np.asarray(col, "<i8").tobytes()))


@st.composite
def forward_backward_messages(draw) -> pb.ForwardBackwardRequest:
    """A ForwardBackwardRequest with random (often inconsistent) tokens, tensors, shapes and sparse indices."""
    tokens = draw(st.lists(st.one_of(_small, st.integers(0, 60000), _ints.filter(lambda t: abs(t) < 2**31)),
                           max_size=8))
    datum = pb.Datum(
        model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=np.asarray(tokens, "<i4").tobytes()))],
        loss_fn_inputs={name: draw(_tensor()) for name in draw(st.lists(
            st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", "bogus"]), max_size=3, unique=True))},
    )
    return pb.ForwardBackwardRequest(model_id=draw(st.text(max_size=40)), seq_id=draw(st.integers(0, 2**31 - 1)),
                                     loss_fn=draw(st.sampled_from(["cross_entropy", "ppo", "nope", ""])),
                                     forward_only=draw(st.booleans()), data=[datum] * draw(st.integers(0, 3)))


# What schemathesis sends as an application/x-protobuf body: random bytes or a random message.
forward_backward_bodies = st.one_of(st.binary(max_size=256), forward_backward_messages().map(lambda m: m.SerializeToString()))


schemathesis.openapi.media_type("application/x-protobuf", forward_backward_bodies)

def _schema():
    """The server's OpenAPI schema, from its own routes (no server needed to list the operations)."""
    from fastapi import FastAPI

    from kernel_backend.api.app import include_routes

    app = FastAPI(title="Stepwise training-session service")
    include_routes(app)
    schema = schemathesis.openapi.from_dict(app.openapi())
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = _schema()


@pytest.fixture(scope="module")
def fuzz_key(shared_server):
    return shared_server.make_key("fuzzer")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case, fuzz_key, shared_server):
    response = case.call(base_url=shared_server.base_url, headers={"X-API-Key": fuzz_key, "Authorization": f"Bearer {fuzz_key}"}, timeout=60)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
    content_type = response.headers.get("content-type", [""])[0]  # schemathesis keeps every value of a header
    assert content_type.startswith(("application/json", "application/x-protobuf", "text/event-stream")), content_type


def test_the_protobuf_routes_are_in_the_schema(shared_server):
    import httpx

    document = httpx.get(shared_server.base_url + "/openapi.json").json()
    for path in ("/api/v1/forward_backward", "/api/v1/forward"):
        assert "application/x-protobuf" in document["paths"][path]["post"]["requestBody"]["content"]


@pytest.fixture(scope="module")
def run(tinker_server):
    """A real training run on the embedded-like server (no token limit), for messages that reach the engine."""
    from test_service_http import Api

    api = Api(tinker_server)
    return api, api.model(api.session(), 0, seed=0), iter(range(1, 10**6))


@given(message=forward_backward_messages(), to_real_run=st.booleans())
@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_random_forward_backward_messages_never_fail_the_server(run, message, to_real_run):
    """Protobuf bodies decoded and, sent to a real run in seq_id order, validated by the engine: each answer
    is a 4xx or a future that succeeds or fails as the user's fault, never the server's."""
    api, model_id, seq = run
    if to_real_run:
        message.model_id, message.seq_id = model_id, next(seq)
    response = api.http.post("/forward_backward", content=message.SerializeToString(),
                             headers={"Content-Type": "application/x-protobuf"})
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        result = api.wait(response.json()["request_id"])
        if result.headers["content-type"].startswith("application/json"):
            assert result.json()["category"] == "user", result.text
