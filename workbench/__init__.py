"""Stepwise's notebook side: connect to a backend, watch training, label preferences.

    import workbench
    service = workbench.connect()              # a tinker.ServiceClient on the local backend (shared)
    tc = service.create_lora_training_client(base_model=..., rank=8).result()
    workbench.Dashboard(training_run_id=tc.model_id)
    workbench.set_budget(usd=0.50)             # the backend refuses (HTTP 402) what would pass it
    summary = await workbench.in_thread(rl.run, config)  # long work; the notebook's widgets stay live

The public names live in three packages (docs/architecture.md, "The map"): workbench.client (connecting,
the Connection, in_thread, going back to a step), workbench.recipes (the recipes and their training pieces:
DPO, preference labels, episodes, the rollout log) and workbench.widgets. The widgets and DPO helpers
load lazily (PEP 562), so `stepwise serve`, which imports workbench.cli, does not pull in plotly,
pandas and torch; connect() and the step functions (fork, sampler_at, undo) are imported eagerly.
"""

from __future__ import annotations

import importlib

from workbench.client.connect import budgets, connect, current, disconnect, remove_budget, set_budget
from workbench.client.connection import BackendError, Connection
from workbench.client.in_thread import Interrupted, in_thread
from workbench.client.past_steps import fork, kept_steps, lineage, sampler_at, undo

_EXPORTS = {
    # widgets
    "Dashboard": "workbench.widgets.dashboard", "CostMeter": "workbench.widgets.cost",
    "estimate_cost": "workbench.widgets.cost", "RolloutInspector": "workbench.widgets.rollouts",
    "rollouts_frame": "workbench.widgets.rollouts", "Labeler": "workbench.widgets.labeler",
    "read_labels": "workbench.widgets.labeler", "LiveLabeler": "workbench.widgets.live_labeler",
    "enable_reprs": "workbench.widgets.reprs",
    "token_html": "workbench.widgets.tokens", "Compare": "workbench.widgets.compare", "Probes": "workbench.widgets.probes",
    "Runs": "workbench.widgets.runs",
    # training helpers
    "dpo_loss": "workbench.recipes.dpo", "make_dpo_loss": "workbench.recipes.dpo",
    "preference_datums": "workbench.recipes.dpo", "add_reference_logprobs": "workbench.recipes.dpo",
}

__all__ = sorted([*_EXPORTS, "BackendError", "Connection", "Interrupted", "budgets", "connect", "current", "disconnect",
                  "fork", "in_thread", "kept_steps", "lineage", "remove_budget", "sampler_at", "set_budget", "undo"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
