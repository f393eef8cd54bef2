"""An OpenAI-compatible endpoint on every backend: chat completions, completions, models.

Mounted at /oai/api/v1 (Tinker's path) and /v1. `model` is a base model name, a
`tinker://<run>/sampler_weights/<name>` (or `/weights/<name>`) path, or `<base>;<path>`.
Requests go through the scheduler like any other sampling, and are metered the same way, under a session of
the client's own (service/sessions.py client_session): the one its `X-Stepwise-Session` header names, else its
body's `user`, else "openai"; one per tenant and name, apart from the SDK sessions (a notebook's) of the same key.
A checkpoint's sampling still counts against its run (the run's budget and usage scope).

/completions takes OpenAI's four prompt shapes (a text, texts, a token list, token lists: what
lm-eval's local-completions sends) and answers n choices per prompt, indexed prompt by prompt; a
list of prompts is bounded and admitted as one request, each prompt a job in the shared decode
batch. `echo` returns the prompt before the completion, and with `logprobs` the prompt's own token
logprobs (None for its first token; the same numbers as compute_logprobs) and their top
alternatives: what loglikelihood and perplexity evaluations read. `max_tokens: 0` with echo scores
the prompt and generates nothing.
Chat completions take tools: `tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and
`role: "tool"` messages; a reply's calls come back as `tool_calls` (finish_reason "tool_calls"), streamed as
tool_calls deltas once the reply is complete (kernel_backend/tool_calls.py renders and parses them).
`response_format` (json_object, json_schema; on completions too), a forced or required tool call and strict tools
are enforced while decoding, by a grammar that masks each token's choices (engine/constraints.py): the reply
validates every time it finishes within max_tokens (finish_reason "length" otherwise); logprobs stay the model's
own. A schema that cannot be enforced is a 400 naming what is wrong.
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kernel_backend import tool_calls
from kernel_backend.service.admission import SEED_RANGE
from kernel_backend.api.auth import tenant_of
from kernel_backend.api.wire import token_id
from kernel_backend.api.tinker import service
from kernel_backend.service import Service, sampling, sessions
from kernel_backend.errors import NotFound, UserError, redact_paths
from kernel_backend.types import SampleOptions, SamplingParams


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        if self.status == 402:  # a budget refused it (kernel_backend/service/budgets.py); OpenAI's name for spent credit
            kind = "insufficient_quota"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the request's usage (and no choices) before [DONE]


class SamplingFields(BaseModel):
    model: str
    n: int = Field(1, ge=1, le=16)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # OpenAI's penalties and logit_bias, and vLLM's min_p, top_k and repetition_penalty (what verifiers' harnesses
    # send); each changes what is sampled, not the logprobs returned (the model's own: engine/sampler.py).
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> a bias in [-100, 100]
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}: enforced
    response_format: dict | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None, max_length=128)  # {"type": "function", "function": {name, description, parameters}}
    tool_choice: str | dict | None = None  # auto, none, required, or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    functions: list[dict] | None = None  # OpenAI's old names for tools: refused with a pointer to the new ones
    function_call: str | dict | None = None


class CompletionRequest(SamplingFields):
    # OpenAI's four shapes: a text, texts, a token list, token lists (lm-eval sends lists of either)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=20)  # token logprobs, with this many alternatives each
    echo: bool = False  # the prompt comes back before the completion, with its own token logprobs


def build_router(prefix: str) -> APIRouter:
    router = APIRouter(prefix=prefix)

    @router.get("/models")
    def list_models(tenant: str = Depends(tenant_of), svc: Service = Depends(service)):
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "stepwise"}
            for name in sampling.openai_models(svc, tenant)
        ]}

    @router.post("/chat/completions")
    async def chat_completions(body: ChatRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service),
                               named: str | None = Header(None, alias=sessions.CLIENT_HEADER)):
        try:
            base, path = sampling.openai_model(svc, tenant, body.model)
            session_id = client_session(svc, tenant, named, body.user, ROUTE)
            tokenizer = sampling.tokenizer(svc, base)
            if body.functions is not None or body.function_call is not None:
                raise OpenAIError(400, "functions and function_call are OpenAI's deprecated names: send tools and "
                                       "tool_choice", param="functions")
            tools = tool_calls.check_tools(body.tools or [])
            choice = tool_calls.choice(body.tool_choice, tools, body.parallel_tool_calls)
            grammar = tool_calls.grammar(choice, tools, _response_schema(body.response_format))
            prompt = tool_calls.render(tokenizer, [_message(m) for m in body.messages], tools, choice.prefill)
            top = (body.top_logprobs or 0) if body.logprobs else 0
            return await _complete(svc, tenant, session_id, body, base, path, [prompt], top, chat=True,
                                   choice=choice, grammar=grammar)
        except (OpenAIError, UserError, NotFound) as e:
            return _as_openai(e).response()

    @router.post("/completions")
    async def completions(body: CompletionRequest, tenant: str = Depends(tenant_of), svc: Service = Depends(service),
                          named: str | None = Header(None, alias=sessions.CLIENT_HEADER)):
        try:
            base, path = sampling.openai_model(svc, tenant, body.model)
            session_id = client_session(svc, tenant, named, body.user, ROUTE)
            tokenizer = sampling.tokenizer(svc, base)
            grammar = tool_calls.grammar(tool_calls.Choice(), [], _response_schema(body.response_format))
            return await _complete(svc, tenant, session_id, body, base, path, _prompts(body.prompt, tokenizer),
                                   body.logprobs or 0, chat=False, grammar=grammar)
        except (OpenAIError, UserError, NotFound) as e:
            return _as_openai(e).response()

    return router


ROUTE = "openai"  # the session name of a request that names none


def client_session(svc: Service, tenant: str, header: str | None, field, route: str) -> str:
    """The session a request on these routes (or the Anthropic one) is recorded under: the client's own, named by its
    X-Stepwise-Session header, else by `field` (a body's user), else after the route (sessions.client_session)."""
    return sessions.client_session(svc, tenant, sessions.client_name(header, field, route))


def _as_openai(e: Exception) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, NotFound):
        return OpenAIError(404, str(e), param="model", code="model_not_found")
    named = re.match(r"\w+", str(e))  # the engine's checks start with the field they refuse ("min_p must be ...")
    return OpenAIError(400, str(e), param=named[0] if named and named[0] in ChatRequest.model_fields else None)


