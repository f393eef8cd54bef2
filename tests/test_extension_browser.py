"""The JupyterLab extension in a real browser: JupyterLab with the extension from the built wheel,
a notebook that connects to the local backend and trains three steps, Debian's Chromium (the
JupyterLab and the backend are the ones every browser test shares: tests/browser.py).

What it checks: the sidebar lists the session under its notebook's name with its base model and
rank, each of its two training runs with its own steps (3 and 1, never their sum), its checkpoints'
tinker:// paths (copied by the copy button), the sampler weights among them, and the in-memory
sampler snapshot said to have no path; the status bar follows the notebook: its cost is above zero,
moved while the training cell was still running, and equals the usage API's for the session; after
the notebook is renamed (File > Rename Notebook…) the sidebar row and the status bar follow it; the
settings (currency symbol, hiding the status item) take effect. A screenshot of the page goes to
tests/_artifacts/extension-sidebar-and-cost-meter.png.

Skipped, with the reason, where /usr/bin/chromium is missing (`make test` installs it as root).
"""

from __future__ import annotations

import json
import re
import time

import httpx
import nbformat
import pytest

from browser import ARTIFACTS, NEEDS_CHROMIUM, backend_api, open_notebook, run_all, tail, wait_until, wait_until_run

pytestmark = NEEDS_CHROMIUM

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
STEPS = 3
PAUSE_S = 2.5  # between steps, so the meter is seen moving while the cell still runs (it polls every 1 s)

SETUP = f"""\
import time
import numpy as np
import workbench
from tinker import types

client = workbench.connect(progress=False)  # the lab's local backend, shared by every notebook
tc = client.create_lora_training_client(base_model="{BASE}", rank=8, seed=0).result()
tokens = list(range(200, 264))
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={{"target_tokens": np.array(tokens[1:]), "weights": np.ones(63, np.float32)}})
print("connected", tc.model_id)"""

TRAIN = f"""\
for step in range({STEPS}):
    tc.forward_backward([datum] * 2, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    time.sleep({PAUSE_S})
checkpoint = tc.save_state("browser-test").result().path
# A second run of the same session, one step; and the first run's samplers: an in-memory snapshot
# (no path), used for a rollout, and saved sampler weights (a path).
second = client.create_lora_training_client(base_model="{BASE}", rank=8, seed=1).result()
second.forward_backward([datum], "cross_entropy")
second.optim_step(types.AdamParams(learning_rate=1e-3)).result()
snapshot = tc.save_weights_and_get_sampling_client().result()
snapshot.sample(types.ModelInput.from_ints(tokens[:8]), 1, types.SamplingParams(max_tokens=4, seed=0)).result()
sampler_path = tc.save_weights_for_sampler("browser-sampler").result().path
print("trained", {STEPS}, "steps; saved", checkpoint)"""


