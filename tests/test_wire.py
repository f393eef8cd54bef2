"""kernel_backend.api.wire against the tinker 0.38 SDK's own encoders and decoders.

Requests are built from real SDK objects and serialized by the SDK's own code path (the
training resource's forward_backward, with and without zstd; pydantic model_dump for the
JSON forms); results are encoded by wire.py and decoded by the SDK's response_conv.
"""

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.resources.training import AsyncTrainingResource
from tinker.types._pydantic_types.datum import Datum as JsonDatum
from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput as JsonForwardBackwardInput
from tinker.types.client_config_response import ClientConfigResponse
from tinker.types.image_chunk import ImageChunk

from kernel_backend.api.wire import (
    datum_from_json,
    decode_forward_backward,
    forward_backward_from_json,
    encode_forward_backward_output,
    encode_sample_response,
    model_input_tokens,
    sample_options,
    sampling_params_from_json,
    target_ids_from_json,
)
from kernel_backend.types import ForwardResult, SampledSequence, SampleResult, TargetIds
from kernel_backend.errors import UserError


def sdk_body(data, loss_fn="cross_entropy", loss_fn_config=None, forward_only=False, compress=False, seq_id=7):
    """The body and headers the SDK's AsyncTrainingResource.forward_backward POSTs."""
    sent = {}

    async def post(path, *, body, options, cast_to):
        sent.update(path=path, body=body, headers=options["headers"])

    fake_client = SimpleNamespace(
        get=None, post=post, patch=None, put=None, delete=None, get_api_list=None,
        _client_config=ClientConfigResponse(proto_compress_fwdbwd=compress),
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id="sess:train:0",
        seq_id=seq_id,
    )
    asyncio.run(AsyncTrainingResource(fake_client).forward_backward(request=request, forward_only=forward_only))
    assert sent["path"] == "/api/v1/forward_backward"
    assert sent["headers"]["Content-Type"] == "application/x-protobuf"
    return sent["body"], sent["headers"].get("Content-Encoding")


def sdk_datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def assert_same(a: np.ndarray, b):
    b = np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a, b)


# ---- forward_backward requests -------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_dense_numpy_datums_round_trip(compress):
    rng = np.random.default_rng(0)
    t1 = rng.integers(0, 1000, 9).astype(np.int64)
    w1 = rng.random(9, dtype=np.float32)
    d1 = sdk_datum(list(range(9)), target_tokens=t1, weights=w1)
    d2 = sdk_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0, 0.0, 0.5])  # lists, SDK picks dtypes
    body, encoding = sdk_body([d1, d2], compress=compress)
    assert encoding == ("zstd" if compress else None)

    call = decode_forward_backward(body, encoding)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("sess:train:0", 7, "cross_entropy", False)
    assert call.loss_fn_config == {}
    assert call.data[0].tokens == list(range(9))
    assert_same(call.data[0].loss_fn_inputs["target_tokens"], t1)
    assert_same(call.data[0].loss_fn_inputs["weights"], w1)
    assert call.data[1].tokens == [5, 6, 7]
    assert_same(call.data[1].loss_fn_inputs["target_tokens"], np.array([6, 7, 8], dtype=np.int64))
    assert_same(call.data[1].loss_fn_inputs["weights"], np.array([1.0, 0.0, 0.5], dtype=np.float32))


def test_torch_2d_inputs_arrive_as_sparse_csr_and_decode_dense():
    n, k = 6, 5
    targets = torch.zeros(n, k, dtype=torch.int64)
    weights = torch.zeros(n, k, dtype=torch.float32)
    targets[:, 0] = torch.arange(10, 10 + n)
    weights[:, 0] = 1.0
    targets[2, 3], weights[2, 3] = 42, 0.25
    advantages = torch.linspace(-1, 1, n)  # 1-D torch -> dense
    datum = sdk_datum(list(range(n)), target_tokens=targets, weights=weights, advantages=advantages)
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # the SDK went sparse

    body, encoding = sdk_body([datum], loss_fn="importance_sampling")
    wire = pb.ForwardBackwardRequest.FromString(body)
    assert wire.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    assert wire.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"

    got = decode_forward_backward(body, encoding).data[0].loss_fn_inputs
    assert_same(got["target_tokens"], targets.numpy())
    assert_same(got["weights"], weights.numpy())
    assert_same(got["advantages"], advantages.numpy())


def test_multiple_chunks_concatenate_and_dense_2d_keeps_shape():
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])])
    dense = np.arange(12, dtype=np.int64).reshape(3, 4) + 1  # no zeros: the SDK keeps it dense
    datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": torch.from_numpy(dense)})
    body, encoding = sdk_body([datum])
    got = decode_forward_backward(body, encoding).data[0]
    assert got.tokens == [1, 2, 3]
    assert_same(got.loss_fn_inputs["target_tokens"], dense)


