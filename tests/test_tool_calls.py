"""Tool calls on the chat endpoints (kernel_backend/tool_calls.py): a checkpoint taught to call a calculator is
asked by the official `openai` client and the official `anthropic` SDK (in its own venv); each gets the call,
sends the tool's result back and gets the final answer; a streamed call assembles to the same call; every
request is on the ledger.

The taught checkpoint is the real SmolLM2 (real_model_server): a model that learned to call a tool is the
point. The protocol's edges (the prompt the tools make, tool_choice's forced opening, the 400s, count_tokens)
run on the tiny stand-in (tinker_server): they check what the server does with a request, not what a model
learned. The render and parse round trip needs only the real tokenizer.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

import client_venvs
from conftest import wait_for_venv
from kernel_backend import tool_calls
from client_venvs import client_env
from test_eval_clients import ledger_cursor, ledger_rows
from test_openai import openai_client
from test_service import BASE, train_steps

# The calculator as inspect-ai's openai-api provider declares a @tool function (strict, and no other properties),
# so that the three clients' prompts are the same one the checkpoint was taught on.
CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression and return the number.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The expression."}},
                   "required": ["expression"], "additionalProperties": False},
    "strict": True}}
QUESTION = "What is 17*5+3?"
ARGUMENTS = {"expression": "17*5+3"}
ANSWER = "17*5+3 is 88."


def asked() -> list[dict]:
    return [{"role": "user", "content": QUESTION}]


def answered(call_id: str = "call_1") -> list[dict]:
    """The conversation once the model has called the calculator and the calculator has answered."""
    call = {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": json.dumps(ARGUMENTS)}}
    return asked() + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call_id, "content": "88"}]


def reply_datum(tokenizer, messages: list[dict], reply: str) -> types.Datum:
    """An SFT example: the prompt the server renders for `messages` with the calculator offered, then `reply`
    (weight 1) to the end of the turn."""
    prompt = tool_calls.render(tokenizer, messages, [CALC])
    reply_tokens = tokenizer(reply + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    full = prompt + reply_tokens
    weights = np.zeros(len(full) - 1, np.float32)
    weights[len(prompt) - 1:] = 1.0
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(full[1:], dtype=np.int64), "weights": weights})


@pytest.fixture(scope="module")
def calculator_path(real_model_server, tokenizer) -> str:
    """A sampler checkpoint of the real model taught the two turns: call the calculator, then answer with its result."""
    call = tool_calls.CALL_OPEN + "\n" + json.dumps({"name": "calc", "arguments": ARGUMENTS}) + "\n" + tool_calls.CALL_CLOSE
    data = [reply_datum(tokenizer, asked(), call), reply_datum(tokenizer, answered(), ANSWER)]
    client = tinker.ServiceClient(base_url=real_model_server.base_url, api_key=real_model_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    train_steps(tc, data, steps=8)
    return tc.save_weights_for_sampler("calculator").result().path


def test_render_and_parse_round_trip(tokenizer):
    """A call the server renders into a prompt parses back to the same call; garbled calls stay text."""
    plain = tool_calls.render(tokenizer, asked(), None)
    assert plain == tokenizer.apply_chat_template(asked(), add_generation_prompt=True)["input_ids"]
    text = tokenizer.decode(tool_calls.render(tokenizer, answered(), [CALC]))
    assert '"name": "calc"' in text and "<tools>" in text and "<tool_response>\n88\n</tool_response>" in text
    call_text = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    (call,) = tool_calls.parse(call_text).calls
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    assert tool_calls.parse("<tool_call>{not json</tool_call>").calls == []
    two = tool_calls.parse('ok <tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": {}}')
    assert [c["function"]["name"] for c in two.calls] == ["a", "b"] and two.content == "ok"
    assert len(tool_calls.parse('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}', True).calls) == 1
    assert tool_calls.streamable("The answer <tool_") == "The answer " and tool_calls.streamable("x <tool_call>{") == "x "


def test_the_openai_client_calls_a_tool_and_answers_with_its_result(real_model_server, calculator_path):
    oai = openai_client(real_model_server)
    before = ledger_cursor(real_model_server)
    first = oai.chat.completions.create(model=calculator_path, messages=asked(), tools=[CALC], temperature=0,
                                        max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calc" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert not choice.message.content  # the call is not repeated as text

    # The researcher's side runs the tool and sends its result back.
    result = str(eval(json.loads(call.function.arguments)["expression"]))  # noqa: S307 - our own test's input
    followed = asked() + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = oai.chat.completions.create(model=calculator_path, messages=followed, tools=[CALC], temperature=0,
                                        max_tokens=40)
    assert final.choices[0].finish_reason == "stop" and "88" in final.choices[0].message.content
    assert not final.choices[0].message.tool_calls

    # Streamed, the call arrives as tool_calls deltas that assemble to the same call.
    chunks = list(oai.chat.completions.create(model=calculator_path, messages=asked(), tools=[CALC], temperature=0,
                                              max_tokens=40, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "calc"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == ARGUMENTS
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # tool_choice "none": the tools are offered but the reply is not read for calls.
    untouched = oai.chat.completions.create(model=calculator_path, messages=asked(), tools=[CALC], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert untouched.choices[0].finish_reason == "stop" and not untouched.choices[0].message.tool_calls
    assert "<tool_call>" in untouched.choices[0].message.content

    rows = [r for r in ledger_rows(real_model_server, before) if r["request_type"] == "ChatCompletion"]
    assert len(rows) == 4 and all(r["sample_tokens"] > 0 and r["cost"] > 0 for r in rows)


ANTHROPIC_SCRIPT = '''\
import json, sys
import anthropic

base_url, key, model, question, tool = sys.argv[1:]
client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)
greedy = {"extra_body": {"temperature": 0}}
tools = [json.loads(tool)]
ask = [{"role": "user", "content": question}]
out = {}
first = client.messages.create(model=model, max_tokens=40, messages=ask, tools=tools, **greedy)
out["first"] = first.model_dump()
out["counted"] = client.messages.count_tokens(model=model, messages=ask, tools=tools).input_tokens
with client.messages.stream(model=model, max_tokens=40, messages=ask, tools=tools, **greedy) as stream:
    out["streamed"] = stream.get_final_message().model_dump()
call = next(b for b in first.content if b.type == "tool_use")
result = str(eval(call.input["expression"]))
followed = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
out["final"] = client.messages.create(model=model, max_tokens=40, messages=followed, tools=tools, **greedy).model_dump()
try:
    client.messages.create(model=model, max_tokens=5, messages=ask,
                           tools=[{"type": "web_search_20250305", "name": "web_search"}])
except anthropic.BadRequestError as e:
    out["server_tool"] = e.body
print(json.dumps(out))
'''


def test_the_anthropic_sdk_calls_a_tool_and_answers_with_its_result(real_model_server, calculator_path, tmp_path):
    python = wait_for_venv(client_venvs.client("anthropic"))
    (tmp_path / "tools.py").write_text(ANTHROPIC_SCRIPT)
    tool = {"name": "calc", "description": CALC["function"]["description"],
            "input_schema": CALC["function"]["parameters"]}
    before = ledger_cursor(real_model_server)
    done = subprocess.run([str(python), "tools.py", real_model_server.base_url, real_model_server.api_key,
                           calculator_path, QUESTION, json.dumps(tool)], cwd=tmp_path, env=client_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)

    first = out["first"]
    assert first["stop_reason"] == "tool_use", first
    (use,) = [b for b in first["content"] if b["type"] == "tool_use"]
    assert use["name"] == "calc" and use["input"] == ARGUMENTS and use["id"].startswith("toolu_")
    assert out["counted"] == first["usage"]["input_tokens"]  # count_tokens: the same prompt, tools included
    (streamed,) = [b for b in out["streamed"]["content"] if b["type"] == "tool_use"]
    assert (streamed["name"], streamed["input"]) == (use["name"], use["input"])
    assert out["streamed"]["stop_reason"] == "tool_use"
    final = out["final"]
    assert final["stop_reason"] == "end_turn" and "88" in final["content"][0]["text"]
    assert "web_search_20250305" in out["server_tool"]["error"]["message"]

    rows = [r for r in ledger_rows(real_model_server, before) if r["request_type"] == "Message"]
    assert len(rows) == 3 and all(r["sample_tokens"] > 0 for r in rows)  # count_tokens runs no model: not billed


INSPECT_TASK = '''\
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import tool


@tool
def calc():
    async def execute(expression: str) -> str:
        """Evaluate an arithmetic expression and return the number.

        Args:
            expression: The expression.
        """
        return str(eval(expression))
    return execute


@task
def calculator():
    return Task(dataset=[Sample(input="What is 17*5+3?", target="88")], solver=[use_tools(calc()), generate()],
                scorer=includes(), config=GenerateConfig(max_tokens=40, temperature=0, seed=0))
'''


def test_inspect_ai_runs_a_tool_using_task_against_the_checkpoint(real_model_server, calculator_path, tmp_path):
    """inspect-ai's own agent loop (use_tools, generate) through its openai-api provider: the checkpoint calls
    the tool, inspect runs it and sends the result back, the final answer is scored."""
    python = wait_for_venv(client_venvs.client("inspect-ai"))
    (tmp_path / "calculator.py").write_text(INSPECT_TASK)
    inspect = str(python.with_name("inspect"))
    env = client_env(LOCAL_API_KEY=real_model_server.api_key, LOCAL_BASE_URL=real_model_server.base_url + "/v1")
    before = ledger_cursor(real_model_server)
    done = subprocess.run([inspect, "eval", "calculator.py", "--model", f"openai-api/local/{calculator_path}",
                           "--log-dir", "logs", "--display", "plain"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (log,) = (tmp_path / "logs").glob("*.eval")
    report = json.loads(subprocess.run([inspect, "log", "dump", str(log)], cwd=tmp_path, env=env, capture_output=True,
                                       text=True, timeout=120).stdout)
    assert report["status"] == "success", report.get("error")
    (sample,) = report["samples"]
    calls = [c for m in sample["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert [(c["function"], c["arguments"]) for c in calls] == [("calc", ARGUMENTS)]
    assert [m["content"] for m in sample["messages"] if m["role"] == "tool"] == ["88"]
    assert report["results"]["scores"][0]["metrics"]["accuracy"]["value"] == 1.0
    rows = [r for r in ledger_rows(real_model_server, before) if r["request_type"] == "ChatCompletion"]
    assert len(rows) == 2  # the call, then the answer


# ---- the protocol's edges, on the tiny stand-in --------------------------------------------------------------


def test_tools_and_tool_choice_shape_the_prompt(tinker_server, tokenizer):
    """Offered tools lengthen the prompt by what the template writes; "required" and a named function add the
    call's opening, which the model continues; "none" offers the same tools."""
    oai = openai_client(tinker_server)

    def prompt_tokens(**kwargs) -> int:
        reply = oai.chat.completions.create(model=BASE, messages=asked(), max_tokens=1, **kwargs)
        return reply.usage.prompt_tokens

    plain, offered = prompt_tokens(), prompt_tokens(tools=[CALC])
    assert plain == len(tool_calls.render(tokenizer, asked(), None))
    assert offered == len(tool_calls.render(tokenizer, asked(), [CALC])) > plain + 50
    assert prompt_tokens(tools=[CALC], tool_choice="none") == offered
    opening = len(tokenizer("<tool_call>\n", add_special_tokens=False)["input_ids"])
    assert prompt_tokens(tools=[CALC], tool_choice="required") == offered + opening
    named = prompt_tokens(tools=[CALC], tool_choice={"type": "function", "function": {"name": "calc"}})
    assert named > offered + opening
    # A conversation with a call and its result is taken as it is rendered.
    reply = oai.chat.completions.create(model=BASE, messages=answered(), tools=[CALC], max_tokens=1)
    assert reply.usage.prompt_tokens == len(tool_calls.render(tokenizer, answered(), [CALC]))


