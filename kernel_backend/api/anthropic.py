"""An Anthropic Messages endpoint: POST /v1/messages, so clients written for Claude (the official
`anthropic` SDK, agent frameworks) talk to a base model or a checkpoint.

`model` names what to sample as on the OpenAI routes (kernel_backend/api/openai.py): a base model,
a `tinker://...` sampler path, or `<base>;<path>`. The key comes in `x-api-key` (what the SDK
sends) or `Authorization: Bearer`. The request goes through sampling.generate like every sampling
request: bounded and admitted before it is queued, batched with everyone's decoding, metered on the
ledger (request type "Message") under a session of the client's own: the one its `X-Stepwise-Session`
header names, else its `metadata.user_id`, else "anthropic" (kernel_backend/api/openai.py client_session);
its errors are the app's handlers' (app.py), in Anthropic's shape on this path. Content is text, tool_use and tool_result blocks; images, documents and
Anthropic's server tools answer a 400 that says so. Tools and tool_choice (auto, any, tool, none)
go through kernel_backend/tool_calls.py, as the OpenAI route's do; a reply's calls come back as
tool_use blocks with stop_reason "tool_use". tool_choice any and tool (and a tool's `strict`) are enforced while
decoding, by a grammar (engine/constraints.py): the tool_use block's input validates against the tool's
input_schema every time it finishes within max_tokens. Errors come in Anthropic's shape,
{"type": "error", "error": {"type", "message"}}. Streaming sends Anthropic's server-sent events:
message_start, ping, content_block_start, content_block_delta (text_delta, or input_json_delta for
a tool_use block) ..., content_block_stop per block, message_delta (stop reason, output tokens),
message_stop. POST /v1/messages/count_tokens answers a prompt's input_tokens without running the
model.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kernel_backend import tool_calls
from kernel_backend.service.admission import SEED_RANGE
from kernel_backend.api.auth import tenant_of
from kernel_backend.api.openai import client_session, cut_at_stop, start_streaming, text_deltas, visible_tokens
from kernel_backend.api.tinker import service
from kernel_backend.service import Service, sampling, sessions
from kernel_backend.types import SampleOptions, SamplingParams
from kernel_backend.errors import UserError, redact_paths

PATH = "/v1/messages"
REQUEST_TYPE = "Message"
ROUTE = "anthropic"  # the session name of a request that names none
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def is_anthropic(path: str) -> bool:
    """Whether an error on `path` must come in Anthropic's shape (app.py's handlers ask)."""
    return path == PATH or path.startswith(PATH + "/")


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                        headers=headers)


class Block(BaseModel):
    """A content block: text, tool_use (an assistant's call) or tool_result (the caller's answer to one)."""

    type: str
    text: str = ""
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool = False  # tool_result


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesInput(BaseModel):
    """What a prompt is made of: what count_tokens takes, and the start of every request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[dict] | None = Field(None, max_length=128)  # {"name", "description", "input_schema"}
    tool_choice: ToolChoice | None = None


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])  # not Anthropic's; for reproducible evals


router = APIRouter()


@router.post(PATH + "/count_tokens")
def count_tokens(body: MessagesInput, tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
    """The prompt's length in tokens, tools included; free, as Anthropic's is (it runs no model)."""
    base, _ = sampling.openai_model(svc, tenant, body.model)
    prompt, _, _ = _prompt(body, sampling.tokenizer(svc, base))
    return {"input_tokens": len(prompt)}


@router.post(PATH)
async def messages(body: MessagesRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service),
                   named: str | None = Header(None, alias=sessions.CLIENT_HEADER)):
    base, path = sampling.openai_model(svc, tenant, body.model)
    session_id = client_session(svc, tenant, named, (body.metadata or {}).get("user_id"), ROUTE)
    tokenizer = sampling.tokenizer(svc, base)
    prompt, choice, grammar = _prompt(body, tokenizer)
    options = SampleOptions(grammar=grammar)
    stop = [s for s in body.stop_sequences or [] if s]
    params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k or -1, seed=body.seed, stop=stop or None)
    message_id = "msg_" + uuid.uuid4().hex
    if body.stream:
        task, queue = start_streaming(svc, tenant, REQUEST_TYPE, base, path, prompt, 1, params, options,
                                      session_id=session_id)
        return StreamingResponse(_events(task, queue, tokenizer, message_id, body.model, len(prompt), stop, choice),
                                 media_type="text/event-stream")
    (result,) = await sampling.generate(svc, tenant, REQUEST_TYPE, base, path, [prompt], 1, params, options,
                                        session_id=session_id)
    (seq,) = result.sequences
    visible, _ = visible_tokens(seq, tokenizer, stop, sampling.eos_ids(svc, base))
    text = tokenizer.decode(visible)
    reason, matched = _stop_reason(seq, text, stop)
    reply = _reply(choice, choice.prefill + cut_at_stop(text, stop))
    content = ([{"type": "text", "text": reply.content}] if reply.content or not reply.calls else []) + \
              [_tool_use(call) for call in reply.calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": content,
            "stop_reason": "tool_use" if reply.calls else reason, "stop_sequence": matched,
            "usage": {"input_tokens": len(prompt), "output_tokens": len(seq.tokens)}}


