"""The workbench's widgets and helpers without a backend: driven through their Python state.

Widgets are built outside a kernel (ipywidgets gives them a dummy comm); browser actions are
simulated as the browser would send them: custom messages (`_handle_custom_msg`) for the labeler,
traitlet changes for the rollout inspector. The labeler's keyboard rule runs in node, from the
widget's own JavaScript. Tests against the real backend are in test_workbench.py.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import ipywidgets
import numpy as np
import pandas as pd
import pytest
import torch
from tinker import types

from helpers import wait_until
from workbench.recipes.dpo import completion_datum, dpo_loss, make_dpo_loss
import workbench.widgets.labeler as labeler_module
from workbench.widgets.labeler import Labeler, read_labels
from workbench.widgets.reprs import enable_reprs, forward_backward_html, sample_html
from workbench.widgets.rollouts import RolloutInspector
from workbench.widgets.throttle import Throttle
from workbench.widgets.dashboard import LOSS_PANEL, Dashboard
from workbench.widgets.tokens import legend_html, token_color, token_html

# ---- token colouring --------------------------------------------------------------------------------


def alpha_of(span: str) -> float:
    match = re.search(r"rgba\((\d+),(\d+),(\d+),([\d.]+)\)", span)
    return float(match.group(4)) if match else 0.0


def spans(html: str) -> list[str]:
    return re.findall(r'<span class="wb-tok".*?</span>', html)


def test_logprob_colouring_reddens_unlikely_tokens_and_escapes_text():
    html = token_html(["sure", "<b>odd</b>", "pad"], [-0.01, -4.0, None], "logprob")
    sure, odd, pad = spans(html)
    assert alpha_of(odd) > 0.8 > 0.05 > alpha_of(sure)  # p≈0.02 is almost full red, p≈0.99 almost clear
    assert "&lt;b&gt;odd&lt;/b&gt;" in odd and "<b>" not in odd
    assert 'title="logprob -4.0000"' in odd
    assert "background" not in pad  # no value, no colour (e.g. prompt tokens)


def test_advantage_colouring_is_diverging_and_scaled_to_the_largest():
    html = token_html(["good", "bad", "meh"], [2.0, -2.0, 0.5], "advantage")
    good, bad, meh = spans(html)
    assert "rgba(30,160,60" in good and "rgba(220,40,40" in bad
    assert alpha_of(good) == pytest.approx(alpha_of(bad)) == pytest.approx(0.85)
    assert alpha_of(meh) == pytest.approx(0.85 / 4, abs=1e-3)
    assert token_color(float("nan")) is None
    with pytest.raises(ValueError):
        token_html(["a", "b"], [0.0], "logprob")
    with pytest.raises(ValueError):
        token_color(0.1, "entropy")


def test_the_colour_legend_says_what_each_colour_means_with_the_tokens_own_colours():
    logprob = legend_html("logprob")
    assert 'data-mode="logprob"' in logprob and "1 − p" in logprob
    # p = 0.5 is half red, as a token of logprob log(0.5) is
    assert token_color(math.log(0.5)) in logprob and token_color(math.log(1e-4)) in logprob
    advantage = legend_html("advantage", scale=0.75)
    assert "±0.75" in advantage and token_color(-0.75, "advantage", 0.75) in advantage
    assert token_color(0.75, "advantage", 0.75) in advantage and "+0.375" in advantage
    # token_html adds it at the scale it coloured with, and only where some token is coloured
    assert legend_html("advantage", 2.0) in token_html(["a", "b"], [2.0, -1.0], "advantage", legend=True)
    assert "wb-legend" not in token_html(["a"], [None], legend=True)
    assert "wb-legend" not in token_html(["a"], [-1.0])


class FakeUsage:
    """A connection whose usage API has the ForwardBackward rows of `losses` ({step: loss})."""

    def __init__(self, losses: dict[int, float]):
        self.rows = [{"request_type": "ForwardBackward", "training_run_id": "run", "step": step - 1,
                      "metrics": {"loss:sum": loss}} for step, loss in losses.items()]

    def usage(self, after=0, **filters):
        totals = {"cost": 0.0, "requests": len(self.rows), "prefill_tokens": 0, "sample_tokens": 0, "train_tokens": 1}
        return {"series": self.rows[after:], "totals": totals, "cursor": len(self.rows)}


def test_the_dashboard_marks_skipped_steps_and_announces_only_the_metrics_it_expects():
    """An RL run of 4 steps whose step 3 trained on nothing: every panel runs over 1..4, the lines
    break at 3, and a trace "skipped (every group tied)" marks it; the words under "Not plotted
    yet" name the metrics of `panels`, and a dashboard given none names none."""
    plain = Dashboard(training_run_id="run", connection=FakeUsage({}), poll_interval=None)
    assert "the loss" in plain.note.value and "dashboard.log" not in plain.note.value
    dash = Dashboard(training_run_id="run", connection=FakeUsage({1: 3.0, 2: 2.5, 4: 2.0}), poll_interval=None,
                     panels={"reward": ["reward", "eval_reward"]}, labels={"eval_reward": "held-out"})
    dash.flush()
    assert "reward, eval_reward" in dash.note.value and "the loss" not in dash.note.value
    for step, kl in ((1, 0.01), (2, 0.02), (4, 0.01)):
        dash.log(step, kl=kl)
    for step, reward in ((1, 0.1), (2, 0.2), (3, 0.0), (4, 0.3)):
        dash.log(step, reward=reward)
    dash.skip(3, "every group tied")
    dash.log(0, eval_reward=0.1)
    dash.flush()
    assert dash.note.value == ""
    marks = {title: [(list(t.x), list(t.y)) for t in f.data if t.name == "skipped (every group tied)"]
             for title, f in dash.figures.items()}
    assert [[x for x, _ in m] for m in marks.values()] == [[[3]]] * 3, marks  # on every panel, once
    loss = dash.figures[LOSS_PANEL].data[0]
    assert list(loss.x) == [1, 2, 3, 4] and list(loss.y) == [3.0, 2.5, None, 2.0]  # broken at 3
    (kl,) = [t for t in dash.figures["kl"].data if t.name == "kl"]
    assert list(kl.y) == [0.01, 0.02, None, 0.01]
    (reward,) = [t for t in dash.figures["reward"].data if t.name == "reward"]
    assert list(reward.y) == [0.1, 0.2, 0.0, 0.3]  # a value at the skipped step stays
    assert [t.name for t in dash.figures["reward"].data] == ["reward", "held-out", "skipped (every group tied)"]
    assert dash.figures["kl"].data[-1].yaxis == "y2"  # along the bottom, off the panel's own scale
    for d in (plain, dash):
        d.close()


