"""Every notebook runs top to bottom in a real kernel, with small step counts, and says what it should."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from servers import Server

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(path: Path, parameters: dict, home: Path, server: Server | None = None) -> str:
    """Execute with `parameters` replacing the cell tagged "parameters"; return all printed text.

    The kernel runs in `home` with its own embedded backend, or, given `server`, binds to that one
    (workbench.connect() honours $STEPWISE_BASE_URL), which saves a backend start per notebook."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    env = {"STEPWISE_HOME": str(home)}  # the kernel inherits these
    if server is not None:
        env.update(STEPWISE_BASE_URL=server.base_url, STEPWISE_API_KEY=server.api_key)
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(home)}}).execute()
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    return "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


@pytest.fixture
def notebook_home(tmp_path, stepwise_home):
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    return tmp_path


def test_quickstart(notebook_home):
    printed = run_notebook(NOTEBOOKS / "00_quickstart.ipynb", {"steps": 6}, notebook_home)
    assert "Quibbleton" in printed
    losses = eval(printed.split("loss per step:")[1].splitlines()[0])
    assert len(losses) == 6 and losses[-1] < losses[0] / 4
    assert "cost $" in printed


def number_after(printed: str, label: str) -> list[float]:
    """The numbers on the line that starts with `label`: "eval_loss: 3.2 -> 1.1" gives [3.2, 1.1]."""
    import re

    line = next(l for l in printed.splitlines() if l.startswith(label))
    return [float(x) for x in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", line[len(label):])]


def test_sft_recipe_notebook(notebook_home, tinker_server):
    printed = run_notebook(NOTEBOOKS / "01_sft.ipynb", {"steps": 3, "sample_questions": 2}, notebook_home, tinker_server)
    before, after = number_after(printed, "eval_loss:")  # test_recipes checks how far it falls
    assert after < before, printed
    assert number_after(printed, "cost $")[0] > 0
    assert (notebook_home / "sft-metrics.jsonl").exists()


def test_rl_recipe_notebook(notebook_home, tinker_server):
    printed = run_notebook(NOTEBOOKS / "02_rl.ipynb", {"steps": 1, "loss_fn": "ppo", "eval_prompts": 2, "inspect_prompts": 2},
                           notebook_home, tinker_server)
    before, after = number_after(printed, "held-out reward:")
    assert 0 <= before <= 1 and 0 <= after <= 1
    rollouts, mean_reward = number_after(printed, "rollouts:")
    assert rollouts == 2 * 4 and 0 <= mean_reward <= 1
    assert len((notebook_home / "rl-metrics.jsonl").read_text().splitlines()) == 1 + 1 + 1  # eval, a step, eval


def test_preference_recipe_notebook(notebook_home, tinker_server):
    printed = run_notebook(NOTEBOOKS / "03_preference.ipynb",
                           {"steps": 2, "num_prompts": 5, "auto_label": True, "rule": "shorter"}, notebook_home,
                           tinker_server)
    labels = [json.loads(line) for line in (notebook_home / "labels.jsonl").read_text().splitlines()]
    pairs = int(printed.split("-> ")[1].split(" preference pairs")[0])
    preferred = [l for l in labels if l["choice"] in ("A", "B")]
    assert pairs == len(preferred) and pairs >= 2
    # The scripted labels went through the widget as clicks would, so the shorter answer (in tokens,
    # which nearly always means in characters) is the chosen one; a swapped A/B mapping would invert it.
    assert sum(len(l["chosen"]) < len(l["rejected"]) for l in preferred) > len(preferred) / 2
    before, after = number_after(printed, "logprob margin:")
    assert after > before, printed


def test_distillation_recipe_notebook(notebook_home, tinker_server):
    printed = run_notebook(NOTEBOOKS / "04_distillation.ipynb", {"steps": 1, "prompts_per_step": 2}, notebook_home,
                           tinker_server)
    before, after = number_after(printed, "kl_teacher:")
    assert before > 0 and after == after  # a number (the recipe test checks that it falls)
    assert "student:" in printed
