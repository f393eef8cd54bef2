"""Token metering and prices: what each request processed, and what that costs.

Three meters, as Tinker and SageMaker bill them: prefill (prompt tokens of sampling and
compute_logprobs, and tokens of forward-only passes), sample (generated tokens) and train
(tokens of forward_backward datums). Prices are per million tokens per base model, from
`prices.toml` beside this file or the file STEPWISE_PRICES names.

A forward(_backward) is billed for every token it sends, as Tinker bills it, whatever the backend
saves: rows that share a prefix compute it once (engine/prefix_tree.py), and the ledger row's metrics show
what the model ran under COMPUTED beside the billed count, so a user sees the saving and the price
stays what the request alone decides (not what it happened to be batched with).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_PRICES = Path(__file__).with_name("prices.toml")
KINDS = ("prefill", "sample", "train")
COMPUTED = "computed_tokens"  # a forward(_backward)'s ledger metric: the tokens the model ran
# A forward(_backward)'s ledger metric: what its loss counts over (see loss_tokens), so a summary can show the
# loss per token as a notebook prints it (loss:sum / weights), not only the sum.
LOSS_TOKENS = "loss_tokens"


@dataclass
class Usage:
    prefill_tokens: int = 0
    sample_tokens: int = 0
    train_tokens: int = 0

    def cost(self, price: dict[str, float]) -> float:
        return (
            self.prefill_tokens * price["prefill"] + self.sample_tokens * price["sample"] + self.train_tokens * price["train"]
        ) / 1e6


def loss_tokens(data, loss_fn: str) -> float:
    """The tokens a forward(_backward)'s loss counts over, from its datums (kernel_backend.types.Datum): for
    cross_entropy the sum of their "weights" (1 a token where a datum has none), for the other losses the
    positions whose "advantages" are not zero (an RL datum's policy tokens: a prompt's and a tool's carry none).
    loss:sum / loss_tokens is the loss per token the notebooks print (workbench.recipes.common.weighted_nll)."""
    total = 0.0
    for datum in data:
        inputs = datum.loss_fn_inputs
        if loss_fn == "cross_entropy":
            weights = inputs.get("weights")
            total += len(datum.tokens) if weights is None else float(np.asarray(weights, dtype=np.float64).sum())
        elif "advantages" in inputs:
            advantages = np.asarray(inputs["advantages"])
            total += float(np.count_nonzero(advantages.reshape(len(advantages), -1).any(axis=1)))
    return total


class Prices:
    def __init__(self, path: str | Path | None = None) -> None:
        path = Path(path) if path else DEFAULT_PRICES
        with open(path, "rb") as f:
            table = tomllib.load(f)
        for model, price in table.items():
            missing = [k for k in KINDS if k not in price]
            if missing:
                raise ValueError(f"{path}: prices for {model!r} lack {missing}; give prefill, sample and train per 1M tokens")
        if "default" not in table:
            raise ValueError(f"{path}: needs a [default] table of prices")
        self.table = table

    def for_model(self, base_model: str) -> dict[str, float]:
        return self.table.get(base_model, self.table["default"])

    def cost(self, base_model: str, usage: Usage) -> float:
        return usage.cost(self.for_model(base_model))


def format_cost(cost: float, symbol: str = "$") -> str:
    """A cost as the JupyterLab extension writes it (extension/src/format.ts, formatCost): below a
    cent three significant digits, so a small model's fractions of a cent do not all read $0.00."""
    if not math.isfinite(cost) or cost <= 0:
        return f"{symbol}0.00"
    if cost >= 1:
        return f"{symbol}{cost:.2f}"
    if cost >= 0.01:
        return f"{symbol}{cost:.4f}"
    return f"{symbol}{cost:.{min(20, 2 - math.floor(math.log10(cost)))}f}"