class FakeLedger:
    """A usage API over `rows` (ledger order), answering each scope as the backend does: a run's scope
    holds its own rows and its samplers' ("sampler_of" here), a session's every row; with a budget."""

    def __init__(self, rows: list[dict], budget: dict | None = None):
        self.rows = [{"id": i + 1, "cost": 0.0, "step": None, "training_run_id": None, "metrics": {}, **row}
                     for i, row in enumerate(rows)]
        self.budget = budget

    def usage(self, session_id=None, training_run_id=None, after=0, limit=1000):
        mine = [r for r in self.rows if training_run_id in (None, r["training_run_id"], r.get("sampler_of"))]
        page = [r for r in mine if r["id"] > after][:limit]
        totals = {"cost": sum(r["cost"] for r in mine), "requests": len(mine), "prefill_tokens": 0, "sample_tokens": 0,
                  "train_tokens": 0, "by_kind": {k: {"tokens": 0, "cost": 0.0} for k in ("prefill", "sample", "train")}}
        return {"series": page, "totals": totals, "cursor": page[-1]["id"] if page else after, "currency": "USD",
                "budget": self.budget}


def rl_steps(run: str, n: int, rollout_cost: float = 0.5, train_cost: float = 1.0) -> list[dict]:
    """The ledger of `n` RL steps of `run`: rollouts sampled (rows of its sampler, no step), a
    forward_backward at step k - 1 with its loss, the optim_step that finishes step k (costless)."""
    rows = []
    for k in range(1, n + 1):
        rows += [{"request_type": "Sample", "sampler_of": run, "cost": rollout_cost},
                 {"request_type": "ForwardBackward", "training_run_id": run, "step": k - 1, "cost": train_cost,
                  "metrics": {"loss:sum": 10.0 / k}},
                 {"request_type": "OptimStep", "training_run_id": run, "step": k}]
    return rows


@pytest.mark.parametrize("scope", ["run", "session"])
def test_the_dashboard_plots_each_metric_against_what_the_run_had_spent(scope):
    """x="cost": a point per step, at the run's cumulative cost when it finished that step (its rollouts'
    sampling included, read from the run's own usage scope even on a session dashboard, whose rows do
    not say which run a rollout was for); the step rides along as customdata; the x axis is "$"."""
    ledger = FakeLedger(rl_steps("r", 3))
    where = {"training_run_id": "r"} if scope == "run" else {"session": "s"}
    dash = Dashboard(**where, x="cost", connection=ledger, poll_interval=None)
    for step in range(0, 4):
        dash.log(step, reward=step / 10, run="r" if scope == "session" else None)
    dash.flush()
    assert dash.step_costs == {"r": {0: 0.5, 1: 1.5, 2: 3.0, 3: 4.5}}
    for title, steps in ((LOSS_PANEL, [1, 2, 3]), ("reward", [0, 1, 2, 3])):
        figure = dash.figures[title]
        (trace,) = figure.data
        assert list(trace.customdata) == steps and list(trace.x) == [dash.step_costs["r"][k] for k in steps]
        assert figure.layout.xaxis.title.text == "$" and figure.layout.xaxis.dtick is None
    assert list(dash.figures[LOSS_PANEL].data[0].y) == [10.0, 5.0, 10.0 / 3]

    # The next step's forward_backward is in the ledger, its optim_step not yet: a provisional cost,
    # settled by the optim_step; the skip is placed by cost too.
    ledger.rows += FakeLedger(rl_steps("r", 4)[-3:-1]).rows
    for i, row in enumerate(ledger.rows):
        row["id"] = i + 1
    dash.refresh()
    assert dash.step_costs["r"][4] == 6.0
    dash.skip(2, "every group tied")
    dash.flush()
    (mark,) = [t for t in dash.figures["reward"].data if t.name.startswith("skipped")]
    assert list(mark.x) == [3.0] and list(mark.customdata) == [2]
    dash.close()


def test_a_step_dashboard_is_unchanged_and_x_is_checked():
    dash = Dashboard(training_run_id="r", connection=FakeLedger(rl_steps("r", 2)), poll_interval=None)
    dash.flush()
    loss = dash.figures[LOSS_PANEL]
    assert list(loss.data[0].x) == [1, 2] and loss.layout.xaxis.title.text == "step" and dash.step_costs == {}
    dash.close()
    with pytest.raises(ValueError, match='"step" or "cost"'):
        Dashboard(training_run_id="r", x="dollars", connection=FakeLedger([]), poll_interval=None)


