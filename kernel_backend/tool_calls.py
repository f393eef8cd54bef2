"""Tool calls in chat: how a tool-using conversation becomes the model's prompt, and how the model's
reply becomes text and tool calls. The OpenAI and Anthropic routes (kernel_backend/api/) speak
through it, each converting its own wire shape into the one below.

The conversation is in Hugging Face's chat shape, which OpenAI's is close to:

    {"role": "assistant", "content": "...", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "calc", "arguments": {"expression": "17*5+3"}}}]}
    {"role": "tool", "tool_call_id": "call_1", "content": "88"}

and tools are JSON schemas in OpenAI's function shape, {"type": "function", "function": {"name",
"description", "parameters"}}.

A chat template that knows tools (it reads `tools` and writes Hermes' <tool_call> blocks: Qwen2.5,
Hermes, SmolLM3) renders them itself, `apply_chat_template(messages, tools=...)`. A template without
tools, SmolLM2's among them, gets the same Hermes format written into the messages before the
template sees them (FALLBACK), so every model can be taught one format:

    system:     <its text>  + the tools as JSON lines inside <tools></tools>, and how to call one
    assistant:  <its text>  + <tool_call>{"name": ..., "arguments": {...}}</tool_call> per call
    tool:       a user turn: <tool_response>...</tool_response> per result (consecutive results, one turn)

Replies are parsed for <tool_call> blocks; a block that is not JSON with a "name" stays text, so a
call the model garbled is seen, never dropped. A template that writes calls in another format
(Llama 3.1's bare JSON, Mistral's [TOOL_CALLS]) is refused with a 400 that says so.

tool_choice: "auto" offers the tools and parses the reply; "none" offers them (as vLLM does) but
parses nothing; "required" and a named function start the reply with the call's opening (`<tool_call>`,
and the name) as a prefill the model continues under a grammar (`grammar`, enforced while decoding:
engine/constraints.py): its arguments are JSON that validates against the tool's parameters, every time,
and the call closes. Under "auto", when a tool is declared `strict` (OpenAI's promise that a call's
arguments match the schema) or response_format asks for JSON, the reply is under a grammar too: a call the
model chooses to make is held to its tool's schema the same way. Otherwise calls are parsed from what the model
wrote, and one that is not valid JSON comes back as text. A constrained reply holds one call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kernel_backend import grammars
from kernel_backend.errors import UserError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_END = re.compile(r"\s*(?:" + re.escape(CALL_CLOSE) + r"|$)")  # after a call's JSON: its close, or the end
_JSON = json.JSONDecoder()
_SPACE = re.compile(r"\s*")

FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions you can call are "
    "described inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write its name and "
    "arguments as JSON inside <tool_call></tool_call>:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class Choice:
    """What the request's tool_choice asks of the reply: parse it for calls, and what it starts with."""

    parse: bool = False
    prefill: str = ""  # the reply's forced opening, continued by the model
    only_first: bool = False  # parallel calls off: the first call is kept
    forced: str | None = None  # "required", or the name of the function the reply must call


@dataclass
class Reply:
    content: str
    calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls, arguments as a JSON string


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_tools(tools: list[dict]) -> list[dict]:
    """The request's tools in OpenAI's function shape, or a UserError that names what is wrong."""
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise UserError(f"tools[{i}] is not a function tool: send {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"description\": ..., \"parameters\": {JSON schema}}}")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise UserError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'; got {name!r}")
        if name in names:
            raise UserError(f"tools[{i}]: two tools are named {name!r}; give each tool its own name")
        if not isinstance(function.get("parameters", {}), dict):
            raise UserError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.add(name)
    return tools


