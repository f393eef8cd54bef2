"""Conversions between the tinker 0.38 wire formats and the engine's plain types.

This module owns every byte-level detail of the protocol's data: the protobuf
`ForwardBackwardRequest` body (optionally zstd-compressed), the JSON forms of Datum,
TensorData, ModelInput and SamplingParams, and the protobuf `ForwardBackwardOutput`
and `SampleResponse` results (and their JSON forms, for SDKs before 0.24 that do not
accept protobuf). The schema is the SDK's own (`tinker.proto.tinker_public_pb2`); nothing
here is copied from it. Bad input raises `UserError` with a message that says
what to send instead; a bad engine result (a bug on our side) raises `ValueError`.

Encodings (all little-endian): token ids in chunks are int32; dense tensors are raw bytes
of their dtype; sparse CSR tensors carry values in their dtype and crow/col indices as
int64. Sparse tensors are densified with 0 in the unlisted cells, which is how the SDK
builds them (it auto-sparsifies 2-D torch `target_tokens` / `weights` with pad 0).

Bounded before the work: a sparse tensor's shape costs nothing to send, so its rows must be its
datum's tokens, its K (the second dimension) at most MAX_TARGET_K, and all the cells one request
densifies at most MAX_DENSE_CELLS; a zstd body may not expand past the server's body limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import response_conv
from tinker.proto import tinker_public_pb2 as pb

from kernel_backend import grammars
from kernel_backend.types import (
    AdamParams,
    Datum,
    DimuonParams,
    ForwardResult,
    SampleOptions,
    SampleResult,
    SamplingParams,
    Span,
    TargetIds,
)
from kernel_backend.errors import UserError

MAX_DECOMPRESSED_BYTES = 64 << 20  # a zstd body may not expand past this (or the server's body limit)
MAX_TARGET_K = 1024  # the most targets per position, (N, K) tensors (top-k distillation uses tens)
MAX_DENSE_CELLS = 1 << 24  # the most cells one request's sparse tensors densify to, all together (128 MiB of int64)
TOPK_EMPTY_LOGPROB = -99999.0  # tinker.types.topk_logprobs.MASK_LOGPROB

_SUPPORTED_CHUNK = "send text tokens as 'encoded_text' chunks (ModelInput.from_ints)"
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
# proto DType -> (little-endian wire dtype, dtype the engine gets). Only float32 and
# int64 are public; int32 and bfloat16 are widened the way the SDK's decoder does.
_PROTO_DTYPES: dict[pb.DType.ValueType, tuple[np.dtype, type]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), np.float32),
    pb.DTYPE_INT64: (np.dtype("<i8"), np.int64),
    pb.DTYPE_INT32: (np.dtype("<i4"), np.int64),
    pb.DTYPE_BFLOAT16: (np.dtype("<u2"), np.float32),
}
_JSON_DTYPES = {"float32": np.float32, "int64": np.int64}


@dataclass
class ForwardBackwardCall:
    """A decoded /api/v1/forward_backward body (also used by forward(): forward_only=True)."""

    model_id: str
    seq_id: int | None  # None: no dedupe (JSON bodies may leave it out)
    loss_fn: str
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)


# ---- requests: protobuf --------------------------------------------------------------------


def decode_forward_backward(body: bytes, content_encoding: str | None = None,
                            max_bytes: int = MAX_DECOMPRESSED_BYTES) -> ForwardBackwardCall:
    """Parse a protobuf ForwardBackwardRequest, zstd-decompressing first (to at most `max_bytes`) if the
    header says so."""
    encoding = (content_encoding or "").strip().lower()
    if encoding == "zstd":
        body = _zstd_decompress(body, max_bytes or MAX_DECOMPRESSED_BYTES)
    elif encoding not in ("", "identity"):
        raise UserError(f"unsupported Content-Encoding {content_encoding!r}; send zstd or no encoding")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, RuntimeWarning) as e:
        raise UserError(
            f"forward_backward body is not a valid protobuf ForwardBackwardRequest ({e}); "
            "send Content-Type application/x-protobuf as the tinker SDK does"
        ) from None
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind is None:
                raise UserError(f"loss_fn_config[{key!r}] has no value; give a number or a string")
            config[key] = value.number if kind == "number" else value.text
    else:
        config = {key: float(value) for key, value in msg.loss_fn_config.items()}
    if not msg.model_id:
        raise UserError("forward_backward body has no model_id; send the id create_model returned")
    budget = _DenseBudget()
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=[_datum_from_proto(d, f"data[{i}]", budget) for i, d in enumerate(msg.data)],
    )


def _zstd_decompress(body: bytes, max_bytes: int) -> bytes:
    out, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise UserError(f"zstd body expands past {max_bytes} bytes; send smaller chunks")
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise UserError(f"body has Content-Encoding: zstd but is not valid zstd data ({e})") from None
    return b"".join(out)


def _datum_from_proto(msg: pb.Datum, where: str, budget: _DenseBudget) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            _reject_chunk(kind, f"{where}.model_input.chunks[{j}]")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"{where}.model_input.chunks[{j}] tokens are {len(raw)} bytes, not whole int32s")
        tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
    inputs = {name: _tensor_from_proto(t, f"{where}.loss_fn_inputs[{name!r}]", len(tokens), budget)
              for name, t in msg.loss_fn_inputs.items()}
    if bool(msg.model_input_spans) != bool(msg.loss_fn_input_spans):
        raise UserError(f"{where} has provenance for only one of model_input and loss_fn_inputs; send both "
                        "(Datum.with_provenance) or neither")
    if not msg.model_input_spans:
        return Datum(tokens=tokens, loss_fn_inputs=inputs)
    return Datum(tokens=tokens, loss_fn_inputs=inputs,
                 model_input_spans=_spans_from_proto(msg.model_input_spans, f"{where}.model_input_spans", len(tokens)),
                 loss_fn_input_spans=_spans_from_proto(msg.loss_fn_input_spans, f"{where}.loss_fn_input_spans",
                                                       len(tokens)))


def _spans_from_proto(msgs, where: str, positions: int) -> list[Span]:
    """Provenance runs as Spans. What they claim (ids, ranges, tokens) is checked against the recorded
    sequences by service/stability.py; here only their shape: at most one run per position, each
    nonnegative (that bounds the work of checking them by the datum's size)."""
    if len(msgs) > max(positions, 1):
        raise UserError(f"{where} has {len(msgs)} runs for {positions} positions; give at most one run per position")
    spans = []
    for j, msg in enumerate(msgs):
        kind = msg.WhichOneof("span")
        if kind is None:
            raise UserError(f"{where}[{j}] is empty; give a PromptProvenanceSpan or a SampledProvenanceSpan")
        run = getattr(msg, kind)
        if run.offset < 0 or run.length < 0 or not run.sequence_id:
            raise UserError(f"{where}[{j}] needs a sequence_id, offset >= 0 and length >= 0; got "
                            f"({run.sequence_id!r}, {run.offset}, {run.length})")
        spans.append(Span(kind == "sampled_tokens", run.sequence_id, run.offset, run.length))
    return spans


def _tensor_from_proto(msg: pb.Tensor, where: str, rows: int, budget: _DenseBudget) -> np.ndarray:
    if msg.dtype not in _PROTO_DTYPES:
        raise UserError(f"{where} has unsupported dtype {msg.dtype}; use float32 or int64")
    wire, target = _PROTO_DTYPES[msg.dtype]

    def read(raw: bytes, dtype: np.dtype, what: str) -> np.ndarray:
        if len(raw) % dtype.itemsize:
            raise UserError(f"{where} {what} is {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte items")
        arr = np.frombuffer(raw, dtype=dtype)
        if msg.dtype == pb.DTYPE_BFLOAT16 and what == "data":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)  # bf16 is a float32's high half
        return arr

    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        return _densify(
            read(csr.values, wire, "data").astype(target),
            shape,
            read(csr.crow_indices, np.dtype("<i8"), "crow_indices"),
            read(csr.col_indices, np.dtype("<i8"), "col_indices"),
            where,
            rows,
            budget,
        )
    return _shaped(read(msg.dense, wire, "data").astype(target), shape or None, where)