@pytest.mark.parametrize("change, needle", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0] is not a function tool"),
    ({"tools": [CALC, CALC]}, "two tools are named 'calc'"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice 'sometimes'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
    ({"functions": [CALC["function"]]}, "deprecated names: send tools"),
    ({"messages": asked() + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}]}]}, "not valid JSON"),
])
def test_bad_tool_requests_answer_400_and_name_the_field(tinker_server, change, needle):
    body = {"model": BASE, "messages": asked(), "tools": [CALC], "max_tokens": 1, **change}
    before = ledger_cursor(tinker_server)
    answer = httpx.post(tinker_server.base_url + "/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {tinker_server.api_key}"}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert needle in answer.json()["error"]["message"]
    assert ledger_rows(tinker_server, before) == []  # refused before any work: nothing billed


def test_anthropic_count_tokens_and_refusals(tinker_server, tokenizer):
    headers = {"x-api-key": tinker_server.api_key, "anthropic-version": "2023-06-01"}
    tool = {"name": "calc", "description": CALC["function"]["description"],
            "input_schema": CALC["function"]["parameters"]}
    body = {"model": BASE, "messages": asked(), "tools": [tool]}
    counted = httpx.post(tinker_server.base_url + "/v1/messages/count_tokens", json=body, headers=headers).json()
    assert counted == {"input_tokens": len(tool_calls.render(tokenizer, asked(), [CALC]))}
    for change, needle in (({"tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among"),
                           ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                            "'image' are not supported"),
                           ({"messages": [{"role": "assistant", "content": [
                               {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]}, "tool_result blocks")):
        answer = httpx.post(tinker_server.base_url + "/v1/messages", json={**body, "max_tokens": 1, **change},
                            headers=headers)
        assert answer.status_code == 400 and needle in answer.json()["error"]["message"], answer.text
        assert "<server path>" not in answer.text
