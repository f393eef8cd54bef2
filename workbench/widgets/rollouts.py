"""The rollout inspector: a table of prompts, completions, rewards and advantages.

    inspector = workbench.RolloutInspector(df, tokenizer=tokenizer)   # or rollouts_frame(...)
    inspector.filter("reward > 0").sort_by("advantage", ascending=False)
    inspector.select(3)             # shows row 3's completion tokens, coloured
    inspector.color_by = "advantage"

`df` (a pandas DataFrame, or a list of dicts) has columns prompt and completion, usually reward and
advantage, and per token: `tokens` (ids, or strings), `logprobs`, optionally `token_advantages`
(else the row's advantage colours every token). Filtering is pandas `DataFrame.query`; selecting is
by the frame's index label. State is traitlets: the browser sets query / sort_column / ascending /
selected / color_by and Python recomputes `rows` and `tokens_html` (so tests drive it the same way).
"""

from __future__ import annotations

import html
from pathlib import Path

import anywidget
import numpy as np
import pandas as pd
import traitlets as t

from workbench.widgets.tokens import token_html, token_pieces

PER_TOKEN = ("tokens", "logprobs", "token_advantages")  # list columns: shown in the detail, not the table
CELL_CHARS = 120


def rollouts_frame(prompts, responses, rewards, tokenizer=None, advantages=None) -> pd.DataFrame:
    """A rollout table from sampling results: one row per sampled sequence.

    `prompts[i]` (text) was sampled into `responses[i]` (a tinker SampleResponse), scored
    `rewards[i]` (one per sequence). Advantages default to reward minus the group's mean reward
    (the cookbook's choice).
    """
    rows = []
    for group, (prompt, response, group_rewards) in enumerate(zip(prompts, responses, rewards)):
        group_rewards = np.asarray(group_rewards, dtype=float)
        group_adv = group_rewards - group_rewards.mean() if advantages is None else np.asarray(advantages[group])
        for seq, reward, advantage in zip(response.sequences, group_rewards, group_adv):
            tokens = list(seq.tokens)
            rows.append({
                "group": group, "prompt": prompt,
                "completion": tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens)),
                "reward": float(reward), "advantage": float(advantage),
                "tokens": tokens, "logprobs": list(seq.logprobs) if seq.logprobs is not None else None,
            })
    return pd.DataFrame(rows)


def _cell(value):
    if isinstance(value, (float, np.floating)):
        return round(float(value), 4)
    if isinstance(value, (int, np.integer, bool, np.bool_)):
        return value.item() if hasattr(value, "item") else value
    text = str(value)
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


class RolloutInspector(anywidget.AnyWidget):
    _esm = Path(__file__).with_name("rollouts.js")
    columns = t.List().tag(sync=True)
    rows = t.List().tag(sync=True)  # the visible rows, each {"_index": label, column: cell}
    total = t.Int(0).tag(sync=True)
    query = t.Unicode("").tag(sync=True)
    sort_column = t.Unicode("").tag(sync=True)
    ascending = t.Bool(True).tag(sync=True)
    selected = t.Int(-1).tag(sync=True)  # index label of the selected row; -1: none
    color_by = t.Enum(["logprob", "advantage"], "logprob").tag(sync=True)
    tokens_html = t.Unicode("").tag(sync=True)
    error = t.Unicode("").tag(sync=True)

    def __init__(self, rollouts, tokenizer=None, max_rows: int = 200):
        super().__init__()
        frame = rollouts if isinstance(rollouts, pd.DataFrame) else pd.DataFrame(list(rollouts))
        missing = {"prompt", "completion"} - set(frame.columns)
        if missing:
            raise ValueError(f"rollouts need columns {sorted(missing)}")
        self.df = frame.reset_index(drop=True)  # integer labels: the browser selects by them
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.view = self.df
        self.columns = [c for c in self.df.columns if c not in PER_TOKEN]
        self.total = len(self.df)
        self.observe(self._update_view, names=["query", "sort_column", "ascending"])
        self.observe(self._update_tokens, names=["selected", "color_by"])
        self._update_view()

    # ---- the Python API (the browser sets the same traitlets) --------------------------------------

    def filter(self, query: str = "") -> "RolloutInspector":
        """Keep the rows matching a pandas query ("reward > 0 and advantage < 0"); "" shows all."""
        self.query = query
        if self.error:
            raise ValueError(self.error)
        return self

    def sort_by(self, column: str, ascending: bool = True) -> "RolloutInspector":
        if column and column not in self.df.columns:
            raise KeyError(f"no column {column!r}; columns: {list(self.df.columns)}")
        with self.hold_trait_notifications():
            self.sort_column, self.ascending = column, ascending
        return self

    def select(self, index: int) -> str:
        """Select a row by index label; returns the HTML of its coloured tokens."""
        self.selected = int(index)
        return self.tokens_html

    # ---- recomputing ----------------------------------------------------------------------------

    def _update_view(self, change=None) -> None:
        view = self.df
        try:
            if self.query.strip():
                view = view.query(self.query)
            self.error = ""
        except Exception as error:  # a typo in the filter box: say so, keep showing everything
            self.error = f"filter {self.query!r}: {error}"
        if self.sort_column:
            view = view.sort_values(self.sort_column, ascending=self.ascending, kind="stable")
        self.view = view
        self.rows = [{"_index": int(label), **{c: _cell(row[c]) for c in self.columns}}
                     for label, row in view.head(self.max_rows).iterrows()]

    def _update_tokens(self, change=None) -> None:
        if self.selected < 0 or self.selected not in self.df.index:
            self.tokens_html = ""
            return
        self.tokens_html = self.row_html(self.selected, self.color_by)

    def row_html(self, index: int, mode: str = "logprob") -> str:
        """A row's prompt, reward/advantage, and completion tokens coloured by `mode`."""
        row = self.df.loc[index]
        tokens = row.get("tokens")
        if tokens is None or (isinstance(tokens, float) and np.isnan(tokens)):
            body = f"<div style='white-space:pre-wrap'>{html.escape(str(row['completion']))}</div>"
        else:
            tokens = list(tokens)
            pieces = [str(x) for x in tokens] if tokens and isinstance(tokens[0], str) else token_pieces(tokens, self.tokenizer)
            body = token_html(pieces, self._token_values(row, len(tokens), mode), mode, legend=True)
        facts = " · ".join(f"{k} {_cell(row[k])}" for k in ("reward", "advantage") if k in row.index)
        return (f"<div style='font:12px sans-serif'><b>row {index}</b> · {facts} · coloured by {mode}"
                f"<div style='color:#555;white-space:pre-wrap'>{html.escape(str(row['prompt']))}</div>{body}</div>")

    @staticmethod
    def _token_values(row, n: int, mode: str):
        if mode == "logprob":
            values = row.get("logprobs")
        elif mode == "advantage":
            values = row.get("token_advantages")
            if values is None or (isinstance(values, float) and np.isnan(values)):
                values = [float(row["advantage"])] * n if "advantage" in row.index else None
        else:
            raise ValueError(f"color_by must be 'logprob' or 'advantage', not {mode!r}")
        if values is None or (isinstance(values, float) and np.isnan(values)):
            return None
        return [float(v) for v in values]
