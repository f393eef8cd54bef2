"""What a new user types first: the README's "Fifteen lines" as printed, and `make lab`.

- The README's code block runs unchanged as a script beside a notebook's backend in a fresh STEPWISE_HOME:
  `workbench.connect()` joins the backend the notebook started, and the model learns the taught answer; the
  well-known key gets a 401 there that says how to connect. The README's server of your own, `python -m
  kernel_backend serve --port 8000`, accepts "tml-local" on loopback; a notebook of that home shares it and
  leaves it running; a second server of the home stops with a message naming the first; a server listening on
  every address refuses the key with a message that says what to do instead. (Port 8000 is used when it is
  free; otherwise the same command on a free port.)
- `make lab` starts JupyterLab on copies of the notebooks, JUPYTER_ARGS reaches Jupyter, and it adds
  --allow-root for root only (the command line make runs as another user has none).

The README's example runs on the real SmolLM2 (REAL_MODEL_ENV), since what it prints is the taught answer; the
other servers here serve the tiny random stand-in for the default model (tests/tiny_model.py): they are about
keys, commands and exit statuses.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REAL_MODEL_ENV
from servers import REPO, free_port, start_server

README = REPO / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Fifteen lines"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def fresh_home(tmp_path, stepwise_home):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models", target_is_directory=True)
    return home


def test_the_readme_example_runs_as_printed_beside_a_notebooks_backend(fresh_home):
    """A notebook holds the home's backend (workbench.connect() started it: a port and a key of its own, no
    loopback key); the README's lines, run as a script, join that backend and teach the answer."""
    code = readme_example()
    assert "client = workbench.connect()" in code
    env = {**os.environ, "STEPWISE_HOME": str(fresh_home), **REAL_MODEL_ENV}
    notebook = subprocess.Popen([sys.executable, "-c", "import sys, workbench; workbench.connect(progress=False); "
                                 "print(workbench.current().base_url, flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        base_url = notebook.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:"), f"the notebook's connect() failed ({notebook.poll()})"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                             env={**os.environ, "STEPWISE_HOME": str(fresh_home)})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "Quibbleton" in out.stdout, out.stdout
        backend = json.loads((fresh_home / "runtime" / "backend.json").read_text())
        assert backend["base_url"] == base_url  # the script used the notebook's backend and started none
        # Plain tinker code with the well-known key gets a 401 that says how to reach this backend.
        refused = httpx.get(f"{base_url}/api/v1/usage", headers={"X-API-Key": "tml-local"})
        assert refused.status_code == 401 and "workbench.connect()" in refused.json()["detail"], refused.text
    finally:
        notebook.stdin.close()
        notebook.wait(timeout=60)