def choice(tool_choice, tools: list[dict], parallel: bool = True) -> Choice:
    """tool_choice ("auto", "none", "required" or {"type": "function", "function": {"name"}}) as a Choice."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise UserError("tool_choice needs tools: send the tools the model may call, or leave tool_choice out")
        return Choice()
    if tool_choice in (None, "auto"):
        return Choice(parse=True, only_first=not parallel)
    if tool_choice == "none":
        return Choice()
    if tool_choice == "required":
        return Choice(parse=True, prefill=CALL_OPEN + "\n", only_first=not parallel, forced="required")
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise UserError(f"tool_choice {tool_choice!r} is not one of 'auto', 'none', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise UserError(f"tool_choice names {name!r}, which is not among the tools sent")
    return Choice(parse=True, prefill=CALL_OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": ',
                  only_first=True, forced=name)


# Free text without a call's opening, and free text up to one (lazy: it ends at the first `<tool_call>`, so what
# follows the first opening is the call, never more free text).
_TEXT_OR_CALL = ("start: TEXT | before \"\\n\" call {close}\n"
                 "TEXT: /(?s:.*)/ & ~/(?s:.*" + re.escape(CALL_OPEN) + ".*)/\n"
                 "before[lazy]: /(?s:.*)" + re.escape(CALL_OPEN) + "/\n")


def grammar(choice: Choice, tools: list[dict], content: dict | None = None) -> str | None:
    """The grammar the reply (after choice.prefill) must match, or None when it is free: a forced call's arguments
    validate against its tool's parameters; under "auto", when a tool is strict or `content` (a JSON schema:
    response_format's) asks for JSON, a call's arguments validate against its tool's, and a reply that is not a call
    is `content`'s JSON (or free text). A UserError names a schema that cannot be enforced."""
    close = grammars.literal("\n" + CALL_CLOSE)
    if choice.forced is not None and choice.forced != "required":
        (i, tool), = [(i, t) for i, t in enumerate(tools) if t["function"]["name"] == choice.forced]
        return grammars.check(f'start: args "}}" {close}\nargs: {_arguments(tool, i)}\n', f"tools[{i}]")
    if choice.forced == "required":
        return grammars.check(f"start: call {close}\n" + _call_rules(tools), "tools")
    strict = choice.parse and any(t["function"].get("strict") for t in tools)
    if content is None and not strict:
        return None
    value = grammars.json_rule(content, "response_format's schema") if content is not None else None
    if not choice.parse:
        return grammars.check(f"start: value\nvalue: {value}\n", "response_format's schema")
    calls = _call_rules(tools)
    if value is not None:
        opening = grammars.literal(CALL_OPEN + "\n")
        return grammars.check(f"start: value | {opening} call {close}\nvalue: {value}\n" + calls,
                              "response_format's schema with the tools")
    return text_or_call(tools, "the strict tools")


def text_or_call(tools: list[dict], what: str = "tools") -> str:
    """The grammar of a reply that is plain text, or text and then one call (Hermes' block) whose arguments
    validate against its tool's parameters: once the reply opens `<tool_call>`, the call is valid and closes.
    What a strict tool promises under "auto", and what the rl recipe's `constrain_tool_calls` holds each
    policy turn to (workbench/recipes/episodes.py)."""
    close = grammars.literal("\n" + CALL_CLOSE)
    return grammars.check(_TEXT_OR_CALL.format(close=close) + _call_rules(tools), what)


