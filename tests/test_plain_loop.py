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

CHECK = '''
from types import SimpleNamespace

import numpy as np
from workbench import episodes


class Replay:
    """A sampler that answers each turn with the next of `turns` (token lists), as the SDK's future would."""

    def __init__(self, turns):
        self.turns = list(turns)

    def sample(self, prompt, num_samples, params, **kwargs):
        tokens = self.turns.pop(0)
        response = SimpleNamespace(sequences=[SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens))])
        return SimpleNamespace(result=lambda: response)


assert losses[-1] < losses[0], losses
datum = tools.sft_datum(tok, demo, calculator)
rendered = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].data[-1])]
weights = np.asarray(datum.loss_fn_inputs["weights"].data)
mine = [i + 1 for i in range(len(weights)) if weights[i] > 0]  # the token positions the demonstration trains
turns, run = [], []
for i in range(len(rendered)):
    if i in mine:
        run.append(rendered[i])
    elif run:
        turns.append(run)
        run = []
turns.append(run) if run else None
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
