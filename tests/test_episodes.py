"""Multi-turn episodes (workbench/recipes/episodes.py): tools as Python functions, their errors and timeouts as
observations, episodes played through the official SDK's sampler, and an episode's datum that trains the
policy's tokens only.

On the tiny stand-in (tinker_server): these check how an episode is assembled and what its datum asks of
the loss, not what a model learns; a random model's replies serve as well as a trained one's.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import jsonschema
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from kernel_backend import tool_calls
from kernel_backend.engine.losses import compute_loss
from test_service import BASE
from workbench.recipes import episodes
from workbench.recipes import estimates, rl, rl_hacks
from workbench.recipes.episodes import Episode, Segment, Step, Tool, ToolEnv


def calc(expression: str) -> float:
    """Evaluate an arithmetic expression.

    Digits, + - * / and brackets only."""
    if set(expression) - set("0123456789+-*/() ."):
        raise ValueError(f"not arithmetic: {expression!r}")
    return eval(expression)  # noqa: S307 - checked above


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_a_tool_is_a_function_with_a_schema():
    tool = Tool.of(calc)
    assert tool.schema == {"type": "function", "function": {
        "name": "calc", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {"type": "string"}}}}}
    assert tool_calls.check_tools([tool.schema])  # what the server's routes take, too


def test_the_strict_reward_refuses_tool_markup_the_model_made_up():
    """The answers RL rewarded on notebook 08 once a list of the template's tags was all it checked: a made-up
    tag like them is markup too, and an answer in plain words is not."""
    echoed = ["The answer is 6188.\n</tool_answer>", "<tool_respond>\nThe answer is '3520'",
              'The output 767 from the "calc" function is <tool_output></tool_output>', "<tool_call>\n{", "x <tool"]
    assert all(episodes.answer_markup(answer) for answer in echoed)
    assert episodes.answer_markup("<tool_output></tool_output> and </tool_output>") == ["<tool_output>", "</tool_output>"]
    assert episodes.answer_markup("The answer is 233, a product of tools and care.") == []
    env = episodes.ToolEnv("What is 17*13 + 12?", check=lambda a: float("233" in a), tools=[], strict=True)
    history = [{"role": "user", "content": "?"}, {"role": "tool", "content": "233"}]
    assert env.step(history, {"content": "The answer is 233.</tool_answer>"}).reward == 0.0
    assert env.step(history, {"content": "The answer is 233."}).reward == 1.0


def test_tool_errors_and_timeouts_become_observations():
    def call(name: str, **arguments) -> dict:
        return {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}

    tools = [Tool.of(calc), Tool.of(slow)]
    results = episodes.call_tools(tools, [call("calc", expression="17*5+3"), call("calc", expression="1/0"),
                                          call("calc", expression="import os"), call("nope"),
                                          call("calc", wrong=1), call("slow", seconds=2)], timeout_s=0.3)
    contents = [r["content"] for r in results]
    assert contents[0] == "88"
    assert contents[1].startswith("Error: ZeroDivisionError")
    assert contents[2] == "Error: ValueError: not arithmetic: 'import os'"
    assert contents[3].startswith("Error: LookupError: no tool named 'nope'")
    assert contents[4].startswith("Error: TypeError") and "wrong" in contents[4]
    assert contents[5] == "Error: slow timed out after 0.3 s"
    assert [r["role"] for r in results] == ["tool"] * 6 and all(r["tool_call_id"] == "c" for r in results)


def test_an_episode_datum_trains_only_the_policys_tokens():
    """The targets that are not the policy's (prompt, tool result, template glue) get exactly zero gradient:
    perturbing what the datum says of them (their placeholder sampler logprobs) changes neither the loss nor
    any gradient; perturbing a policy token's does."""
    rng = np.random.default_rng(0)
    episode = Episode([Segment("prompt", [1, 2, 3, 4, 5]), Segment("policy", [6, 7, 8, 9], [-0.5, -1.0, -0.2, -2.0]),
                       Segment("observation", [10, 11, 12, 13, 14, 15]), Segment("policy", [16, 17, 18], [-0.1, -0.3, -0.7])],
                      messages=[])
    datum = episode.datum(advantage=0.75)
    inputs = {k: torch.tensor(v.to_numpy(), dtype=torch.float64) for k, v in datum.loss_fn_inputs.items()
              if k != "target_tokens"}
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
    policy = np.zeros(len(targets), bool)
    policy[4:8] = policy[14:17] = True  # the targets the policy sampled: position p predicts token p + 1
    assert list(targets[policy]) == [6, 7, 8, 9, 16, 17, 18]
    assert np.all(inputs["advantages"].numpy()[policy] == 0.75) and np.all(inputs["advantages"].numpy()[~policy] == 0)
    lp = torch.tensor(rng.uniform(-3, 0, len(targets)))  # the learner's: near the sampler's on the policy's tokens
    lp[policy] = inputs["logprobs"][policy] + torch.tensor(rng.uniform(-0.05, 0.05, policy.sum()))

    def loss_and_grad(inputs: dict, loss_fn: str):
        leaf = lp.clone().requires_grad_(True)
        loss, _ = compute_loss(loss_fn, leaf, inputs, {})
        loss.backward()
        return loss.item(), leaf.grad.clone()

    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        loss, grad = loss_and_grad(inputs, loss_fn)
        assert torch.all(grad[torch.from_numpy(~policy)] == 0) and torch.all(grad[torch.from_numpy(policy)] != 0)
        perturbed = dict(inputs, logprobs=torch.where(torch.from_numpy(policy), inputs["logprobs"],
                                                      torch.tensor(rng.uniform(-5, 0, len(targets)))))
        perturbed_loss, perturbed_grad = loss_and_grad(perturbed, loss_fn)
        assert perturbed_loss == loss and torch.equal(perturbed_grad, grad)
        moved = dict(inputs, logprobs=inputs["logprobs"].clone())
        moved["logprobs"][4] -= 1.0
        assert not torch.equal(loss_and_grad(moved, loss_fn)[1], grad)


