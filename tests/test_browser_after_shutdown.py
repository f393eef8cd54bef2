"""What a person sees when a notebook's backend goes away, in the real browser: the shared JupyterLab
(tests/browser.py), a backend of this test's own (a separate STEPWISE_HOME, so that stopping it
leaves the lab's shared backend to the other tests), Debian's Chromium.

A notebook connects to that backend, trains a step, samples with the run's weights, saves a
checkpoint and shows a CostMeter and a Dashboard of its run (both count the run's rollouts). Then
the backend stops while the notebook stays open:

- the widgets say "Backend stopped" (workbench/widgets/polling.py), not "[Errno 111] Connection refused";
- the sidebar keeps the session, greyed among the ended ones, "unreachable" (its kernel still
  announces the backend), with its checkpoint's tinker:// path.

Then the notebook's kernel shuts down (the Jupyter sessions API, as closing it does): the session
stays listed, now "ended", with its checkpoint, for the lab's life. Screenshots of both moments go
to tests/_artifacts/after-shutdown-*.png.

The backend serves the tiny random stand-in for the default model (tests/tiny_model.py): what is checked is
what a person sees, not what a model learns.
"""

from __future__ import annotations

import re

import httpx
import nbformat
import pytest

from browser import ARTIFACTS, NEEDS_CHROMIUM, open_notebook, run_all, tail, wait_until, wait_until_run
from servers import start_server

pytestmark = NEEDS_CHROMIUM

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOTEBOOK = "after-shutdown.ipynb"


@pytest.fixture
def own_backend(tmp_path, stepwise_home, tiny_model):
    from tiny_model import stand_in_env

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")  # the converted default model, shared
    server = start_server(home, env=stand_in_env(tiny_model), timeout=600)
    yield server
    server.stop()


def announced(lab: dict, base_url: str) -> bool:
    """Whether a kernel's registry file (runtime/<pid>.json) still names the backend at `base_url`."""
    for path in (lab["home"] / "runtime").glob("*.json"):
        try:
            if path.stem.isdigit() and f'"{base_url}"' in path.read_text():
                return True
        except OSError:
            pass  # removed while we looked: another kernel exiting
    return False


def cells(base_url: str, api_key: str) -> list[str]:
    return [f"""\
import numpy as np
import workbench
from tinker import types

client = workbench.connect({base_url!r}, {api_key!r}, progress=False)
tc = client.create_lora_training_client(base_model="{BASE}", rank=4, seed=0).result()
tokens = list(range(200, 232))
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={{"target_tokens": np.array(tokens[1:]), "weights": np.ones(31, np.float32)}})
tc.forward_backward([datum], "cross_entropy")
tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
rollout = tc.save_weights_and_get_sampling_client().result().sample(  # sampled with the run's weights
    types.ModelInput.from_ints(tokens[:8]), 2, types.SamplingParams(max_tokens=4, seed=0)).result()
print("saved", tc.save_state("kept").result().path)""",
            "workbench.CostMeter(training_run_id=tc, poll_interval=0.5)",
            "workbench.Dashboard(training_run_id=tc, poll_interval=0.5)"]


def test_widgets_and_sidebar_after_the_backend_stops(lab, browser, own_backend):
    from playwright.sync_api import expect

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in
                                               cells(own_backend.base_url, own_backend.api_key)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / NOTEBOOK)
    page = browser.new_page()
    open_notebook(page, lab, NOTEBOOK)
    run_all(page)
    wait_until_run([page], lab, timeout=300)  # or until a cell fails: then what it printed is the failure's message
    outputs = page.locator(".jp-Notebook .jp-OutputArea-output").all_text_contents()
    assert any("saved tinker://" in text for text in outputs), f"the notebook printed: {outputs}"
    saved = page.get_by_text(re.compile(r"saved tinker://"))
    path = re.search(r"tinker://\S+", saved.text_content()).group(0)
    # The run's meter and dashboard include its rollouts (billed to the sampler, attributed to the run).
    run_id = path.removeprefix("tinker://").split("/")[0]
    run = httpx.get(f"{own_backend.base_url}/api/v1/usage", params={"training_run_id": run_id},
                    headers={"X-API-Key": own_backend.api_key}).json()["totals"]
    assert run["sample_tokens"] > 0 and run["train_tokens"] == 31
    meter, dashboard = page.locator(".wb-cost"), page.locator(".wb-dashboard-cost")
    expect(meter.locator("tr[data-kind='train'] .wb-cost-tokens")).to_have_text("31")
    expect(meter.locator("tr[data-kind='sample'] .wb-cost-tokens")).to_have_text(f"{run['sample_tokens']:,}")
    expect(dashboard).to_contain_text(f"sample {run['sample_tokens']:,} · train 31")

    page.locator('.jp-SideBar [data-id="stepwise-sessions"]').click()
    row = page.locator(f"li.jp-StepwiseSession[data-name='{NOTEBOOK}']")
    expect(row).to_have_attribute("data-status", "active")
    row.locator(".jp-StepwiseSession-header").click()
    expect(row.locator(".jp-StepwiseCheckpoint-path")).to_have_text(path)

    # The backend stops; the notebook stays open, its kernel alive.
    own_backend.stop()
    for widget in (meter.locator(".wb-cost-error"), dashboard):
        expect(widget).to_contain_text("Backend stopped", timeout=30_000)
        assert "Errno" not in widget.text_content()
    expect(meter.locator("tr[data-kind='train'] .wb-cost-tokens")).to_have_text("31")  # the last figures stay
    ended = page.locator(f".jp-StepwiseSidebar-ended li.jp-StepwiseSession[data-name='{NOTEBOOK}']")
    expect(ended).to_have_attribute("data-status", "unreachable", timeout=30_000)
    expect(ended).to_have_class(re.compile(r"\bjp-mod-ended\b"))
    expect(ended.locator(".jp-StepwiseCheckpoint-path")).to_have_text(path)  # still expanded, still listed
    said = page.locator(".jp-StepwiseSidebar-backendError, .jp-StepwiseSidebar-message").filter(
        has_text=own_backend.base_url)
    expect(said).to_contain_text("Backend stopped")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "after-shutdown-backend-stopped.png"))

    # The kernel shuts down (as closing the notebook and shutting its kernel does): no process announces
    # the backend any more; the session stays, ended, with its checkpoint.
    (jupyter_session,) = [s for s in httpx.get(f"{lab['url']}/api/sessions").json() if s["path"] == NOTEBOOK]
    assert httpx.delete(f"{lab['url']}/api/sessions/{jupyter_session['id']}").status_code == 204
    wait_until(lambda: not announced(lab, own_backend.base_url), 60,
               f"the kernel did not remove its registry file:\n{tail(lab['log'])}")
    expect(ended).to_have_attribute("data-status", "ended", timeout=30_000)
    expect(ended.locator(".jp-StepwiseCheckpoint-path")).to_have_text(path)
    expect(ended.locator(".jp-StepwiseSession-header")).to_have_attribute("title", re.compile("its backend stopped"))
    page.locator(".jp-StepwiseSidebar-endedHeader").click()  # the ended group folds
    expect(ended).to_be_hidden()
    page.locator(".jp-StepwiseSidebar-endedHeader").click()
    expect(ended).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "after-shutdown-kernel-gone.png"))
    (lab["root"] / NOTEBOOK).unlink()
