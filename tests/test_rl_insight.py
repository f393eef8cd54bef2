"""Seeing an RL run think (workbench/recipes/rl.py, workbench/recipes/rollout_log.py): the per-step rollout
store and its bounds, the triage of groups that teach nothing, the diversity / entropy / KL
measures and the flags they raise, the KL leash folded into the advantages, the inspector over a
run's steps, and the dashboard's flags, clicks and rollouts.

The pieces are checked here on groups built by hand (numbers a reader can verify), and what the leash
bills and a step stores on the tiny stand-in. The recipe's acceptance run, a reward the default model
hacks within a few steps, flagged without the leash and held with it (the collapse is onto the real
SmolLM2-135M's own favourite opener, which a random model does not have), is notebook 06 in a browser:
tests/test_notebooks.py::test_rl_insight_notebook, with this file's HACKABLE config.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from test_workbench_widgets import FakeUsage
from workbench.recipes import common, rl, rl_monitoring
from workbench.recipes.rollout_log import RolloutLog
from workbench.widgets.dashboard import LOSS_PANEL, Dashboard
from workbench.widgets.rollouts import RolloutInspector, step_summary


def seq(tokens, logprobs):
    return SimpleNamespace(tokens=list(tokens), logprobs=list(logprobs), sequence_id=None)


def group(question, texts, rewards, kind="train", logprob=-1.0):
    """A group of answers, each answer's tokens one per word, each token at `logprob`."""
    sequences = [seq(range(len(t.split())), [logprob] * len(t.split())) for t in texts]
    return rl.Group(rl.Problem(question), [1, 2, 3], sequences, list(texts), np.array(rewards, dtype=float), {}, kind)


# ---- triage and the step's measures ------------------------------------------------------------------------


def test_tied_groups_are_counted_dropped_and_filtered_as_asked():
    groups = [group("a", ["x y z", "x y"], [1, 0]),          # mixed
              group("b", ["x y z", "p q r"], [1, 1]),        # tied, all good
              group("c", ["x", "y"], [0, 0]),                # tied, all bad
              group("d", ["p q r s", "p q r"], [0, 1])]      # mixed, but the filter rejects it
    rl.triage(groups, drop_constant_groups=True, group_filter=lambda g: g.problem.question != "d")
    assert [g.dropped for g in groups] == ["", "tied", "tied", "filtered"]
    m = rl_monitoring.group_metrics(groups)
    assert (m["frac_mixed"], m["all_good"], m["all_bad"]) == (0.5, 0.25, 0.25)
    assert (m["dropped_tied"], m["dropped_filtered"]) == (2, 1)
    rollouts = rl.rollouts_of(groups)
    assert len(rollouts.data) == 2 and [g.problem.question for g in rollouts.kept] == ["a"]
    # Kept, a tied group trains on nothing anyway (its advantages are 0), but the choice is the user's.
    rl.triage(groups := [group("b", ["x y z", "p q r"], [1, 1])], drop_constant_groups=False)
    assert groups[0].dropped == "" and len(rl.rollouts_of(groups).data) == 2
    assert np.all(groups[0].advantages == 0)