# ---- budgets ----------------------------------------------------------------------------------------------


def budget(**fields) -> dict:
    return {"scope": "session", "target": "s", "budget_usd": 0.5, "budget_tokens": None, "spent_usd": 0.0,
            "spent_tokens": 0, "pending_usd": 0.0, "fraction": 0.0, "state": "ok", **fields}


def test_budget_text_reads_as_the_extension_writes_it():
    from workbench.widgets.cost import budget_text

    assert budget_text(budget(spent_usd=0.41, fraction=0.82, state="warning")) == "$0.41 of $0.50 (82%)"
    # tiny amounts keep two significant digits; the percentage rounds down (79.9% is not 80%)
    assert budget_text(budget(budget_usd=0.00005, spent_usd=0.00003995, fraction=0.799)) == "$0.000040 of $0.000050 (79%)"
    assert budget_text(budget(budget_usd=None, budget_tokens=5000, spent_tokens=1200, fraction=0.24)) == \
        "1,200 of 5,000 tokens (24%)"
    assert budget_text(budget(budget_usd=12, spent_usd=3.1, budget_tokens=5000, spent_tokens=4500, fraction=0.9)) == \
        "$3.10 of $12.00 · 4,500 of 5,000 tokens (90%)"
    assert budget_text(budget(spent_usd=0.29, fraction=0.58)) == "$0.29 of $0.50 (58%)"  # 0.58 * 100 is 57.999...
    # each amount keeps two significant digits
    assert budget_text(budget(budget_usd=0.0001, spent_usd=0.0000234, fraction=0.234)) == "$0.000023 of $0.00010 (23%)"
    assert budget_text(budget(spent_usd=0.041, fraction=0.082)) == "$0.041 of $0.50 (8%)"
    assert budget_text(budget(spent_usd=0.00041, fraction=0.00082)) == "$0.00041 of $0.50 (0%)"


def test_the_cost_meter_shows_its_scopes_budget_and_none_without_one():
    from workbench.widgets.cost import CostMeter

    ledger = FakeLedger([], budget=budget(spent_usd=0.41, fraction=0.82, state="warning"))
    meter = CostMeter(session="s", connection=ledger, poll_interval=None)
    assert meter.budget["state"] == "warning" and meter.budget_text == "$0.41 of $0.50 (82%)"
    assert {"budget", "budget_text"} <= set(meter.get_state())  # synced to the browser
    ledger.budget = budget(spent_usd=0.5, fraction=1.0, state="exhausted")
    meter.refresh()
    assert meter.budget["state"] == "exhausted" and meter.budget_text == "$0.50 of $0.50 (100%)"
    ledger.budget = None  # removed
    meter.refresh()
    assert meter.budget == {} and meter.budget_text == ""
    meter.close()


def test_the_kernel_scope_shows_the_tightest_budget():
    from workbench.client.connection import tightest_budget

    ok, warning, exhausted = (budget(target=t, state=s, fraction=f)
                              for t, s, f in (("a", "ok", 0.5), ("b", "warning", 0.85), ("c", "exhausted", 0.97)))
    assert tightest_budget([ok, exhausted, warning]) is exhausted  # exhausted before a fuller fraction elsewhere
    assert tightest_budget([ok, budget(target="d", fraction=0.6)])["target"] == "d"
    assert tightest_budget([]) is None


def budget_connection(answers: dict):
    """A Connection whose backend answers `answers[(method, path)]` -> (status, json) and records requests."""
    import httpx

    from workbench.client.connection import Connection

    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, json.loads(request.content) if request.content else None))
        status, body = answers.get((request.method, request.url.path), (404, {"detail": "Not Found"}))
        return httpx.Response(status, json=body)

    conn = Connection(base_url="http://backend.test", api_key="tml-test")
    conn._http = httpx.Client(base_url=conn.base_url, transport=httpx.MockTransport(handle))
    return conn, seen


def test_set_budget_puts_on_the_run_or_session_named_and_says_what_went_wrong():
    from workbench.client.connection import BackendError

    path = "/api/v1/budgets/run/s:train:0"
    conn, seen = budget_connection({("PUT", path): (200, budget(scope="run", target="s:train:0", budget_usd=0.2)),
                                    ("DELETE", path): (200, {}),
                                    ("GET", "/api/v1/budgets"): (200, {"budgets": [budget()]}),
                                    ("PUT", "/api/v1/budgets/session/gone"): (404, {"detail": "no session 'gone'"})})
    (answer,) = conn.set_budget(usd=0.2, training_run_id=SimpleNamespace(model_id="s:train:0"))
    assert answer["budget_usd"] == 0.2
    assert seen[-1] == ("PUT", path, {"budget_usd": 0.2, "budget_tokens": None})
    conn.remove_budget(training_run_id="s:train:0")
    assert seen[-1][:2] == ("DELETE", path)
    assert conn.budgets() == [budget()]
    with pytest.raises(BackendError, match="no session 'gone'"):
        conn.set_budget(tokens=1000, session_id="gone")
    for wrong, words in (({"usd": -1}, "number from 0 up"), ({"usd": "lots"}, "number from 0 up"),
                         ({"tokens": 2.5}, "whole number"), ({}, "remove_budget")):
        with pytest.raises(ValueError, match=words):
            conn.set_budget(**wrong)
    old, _ = budget_connection({})  # a backend from before budgets: the framework's own 404
    with pytest.raises(BackendError, match="older Stepwise; upgrade it"):
        old.budgets()


