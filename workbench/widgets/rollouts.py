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

A run's steps. `RolloutInspector.from_log(path)` reads the rollouts an RL run stored per step
(workbench/recipes/rollout_log.py): `steps` lists the steps kept, `step` is the one shown (the browser's
◀ ▶ and its step menu set it; `show_step(k)` too), and the rows are grouped by prompt, a group whose
rewards all tie marked (it teaches nothing: its centred advantages are 0) with why it was dropped.
`across_steps(prompt)` shows one prompt's answers at every step kept (the browser's "this prompt
across steps" on a selected row; `across_steps("")` goes back to the step).

Episodes. A row with `roles` (per token "policy" or "observation": a multi-turn task's answer, as
rollout_log stores it) is shown turn by turn: the policy's turns coloured by logprob or advantage, the
environment's (a tool's result, the chat template's text between turns) in grey boxes of their own,
never coloured: nobody sampled them and they carry no advantage. `summary` says in words
what the step was: its groups, how many mixed, tied, dropped, and its held-out probes' diversity.
"""

from __future__ import annotations

import html
from pathlib import Path

import anywidget
import numpy as np
import pandas as pd
import traitlets as t

from workbench.recipes.rollout_log import RolloutLog
from workbench.widgets.tokens import legend_html, token_html, token_pieces

PER_TOKEN = ("tokens", "logprobs", "token_advantages", "roles")  # list columns: shown in the detail, not the table
OBSERVATION_STYLE = ("background:#eef1f4;border-left:3px solid #8a96a3;padding:2px 6px;margin:3px 0;"
                     "color:#3d4650;white-space:pre-wrap;font-family:monospace")
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


def step_summary(groups: list[dict]) -> str:
    """One stored step in words: "step 7: 4 groups, 3 mixed, 1 tied (dropped: 1 tied, 0 filtered);
    8 held-out probe answers: 2 distinct"."""
    train = [g for g in groups if g.get("kind", "train") == "train"]
    probes = [g for g in groups if g.get("kind") == "probe"]
    tied = sum(bool(g.get("tied")) for g in train)
    text = f"step {groups[0]['step'] if groups else '?'}: {len(train)} groups, {len(train) - tied} mixed, {tied} tied"
    dropped = [g["dropped"] for g in train if g.get("dropped")]
    if dropped:
        text += f" (dropped: {dropped.count('tied')} tied, {dropped.count('filtered')} filtered)"
    answers = [c.strip() for g in probes for c in g["completions"]]
    if answers:
        text += f"; {len(answers)} held-out probe answers: {len(set(answers))} distinct"
    return text


def _cell(value):
    if isinstance(value, (float, np.floating)):
        return round(float(value), 4)
    if isinstance(value, (int, np.integer, bool, np.bool_)):
        return value.item() if hasattr(value, "item") else value
    text = str(value)
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