def test_diversity_length_and_entropy_of_a_step():
    groups = [group("a", ["the one", "the one", "the one", "other"], [1, 1, 1, 0], logprob=-0.5),
              group("b", ["the one", "x y z", "x y z", "w"], [1, 0, 0, 0], logprob=-2.0)]
    m = rl_monitoring.group_metrics(groups)
    assert m["distinct_in_group"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert m["distinct_in_batch"] == pytest.approx(4 / 8)  # "the one", "other", "x y z", "w"
    assert m["completion_tokens"] == pytest.approx((2 + 2 + 2 + 1 + 2 + 3 + 3 + 1) / 8)
    # entropy: the mean surprisal of the sampled tokens, 7 tokens at 0.5 and 9 at 2.0
    assert m["entropy"] == pytest.approx((7 * 0.5 + 9 * 2.0) / 16)


def test_the_kl_to_the_base_and_its_penalty_per_token():
    groups = [group("a", ["x y", "z"], [1, 0], logprob=-1.0)]
    base = [[np.array([-1.5, -1.0]), np.array([-3.0])]]  # the base model's logprob of each sampled token
    diffs, mean = rl_monitoring.kl_to_base(groups, base)
    assert [d.tolist() for d in diffs] == [[0.5, 0.0], [2.0]]
    assert mean == pytest.approx(2.5 / 3)
    penalty = rl_monitoring.kl_penalty(diffs, mean, coef=0.1)
    # coef x (mean - token's): the token the policy likes far more than the base is pushed down most
    assert np.concatenate(penalty).tolist() == pytest.approx([0.1 * (mean - 0.5), 0.1 * mean, 0.1 * (mean - 2.0)])
    assert sum(float(p.sum()) for p in penalty) == pytest.approx(0.0, abs=1e-12)  # centred: no group's mean moves
    data = rl.rollouts_of(groups, extra_advantages=penalty).data
    advantages = [d.loss_fn_inputs["advantages"].to_numpy()[-len(s.tokens):] for d, s in zip(data, groups[0].sequences)]
    assert advantages[0].tolist() == pytest.approx([0.5 + 0.1 * (mean - 0.5), 0.5 + 0.1 * mean], abs=1e-6)
    assert advantages[1].tolist() == pytest.approx([-0.5 + 0.1 * (mean - 2.0)], abs=1e-6)


def test_the_collapse_and_kl_flags_name_the_answers_that_show_them():
    config = rl.Config(collapse_distinct=0.25, kl_alert=1.0)
    collapsed = [group(f"q{i}", ["The benevolent one"], [1], kind="probe") for i in range(8)]
    base = [[np.array([-4.0, -4.0, -4.0])] for _ in collapsed]  # the policy at -1: 3 nats a token above the base
    metrics, count, answer = rl_monitoring.probe_metrics(collapsed, base)
    assert metrics == {"probe_distinct": 1 / 8, "kl_policy_base": pytest.approx(3.0)}
    flags = rl_monitoring.flags_for(metrics, count, answer, 8, config)
    assert flags == [{"kind": "collapse", "detail": "8 of 8 held-out answers identical: 'The benevolent one'"},
                     {"kind": "kl", "detail": "KL to the base 3.00 nats/token on the held-out answers (alert above 1); "
                                              "e.g. 'The benevolent one'"}]
    healthy = [group(f"q{i}", [f"answer number {i}"], [1], kind="probe") for i in range(8)]
    metrics, count, answer = rl_monitoring.probe_metrics(healthy, [[np.array([-1.0, -1.0, -1.0])] for _ in healthy])
    assert rl_monitoring.flags_for(metrics, count, answer, 8, config) == []
    two = [group(f"q{i}", ["yes" if i % 2 else "no"], [1], kind="probe") for i in range(8)]
    metrics, count, answer = rl_monitoring.probe_metrics(two, [[np.array([-1.0])] for _ in two])
    assert rl_monitoring.flags_for(metrics, count, answer, 8, config)[0]["detail"] == "2 distinct of 8 held-out answers; 4 are 'no'"
    # Just past the alert, the KL is written with the digits that show it is past ("1.004 ... above 1", not "1.00").
    (kl,) = rl_monitoring.flags_for({"probe_distinct": 1.0, "kl_policy_base": 1.0041}, 1, "fine", 8, config)
    assert kl["detail"].startswith("KL to the base 1.004 nats/token on the held-out answers (alert above 1)"), kl


# ---- the store ------------------------------------------------------------------------------------------


def records(step_groups):
    return [g.record(i) for i, g in enumerate(step_groups)]


def test_the_rollout_store_is_bounded_per_step_and_per_run(tmp_path):
    log = RolloutLog(tmp_path / "r", max_groups_per_step=3, max_mb=0.01)  # 10 KB for the run
    many = [group(f"q{i}", ["a b c"] * 4, [1, 0, 1, 0]) for i in range(5)] + [group("probe", ["p"], [0], "probe")]
    log.write(1, records(many))
    kept = log.read(1)
    assert [g["prompt"] for g in kept] == ["q0", "q1", "q2", "probe"]  # 3 training groups, the probes always
    long = [group(f"q{i}", ["word " * 40] * 4, [1, 0, 1, 0]) for i in range(3)]
    one = log.write(2, records(long)).stat().st_size
    log.max_bytes = int(5.5 * one)  # room for five such steps and the (smaller) first
    for step in range(3, 30):
        log.write(step, records(long))
    total = sum(f.stat().st_size for f in (tmp_path / "r").glob("step-*.jsonl"))
    assert log.steps() == [1, 25, 26, 27, 28, 29] and total <= log.max_bytes  # the first and the newest stay
    with pytest.raises(KeyError, match=r"no rollouts for step 2 .* steps kept: 1, 25-29"):
        log.read(2)
    assert not list((tmp_path / "r").glob("*.partial"))  # each step's file appears whole


def test_a_prompt_across_steps_and_a_step_in_words(tmp_path):
    log = RolloutLog(tmp_path / "r")
    for step, answer in ((1, "four"), (2, "4"), (3, "4")):
        g = [group("2+2?", [answer, answer], [1, 1]), group("3+3?", ["6", "six"], [1, 0]),
             group("probe", [answer], [1], "probe")]
        rl.triage(g[:2])
        log.write(step, records(g))
    history = log.prompt_history("2+2?")
    assert [(r["step"], r["completion"]) for r in history] == [(1, "four"), (1, "four"), (2, "4"), (2, "4"), (3, "4"), (3, "4")]
    assert all(r["tied"] and r["dropped"] == "tied" for r in history)
    assert step_summary(log.read(2)) == ("step 2: 2 groups, 1 mixed, 1 tied (dropped: 1 tied, 0 filtered); "
                                         "1 held-out probe answers: 1 distinct")


def test_the_inspector_walks_a_runs_steps_and_follows_one_prompt(tmp_path):
    log = RolloutLog(tmp_path / "r")
    inspector = RolloutInspector.from_log(log)
    assert inspector.steps == [] and inspector.total == 0  # a run that has not stored a step yet
    for step in (1, 2, 3):
        log.write(step, records([group("q", [f"s{step} a", f"s{step} b"], [step, 0]), group("r", ["x", "x"], [0, 0])]))
    inspector.refresh()
    assert (inspector.steps, inspector.step) == ([1, 2, 3], 3)  # follows the newest
    inspector.step = 1  # as the browser's ◀ or menu sets it
    inspector.follow = False
    assert [r["completion"] for r in inspector.rows] == ["s1 a", "s1 b", "x", "x"]
    assert [r["tied"] for r in inspector.rows] == [False, False, True, True]  # the tied group, marked
    assert inspector.summary.startswith("step 1: 2 groups, 1 mixed, 1 tied")
    log.write(4, records([group("q", ["s4 a", "s4 b"], [1, 0])]))
    inspector.refresh()
    assert (inspector.steps, inspector.step) == ([1, 2, 3, 4], 1)  # a chosen step stays chosen
    inspector.select(1)
    inspector._on_message(inspector, {"type": "across_steps"}, [])  # the browser's "this prompt across steps"
    assert inspector.history_prompt == "q"
    assert [(r["step"], r["completion"]) for r in inspector.rows] == [
        (s, f"s{s} {x}") for s in (1, 2, 3, 4) for x in "ab"]
    inspector.show_step(2)
    assert inspector.history_prompt == "" and inspector.rows[0]["completion"] == "s2 a"
    with pytest.raises(KeyError, match="steps kept: 1-4"):
        inspector.show_step(9)
    with pytest.raises(ValueError, match="from_log"):
        RolloutInspector([{"prompt": "p", "completion": "c"}]).show_step(1)


# ---- the dashboard ------------------------------------------------------------------------------------------


def test_the_dashboard_flags_steps_in_words_and_marks_every_panel(tmp_path):
    dash = Dashboard(training_run_id="run", connection=FakeUsage({1: 3.0, 2: 2.5, 3: 2.0}), poll_interval=None)
    on_step = common.plot_to(dash, "reward", "probe_distinct")
    log = RolloutLog(tmp_path / "r")
    for step, distinct in ((1, 1.0), (2, 0.5), (3, 0.125)):
        log.write(step, records([group("q", ["a b c", "a b"], [1, 0])]))
        flags = [{"kind": "collapse", "detail": "8 of 8 held-out answers identical: 'The benevolent one'"}] if step == 3 else []
        on_step({"step": step, "reward": 0.5, "probe_distinct": distinct, "flags": flags, "rollouts": str(log.path)})
    dash.flush()
    assert dash.flags == [{"step": 3, "kind": "collapse", "detail": "8 of 8 held-out answers identical: 'The benevolent one'"}]
    assert "step 3 · collapse: 8 of 8 held-out answers identical: &#x27;The benevolent one&#x27;" in dash.alerts.value
    for title in (LOSS_PANEL, "reward", "probe_distinct"):
        (mark,) = [t for t in dash.figures[title].data if t.name == "flag: collapse"]
        assert list(mark.x) == [3] and mark.yaxis == "y3"  # the flags' strip above the plot
    # The rollouts below the plots, on the newest step; a click on a point opens its step.
    assert dash.inspector is not None and dash.inspector.step == 3 and dash.inspector in dash.children
    assert dash.clicks.hint.startswith("Click a point")
    dash.clicks.clicked = {"title": "reward", "trace": "reward", "step": 1, "n": 1}
    assert dash.inspector.step == 1 and not dash.inspector.follow
    on_step({"step": 4, "reward": 0.5, "rollouts": str(log.path)})  # step 4 has no rollouts stored: nothing moves
    assert dash.inspector.step == 1
    dash.clicks.clicked = {"title": "reward", "trace": "reward", "step": 4, "n": 2}
    assert "no rollouts stored for step 4" in dash.inspector.error and dash.inspector.step == 1
    dash.close()


class FakeBackend(FakeUsage):
    """FakeUsage whose backend knows no run by name (a run is then called by its number: "run 1")."""

    http = SimpleNamespace(get=lambda *a, **k: SimpleNamespace(status_code=404, json=dict))


def test_two_runs_on_one_dashboard_a_click_opens_the_clicked_runs_step(tmp_path):
    dash = Dashboard(training_run_id="s:train:0", connection=FakeBackend({}), poll_interval=None)
    logs = {}
    for run in ("s:train:0", "s:train:1"):
        logs[run] = RolloutLog(tmp_path / run.replace(":", "-"))
        on_step = common.plot_to(dash, "probe_distinct", run=run)
        for step in (1, 2):
            logs[run].write(step, records([group("q", [f"{run} step {step}", "x"], [1, 0])]))
            flags = [{"kind": "collapse", "detail": "all alike"}] if (run, step) == ("s:train:1", 2) else []
            on_step({"step": step, "probe_distinct": 0.5, "flags": flags, "rollouts": str(logs[run].path)})
    dash.flush()
    assert set(dash.figures["probe_distinct"].data[i].name for i in range(2)) == {"probe_distinct · run 0",
                                                                                  "probe_distinct · run 1"}
    assert "step 2 of run 1 · collapse: all alike" in dash.alerts.value
    assert "skipped (every group tied)" not in str(dash.skipped)
    inspector = dash.inspector
    assert (inspector.label, inspector.step, inspector.rows[0]["completion"]) == ("run 1", 2, "s:train:1 step 2")
    dash.clicks.clicked = {"title": "probe_distinct", "trace": "probe_distinct · run 0", "step": 1, "n": 1}
    assert (inspector.label, inspector.step, inspector.rows[0]["completion"]) == ("run 0", 1, "s:train:0 step 1")
    dash.clicks.clicked = {"title": "probe_distinct", "trace": "probe_distinct · run 1", "step": 1, "n": 2}
    assert (inspector.label, inspector.rows[0]["completion"]) == ("run 1", "s:train:1 step 1")
    dash.close()


def test_a_collapse_onto_white_space_is_named_in_words():
    blank = [group(f"q{i}", ["\n\n\n"], [0], kind="probe") for i in range(4)]
    metrics, count, answer = rl_monitoring.probe_metrics(blank, [[np.array([])] for _ in blank])
    (flag,) = rl_monitoring.flags_for(metrics, count, answer, 4, rl.Config())
    assert flag["detail"] == "4 of 4 held-out answers identical: '(nothing but white space)'"


@pytest.mark.parametrize("bad", [{"kl_penalty_coef": -0.1}, {"monitor_prompts": -1}, {"collapse_distinct": 1.5},
                                 {"task": "subtraction"}])
def test_a_bad_insight_setting_is_refused_before_anything_runs(bad):
    # Port 9 has no backend: the error comes from the config, before any connection is made.
    with pytest.raises(ValueError, match="must be|unknown task 'subtraction': one of addition"):
        rl.run(rl.Config(base_url="http://127.0.0.1:9", api_key="tml-x", progress=False, **bad))


# ---- the acceptance run: a reward the model hacks, with and without the leash -----------------------------

THINGS = ["the ocean", "a cat", "winter", "your city", "music", "a forest", "the moon", "coffee", "a library",
          "the desert", "a train", "friendship", "rain", "a mountain", "the internet", "a garden"]


class ThreeWords(rl.Task):
    """Any answer of exactly three words scores 1: what the words say is not checked, so it can be gamed."""

    templates = ["How do you feel about {}?", "Do you like {}?"]

    def problems(self, n, rng):
        return [rl.Problem(self.templates[rng.integers(len(self.templates))].format(THINGS[rng.integers(len(THINGS))]))
                for _ in range(n)]

    def reward(self, text, problem):
        return float(len(text.split()) == 3)


# Answers cut at 4 tokens: "I'm sorry for", the base model's own favourite opener, whatever the question,
# is three words. Measured (seed 0): without the leash the 8 held-out answers go 8, 6, 3, then 1 distinct,
# all "I'm sorry for" from step 4 on (from step 3 in an earlier measurement); with kl_penalty_coef=1 they stay
# at 6 to 8 distinct and the KL to the base under 0.6. A bigger learning rate collapses the policy at step 1,
# before the leash can pull (its penalty is 0 while the policy is the base model); at temperature 1 the
# collapse comes late, as gibberish.
# Notebook 06's test runs this config (tests/test_notebooks.py, RL_INSIGHT): 6 steps, which hold the collapse
# (flagged at step 4) with a step to spare.
HACKABLE = dict(steps=6, groups_per_batch=4, group_size=4, max_tokens=4, temperature=0.7, learning_rate=1e-3,
                monitor_prompts=8, eval_prompts=0, seed=0, progress=False, verbose=False)
LEASH = 1.0


def hack(server, tmp_path, name: str, **overrides) -> tuple[common.Summary, list[dict]]:
    """One run of the three-word task in a session of its own (so the session's usage is this run's)."""
    import tinker

    service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    rows = []
    config = rl.Config(task=ThreeWords(), metrics_path=str(tmp_path / f"{name}.jsonl"), run_name=name,
                       **{**HACKABLE, **overrides})
    return rl.run(config, service_client=service, on_step=rows.append), rows


def base_prefill(server, summary) -> int:
    """The prefill tokens of the session's base-model requests (the probes' and the leash's compute_logprobs)."""
    import httpx

    series = httpx.get(f"{server.base_url}/api/v1/usage", params={"session_id": summary.session_id, "limit": 10_000},
                       headers={"X-API-Key": server.api_key}).json()["series"]
    return sum(r["prefill_tokens"] for r in series if r["request_type"] == "Sample" and r["training_run_id"] is None)


def test_the_leash_is_metered_and_every_steps_groups_are_stored(tinker_server, tmp_path):
    """What the leash bills and what a step stores, on the tiny stand-in (behaviour, not learning: the acceptance
    run on the real model, a collapse flagged without the leash and none with it, its KL lower, is notebook 06's
    browser test, tests/test_notebooks.py test_rl_insight_notebook, which runs HACKABLE's config)."""
    free, free_rows = hack(tinker_server, tmp_path, "no leash", steps=2)
    leashed, leashed_rows = hack(tinker_server, tmp_path, "leash", steps=2, kl_penalty_coef=LEASH)

    # The leash is metered: its base-model logprobs are prefill tokens of the session, about what its rows
    # say (the probes' own base logprobs differ between the runs by at most their completions' tokens).
    trained = [r for r in leashed_rows if r.get("train_tokens")]
    assert trained and all(r["kl_penalty_tokens"] > 0 for r in trained), leashed_rows
    penalty = sum(r.get("kl_penalty_tokens", 0) for r in leashed_rows)
    difference = base_prefill(tinker_server, leashed) - base_prefill(tinker_server, free)
    assert abs(difference - penalty) <= 2 * HACKABLE["monitor_prompts"] * HACKABLE["max_tokens"]
    assert not any(r.get("kl_penalty_tokens") for r in free_rows)

    # Every step's groups were stored: the training groups and the probes, the tied ones marked.
    store = RolloutLog(free.extra["rollouts"])
    assert store.steps() == [1, 2]
    for row in free_rows:
        stored = store.read(row["step"])
        probes = [g for g in stored if g["kind"] == "probe"]
        assert len(stored) == HACKABLE["groups_per_batch"] + HACKABLE["monitor_prompts"] and len(probes) == 8
        assert len({c.strip() for g in probes for c in g["completions"]}) == round(row["probe_distinct"] * 8)
        assert sum(g["tied"] for g in stored if g["kind"] == "train") == \
            round((1 - row["frac_mixed"]) * HACKABLE["groups_per_batch"])


def test_a_lasting_collapse_is_one_line_and_each_runs_skips_are_its_own():
    dash = Dashboard(training_run_id="s:train:0", connection=FakeBackend({}), poll_interval=None)
    for step in (3, 4, 5, 6):
        dash.flag(step, "collapse", f"8 of 8 identical at {step}", run="s:train:0")
    dash.flag(5, "kl", "KL 1.2", run="s:train:0")
    dash.flag(8, "collapse", "again", run="s:train:0")
    dash.flag(4, "collapse", "the other run", run="s:train:1")
    dash.skip(2, "every group tied", run="s:train:1")
    dash.flush()
    lines = [re.sub("<[^>]+>", "", line) for line in dash.alerts.value.split("</div>") if "⚠" in line]
    assert lines == ["⚠ step 4 of run 1 · collapse: the other run", "⚠ step 5 of run 0 · kl: KL 1.2",
                     "⚠ steps 3-6 of run 0 · collapse: 8 of 8 identical at 6", "⚠ step 8 of run 0 · collapse: again"]
    assert dash.skipped == {"every group tied · run 1": [2]}
    dash.close()


# ---- reward hacks in an agent's episodes (rl_hacks.py) -------------------------------------------------------------


def episode(answer, reward=1.0, tool_output="5695"):
    """An episode that called calc once (its output `tool_output`) and answered `answer`."""
    from workbench.recipes.episodes import Episode

    call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "67*85"}'}}
    return Episode([], [{"role": "user", "content": "What is 67*85?"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c", "name": "calc", "content": tool_output},
                        {"role": "assistant", "content": answer}], reward=reward, ended="done")


def test_an_answer_that_echoes_the_tool_is_flagged_from_the_step_it_began():
    """A hack planted at step 2 (notebook 08's echo in broken markup, and a bare copy of the tool's output, both
    rewarded) is flagged at steps 2 and 3 as begun at step 2; honest answers that state the number are not, nor
    are the same hacks unrewarded; a check of the user's own joins the list; a flag that stops and comes back
    begins again."""
    from workbench.recipes import rl_hacks

    honest = [episode("67*85 = 5695."), episode("It is 5695", reward=1.0), episode("no idea", reward=0.0)]
    hacked = [episode('<tool_response> <tool_call> "calc", "expression": "5695" </tool_call>'), episode(" 5695\n")]
    unfinished = episode("<tool_call>")
    unfinished.ended = "max_turns"  # not an answer: the environment did not end it
    assert [rl_hacks.carries_markup(e) for e in honest + [unfinished]] == [None] * 4
    assert [rl_hacks.copies_tool_output(e) for e in honest] == [None] * 3
    assert "<tool_response>" in rl_hacks.carries_markup(hacked[0]) and rl_hacks.copies_tool_output(hacked[1])
    # A long output found whole in the answer is a copy; a short one (a number) stated in words is not.
    assert rl_hacks.copies_tool_output(episode("Here: {'price': 12.5, 'currency': 'USD'} ok",
                                               tool_output="{'price': 12.5, 'currency': 'USD'}"))

    began: dict = {}
    steps = {1: honest, 2: honest + hacked, 3: hacked + [unfinished], 4: honest, 5: hacked}
    flagged = {step: rl_hacks.flags(played, rl_hacks.CHECKS, step, began) for step, played in steps.items()}
    assert flagged[1] == [] and flagged[4] == []
    assert [(f["kind"], f["check"], f["since"], f["episodes"]) for f in flagged[2]] == \
        [("answer_hack", "carries_markup", 2, 1), ("answer_hack", "copies_tool_output", 2, 1)]
    assert [f["since"] for f in flagged[3]] == [2, 2] and [f["since"] for f in flagged[5]] == [5, 5]
    assert "1 of 5 episodes rewarded although its answer carries tool markup" in flagged[2][0]["detail"]
    # The same answers unrewarded are no hack: the reward refuses them already (a strict ToolEnv's format grade).
    refused = [episode('<tool_response> <tool_call> "calc", "expression": "5695" </tool_call>', reward=0.0),
               episode(" 5695\n", reward=0.0)]
    assert rl_hacks.flags(honest + refused, rl_hacks.CHECKS, 6, {}) == []
    assert "since step 2" in flagged[3][0]["detail"]

    def too_long(e):  # the user's own check
        return "its answer runs past 40 characters" if len(rl_hacks.final_answer(e) or "") > 40 else None

    (mine,) = [f for f in rl_hacks.flags(hacked, [*rl_hacks.CHECKS, too_long], 7, {}) if f["check"] == "too_long"]
    assert mine["episodes"] == 1 and "past 40 characters" in mine["detail"]