def _reject_chunk(kind: str | None, where: str) -> None:
    if kind is None:
        raise UserError(f"{where} is empty; {_SUPPORTED_CHUNK}")
    name = {"image": "image", "image_asset_pointer": "image", "dmel": "audio (dmel)"}.get(kind, repr(kind))
    raise UserError(f"{where}: {name} chunks are not supported by this backend; {_SUPPORTED_CHUNK}")


# ---- tensors (shared by proto and JSON) ----------------------------------------------------


def _shaped(flat: np.ndarray, shape: list[int] | None, where: str) -> np.ndarray:
    if shape is None:
        return flat  # tinker's convention: no shape means 1-D
    if any(d < 0 for d in shape) or math.prod(shape) != flat.size:
        raise UserError(f"{where} has {flat.size} values but shape {shape}")
    return flat.reshape(shape)


class _DenseBudget:
    """The cells one request's sparse tensors may still densify to (MAX_DENSE_CELLS in all)."""

    def __init__(self) -> None:
        self.left = MAX_DENSE_CELLS

    def take(self, cells: int, where: str) -> None:
        if cells > self.left:
            raise UserError(f"{where}: this request's sparse tensors densify to more than {MAX_DENSE_CELLS} cells in "
                            "all; send fewer datums per request, or a smaller K")
        self.left -= cells


