"""The cost meter: live prefill / sample / train tokens and money, and estimate_cost() before a call.

Scopes: one session, one training run (its own requests and the sampling done with its weights:
its rollouts), or the whole kernel (every session this kernel's connect() clients opened). The numbers come from the backend's usage ledger (GET /api/v1/usage),
the single source of truth: nothing is counted on the client.

    meter = workbench.CostMeter()                          # the whole kernel
    meter = workbench.CostMeter(training_run_id=tc.model_id)
    workbench.estimate_cost(datums=batch)                  # what a forward_backward would cost

When the scope has a budget (workbench.connect(budget_usd=...), workbench.set_budget), the meter
shows what was spent of it as a bar with "$0.41 of $0.50 (82%)": its colour follows the backend's
state of the budget (normal, amber from 80%: "warning", red: "exhausted", when the backend refuses
more work). The kernel scope shows the tightest of its sessions' budgets and the tenant's. Requests the
backend refused in the scope (402 over a budget, 429 over a rate limit) show in red with the server's message.
"""

from __future__ import annotations

import math
from pathlib import Path

import anywidget
import traitlets as t

from kernel_backend.metering import format_cost
from workbench.client.connection import refusal_text, run_id_of, session_id_of  # noqa: F401 - here too, where the widgets import them
from workbench.widgets.polling import Poller

KINDS = ("prefill", "sample", "train")


def budget_text(budget: dict, symbol: str = "$") -> str:
    """What was spent of a budget: "$0.41 of $0.50 (82%)", "1,200 of 5,000 tokens (24%)", or both
    joined by " · ". The same text as the JupyterLab extension's (extension/src/format.ts, budgetText).

    Each amount of money keeps two significant digits, and two decimals at least ("$0.41 of $0.50",
    "$0.000024 of $0.00010"): a small model's steps cost fractions of a cent. The percentage is the
    backend's `fraction` rounded down, so it never reads 80% before the budget is in its warning state."""
    def money(amount: float) -> str:
        places = min(20, max(2, 1 - math.floor(math.log10(amount)))) if amount > 0 else 2
        return f"{symbol}{amount:.{places}f}"

    parts = []
    if budget.get("budget_usd") is not None:
        parts.append(f"{money(float(budget.get('spent_usd') or 0))} of {money(float(budget['budget_usd']))}")
    if budget.get("budget_tokens") is not None:
        parts.append(f"{int(budget.get('spent_tokens') or 0):,} of {int(budget['budget_tokens']):,} tokens")
    return " · ".join(parts) + f" ({math.floor(float(budget.get('fraction') or 0) * 100 + 1e-9)}%)"


def usage_scope(connection, session=None, training_run_id=None):
    """(label, fetch) for a scope: fetch(after) returns the usage API's answer for it."""
    session_id, run_id = session_id_of(session), run_id_of(training_run_id)
    if session_id is None and run_id is None:
        return "kernel", lambda after=0: connection.kernel_usage()
    name = getattr(session, "_display_name", None)  # a ServiceClient knows its session's name
    label = f"run {run_id}" if run_id else f"session {session_id}" + (f" ({name})" if name else "")
    return label, lambda after=0: connection.usage(session_id=session_id, training_run_id=run_id, after=after)


