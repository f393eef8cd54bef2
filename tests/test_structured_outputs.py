"""Constrained decoding (kernel_backend/engine/constraints.py, kernel_backend/grammars.py): a grammar's allowed
tokens mask a row's logits, so what the schema promises holds every time.

In the engine, on the tiny random stand-in at temperature 1 (a model that writes noise: whatever it outputs
under a grammar is the mask's doing): constrained rows validate, rows without a grammar in the same batch draw
what they draw alone, logprobs are the model's own, a grammar compiles once, bad schemas are refused.
Through the real openai and anthropic clients: response_format, .parse(), forced, required and strict tool calls,
a mixed batch, the 400s: on the stand-in for the mechanics, and on the real base model at temperature 1 for
"every reply validates" where a model's own strings have to finish.
"""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest

import client_venvs
from client_venvs import client_env
from conftest import wait_for_venv
from kernel_backend import grammars, tool_calls
from kernel_backend.engine import constraints
from kernel_backend.errors import UserError
from kernel_backend.types import SampleOptions, SamplingParams
from test_eval_clients import ledger_cursor, ledger_rows
from test_openai import openai_client
from test_service import BASE

# A schema a random model completes within a few dozen tokens: bounded values only.
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "color": {"enum": ["red", "green", "blue"]}},
         "required": ["ok", "n", "color"], "additionalProperties": False}


def _sample(engine, prompt, n, params, grammar=None):
    return engine.sample_request(None, prompt, n, params, SampleOptions(grammar=grammar))


def test_constrained_rows_validate_beside_unconstrained_ones(engine, tokenizer):
    prompt = tokenizer("Answer in JSON:", add_special_tokens=False)["input_ids"]
    grammar = grammars.json_grammar(SMALL, "schema")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    alone = engine.run_requests([_sample(engine, prompt, 4, params)])[0]
    constrained, free = engine.run_requests([_sample(engine, prompt, 8, params, grammar),
                                             _sample(engine, prompt, 4, params)])
    for seq in constrained.sequences:
        assert seq.stop_reason == "stop"  # the grammar completed: the row stopped
        jsonschema.validate(json.loads(tokenizer.decode(seq.tokens)), SMALL)
    # Rows without a grammar draw exactly what they draw alone: the mask touches constrained rows only.
    assert [s.tokens for s in free.sequences] == [s.tokens for s in alone.sequences]
    # ...and they are noise, which the grammar's rows are not: the test above is the mask's doing.
    assert not any(tokenizer.decode(s.tokens).startswith('{"') for s in free.sequences)


def test_logprobs_are_the_models_own(engine, tokenizer):
    prompt = tokenizer("JSON:", add_special_tokens=False)["input_ids"]
    result = engine.run_requests([_sample(engine, prompt, 2, SamplingParams(max_tokens=30, temperature=1.0, seed=3),
                                          grammars.json_grammar(SMALL, "schema"))])[0]
    for seq in result.sequences:
        recomputed = engine.compute_logprobs(None, prompt + seq.tokens)[len(prompt):]
        assert recomputed == pytest.approx(seq.logprobs, abs=1e-3)
        # Under the mask the drawn tokens would have had probability ~1 where the grammar forces them; the
        # model's own logprobs of this random model's are far below that.
        assert min(seq.logprobs) < -5


def test_greedy_is_masked_too_and_a_grammar_compiles_once(engine, tokenizer):
    prompt = tokenizer("Say yes or no:", add_special_tokens=False)["input_ids"]
    grammar = 'start: "yes" | "no"\n'
    before = engine.grammars().compiles
    for _ in range(2):
        (seq,) = engine.run_requests([_sample(engine, prompt, 1, SamplingParams(max_tokens=8, temperature=0.0),
                                              grammar)])[0].sequences
        assert tokenizer.decode(seq.tokens) in ("yes", "no") and seq.stop_reason == "stop"
    assert engine.grammars().compiles == before + 1


def test_compiled_grammars_are_a_bounded_cache(engine):
    compiler = engine.grammars()
    many = [f'start: "item {i}"\n' for i in range(constraints.CACHE_SIZE + 1)]
    for grammar in many:
        compiler.compile(grammar)
    before = compiler.compiles
    compiler.compile(many[-1])  # recent: cached
    assert compiler.compiles == before
    compiler.compile(many[0])  # the least recently used was dropped when the last came in: compiled again
    assert compiler.compiles == before + 1


