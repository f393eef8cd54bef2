"""Planning a run's cost before it runs: each recipe's estimate(config).

A recipe's `planned_tokens(config, assume)` walks the loop its run() would walk, with no backend,
and counts each metered call's tokens as the backend meters them (kernel_backend/execution/scheduler.py):
a sample request bills its prompt once however many answers it asks for; compute_logprobs is the
SDK's sample request of max_tokens=1, so the whole sequence is prefill and one token is sampled;
forward is prefill, forward_backward is train, and forward_backward_custom is both (the SDK runs a
forward for the logprobs, then a forward_backward on the same data). optim_step, saving weights and
making samplers cost nothing. Prompt and data lengths come from the very data the run will use, so
they are exact; what no plan knows is how long each sampled answer will be and how many answers are
trained on (RL drops tied groups, the preference rule drops tied pairs): `Assumed` says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx

from kernel_backend.metering import Prices, Usage
from workbench.recipes.common import BaseConfig, read_jsonl, runs_dir


@dataclass
class Assumed:
    """What an estimate assumes about sampling. The default is the upper bound: every answer runs to
    its call's max_tokens, every group or pair is trained on."""

    completion: float | None = None  # mean tokens per sampled answer; None: each call's max_tokens
    kept: float = 1.0                # share of prompts whose answers are trained on (RL groups, preference pairs)
    source: str = ""                 # the metrics file these were measured in

    def answer(self, max_tokens: int) -> float:
        """The tokens assumed for one answer of a call that may generate max_tokens."""
        return float(max_tokens) if self.completion is None else min(self.completion, float(max_tokens))


@dataclass
class Tally:
    """Tokens by meter, added call by call (fractions allowed: an assumed mean length times a count)."""

    prefill: float = 0.0
    sample: float = 0.0
    train: float = 0.0

    def sample_request(self, prompt: int, num_samples: int, answer: float) -> None:
        self.prefill += prompt  # once per request, not per answer
        self.sample += num_samples * answer

    def compute_logprobs(self, sequence: float, times: float = 1) -> None:
        self.prefill += times * sequence
        self.sample += times  # the one token of its max_tokens=1 request

    def forward(self, inputs: Iterable[float]) -> None:
        self.prefill += sum(inputs)

    def forward_backward(self, inputs: Iterable[float]) -> None:
        self.train += sum(inputs)

    def forward_backward_custom(self, inputs: Iterable[float]) -> None:
        inputs = list(inputs)
        self.forward(inputs)
        self.forward_backward(inputs)

    def usage(self) -> Usage:
        return Usage(round(self.prefill), round(self.sample), round(self.train))


def datum_input(prompt: int, answer: float) -> float:
    """A datum's input length (what forward and forward_backward bill): prompt + answer, less the last
    token, which is only a target."""
    return prompt + answer - 1


@dataclass
class Estimate:
    """A run's tokens by meter and its cost before it runs (each recipe's estimate(config)).

    `prefill_tokens`, `sample_tokens`, `train_tokens` and `cost` are the typical run: sampled answers
    as long as a previous run of the recipe measured them, and as many groups trained on. Without a
    previous run they are the upper bound. `upper` / `upper_cost` always take every answer at
    max_tokens and every group trained on: the run cannot cost more (its prompts and data are counted
    exactly). `assumption` says which figures were used."""

    recipe: str
    base_model: str
    prefill_tokens: int
    sample_tokens: int
    train_tokens: int
    cost: float
    upper: Usage
    upper_cost: float
    assumption: str

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.sample_tokens + self.train_tokens

    def versus(self, actual: float) -> str:
        """One line: this estimate against what the run cost (Summary.spent)."""
        return (f"estimate ${self.cost:.6f} vs actual ${actual:.6f} (actual / estimate {actual / self.cost:.2f}; "
                f"upper bound ${self.upper_cost:.6f})")

    def describe(self) -> str:
        def by_kind(prefill, sample, train):
            return f"prefill {prefill:,}, sample {sample:,}, train {train:,} tokens"

        return "\n".join([
            f"{self.recipe} estimate: ${self.cost:.6f} (upper bound ${self.upper_cost:.6f}) on {self.base_model}",
            f"  typical: {by_kind(self.prefill_tokens, self.sample_tokens, self.train_tokens)}",
            f"  upper:   {by_kind(self.upper.prefill_tokens, self.upper.sample_tokens, self.upper.train_tokens)}",
            f"  {self.assumption}",
        ])

    __str__ = describe

    def __repr__(self) -> str:
        return self.describe()

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.describe())}</pre>"