class CostMeter(anywidget.AnyWidget):
    """Tokens and money for a scope, refreshed every `poll_interval` seconds (None: only on refresh()).

    The numbers are traitlets (prefill_tokens, ..., cost, by_kind); `rows` is the table as the
    browser shows it, formatted here once ([label, tokens, cost] per kind, then the total);
    `budget` is the scope's budget (the usage API's, with its spent, fraction and state) and
    `budget_text` what the bar beside it says."""

    _esm = Path(__file__).with_name("cost.js")  # the front end
    scope = t.Unicode("kernel").tag(sync=True)
    prefill_tokens = t.Int(0)
    sample_tokens = t.Int(0)
    train_tokens = t.Int(0)
    requests = t.Int(0)
    cost = t.Float(0.0)
    by_kind = t.Dict()
    currency = t.Unicode("USD")
    rows: t.List[list] = t.List().tag(sync=True)
    budget = t.Dict().tag(sync=True)  # the scope's budget as the backend counts it ({} when it has none)
    budget_text = t.Unicode("").tag(sync=True)  # budget_text(budget), drawn beside the bar
    error = t.Unicode("").tag(sync=True)
    # The requests the backend refused in the scope (a budget's 402, a rate limit's 429: they bill nothing, so the
    # table never shows them): {"count", "last"} as the usage API gives it ({} when none), and the red line saying so.
    refusals = t.Dict().tag(sync=True)
    refused_text = t.Unicode("").tag(sync=True)

    def __init__(self, session=None, training_run_id=None, *, connection=None, poll_interval: float | None = 2.0):
        super().__init__()
        from workbench.client.connect import current

        self.connection = connection or current()
        self.scope, self._fetch = usage_scope(self.connection, session, training_run_id)
        self._poller = Poller(self.refresh, poll_interval or 0, on_error=lambda e: setattr(self, "error", str(e)))
        self.refresh()
        if poll_interval:
            self._poller.start()

    def refresh(self) -> dict:
        """Read the totals now; returns them (the usage API's `totals`)."""
        report = self._fetch(after=0)
        totals = report["totals"]
        symbol = "$" if report.get("currency", "USD") == "USD" else report["currency"] + " "
        with self.hold_sync():  # one message to the browser
            self.prefill_tokens = totals["prefill_tokens"]
            self.sample_tokens = totals["sample_tokens"]
            self.train_tokens = totals["train_tokens"]
            self.requests = totals["requests"]
            self.cost = totals["cost"]
            self.by_kind = totals["by_kind"]
            self.rows = [[kind, f"{totals[f'{kind}_tokens']:,}", format_cost(totals["by_kind"][kind]["cost"], symbol)]
                         for kind in KINDS] + [["total", f"{totals['requests']:,} requests",
                                                 format_cost(totals["cost"], symbol)]]
            self.budget = report.get("budget") or {}
            self.budget_text = budget_text(self.budget, symbol) if self.budget else ""
            self.refusals = report.get("refusals") or {}
            self.refused_text = refusal_text(self.refusals)
            self.error = ""
        return totals

    def stop(self) -> None:
        self._poller.stop()

    def close(self) -> None:
        self.stop()
        super().close()


def _token_list(item) -> list[int]:
    """Token ids from a tinker Datum (its model input), a ModelInput, or a plain list."""
    if hasattr(item, "model_input"):
        item = item.model_input
    if hasattr(item, "to_ints"):
        return list(item.to_ints())
    return [int(x) for x in item]


def estimate_cost(datums=None, prompts=None, *, num_samples: int = 1, max_tokens: int = 0,
                  base_model: str | None = None, prefill_tokens: int = 0, sample_tokens: int = 0,
                  train_tokens: int = 0, connection=None) -> dict:
    """Price a call before making it (POST /api/v1/usage/estimate).

    `datums`: what a forward_backward would train on (tinker Datums or token lists);
    `prompts` with `num_samples` and `max_tokens`: a sample call (an upper bound: every sample is
    assumed to run to max_tokens). Or give token counts directly. Returns tokens by kind and `cost`.
    """
    from workbench.client.connect import current

    body = {"prefill_tokens": prefill_tokens, "sample_tokens": sample_tokens, "train_tokens": train_tokens,
            "datums": [_token_list(d) for d in datums or []], "prompts": [_token_list(p) for p in prompts or []],
            "num_samples": num_samples, "max_tokens": max_tokens}
    if base_model is not None:
        body["base_model"] = base_model
    return (connection or current()).estimate(**body)
