"""The notebook widgets, one concept per module: dashboard (loss/metrics/cost while training, runs
overlaid), runs (a session's runs as a tree of forks), compare (checkpoints side by side), probes
(what one step changed), cost (the cost meter and estimate_cost), rollouts (the rollout table),
labeler (preference judgments), live_labeler (the labeler fed by a training run, DPO updates meanwhile), reprs (HTML for the SDK's results), tokens (per-token colouring);
throttle and polling are the shared plumbing that keeps updates to a few per second (on threads of their
own: workbench/client/widget_states.py keeps the kernel's answer to a reloaded page safe from them)."""

from workbench.widgets.compare import Compare
from workbench.widgets.cost import CostMeter, estimate_cost
from workbench.widgets.dashboard import Dashboard
from workbench.widgets.labeler import Labeler, read_labels
from workbench.widgets.live_labeler import LiveLabeler
from workbench.widgets.probes import Probes
from workbench.widgets.reprs import enable_reprs, forward_backward_html, sample_html
from workbench.widgets.rollouts import RolloutInspector, rollouts_frame
from workbench.widgets.runs import Runs
from workbench.widgets.tokens import token_color, token_html, token_pieces
from workbench.client import widget_states

widget_states.install()  # before any of these widgets is made off the shell thread (see widget_states)

__all__ = ["Compare", "CostMeter", "Dashboard", "Labeler", "LiveLabeler", "Probes", "RolloutInspector", "Runs", "enable_reprs",
           "estimate_cost", "forward_backward_html", "read_labels", "rollouts_frame", "sample_html", "token_color",
           "token_html", "token_pieces"]