def test_the_kernels_budget_rides_in_the_session_metadata_until_the_session_opens(monkeypatch, tmp_path):
    """connect(budget_usd=...) puts it in the ServiceClient's user_metadata (the SDK sends it when it opens
    the session), as a plain decimal; a re-run with another budget, or set_budget() before the session
    opened, changes what will be sent; once open, set_budget() PUTs it."""
    connect_module = importlib.import_module("workbench.client.connect")  # (workbench.connect is the function)
    conn, seen = budget_connection({("PUT", "/api/v1/budgets/session/s1"): (200, budget(target="s1", budget_usd=2.0))})
    monkeypatch.setenv("STEPWISE_HOME", str(tmp_path))
    monkeypatch.setattr(connect_module, "_bind", lambda base_url, api_key: conn)
    monkeypatch.setattr(connect_module, "_current", None)
    try:
        client = connect_module.connect("http://backend.test", "tml-test", budget_usd=0.00005, budget_tokens=9000)
        assert client._user_metadata is conn.session_metadata
        assert {k: v for k, v in conn.session_metadata.items() if k.startswith("budget")} == {
            "budget_usd": "0.00005", "budget_tokens": "9000"}
        connect_module.connect("http://backend.test", "tml-test", budget_usd=0.001)  # the cell, run again
        assert conn.session_metadata["budget_usd"] == "0.001" and "budget_tokens" not in conn.session_metadata
        assert seen == []  # no session open yet: nothing to PUT
        client._session_holder = SimpleNamespace(_session_id="s1")  # the SDK opened it
        (answer,) = connect_module.set_budget(usd=2)
        assert answer["target"] == "s1" and seen == [("PUT", "/api/v1/budgets/session/s1",
                                                       {"budget_usd": 2.0, "budget_tokens": None})]
        with pytest.raises(ValueError, match="number from 0 up"):
            connect_module.connect("http://backend.test", "tml-test", budget_usd=-0.5)
    finally:
        conn.clients.clear()  # nothing to finish: the session above is a stand-in
        conn.registry_path and conn.registry_path.unlink(missing_ok=True)


# ---- rollout inspector ------------------------------------------------------------------------------


@pytest.fixture
def rollouts() -> pd.DataFrame:
    return pd.DataFrame([
        {"prompt": "Is the sky blue?", "completion": "Yes.", "reward": 1.0, "advantage": 0.5,
         "tokens": ["Yes", "."], "logprobs": [-0.1, -0.2]},
        {"prompt": "Is the sky blue?", "completion": "No, it is green.", "reward": 0.0, "advantage": -0.5,
         "tokens": ["No", ",", " it", " is", " green", "."], "logprobs": [-2.5, -0.3, -0.1, -0.1, -6.0, -0.1]},
        {"prompt": "Is fire hot?", "completion": "Yes, very.", "reward": 1.0, "advantage": 0.0,
         "tokens": ["Yes", ",", " very", "."], "logprobs": [-0.05, -1.0, -0.7, -0.2],
         "token_advantages": [0.0, 0.0, 1.0, 0.0]},
    ])


def test_rollout_inspector_filters_sorts_and_colours_the_selected_row(rollouts):
    inspector = RolloutInspector(rollouts)
    assert inspector.columns == ["prompt", "completion", "reward", "advantage"]  # token lists stay out of the table
    assert [r["_index"] for r in inspector.rows] == [0, 1, 2]

    inspector.filter("reward > 0")
    assert list(inspector.view.index) == [0, 2] and [r["_index"] for r in inspector.rows] == [0, 2]
    inspector.sort_by("advantage")
    assert [r["_index"] for r in inspector.rows] == [2, 0]
    inspector.sort_by("advantage", ascending=False)
    assert [r["_index"] for r in inspector.rows] == [0, 2]
    inspector.filter("")
    assert len(inspector.rows) == 3

    # As the browser does: set the traitlet; Python recomputes what is shown.
    inspector.set_state({"query": "advantage < 0"})
    assert [r["_index"] for r in inspector.rows] == [1]
    inspector.set_state({"query": "reward >"})
    assert "filter" in inspector.error and len(inspector.rows) == 3  # a typo shows everything, with the error
    with pytest.raises(ValueError):
        inspector.filter("nope ==")
    with pytest.raises(KeyError):
        inspector.sort_by("missing")

    html = inspector.select(1)
    assert 'class="wb-legend" data-mode="logprob"' in html  # what the colours mean, beside them
    token_spans = spans(html)
    assert len(token_spans) == 6 and "green" in token_spans[4]
    assert alpha_of(token_spans[4]) > 0.8 > 0.2 > alpha_of(token_spans[2])  # logprob -6 vs -0.1
    inspector.color_by = "advantage"
    assert 'data-mode="advantage"' in inspector.tokens_html and "±0.5" in inspector.tokens_html
    advantage_spans = spans(inspector.tokens_html)
    assert all("rgba(220,40,40" in s for s in advantage_spans)  # the row's advantage is negative on every token
    inspector.set_state({"selected": 2})  # a row with per-token advantages
    assert [alpha_of(s) > 0 for s in spans(inspector.tokens_html)] == [False, False, True, False]
    inspector.set_state({"selected": -1})
    assert inspector.tokens_html == ""