def _prompt(body: MessagesInput, tokenizer) -> tuple[list[int], tool_calls.Choice, str | None]:
    """The request's prompt tokens (tools offered, the reply's opening forced by tool_choice), its Choice and the
    grammar the reply must match (tool_calls.grammar: a forced call's, strict tools'; None for free text)."""
    tools = tool_calls.check_tools([_as_function(i, tool) for i, tool in enumerate(body.tools or [])])
    pick = body.tool_choice or ToolChoice(type="auto")
    openai_choice = {"auto": "auto", "any": "required", "none": "none",
                     "tool": {"type": "function", "function": {"name": pick.name}}}[pick.type]
    choice = tool_calls.choice(openai_choice if tools or pick.type != "auto" else None, tools,
                               parallel=not pick.disable_parallel_tool_use)
    chat = [{"role": "system", "content": _text(body.system)}] if body.system else []
    for message in body.messages:
        chat += _chat_messages(message)
    return tool_calls.render(tokenizer, chat, tools, choice.prefill), choice, tool_calls.grammar(choice, tools)


def _as_function(index: int, tool: dict) -> dict:
    """An Anthropic tool ({"name", "description", "input_schema"}) in OpenAI's function shape."""
    if tool.get("type") not in (None, "custom"):
        raise UserError(f"tools[{index}] is Anthropic's server tool {tool.get('type')!r}, which this server does not "
                        "run; declare your own tool with name, description and input_schema and run it yourself")
    return {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description", ""),
                                             "parameters": tool.get("input_schema", {"type": "object"}),
                                             "strict": bool(tool.get("strict"))}}


def _chat_messages(message: Message) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool_result blocks become tool messages (before its
    text), an assistant's tool_use blocks its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": ("Error: " if b.is_error else "") +
                (b.content if isinstance(b.content, str) else _text(b.content or []))}
               for b in message.content if b.type == "tool_result"]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
             for b in message.content if b.type == "tool_use"]
    if results and message.role != "user" or calls and message.role != "assistant":
        raise UserError("tool_use blocks belong in assistant messages and tool_result blocks in user messages")
    text = _text([b for b in message.content if b.type not in ("tool_use", "tool_result")])
    if calls:
        return [{"role": "assistant", "content": text, "tool_calls": calls}]
    return results + ([{"role": message.role, "content": text}] if text or not results else [])


def _reply(choice: tool_calls.Choice, text: str) -> tool_calls.Reply:
    """The reply's text (its forced opening included) as text and tool calls."""
    return tool_calls.parse(text, choice.only_first) if choice.parse else tool_calls.Reply(text)


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def _text(content) -> str:
    """A message's (or the system prompt's) text: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    for block in content:
        if block.type != "text":
            raise UserError(f"content blocks of type {block.type!r} are not supported here; send text, tool_use "
                            "and tool_result blocks")
    return "".join(block.text for block in content)


def _stop_reason(seq, text: str, stop: list[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason (end_turn, stop_sequence, max_tokens) and the stop sequence met."""
    if seq.stop_reason != "stop":
        return "max_tokens", None
    met = [(text.find(s), s) for s in stop if s in text]
    return ("stop_sequence", min(met)[1]) if met else ("end_turn", None)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def _events(task, queue, tokenizer, message_id: str, model: str, input_tokens: int, stop: list[str],
                  choice: tool_calls.Choice):
    """Anthropic's event stream for one message; a client that goes away cancels the generation. Text
    streams as it comes (with tools, up to a call's opening); the calls follow once the reply is
    complete, a tool_use block each with its input as one input_json_delta."""
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        blocks = 0  # content blocks opened so far

        def text_delta(text: str):
            return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": text}})

        text, sent = choice.prefill, ""
        async for _, piece in text_deltas(task, queue, tokenizer, 1, stop):
            text += piece
            ready = tool_calls.streamable(text) if choice.parse else text
            if len(ready) > len(sent):
                if blocks == 0:
                    yield _text_block_start()
                    blocks = 1
                yield text_delta(ready[len(sent):])
                sent = ready
        try:
            (result,) = task.result()
        except Exception as e:  # failed while streaming: Anthropic's error event ends the stream
            kind = "invalid_request_error" if isinstance(e, UserError) else "api_error"
            yield _event("error", {"type": "error", "error": {"type": kind, "message": redact_paths(str(e))}})
            return
        (seq,) = result.sequences
        reason, matched = _stop_reason(seq, tokenizer.decode(seq.tokens, skip_special_tokens=True), stop)
        reply = _reply(choice, text)
        rest = reply.content[len(sent):] if reply.content.startswith(sent) else ""
        if blocks == 0 and (rest or not reply.calls):
            yield _text_block_start()
            blocks = 1
        if rest:
            yield text_delta(rest)
        if blocks:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        for call in reply.calls:
            block = {**_tool_use(call), "input": {}}
            yield _event("content_block_start", {"type": "content_block_start", "index": blocks, "content_block": block})
            yield _event("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": {
                "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
            yield _event("content_block_stop", {"type": "content_block_stop", "index": blocks})
            blocks += 1
        yield _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": len(seq.tokens)},
                                       "delta": {"stop_reason": "tool_use" if reply.calls else reason,
                                                 "stop_sequence": matched}})
        yield _event("message_stop", {"type": "message_stop"})
    finally:
        task.cancel()


def _text_block_start() -> str:
    return _event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