class Scripted:
    """An environment that answers every reply with a tool result, and ends after `turns` of them, rewarding
    the last reply with `reward(text)`, which it also logs as the grade "graded"."""

    def __init__(self, turns: int, reward=lambda text: 1.0) -> None:
        self.turns, self.reward = turns, reward

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": "What is 17*5+3?"}]

    def step(self, history: list[dict], reply: dict) -> Step:
        done = sum(m["role"] == "assistant" for m in history) + 1 >= self.turns
        reward = self.reward(reply["content"])
        return Step(done=True, reward=reward, parts={"graded": reward}) if done else \
            Step([{"role": "tool", "tool_call_id": "c", "content": f"result {len(history)}"}])


def reused_tokens(server) -> int:
    """The prompt positions the server's prefix caches have served so far (the operator's /admin/stats)."""
    stats = httpx.get(server.base_url + "/api/v1/admin/stats", headers={"X-API-Key": server.api_key}).json()
    return sum(models[BASE]["prefix_cache"]["reused_tokens"] for models in stats["sampling"].values() if BASE in models)


@pytest.fixture(scope="module")
def sampler(tinker_server):
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    return client.create_sampling_client(base_model=BASE).result()


def test_episodes_play_through_the_sdk_as_one_token_sequence(sampler, tokenizer, tinker_server):
    """Each turn's prompt is the last one's plus the policy's tokens plus the observation's: the server sees one
    growing sequence (its prefix cache serves the start); the episode's text is the template's conversation."""
    envs = [Scripted(3), Scripted(1), Scripted(9)]
    reused_before = reused_tokens(tinker_server)
    played = episodes.run_episodes(sampler, tokenizer, envs, tools=[Tool.of(calc)], max_turns=4, max_tokens=6,
                                   temperature=1.0, seed=1)
    # Each later turn's prompt starts with the last turn's whole prompt, which the prefix cache serves.
    def prompt_lengths(episode: Episode) -> list[int]:  # each turn's prompt: every token before its reply
        return [sum(len(s.tokens) for s in episode.segments[:i]) for i, s in enumerate(episode.segments)
                if s.role == "policy"]

    repeated = sum(length - 1 for e in played for length in prompt_lengths(e)[:-1])
    assert repeated > 0 and reused_tokens(tinker_server) - reused_before >= repeated
    three, one, capped = played
    assert [s.role for s in three.segments] == ["prompt", "policy", "observation", "policy", "observation", "policy"]
    assert (three.turns, three.ended, three.reward) == (3, "done", 1.0)
    assert (one.turns, one.ended) == (1, "done") and (capped.turns, capped.ended, capped.reward) == (4, "max_turns", 0.0)
    for episode in played:
        assert episode.segments[0].tokens == tool_calls.render(tokenizer, episode.messages[:1], [Tool.of(calc).schema])
        for segment in episode.segments:
            if segment.role == "policy":
                assert 0 < len(segment.tokens) <= 6 and len(segment.logprobs) == len(segment.tokens)
    text = tokenizer.decode(three.tokens)
    assert "<tool_response>\nresult 1\n</tool_response>" in text and text.count("<|im_start|>assistant\n") == 3
    datum = three.datum(advantage=1.0)
    assert datum.model_input.length == len(three.tokens) - 1
    assert sum(datum.loss_fn_inputs["advantages"].to_numpy() != 0) == three.policy_tokens

    with pytest.raises(ValueError, match="raise max_episode_tokens"):  # refused before anything is sampled
        episodes.run_episodes(sampler, tokenizer, [Scripted(1)], tools=[Tool.of(calc)], max_episode_tokens=100)

    # The episode trains as it was sampled: on the same weights, the learner's logprobs of the policy's
    # tokens are the sampler's (importance ratio 1), the observation's tokens count for nothing.
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    out = tc.forward([datum], "importance_sampling").result()
    assert out.metrics["kl_sample_train:mean"] == pytest.approx(0.0, abs=2e-3)