class RolloutInspector(anywidget.AnyWidget):
    _esm = Path(__file__).with_name("rollouts.js")
    columns: t.List[str] = t.List().tag(sync=True)
    rows: t.List[dict] = t.List().tag(sync=True)  # the visible rows, each {"_index": label, column: cell}
    total = t.Int(0).tag(sync=True)
    query = t.Unicode("").tag(sync=True)
    sort_column = t.Unicode("").tag(sync=True)
    ascending = t.Bool(True).tag(sync=True)
    selected = t.Int(-1).tag(sync=True)  # index label of the selected row; -1: none
    color_by = t.Enum(["logprob", "advantage"], "logprob").tag(sync=True)
    tokens_html = t.Unicode("").tag(sync=True)
    error = t.Unicode("").tag(sync=True)
    # A run's steps (from_log): the steps kept, the one shown (-1: rows not from a log), the prompt
    # followed across steps ("": none), and the shown step in words.
    steps: t.List[int] = t.List().tag(sync=True)
    step = t.Int(-1).tag(sync=True)
    history_prompt = t.Unicode("").tag(sync=True)
    summary = t.Unicode("").tag(sync=True)
    follow = t.Bool(True).tag(sync=True)  # refresh() moves to the newest step, until a step is chosen by hand
    label = t.Unicode("").tag(sync=True)  # whose rollouts these are (a run's name), shown before the steps

    def __init__(self, rollouts=(), tokenizer=None, max_rows: int = 200, store: RolloutLog | None = None,
                 label: str = ""):
        super().__init__(label=label)
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.store = store  # a run's stored rollouts (from_log), else None
        self._shown: tuple[int, str] | None = None  # the (step, history_prompt) whose rows are shown
        self._set_frame(rollouts)
        self.observe(self._update_view, names=["query", "sort_column", "ascending"])
        self.observe(self._update_tokens, names=["selected", "color_by"])
        self.observe(self._load, names=["step", "history_prompt"])
        self.on_msg(self._on_message)

    @classmethod
    def from_log(cls, log: "RolloutLog | str | Path", tokenizer=None, step: int | None = None,
                 max_rows: int = 200) -> "RolloutInspector":
        """An inspector over a run's stored rollouts (rl.Config's rollouts_dir), on `step` (default: the newest)."""
        inspector = cls(tokenizer=tokenizer, max_rows=max_rows, store=log if isinstance(log, RolloutLog) else RolloutLog(log))
        return inspector.refresh(step)

    def _set_frame(self, rollouts) -> None:
        frame = rollouts if isinstance(rollouts, pd.DataFrame) else pd.DataFrame(list(rollouts))
        missing = {"prompt", "completion"} - set(frame.columns)
        if missing and (len(frame) or self.store is None):  # an inspector on a log may start with no step yet
            raise ValueError(f"rollouts need columns {sorted(missing)}")
        self.df = frame.reset_index(drop=True)  # integer labels: the browser selects by them
        with self.hold_trait_notifications():
            self.columns = [c for c in self.df.columns if c not in PER_TOKEN]
            self.total = len(self.df)
            self.selected = -1
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

    # ---- a run's steps (from_log) -------------------------------------------------------------------

    def refresh(self, step: int | None = None) -> "RolloutInspector":
        """Re-read which steps the log keeps; show `step`, or else the newest (a run still going adds steps)."""
        self.steps = self._need_log().steps()
        if step is not None:
            return self.show_step(step)
        if self.steps and (self.follow or self.step not in self.steps) and not self.history_prompt:
            self.show_step(self.steps[-1])
        return self

    def show_log(self, store: RolloutLog, label: str = "") -> "RolloutInspector":
        """Show another run's stored rollouts (its newest step, unless show_step follows)."""
        self.store, self.label, self._shown = store, label, None
        with self.hold_trait_notifications():
            self.history_prompt, self.step = "", -1
        return self.refresh()

    def show_step(self, step: int) -> "RolloutInspector":
        """Show one step's groups (KeyError, naming the steps kept, for a step the log does not have)."""
        store = self._need_log()
        store.read(int(step))  # raises the KeyError that says which steps are kept
        if int(step) not in self.steps:
            self.steps = store.steps()
        with self.hold_trait_notifications():
            self.history_prompt = ""
            self.step = int(step)
        self._load()
        return self

    def across_steps(self, prompt: str) -> "RolloutInspector":
        """Show `prompt`'s answers at every step kept ("": back to the step)."""
        self._need_log()
        self.history_prompt = prompt
        self._load()
        return self

    def _on_message(self, widget, content, buffers) -> None:
        """The browser's "this prompt across steps" on the selected row (whose cell may be cut short)."""
        if content.get("type") == "across_steps" and self.store is not None and self.selected in self.df.index:
            self.across_steps(str(self.df.loc[self.selected, "prompt"]))

    def _need_log(self) -> RolloutLog:
        if self.store is None:
            raise ValueError("this inspector shows the table it was given; RolloutInspector.from_log(path) reads a run's steps")
        return self.store

    def _load(self, change=None) -> None:
        """Show the chosen step's rows, or the followed prompt's; once per choice (a browser's change
        and the Python call that made it both land here)."""
        shown = (self.step, self.history_prompt)
        if self.store is None or (self.step < 0 and not self.history_prompt) or shown == self._shown:
            return
        try:
            if self.history_prompt:
                rows = self.store.prompt_history(self.history_prompt)
                self.summary = (f"{self.history_prompt!r} at {len({r['step'] for r in rows})} steps: {len(rows)} answers"
                                " (◀ ▶ go back to one step)")
            else:
                rows = self.store.samples(self.step)
                self.summary = step_summary(self.store.read(self.step))
        except KeyError as error:
            self.error = str(error.args[0])
            return
        self._shown, self.error = shown, ""
        # Grouped by prompt: each group's answers together, the groups in the order they were sampled.
        self._set_frame(sorted(rows, key=lambda r: (r.get("step", 0), r.get("kind") != "train", r["group"])))

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
            values, roles = self._token_values(row, len(tokens), mode), _listed(row.get("roles"))
            body = turns_html(pieces, values, roles, mode) if roles else token_html(pieces, values, mode, legend=True)
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
        roles = _listed(row.get("roles")) or ["policy"] * n
        return [float(v) if v is not None and role == "policy" else None for v, role in zip(values, roles)]


def _listed(value) -> list | None:
    """A per-token column's list, or None where the row has none (pandas fills a missing one with NaN)."""
    return None if value is None or (isinstance(value, float) and np.isnan(value)) else list(value)


def turns_html(pieces: list[str], values: list | None, roles: list[str], mode: str) -> str:
    """An episode's tokens turn by turn: each run of the policy's tokens coloured by `mode`, each run of the
    environment's in a grey box, uncoloured; what the colours mean follows once, at one scale for all turns."""
    values = values or [None] * len(pieces)
    blocks, start = [], 0
    for end in range(1, len(roles) + 1):
        if end < len(roles) and roles[end] == roles[start]:
            continue
        if roles[start] == "policy":
            blocks.append('<div class="wb-turn" data-role="policy">' + token_html(pieces[start:end], values[start:end], mode)
                          + "</div>")
        else:
            blocks.append(f'<div class="wb-turn" data-role="observation" style="{OBSERVATION_STYLE}" '
                          f'title="the environment\'s tokens: not sampled, no advantage">{html.escape("".join(pieces[start:end]))}</div>')
        start = end
    finite = [abs(v) for v in values if v is not None and np.isfinite(v)]
    return "".join(blocks) + (legend_html(mode, max(finite) or 1.0) if finite else "")