def _response_schema(response_format: dict | None) -> dict | None:
    """The JSON schema response_format asks the reply to match; None for free text."""
    response_format = response_format or {}
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                   "{a JSON schema object}, \"strict\": true}}", param="response_format")
        # strict or not, the schema is enforced: what OpenAI promises only under strict holds either way.
        return spec["schema"]
    raise OpenAIError(400, f"response_format type {kind!r} is not supported: send 'text', 'json_object' or "
                           "'json_schema'", param="response_format")


def _message(message: ChatMessage) -> dict:
    """A chat message in the shape tool_calls.render takes."""
    out: dict[str, Any] = {"role": message.role, "content": _text(message.content)}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(400, f"message content of type {part.get('type')!r} is not supported; send text",
                              param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _prompts(prompt, tokenizer) -> list[list[int]]:
    """The request's prompts as token lists, whichever of OpenAI's four shapes it came in."""
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if not prompt or not all(prompt):
        raise OpenAIError(400, "prompt is empty: send a text, texts, a token list or token lists", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]


def _max_tokens(body: SamplingFields, chat: bool) -> int:
    chosen = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return (512 if chat else 16) if chosen is None else chosen


async def _complete(svc: Service, tenant: str, session_id: str, body: SamplingFields, base: str, path: str | None,
                    prompts: list[list[int]], top_logprobs: int, chat: bool, choice: tool_calls.Choice | None = None,
                    grammar: str | None = None):
    tokenizer = sampling.tokenizer(svc, base)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    echo, max_tokens = getattr(body, "echo", False), _max_tokens(body, chat)
    asked = getattr(body, "logprobs", None)  # a chat request's is a flag, a completion's a count (or None)
    wants_logprobs = bool(asked) if chat else asked is not None
    if max_tokens == 0 and not echo:
        raise OpenAIError(400, "max_tokens 0 generates nothing: set echo to true to score the prompt", param="max_tokens")
    if body.stream and echo:
        raise OpenAIError(400, "echo is not supported with stream; send stream false to score a prompt", param="echo")
    # max_tokens 0 (score only) is one prefill, as compute_logprobs is: the token it yields is not returned
    # (and, like compute_logprobs's, billed as one sample token).
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=body.temperature, top_p=body.top_p,
                            seed=body.seed, stop=stop or None, top_k=body.top_k or -1, min_p=body.min_p,
                            repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
                            presence_penalty=body.presence_penalty, logit_bias={token_id(t, "logit_bias"): bias for t, bias in (body.logit_bias or {}).items()} or None)
    options = SampleOptions(topk_sample_logprobs=top_logprobs, prompt_logprobs=bool(echo) and wants_logprobs,
                            topk_prompt_logprobs=top_logprobs if echo and wants_logprobs else 0, grammar=grammar)
    request_type = "ChatCompletion" if chat else "Completion"
    completion_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        if len(prompts) > 1:
            raise OpenAIError(400, "stream takes one prompt per request", param="prompt")
        task, queue = start_streaming(svc, tenant, request_type, base, path, prompts[0], body.n, params, options,
                                      session_id=session_id)
        wants_usage = body.stream_options is not None and body.stream_options.include_usage
        usage_of = (lambda results: _usage(prompts, results, max_tokens)) if wants_usage else None
        return StreamingResponse(
            _stream(task, queue, tokenizer, completion_id, created, body.model, body.n, chat, stop or [], usage_of,
                    choice or tool_calls.Choice()),
            media_type="text/event-stream",
        )
    results = await sampling.generate(svc, tenant, request_type, base, path, prompts, body.n, params, options,
                                      session_id=session_id)
    eos = sampling.eos_ids(svc, base)
    choices: list[dict[str, Any]] = []
    for prompt, result in zip(prompts, results):
        for seq in result.sequences:
            visible, finish = visible_tokens(seq, tokenizer, stop or [], eos) if max_tokens else ([], "length")
            text = cut_at_stop(tokenizer.decode(visible), stop or [])
            choice_out = {"index": len(choices), "finish_reason": finish}  # OpenAI's: prompt by prompt, n each
            if chat:
                logprobs = _chat_logprobs(seq, visible, tokenizer, top_logprobs) if wants_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if choice is not None and choice.parse:
                    reply = tool_calls.parse(choice.prefill + text, choice.only_first)
                    if reply.calls:
                        message = {"role": "assistant", "content": reply.content or None, "tool_calls": reply.calls}
                        finish = "tool_calls"
                    else:
                        message["content"] = choice.prefill + text
                choice_out.update(finish_reason=finish, message=message, logprobs=logprobs)
            else:
                logprobs = None
                if wants_logprobs:
                    # Every generated token, the end-of-sequence one too (as vLLM does; the text leaves it
                    # out): lm-eval drops the last entry as the one generated token of a scoring request.
                    generated = list(seq.tokens) if max_tokens else []
                    logprobs = _completion_logprobs((_prompt_entries(prompt, result, tokenizer) if echo else [])
                                                    + _entries(seq, generated, tokenizer, top_logprobs))
                choice_out.update(text=(tokenizer.decode(prompt) if echo else "") + text, logprobs=logprobs)
            choices.append(choice_out)
    return {
        "id": completion_id, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": body.model, "choices": choices, "usage": _usage(prompts, results, max_tokens),
    }


