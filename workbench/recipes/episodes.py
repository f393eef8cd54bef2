"""Multi-turn episodes: the policy talks with an environment over several turns (it calls tools, the
environment answers), and a whole episode trains as one datum.

An environment is any object with two methods (the researcher's code, run here, never on the server):

    reset() -> list[dict]                          the first messages: [{"role": "user", "content": ...}]
    step(history, reply) -> Step                   what follows the policy's reply: messages to append
                                                   (tool results, a user's answer) and/or done, reward

How it works, and why: docs/workbench.md, "Inside the workbench, module by module", workbench/recipes/episodes.py.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tinker import types

from kernel_backend import tool_calls
from workbench.client import sdk_hooks

TOOL_MARKUP = (tool_calls.CALL_OPEN, tool_calls.CALL_CLOSE, "<tool_response>", "</tool_response>")
LONG_OUTPUT = 20  # characters: a tool output this long, found whole in an answer, was copied (copied_output)
PLACEHOLDER = "\x00policy-reply\x00"  # stands for the policy's turn when the template's glue around it is measured
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    """A Python function the policy may call, and the JSON schema it is offered with."""

    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def of(cls, fn: Callable, description: str | None = None, parameters: dict | None = None) -> Tool:
        """A tool from a function: its name, its docstring's first paragraph, and (unless `parameters` is
        given) a schema of its annotated parameters, required unless they have a default."""
        if parameters is None:
            signature = inspect.signature(fn)
            parameters = {"type": "object", "required": [], "properties": {}}
            for name, p in signature.parameters.items():
                parameters["properties"][name] = {"type": JSON_TYPES.get(p.annotation, "string")}
                if p.default is inspect.Parameter.empty:
                    parameters["required"].append(name)
        description = description or (inspect.getdoc(fn) or "").split("\n\n")[0]
        return cls(fn, {"type": "function", "function": {"name": fn.__name__, "description": description,
                                                         "parameters": parameters}})


@dataclass
class Step:
    """What follows a policy's turn: messages for the next (tool results, a user), or the end and its reward."""

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # the reward's grades by name, logged (docs/workbench.md)


def call_tools(tools: list[Tool], calls: list[dict], timeout_s: float = 5.0) -> list[dict]:
    """Run each call; its result, or its error, as a tool message. A call that runs past `timeout_s` is
    answered with an error (its thread is left to finish: Python cannot stop it)."""
    by_name = {t.name: t for t in tools}
    out = []
    for call in calls:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        try:
            if name not in by_name:
                raise LookupError(f"no tool named {name!r}; the tools are {sorted(by_name)}")
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            try:
                result = pool.submit(by_name[name].fn, **json.loads(arguments)).result(timeout=timeout_s)
            finally:
                pool.shutdown(wait=False)
            content = result if isinstance(result, str) else json.dumps(result)
        except concurrent.futures.TimeoutError:
            content = f"Error: {name} timed out after {timeout_s:g} s"
        except Exception as e:  # the policy's call was wrong, or the tool failed: the policy sees why
            content = f"Error: {type(e).__name__}: {e}"
        out.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": content})
    return out


# Any tag that starts "<tool" or "</tool": the template's own (TOOL_MARKUP) and the ones a small model makes up from
# them ("<tool_respond>", "</tool_answer>", "<tool_output>"), which RL learned to slip past a list of the real ones.
TOOL_TAG = re.compile(r"</?tool\w*>?")


def answer_markup(answer: str) -> list[str]:
    """The tool markup an answer carries (an answer is plain words; markup in it is an echo or a broken call): the
    template's tags and any made-up tag like them, each once, in order."""
    return list(dict.fromkeys(TOOL_TAG.findall(answer)))


def copied_output(answer: str, messages: list[dict]) -> str | None:
    """The tool output the answer copies: the answer is that output and nothing more, or holds a long one whole
    (a short output, a number, may rightly appear inside an answer in words)."""
    for message in messages:
        output = str(message.get("content") or "").strip() if message.get("role") == "tool" else ""
        if output and (answer.strip() == output or (len(output) >= LONG_OUTPUT and output in answer)):
            return output
    return None


def called_tool(messages: list[dict]) -> bool:
    """Whether the conversation's last tool turn ran without an error: the answer follows a well-formed call."""
    results = [m for m in messages if m.get("role") == "tool"]
    return bool(results) and not str(results[-1].get("content", "")).startswith("Error:")