def test_end_of_sequence_only_where_the_grammar_accepts(engine, tokenizer):
    """A grammar that may go on after it accepts: the row stops at its end-of-sequence token, never before."""
    prompt = tokenizer("Digits:", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    result = engine.run_requests([_sample(engine, prompt, 8, params, "start: /[0-9]{2,6}/\n")])[0]
    for seq in result.sequences:
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        assert text.isdigit() and 2 <= len(text) <= 6, text


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"$ref": "#/definitions/missing"}, "/definitions/missing"),
    ({"type": "string", "minLength": "three"}, "minLength"),
])
def test_a_schema_that_cannot_be_enforced_names_why(schema, named):
    with pytest.raises(UserError, match=named):
        grammars.json_grammar(schema, "response_format.json_schema.schema")


def test_grammar_size_is_bounded_before_any_work(engine, tokenizer):
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(UserError, match="bytes as a grammar"):
        grammars.json_grammar(huge, "schema")
    with pytest.raises(UserError, match="bytes as a grammar"):  # the engine bounds what reaches it another way too
        engine.sample_request(None, [1, 2, 3], 1, SamplingParams(max_tokens=4), SampleOptions(grammar="x" * 70000))


def test_the_vllm_sampler_refuses_a_grammar_it_cannot_end_rather_than_ignore_it():
    from kernel_backend.execution.vllm_sampler import VllmSampling  # the vLLM sampler's module, not vLLM

    # vLLM's structured outputs take a grammar (tests/test_vllm.py), but end it with end-of-sequence, which stop=[]
    # does not stop at.
    options = SampleOptions(grammar='start: "a"\n')
    VllmSampling.check_options(options, SamplingParams(max_tokens=4))
    with pytest.raises(UserError, match=r"stop=\[\] is not supported by this server's sampler \(vLLM"):
        VllmSampling.check_options(options, SamplingParams(max_tokens=4, stop=[]))


# ---- through the real clients -------------------------------------------------------------------------------

# Tools whose arguments a random model completes in a few tokens (the stand-in's tests), and the calculator the
# real model fills in (a free string: only a model that writes text closes it).
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The weather for the next days.",
            "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                           "required": ["unit", "days"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "alarm", "description": "Set an alarm.", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour", "loud"], "additionalProperties": False}}}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 20}},
                       "required": ["expression"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# Room for a reply of the schemas above whatever tokens the model picks (a string of 20 emoji is ~60 tokens): the
# guarantee holds for a reply that finishes within max_tokens; rows stop as soon as their grammar completes.
ROOM = 128

ASK = [{"role": "user", "content": "Who is the main character of your favourite book? Answer in JSON."}]


class Mood(pydantic.BaseModel):
    happy: bool
    level: int = pydantic.Field(ge=0, le=9)
    colour: Literal["red", "green", "blue"]


def _arguments_valid(call, tools) -> None:
    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_response_format_json_schema_and_object_validate_every_time(tinker_server):
    oai = openai_client(tinker_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
    reply = oai.chat.completions.create(model=BASE, messages=ASK, n=8, temperature=1.0, max_tokens=40,
                                        response_format=fmt, logprobs=True)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SMALL)
        # The model's own logprobs: a random model gives every token about 1/49152 (log ~ -10.8), forced ones too;
        # the masked, renormalised distribution would give a forced token (the `": ` after a key) exactly 0.
        assert max(entry.logprob for entry in choice.logprobs.content) < -2
    reply = oai.chat.completions.create(model=BASE, messages=ASK, n=4, temperature=1.0, max_tokens=24,
                                        response_format={"type": "json_object"})
    for choice in reply.choices:  # noise inside, but a JSON object while it is within max_tokens
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    completion = oai.completions.create(model=BASE, prompt="JSON:", n=4, temperature=1.0, max_tokens=40,
                                        extra_body={"response_format": fmt})
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.text), SMALL)


def test_parse_with_a_pydantic_model(tinker_server):
    oai = openai_client(tinker_server)
    for _ in range(4):
        parsed = oai.chat.completions.parse(model=BASE, messages=ASK, temperature=1.0, max_tokens=40,
                                            response_format=Mood)
        assert isinstance(parsed.choices[0].message.parsed, Mood)


