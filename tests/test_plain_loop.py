"""docs/workbench.md's "A tool-using loop of your own", run as printed against the local backend of the test
session (the tiny stand-in, as tests/test_docs.py runs the page), then checked: the demonstration's loss falls, and
the loop renders what the recipe renders. Its `play`, fed the demonstration's own assistant turns as if sampled,
gives token for token the sequence `common.chat_datum` (the sft recipe's rendering of that conversation) gives and
the one `episodes.run_episodes` (the rl recipe's) plays from the same turns, its policy tokens exactly the
demonstration's weighted ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from servers import REPO

REPLAY = '''
from types import SimpleNamespace


class Replay:
    """A sampler that answers each turn with the next of `turns` (token lists), as the SDK's future would."""

    def __init__(self, turns):
        self.turns = list(turns)

    def sample(self, prompt, num_samples, params, **kwargs):
        tokens = self.turns.pop(0)
        response = SimpleNamespace(sequences=[SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens))])
        return SimpleNamespace(result=lambda: response)


def trained_turns(datum):
    """A demonstration datum's tokens, the positions it trains, and those positions' runs (its assistant turns)."""
    rendered = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].data[-1])]
    weights = list(datum.loss_fn_inputs["weights"].data)
    mine = [i + 1 for i in range(len(weights)) if weights[i] > 0]
    turns, run = [], []
    for i in range(len(rendered)):
        if i in mine:
            run.append(rendered[i])
        elif run:
            turns.append(run)
            run = []
    return rendered, mine, turns + ([run] if run else [])
'''

CHECK = REPLAY + '''
import numpy as np
from workbench.recipes import episodes


assert losses[-1] < losses[0], losses
rendered, mine, turns = trained_turns(tools.sft_datum(tok, demo, calculator))
assert len(turns) == 2, turns  # the call, the answer

by_hand = play(Replay(turns))
env = episodes.ToolEnv(question[0]["content"], check=lambda text: float("88" in text), tools=calculator)
(by_recipe,) = episodes.run_episodes(Replay(turns), tok, [env], tools=calculator, max_turns=3, max_tokens=48)
assert by_hand.tokens == by_recipe.tokens, (tok.decode(by_hand.tokens), tok.decode(by_recipe.tokens))
assert [s.role for s in by_hand.segments] == ["prompt", "policy", "observation", "policy"]
assert by_hand.tokens == rendered[:len(by_hand.tokens)] and len(rendered) - len(by_hand.tokens) <= 1, \\
    (tok.decode(by_hand.tokens), tok.decode(rendered))
assert (by_hand.reward, by_recipe.reward) == (1.0, 1.0)
assert tok.decode(by_hand.tokens).count("<|im_start|>system") == 1
datum = by_hand.datum(1.0)
assert [i + 1 for i, a in enumerate(datum.loss_fn_inputs["advantages"].data) if a] == \\
    [i for i in mine if i < len(by_hand.tokens)]
print("PLAIN-LOOP-OK")
'''


def test_the_plain_loop_in_the_docs_learns_and_renders_as_the_recipes_do(tinker_server, stepwise_home):
    page = (REPO / "docs" / "workbench.md").read_text()
    section = page.split("### A tool-using loop of your own", 1)[1].split("\n### ", 1)[0]
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(snippets) == 1
    env = {**os.environ, "STEPWISE_HOME": str(stepwise_home)}
    env.pop("STEPWISE_BASE_URL", None)
    done = subprocess.run([sys.executable, "-c", snippets[0] + CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "PLAIN-LOOP-OK" in done.stdout, (done.stdout + done.stderr)[-4000:]


# Qwen2.5-Instruct's chat template (its tokenizer_config.json), a template that renders tools itself (tool_calls.py):
# the system turn lists them under "# Tools", calls are <tool_call> blocks, replies a user turn of <tool_response>s.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}"
    "{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_with_native_tools_renders_its_own_format_and_its_episodes_match_its_demonstrations():
    """workbench.recipes.tools on a chat template that knows tools (Qwen2.5's, on the default model's tokenizer, whose
    ChatML tokens it shares): the tools are offered in the template's own words, not the Hermes fallback's; a
    demonstration's assistant turns, replayed as an episode's sampled turns, give token for token the
    demonstration's sequence, with one system turn and the tool's reply in the template's format."""
    import copy
    import json

    from kernel_backend import tool_calls
    from workbench.recipes import episodes, tools
    from workbench.recipes import common

    tok = copy.deepcopy(common.local_tokenizer())
    tok.chat_template = QWEN25_TEMPLATE
    assert tool_calls.knows_tools(tok)
    namespace: dict = {}
    exec(REPLAY, namespace)

    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression, {"__builtins__": {}}))

    calculator = [tools.Tool.of(calc)]
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": json.dumps({"expression": "17*5+3"})}}
    question = [{"role": "user", "content": "What is 17*5+3?"}]
    demo = question + [{"role": "assistant", "content": "", "tool_calls": [call]}, *tools.call_tools(calculator, [call]),
                       {"role": "assistant", "content": "17*5+3 is 88."}]
    offered = tok.decode(tools.prompt(tok, question, calculator))
    assert offered.startswith("<|im_start|>system\nYou are Qwen") and "# Tools" in offered and '"name": "calc"' in offered
    assert "You are provided with function signatures" in offered and "SmolLM" not in offered

    rendered, mine, turns = namespace["trained_turns"](tools.sft_datum(tok, demo, calculator))
    assert len(turns) == 2 and tok.decode(turns[0]).startswith("<tool_call>"), [tok.decode(t) for t in turns]
    assert tools.reply(tok, turns[0])["tool_calls"][0]["function"]["name"] == "calc"
    env = episodes.ToolEnv(question[0]["content"], check=lambda text: float("88" in text), tools=calculator, strict=True)
    (played,) = episodes.run_episodes(namespace["Replay"](turns), tok, [env], tools=calculator, max_turns=3, max_tokens=48)
    assert played.tokens == rendered[:len(played.tokens)] and len(rendered) - len(played.tokens) <= 1, \
        (tok.decode(played.tokens), tok.decode(rendered))
    text = tok.decode(played.tokens)
    assert text.count("<|im_start|>system") == 1 and "<|im_start|>user\n<tool_response>\n88\n</tool_response><|im_end|>" in text
    assert played.reward == 1.0 and played.parts == {"answer": 1.0, "tool_use": 1.0, "format": 1.0}
    datum = played.datum(1.0)
    assert [i + 1 for i, a in enumerate(datum.loss_fn_inputs["advantages"].data) if a] == \
        [i for i in mine if i < len(played.tokens)]