class HeldSampler:
    """The SDK's sampler, except that the first turn of the episode asking `held` is answered only once another
    episode's second turn has been sent (after 60 s regardless: then `released_early` stays False)."""

    def __init__(self, inner, held: list[int], others: list[list[int]]) -> None:
        self.inner, self.held, self.others = inner, held, others
        self.second_turn_sent, self.released_early = threading.Event(), False

    def sample(self, prompt, num_samples, params, **kwargs):
        tokens, future = prompt.to_ints(), self.inner.sample(prompt, num_samples, params, **kwargs)
        if any(len(tokens) > len(first) and tokens[:len(first)] == first for first in self.others):
            self.second_turn_sent.set()
        if tokens != self.held:
            return future
        gate = concurrent.futures.Future()  # a plain future, as older SDKs returned: waited on as it is

        def release():
            self.released_early = self.second_turn_sent.wait(60)
            gate.set_result(future.result())
        threading.Thread(target=release, daemon=True).start()
        return gate


def test_an_episode_goes_on_while_another_is_still_sampling(sampler, tokenizer):
    """Each episode's next turn is sent as soon as its own turn is back, not when every episode's is: with one
    episode's first turn held back, another's second turn goes out meanwhile, and every episode still plays out as
    its environment says, in the order given."""
    schemas = [Tool.of(calc).schema]
    envs = [Scripted(3), Scripted(1), Scripted(2)]
    envs[1].reset = lambda: [{"role": "user", "content": "Which tool adds numbers?"}]  # the held episode's own prompt
    firsts = [tool_calls.render(tokenizer, env.reset(), schemas) for env in envs]
    held = HeldSampler(sampler, firsts[1], [firsts[0], firsts[2]])
    played = episodes.run_episodes(held, tokenizer, envs, tools=[Tool.of(calc)], max_turns=4, max_tokens=6, seed=2)
    assert held.released_early, "no other episode's second turn was sent while the held one was sampling"
    assert [(e.turns, e.ended) for e in played] == [(3, "done"), (1, "done"), (2, "done")]
    assert [e.segments[0].tokens for e in played] == firsts