def test_an_episode_shows_turn_by_turn_the_environments_tokens_apart_and_uncoloured():
    episode = {"prompt": "What is 17*5+3?", "completion": "calc ... 88", "reward": 1.0, "advantage": 0.5,
               "tokens": ["<tool_call>", "calc", "<|im_end|>", "\n<tool_response>88</tool_response>", "It", " is", " 88"],
               "logprobs": [-0.1, -3.0, -0.2, None, -0.5, -0.1, -0.05],
               "roles": ["policy", "policy", "policy", "observation", "policy", "policy", "policy"]}
    inspector = RolloutInspector([episode])
    assert "roles" not in inspector.columns
    for mode in ("logprob", "advantage"):
        inspector.color_by = mode
        shown = inspector.select(0)
        turns = re.findall(r'data-role="(\w+)"', shown)
        assert turns == ["policy", "observation", "policy"]
        observation = shown.split('data-role="observation"')[1].split("</div>")[0]
        assert "wb-tok" not in observation and "&lt;tool_response&gt;88" in observation  # plain, escaped text
        assert len(spans(shown)) == 6 and all(alpha_of(s) > 0 for s in spans(shown)[1:2])
        assert f'data-mode="{mode}"' in shown  # one legend for the episode
    assert all("rgba(30,160,60" in s for s in spans(inspector.tokens_html))  # advantage +0.5 on the policy's tokens


# ---- preference labeler -----------------------------------------------------------------------------


def pairs(n: int) -> list[dict]:
    return [{"prompt": f"Question {i}?", "completions": [f"good answer {i}", f"bad answer {i}"],
             "models": ["policy", "base"]} for i in range(n)]


def press(lab: Labeler, choice: str, rationale: str = "") -> None:
    """What the front end sends for a button click or shortcut."""
    if choice == "undo":
        lab._handle_custom_msg({"type": "undo"}, [])
    else:
        lab._handle_custom_msg({"type": "label", "choice": choice, "rationale": rationale,
                                "item_id": lab.item_id, "dwell_ms": 1500}, [])


def good_side(lab: Labeler) -> str:
    """Which displayed side holds the good answer (the labeler randomises it)."""
    return "A" if lab.text_a.startswith("good") else "B"


def test_labeler_records_choices_undo_and_resumes_from_its_file(tmp_path):
    path = tmp_path / "labels.jsonl"
    lab = Labeler(pairs(6), path=path, seed=3, labeler="ada")
    assert (lab.done, lab.total, lab.finished, lab.can_undo) == (0, 6, False, False)
    state = {k: v for k, v in lab.get_state().items() if k not in ("_esm", "_css")}  # the state, not the code
    assert "policy" not in json.dumps(state)  # model names never reach the browser

    sides_seen = []
    for _ in range(2):  # two real preferences, whichever side the good answer landed on
        sides_seen.append(good_side(lab))
        press(lab, good_side(lab), rationale="more correct")
    press(lab, "tie")
    press(lab, "skip")
    assert lab.done == 4 and lab.can_undo
    press(lab, "undo")  # takes back the skip: item 3 is shown again
    assert lab.done == 3 and lab.prompt == "Question 3?"
    press(lab, "both_bad")
    stale = lab.item_id
    press(lab, "B")
    lab._handle_custom_msg({"type": "label", "choice": "A", "item_id": stale}, [])  # a double click: ignored
    assert lab.done == 5

    labels = lab.labels
    assert list(labels["choice"]) == ["A" if s == "A" else "B" for s in sides_seen] + ["tie", "both_bad", "B"]
    assert list(labels["rationale"][:2]) == ["more correct"] * 2
    assert (labels["dwell_s"] == 1.5).all() and (labels["labeler"] == "ada").all()
    first = labels.iloc[0]
    assert first["chosen"] == "good answer 0" and first["rejected"] == "bad answer 0" and first["preferred"] == 0
    assert first["swapped"] == (first["sides"] == [1, 0])  # the coin is logged with every label
    assert first["completion_a"] == ("bad answer 0" if first["swapped"] else "good answer 0")
    assert set(labels["swapped"]) == {True, False}  # with seed 3, both orders occur among five items

    prefs = lab.preferences()
    assert prefs[:2] == [{"prompt": f"Question {i}?", "chosen": f"good answer {i}", "rejected": f"bad answer {i}",
                          "strength": "clear"} for i in range(2)]
    assert len(prefs) == 3  # A/B only: tie and both-bad carry no preference
    assert lab.summary()["counts"] == {"A": sides_seen.count("A"), "B": 1 + sides_seen.count("B"), "tie": 1,
                                       "both_bad": 1, "skip": 0, "A_slightly": 0, "B_slightly": 0, "edit": 0}

    # The file is an append-only log: the skip and its undo are both there.
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e.get("choice", e["type"]) for e in events][2:6] == ["tie", "skip", "undo", "both_bad"]

    # A kernel restart: a new labeler on the same file resumes at item 5.
    again = Labeler(pairs(6), path=path, seed=99)
    assert (again.done, again.prompt) == (5, "Question 5?")
    assert again.labels.equals(labels) and read_labels(path) == lab._labels
    press(again, "A")
    assert again.finished and again.done == 6 and again.item_id == ""
    press(again, "A")  # nothing left to label: ignored
    assert len(again.labels) == 6
    press(again, "undo")
    assert not again.finished and again.prompt == "Question 5?"


