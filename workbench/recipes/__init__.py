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

Beside them, the training pieces they use (a notebook's own loop may use them too):

- dpo:               DPO's loss (soft labels from strength) and the datums of preference pairs (preference)
- preference_labels: preference judgments as data: what each choice means, the JSONL files they travel in
- live_preference:   the live loop behind the LiveLabeler: sample pairs from the policy, DPO updates meanwhile
- episodes:          multi-turn episodes: tools, environments, the policy's turns as one token sequence (rl)
- tools:             the public names for a tool-using loop of your own (episodes and common, re-exported)
- rollout_log:       each RL step's rollouts, written by rl and read by the rollout inspector
- rl_tasks, rl_monitoring, rl_hacks: rl's tasks, its health metrics, the reward hacks it can be shown
- demo:              `stepwise demo`: sft then rl, headless

Import the modules themselves (`from workbench.recipes import sft`); nothing heavy loads here.
"""

from workbench.recipes.common import BaseConfig, MetricsLog, Summary

__all__ = ["BaseConfig", "MetricsLog", "Summary"]
