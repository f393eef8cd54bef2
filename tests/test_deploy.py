"""deploy/stepwise.service and deploy/stepwise.env, as far as this machine can run them (no systemd as PID 1 here):
`systemd-analyze verify` reads the unit with this checkout's `stepwise` in its ExecStart, and that ExecStart runs as a
test's own server with the environment file's settings: it becomes ready, logs JSON lines, and stops on SIGTERM.

The server serves the tiny stand-in for the default model (tests/tiny_model.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from servers import REPO, free_port
from tiny_model import stand_in_env

UNIT = REPO / "deploy" / "stepwise.service"
ENV_FILE = REPO / "deploy" / "stepwise.env"
STEPWISE = Path(sys.executable).parent / "stepwise"  # the console script this checkout's venv installed


def unit_here(tmp_path: Path) -> Path:
    """The unit with this venv's `stepwise` and the repo's environment file where the installed ones would be."""
    text = UNIT.read_text().replace("/opt/stepwise/.venv/bin/stepwise", str(STEPWISE)) \
        .replace("/etc/stepwise/stepwise.env", str(ENV_FILE))
    path = tmp_path / "stepwise.service"
    path.write_text(text)
    return path


def service_value(unit: str, key: str) -> str:
    (line,) = [line for line in unit.splitlines() if line.startswith(f"{key}=")]
    return line.split("=", 1)[1]


def test_the_unit_verifies(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (apt-get install systemd)")
    checked = subprocess.run(["systemd-analyze", "verify", str(unit_here(tmp_path))], capture_output=True, text=True,
                             timeout=120)
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr


def test_the_units_command_with_its_environment_serves_logs_json_and_stops_on_sigterm(tmp_path, stepwise_home,
                                                                                       tiny_model):
    unit = unit_here(tmp_path).read_text()
    command = shlex.split(service_value(unit, "ExecStart"))
    assert command[:2] == [str(STEPWISE), "serve"] and "--host" in command
    port = free_port()
    command[command.index("--port") + 1] = str(port)
    settings = dict(line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#"))
    assert settings["STEPWISE_HOME"] == service_value(unit, "ReadWritePaths")  # the one folder it may write
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")
    env = {"PATH": os.environ["PATH"], **settings, "STEPWISE_HOME": str(home), **stand_in_env(tiny_model),
           "STEPWISE_LOCAL_KEY": "tml-deploy-test"}
    log = tmp_path / "journal.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"not ready in 300 s: {log.read_text()[-3000:]}")
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/usage", headers={"X-API-Key": "tml-deploy-test"},
                         timeout=30).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)  # systemd's KillSignal
        code = process.wait(timeout=float(service_value(unit, "TimeoutStopSec")))
    assert code == 0 or str(code) in service_value(unit, "SuccessExitStatus").split(), log.read_text()[-3000:]
    ours = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert any(r["logger"] == "stepwise.requests" and r["route"] == "/api/v1/usage" and r["status"] == 200 for r in ours)
    assert "\x1b[" not in log.read_text()