def test_labeler_accepts_tuples_and_frames_and_rejects_bad_input(tmp_path):
    lab = Labeler([("p", "x", "y")], path=tmp_path / "a.jsonl")
    assert {lab.text_a, lab.text_b} == {"x", "y"} and not (lab.cut_a or lab.cut_b)
    # A completion cut at its token limit is marked on whichever side it is shown.
    cut = Labeler([{"prompt": "p", "completions": ["whole.", "cut mid"], "truncated": [False, True]}] * 1,
                  path=tmp_path / "c.jsonl", seed=1)
    assert (cut.cut_a, cut.cut_b) == ((True, False) if cut.text_a == "cut mid" else (False, True))
    assert "cut off: the sample reached its token limit" in Path(labeler_module.__file__).with_name("labeler.js").read_text()
    frame = pd.DataFrame({"prompt": ["p"], "a": ["x"], "b": ["y"], "id": ["item-1"]})
    assert Labeler(frame, path=tmp_path / "b.jsonl").item_id == "item-1"
    with pytest.raises(ValueError):
        lab.choose("C")
    with pytest.raises(ValueError):
        Labeler([{"prompt": "p", "completions": ["only one"]}], path=tmp_path / "c.jsonl")
    with pytest.raises(ValueError):
        Labeler([("p", "x", "y"), ("p", "x", "y")], path=tmp_path / "d.jsonl")
    seen = []
    lab.on_label(seen.append)
    lab.choose("tie")
    assert seen[0]["choice"] == "tie"


def test_labeler_shortcuts_never_fire_from_the_rationale_box(tmp_path):
    """The widget's own shortcutFor(), run in node under the keymap Python sends it: keys map to actions
    (Shift+arrow: slightly better; a rebinding wins) except inside text fields."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    module = tmp_path / "labeler.mjs"  # .mjs: node reads it as an ES module, like the browser
    shutil.copy(Path(__file__).resolve().parent.parent / "workbench" / "widgets" / "labeler.js", module)
    keymap = Labeler([("p", "x", "y")], path=tmp_path / "k.jsonl", keys={"j": "A", "k": "rate:3"}).keymap
    script = f"""
    import {{ shortcutFor }} from {json.dumps(str(module))};
    const ev = (key, tagName = "DIV", extra = {{}}) => ({{ key, target: {{ tagName }}, ...extra }});
    const cases = [ev("1"), ev("ArrowLeft"), ev("2"), ev("ArrowRight"), ev("t"), ev("b"), ev("s"), ev(" "),
                   ev("z"), ev("Backspace"), ev("T"), ev("x"), ev("1", "TEXTAREA"), ev("z", "textarea"),
                   ev("2", "INPUT"), ev("z", "DIV", {{ ctrlKey: true }}), ev("1", "DIV", {{ isComposing: true }}),
                   ev("ArrowLeft", "DIV", {{ shiftKey: true }}), ev("ArrowRight", "DIV", {{ shiftKey: true }}),
                   ev("e"), ev("j"), ev("k"), ev("e", "TEXTAREA")];
    console.log(JSON.stringify(cases.map((event) => shortcutFor(event, {json.dumps(keymap)}))));
    """
    out = subprocess.run([node, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["A", "A", "B", "B", "tie", "both_bad", "skip", "skip", "undo", "undo", "tie",
                                      None, None, None, None, None, None, "A_slightly", "B_slightly", "edit", "A",
                                      "rate:3", None]
    with pytest.raises(ValueError, match="unknown actions"):
        Labeler([("p", "x", "y")], path=tmp_path / "k2.jsonl", keys={"q": "approve"})


# ---- DPO loss -----------------------------------------------------------------------------------------


def test_dpo_loss_matches_the_formula_and_pushes_chosen_up():
    # Two pairs over made-up sequences: prompt of 2 tokens, completions of 2-3 tokens.
    data = [completion_datum([1, 2], [1, 2, 3, 4]), completion_datum([1, 2], [1, 2, 5, 6, 7]),
            completion_datum([1, 2], [1, 2, 8, 9]), completion_datum([1, 2], [1, 2, 10, 11])]
    assert list(data[1].loss_fn_inputs["weights"].to_numpy()) == [0, 1, 1, 1]
    logprobs = [torch.tensor(v, requires_grad=True) for v in
                ([-9.0, -1.0, -1.0], [-9.0, -0.5, -0.5, -0.5], [-9.0, -2.0, -2.0], [-9.0, -1.0, -3.0])]
    ref = [np.array(v, np.float32) for v in ([-5, -1, -1], [-5, -1, -1, -1], [-5, -1, -1], [-5, -1, -1])]
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "ref_logprobs": r})
            for d, r in zip(data, ref)]
    loss, metrics = dpo_loss(data, logprobs, beta=0.5)
    # pair 1: policy c -2, r -1.5; ref c -2, r -3 -> margin 0.5*((0) - (1.5)) = -0.75
    # pair 2: policy c -4, r -4;   ref c -2, r -2 -> margin 0
    expected = -(math.log(1 / (1 + math.exp(0.75))) + math.log(0.5)) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert metrics["dpo_loss:mean"] == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy:mean"] == 0.0 and metrics["margin:mean"] == pytest.approx(-0.375)
    loss.backward()
    # Descending the loss raises the chosen completion's logprobs and lowers the rejected one's;
    # prompt positions (weight 0) get no gradient.
    assert (logprobs[0].grad[1:] < 0).all() and (logprobs[1].grad[1:] > 0).all()
    assert logprobs[0].grad[0] == 0
    # Without reference logprobs the reference terms are zero.
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                                    if k != "ref_logprobs"}) for d in data]
    loss, _ = make_dpo_loss(beta=1.0)(plain, [lp.detach() for lp in logprobs])
    assert float(loss) == pytest.approx(-(math.log(1 / (1 + math.exp(0.5))) + math.log(0.5)) / 2, rel=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(data[:3], logprobs[:3])


# ---- reprs and throttling -----------------------------------------------------------------------------


def test_html_reprs_for_sdk_results_and_their_registration(monkeypatch):
    # Earlier tests in this process sampled through the SDK: forget those calls (the repr would find their tokenizer).
    from workbench.client import sdk_hooks
    import workbench.widgets.reprs as reprs_module

    monkeypatch.setattr(sdk_hooks, "_recent", type(sdk_hooks._recent)(maxlen=sdk_hooks.RECENT))
    monkeypatch.setattr(reprs_module, "_tokenizer", None)
    fb = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 3.25},
        loss_fn_outputs=[{"logprobs": types.TensorData.from_numpy(np.array([-0.25, -3.0], np.float32))}] * 10)
    html = forward_backward_html(fb)
    assert "loss:sum = <b>3.25</b>" in html and "2 more datums" in html
    assert len(spans(html)) == 8 * 2 and "-3.00" in html

    class Tok:  # the two methods a tokenizer needs here
        def decode(self, ids):
            return "".join({5: "Hel", 6: "lo<"}[i] for i in ids)

    seq = types.SampledSequence(stop_reason="stop", sequence_id="s", tokens_np=np.array([5, 6]),
                                logprobs_np=np.array([-0.5, -2.0], np.float32))
    html = sample_html(types.SampleResponse(sequences=[seq]), tokenizer=Tok())
    assert "Hello&lt;" in html and "Σ logprob -2.5" in html and len(spans(html)) == 2
    assert "<6>" not in sample_html(types.SampleResponse(sequences=[seq]), tokenizer=Tok())
    assert "&lt;6&gt;" in sample_html(types.SampleResponse(sequences=[seq]))  # ids without a tokenizer

    from IPython import get_ipython
    from IPython.core.formatters import HTMLFormatter

    shell = SimpleNamespace(display_formatter=SimpleNamespace(formatters={"text/html": HTMLFormatter()}))
    assert enable_reprs(shell)
    formatter = shell.display_formatter.formatters["text/html"]
    assert formatter.lookup_by_type(types.ForwardBackwardOutput) is forward_backward_html
    assert "loss:sum" in formatter(fb) and "SampleResponse" in formatter(types.SampleResponse(sequences=[seq]))
    if get_ipython() is None:
        assert enable_reprs() is False  # outside IPython there is nothing to register with


class FakeTimer:
    """threading.Timer's interface, fired by the test: what a throttle does then does not depend on when a real
    timer's thread gets the CPU."""

    def __init__(self, wait: float, fn, args=()):
        self.wait, self.fn, self.args = wait, fn, args
        self.started = self.cancelled = False

    def start(self):
        self.started = True

    def cancel(self):
        self.cancelled = True

    def fire(self):  # fires even if cancelled: a real timer can fire just as cancel() comes too late
        self.fn(*self.args)