def test_loss_fn_config_forward_only_and_strings():
    datum = sdk_datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -2.0], advantages=[0.5, -0.5])
    body, encoding = sdk_body(
        [datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}, forward_only=True, seq_id=3
    )
    call = decode_forward_backward(body, encoding)
    assert call.forward_only is True and call.seq_id == 3 and call.loss_fn == "ppo"
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}

    legacy = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="ppo", loss_fn_config={"clip_high_threshold": 1.3})
    assert decode_forward_backward(legacy.SerializeToString(), None).loss_fn_config == {"clip_high_threshold": 1.3}


def test_malformed_bodies_raise_user_error():
    with pytest.raises(UserError, match="not a valid protobuf"):
        decode_forward_backward(b"\xff\xff\xff\xff", None)
    with pytest.raises(UserError, match="zstd"):
        decode_forward_backward(b"definitely not zstd", "zstd")
    with pytest.raises(UserError, match="Content-Encoding"):
        decode_forward_backward(b"", "br")
    with pytest.raises(UserError, match="model_id"):
        decode_forward_backward(b"", None)  # the empty message parses; it has no model_id

    bad_shape = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = bad_shape.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(3, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[2]))
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs\['weights'\] has 3 values but shape \[2\]"):
        decode_forward_backward(bad_shape.SerializeToString(), None)

    bad_csr = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 2])
    bad_csr.sparse_csr.values = np.array([5], "<i8").tobytes()
    bad_csr.sparse_csr.crow_indices = np.array([0, 1, 3], "<i8").tobytes()
    bad_csr.sparse_csr.col_indices = np.array([0], "<i8").tobytes()
    d.loss_fn_inputs["weights"].CopyFrom(bad_csr)
    with pytest.raises(UserError, match="sparse CSR"):
        decode_forward_backward(bad_shape.SerializeToString(), None)


def test_image_chunks_are_rejected_naming_encoded_text():
    model_input = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[1]), ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
    )
    datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [1, 2, 3, 4, 5]})
    body, encoding = sdk_body([datum])
    with pytest.raises(UserError, match=r"chunks\[1\]: image chunks are not supported.*encoded_text"):
        decode_forward_backward(body, encoding)


# ---- JSON forms ----------------------------------------------------------------------------


def test_json_datum_dense_and_sparse():
    targets = torch.zeros(4, 6, dtype=torch.int64)
    targets[:, 0] = torch.tensor([3, 4, 5, 6])
    weights = torch.tensor([[1.0] + [0.0] * 5] * 4)
    obj = JsonDatum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights, "advantages": [0.1, 0.2, 0.3, 0.4]},
    ).model_dump(mode="json", exclude_none=True)
    assert "sparse_crow_indices" in obj["loss_fn_inputs"]["target_tokens"]
    assert obj["model_input"]["chunks"][0]["type"] == "encoded_text"

    datum = datum_from_json(obj)
    assert datum.tokens == [1, 2, 3, 4]
    assert_same(datum.loss_fn_inputs["target_tokens"], targets.numpy())
    assert_same(datum.loss_fn_inputs["weights"], weights.numpy())
    assert_same(datum.loss_fn_inputs["advantages"], np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32))

    with pytest.raises(UserError, match="dtype"):
        datum_from_json({"model_input": {"chunks": []}, "loss_fn_inputs": {"w": {"data": [1], "dtype": "int8"}}})


def test_json_forward_backward_body():
    fb_input = JsonForwardBackwardInput(
        data=[JsonDatum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})],
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.9},
    )
    body = {"model_id": "s:train:0", "seq_id": 4, "forward_backward_input": fb_input.model_dump(mode="json")}
    call = forward_backward_from_json(body)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 4, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": 0.9}
    assert call.data[0].tokens == [1, 2]
    assert_same(call.data[0].loss_fn_inputs["target_tokens"], np.array([2, 3], dtype=np.int64))
    legacy = {"model_id": "m", "seq_id": 1, "forward_input": fb_input.model_dump(mode="json")}
    assert forward_backward_from_json(legacy).forward_only is True


