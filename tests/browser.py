"""JupyterLab in Debian's Chromium, shared by the browser tests (a pytest plugin: conftest loads it).

- `lab` (session): one JupyterLab, token-less on a free loopback port, with the extension as the
  stepwise wheel installs it, a folder of its own as root and its own STEPWISE_HOME (the converted
  default model shared through a symlink). Every notebook the tests open there connects with plain
  `workbench.connect()`, so they all share one local backend, as a researcher's notebooks do.
- `browser` (function): a Chromium page opener; `open_notebook()` / `run_all()` / `wait_until_run()`
  drive JupyterLab the way a person does (menus, not the Python API).

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
ARTIFACTS = REPO / "tests" / "_artifacts"  # gitignored; screenshots stay there for a person to look at
NEEDS_CHROMIUM = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="the browser tests need Debian's Chromium at /usr/bin/chromium: `apt-get install -y chromium` "
           "(`make test` does it when run as root)")


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def lab(tmp_path_factory, wheel_prefix, stepwise_home):
    """JupyterLab with the wheel's extension: {url, root, home, log}."""
    root = tmp_path_factory.mktemp("lab")
    home = root / "stepwise_home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")  # the converted default model, shared
    settings = root / "_settings"
    write_json(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
               {"fetchNews": "false", "checkForUpdates": False})  # no news toast over the screenshots
    write_json(settings / "stepwise-lab/plugin.jupyterlab-settings", {"refreshInterval": 1})

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
        wait_until(lambda: http_ok(f"{url}/api/status"), 120, f"JupyterLab did not start; see {log_path}", process)
        yield {"url": url, "root": root, "home": home, "log": log_path}
    finally:
        process.terminate()  # shuts its kernels down; the local backend follows its last kernel
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def browser():
    """new_page() -> a page in Debian's Chromium (never a browser Playwright downloads; no sandbox as root).

    Playwright's sync API runs an event loop in this thread while it is open, so it is opened and
    closed within the test: left open for the session (pytest-playwright's fixtures), it would break
    every later test that runs asyncio. Pages of one test share a context (cookies, clipboard).
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        context = chromium.new_context(viewport={"width": 1400, "height": 900})
        context.grant_permissions(["clipboard-read", "clipboard-write"])
        try:
            yield context
        finally:
            chromium.close()


# ---- driving JupyterLab ---------------------------------------------------------------------------


def write_notebook(lab: dict, source: Path, parameters: dict, name: str | None = None) -> str:
    """Copy a notebook into the lab's root with its "parameters" cell replaced; returns its path there."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    name = name or source.name
    nbformat.write(nb, lab["root"] / name)
    return name


def open_notebook(page, lab: dict, name: str) -> None:
    page.set_default_timeout(30_000)
    page.goto(f"{lab['url']}/lab/tree/{name}?reset")  # this notebook alone, not the tabs of earlier tests
    wait_for_kernel(page)


def wait_for_kernel(page) -> None:
    """Until the notebook's kernel is connected and idle (after opening or reloading the page)."""
    from playwright.sync_api import expect

    expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=120_000)


def run_all(page) -> None:
    """Run > Run All Cells, then until the first code cell shows that it runs.

    JupyterLab enables the command only while the notebook is the shell's current widget, which it becomes a moment
    after the focus lands in it; a click on a disabled item closes the menu and does nothing (Lumino logs "Command
    ... is disabled"). So the menu is opened until it shows the item enabled, and the item is clicked once."""
    item = page.get_by_role("menuitem", name="Run All Cells", exact=True)
    console: list[str] = []  # what the page logged meanwhile, for the failure's message
    page.on("console", lambda message: console.append(message.text))
    deadline = time.monotonic() + 30
    while True:
        page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})  # the notebook has the focus
        page.get_by_role("menuitem", name="Run", exact=True).click()
        if "lm-mod-disabled" not in (item.get_attribute("class") or ""):
            break
        page.keyboard.press("Escape")
        assert time.monotonic() < deadline, "Run All Cells stayed disabled: the notebook never became the current widget"
        page.wait_for_timeout(250)
    item.click()
    deadline = time.monotonic() + 60
    while True:
        prompts = run_state(page)["prompts"]
        if prompts and not re.fullmatch(r"\[ ?\]:", prompts[0].strip()):
            return
        assert time.monotonic() < deadline, (f"Run All Cells did not start the notebook: {run_state(page)}; the page "
                                             f"logged: {console[-10:]}")
        page.wait_for_timeout(250)


def save(page) -> None:
    """File > Save Notebook, as a person does before reloading (or as autosave would)."""
    from playwright.sync_api import expect

    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Save Notebook")).first.click()
    expect(page.locator(".jp-mod-current.jp-mod-dirty")).to_have_count(0)


def run_state(page) -> dict:
    """How far Run All got: the code cells' prompts ("[3]:", "[*]:", "[ ]:") as the page shows them."""
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-prompt").all_text_contents()
    return {"cells": len(prompts), "done": sum(bool(re.match(r"\[\d+\]", p.strip())) for p in prompts),
            "prompts": prompts}


def wait_until_run(pages: list, lab: dict, timeout: float = 900) -> None:
    """Wait until every code cell of every page shows an execution count (the kernel ran it)."""
    deadline = time.monotonic() + timeout
    while True:
        states = [run_state(p) for p in pages]
        if all(s["cells"] and s["done"] == s["cells"] for s in states):
            return
        if any(p.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']").count()
               for p in pages):
            return  # a cell failed: Run All stops; the checks that follow say what it printed
        assert time.monotonic() < deadline, f"the notebooks did not finish: {states}\nlab log:\n{tail(lab['log'])}"
        pages[0].wait_for_timeout(1000)


# ---- helpers ----------------------------------------------------------------------------------------


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


def backend_api(lab: dict) -> httpx.Client:
    """The usage API of the lab's local backend, with its key (from runtime/backend.json)."""
    record = json.loads((lab["home"] / "runtime" / "backend.json").read_text())
    return httpx.Client(base_url=record["base_url"], headers={"X-API-Key": record["local_key"]}, timeout=30)