class ToolEnv:
    """A question answered with tools: each reply that calls tools gets their results; the first that
    does not is the answer, rewarded by `check(answer_text) -> float`. With `strict`, the reward is
    check's grade ("answer") times "tool_use" and "format" (docs/workbench.md, "Inside the workbench"),
    all three logged."""

    def __init__(self, question: str, check: Callable[[str], float], tools: list[Tool], system: str | None = None,
                 timeout_s: float = 5.0, strict: bool = False) -> None:
        self.question, self.check, self.tools, self.system, self.timeout_s = question, check, tools, system, timeout_s
        self.strict = strict

    def reset(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
               [{"role": "user", "content": self.question}]

    def step(self, history: list[dict], reply: dict) -> Step:
        if reply.get("tool_calls"):
            return Step(call_tools(self.tools, reply["tool_calls"], self.timeout_s))
        answer = reply.get("content") or ""
        if not self.strict:
            return Step(done=True, reward=float(self.check(answer)))
        parts = {"answer": float(self.check(answer)), "tool_use": float(called_tool(history)),
                 "format": float(not answer_markup(answer) and copied_output(answer, history) is None)}
        return Step(done=True, reward=float(np.prod(list(parts.values()))), parts=parts)


@dataclass
class Segment:
    """A run of an episode's tokens: the first prompt, a policy turn (sampled, with its logprobs), or an
    observation (the environment's messages and the template's text around them)."""

    role: str  # "prompt", "policy" or "observation"
    tokens: list[int]
    logprobs: list[float] | None = None  # the sampler's, policy turns only
    text: str = ""

    def sampled_logprobs(self) -> list[float]:
        """A policy turn's logprobs (a policy segment always has them)."""
        if self.logprobs is None:
            raise ValueError(f"this {self.role} segment has no sampler logprobs")
        return self.logprobs


@dataclass
class Episode:
    segments: list[Segment]
    messages: list[dict]  # the conversation as chat messages, the policy's turns parsed
    reward: float = 0.0
    ended: str = ""  # "done", "max_turns", "max_tokens"
    tool_calls: int = 0
    tool_errors: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # the environment's grades of the answer (Step.parts)

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]

    @property
    def turns(self) -> int:
        return sum(s.role == "policy" for s in self.segments)

    @property
    def policy_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments if s.role == "policy")

    def policy_mask(self) -> np.ndarray:
        """Per datum position (each token but the last, predicting the next): whether its target is a token
        the policy sampled."""
        return np.concatenate([np.full(len(s.tokens), s.role == "policy") for s in self.segments])[1:]

    def datum(self, advantage: float) -> types.Datum:
        """The episode as one policy-gradient datum (importance_sampling, ppo, cispo, dro): each policy
        token's target carries `advantage` and its sampler logprob; every other target advantage 0 and
        logprob 0, so it gets no gradient."""
        tokens, policy = self.tokens, self.policy_mask()
        advantages = np.where(policy, advantage, 0.0).astype(np.float32)
        logprobs = np.zeros(len(tokens) - 1, np.float32)
        logprobs[policy] = [x for s in self.segments if s.role == "policy" for x in s.sampled_logprobs()]
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
                                           "logprobs": types.TensorData.from_numpy(logprobs),
                                           "advantages": types.TensorData.from_numpy(advantages)})