def _densify(values: np.ndarray, shape: list[int], crow: np.ndarray, col: np.ndarray, where: str, tokens: int,
             budget: _DenseBudget) -> np.ndarray:
    """A CSR tensor as a dense array, 0 in the unlisted cells, once its size is known to be bounded:
    one row per token of its datum, K columns at most MAX_TARGET_K, within the request's budget."""
    if len(shape) != 2 or min(shape) < 0:
        raise UserError(f"{where} is sparse CSR, so it needs a 2-D shape; got {shape}")
    rows, cols = shape
    if rows != tokens:
        raise UserError(f"{where} has sparse shape {shape} but model_input has {tokens} tokens; "
                        f"give one row per input position: shape ({tokens}, K)")
    if not 1 <= cols <= MAX_TARGET_K:
        raise UserError(f"{where} has K = {cols} (shape {shape}); K must be from 1 to {MAX_TARGET_K}")
    budget.take(rows * cols, where)
    out = np.zeros((rows, cols), dtype=values.dtype)
    out[_csr_rows(len(values), shape, crow, col, where), col] = values
    return out


def _csr_rows(nnz: int, shape: list[int], crow: np.ndarray, col: np.ndarray, where: str) -> np.ndarray:
    """The row of each of a CSR tensor's `nnz` listed cells, once its indices are checked against its shape."""
    rows, cols = shape
    if (
        len(crow) != rows + 1
        or crow[0] != 0
        or crow[-1] != nnz
        or np.any(np.diff(crow) < 0)
        or len(col) != nnz
        or (nnz and (col.min() < 0 or col.max() >= cols))
    ):
        raise UserError(
            f"{where} has inconsistent sparse CSR indices for shape {shape}: need {rows + 1} non-decreasing "
            f"crow_indices from 0 to {nnz} and {nnz} col_indices below {cols}"
        )
    return np.repeat(np.arange(rows), np.diff(crow))


def _tensor_from_json(obj: Any, where: str, rows: int, budget: _DenseBudget) -> np.ndarray:
    if not isinstance(obj, dict) or "data" not in obj or "dtype" not in obj:
        raise UserError(f"{where} must be a TensorData object {{data, dtype, shape?}}")
    dtype = _JSON_DTYPES.get(obj["dtype"])
    if dtype is None:
        raise UserError(f"{where}.dtype is {obj['dtype']!r}; use 'float32' or 'int64'")
    try:
        values = np.asarray(obj["data"], dtype=dtype)
        shape = None if obj.get("shape") is None else [int(d) for d in obj["shape"]]
        crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
        if crow is not None or col is not None:
            if crow is None or col is None:
                raise UserError(f"{where} needs both sparse_crow_indices and sparse_col_indices")
            crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
            if values.ndim != 1 or crow_a.ndim != 1 or col_a.ndim != 1:
                raise UserError(f"{where} sparse data and indices must be flat lists")
            return _densify(values, shape or [], crow_a, col_a, where, rows, budget)
    except UserError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise UserError(f"{where} is not a flat list of {obj['dtype']} numbers ({e})") from None
    return _shaped(values.reshape(-1), shape, where)


