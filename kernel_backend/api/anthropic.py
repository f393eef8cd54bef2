"""An Anthropic Messages endpoint: POST /v1/messages, so clients written for Claude (the official
`anthropic` SDK, agent frameworks) talk to a base model or a checkpoint.

`model` names what to sample as on the OpenAI routes (kernel_backend/api/openai.py): a base model,
a `tinker://...` sampler path, or `<base>;<path>`. The key comes in `x-api-key` (what the SDK
sends) or `Authorization: Bearer`. The request goes through sampling.generate like every sampling
request: bounded and admitted before it is queued, batched with everyone's decoding, metered on the
ledger (request type "Message"); its errors are the app's handlers' (app.py), in Anthropic's
shape on this path. Text content only: images, documents and tool use answer a 400
that says so. Errors come in Anthropic's shape, {"type": "error", "error": {"type", "message"}}.
Streaming sends Anthropic's server-sent events: message_start, content_block_start, ping,
content_block_delta (text_delta) ..., content_block_stop, message_delta (stop reason, output
tokens), message_stop.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kernel_backend.admission import SEED_RANGE
from kernel_backend.api.auth import tenant_of
from kernel_backend.api.openai import cut_at_stop, start_streaming, text_deltas, visible_tokens
from kernel_backend.api.tinker import service
from kernel_backend.service import Service, sampling
from kernel_backend.types import SamplingParams, UserError, redact_paths

PATH = "/v1/messages"
REQUEST_TYPE = "Message"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def is_anthropic(path: str) -> bool:
    """Whether an error on `path` must come in Anthropic's shape (app.py's handlers ask)."""
    return path == PATH or path.startswith(PATH + "/")


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                        headers=headers)


class TextBlock(BaseModel):
    type: str
    text: str = ""


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(BaseModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # not Anthropic's; for reproducible evals


router = APIRouter()


@router.post(PATH)
async def messages(body: MessagesRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    if body.tools:
        raise UserError("tool use is not supported on this server yet: send messages without `tools` "
                        "(docs/evaluate.md lists what /v1/messages takes)")
    base, path = sampling.openai_model(svc, tenant, body.model)
    tokenizer = sampling.tokenizer(svc, base)
    chat = ([{"role": "system", "content": _text(body.system)}] if body.system else []) + \
           [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    stop = [s for s in body.stop_sequences or [] if s]
    params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k or -1, seed=body.seed, stop=stop or None)
    message_id = "msg_" + uuid.uuid4().hex
    if body.stream:
        task, queue = start_streaming(svc, tenant, REQUEST_TYPE, base, path, prompt, 1, params)
        return StreamingResponse(_events(task, queue, tokenizer, message_id, body.model, len(prompt), stop),
                                 media_type="text/event-stream")
    (result,) = await sampling.generate(svc, tenant, REQUEST_TYPE, base, path, [prompt], 1, params)
    (seq,) = result.sequences
    visible, _ = visible_tokens(seq, tokenizer, stop, sampling.eos_ids(svc, base))
    text = tokenizer.decode(visible)
    reason, matched = _stop_reason(seq, text, stop)
    return {"id": message_id, "type": "message", "role": "assistant", "model": body.model,
            "content": [{"type": "text", "text": cut_at_stop(text, stop)}],
            "stop_reason": reason, "stop_sequence": matched,
            "usage": {"input_tokens": len(prompt), "output_tokens": len(seq.tokens)}}


def _text(content) -> str:
    """A message's (or the system prompt's) text: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    for block in content:
        if block.type != "text":
            raise UserError(f"content blocks of type {block.type!r} are not supported here; send text blocks")
    return "".join(block.text for block in content)


def _stop_reason(seq, text: str, stop: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason (end_turn, stop_sequence, max_tokens) and the stop sequence met."""
    if seq.stop_reason != "stop":
        return "max_tokens", None
    met = [(text.find(s), s) for s in stop if s in text]
    return ("stop_sequence", min(met)[1]) if met else ("end_turn", None)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def _events(task, queue, tokenizer, message_id: str, model: str, input_tokens: int, stop: list[str]):
    """Anthropic's event stream for one message; a client that goes away cancels the generation."""
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        async for _, piece in text_deltas(task, queue, tokenizer, 1, stop):
            yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": piece}})
        try:
            (result,) = task.result()
        except Exception as e:  # failed while streaming: Anthropic's error event ends the stream
            kind = "invalid_request_error" if isinstance(e, UserError) else "api_error"
            yield _event("error", {"type": "error", "error": {"type": kind, "message": redact_paths(str(e))}})
            return
        (seq,) = result.sequences
        reason, matched = _stop_reason(seq, tokenizer.decode(seq.tokens, skip_special_tokens=True), stop)
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                                       "usage": {"output_tokens": len(seq.tokens)}})
        yield _event("message_stop", {"type": "message_stop"})
    finally:
        task.cancel()