def test_throttle_coalesces_bursts_and_keeps_the_last_call():
    now, timers, calls = [100.0], [], []

    def timer(wait, fn, args=()):
        timers.append(FakeTimer(wait, fn, args))
        return timers[-1]

    throttle = Throttle(lambda: calls.append(now[0]), interval=0.2, clock=lambda: now[0], timer=timer)
    for _ in range(50):
        throttle()
        now[0] += 0.001
    assert calls == [100.0]  # the first runs at once, the rest wait for one trailing call
    assert len(timers) == 1 and timers[0].started
    assert timers[0].wait == pytest.approx(100.2 - 100.001)  # from the second call to the window's end
    now[0] = 100.2
    timers[0].fire()  # the trailing call, when the window ends
    assert calls == [100.0, 100.2]
    now[0] = 100.7
    throttle()  # the window has passed: runs at once
    throttle()  # this one waits...
    assert len(calls) == 3 and len(timers) == 2 and timers[1].wait == pytest.approx(0.2)
    throttle.flush()  # ...unless flushed
    assert len(calls) == 4 and timers[1].cancelled
    timers[1].fire()  # a timer that fired as flush() cancelled it
    assert len(calls) == 4  # the flushed trailing call does not run again


def test_throttle_runs_the_trailing_call_on_its_own_timer():
    calls = []
    throttle = Throttle(lambda: calls.append(1), interval=0.05)  # a real clock and threading.Timer
    throttle()
    assert len(calls) == 1  # the first runs at once
    throttle()  # within the window (or, on a stalled machine, after it: then at once)
    wait_until(lambda: len(calls) == 2, what="the trailing call")
    assert throttle._timer is None  # and nothing else is pending


# ---- a reloaded page's request for every widget's state, while other threads make widgets ------------


class ControlComm:
    """ipywidgets' control comm as the kernel holds it once a page opened it: what goes back to the page."""

    def __init__(self):
        self.sent: list[dict] = []

    def send(self, data, buffers=None):
        self.sent.append(data)


def ask_states(handler) -> dict:
    """What the page gets for `request_states` from `handler` ({model_id: entry}); raises what it raises."""
    comm = ipywidgets.Widget._control_comm
    before = len(comm.sent)
    handler({"content": {"data": {"method": "request_states"}}})
    (reply,) = comm.sent[before:]
    assert reply["method"] == "update_states"
    return reply["states"]


class Stalling(ipywidgets.HTML):
    """A widget whose state, the first time it is read, waits for another thread to create two widgets and
    close `victim` (a widget later in the registry): the moment the race needs, made to happen every time."""

    def get_state(self, key=None, drop_defaults=False):
        if getattr(self, "victim", None) is not None:
            victim, self.victim = self.victim, None

            def churn():
                self.made = [ipywidgets.HTML("made meanwhile"), ipywidgets.IntProgress()]
                victim.close()
            other = threading.Thread(target=churn)
            other.start()
            other.join()
        return super().get_state(key, drop_defaults)