def test_a_demonstration_of_a_call_trains_what_an_episode_samples(tokenizer):
    """common.chat_datum(..., tools=): a demonstration rendered as run_episodes renders its prompt (the tools
    offered), weight 1 on the assistant's call and the end of its turn, 0 on everything before."""
    from workbench.recipes import common

    schemas = [Tool.of(calc).schema]
    asked = [{"role": "user", "content": "What is 17*5+3?"}]
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": json.dumps({"expression": "17*5+3"})}}
    datum = common.chat_datum(tokenizer, asked + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                              train_on="last_assistant", tools=schemas)
    prompt = tool_calls.render(tokenizer, asked, schemas)
    tokens = datum.model_input.to_ints() + [int(datum.loss_fn_inputs["target_tokens"].data[-1])]
    weights = np.asarray(datum.loss_fn_inputs["weights"].data)
    assert tokens[:len(prompt)] == prompt and not weights[:len(prompt) - 1].any() and weights[len(prompt) - 1:].all()
    trained = tokenizer.decode(tokens[len(prompt):])
    assert trained.startswith("<tool_call>") and tool_calls.parse(trained.split("<|im_end|>")[0]).calls[0]["function"] == call["function"]
    assert common.chat_datum(tokenizer, asked + [{"role": "assistant", "content": "88"}]).model_input.to_ints()[:len(prompt)] != prompt