def test_sidebar_and_cost_meter_follow_a_training_notebook(lab, browser):
    from playwright.sync_api import expect

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(TRAIN)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / "train.ipynb")
    page = browser.new_page()
    open_notebook(page, lab, "train.ipynb")
    meter = page.locator(".jp-StepwiseCost")
    expect(meter).to_have_attribute("data-cost", "0")  # the extension loaded; nothing runs yet
    run_all(page)

    # While the cells run, watch the meter: it must move before the training cell has finished.
    done = page.get_by_text(re.compile(rf"trained {STEPS} steps; saved tinker://"))
    seen_while_running: set[float] = set()
    deadline = time.monotonic() + 300
    while not done.is_visible():
        assert time.monotonic() < deadline, f"the notebook did not finish; lab log:\n{tail(lab['log'])}"
        seen_while_running.add(float(meter.get_attribute("data-cost")))
        page.wait_for_timeout(250)

    # The usage API of the lab's backend, for this notebook's session (named after it).
    api = backend_api(lab)
    (session,) = [s for s in api.get("/api/v1/usage/sessions").json()["sessions"] if s["display_name"] == "train.ipynb"]
    final = api.get("/api/v1/usage", params={"session_id": session["session_id"]}).json()["totals"]["cost"]
    assert final > 0
    moving = sorted(c for c in seen_while_running if 0 < c < final)
    assert moving, f"the meter did not move while the cell ran: saw {sorted(seen_while_running)}, final {final}"

    # The status bar settles on the usage API's cost: exactly in its data, and as text.
    wait_until(lambda: abs(float(meter.get_attribute("data-cost")) - final) <= 1e-12 * max(1.0, final), 15,
               f"status-bar cost {meter.get_attribute('data-cost')} != usage API {final}")
    shown = float(re.search(r"\$([\d.]+)", meter.inner_text()).group(1))
    assert shown == pytest.approx(final, rel=5e-3)
    assert "train.ipynb: 1 running session" in meter.get_attribute("title")
    assert meter.get_attribute("data-notebook") == "train.ipynb"

    # The sidebar: our session, under the notebook's name, with its model and rank, and each run with
    # its own steps; a click shows the checkpoints, the sampler weights and the snapshot among them.
    page.locator('.jp-SideBar [data-id="stepwise-sessions"]').click()
    row = page.locator("li.jp-StepwiseSession[data-name='train.ipynb']")
    expect(row).to_have_count(1)
    expect(row.locator(".jp-StepwiseSession-rank")).to_have_text("LoRA r8")
    expect(row.locator(".jp-StepwiseSession-status")).to_have_text("active")
    first, second = session["training_run_ids"]
    expect(row).to_have_attribute("data-runs", "2")
    for run_id, steps, label in ((first, STEPS, "train:0"), (second, 1, "train:1")):
        run = row.locator(f"li.jp-StepwiseRun[data-run-id='{run_id}']")
        expect(run).to_have_attribute("data-steps", str(steps))
        expect(run.locator(".jp-StepwiseRun-name")).to_have_text(label)
        expect(run.locator(".jp-StepwiseRun-steps")).to_have_text(f"{steps} step" + ("s" if steps > 1 else ""))
        expect(run.locator(".jp-StepwiseRun-loss")).to_have_text(re.compile(r"^loss/token \d"))
    expect(row).not_to_contain_text(f"{STEPS + 1} steps")
    row.locator(".jp-StepwiseSession-header").click()
    paths = {c["checkpoint_type"]: c["tinker_path"] for c in session["checkpoints"]}
    assert set(paths) == {"training", "sampler"} and paths["sampler"].endswith("/sampler_weights/browser-sampler")
    for kind, path in paths.items():
        expect(row.locator(f".jp-StepwiseCheckpoint[data-type='{kind}'] .jp-StepwiseCheckpoint-path")).to_have_text(path)
    expect(row.locator(".jp-StepwiseCheckpoint[data-type='sampler'] .jp-StepwiseCheckpoint-type")).to_contain_text(
        "sampler weights · train:0")
    (snapshot,) = session["sampler_snapshots"]
    expect(row.locator(".jp-StepwiseSnapshot-id")).to_have_text(snapshot["sampler_id"])
    expect(row.locator(".jp-StepwiseSnapshot")).to_contain_text("no tinker:// path")
    expect(row.locator(".jp-StepwiseCheckpoint-none")).to_have_count(0)
    copy = row.locator(".jp-StepwiseCheckpoint[data-type='training'] .jp-StepwiseCheckpoint-copy")
    copy.click()
    expect(copy).to_have_text("Copied")

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "extension-sidebar-and-cost-meter.png"
    page.screenshot(path=str(screenshot))
    print("screenshot:", screenshot)

    # The notebook is renamed, as a person does it: the session (named train.ipynb when its kernel
    # connected) follows it in the sidebar and in the status bar.
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Rename Notebook")).click()
    page.locator(".jp-Dialog input").fill("renamed.ipynb")
    page.locator(".jp-Dialog").get_by_role("button", name="Rename").click()
    row = page.locator("li.jp-StepwiseSession[data-name='renamed.ipynb']")
    expect(row).to_have_attribute("data-session-id", session["session_id"], timeout=15_000)
    expect(row.locator(".jp-StepwiseSession-title")).to_have_text("renamed.ipynb")
    expect(row.locator(".jp-StepwiseSession-header")).to_have_attribute(
        "title", re.compile(r"started as train\.ipynb; its notebook is now renamed\.ipynb"))
    expect(page.locator("li.jp-StepwiseSession[data-name='train.ipynb']")).to_have_count(0)
    expect(meter).to_have_attribute("data-notebook", "renamed.ipynb")
    assert float(meter.get_attribute("data-cost")) == pytest.approx(final, rel=1e-12)
    assert "renamed.ipynb: 1 running session" in meter.get_attribute("title")
    page.screenshot(path=str(ARTIFACTS / "extension-renamed-notebook.png"))

    # Settings: another currency symbol, and no status item, after a reload (then back, for the
    # tests that share this JupyterLab).
    settings = f"{lab['url']}/lab/api/settings/stepwise-lab:plugin"
    raw = json.dumps({"refreshInterval": 1, "currencySymbol": "€", "showStatusItem": False})
    assert httpx.put(settings, json={"raw": raw}).status_code == 204
    try:
        # ?reset: the saved workspace still names train.ipynb, which the rename took away
        page.goto(f"{lab['url']}/lab/tree/renamed.ipynb?reset")
        tab = page.locator('.jp-SideBar [data-id="stepwise-sessions"]')
        if tab.get_attribute("aria-selected") != "true":
            tab.click()
        expect(page.locator(".jp-StepwiseSidebar-running")).to_have_text(re.compile(r"^running sessions €"), timeout=30_000)
        expect(row.locator(".jp-StepwiseSession-cost")).to_have_text(re.compile(r"^€0\.0"))
        expect(page.locator(".jp-StepwiseCost")).to_be_hidden()
    finally:
        assert httpx.put(settings, json={"raw": json.dumps({"refreshInterval": 1})}).status_code == 204