def test_asample_json_prompt_and_sampling_params():
    request = types.SampleRequest(
        sampling_session_id="s:sample:0",
        seq_id=0,
        num_samples=2,
        prompt=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])]),
        sampling_params=types.SamplingParams(max_tokens=5, temperature=0.5, stop=["\n\n", "END"], seed=3),
    )
    body = request.model_dump(exclude_unset=False, exclude_none=True, mode="json")  # as resources/sampling.py
    assert model_input_tokens(body["prompt"]) == [1, 2, 3]
    params = sampling_params_from_json(body["sampling_params"])
    assert (params.max_tokens, params.temperature, params.seed, params.top_k, params.top_p) == (5, 0.5, 3, -1, 1.0)
    assert params.stop == ["\n\n", "END"]

    assert sampling_params_from_json({"stop": "x"}).stop == ["x"]
    assert sampling_params_from_json({"stop": [7, 8]}).stop == [7, 8]
    assert sampling_params_from_json({"stop": []}).stop == []
    defaults = sampling_params_from_json(types.SamplingParams().model_dump(mode="json", exclude_none=True))
    assert defaults.stop is None and defaults.max_tokens is None and defaults.temperature == 1.0
    with pytest.raises(UserError, match="stop"):
        sampling_params_from_json({"stop": ["a", 1]})
    with pytest.raises(UserError, match="max_tokens"):
        sampling_params_from_json({"max_tokens": "ten"})

    image_prompt = types.ModelInput(chunks=[ImageChunk(data=b"x", format="jpeg", expected_tokens=1)])
    with pytest.raises(UserError, match="image chunks are not supported.*encoded_text"):
        model_input_tokens(image_prompt.model_dump(mode="json"))
    with pytest.raises(UserError, match="image chunks"):
        model_input_tokens({"chunks": [{"type": "image_asset_pointer", "location": "x", "format": "png"}]})


# ---- results -------------------------------------------------------------------------------


def test_forward_backward_output_decodes_with_sdk():
    lp1 = np.array([-0.5, -1.25, -2.0], dtype=np.float32)
    lp2 = np.array([[-0.1, -0.2], [-0.3, -0.4]], dtype=np.float32)  # (N, K) targets
    lp3 = np.array([[-1.0, -2.0, -3.0]], dtype=np.float32)  # a different K: its own ArrayRecord
    result = ForwardResult(
        loss_fn_outputs=[{"logprobs": lp1}, {"logprobs": lp2.copy()}, {"logprobs": lp2 * 2}, {"logprobs": lp3}],
        metrics={"loss:sum": 3.75, "tokens:sum": 12.0},
    )
    out = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == {"loss:sum": 3.75, "tokens:sum": 12.0}
    assert len(out.loss_fn_outputs) == 4
    for got, want in zip(out.loss_fn_outputs, [lp1, lp2, lp2 * 2, lp3]):
        td = got["logprobs"]
        assert td.dtype == "float32" and td.shape == list(want.shape)
        np.testing.assert_array_equal(td.to_numpy().reshape(td.shape), want)

    wire = pb.ForwardBackwardOutput.FromString(encode_forward_backward_output(result))
    bt = wire.loss_fn_outputs[0].fields["logprobs"]
    assert wire.loss_fn_outputs[0].num_datums == 1 and list(bt.trailing_shape) == []
    assert np.frombuffer(bt.offsets, "<i8").tolist() == [0, 12]
    assert np.frombuffer(wire.loss_fn_outputs[1].fields["logprobs"].offsets, "<i8").tolist() == [0, 16, 32]

    empty = deserialize_forward_backward_output(encode_forward_backward_output(ForwardResult([], {"loss:sum": 0.0})))
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}


def test_sample_response_decodes_with_sdk():
    result = SampleResult(
        sequences=[
            SampledSequence(tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -1.5], stop_reason="stop"),
            SampledSequence(tokens=[8], logprobs=[-0.25], stop_reason="length"),
        ],
        prompt_logprobs=[None, -2.5, -0.75],
        topk_prompt_logprobs=[None, [(11, -0.5), (12, -1.5)], [(13, -0.25), (14, -2.0)]],
    )
    resp = deserialize_sample_response(encode_sample_response(result))
    assert [s.stop_reason for s in resp.sequences] == ["stop", "length"]
    assert resp.sequences[0].tokens == [5, 6, 7] and resp.sequences[1].tokens == [8]
    assert resp.sequences[0].logprobs == [-0.5, -1.0, -1.5] and resp.sequences[1].logprobs == [-0.25]
    assert math.isnan(resp.prompt_logprobs_np[0])
    assert resp.prompt_logprobs == [None, -2.5, -0.75]
    topk = resp.topk_prompt_logprobs_np
    assert topk.token_ids.shape == (3, 2) and topk.logprobs.shape == (3, 2)
    assert topk.token_ids[0].tolist() == [0, 0] and topk.logprobs[0].tolist() == [-99999.0, -99999.0]
    assert resp.topk_prompt_logprobs == [None, [(11, -0.5), (12, -1.5)], [(13, -0.25), (14, -2.0)]]

    plain = deserialize_sample_response(
        encode_sample_response(SampleResult([SampledSequence([1], [-0.5], "length")]))
    )
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None
    assert plain.sequences[0].logprobs == [-0.5]

    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response(SampleResult([SampledSequence([1], [-0.5], "eos")]))