# ---- requests: JSON ------------------------------------------------------------------------


def model_input_tokens(obj: Any, where: str = "model_input") -> list[int]:
    """Token ids of a JSON ModelInput `{chunks: [{type: "encoded_text", tokens: [...]}, ...]}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("chunks"), list):
        raise UserError(f"{where} must be a ModelInput object {{chunks: [...]}}")
    tokens: list[int] = []
    for j, chunk in enumerate(obj["chunks"]):
        here = f"{where}.chunks[{j}]"
        if not isinstance(chunk, dict):
            raise UserError(f"{here} must be an object; {_SUPPORTED_CHUNK}")
        kind = chunk.get("type", "encoded_text" if "tokens" in chunk else None)
        if kind != "encoded_text":
            _reject_chunk(kind, here)
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"{here}.tokens must be a list of integer token ids")
        tokens.extend(ids)
    return tokens


def datum_from_json(obj: Any, where: str = "datum", budget: _DenseBudget | None = None) -> Datum:
    """A JSON tinker Datum `{model_input, loss_fn_inputs: {name: TensorData}}` as an engine Datum."""
    if not isinstance(obj, dict):
        raise UserError(f"{where} must be a Datum object {{model_input, loss_fn_inputs}}")
    inputs = obj.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict):
        raise UserError(f"{where}.loss_fn_inputs must map names to TensorData objects")
    tokens = model_input_tokens(obj.get("model_input"), f"{where}.model_input")
    budget = budget or _DenseBudget()
    return Datum(
        tokens=tokens,
        loss_fn_inputs={k: _tensor_from_json(v, f"{where}.loss_fn_inputs[{k!r}]", len(tokens), budget)
                        for k, v in inputs.items()},
    )


def forward_backward_from_json(obj: Any, forward_only: bool = False) -> ForwardBackwardCall:
    """A JSON forward_backward (or legacy /forward) body: {model_id, seq_id, forward_backward_input |
    forward_input: {data, loss_fn, loss_fn_config?}}. The 0.38 SDK itself only sends protobuf."""
    if not isinstance(obj, dict) or not obj.get("model_id"):
        raise UserError("forward_backward body must be an object with a model_id")
    key = "forward_input" if "forward_input" in obj else "forward_backward_input"
    fb = obj.get(key)
    if not isinstance(fb, dict) or not isinstance(fb.get("data"), list):
        raise UserError(f"forward_backward body needs {key}: {{data: [Datum...], loss_fn, loss_fn_config?}}")
    seq_id = obj.get("seq_id")  # absent: no dedupe, every such request is new work
    if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool)):
        raise UserError(f"seq_id must be an integer, got {seq_id!r}")
    budget = _DenseBudget()
    config = fb.get("loss_fn_config") or {}
    if not isinstance(config, dict) or not all(
        isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in config.values()
    ):
        raise UserError("loss_fn_config must map names to numbers or strings")
    return ForwardBackwardCall(
        model_id=str(obj["model_id"]),
        seq_id=seq_id,
        loss_fn=str(fb.get("loss_fn", "cross_entropy")),
        loss_fn_config={k: v if isinstance(v, str) else float(v) for k, v in config.items()},
        forward_only=bool(obj.get("forward_only", forward_only or key == "forward_input")),
        data=[datum_from_json(d, f"data[{i}]", budget) for i, d in enumerate(fb["data"])],
    )


def sampling_params_from_json(obj: Any) -> SamplingParams:
    """asample's `sampling_params`. Absent max_tokens stays None (the engine picks a default)."""
    if obj is None:
        obj = {}
    if not isinstance(obj, dict):
        raise UserError("sampling_params must be an object {max_tokens?, seed?, stop?, temperature, top_k, top_p, "
                        "min_p?, repetition_penalty?, frequency_penalty?, presence_penalty?, logit_bias?}")

    def number(key: str, default: Any, kind: type) -> Any:
        value = obj.get(key)
        if value is None:
            return default
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            raise UserError(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        return kind(value)

    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is not None:
        is_id = lambda s: isinstance(s, int) and not isinstance(s, bool)  # noqa: E731
        if not isinstance(stop, list) or not (all(isinstance(s, str) for s in stop) or all(map(is_id, stop))):
            raise UserError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    bias = obj.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise UserError("sampling_params.logit_bias must be an object {token id: bias}")
        bias = {token_id(key, "sampling_params.logit_bias"): value for key, value in bias.items()}
    return SamplingParams(
        max_tokens=number("max_tokens", None, int),
        temperature=number("temperature", 1.0, float),
        top_k=number("top_k", -1, int),
        top_p=number("top_p", 1.0, float),
        seed=number("seed", None, int),
        stop=stop,
        # Ours, beyond the SDK's SamplingParams (docs/tinker-surface.md): a client that sends them gets them.
        min_p=number("min_p", 0.0, float),
        repetition_penalty=number("repetition_penalty", 1.0, float),
        frequency_penalty=number("frequency_penalty", 0.0, float),
        presence_penalty=number("presence_penalty", 0.0, float),
        logit_bias=bias or None,
    )


def token_id(key: Any, where: str) -> int:
    """A token id given as a JSON object's key ("42") or a number (logit_bias, here and on the OpenAI routes)."""
    try:
        if isinstance(key, bool):
            raise ValueError
        return int(key)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {key!r} is not a token id") from None


def sample_options(body: Any) -> SampleOptions:
    """What an asample body (the SDK's SampleRequest, and our `constraint`: grammars.constraint) asks for besides
    its samples. Bounded against the prompt by SampleOptions.check, at admission."""
    target = body.target_prompt_logprobs
    constraint = getattr(body, "constraint", None)
    return SampleOptions(
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        topk_sample_logprobs=body.topk_sample_logprobs,
        target_prompt_logprobs=target_ids_from_json(target.model_dump(mode="json")) if target is not None else None,
        prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        grammar=grammars.constraint(constraint) if constraint is not None else None,
    )


def target_ids_from_json(obj: Any, where: str = "target_prompt_logprobs") -> TargetIds:
    """A JSON TensorData of int64 token ids, [len(prompt) - 1, K], dense or sparse CSR, as its cells in
    its own layout (the answer keeps it). Every array here is as long as what was sent."""
    if not isinstance(obj, dict) or obj.get("dtype") != "int64":
        raise UserError(f"{where} must be an int64 TensorData of token ids, shape [len(prompt) - 1, K]")
    shape = obj.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise UserError(f"{where} needs a 2-D shape [len(prompt) - 1, K], got {shape!r}")
    data = obj.get("data")
    if not isinstance(data, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise UserError(f"{where}.data must be a flat list of integer token ids (-1 for none)")
    ids = np.asarray(data, dtype=np.int64)
    crow, col = obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")
    if crow is None and col is None:
        if len(ids) != shape[0] * shape[1]:
            raise UserError(f"{where} has {len(ids)} values but shape {shape}")
        return TargetIds((shape[0], shape[1]), np.repeat(np.arange(shape[0]), shape[1]), ids)
    if crow is None or col is None:
        raise UserError(f"{where} needs both sparse_crow_indices and sparse_col_indices")
    rows = _csr_rows(len(ids), shape, np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64), where)
    return TargetIds((shape[0], shape[1]), rows, ids, list(crow), list(col))


def optim_params(params: Any) -> AdamParams | DimuonParams:
    """optim_step's params as the SDK sends them: `adam_params` {learning_rate, beta1, beta2, eps,
    weight_decay, grad_clip_norm} (parsed by the SDK's AdamParams), or `optimizer_params` {type:
    "dimuon", learning_rate, grad_clip_norm, beta1, and from newer SDKs damping and
    rank_lr_correction_exponent}. Values are checked by kernel_backend.engine.optimizers."""
    if hasattr(params, "beta2"):  # tinker.types.AdamParams
        return AdamParams(params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay,
                          params.grad_clip_norm)
    fields = dict(params.model_dump() if hasattr(params, "model_dump") else params)
    kind = fields.pop("type", None)
    if kind != "dimuon":
        raise UserError(f"optimizer {kind!r} is not supported; send AdamParams or DimuonParams")
    known = set(DimuonParams.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"optimizer_params has unknown key(s) {unknown}; DimuonParams has: {', '.join(sorted(known))}")
    if "learning_rate" not in fields:
        raise UserError("optimizer_params.learning_rate is required for Dimuon (it has no default)")
    return DimuonParams(**fields)


# ---- results: protobuf ---------------------------------------------------------------------


def encode_forward_backward_output(result: ForwardResult) -> bytes:
    """A ForwardResult as the protobuf ForwardBackwardOutput the SDK decodes.

    Each loss_fn_outputs field becomes a BatchedTensor: the datums' arrays concatenated,
    int64 byte offsets (num_datums + 1, from 0) and the dims after the first. Datums whose
    trailing shapes differ (ragged K) go into separate ArrayRecords, which the SDK joins.
    """
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result.metrics.items():
        msg.metrics[key] = float(value)
    groups: list[tuple[list, list[dict[str, np.ndarray]]]] = []  # (signature, datums)
    for out in result.loss_fn_outputs:
        out = {k: np.atleast_1d(np.asarray(v)) for k, v in out.items()}
        sig = sorted((k, _proto_dtype(v, k), v.shape[1:]) for k, v in out.items())
        if groups and sig == groups[-1][0]:
            groups[-1][1].append(out)
            continue
        if groups and sorted(out) != [s[0] for s in groups[-1][0]]:
            raise ValueError("every datum's loss_fn_outputs must have the same field names")
        groups.append((sig, [out]))
    for sig, datums in groups:
        record = msg.loss_fn_outputs.add(num_datums=len(datums))
        for name, proto_dtype, trailing in sig:
            wire = _PROTO_DTYPES[proto_dtype][0]
            parts = [np.ascontiguousarray(out[name], dtype=wire).tobytes() for out in datums]
            offsets = np.cumsum([0] + [len(p) for p in parts]).astype("<i8")
            record.fields[name].CopyFrom(
                pb.BatchedTensor(
                    data=b"".join(parts), offsets=offsets.tobytes(), dtype=proto_dtype, trailing_shape=trailing
                )
            )
    return msg.SerializeToString()


def _proto_dtype(arr: np.ndarray, name: str) -> pb.DType.ValueType:
    if arr.dtype.kind == "f":
        return pb.DTYPE_FLOAT32
    if arr.dtype.kind in "iub":
        return pb.DTYPE_INT64
    raise ValueError(f"loss_fn_outputs[{name!r}] has dtype {arr.dtype}; only numbers go on the wire")


def encode_sample_response(result: SampleResult) -> bytes:
    """A SampleResult as the protobuf SampleResponse the SDK decodes.

    Sampled logprobs are always sent. Prompt logprobs are float32 with NaN where None (position 0,
    and before the last n with prompt_logprobs_last_n). Top-k logprobs (prompt, and each sequence's
    sampled) are N x K row-major matrices, K the longest row; empty cells are token 0 / logprob
    -99999.0, which the SDK reads back as None. Target logprobs are a float32 tensor in the request's
    layout (dense, or sparse with its CSR indices); alternative prompt tokens two dense [N - 1, k] tensors.
    """
    msg = pb.SampleResponse()
    for i, seq in enumerate(result.sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason is {seq.stop_reason!r}; expected 'stop' or 'length'")
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"sequences[{i}] has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
        sequence = msg.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if seq.top_logprobs is not None:
            if len(seq.top_logprobs) != len(seq.tokens):
                raise ValueError(f"sequences[{i}] has {len(seq.tokens)} tokens but {len(seq.top_logprobs)} top-k rows")
            sequence.topk_sampled_logprobs.CopyFrom(_topk_matrix(seq.top_logprobs))
    if result.prompt_logprobs is not None:
        lps = [math.nan if lp is None else lp for lp in result.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(lps, dtype="<f4").tobytes()
    if result.topk_prompt_logprobs is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_matrix(result.topk_prompt_logprobs))
    if result.targets is not None:
        targets = result.targets
        values = np.asarray(result.target_prompt_logprobs, dtype="<f4").tobytes()
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=targets.shape)
        if targets.crow_indices is None:
            tensor.dense = values
        else:
            tensor.sparse_csr.CopyFrom(pb.SparseCsr(
                values=values, crow_indices=np.asarray(targets.crow_indices, dtype="<i8").tobytes(),
                col_indices=np.asarray(targets.col_indices, dtype="<i8").tobytes()))
        msg.target_prompt_logprobs.CopyFrom(tensor)
    if result.prompt_alt_tokens is not None:
        tokens, logprobs = result.prompt_alt_tokens, result.prompt_alt_logprobs
        assert logprobs is not None, "prompt_alt_tokens come with their logprobs"
        msg.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(
            tokens=pb.Tensor(dtype=pb.DTYPE_INT64, shape=tokens.shape, dense=tokens.astype("<i8").tobytes()),
            logprobs=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=logprobs.shape, dense=logprobs.astype("<f4").tobytes()),
        ))
    return msg.SerializeToString()


