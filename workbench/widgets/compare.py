"""Compare checkpoints: the same prompts sampled from several samplers, side by side, one column each.

    cmp = workbench.widgets.compare.Compare({"base": s0, "run1 step 16": s1, "run2 step 24": s2},
                                            prompts, reward=lambda prompt, answer: float("Paris" in answer))
    display(cmp)
    cmp.sort("run1 step 16", "reward")     # or pick it in the dropdown; "" is the prompts' own order
    cmp.open_row(2)                            # row 2 (in the prompts' order) shows its answers token by token

Every prompt is sampled once from every sampler with the same SamplingParams (same seed, same
temperature, same max_tokens), so two columns differ only by their weights. All the requests are
submitted before any is waited for, so the backend batches them; a progress bar (the recipes'
tqdm, a widget in a notebook) counts the answers in.

A prompt is a string (one user turn, rendered with the tokenizer's chat template: the recipes'
`user_prompt`), a list of chat messages (`render_prompt`), a list of token ids, or a
`types.ModelInput`. `reward(prompt, answer_text) -> float` is the researcher's own; the mean
logprob is over the answer's tokens, from the logprobs the sampler returned.

State is plain traitlets, so tests read it without a browser: `columns` (the sampler names),
`rows` ([{prompt, answers: {name: {text, tokens, token_ids, logprobs, reward, mean_logprob,
length}}}], in the order shown), `sort_by` ("name:reward", "name:mean_logprob", "name:length" or
""), `ascending`, `opened` (a row's index in the prompts' order, -1 for none) and `html`, the
table as rendered. Each row is followed by a <details> line that opens its answers token by token
(coloured by logprob, tokens.token_html), in the browser with a click and from Python with open().
"""

from __future__ import annotations

import html as html_lib
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import ipywidgets as w
import traitlets as t
from tinker import types

from workbench.recipes.common import progress_bar, render_prompt, user_prompt
from workbench.widgets.tokens import legend_html, local_tokenizer, token_html, token_pieces

if TYPE_CHECKING:
    from tinker import SamplingClient

SORT_KEYS = ("reward", "mean_logprob", "length")
_STYLE = ("<style>.wb-cmp{border-collapse:collapse;font:12px sans-serif}.wb-cmp td,.wb-cmp th{border:1px solid #ddd;"
          "padding:3px 6px;vertical-align:top;text-align:left}.wb-cmp .wb-facts{color:#666;font-size:11px}"
          ".wb-cmp .wb-answer{white-space:pre-wrap}</style>")


def client_tokenizer(client):
    """The tokenizer of a sampling or training client: the local model store's for its base model
    (SamplingClient.get_tokenizer() asks the hub, offline it fails), else the SDK's get_tokenizer()."""
    try:
        return local_tokenizer(client.get_base_model())
    except Exception:  # noqa: BLE001 - a model this machine does not have: the SDK's way
        return client.get_tokenizer()


def prompt_tokens(prompt, tokenizer, system: str | None = None) -> tuple[str, list[int]]:
    """(the prompt as text to show, its model input tokens) for a string, chat messages, ids or ModelInput."""
    if isinstance(prompt, str):
        return prompt, user_prompt(tokenizer, prompt, system)
    if isinstance(prompt, types.ModelInput):
        ids = list(prompt.to_ints())
        return tokenizer.decode(ids), ids
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        return (users[-1] if users else str(prompt[-1].get("content", ""))), render_prompt(tokenizer, prompt)
    ids = [int(x) for x in prompt]
    return tokenizer.decode(ids), ids