def test_group_advantages_and_a_tool_env():
    env = ToolEnv("What is 17*5+3?", check=lambda text: float("88" in text), tools=[Tool.of(calc)], system="Be brief.")
    assert env.reset()[0] == {"role": "system", "content": "Be brief."}
    call = tool_calls.parse('<tool_call>{"name": "calc", "arguments": {"expression": "17*5+3"}}</tool_call>').calls
    observed = env.step(env.reset(), {"role": "assistant", "content": "", "tool_calls": call})
    assert not observed.done and observed.messages[0]["content"] == "88"
    answered = env.step(env.reset(), {"role": "assistant", "content": "It is 88."})
    assert answered.done and answered.reward == 1.0
    played = [Episode([], [], reward=r) for r in (1.0, 0.0, 0.0, 1.0)]
    assert episodes.group_advantages(played).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_a_strict_tool_env_rewards_only_a_plain_answer_after_a_call_that_ran():
    """strict=True: the reward is the product of three grades, each logged: the answer's check, a call that ran
    before it, and an answer in plain words. Every hack notebook 08's first reward paid for earns 0."""
    env = ToolEnv("What is 17*5+3?", check=lambda text: float("88" in text), tools=[Tool.of(calc)], strict=True)
    asked = env.reset()

    def answered(text: str, expression: str | None = "17*5+3") -> Step:
        history = list(asked)
        if expression is not None:
            calls = tool_calls.parse(f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>').calls
            reply = {"role": "assistant", "content": "", "tool_calls": calls}
            history += [reply, *env.step(history, reply).messages]
        return env.step(history, {"role": "assistant", "content": text})

    good = answered("17*5+3 is 88.")
    assert good.done and good.reward == 1.0 and good.parts == {"answer": 1.0, "tool_use": 1.0, "format": 1.0}
    graded = {text: (step.reward, step.parts) for text, step in [
        ("88", answered("88")),                                              # the tool's reply, copied back
        ("<tool_response>88</tool_response>", answered("<tool_response>88</tool_response>")),  # markup echoed
        ("no call", answered("It is 88.", expression=None)),                 # right, but never asked the tool
        ("errored", answered("It is 88.", expression="17*5+")),              # the only call failed
        ("wrong", answered("It is 87."))]}
    assert graded == {
        "88": (0.0, {"answer": 1.0, "tool_use": 1.0, "format": 0.0}),
        "<tool_response>88</tool_response>": (0.0, {"answer": 1.0, "tool_use": 1.0, "format": 0.0}),
        "no call": (0.0, {"answer": 1.0, "tool_use": 0.0, "format": 1.0}),
        "errored": (0.0, {"answer": 1.0, "tool_use": 0.0, "format": 1.0}),
        "wrong": (0.0, {"answer": 0.0, "tool_use": 1.0, "format": 1.0})}
    assert ToolEnv("q", check=lambda text: 1.0, tools=[]).step([], {"content": "88"}).parts == {}  # not strict: no grades


class TwoTurnTask(rl.Task):
    """A multi-turn task for the rl recipe: every episode takes two turns (a tool result between them); the
    reward, the parity of the last reply's length, differs within a group, so the groups train."""

    tools = [Tool.of(calc)]

    def problems(self, n, rng):
        return [rl.Problem(f"What is {a}*{b}?", str(a * b)) for a, b in rng.integers(1, 9, size=(n, 2))]

    def env(self, problem):
        return Scripted(2, reward=lambda text: float(len(text) % 2))


def test_the_rl_recipe_trains_on_episodes(tinker_server, tokenizer, browser, tmp_path):
    """rl.run with a task that has env(problem): each answer an episode, logged with its turns and tool calls,
    stored with each token's role, trained as one datum whose policy tokens the learner scores as the sampler
    did (kl_sampler ~0: the observation's tokens, placeholder logprobs, are not counted)."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    rows = []
    def planted(episode):  # an rl insight check of the user's: it fails every two-turn episode (the rewarded flag)
        return "a planted hack" if episode.turns == 2 else None

    config = rl.Config(task=TwoTurnTask(), steps=2, groups_per_batch=2, group_size=4, max_tokens=8, max_turns=3,
                       eval_prompts=1, eval_samples=2, monitor_prompts=0, progress=False, verbose=False,
                       metrics_path=str(tmp_path / "rl.jsonl"), run_name="episodes",
                       episode_checks=[*rl_hacks.CHECKS, planted])
    summary = rl.run(config, service_client=client, on_step=rows.append)
    steps = [r for r in rows if "turns" in r]
    assert summary.steps == 2 and len(steps) == 2
    # The user's check flags both steps (each has rewarded episodes), as begun at step 1 (the stand-in's noise trips
    # neither built-in check).
    assert [[(f["kind"], f["check"], f["since"]) for f in r["flags"]] for r in steps] == \
        [[("answer_hack", "planted", 1)]] * 2 and summary.extra["flagged_steps"] == [1, 2]
    rewarded = round(steps[1]["reward"] * 8)  # the planted check fails every episode; rewarded ones are flagged
    assert f"{rewarded} of 8 episodes rewarded although a planted hack" in steps[1]["flags"][0]["detail"]
    assert "since step 1" in steps[1]["flags"][0]["detail"]
    for row in steps:
        assert row["turns"] == 2.0 and row["tool_calls"] == 0.0 and row["episode_tokens"] > 0
        assert row["graded"] == row["reward"]  # the environment's grade (Step.parts), logged per step
    trained = [r for r in steps if "kl_sampler" in r]
    assert trained and all(abs(r["kl_sampler"]) < 1e-2 and r["train_tokens"] > 0 for r in trained), trained
    from workbench.recipes.rollout_log import RolloutLog

    (answer, *_) = RolloutLog(summary.extra["rollouts"]).samples(1)
    assert set(answer["roles"]) == {"policy", "observation"} and len(answer["roles"]) == len(answer["tokens"])
    assert all((lp is None) == (role == "observation") for lp, role in zip(answer["logprobs"], answer["roles"]))
    # The inspector shows the episode turn by turn: in the page, the environment's turns are grey boxes
    # with no token coloured; the policy's tokens are coloured.
    from workbench.widgets.rollouts import RolloutInspector

    inspector = RolloutInspector.from_log(summary.extra["rollouts"], tokenizer=tokenizer, step=1)
    assert {"graded", "turns", "tool_calls", "tool_errors", "episode_tokens"} <= set(inspector.columns)
    assert (inspector.df["graded"] == inspector.df["reward"]).all()  # each episode's grade, a column of its own
    inspector.select(0)
    page = browser.new_page()
    page.set_content(f"<html><body style='width:900px'>{inspector.tokens_html}</body></html>")
    observation, policy = page.locator('[data-role="observation"]'), page.locator('[data-role="policy"] .wb-tok')
    assert observation.count() == 1 and "<tool_response>" in observation.inner_text()
    assert observation.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(238, 241, 244)"
    assert observation.locator(".wb-tok").count() == 0  # nothing coloured
    assert policy.count() == list(inspector.df.loc[0, "roles"]).count("policy")
    shades = policy.evaluate_all("spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    assert any(c != "rgba(0, 0, 0, 0)" for c in shades)  # the policy's tokens coloured by logprob
    page.screenshot(path=str(tmp_path / "episode.png"))

    with pytest.raises(ValueError, match="monitor_prompts=0"):
        rl.run(rl.Config(task=TwoTurnTask(), monitor_prompts=8), service_client=client)


def test_a_multi_turn_runs_estimate_bounds_every_turn_of_every_episode(stepwise_home):
    """Before it runs, a multi-turn run is priced at its bound: every episode takes max_turns turns, each its own
    request with a prompt of max_episode_tokens, and trains as a datum of that length."""
    config = rl.Config(task=TwoTurnTask(), steps=2, groups_per_batch=2, group_size=4, max_tokens=8, max_turns=3,
                       max_episode_tokens=512, eval_prompts=1, eval_samples=2, monitor_prompts=0)
    usage = rl.planned_tokens(config, estimates.Assumed()).usage()
    episodes_played = 2 * 1 * 2 + 2 * 2 * 4  # the eval before and after, then every step's groups
    assert usage.prefill_tokens == episodes_played * 3 * 512
    assert usage.sample_tokens == episodes_played * 3 * 8
    assert usage.train_tokens == 2 * 2 * 4 * 512  # a datum of at most max_episode_tokens


def lookup(symbol: str) -> str:
    """A stock's last price."""
    return {"ACME": "12.5", "INITECH": "7"}[symbol]


LOOKUP = Tool.of(lookup, parameters={"type": "object", "properties": {"symbol": {"enum": ["ACME", "INITECH"]}},
                                     "required": ["symbol"], "additionalProperties": False})


def test_constrained_episodes_make_only_valid_calls(tinker_server, tokenizer, tmp_path):
    """episodes.run_episodes(constrain_calls=True), rl.Config(constrain_tool_calls=True): the tiny stand-in, taught
    to open a call and end its turn there, makes calls that parse and validate against the tool's schema every time
    with the option on; without it, the calls it opens are empty (so the option, not the model, made them valid)."""
    from workbench.recipes import common

    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=0, seed=0).result()
    asked = [{"role": "user", "content": "What does ACME cost?"}]
    demo = common.chat_datum(tokenizer, asked + [{"role": "assistant", "content": "<tool_call>\n"}],
                             train_on="last_assistant", tools=[LOOKUP.schema])
    for _ in range(50):  # a full fine-tune: the tiny model learns the opening's five tokens in about 40 steps
        tc.forward_backward([demo], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()

    def play(constrain: bool) -> list[Episode]:
        envs = [ToolEnv("What does ACME cost?", check=lambda text: float("12.5" in text), tools=[LOOKUP])
                for _ in range(6)]
        return episodes.run_episodes(sampler, tokenizer, envs, tools=[LOOKUP], max_turns=2, max_tokens=32, seed=3,
                                     constrain_calls=constrain)

    def opened(played: list[Episode]) -> list[str]:  # the policy turns that open a call
        return [s.text for e in played for s in e.segments if s.role == "policy" and tool_calls.CALL_OPEN in s.text]

    free = opened(play(False))
    assert len(free) >= 3 and not any(tool_calls.parse(text).calls for text in free), free
    held = play(True)
    assert len(opened(held)) >= 3
    for text in opened(held):
        (call,) = tool_calls.parse(text).calls
        jsonschema.validate(json.loads(call["function"]["arguments"]), LOOKUP.schema["function"]["parameters"])
    assert sum(e.tool_calls for e in held) == len(opened(held)) and not any(e.tool_errors for e in held)
    with pytest.raises(ValueError, match="give the tools"):
        episodes.run_episodes(sampler, tokenizer, [Scripted(1)], constrain_calls=True)

    # The rl recipe's option: the same, from the taught weights, logged per step (tool calls made, none failed).
    class LookupTask(rl.Task):
        tools = [LOOKUP]

        def problems(self, n, rng):
            return [rl.Problem("What does ACME cost?", "12.5") for _ in range(n)]

        def env(self, problem):
            return ToolEnv(problem.question, check=lambda text: float(problem.answer in text), tools=self.tools)

    rows = []
    state = tc.save_state("opens-calls").result().path
    rl.run(rl.Config(task=LookupTask(), load_checkpoint_path=state, constrain_tool_calls=True, steps=1,
                     groups_per_batch=1, group_size=4, max_tokens=32, max_turns=2, eval_prompts=0, monitor_prompts=0,
                     progress=False, verbose=False, metrics_path=str(tmp_path / "rl.jsonl")),
           service_client=client, on_step=rows.append)
    (step,) = [r for r in rows if "tool_calls" in r]
    assert step["tool_calls"] > 0 and step["tool_errors"] == 0.0, step