def _usage(prompts: list[list[int]], results: list, max_tokens: int) -> dict:
    """OpenAI's usage object, summed over the prompts; cached_tokens: the prompts' starts the prefix
    cache served (billed all the same)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(seq.tokens) for r in results for seq in r.sequences) if max_tokens else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_prompt_tokens for r in results)}}


def visible_tokens(seq, tokenizer, stop: list[str], eos: set[int]) -> tuple[list[int], str]:
    """The tokens a reader sees (no end-of-sequence token) and OpenAI's finish_reason."""
    tokens = list(seq.tokens)
    if seq.stop_reason == "stop" and tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tokens, "stop" if seq.stop_reason == "stop" else "length"


def cut_at_stop(text: str, stop: list[str]) -> str:
    """OpenAI leaves the stop sequence out of the returned text."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def _entry(tokenizer, token: int, logprob: float | None, alternatives) -> dict:
    """One token's logprob entry: its text, logprob and the most likely alternatives (None: the
    prompt's first token, which nothing predicts)."""
    text = tokenizer.decode([token])
    top = None if alternatives is None else [{"token": tokenizer.decode([t]), "logprob": lp,
                                             "bytes": list(tokenizer.decode([t]).encode())} for t, lp in alternatives]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": top}


def _entries(seq, visible: list[int], tokenizer, top: int) -> list[dict]:
    """The generated tokens' entries."""
    return [_entry(tokenizer, token, seq.logprobs[i], (seq.top_logprobs[i] if seq.top_logprobs else [])[:top])
            for i, token in enumerate(visible)]


def _prompt_entries(prompt: list[int], result, tokenizer) -> list[dict]:
    """The prompt's own entries (echo): the same numbers compute_logprobs gives, None for the first token."""
    tops = result.topk_prompt_logprobs or [None] + [[]] * (len(prompt) - 1)
    return [_entry(tokenizer, token, result.prompt_logprobs[i], tops[i]) for i, token in enumerate(prompt)]


def _chat_logprobs(seq, visible: list[int], tokenizer, top: int) -> dict:
    return {"content": _entries(seq, visible, tokenizer, top)}


def _completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions shape: parallel lists; text_offset is each token's start in `text`."""
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [None if e["top_logprobs"] is None else {a["token"]: a["logprob"] for a in e["top_logprobs"]}
                         for e in entries],
        "text_offset": offsets,
    }