NAMED = f"""\
import numpy as np
import workbench
from tinker import types
from workbench.recipes import common

client = workbench.connect(name="warehouse-agent", progress=False)
tc = client.create_lora_training_client(base_model="{BASE}", rank=8, seed=0, user_metadata={{"name": "warm-up"}}).result()
dash = workbench.Dashboard(training_run_id=tc)
display(dash)
tokens = list(range(200, 264))
weights = np.zeros(63, np.float32)
weights[20:] = 1.0  # the prompt's 20 tokens are not trained on
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={{"target_tokens": np.array(tokens[1:]), "weights": weights}})
adam = types.AdamParams(learning_rate=1e-3)
for step in range(1, 4):
    out = tc.forward_backward([datum] * 2, "cross_entropy").result()
    tc.optim_step(adam).result()
    loss, counted = common.weighted_nll([datum] * 2, out.loss_fn_outputs)
    print(f"step {{step}}: loss per token {{loss / counted:.6f}} (summed {{loss:.3f}})")
tc.optim_step(adam).result()  # step 4 trains on nothing, as an RL step whose groups all tied
dash.skip(4, "all groups tied")
dash.refresh()
print("named run done")"""


def boxes_overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
        a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]


def test_sidebar_says_what_each_number_covers(lab, browser):
    """Issue 56, where it shows: the session is called by the name given to connect() (not its notebook's);
    the run shows its loss per token, equal to what the notebook printed, at the step it belongs to, its last
    step (trained on nothing) counted as skipped; the header labels what the running sessions spent and what
    the lab spent since it started; the dashboard's "loss per step" title sits clear of plotly's toolbar.
    Screenshots: tests/_artifacts/extension-named-session.png, extension-loss-plot-title.png."""
    from playwright.sync_api import expect

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NAMED)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / "agent.ipynb")
    page = browser.new_page()
    open_notebook(page, lab, "agent.ipynb")
    run_all(page)
    wait_until_run([page], lab, 300)
    stdout = "\n".join(page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
                       .all_inner_texts())
    assert "named run done" in stdout, page.locator(".jp-Notebook").inner_text()[-3000:]
    printed = [float(x) for x in re.findall(r"loss per token ([\d.]+)", stdout)]
    assert len(printed) == 3, stdout

    page.locator('.jp-SideBar [data-id="stepwise-sessions"]').click()
    row = page.locator("li.jp-StepwiseSession[data-name='warehouse-agent']")
    expect(row).to_have_count(1, timeout=15_000)
    expect(row.locator(".jp-StepwiseSession-title")).to_have_text("warehouse-agent")
    expect(row).to_have_attribute("data-notebook", "agent.ipynb")
    run = row.locator("li.jp-StepwiseRun")
    expect(run.locator(".jp-StepwiseRun-name")).to_have_text("warm-up")
    expect(run.locator(".jp-StepwiseRun-steps")).to_have_text("4 steps (1 skipped)")
    loss = run.locator(".jp-StepwiseRun-loss")
    expect(loss).to_have_text(re.compile(r"^loss/token [\d.]+ at step 3$"))
    shown = float(re.search(r"loss/token ([\d.]+)", loss.inner_text()).group(1))
    assert shown == pytest.approx(printed[-1], rel=1e-3), (shown, printed)
    assert "loss:sum" in loss.get_attribute("title") and "1 step skipped" in loss.get_attribute("title")

    summary = page.locator(".jp-StepwiseSidebar-summary")
    expect(summary.locator(".jp-StepwiseSidebar-count")).to_have_text(re.compile(r"^\d+ sessions? · \d+ running\s*$"))
    expect(summary.locator(".jp-StepwiseSidebar-running")).to_have_text(re.compile(r"^running sessions \$[\d.]+$"))
    expect(summary.locator(".jp-StepwiseSidebar-lab")).to_have_text(re.compile(r"^lab since \d\d:\d\d UTC \$[\d.]+$"))
    assert "ended sessions not counted" in summary.locator(".jp-StepwiseSidebar-running").get_attribute("title")
    assert "ended ones included" in summary.locator(".jp-StepwiseSidebar-lab").get_attribute("title")
    # The status bar follows the notebook's session, whatever it is called.
    expect(page.locator(".jp-StepwiseCost")).to_have_attribute("data-notebook", "agent.ipynb")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "extension-named-session.png"))

    # The loss plot: its title clear of the toolbar that shows on hover.
    plot = page.locator(".wb-dashboard .js-plotly-plot").filter(has=page.locator(".gtitle", has_text="loss per step"))
    expect(plot).to_have_count(1)
    plot.scroll_into_view_if_needed()
    plot.hover()
    modebar = plot.locator(".modebar")
    expect(modebar).to_be_visible()
    title, bar = plot.locator(".gtitle").bounding_box(), modebar.bounding_box()
    assert not boxes_overlap(title, bar), (title, bar)
    plot.screenshot(path=str(ARTIFACTS / "extension-loss-plot-title.png"))


