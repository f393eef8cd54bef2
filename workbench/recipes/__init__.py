"""The cookbook: small recipes built from a few shared pieces (workbench.recipes.common).

Each recipe module has a `Config` dataclass, `run(config, service_client=None, on_step=None)
-> Summary` and `estimate(config) -> estimates.Estimate` (the run's tokens by kind and cost, from the
config alone, before it runs), and runs as a script (`python -m workbench.recipes.<name> --steps
10 ...`; with no --base-url it uses the local backend through workbench.connect(), started if none
runs). Every step's metrics go to a JSONL file ($STEPWISE_HOME/runs by default) and to
`on_step(row)` (a notebook plots them: `common.plot_to(dashboard, "reward")`); the Summary at the
end reads tokens and cost from the backend's usage API, and gives the cost per unit of progress.

- sft:          chat SFT on a JSONL of conversations (ships made-up facts to learn)
- rl:           RL with a locally computed verifier reward on a generated arithmetic task
- preference:   two samples per prompt, a scripted label, DPO via forward_backward_custom
- distillation: on-policy distillation from the base model behind a hidden system prompt

Import the modules themselves (`from workbench.recipes import sft`); nothing heavy loads here.
"""

from workbench.recipes.common import BaseConfig, MetricsLog, Summary

__all__ = ["BaseConfig", "MetricsLog", "Summary"]