def start_streaming(svc: Service, tenant: str, request_type: str, base: str, path: str | None, prompt: list[int],
                    n: int, params: SamplingParams, options: SampleOptions | None = None, session_id: str | None = None):
    """Start generating `prompt` with each token queued as the decoder makes it: (task, queue) for
    text_deltas. sampling.generate bounds and admits the request now, so bad input is a 4xx before
    the stream starts. The Anthropic route streams through this too."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def on_token(row: int, token: int, logprob: float) -> None:  # on the scheduler thread
        loop.call_soon_threadsafe(queue.put_nowait, (row, token))

    generation = sampling.generate(svc, tenant, request_type, base, path, [prompt], n, params, options, on_token=on_token,
                                   session_id=session_id)
    return asyncio.create_task(generation), queue


async def text_deltas(task, queue, tokenizer, n: int, stop: list[str]):
    """(row, new text) as the decode loop yields tokens (queued by `on_token` from the scheduler
    thread), the stop sequences cut off; text is sent once it decodes whole (a token can end
    mid-character). The Anthropic route streams through this too."""
    sent = [""] * n  # text already sent per row
    tokens: list[list[int]] = [[] for _ in range(n)]
    # Tokens are queued before the task completes, so once the task is done and the queue is
    # empty, every token has been seen.
    while not (task.done() and queue.empty()):
        try:
            row, token = await asyncio.wait_for(queue.get(), timeout=0.05)
        except asyncio.TimeoutError:
            continue
        tokens[row].append(token)
        text = cut_at_stop(tokenizer.decode(tokens[row], skip_special_tokens=True), stop)
        if text.startswith(sent[row]) and len(text) > len(sent[row]) and not text.endswith("\ufffd"):
            yield row, text[len(sent[row]):]
            sent[row] = text


async def _stream(task, queue, tokenizer, completion_id, created, model, n, chat, stop, usage_of, choice):
    """Server-sent events: one chunk per generated token, as the decode loop produces it; with
    `usage_of` (stream_options.include_usage) a last chunk with the usage. A client that goes away
    cancels the generation (its rows leave the decoder at the next step)."""
    try:
        async for event in _events(task, queue, tokenizer, completion_id, created, model, n, chat, stop, usage_of,
                                   choice):
            yield event
    finally:
        task.cancel()


async def _events(task, queue, tokenizer, completion_id, created, model, n, chat, stop, usage_of, choice):
    """With tools, a reply's content streams up to a call's opening; its calls follow once the reply is
    complete (parsed whole, as the non-streamed answer is), as OpenAI's tool_calls deltas: the
    call's id and name, then its arguments."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, delta: dict | str, finish: str | None = None) -> str:
        if chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps({"id": completion_id, "object": kind, "created": created, "model": model,
                                      "choices": [choice]}) + "\n\n"

    def content(text: str) -> dict | str:
        return {"content": text} if chat else text

    if chat:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
    texts, sent = [choice.prefill] * n, [""] * n  # each row's reply so far, and the content streamed of it
    async for row, piece in text_deltas(task, queue, tokenizer, n, stop):
        texts[row] += piece
        ready = tool_calls.streamable(texts[row]) if choice.parse else texts[row]
        if len(ready) > len(sent[row]):
            yield chunk(row, content(ready[len(sent[row]):]))
            sent[row] = ready
    try:
        (result,) = task.result()
    except Exception as e:  # failed while running (already streaming): an error event, then the end
        kind = "invalid_request_error" if isinstance(e, UserError) else "server_error"
        yield "data: " + json.dumps({"error": {"message": redact_paths(str(e)), "type": kind}}) + "\n\n"
        return
    for index, seq in enumerate(result.sequences):
        finish = "stop" if seq.stop_reason == "stop" else "length"
        reply = tool_calls.parse(texts[index], choice.only_first) if choice.parse else tool_calls.Reply(texts[index])
        rest = reply.content or ""
        if rest.startswith(sent[index]) and len(rest) > len(sent[index]):
            yield chunk(index, content(rest[len(sent[index]):]))
        for i, call in enumerate(reply.calls):
            yield chunk(index, {"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                "function": {"name": call["function"]["name"], "arguments": ""}}]})
            yield chunk(index, {"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
        yield chunk(index, {} if chat else "", "tool_calls" if reply.calls else finish)
    if usage_of is not None:  # OpenAI's shape: no choices, the whole request's usage
        yield "data: " + json.dumps({"id": completion_id, "object": kind, "created": created, "model": model,
                                      "choices": [], "usage": usage_of([result])}) + "\n\n"
    yield "data: [DONE]\n\n"