def previous_metrics(recipe: str, config: BaseConfig) -> Path | None:
    """The metrics file of the latest earlier run of `recipe`: config.metrics_path when it exists (a run
    of this config wrote it), else the newest $STEPWISE_HOME/runs/<recipe>-<time>.jsonl, if any."""
    if config.metrics_path and Path(config.metrics_path).exists():
        return Path(config.metrics_path)
    runs = sorted(runs_dir().glob(f"{recipe}-[0-9]*.jsonl"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def measured(path: Path, kept_share: Callable[[list[dict]], float | None] | None = None) -> Assumed | None:
    """What a previous run's metrics measured: the mean tokens per sampled answer (its rows' sample_tokens
    over their samples) and, with `kept_share(rows)`, the share of prompts whose answers it trained on;
    None when the file has no sampling rows."""
    rows = read_jsonl(path)
    sampled = [r for r in rows if r.get("samples")]
    if not sampled:
        return None
    completion = sum(r["sample_tokens"] for r in sampled) / sum(r["samples"] for r in sampled)
    kept = kept_share(rows) if kept_share else None
    return Assumed(completion, 1.0 if kept is None else kept, str(path))


def prices_for(config: BaseConfig) -> dict[str, float]:
    """USD per million tokens by meter for config.base_model: the backend's own (POST /api/v1/usage/estimate)
    when the config names one, else the local price table (kernel_backend/prices.toml, or $STEPWISE_PRICES:
    what a local backend charges)."""
    if config.base_url and config.api_key:
        response = httpx.post(f"{config.base_url.rstrip('/')}/api/v1/usage/estimate", json={"base_model": config.base_model},
                              headers={"X-API-Key": config.api_key}, timeout=30)
        response.raise_for_status()
        return response.json()["prices_per_million"]
    return Prices(os.environ.get("STEPWISE_PRICES") or None).for_model(config.base_model)


def estimate_run(recipe: str, config: BaseConfig, planned_tokens: Callable[[Any, Assumed], Tally],
                 previous: str | Path | None = None,
                 kept_share: Callable[[list[dict]], float | None] | None = None) -> Estimate:
    """The Estimate of a recipe's run: its `planned_tokens` walked twice, once at the upper bound and once
    with what the previous run measured (`previous`, a metrics JSONL; default: previous_metrics())."""
    upper = planned_tokens(config, Assumed()).usage()
    path = Path(previous) if previous else previous_metrics(recipe, config)
    assume = measured(path, kept_share) if path and path.exists() else None
    if assume is None:
        typical = upper
        assumption = (f"no previous {recipe} run measured: every sampled answer counted at max_tokens, all trained on "
                      f"(the upper bound: answers that stop early cost less)")
    else:
        typical = planned_tokens(config, assume).usage()
        kept = f", the answers to {assume.kept:.0%} of prompts trained on" if kept_share else ""
        assumption = (f"typical: {assume.completion:.1f} tokens per sampled answer{kept}, as measured in "
                      f"{assume.source}; upper: every answer max_tokens, all trained on")
    price = prices_for(config)
    return Estimate(recipe, config.base_model, typical.prefill_tokens, typical.sample_tokens, typical.train_tokens,
                    typical.cost(price), upper, upper.cost(price), assumption)