def _call_rules(tools: list[dict]) -> str:
    """Lark rules of `call`: one call's JSON, `{"name": ..., "arguments": {...}}`, of any of the tools, its arguments
    held to the tool's parameters (strict or not: a reply under a grammar gets no call that could fail)."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        start = grammars.literal('{"name": ' + json.dumps(tool["function"]["name"]) + ', "arguments": ')
        rules.append(f'call_{i}: {start} args_{i} "}}"\nargs_{i}: {_arguments(tool, i)}\n')
        names.append(f"call_{i}")
    return "call: " + " | ".join(names) + "\n" + "".join(rules)


def _arguments(tool: dict, index: int) -> str:
    """The rule body of a call's arguments: a JSON object valid against the tool's parameters."""
    return grammars.json_rule(tool["function"].get("parameters") or {"type": "object"},
                              f"tools[{index}].function.parameters")


def knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself (and writes Hermes' <tool_call>)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "tools" not in template:
        return False
    if CALL_OPEN not in template:
        raise UserError("this model's chat template writes tool calls in a format this server does not parse yet "
                        "(it parses Hermes' <tool_call> blocks); send the request without tools")
    return True


def render(tokenizer, messages: list[dict], tools: list[dict] | None, prefill: str = "",
           add_generation_prompt: bool = True) -> list[int]:
    """The prompt's tokens: the conversation with the tools offered, the assistant's turn opened (and
    started with `prefill`); without add_generation_prompt, the conversation alone (a training example's)."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    return tokenizer(text + prefill, add_special_tokens=False)["input_ids"]


def render_text(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True) -> str:
    """The conversation as the template writes it, the tools offered (by the template, or FALLBACK's way)."""
    if tools and knows_tools(tokenizer):
        return tokenizer.apply_chat_template(_arguments_as_objects(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(fallback_messages(messages, tools), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation in plain text turns, the Hermes format written in (for templates without tools)."""
    out: list[dict] = []
    if tools:
        listed = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(_offered(t), ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": (messages[0]["content"] or "") + "\n\n" + listed})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listed})
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("from_tool"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "from_tool": True})
            continue
        content = message.get("content") or ""
        calls = [_call_text(c) for c in message.get("tool_calls") or []]
        out.append({"role": message["role"], "content": "\n".join(([content] if content else []) + calls)})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _offered(tool: dict) -> dict:
    """What the model reads of a tool: its name, description and parameters. The same tool sent by any
    client (OpenAI's with `strict`, Anthropic's as input_schema) makes the same prompt."""
    function = {k: tool["function"][k] for k in ("name", "description", "parameters") if k in tool["function"]}
    return {"type": "function", "function": function}


def _call_text(call: dict) -> str:
    function = call["function"]
    return CALL_OPEN + "\n" + json.dumps({"name": function["name"], "arguments": _as_object(function["arguments"])},
                                         ensure_ascii=False) + "\n" + CALL_CLOSE


def _as_object(arguments) -> dict:
    """A call's arguments as a JSON object (OpenAI sends them as a JSON string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise UserError(f"a tool call's arguments are not valid JSON ({e}): send a JSON object as a string") from None
    if not isinstance(arguments, dict):
        raise UserError("a tool call's arguments must be a JSON object")
    return arguments


def _arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Templates that know tools read each call's arguments as a mapping."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def parse(text: str, only_first: bool = False) -> Reply:
    """A reply's text and its tool calls (<tool_call> blocks that are JSON with a name; an unclosed last
    block counts, as a reply cut at a stop token ends one). A block's JSON is read whole, so a `</tool_call>`
    inside one of its strings does not cut it short."""
    calls: list[dict] = []
    kept: list[str] = []
    at = search = 0
    while (start := text.find(CALL_OPEN, search)) >= 0:
        search = start + len(CALL_OPEN)
        found = _call_at(text, search)
        if found is None or (only_first and calls):
            continue
        call, search = found
        kept.append(text[at:start])
        at = search
        calls.append(call)
    kept.append(text[at:])
    return Reply(content="".join(kept).strip() if calls else text, calls=calls)


def _call_at(text: str, at: int) -> tuple[dict, int] | None:
    """The call whose JSON starts at `at` (after whitespace), and where its block ends; None if it is not one."""
    try:
        space = _SPACE.match(text, at)  # (always a match, perhaps empty)
        value, end = _JSON.raw_decode(text, space.end() if space else at)
    except json.JSONDecodeError:
        return None
    close = _CALL_END.match(text, end)
    call = _parsed_call(value) if close is not None else None
    return (call, close.end()) if call is not None and close is not None else None


def _parsed_call(value) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def streamable(text: str) -> str:
    """How much of a reply's text so far can be streamed as content: everything before a call's
    opening, less a tail that may be the start of one."""
    cut = text.find(CALL_OPEN)
    if cut >= 0:
        return text[:cut]
    for keep in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-keep:]):
            return text[:-keep]
    return text