def observation_tokens(tokenizer, history: list[dict], reply_text: str, messages: list[dict],
                       schemas: list[dict] | None) -> tuple[list[int], str]:
    """The tokens that follow the policy's sampled turn: the rest of the template's closing of that turn
    (what the sampler did not write: the newline after the end token, or the end token itself when
    the turn was cut at max_tokens), then `messages` and the opening of the next policy turn."""
    with_reply = history + [{"role": "assistant", "content": PLACEHOLDER}]
    before = tool_calls.render_text(tokenizer, with_reply, schemas, add_generation_prompt=False)
    after = tool_calls.render_text(tokenizer, with_reply + messages, schemas, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("this chat template renders earlier turns differently once more follow, so an episode "
                         "cannot be one token sequence; use a template that appends turns")
    closing = before[before.index(PLACEHOLDER) + len(PLACEHOLDER):]  # e.g. "<|im_end|>\n"
    written = next((k for k in range(len(closing), 0, -1) if reply_text.endswith(closing[:k])), 0)
    text = closing[written:] + after[len(before):]
    return tokenizer(text, add_special_tokens=False)["input_ids"], text


def reply_message(tokenizer, tokens: list[int]) -> dict:
    """A sampled turn as the chat message the environment sees: {"role": "assistant", "content", "tool_calls"?},
    its calls parsed from its text (a garbled call stays text: tool_calls.parse)."""
    parsed = tool_calls.parse(tokenizer.decode(tokens, skip_special_tokens=True))
    return {"role": "assistant", "content": parsed.content, **({"tool_calls": parsed.calls} if parsed.calls else {})}


def run_episodes(sampler, tokenizer, envs: list, tools: list[Tool] | None = None, max_turns: int = 4,
                 max_tokens: int = 64, max_episode_tokens: int = 1024, temperature: float = 1.0,
                 seed: int = 0, constrain_calls: bool = False) -> list[Episode]:
    """Play each environment to its end, all of them at once: every episode's first turn is sampled together
    (the server batches them), and each episode goes on as soon as its own turn is back: its environment
    steps here, on this thread, and its next turn joins the server's running batch while other episodes are
    still sampling theirs (no turn waits for the slowest episode of the one before). An episode ends when
    its environment says done, after `max_turns` policy turns, or when its tokens pass `max_episode_tokens`
    (reward 0 unless done). Each turn's seed is fixed by the episode and the turn, so what an episode samples
    does not depend on when its turn ran. `constrain_calls`: each turn is plain text or one valid call
    (docs/workbench.md, "Inside the workbench")."""
    schemas = [t.schema for t in tools] if tools else None
    extra = {}
    if constrain_calls:
        if not schemas:
            raise ValueError("constrain_calls holds tool calls to their tools' schemas: give the tools")
        sdk_hooks.install()  # the SDK's sample() takes constraint= (idempotent; connect() has done it already)
        extra = {"constraint": {"lark": tool_calls.text_or_call(schemas)}}
    episodes = []
    for env in envs:
        messages = env.reset()
        prompt = tool_calls.render(tokenizer, messages, schemas)
        if len(prompt) + max_tokens > max_episode_tokens:
            raise ValueError(f"an episode's first prompt is {len(prompt)} tokens, and with max_tokens {max_tokens} "
                             f"its first turn passes max_episode_tokens {max_episode_tokens}: raise max_episode_tokens")
        episodes.append(Episode([Segment("prompt", prompt, text=tokenizer.decode(prompt))], messages))

    def sample(i: int, turn: int):
        return sampler.sample(types.ModelInput.from_ints(episodes[i].tokens), 1, types.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed * 1000 + i * 64 + turn), **extra)

    def play(i: int, turn: int, response) -> bool:
        """Episode i's turn `turn` is back: record it and step its environment. Whether the episode goes on."""
        episode, env = episodes[i], envs[i]
        (seq,) = response.sequences
        text = tokenizer.decode(seq.tokens)  # with the end token: the template's closing is measured from it
        reply = reply_message(tokenizer, seq.tokens)
        calls = reply.get("tool_calls", [])
        history = list(episode.messages)
        episode.segments.append(Segment("policy", list(seq.tokens), list(seq.logprobs),
                                        tokenizer.decode(seq.tokens, skip_special_tokens=True)))
        episode.messages.append(reply)
        outcome = env.step(history, reply)
        episode.tool_calls += len(calls)
        episode.tool_errors += sum(m.get("role") == "tool" and str(m.get("content", "")).startswith("Error:")
                                   for m in outcome.messages)
        if outcome.done:
            episode.reward, episode.parts, episode.ended = outcome.reward, dict(outcome.parts), "done"
            return False
        if turn == max_turns - 1:
            episode.ended = "max_turns"
            return False
        tokens, obs_text = observation_tokens(tokenizer, history, text, outcome.messages, schemas)
        episode.segments.append(Segment("observation", tokens, text=obs_text))
        episode.messages.extend(outcome.messages)
        if len(episode.tokens) + max_tokens > max_episode_tokens:
            episode.ended = "max_tokens"
            return False
        return True

    pending = {i: (0, sample(i, 0)) for i in range(len(envs))}  # episode -> (its turn, that turn's future)
    while pending:
        for i in _finished(pending):  # in episode order: the environments step in a fixed order
            turn, future = pending.pop(i)
            if play(i, turn, future.result()):
                pending[i] = (turn + 1, sample(i, turn + 1))
    return episodes


def _finished(pending: dict) -> list[int]:
    """The episodes whose turn is back, at least one (waiting for the first). The SDK's futures give a standard
    concurrent future (`.future()`); a sampler whose futures do not is waited on in episode order."""
    waitable = {i: getattr(future, "future", lambda f=future: f)() for i, (_, future) in pending.items()}
    if not all(isinstance(f, concurrent.futures.Future) for f in waitable.values()):
        return [min(pending)]
    concurrent.futures.wait(list(waitable.values()), return_when=concurrent.futures.FIRST_COMPLETED)
    return sorted(i for i, f in waitable.items() if f.done())


def group_advantages(episodes: list[Episode]) -> np.ndarray:
    """GRPO's: each episode's reward minus its group's mean (the episodes of one environment's problem)."""
    rewards = np.array([e.reward for e in episodes], dtype=float)
    return rewards - rewards.mean()