def _topk_matrix(rows: Sequence[list[tuple[int, float]] | None]) -> pb.TopkLogprobs:
    """Per position, up to k (token, logprob) pairs (None: nothing there) as the SDK's TopkLogprobs."""
    n, k = len(rows), max((len(r) for r in rows if r), default=0)
    ids = np.zeros((n, k), dtype="<i4")
    lps = np.full((n, k), TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row or ()):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(length=n, k=k, token_ids=ids.tobytes(), logprobs=lps.tobytes())


# ---- results: JSON, for clients that do not accept protobuf -----------------------------------------
# A finished Sample, Forward or ForwardBackward future is stored as the protobuf reply tinker >= 0.24 asks
# for. Older SDKs (0.18 reads protobuf for SampleResponse only, 0.16 and before for nothing) send
# `Accept: application/json` and validate the reply with pydantic: these give them the same result in the
# JSON shapes those SDKs' types declare, decoded with the SDK's own reader so nothing is lost on the way.

def accepts_protobuf(accept: str | None) -> bool:
    """Whether an Accept header lists application/x-protobuf with a quality above 0. A header that is
    silent (absent, `*/*`) gets JSON, which every SDK version and every HTTP tool reads."""
    for item in (accept or "").split(","):
        media, *params = [part.strip() for part in item.split(";")]
        if media.lower() == "application/x-protobuf":
            quality = next((p.split("=", 1)[1] for p in params if p.replace(" ", "").startswith("q=")), "1")
            try:
                return float(quality) > 0
            except ValueError:
                return True
    return False


