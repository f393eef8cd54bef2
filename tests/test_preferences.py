"""Preference judgments without a backend: strength in the DPO loss (against a hand computation), the
live loop's ordering, hidden repeats and self-agreement, the richer judgments' records and their bad
input, and the prompt/chosen/rejected JSONL round trip (workbench/recipes/preference_labels.py,
workbench/recipes/dpo.py, workbench/recipes/live_preference.py, workbench/widgets/labeler.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tinker import types

from workbench.recipes import preference_labels
from workbench.recipes.dpo import completion_datum, dpo_loss, with_confidence
from workbench.recipes.live_preference import LiveConfig, config_from, order
from workbench.widgets.labeler import Labeler


# ---- strength in the DPO loss ------------------------------------------------------------------------


def pair_datums(ref: list[float]) -> list[types.Datum]:
    """Two pairs over a 3-token prompt and a 2-token answer; `ref` is each datum's reference logprob
    per answer token (the same on both of its tokens)."""
    data = []
    for r in ref:
        datum = completion_datum([1, 2, 3], [1, 2, 3, 4, 5])  # targets 2..5; weights on the answer: [0, 0, 1, 1]
        data.append(types.Datum(model_input=datum.model_input,
                                loss_fn_inputs={**datum.loss_fn_inputs, "ref_logprobs": np.array([0, 0, r, r], np.float32)}))
    return data


def test_strength_makes_the_dpo_label_soft_as_computed_by_hand():
    beta = 0.5
    ref = [-1.0, -2.0, -1.5, -1.5]  # chosen0, rejected0, chosen1, rejected1
    data = pair_datums(ref)
    with_confidence(data[2], 0.75)  # the second pair is a slight preference
    policy = [-0.5, -2.5, -1.0, -1.5]  # per answer token
    logprobs = [torch.tensor([-9.0, -9.0, p, p], requires_grad=True) for p in policy]  # the prompt's positions don't count
    loss, metrics = dpo_loss(data, logprobs, beta=beta)

    # By hand: m = beta * ((pi_c - ref_c) - (pi_r - ref_r)), each sum over the two answer tokens.
    m0 = beta * ((2 * -0.5 - 2 * -1.0) - (2 * -2.5 - 2 * -2.0))  # 0.5 * (1 + 1) = 1.0
    m1 = beta * ((2 * -1.0 - 2 * -1.5) - (2 * -1.5 - 2 * -1.5))  # 0.5 * 1 = 0.5
    logsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    by_hand = (-logsig(m0) - (0.75 * logsig(m1) + 0.25 * logsig(-m1))) / 2
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-6)
    assert metrics["margin:mean"] == pytest.approx((m0 + m1) / 2, rel=1e-6)

    # Plain DPO (no confidence) is the p = 1 case.
    plain, _ = dpo_loss(pair_datums(ref), [lp.detach() for lp in logprobs], beta=beta)
    assert float(plain) == pytest.approx((-logsig(m0) - logsig(m1)) / 2, rel=1e-6)

    # A slight preference stops pulling where sigmoid(m) = 0.75 (m = log 3); a clear one never does.
    at = math.log(3) / beta / 2  # per-token policy gain over the reference that gives m = log 3
    tokens = [torch.tensor([0.0, 0.0, -1.0 + at, -1.0 + at], requires_grad=True), torch.tensor([0.0, 0.0, -1.0, -1.0])]
    slight = pair_datums([-1.0, -1.0])
    with_confidence(slight[0], 0.75)
    loss, _ = dpo_loss(slight, tokens, beta=beta)
    loss.backward()
    assert tokens[0].grad.abs().max() < 1e-6
    tokens[0].grad = None
    loss, _ = dpo_loss(pair_datums([-1.0, -1.0]), tokens, beta=beta)
    loss.backward()
    assert tokens[0].grad[2] < -0.01  # plain DPO still pushes the chosen answer up


# ---- which pair to show first ------------------------------------------------------------------------


def test_the_queue_orders_informative_pairs_first():
    items = [{"id": "far", "policy_logprob": [-5.0, -25.0], "ref_logprob": [-5.0, -25.0], "coin": 0.9},
             {"id": "close", "policy_logprob": [-10.0, -10.5], "ref_logprob": [-10.0, -10.5], "coin": 0.1},
             {"id": "moved", "policy_logprob": [-8.0, -12.0], "ref_logprob": [-12.0, -8.0], "coin": 0.5}]
    # margin: the policy can least tell the answers apart (|-0.5| < |4| < |20|)
    assert [i["id"] for i in order(items, "margin")] == ["close", "moved", "far"]
    # disagreement: the policy has moved furthest from the reference (8, then 0 and 0: the smaller margin first)
    assert [i["id"] for i in order(items, "disagreement")] == ["moved", "close", "far"]
    assert [i["id"] for i in order(items, "random")] == ["far", "moved", "close"]  # the seeded coins
    with pytest.raises(ValueError, match="ordering must be one of"):
        LiveConfig(ordering="best")
    with pytest.raises(TypeError, match="unknown settings \\['updte_every'\\]"):
        config_from(updte_every=3)
    with pytest.raises(ValueError, match="update_every must be at least 1"):
        LiveConfig(update_every=0)


# ---- hidden repeats and self-agreement -----------------------------------------------------------------


def items(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Question {i}?", "completions": [f"good {i}", f"bad {i}"]} for i in range(n)]


def good(lab: Labeler) -> str:
    return "A" if lab.text_a.startswith("good") else "B"


def test_hidden_repeats_come_back_swapped_and_measure_self_agreement(tmp_path):
    lab = Labeler(items(4), path=tmp_path / "labels.jsonl", seed=1, repeat_share=1.0, repeat_gap=1)
    first_a = lab.text_a
    lab.choose(good(lab))  # q0: the good answer
    lab.choose("tie")      # q1
    assert lab.item_id == "q0~repeat" and lab.text_b == first_a  # q0 again, the other way round
    lab.choose(good(lab))  # agrees
    assert lab.item_id == "q1~repeat"
    lab.choose("A")  # q1 was a tie: disagrees
    assert lab.self_agreement == "1 of 2 repeats agreed"
    assert lab.summary()["self_agreement"] == {"repeats": 2, "agreed": 1, "rate": 0.5}
    # Repeats train nothing and are not pairs to export; they are in the labels file, marked.
    assert [p["prompt"] for p in lab.preferences()] == ["Question 0?"]
    records = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert [r.get("repeat_of") for r in records] == [None, None, "q0", "q1"]
    assert lab.done == 2  # pairs labelled: a repeat is not a new pair
    lab.undo()  # the repeat's label: the repeat is shown again, the same way round
    assert lab.item_id == "q1~repeat" and lab.self_agreement == "1 of 1 repeats agreed"


# ---- the richer judgments, and bad input ------------------------------------------------------------------


def test_strength_rating_and_edit_records_and_bad_input_changes_nothing(tmp_path):
    path = tmp_path / "labels.jsonl"
    lab = Labeler(items(4), path=path, seed=0, rubric="1 useless ... 5 exactly right")
    slight = lab.choose(good(lab).replace("A", "A_slightly").replace("B", "B_slightly"), rating=4)
    assert (slight["strength"], slight["rating"], slight["chosen"]) == ("slight", 4, "good 0")
    assert preference_labels.confidence(slight) == 0.75
    shown_a, item = lab.text_a, lab.item_id
    lines = path.read_text()
    for bad in (lambda: lab.choose("A", rating=7), lambda: lab.choose("edit"), lambda: lab.edit("C", "x"),
                lambda: lab.edit("A", "   ")):
        with pytest.raises(ValueError):
            bad()
    assert lab.edit("A", shown_a) is None and "as it was" in lab.message  # an edit that changes nothing
    assert path.read_text() == lines and lab.item_id == item  # nothing recorded, the same pair on show
    edit = lab.edit("A", "A better answer.", rationale="both rambled")
    assert (edit["choice"], edit["chosen"], edit["rejected"], edit["strength"]) == \
        ("edit", "A better answer.", shown_a, "clear")
    assert lab.preferences()[-1] == {"prompt": "Question 1?", "chosen": "A better answer.", "rejected": shown_a,
                                     "strength": "clear"}


def test_export_and_import_round_trip_the_common_preference_format(tmp_path):
    lab = Labeler(items(5), path=tmp_path / "labels.jsonl", seed=2)
    lab.choose(good(lab))
    lab.choose(good(lab).replace("A", "A_slightly").replace("B", "B_slightly"), rationale="a bit clearer")
    lab.choose("tie")
    lab.choose("both_bad")
    lab.edit("B", "Rewritten.")
    out = tmp_path / "prefs.jsonl"
    assert lab.export(out) == 3  # the two preferences and the edit; a tie and both-bad say nothing
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all({"prompt", "chosen", "rejected"} <= set(r) and isinstance(r["chosen"], str) for r in rows)
    assert [r["confidence"] for r in rows] == [1.0, 0.75, 1.0]
    back = preference_labels.import_jsonl(out)
    assert [{k: r[k] for k in ("prompt", "chosen", "rejected", "strength")} for r in back] == lab.preferences()
    assert back[1]["rationale"] == "a bit clearer"

    # Another tool's rows: chat message lists (Hugging Face conversational preference data).
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "Hi?"}],
                                "chosen": [{"role": "assistant", "content": "Hello."}],
                                "rejected": [{"role": "assistant", "content": "Go away."}]}) + "\n\n")
    (row,) = preference_labels.import_jsonl(chat)
    assert (row["prompt"], row["chosen"], row["rejected"], row["strength"]) == ("Hi?", "Hello.", "Go away.", "clear")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n" +
                      json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: .* \(missing rejected\)"):
        preference_labels.import_jsonl(broken)


@pytest.mark.clients
def test_the_export_loads_as_a_hugging_face_preference_dataset(tmp_path):
    """The exported file, read by Hugging Face `datasets` (in the lm-eval client venv, where it is a
    dependency) as TRL's DPOTrainer reads a local preference set: string prompt/chosen/rejected columns."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import client_venvs
    from conftest import wait_for_venv

    lab = Labeler(items(3), path=tmp_path / "labels.jsonl", seed=0)
    lab.choose(good(lab))
    lab.choose(good(lab).replace("A", "A_slightly").replace("B", "B_slightly"))
    lab.edit("A", "Rewritten.")
    assert lab.export(tmp_path / "prefs.jsonl") == 3
    python = wait_for_venv(client_venvs.client("lm-eval"))
    script = ("import datasets, json, sys\n"
              "ds = datasets.load_dataset('json', data_files=sys.argv[1], split='train')\n"
              "print(json.dumps({'rows': ds.num_rows, 'types': {k: str(ds.features[k].dtype) for k in ('prompt', 'chosen', 'rejected')},"
              " 'first': ds[0]['chosen'], 'confidence': list(ds['confidence'])}))")
    out = subprocess.run([str(python), "-c", script, str(tmp_path / "prefs.jsonl")], capture_output=True, text=True,
                         timeout=300, env={"HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read == {"rows": 3, "types": {"prompt": "string", "chosen": "string", "rejected": "string"},
                    "first": "good 0", "confidence": [1.0, 0.75, 1.0]}
