"""Compare (checkpoints side by side) and Probes (what one step changed) against a real backend,
driven through the official tinker SDK, as a researcher drives them.

Small on purpose: two prompts, answers of at most 12 tokens, one LoRA run of rank 4. Two tests run on
the real default model (`real_service`, on `real_model_server`), because they check what a few steps
teach it: in test_compare_puts_each_sampler_in_a_column_seeded_alike_and_sorts the trained snapshot
answers "zebra" where the base model does not, and in test_probes_show_what_each_step_changed the
greedy answer comes to say it. The others check what the widgets and the SDK hook do, on any model:
they run on `tinker_server`'s tiny random stand-in (tests/tiny_model.py).
"""

from __future__ import annotations

import html as html_lib
import threading

import pytest
import tinker
from tinker import types

from workbench.client import sdk_hooks
from workbench.recipes.dpo import completion_datum, encode_pair
from workbench.widgets.compare import Compare
from workbench.widgets.probes import Probes, first_divergence

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION, ANSWER = "What is the capital of France?", "Zebra zebra zebra."
PROMPTS = [QUESTION, "Name a colour."]


@pytest.fixture(scope="module")
def service(tinker_server):
    return tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)


@pytest.fixture(scope="module")
def real_service(real_model_server):
    return tinker.ServiceClient(base_url=real_model_server.base_url, api_key=real_model_server.api_key)


def sft(tc, tokenizer, steps: int, lr: float = 5e-3) -> None:
    datum = completion_datum(*encode_pair(QUESTION, ANSWER, tokenizer))
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def test_compare_puts_each_sampler_in_a_column_seeded_alike_and_sorts(real_service):
    base = real_service.create_sampling_client(base_model=BASE).result()
    tc = real_service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    tokenizer = tc.get_tokenizer()
    sft(tc, tokenizer, steps=4)
    trained = tc.save_weights_and_get_sampling_client().result()

    samplers = {"base": base, "base again": base, "trained": trained}
    reward = lambda prompt, answer: float("zebra" in answer.lower())  # noqa: E731
    cmp = Compare(samplers, PROMPTS, reward, max_tokens=12, seed=7, temperature=1.0, progress=False)

    assert cmp.columns == ["base", "base again", "trained"]
    assert cmp.html.count('class="wb-sampler"') == 3
    for name in cmp.columns:
        assert f'data-sampler="{html_lib.escape(name)}"' in cmp.html
    assert [r["prompt"] for r in cmp.rows] == PROMPTS
    for row in cmp.rows:
        for name in cmp.columns:
            answer = row["answers"][name]
            assert answer["length"] == len(answer["token_ids"]) == len(answer["tokens"]) > 0
            assert answer["mean_logprob"] == pytest.approx(sum(answer["logprobs"]) / answer["length"])
            assert answer["reward"] == reward(row["prompt"], answer["text"])
            assert html_lib.escape(answer["text"]) in cmp.html
        # the same sampler and the same seed (temperature 1): the same answer, token for token
        assert row["answers"]["base"]["token_ids"] == row["answers"]["base again"]["token_ids"]
    # the trained snapshot learned its one datum: it answers the trained question with it
    assert cmp.rows[0]["answers"]["trained"]["reward"] == 1.0
    assert cmp.rows[0]["answers"]["base"]["reward"] == 0.0

    # another seed gives other samples: the seed is what made the two base columns agree
    other = Compare({"base": base}, PROMPTS, max_tokens=12, seed=8, temperature=1.0, progress=False)
    assert any(o["answers"]["base"]["token_ids"] != r["answers"]["base"]["token_ids"]
               for o, r in zip(other.rows, cmp.rows))

    # sorting by a sampler's mean logprob, both ways; the table is redrawn in that order
    values = [r["answers"]["base"]["mean_logprob"] for r in cmp.rows]
    assert values[0] != values[1]
    cmp.sort("base", "mean_logprob", ascending=True)
    ascending = [r["index"] for r in cmp.rows]
    assert ascending == sorted(range(2), key=lambda i: values[i])
    cmp.sort_by, cmp.ascending = "base:mean_logprob", False  # what the dropdown and checkbox set
    assert [r["index"] for r in cmp.rows] == ascending[::-1]
    assert cmp._sort.value == "base:mean_logprob" and cmp._order.value is False
    first = cmp.rows[0]["prompt"]
    assert cmp.html.index(html_lib.escape(first)) < cmp.html.index(html_lib.escape(cmp.rows[1]["prompt"]))
    cmp.sort("trained", "reward")
    assert cmp.rows[0]["index"] == 0  # the trained answer's reward 1 comes first
    cmp.sort()
    assert [r["index"] for r in cmp.rows] == [0, 1]

    # a row opens its answers token by token, each token a span coloured by its logprob
    shown = cmp.open_row(1)
    assert cmp.opened == 1 and "<details open>" in cmp.html
    assert shown.count('class="wb-tok"') == sum(cmp.rows[1]["answers"][n]["length"] for n in cmp.columns)
    with pytest.raises(ValueError, match="no reward function"):
        other.sort("base", "reward")


def test_the_optim_step_hook_runs_on_the_callers_thread_and_changes_nothing(service):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    seen = []
    remove = sdk_hooks.on_optim_step(tc, lambda client, future: seen.append((client, future, threading.get_ident())))
    sdk_hooks.install()  # again: still one wrapper, so one call per step
    future = tc.optim_step(types.AdamParams(learning_rate=1e-4))
    assert len(seen) == 1 and seen[0][0] is tc and seen[0][1] is future and seen[0][2] == threading.get_ident()
    assert isinstance(future.result(), types.OptimStepResponse)
    remove()
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    assert len(seen) == 1


