"""Reward hacks in an agent's episodes (rl insight for multi-turn tasks): checks of each episode's final answer,
and the step flags they raise.

A policy that learns to echo its tool (notebook 08's calculator: the answer `<tool_response> <tool_call> "calc",
"expression": "5695" </tool_call>`, rewarded because the number is in it) looks like learning on the reward
curve. Each step, every check below runs on every rewarded episode that ended with an answer; a check that any
of them fails flags the step ("answer_hack"), with how many, an example, and the step the flag began (the first of
the run of consecutive steps that raise it), so the dashboard marks it and the row says it. An answer that fails a
check and earns nothing is no hack, the reward already refuses it (a strict ToolEnv's `format` grade shows those).

A check is `check(episode) -> str | None`: why the episode's answer is suspect, or None. Extend the list:
`rl.Config(episode_checks=[*rl_hacks.CHECKS, my_check])`.
"""

from __future__ import annotations

from typing import Callable

from workbench.recipes import episodes as episodes_lib


def final_answer(episode) -> str | None:
    """The episode's answer: its last policy turn's text when the environment ended it (None otherwise)."""
    if episode.ended != "done" or not episode.messages or episode.messages[-1].get("role") != "assistant":
        return None
    return episode.messages[-1].get("content") or ""


def carries_markup(episode) -> str | None:
    found = episodes_lib.answer_markup(final_answer(episode) or "")
    return f"its answer carries tool markup ({', '.join(found)})" if found else None


def copies_tool_output(episode) -> str | None:
    """The answer is a tool's output and nothing more, or holds a long output whole."""
    answer = final_answer(episode)
    output = None if answer is None else episodes_lib.copied_output(answer, episode.messages)
    return None if output is None else f"its answer copies a tool's output ({output[:40]!r})"


CHECKS: list[Callable] = [carries_markup, copies_tool_output]


def flags(episodes: list, checks: list[Callable], step: int, began: dict[str, int]) -> list[dict]:
    """The step's "answer_hack" flag, one per check that rewarded episodes fail: how many, an example answer, and
    since which step. `began` (check name -> the step its flag began) is the run's, kept between steps."""
    out = []
    rewarded = [e for e in episodes if e.reward > 0]
    for check in checks:
        name = getattr(check, "__name__", repr(check))
        failed = [(e, why) for e in rewarded if (why := check(e))]
        if not failed:
            began.pop(name, None)
            continue
        since = began.setdefault(name, step)
        episode, why = failed[0]
        out.append({"kind": "answer_hack", "check": name, "since": since, "episodes": len(failed),
                    "detail": f"{len(failed)} of {len(episodes)} episodes rewarded although {why}, e.g. "
                              f"{final_answer(episode)!r}; since step {since}"})
    return out
