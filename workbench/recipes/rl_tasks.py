"""The rl recipe's tasks: what a custom task implements (`Task`), the arithmetic task the recipe trains by
default (`AdditionTask`), and the tasks a config may name (`TASKS`, `task_for`).

A task is passed as `rl.Config(task=MyTask())` (workbench/recipes/rl.py re-exports these names, so
`rl.Task`, `rl.Problem` and `rl.AdditionTask` are the ones to use).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kernel_backend import tool_calls
from workbench.recipes import common

if TYPE_CHECKING:  # annotations only: rl.py imports this module
    from workbench.recipes.rl import Config


@dataclass
class Problem:
    question: str
    answer: str = ""
    operands: tuple[int, ...] = ()


class Task:
    """What the recipe asks of a task. Subclass it (or write any class with these methods) and pass
    an instance, `rl.Config(task=MyTask())`:

    - `problems(n, rng)`: n fresh problems (`Problem(question, answer)`), drawn with the numpy generator;
    - `render(tokenizer, problem)`: the prompt's tokens (here: the question as one user turn of the
      chat template; override it for a system prompt or few-shot turns);
    - `reward(text, problem)`: the number the policy is trained to raise;
    - `grade(text, problem)`: the reward's parts, {name: value}, each logged per step and stored with
      the rollouts (none here);
    - `eval_metric`: what the held-out eval averages, "reward" or one of grade's parts.

    A multi-turn task (tools, a game, a simulated user) has `env(problem)` instead of render, reward and
    grade: a fresh environment per answer (workbench/recipes/episodes.py: `reset()`, `step(history, reply)`),
    and `tools`, the episodes.Tool list offered in every episode. Each answer is then an episode of up to
    `max_turns` policy turns, rewarded by its environment, trained as one datum in which only the
    policy's tokens carry the advantage; its turns, tool calls and tool errors are logged as reward parts,
    and so are the grades its environment gives the answer (episodes.Step.parts: `ToolEnv(strict=True)`'s
    answer, tool_use and format), which the dashboard can plot and the inspector shows per episode.
    """

    eval_metric = "reward"

    def problems(self, n: int, rng: np.random.Generator) -> list[Problem]:
        raise NotImplementedError("a task's problems(n, rng) returns n Problem(question, answer)")

    def render(self, tokenizer, problem: Problem) -> list[int]:
        if hasattr(self, "env"):  # a multi-turn task: its first turn's prompt, the tools offered
            return tool_calls.render(tokenizer, self.env(problem).reset(), tool_schemas(self))
        return common.user_prompt(tokenizer, problem.question)

    def grade(self, text: str, problem: Problem) -> dict[str, float]:
        return {}

    def reward(self, text: str, problem: Problem) -> float:
        raise NotImplementedError("a task's reward(text, problem) scores one reply")


class AdditionTask(Task):
    """Questions "What is a plus b? Reply with only the number." for a, b in [low, high].

    The verifier is strict: a reply is correct when it is the sum and nothing else, allowing only a
    restatement of the question before it ("4 + 3 = 7", "4 plus 3 equals 7.", "The answer is 7")
    and a final full stop. "5 + 5 = 10 Snakes, following" is wrong: the prompt asked for the
    number only. A second, separate check, `format`, is 1 when the reply is exactly a number (right
    or wrong): the instruction followed to the letter. The training reward is
    `correct + format_weight * format` (format_weight 0 by default: the format is logged, not
    trained on); the held-out eval counts `correct` only.
    """

    eval_metric = "correct"

    def __init__(self, low: int = 1, high: int = 9, template: str = "What is {a} plus {b}? Reply with only the number.",
                 format_weight: float = 0.0):
        self.low, self.high, self.template, self.format_weight = low, high, template, format_weight

    def problems(self, n: int, rng: np.random.Generator) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(self.low, self.high + 1, size=2))
            out.append(Problem(self.template.format(a=a, b=b), str(a + b), (a, b)))
        return out

    @staticmethod
    def grade(text: str, problem: Problem) -> dict[str, float]:
        """{"correct": 0 or 1, "format": 0 or 1} for one reply (see the class docstring)."""
        a, b = (re.escape(str(x)) for x in problem.operands) if problem.operands else ("", "")
        restated = rf"(?:the answer is|{a}\s*(?:\+|plus)\s*{b}\s*(?:=|is|equals))\s*" if a else r"(?:the answer is)\s*"
        answer = re.fullmatch(rf"\s*(?:{restated})?(-?\d+)\s*\.?\s*", text, flags=re.IGNORECASE)
        only_number = re.fullmatch(r"\s*-?\d+\s*\.?\s*", text) is not None
        return {"correct": float(answer is not None and answer.group(1) == problem.answer),
                "format": float(only_number)}

    def reward(self, text: str, problem: Problem) -> float:
        grade = self.grade(text, problem)
        return grade["correct"] + self.format_weight * grade["format"]


TASKS = {"addition": AdditionTask}  # config.task by name: each is built with (high=max_operand, format_weight=)


def task_for(config: Config):
    if not isinstance(config.task, str):
        return config.task
    if config.task not in TASKS:
        raise ValueError(f"unknown task {config.task!r}: one of {', '.join(TASKS)}, or pass a Task instance")
    return TASKS[config.task](high=config.max_operand, format_weight=config.format_weight)


def tool_schemas(task) -> list[dict] | None:
    return [t.schema for t in task.tools] if getattr(task, "tools", None) else None