def test_a_server_a_person_started_is_the_homes_shared_backend(fresh_home, tiny_model):
    """`python -m kernel_backend serve --port 8000` (the README's server of your own) listens on loopback with
    the key tml-local; a notebook of the same home uses it (found in runtime/backend.json) and leaves it running
    when it exits: a person started it, not a kernel. A second server of the home stops at once, naming it."""
    from tiny_model import stand_in_env

    port = 8000 if port_free(8000) else free_port()
    server = subprocess.Popen([sys.executable, "-m", "kernel_backend", "serve", "--port", str(port)],
                              env={**os.environ, "STEPWISE_HOME": str(fresh_home), **stand_in_env(tiny_model)},
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(f"http://127.0.0.1:{port}"):
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        joined = subprocess.run([sys.executable, "-c", "import workbench; workbench.connect(progress=False); "
                                 "print(workbench.current().base_url, workbench.current().api_key)"],
                                capture_output=True, text=True, timeout=120, cwd=REPO,
                                env={**os.environ, "STEPWISE_HOME": str(fresh_home)})
        assert joined.stdout.split() == [f"http://127.0.0.1:{port}", "tml-local"], joined.stderr[-2000:]
        assert server.poll() is None and _healthy(f"http://127.0.0.1:{port}")
        second = subprocess.run([sys.executable, "-m", "kernel_backend", "serve", "--port", str(free_port())],
                                capture_output=True, text=True, timeout=120, cwd=REPO,
                                env={**os.environ, "STEPWISE_HOME": str(fresh_home)})
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert f"another Stepwise backend already serves {fresh_home} at http://127.0.0.1:{port}" in second.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_server_on_every_address_refuses_the_loopback_key(fresh_home, tiny_model):
    from tiny_model import stand_in_env

    server = start_server(fresh_home, env={"STEPWISE_LOCAL_KEY": "tml-real-key", **stand_in_env(tiny_model)},
                          host="0.0.0.0")
    try:
        refused = httpx.get(f"{server.base_url}/api/v1/usage", headers={"X-API-Key": "tml-local"})
        assert refused.status_code == 401
        assert "accepted only by a backend that listens on loopback" in refused.json()["detail"]
        assert "stepwise keys create" in refused.json()["detail"]
        assert httpx.get(f"{server.base_url}/api/v1/usage", headers={"X-API-Key": "tml-real-key"}).status_code == 200
    finally:
        server.stop()


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/api/v1/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---- make lab ------------------------------------------------------------------------------------------

# -o install: the environment is already installed (make test did it); these are about `lab`.
MAKE_LAB = ["make", "-s", "-o", "install", "lab"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_starts_jupyterlab_on_copies_of_the_notebooks(tmp_path):
    lab_dir, port = tmp_path / "notebooks", free_port()
    command = [*MAKE_LAB, f"LAB_DIR={lab_dir}",
               f"JUPYTER_ARGS=--no-browser --port={port} --IdentityProvider.token= --ServerApp.ip=127.0.0.1"]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        lab = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert lab.poll() is None, f"make lab exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"JupyterLab did not answer: {log.read_text()[-2000:]}"
            time.sleep(0.5)
        contents = httpx.get(f"http://127.0.0.1:{port}/api/contents").json()["content"]
        assert {c["name"] for c in contents} >= {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
    finally:
        os.killpg(lab.pid, 15)  # make and the JupyterLab it started
        lab.wait(timeout=30)
    # Copies: running and saving them leaves the repository's notebooks as they are.
    assert (lab_dir / "00_quickstart.ipynb").read_bytes() == (REPO / "notebooks/00_quickstart.ipynb").read_bytes()


def dry_run(user: str | None, lab_dir: Path) -> str:
    command = [*MAKE_LAB, "-n", f"LAB_DIR={lab_dir}", "JUPYTER_ARGS=--port=8899"]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_adds_allow_root_only_for_root(tmp_path):
    """JupyterLab refuses to run as root without --allow-root: `make lab` adds it for root only.
    (Starting it as another user needs a Python that user can run; the command line is checked.)"""
    mine = dry_run(None, tmp_path)
    assert "--port=8899" in mine and f"--ServerApp.root_dir={tmp_path}" in mine
    assert ("--allow-root" in mine) == (os.geteuid() == 0)
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("checking another user's command line needs root and runuser")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no `nobody` user to run make as")
    theirs = dry_run("nobody", tmp_path)
    assert "--port=8899" in theirs and "--allow-root" not in theirs


# ---- the console commands ---------------------------------------------------------------------------


STEPWISE = Path(sys.executable).parent / "stepwise"  # the console script pip wrote, as a person runs it


@pytest.mark.parametrize("argv, status", [(["serve", "--help"], 0), (["keys", "--help"], 0), (["export", "--help"], 0),
                                          (["demo", "--help"], 0), ([], 2), (["keys"], 2), (["nonsense"], 2)])
def test_every_console_command_exits_with_its_status(argv, status):
    out = subprocess.run([str(STEPWISE), *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == status, (argv, out.returncode, out.stdout[-1000:], out.stderr[-1000:])
    assert "Traceback" not in out.stderr
    assert ("usage:" in out.stdout) if status == 0 else ("usage:" in out.stderr)


def test_stepwise_demo_exits_0_and_prints_its_summary_lines_only(tinker_server):
    """The demo's console script once ended with status 1 and printed the summaries' dict (it handed
    main()'s return value to sys.exit): a script or CI step running it saw a failure."""
    out = subprocess.run([str(STEPWISE), "demo", "--sft-steps", "1", "--rl-steps", "1", "--rl-eval-prompts", "1",
                          "--progress", "false", "--base-url", tinker_server.base_url, "--api-key", tinker_server.api_key],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("metrics: ") and any(line.startswith("demo done: ") for line in lines), lines[-6:]
    assert "{'sft'" not in out.stdout + out.stderr and "Summary(" not in out.stdout + out.stderr