REFUSED_SETUP = f"""\
import os, time
import numpy as np
import workbench
from tinker import types

client = workbench.connect(progress=False)
tc = client.create_lora_training_client(base_model="{BASE}", rank=8, seed=0).result()
tokens = list(range(200, 264))
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={{"target_tokens": np.array(tokens[1:]), "weights": np.ones(63, np.float32)}})
print("connected", tc.model_id)
while not os.path.exists("tenant-budget-set"):  # the test sets the tenant's budget meanwhile
    time.sleep(0.2)"""

# Issue 65's loop: forward_backward not awaited, so its 402 is raised nowhere; each optim_step "succeeds" on no gradient.
REFUSED_LOOP = f"""\
for step in range({STEPS}):
    tc.forward_backward([datum] * 2, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
print("refused loop done")
workbench.CostMeter(session=client, poll_interval=None)  # the notebook's own view of the refusals"""


def test_refusals_of_an_exhausted_tenant_budget_show_where_they_land(lab, browser):
    """Issue 65: a tenant whose budget is spent runs the unawaited loop. The status bar turns red (the tenant's
    budget counts as a session's), the sidebar shows the tenant's budget, the run says its steps were refused
    (not skipped), and the session and the notebook's CostMeter show the server's 402 in red. The lab's backend is every notebook's (tenant
    "local"), so its budget is removed afterwards for the tests that share it.
    Screenshot: tests/_artifacts/extension-refused-steps.png."""
    from playwright.sync_api import expect

    from kernel_backend.persistence.api_keys import LOCAL_TENANT

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(REFUSED_SETUP),
                                               nbformat.v4.new_code_cell(REFUSED_LOOP)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / "refused.ipynb")
    flag = lab["root"] / "tenant-budget-set"
    flag.unlink(missing_ok=True)
    page = browser.new_page()
    open_notebook(page, lab, "refused.ipynb")
    run_all(page)
    expect(page.get_by_text(re.compile(r"^connected "))).to_be_visible(timeout=300_000)

    api = backend_api(lab)
    tenant_budget = f"/api/v1/budgets/tenant/{LOCAL_TENANT}"
    # Less than anything costs: the first forward_backward is refused, whatever the tenant spent before.
    assert api.put(tenant_budget, json={"budget_usd": 1e-9}).status_code == 200
    try:
        flag.touch()
        wait_until_run([page], lab, 300)
        stdout = "\n".join(page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stdout']")
                           .all_inner_texts())
        assert "refused loop done" in stdout, page.locator(".jp-Notebook").inner_text()[-3000:]

        meter = page.locator(".jp-StepwiseCost")
        page.locator('.jp-SideBar [data-id="stepwise-sessions"]').click()
        row = page.locator("li.jp-StepwiseSession[data-name='refused.ipynb']")
        expect(row).to_have_count(1, timeout=15_000)
        run = row.locator("li.jp-StepwiseRun")
        expect(run).to_have_attribute("data-refused", str(STEPS))
        expect(run).to_have_attribute("data-skipped", "0")
        steps = run.locator(".jp-StepwiseRun-steps")
        expect(steps).to_have_text(f"{STEPS} steps ({STEPS} refused)")
        expect(steps).not_to_contain_text("skipped")
        assert "Await each forward_backward (.result())" in steps.get_attribute("title")
        assert "402" in steps.get_attribute("title")
        refusals = row.locator(".jp-StepwiseRefusals")
        expect(refusals).to_be_visible()
        expect(refusals).to_have_text(re.compile(r"^\d+ requests? refused · 402: .*budget"))
        assert "budget" in refusals.get_attribute("title")
        # Red: the theme's error colour, as an exhausted budget's text.
        colour = refusals.evaluate("node => getComputedStyle(node).color")
        error = page.evaluate("getComputedStyle(document.body).getPropertyValue('--jp-error-color1')")
        rgb = page.evaluate("c => { const d = document.createElement('div'); d.style.color = c; document.body.append(d);"
                            " const v = getComputedStyle(d).color; d.remove(); return v; }", error.strip())
        assert colour == rgb, (colour, rgb)
        # The cost meter under the loop says it too, in red, in the server's words.
        refused_line = page.locator(".wb-cost .wb-refusals")
        expect(refused_line).to_have_text(re.compile(r"^\d+ requests? refused · the last, a ForwardBackward: 402 .*budget"))
        assert refused_line.evaluate("node => getComputedStyle(node).color") == rgb

        # The tenant's budget: a bar under the header, and the status bar red, its tooltip saying whose.
        tenant_bar = page.locator(".jp-StepwiseSidebar-header .jp-StepwiseSidebar-tenantBudget")
        expect(tenant_bar).to_be_visible(timeout=15_000)
        expect(tenant_bar).to_have_class(re.compile(r"\bstepwise-budget-exhausted\b"))
        expect(tenant_bar).to_contain_text("tenant budget $")
        assert tenant_bar.get_attribute("title").startswith("The tenant's budget")

        expect(meter).to_have_class(re.compile(r"\bstepwise-budget-exhausted\b"), timeout=15_000)
        expect(meter).to_have_attribute("title", re.compile(r"^The tenant's budget \(tenant local"))
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        screenshot = ARTIFACTS / "extension-refused-steps.png"  # taken on a failure too: it shows what the page had
        page.screenshot(path=str(screenshot))
        print("screenshot:", screenshot)
        flag.unlink(missing_ok=True)
        assert api.delete(tenant_budget).status_code == 200
    expect(page.locator(".jp-StepwiseSidebar-tenantBudget")).to_be_hidden(timeout=15_000)
    expect(page.locator(".jp-StepwiseCost")).not_to_have_class(re.compile(r"\bstepwise-budget-exhausted\b"))