def test_forced_and_required_tool_calls_validate_every_time(tinker_server):
    oai = openai_client(tinker_server)
    tools = [FORECAST, ALARM]
    named = oai.chat.completions.create(model=BASE, messages=ASK, tools=tools, n=8, temperature=1.0, max_tokens=40,
                                        tool_choice={"type": "function", "function": {"name": "alarm"}})
    required = oai.chat.completions.create(model=BASE, messages=ASK, tools=tools, n=8, temperature=1.0, max_tokens=40,
                                           tool_choice="required")
    for choice in named.choices + required.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        _arguments_valid(call, tools)
    assert {c.message.tool_calls[0].function.name for c in named.choices} == {"alarm"}
    # Streamed: the same enforced call, as tool_calls deltas.
    chunks = list(oai.chat.completions.create(model=BASE, messages=ASK, tools=tools, temperature=1.0, max_tokens=40,
                                              tool_choice="required", stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    arguments = json.loads("".join(p.function.arguments or "" for p in pieces))
    (tool,) = [t for t in tools if t["function"]["name"] == pieces[0].function.name]
    jsonschema.validate(arguments, tool["function"]["parameters"])


def test_strict_tools_hold_when_the_model_calls_them(tinker_server, tokenizer):
    """tool_choice auto with a strict tool: the reply is text or a call; a call's arguments validate. The random
    stand-in rarely opens a call by itself, so a grammar-level check (the same grammar) covers the call's side."""
    strict = {**FORECAST, "function": {**FORECAST["function"], "strict": True}}
    oai = openai_client(tinker_server)
    reply = oai.chat.completions.create(model=BASE, messages=ASK, tools=[strict], n=4, temperature=1.0, max_tokens=12)
    for choice in reply.choices:
        for call in choice.message.tool_calls or []:
            _arguments_valid(call, [strict])
        assert "<tool_call>" not in (choice.message.content or "")  # an opened call is always a valid one
    grammar = tool_calls.grammar(tool_calls.choice("auto", [strict]), [strict])
    matcher = constraints.Compiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}).compile(grammar).matcher

    def accepts(text: str) -> bool:
        probe = matcher.deep_copy()
        return all(probe.consume_token(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])

    assert accepts('Sure. <tool_call>\n{"name": "forecast", "arguments": {"unit": "c", "days": 3}}\n</tool_call>')
    assert accepts("No call, a < b and <tool_ here.")
    assert not accepts('<tool_call>\n{"name": "forecast", "arguments": {"unit": "k", "days": 3}}')
    assert not accepts('<tool_call>\n{"name": "forecast", "arguments": {"days": 9}}')


def test_response_format_with_tools_is_the_json_or_a_valid_call(tinker_server):
    oai = openai_client(tinker_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}}
    reply = oai.chat.completions.create(model=BASE, messages=ASK, tools=[ALARM], response_format=fmt, n=8,
                                        temperature=1.0, max_tokens=40)
    for choice in reply.choices:
        if choice.message.tool_calls:
            _arguments_valid(choice.message.tool_calls[0], [ALARM])
        else:
            jsonschema.validate(json.loads(choice.message.content), SMALL)


def test_a_mixed_batch_of_constrained_and_free_requests(tinker_server):
    oai = openai_client(tinker_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL}}
    results, errors = {}, []

    def run(name: str, **kwargs) -> None:
        try:
            results[name] = oai.chat.completions.create(model=BASE, messages=ASK, temperature=1.0, n=4, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=("json",), kwargs={"response_format": fmt, "max_tokens": 40}),
               threading.Thread(target=run, args=("free",), kwargs={"max_tokens": 24, "seed": 5}),
               threading.Thread(target=run, args=("call",), kwargs={"tools": [ALARM], "tool_choice": "required",
                                                                   "max_tokens": 40})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for choice in results["json"].choices:
        jsonschema.validate(json.loads(choice.message.content), SMALL)
    for choice in results["call"].choices:
        _arguments_valid(choice.message.tool_calls[0], [ALARM])
    alone = oai.chat.completions.create(model=BASE, messages=ASK, temperature=1.0, n=4, max_tokens=24, seed=5)
    assert [c.message.content for c in results["free"].choices] == [c.message.content for c in alone.choices]