def test_sampling_options_travel_as_the_sdk_sends_and_reads_them():
    """asample's options, from the body the SDK builds (a SampleRequest dumped to JSON), and their answers
    in a SampleResponse the SDK decodes: top-k per sampled token, target logprobs in the request's own
    layout (dense, or sparse with the same CSR indices), alternative tokens as two [N - 1, k] tensors."""
    ids = torch.full((4, 2), -1, dtype=torch.int64)
    ids[1, 0], ids[3, 1] = 17, 99
    for target in (types.TensorData.from_torch(ids), types.TensorData.from_torch_sparse(ids, pad_value=-1)):
        request = types.SampleRequest(
            sampling_session_id="s:sample:0", seq_id=0, prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
            sampling_params=types.SamplingParams(max_tokens=2), prompt_logprobs=True, topk_sample_logprobs=3,
            prompt_alt_tokens_k=2, prompt_logprobs_last_n=2, target_prompt_logprobs=_tensor_data_to_model(target))
        body = types.SampleRequest.model_validate(request.model_dump(exclude_none=True, mode="json"))
        options = sample_options(body)
        assert (options.prompt_logprobs, options.topk_sample_logprobs, options.prompt_alt_tokens_k,
                options.prompt_logprobs_last_n) == (True, 3, 2, 2)
        targets = options.target_prompt_logprobs
        sparse = target.sparse_crow_indices is not None
        assert targets.shape == (4, 2) and (targets.crow_indices is not None) == sparse
        # Each cell's row, and its id: every cell of a dense tensor, only the named ones of a sparse one.
        assert targets.first_row == 1
        assert targets.ids[targets.ids >= 0].tolist() == [17, 99] and targets.rows[targets.ids >= 0].tolist() == [1, 3]
        assert len(targets.ids) == (2 if sparse else 8)

        answer = np.where(targets.ids >= 0, -1.5 - targets.rows, 0.0).astype(np.float32)
        alt_tokens, alt_logprobs = np.arange(8).reshape(4, 2), -np.arange(8, dtype=np.float32).reshape(4, 2)
        result = SampleResult(
            [SampledSequence([5, 6], [-0.5, -1.0], "length", top_logprobs=[[(5, -0.5), (9, -1.25)], [(7, -0.75), (6, -1.0)]])],
            targets=targets, target_prompt_logprobs=answer, prompt_alt_tokens=alt_tokens, prompt_alt_logprobs=alt_logprobs)
        resp = deserialize_sample_response(encode_sample_response(result))
        assert resp.sequences[0].topk_logprobs == [[(5, -0.5), (9, -1.25)], [(7, -0.75), (6, -1.0)]]
        got = resp.target_prompt_logprobs
        assert got.shape == [4, 2] and got.sparse_crow_indices == target.sparse_crow_indices
        dense = np.zeros((4, 2), dtype=np.float32)
        dense[1, 0], dense[3, 1] = -2.5, -4.5
        assert got.to_numpy().tolist() == dense.tolist()
        assert resp.prompt_alt_tokens.tokens.to_numpy().tolist() == alt_tokens.tolist()
        assert resp.prompt_alt_tokens.tokens.dtype == "int64"
        assert resp.prompt_alt_tokens.logprobs.to_numpy().tolist() == alt_logprobs.tolist()
    # A one-token prompt has no position to draw alternatives at: empty [0, k] tensors.
    empty = deserialize_sample_response(encode_sample_response(SampleResult(
        [SampledSequence([1], [-0.5], "length")], prompt_alt_tokens=np.zeros((0, 3), np.int64),
        prompt_alt_logprobs=np.zeros((0, 3), np.float32))))
    assert empty.prompt_alt_tokens.tokens.to_numpy().shape == (0, 3)


@pytest.mark.parametrize("tensor, message", [
    ({"data": [1.5], "dtype": "float32", "shape": [1, 1]}, "int64"),
    ({"data": [1, 2], "dtype": "int64", "shape": [2]}, "2-D shape"),
    ({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "3 values but shape"),
    ({"data": [1.5, 2], "dtype": "int64", "shape": [1, 2]}, "integer token ids"),
    ({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1]}, "both sparse"),
    ({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [0]},
     "inconsistent sparse CSR"),
    ({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1], "sparse_col_indices": [5]},
     "inconsistent sparse CSR"),
])
def test_malformed_target_prompt_logprobs_are_user_errors(tensor, message):
    with pytest.raises(UserError, match=message):
        target_ids_from_json(tensor)


def test_a_sparse_target_keeps_its_layout():
    got = target_ids_from_json({"data": [4, 5], "dtype": "int64", "shape": [3, 4], "sparse_crow_indices": [0, 0, 2, 2],
                                "sparse_col_indices": [1, 3]})
    assert isinstance(got, TargetIds) and got.rows.tolist() == [1, 1] and got.ids.tolist() == [4, 5]
    assert (got.crow_indices, got.col_indices) == ([0, 0, 2, 2], [1, 3])
