"""Tool-using conversations for a training loop of your own (docs/workbench.md, "A tool-using loop of your own"):
the public names for rendering tools, calls and tool replies in the model's chat template, parsing a sampled reply,
and building the datums, so a plain tinker loop renders exactly what the rl recipe and the server's OpenAI and
Anthropic routes render. It owns no logic: each name is the recipe's own function (workbench/recipes/episodes.py,
workbench/recipes/common.py, kernel_backend/tool_calls.py), re-exported or given tools as `Tool`s.

    prompt(tokenizer, messages, tools)       the first prompt's tokens: the tools offered, the assistant's turn opened
    reply(tokenizer, sampled_tokens)         the sampled turn as a chat message, its calls parsed
    call_tools(tools, calls)                 run the calls: one tool message each (an error becomes its text)
    after_reply(tokenizer, history, sampled_tokens, messages, tools)
                                             the tokens after the sampled turn: its closing, `messages` (the tools'
                                             replies), the next assistant turn opened; never a second system prompt
    Episode, Segment                         the token runs of an episode; Episode.datum(advantage): its RL datum
    sft_datum(tokenizer, messages, tools)    a conversation as a cross_entropy datum, weight 1 on the assistant's
                                             tokens, 0 on the rest
    parse(text)                              a reply's text as content and calls (tool_calls.Reply)
"""

from __future__ import annotations

from tinker import types

from kernel_backend import tool_calls
from kernel_backend.tool_calls import Reply, parse  # noqa: F401 - public here
from workbench.recipes import episodes
from workbench.recipes.episodes import Episode, Segment, Tool, call_tools  # noqa: F401 - public here
from workbench.recipes.episodes import reply_message as reply  # noqa: F401 - public here
from workbench.recipes import common


def schemas(tools: list[Tool] | None) -> list[dict] | None:
    """The tools' JSON schemas, as the chat template gets them."""
    return [t.schema for t in tools] if tools else None


def prompt(tokenizer, messages: list[dict], tools: list[Tool] | None = None) -> list[int]:
    """The conversation's tokens with the tools offered and the assistant's turn opened: an episode's first prompt."""
    return tool_calls.render(tokenizer, messages, schemas(tools))


def after_reply(tokenizer, history: list[dict], sampled_tokens: list[int], messages: list[dict],
                tools: list[Tool] | None = None) -> list[int]:
    """What follows a sampled turn in the episode's one token sequence: the rest of that turn's closing, then
    `messages` (the tools' replies, a user's turn) and the next assistant turn opened. `history` is the
    conversation before the sampled turn. Rendered as the difference of two renderings of the whole conversation,
    so nothing the template adds at a conversation's start (SmolLM2's default system prompt) is added again."""
    return episodes.observation_tokens(tokenizer, history, tokenizer.decode(sampled_tokens), messages,
                                       schemas(tools))[0]


def sft_datum(tokenizer, messages: list[dict], tools: list[Tool] | None = None) -> types.Datum:
    """A whole conversation (assistant turns with `tool_calls`, `role: tool` replies) as a cross_entropy datum:
    weight 1 on every assistant turn's tokens, 0 on the rest; the tokens are what an episode of it samples."""
    return common.chat_datum(tokenizer, messages, train_on="all_assistant", tools=schemas(tools))
