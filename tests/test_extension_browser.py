"""The JupyterLab extension in a real browser: JupyterLab with the extension from the built wheel,
a notebook that starts the embedded backend and trains three steps, Debian's Chromium.

What it checks: the sidebar lists the session with its three steps, base model and rank, and its
checkpoint's tinker:// path (copied by the copy button); the status-bar cost is above zero, moved
while the training cell was still running, and equals the usage API's; the settings (currency
symbol, hiding the status item) take effect. A screenshot of the page
goes to tests/_artifacts/extension-sidebar-and-cost-meter.png.

Skipped, with the reason, where /usr/bin/chromium is missing (`make test` installs it as root).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import nbformat
import pytest

from servers import REPO, free_port

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "tests" / "_artifacts"  # gitignored; the screenshot stays there for a person to look at
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="the browser test needs Debian's Chromium at /usr/bin/chromium: `apt-get install -y chromium` "
           "(`make test` does it when run as root)")

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
STEPS = 3
PAUSE_S = 2.5  # between steps, so the meter is seen moving while the cell still runs (it polls every 1 s)

SETUP = f"""\
import time
import numpy as np
import workbench
from tinker import types

client = workbench.connect(progress=False)
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
print("trained", {STEPS}, "steps; saved", checkpoint)"""


@pytest.fixture
def page():
    """A page in Debian's Chromium (never a browser Playwright downloads; no sandbox as root).

    Playwright's sync API runs an event loop in this thread while it is open, so it is opened and
    closed within the test: left open for the session (pytest-playwright's fixtures), it would break
    every later test that runs asyncio.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 720})
        finally:
            browser.close()


@pytest.fixture(scope="module")
def wheel_prefix(tmp_path_factory) -> Path:
    """The extension's files as the stepwise wheel installs them: share/jupyter and etc/jupyter of a prefix.

    The wheel is built from this checkout (the labextension is already built, so Node is not run);
    its data files are laid out under a prefix that JUPYTER_PATH / JUPYTER_CONFIG_PATH point to, so
    JupyterLab loads the extension from the wheel, not from the checkout.
    """
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(out.glob("stepwise-*.whl"))
    prefix = out / "prefix"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            data = re.match(r"stepwise-[^/]+\.data/data/(.+)", name)
            if data and not name.endswith("/"):
                target = prefix / data.group(1)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
    assert (prefix / "share/jupyter/labextensions/stepwise-lab/static/style.js").exists()
    assert json.loads((prefix / "etc/jupyter/jupyter_server_config.d/stepwise.json").read_text())[
        "ServerApp"]["jpserver_extensions"]["workbench.lab"] is True
    return prefix