def _mean(values: Sequence[float] | None) -> float | None:
    values = [float(v) for v in values or () if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


class Compare(w.VBox):
    columns: t.List[str] = t.List()
    rows: t.List[dict] = t.List()         # in the order shown (sorted); each carries "index", its place among the prompts
    sort_by = t.Unicode("")   # "sampler name:reward" | ":mean_logprob" | ":length"; "" keeps the prompts' order
    ascending = t.Bool(False)  # False: the highest first
    opened = t.Int(-1)
    html = t.Unicode("")

    def __init__(self, samplers: Mapping[str, SamplingClient], prompts, reward: Callable[[object, str], float] | None = None,
                 *, max_tokens: int = 64, seed: int = 0, temperature: float = 0.0,
                 sampling_params: types.SamplingParams | None = None, tokenizer=None, system: str | None = None,
                 progress: bool = True):
        if not samplers:
            raise ValueError("Compare needs at least one sampler: {name: SamplingClient}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("Compare needs at least one prompt")
        self.samplers = dict(samplers)
        self.prompts = prompts
        self.reward = reward
        self.tokenizer = tokenizer if tokenizer is not None else client_tokenizer(next(iter(self.samplers.values())))
        self.sampling_params = sampling_params or types.SamplingParams(max_tokens=max_tokens, seed=seed,
                                                                       temperature=temperature)
        self._sort = w.Dropdown(description="sort by", options=self._sort_options(), value="")
        self._order = w.Checkbox(description="lowest first", value=False, indent=False)
        self._table = w.HTML()
        super().__init__(children=[w.HBox([self._sort, self._order]), self._table])
        self.columns = list(self.samplers)
        # The widgets and the traitlets say the same thing: either side may be set.
        t.link((self._sort, "value"), (self, "sort_by"))
        t.link((self._order, "value"), (self, "ascending"))
        self._unsorted = self._sample(system, progress)
        self.observe(self._update, names=["sort_by", "ascending", "opened"])
        self._update()

    def _sort_options(self) -> list[tuple[str, str]]:
        keys = [k for k in SORT_KEYS if k != "reward" or self.reward is not None]
        return [("the prompts' order", "")] + [(f"{name} · {key.replace('_', ' ')}", f"{name}:{key}")
                                              for name in self.samplers for key in keys]

    # ---- sampling -----------------------------------------------------------------------------

    def _sample(self, system: str | None, progress: bool) -> list[dict]:
        inputs = [prompt_tokens(p, self.tokenizer, system) for p in self.prompts]
        # Everything is submitted before anything is waited for, so the backend batches the requests.
        futures = {(i, name): sampler.sample(types.ModelInput.from_ints(ids), 1, self.sampling_params)
                   for name, sampler in self.samplers.items() for i, (_, ids) in enumerate(inputs)}
        rows: list[dict[str, Any]] = [{"index": i, "prompt": text, "answers": {}} for i, (text, _) in enumerate(inputs)]
        bar = progress_bar(len(futures), "sampling", progress)
        try:
            for (i, name), future in futures.items():
                rows[i]["answers"][name] = self._answer(self.prompts[i], future.result().sequences[0])
                bar.update(1)
        finally:
            bar.close()
        return rows

    def _answer(self, prompt, sequence) -> dict:
        ids = [int(x) for x in sequence.tokens]
        logprobs = [float(v) for v in sequence.logprobs] if sequence.logprobs is not None else None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "tokens": token_pieces(ids, self.tokenizer), "token_ids": ids, "logprobs": logprobs,
                "reward": float(self.reward(prompt, text)) if self.reward is not None else None,
                "mean_logprob": _mean(logprobs), "length": len(ids)}

    # ---- the Python API (the dropdown and checkbox set the same traitlets) ------------------------

    def sort(self, sampler: str = "", key: str = "reward", ascending: bool = False) -> "Compare":
        """Order the rows by one sampler's `key` (reward, mean_logprob, length); no sampler: the prompts' order."""
        if sampler and sampler not in self.samplers:
            raise KeyError(f"no sampler {sampler!r}; samplers: {list(self.samplers)}")
        if sampler and key not in SORT_KEYS:
            raise ValueError(f"sort key must be one of {SORT_KEYS}, not {key!r}")
        if sampler and key == "reward" and self.reward is None:
            raise ValueError("no reward function was given, so there is no reward to sort by")
        with self.hold_trait_notifications():
            self.sort_by, self.ascending = (f"{sampler}:{key}" if sampler else ""), ascending
        return self

    def open_row(self, index: int) -> str:
        """Open row `index` (its place among the prompts) token by token; returns its answers' HTML."""
        if not 0 <= index < len(self._unsorted):
            raise IndexError(f"no row {index}; there are {len(self._unsorted)}")
        self.opened = int(index)
        return self.tokens_html(index)

    # ---- rendering ----------------------------------------------------------------------------

    def _sorted(self) -> list[dict]:
        if not self.sort_by:
            return list(self._unsorted)
        name, _, key = self.sort_by.rpartition(":")
        if name not in self.samplers or key not in SORT_KEYS:
            raise ValueError(f"sort_by {self.sort_by!r}: use 'sampler name:{'|'.join(SORT_KEYS)}' or ''")
        present = [r for r in self._unsorted if r["answers"][name][key] is not None]
        missing = [r for r in self._unsorted if r["answers"][name][key] is None]  # no value: always last
        return sorted(present, key=lambda r: r["answers"][name][key], reverse=not self.ascending) + missing

    def _update(self, change=None) -> None:
        self.rows = self._sorted()
        self.html = self._render()
        self._table.value = self.html

    def tokens_html(self, index: int) -> str:
        """Row `index`'s answers, one per sampler, each token coloured by its logprob."""
        row = self._unsorted[index]
        parts = [f"<div><b>{html_lib.escape(name)}</b> · {row['answers'][name]['length']} tokens"
                 + token_html(row["answers"][name]["tokens"], row["answers"][name]["logprobs"], "logprob")
                 + "</div>" for name in self.columns]
        return "".join(parts)

    def _render(self) -> str:
        heads = "".join(f'<th class="wb-sampler" data-sampler="{html_lib.escape(n, quote=True)}">'
                        f"{html_lib.escape(n)}</th>" for n in self.columns)
        body = []
        for row in self.rows:
            cells = []
            for name in self.columns:
                a = row["answers"][name]
                facts = (([f"reward {_fmt(a['reward'])}"] if self.reward is not None else [])
                         + [f"mean logprob {_fmt(a['mean_logprob'])}", f"{a['length']} tokens"])
                cells.append(f'<td><div class="wb-answer">{html_lib.escape(a["text"])}</div>'
                             f'<div class="wb-facts">{" · ".join(facts)}</div></td>')
            body.append(f'<tr class="wb-row" data-index="{row["index"]}"><td>{row["index"]}</td>'
                        f'<td class="wb-answer">{html_lib.escape(row["prompt"])}</td>{"".join(cells)}</tr>')
            opened = " open" if row["index"] == self.opened else ""
            body.append(f'<tr class="wb-tokens-row"><td></td><td colspan="{len(self.columns) + 1}">'
                        f"<details{opened}><summary>answers token by token</summary>"
                        f"{self.tokens_html(row['index'])}</details></td></tr>")
        sort = f"sorted by {html_lib.escape(self.sort_by)}" if self.sort_by else "in the prompts' order"
        params = self.sampling_params
        caption = (f"{len(self.rows)} prompts × {len(self.columns)} samplers, {sort} · each sampled with seed "
                   f"{params.seed}, temperature {params.temperature}, at most {params.max_tokens} tokens")
        return (f'{_STYLE}<div class="wb-compare"><div class="wb-facts" style="font:11px sans-serif;color:#666">'
                f'{caption}</div><table class="wb-cmp"><tr><th>#</th><th>prompt</th>{heads}</tr>{"".join(body)}'
                f"</table>{legend_html('logprob')}</div>")