def proto_reply_as_json(body: bytes, request_type: str) -> dict:
    """A stored protobuf reply (a Sample future's SampleResponse, a Forward or ForwardBackward future's
    ForwardBackwardOutput) as the JSON object tinker SDKs before protobuf replies validate."""
    if request_type == "Sample":
        sample = response_conv.deserialize_sample_response(body)
        return {
            "type": "sample",
            "sequences": [{"stop_reason": seq.stop_reason, "tokens": list(seq.tokens),
                           "logprobs": None if seq.logprobs is None else list(seq.logprobs)}
                          for seq in sample.sequences],
            "prompt_logprobs": sample.prompt_logprobs,
            "topk_prompt_logprobs": sample.topk_prompt_logprobs,
        }
    if request_type in ("Forward", "ForwardBackward"):
        output = response_conv.deserialize_forward_backward_output(body)
        return {
            "loss_fn_output_type": output.loss_fn_output_type,
            "loss_fn_outputs": [{name: {"data": np.asarray(t.to_numpy()).ravel().tolist(), "dtype": t.dtype,
                                        "shape": list(t.shape) if t.shape is not None else None}
                                 for name, t in out.items()} for out in output.loss_fn_outputs],
            "metrics": dict(output.metrics),
        }
    raise ValueError(f"a {request_type} future has no protobuf reply")
