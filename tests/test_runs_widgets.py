"""Runs side by side against a real backend (the `tinker_server` process), trained through the official SDK:
the Runs tree (workbench/widgets/runs.py) and the Dashboard overlaying chosen runs
(training_run_id=[...]) and logging by run name (workbench/widgets/dashboard.py).

The tree here is root -> A (forked at step 2) -> B (forked from A at step 3), plus a second root with no
name, all in one session; the runs take one or two tiny steps each. `tinker_server` serves the tiny random
stand-in for the default model (tests/tiny_model.py): the tree, the overlays and the logged points are the
same on any model.
"""

from __future__ import annotations

import pytest
from tinker import types

import workbench
from workbench.widgets.cost import format_cost, session_id_of
from workbench.widgets.dashboard import LOSS_PANEL, Dashboard
from workbench.widgets.runs import Runs, tree_order

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def service(tinker_server):
    client = workbench.connect(tinker_server.base_url, tinker_server.api_key, name="runs-tree", progress=False)
    yield client
    workbench.disconnect()


def tiny(tokenizer, k: int) -> list[types.Datum]:
    """One short datum, different per step: prompt tokens weighted 0, answer tokens weighted 1."""
    prompt = tokenizer.encode(f"Blorp {k} is")
    answer = tokenizer.encode(f" green {k}.")
    tokens = prompt + answer
    weights = [0.0] * len(prompt) + [1.0] * len(answer)
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})]


def train(tc, tokenizer, ks) -> list[float]:
    losses = []
    for k in ks:
        fb = tc.forward_backward(tiny(tokenizer, k), "cross_entropy")
        tc.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_tree_order_puts_forks_under_their_parent_and_an_outside_parent_at_the_root():
    runs = [{"training_run_id": "s:1"}, {"training_run_id": "s:2", "parent_run_id": "s:1"},
            {"training_run_id": "s:3", "parent_run_id": "other-session:7"},  # its parent is not listed
            {"training_run_id": "s:4", "parent_run_id": "s:2"}, {"training_run_id": "s:5", "parent_run_id": "s:1"}]
    assert [(r["training_run_id"], r["depth"]) for r in tree_order(runs)] == [
        ("s:1", 0), ("s:2", 1), ("s:4", 2), ("s:5", 1), ("s:3", 0)]


def test_runs_tree_and_a_dashboard_of_chosen_runs(service, tokenizer):
    root = service.create_lora_training_client(base_model=BASE, rank=4, seed=1, user_metadata={"name": "root"}).result()
    root_losses = train(root, tokenizer, [1, 2])
    a = workbench.fork(root, name="A")  # now: after step 2
    a_losses = train(a, tokenizer, [3])
    b = workbench.fork(a, name="B")  # after A's step 3; B takes no step
    other = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    train(other, tokenizer, [1])
    conn = workbench.current()

    # Two chosen runs overlaid: one loss trace each, named by run name, the fork's on its parent's x axis.
    dash = Dashboard(training_run_id=[root, a], poll_interval=None)
    assert dash.training_run_ids == [root.model_id, a.model_id] and dash.training_run_id == root.model_id
    loss = dash.panel_series()[LOSS_PANEL][1]
    assert set(loss) == {"root", "A"}
    assert loss["root"][0] == [1, 2] and loss["root"][1] == pytest.approx(root_losses, rel=1e-5)
    assert loss["A"][0] == [3] and loss["A"][1] == pytest.approx(a_losses, rel=1e-5)
    # Its cost is those two runs' own, not the session's (which has `other`'s step too).
    chosen = sum(conn.usage(training_run_id=r.model_id)["totals"]["cost"] for r in (root, a))
    session_cost = conn.usage(session_id=session_id_of(service))["totals"]["cost"]
    assert dash.cost == pytest.approx(chosen, rel=1e-12) and 0 < dash.cost < session_cost
    assert dash.refresh() == 0  # each run's cursor is at its end: nothing read twice
    assert dash.panel_series()[LOSS_PANEL][1]["A"][0] == [3]

    # log(run=<name>): a run the dashboard plots, and one it has no row of yet (B), both found by name.
    dash.log(3, run="A", acc=0.5)
    dash.log(3, run="B", acc=0.25)
    dash.log(2, run=root, acc=0.75)
    assert dash.metrics["acc"]["runs"] == [a.model_id, b.model_id, root.model_id]
    acc = dash.panel_series()["acc"][1]
    assert acc == {"acc · A": ([3], [0.5]), "acc · B": ([3], [0.25]), "acc · root": ([2], [0.75])}
    dash.flush()
    assert sorted(tr.name for tr in dash.figures[LOSS_PANEL].data) == ["A", "root"]
    assert callable(dash.watch)

    # The session's runs as a tree, in order, with lineage, steps, last loss, cost and the logged metric.
    # (connect() hands back the module's client, whose session may hold runs of tests before this one.)
    runs = Runs(session=service, dashboard=dash, poll_interval=None)
    made = (root.model_id, a.model_id, b.model_id, other.model_id)
    mine = [r for r in runs.runs if r["training_run_id"] in made]
    rows = {r["training_run_id"]: r for r in mine}
    assert [r["training_run_id"] for r in mine] == list(made)
    assert [r["depth"] for r in mine] == [0, 1, 2, 0]
    assert [r["name"] for r in mine[:3]] == ["root", "A", "B"]
    assert mine[3]["name"] != "root" and mine[3]["parent_run_id"] is None
    assert (rows[a.model_id]["parent_run_id"], rows[a.model_id]["fork_step"]) == (root.model_id, 2)
    assert (rows[b.model_id]["parent_run_id"], rows[b.model_id]["fork_step"]) == (a.model_id, 3)
    assert [(r["first_step"], r["step"]) for r in mine] == [(0, 2), (2, 3), (3, 3), (0, 1)]
    assert rows[root.model_id]["last_loss"] == pytest.approx(root_losses[-1], rel=1e-5)
    assert rows[b.model_id]["last_loss"] is None
    assert rows[root.model_id]["cost"] > 0 and rows[b.model_id]["cost"] == 0.0
    assert rows[a.model_id]["metrics"] == {"acc": 0.5} and rows[other.model_id]["metrics"] == {}
    # The loss column says it is a sum; a note says what the session spent beyond the runs' own training.
    page = runs.table.value
    assert "<th title='the last forward_backward&#x27;s loss: a sum over its tokens, not a mean'>last loss (sum)</th>" in page
    own = sum(r["cost"] for r in runs.runs)
    assert runs.session_cost >= own > 0
    assert (f"The session spent {format_cost(runs.session_cost)}: {format_cost(own)} on these runs' training, "
            f"{format_cost(runs.session_cost - own)} on the rest") in page
    assert "root @ step 2" in runs.table.value and "A @ step 3" in runs.table.value
    for widget in (dash, runs):
        widget.close()