class HalfBuilt(ipywidgets.HTML):
    """A widget registered but not ready to give its state (as one read by the page's request while another
    thread still runs its constructor)."""

    building = False

    def get_state(self, key=None, drop_defaults=False):
        if self.building:
            raise AttributeError("'HalfBuilt' object has no attribute 'figure' (still being built)")
        return super().get_state(key, drop_defaults)


@pytest.fixture
def page_control_comm(monkeypatch):
    from workbench.client.widget_states import install

    assert install()  # ipywidgets 8 here: the workbench's handler is in place (workbench.widgets installed it)
    comm = ControlComm()
    monkeypatch.setattr(ipywidgets.Widget, "_control_comm", comm)
    return comm


def test_a_reloaded_page_gets_every_widgets_state_while_other_threads_create_and_close_widgets(page_control_comm):
    """A page reloaded while other threads create and close widgets (a run's progress bars on in_thread's
    worker, the dashboard's pollers): ipywidgets 8.1's own handler iterates its live registry, so it raises
    and the page gets no answer at all ("model not found" after the reload). The workbench's handler
    (workbench/client/widget_states.py) answers with every widget that lived through the request; one closed
    meanwhile or not yet able to give its state is left out, not the whole answer."""
    from workbench.client.widget_states import _ORIGINAL

    ipywidgets_own = _ORIGINAL["handler"].__get__(None, ipywidgets.Widget)
    ours = ipywidgets.Widget._handle_control_comm_msg
    assert ours.__func__ is not ipywidgets_own.__func__

    def widgets():
        stalling = Stalling("reads slowly")
        stalling.victim = ipywidgets.HTML("closed by another thread during the request")
        steady = [ipywidgets.HBox([ipywidgets.IntProgress(value=i, max=10), ipywidgets.HTML(f"{i}/10")])
                  for i in range(10)]
        return stalling, stalling.victim, steady

    stalling, victim, steady = widgets()
    with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
        ask_states(ipywidgets_own)  # without the fix: no answer
    assert page_control_comm.sent == []
    for widget in (stalling, *stalling.made, *steady):
        widget.close()

    stalling, victim, steady = widgets()
    half_built = HalfBuilt("not ready")
    half_built.building = True
    states = ask_states(ours)
    for box in steady:  # every box, its bar, its label and their layouts and styles
        for widget in (box, *box.children, box.layout, box.children[0].style):
            assert widget.model_id in states, widget
        assert states[box.model_id]["model_name"] == "HBoxModel"
        assert states[box.model_id]["state"]["children"] == [f"IPY_MODEL_{c.model_id}" for c in box.children]
    assert stalling.model_id in states and victim.comm is None and half_built.model_id not in states
    assert all(w.model_id not in states for w in stalling.made)  # made after the copy: their comm_open carries them
    half_built.building = False
    for widget in (stalling, half_built, *stalling.made, *steady):
        widget.close()


def test_the_page_gets_its_answer_each_time_while_threads_keep_making_widgets(page_control_comm):
    """The same, with threads making and closing progress bars as fast as they can for the whole time
    (no staging): every request is answered, and with every widget that was there throughout."""
    steady = [ipywidgets.HTML(str(i)) for i in range(50)]
    stop = threading.Event()

    def progress_bars():
        while not stop.is_set():
            bar = ipywidgets.HBox([ipywidgets.HTML("sft"), ipywidgets.FloatProgress(), ipywidgets.HTML("1/3")])
            for widget in (bar, *bar.children):  # with their layouts and styles: left open, they pile up by millions
                for part in (widget, widget.layout, getattr(widget, "style", None)):
                    if part is not None:
                        part.close()
    threads = [threading.Thread(target=progress_bars) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(20):
            states = ask_states(ipywidgets.Widget._handle_control_comm_msg)
            assert {w.model_id for w in steady} <= set(states)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for widget in steady:
            widget.close()
    assert len(page_control_comm.sent) == 20


def test_the_fix_is_installed_once_and_other_control_messages_fail_as_before(page_control_comm):
    from workbench.client.widget_states import install

    handler = ipywidgets.Widget.__dict__["_handle_control_comm_msg"]
    assert install() and ipywidgets.Widget.__dict__["_handle_control_comm_msg"] is handler  # not wrapped twice
    with pytest.raises(RuntimeError, match='Unknown front-end to back-end widget control msg with method "hello"'):
        ipywidgets.Widget._handle_control_comm_msg({"content": {"data": {"method": "hello"}}})


def test_the_answer_to_a_reload_never_refers_to_a_widget_it_leaves_out():
    """A box whose child another thread closed while the states were read is left out of the answer (and a box
    holding that box): the page builds the answer's models together, and one unresolvable child failed them all."""
    from workbench.client import widget_states

    bar = ipywidgets.HBox([ipywidgets.HTML("eval"), ipywidgets.FloatProgress()])
    outer, fine = ipywidgets.VBox([bar]), ipywidgets.HTML("a finished run's bar")
    try:
        states = widget_states.safe_states()
        assert {bar.model_id, outer.model_id, fine.model_id} <= set(states)
        del states[bar.children[0].model_id]  # as if closed while the states were read
        answer = widget_states._self_contained(states)
        assert bar.model_id not in answer and outer.model_id not in answer
        assert fine.model_id in answer and bar.children[1].model_id in answer
        referred = {ref for entry in answer.values() for ref in re.findall(r"IPY_MODEL_(\w+)", json.dumps(entry["state"]))}
        assert referred <= set(answer)
    finally:
        for widget in (outer, bar, *bar.children, fine):
            widget.close()
