"""The notebook widgets, one concept per module: dashboard (loss/metrics/cost while training),
cost (the cost meter and estimate_cost), rollouts (the rollout table), labeler (A/B preferences),
reprs (HTML for the SDK's results), tokens (per-token colouring); throttle and polling are the
shared plumbing that keeps updates to a few per second."""

from workbench.widgets.cost import CostMeter, estimate_cost
from workbench.widgets.dashboard import Dashboard
from workbench.widgets.labeler import Labeler, read_labels
from workbench.widgets.reprs import enable_reprs, forward_backward_html, sample_html
from workbench.widgets.rollouts import RolloutInspector, rollouts_frame
from workbench.widgets.tokens import token_color, token_html, token_pieces

__all__ = ["CostMeter", "Dashboard", "Labeler", "RolloutInspector", "enable_reprs", "estimate_cost",
           "forward_backward_html", "read_labels", "rollouts_frame", "sample_html", "token_color", "token_html",
           "token_pieces"]