def test_probes_show_what_each_step_changed(real_service):
    tc = real_service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    tokenizer = tc.get_tokenizer()
    probes = Probes(tc, [(QUESTION, ANSWER), {"prompt": "Name a colour.", "reference": "Blue."}, QUESTION],
                    max_tokens=12)
    probes.wait()
    assert probes.steps == [0]
    assert [c["index"] for c in probes.changes] == [0, 1] and [a["index"] for a in probes.answers] == [2]
    assert probes.changes[0]["delta"] is None and probes.changes[0]["sums"] == []
    prompt_ids, full = encode_pair(QUESTION, ANSWER, tokenizer)
    assert len(probes.changes[0]["tokens"]) == len(full) - len(prompt_ids)

    sft(tc, tokenizer, steps=1)  # the hook measures after the step, in the background
    probes.wait()
    assert probes.steps == [0, 1]
    trained = probes.changes[0]
    assert len(trained["delta"]) == len(trained["tokens"])
    assert trained["sums"][-1] == pytest.approx(sum(trained["delta"]))
    assert trained["sums"][-1] > 0  # the step trained on this very reference: it got likelier
    for piece in trained["tokens"]:
        assert html_lib.escape(piece) in probes.html  # the heat map shows the tokens as text
    assert probes.html.count('class="wb-tok"') == sum(len(c["tokens"]) for c in probes.changes)
    assert 'data-mode="change"' in probes.html

    # an explicit measurement with no step in between changes nothing
    probes.measure()
    assert probes.steps == [0, 1, 1] and max(abs(d) for d in probes.changes[0]["delta"]) < 1e-4

    marked = []
    for step in (2, 3, 4):  # each step's greedy answer before and after it, the first differing token marked
        sft(tc, tokenizer, steps=1)
        probes.wait()
        answer = probes.answers[0]
        assert answer["before"] and answer["after"] and probes.steps[-1] == step
        assert (answer["divergence"] is None) == (answer["before_tokens"] == answer["after_tokens"])
        if answer["divergence"] is not None:
            d = answer["divergence"]
            assert answer["before_tokens"][:d] == answer["after_tokens"][:d]
            marked.append(probes.html.count('class="wb-diverge"'))
    assert probes.steps == [0, 1, 1, 2, 3, 4]
    assert probes.changes[0]["total"] > trained["sums"][-1]  # four steps on it moved it further than one
    assert "zebra" not in answer["first"].lower() and "zebra" in answer["after"].lower()
    assert marked and all(count == 2 for count in marked)  # the answer changed at some step, marked in both
    probes.close()
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    assert probes.steps[-1] == 4  # closed: no longer measuring


def test_probes_are_bounded(service):
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    with pytest.raises(ValueError, match="max_probes=2"):
        Probes(tc, ["a", "b", "c"], max_probes=2)
    with pytest.raises(ValueError, match="max_tokens=4"):
        Probes(tc, [("Say something long.", "This reference answer is many tokens long indeed.")], max_tokens=4)


def test_probes_count_steps_from_where_the_run_is(tinker_server):
    """With a workbench connection (what Dashboard.watch passes), the "before" is the run's own step."""
    import workbench

    client = workbench.connect(tinker_server.base_url, tinker_server.api_key, progress=False)
    try:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
        sft(tc, tc.get_tokenizer(), steps=2, lr=1e-4)
        probes = Probes(tc, [(QUESTION, "Paris.")], connection=workbench.current(), max_tokens=12).wait()
        assert probes.steps == [2]
        tc.optim_step(types.AdamParams(learning_rate=1e-4))
        assert probes.wait().steps == [2, 3] and "step 3, the change since step 2" in probes.html

        # Two steps sent back to back, nothing waited for: each measurement still sees the weights
        # after exactly its own step (it is in the run's request order right after it).
        tokenizer = tc.get_tokenizer()
        datum = completion_datum(*encode_pair(QUESTION, ANSWER, tokenizer))
        for _ in range(2):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-3))
        measured = [h["logprobs"][0] for h in probes.wait()._history]
        assert probes.steps == [2, 3, 4, 5]
        prompt_ids, full = encode_pair(QUESTION, "Paris.", tokenizer)
        for step, logprobs in zip((4, 5), measured[2:]):
            sampler = workbench.sampler_at(tc, step=step)
            expected = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[len(prompt_ids):]
            assert logprobs == pytest.approx(expected, abs=1e-3)
        assert max(abs(a - b) for a, b in zip(measured[2], measured[3])) > 0.01  # the two steps differ
    finally:
        workbench.disconnect()


def test_the_first_divergent_token_and_its_mark():
    from workbench.widgets.probes import marked_html, normalize_probes

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one answer stopped where the other went on
    assert marked_html(["a", "<b>"], 1).count('class="wb-diverge"') == 1 and "&lt;b&gt;" in marked_html(["a", "<b>"], 1)
    assert "∎" in marked_html(["a"], 1) and "wb-diverge" not in marked_html(["a"], None)
    assert normalize_probes(["p", ("q", "r"), {"prompt": "s"}]) == [
        {"prompt": "p", "reference": None}, {"prompt": "q", "reference": "r"}, {"prompt": "s", "reference": None}]
    with pytest.raises(ValueError, match="probe 0"):
        normalize_probes([("a", "b", "c")])