@pytest.mark.parametrize("change, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentRequired": {"a": ["b"]}}}}}, "dependentRequired"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}},
     "/$defs/gone"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs {\"json_schema\""),
    ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "dependentSchemas": {}}}}], "tool_choice": "required"}, "tools"),
])
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_it(tinker_server, change, needle):
    body = {"model": BASE, "messages": ASK, "max_tokens": 4, **change}
    before = ledger_cursor(tinker_server)
    answer = httpx.post(tinker_server.base_url + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {tinker_server.api_key}"}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert needle in error["message"] and error["param"] in ("response_format", "tools")
    assert ledger_rows(tinker_server, before) == []  # refused before any work: nothing billed


def json_schema_replies_validate(oai) -> None:
    """Eight replies under a strict json_schema at temperature 1 (the base model): each ends and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = oai.chat.completions.create(model=BASE, messages=ASK, n=8, temperature=1.0, max_tokens=ROOM,
                                        response_format=fmt)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_the_real_model_under_json_schema_parse_and_forced_calls(real_model_server):
    """The base model at temperature 1: every reply validates, through the openai client."""
    oai = openai_client(real_model_server)
    json_schema_replies_validate(oai)
    for _ in range(2):
        parsed = oai.chat.completions.parse(model=BASE, messages=ASK, temperature=1.0, max_tokens=ROOM,
                                            response_format=Mood).choices[0].message.parsed
        assert isinstance(parsed, Mood)
    question = [{"role": "user", "content": "What is 17*5+3?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "calc"}}):
        reply = oai.chat.completions.create(model=BASE, messages=question, tools=[CALC, FORECAST], n=8,
                                            temperature=1.0, max_tokens=ROOM, tool_choice=tool_choice)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice.message.content
            _arguments_valid(choice.message.tool_calls[0], [CALC, FORECAST])


ANTHROPIC_FORCED = '''\
import json, sys
import anthropic

base_url, key, model, tools = sys.argv[1:]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
ask = [{"role": "user", "content": "What is 17*5+3?"}]
out = {"any": [], "tool": []}
for _ in range(6):
    for kind, choice in (("any", {"type": "any"}), ("tool", {"type": "tool", "name": "calc"})):
        reply = client.messages.create(model=model, max_tokens=128, messages=ask, tools=json.loads(tools),
                                       tool_choice=choice, extra_body={"temperature": 1.0})
        out[kind].append(reply.model_dump())
with client.messages.stream(model=model, max_tokens=128, messages=ask, tools=json.loads(tools),
                            tool_choice={"type": "any"}, extra_body={"temperature": 1.0}) as stream:
    out["streamed"] = stream.get_final_message().model_dump()
try:
    client.messages.create(model=model, max_tokens=4, messages=ask, tool_choice={"type": "any"}, tools=[
        {"name": "f", "input_schema": {"type": "object", "dependentRequired": {"a": ["b"]}}}])
except anthropic.BadRequestError as e:
    out["refused"] = e.body
print(json.dumps(out))
'''


def test_anthropic_forced_tool_use_validates_every_time(real_model_server, tmp_path):
    python = wait_for_venv(client_venvs.client("anthropic"))
    (tmp_path / "forced.py").write_text(ANTHROPIC_FORCED)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (CALC, FORECAST)]
    done = subprocess.run([str(python), "forced.py", real_model_server.base_url, real_model_server.api_key, BASE,
                           json.dumps(tools)], cwd=tmp_path, env=client_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    schemas = {t["name"]: t["input_schema"] for t in tools}
    for kind in ("any", "tool"):
        for message in out[kind]:
            assert message["stop_reason"] == "tool_use", message
            (use,) = [b for b in message["content"] if b["type"] == "tool_use"]
            jsonschema.validate(use["input"], schemas[use["name"]])
            assert kind == "any" or use["name"] == "calc"
    (use,) = [b for b in out["streamed"]["content"] if b["type"] == "tool_use"]
    jsonschema.validate(use["input"], schemas[use["name"]])
    assert "dependentRequired" in out["refused"]["error"]["message"]