@pytest.fixture(scope="module")
def lab(tmp_path_factory, wheel_prefix, stepwise_home):
    """JupyterLab, token-less on a free loopback port, with the wheel's extension and its own STEPWISE_HOME."""
    root = tmp_path_factory.mktemp("lab")
    home = root / "stepwise_home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")  # the converted default model, shared
    settings = root / "_settings"
    write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
               {"fetchNews": "false", "checkForUpdates": False})  # no news toast over the screenshot
    write_json(settings / "stepwise-lab/plugin.jupyterlab-settings", {"refreshInterval": 1})
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(TRAIN)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "train.ipynb")

    env = {**os.environ, "STEPWISE_HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE",
           "JUPYTER_PATH": str(wheel_prefix / "share/jupyter"),
           "JUPYTER_CONFIG_PATH": str(wheel_prefix / "etc/jupyter"),
           "JUPYTER_CONFIG_DIR": str(root / "_config"), "JUPYTER_RUNTIME_DIR": str(root / "_runtime")}
    listed = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], env=env,
                            capture_output=True, text=True, timeout=120)
    section = (listed.stdout + listed.stderr).split(str(wheel_prefix / "share/jupyter/labextensions"))[1]
    assert re.search(r"stepwise-lab v[\d.]+ \S*enabled\S* \S*OK", section.split("\n\n")[0]), listed

    port = free_port()
    log_path = root / "lab.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
             "--allow-root", "--IdentityProvider.token=", "--ServerApp.password=",
             "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={root}",
             f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={root / '_workspaces'}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{url}/api/status"), 120, f"JupyterLab did not start; see {log_path}",
                   process)
        yield {"url": url, "home": home, "log": log_path}
    finally:
        process.terminate()  # shuts its kernels down; the embedded backend follows its kernel
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_sidebar_and_cost_meter_follow_a_training_notebook(lab, page):
    from playwright.sync_api import expect

    page.set_default_timeout(30_000)
    page.goto(f"{lab['url']}/lab/tree/train.ipynb?reset")
    expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=90_000)
    meter = page.locator(".jp-StepwiseCost")
    expect(meter).to_have_attribute("data-cost", "0")  # the extension loaded; nothing runs yet

    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

    # While the cells run, watch the meter: it must move before the training cell has finished.
    done = page.get_by_text(re.compile(rf"trained {STEPS} steps; saved tinker://"))
    seen_while_running: set[float] = set()
    deadline = time.monotonic() + 300
    while not done.is_visible():
        assert time.monotonic() < deadline, f"the notebook did not finish; lab log:\n{tail(lab['log'])}"
        seen_while_running.add(float(meter.get_attribute("data-cost")))
        page.wait_for_timeout(250)

    # The usage API of the backend the kernel announced, read with its key.
    (registry,) = (lab["home"] / "runtime").glob("*.json")
    backend = json.loads(registry.read_text())
    api = httpx.Client(base_url=backend["base_url"], headers={"X-API-Key": backend["api_key"]})
    final = api.get("/api/v1/usage").json()["totals"]["cost"]
    assert final > 0
    moving = sorted(c for c in seen_while_running if 0 < c < final)
    assert moving, f"the meter did not move while the cell ran: saw {sorted(seen_while_running)}, final {final}"

    # The status bar settles on the usage API's cost: exactly in its data, and as text.
    wait_until(lambda: abs(float(meter.get_attribute("data-cost")) - final) <= 1e-12 * max(1.0, final), 15,
               f"status-bar cost {meter.get_attribute('data-cost')} != usage API {final}")
    shown = float(re.search(r"\$([\d.]+)", meter.inner_text()).group(1))
    assert shown == pytest.approx(final, rel=5e-3)
    assert "train:" in meter.get_attribute("title")

    # The sidebar: our session with three steps, its model and rank; a click shows the checkpoint.
    page.locator('.jp-SideBar [data-id="stepwise-sessions"]').click()
    row = page.locator("li.jp-StepwiseSession").filter(has_text="SmolLM2-135M-Instruct")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-steps", str(STEPS))
    expect(row.locator(".jp-StepwiseSession-steps")).to_have_text(f"{STEPS} steps")
    expect(row.locator(".jp-StepwiseSession-rank")).to_have_text("LoRA r8")
    expect(row.locator(".jp-StepwiseSession-status")).to_have_text("active")
    row.locator(".jp-StepwiseSession-header").click()
    (checkpoint,) = [c["tinker_path"] for s in api.get("/api/v1/usage/sessions").json()["sessions"]
                     for c in s["checkpoints"]]
    expect(row.locator(".jp-StepwiseCheckpoint-path")).to_have_text(checkpoint)
    row.locator(".jp-StepwiseCheckpoint-copy").click()
    expect(row.locator(".jp-StepwiseCheckpoint-copy")).to_have_text("Copied")

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "extension-sidebar-and-cost-meter.png"
    page.screenshot(path=str(screenshot))
    print("screenshot:", screenshot)

    # Settings: another currency symbol, and no status item, after a reload.
    raw = json.dumps({"refreshInterval": 1, "currencySymbol": "€", "showStatusItem": False})
    assert httpx.put(f"{lab['url']}/lab/api/settings/stepwise-lab:plugin", json={"raw": raw}).status_code == 204
    page.reload()
    expect(page.locator(".jp-StepwiseSidebar-summary")).to_contain_text("running · €")
    expect(page.locator("li.jp-StepwiseSession .jp-StepwiseSession-cost")).to_have_text(re.compile(r"^€0\.0"))
    expect(page.locator(".jp-StepwiseCost")).to_be_hidden()


# ---- helpers --------------------------------------------------------------------------------------


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(condition, timeout: float, message: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{message} (exited with {process.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.3)


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

