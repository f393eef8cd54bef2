"""Start a real backend process on a free loopback port, for tests that talk to it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


# Every server started in this process, for the failure report (conftest.py's pytest_runtest_makereport adds the
# log tails of those a failing test started: the servers' logs live in the test's tmp_path, which pytest rotates away).
STARTED: list["Server"] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    api_key: str
    home: Path
    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # what start_server was given (make_key's command needs its database)

    @property
    def tokenizer_dir(self) -> str:
        return str(next((self.home / "models").glob("*SmolLM2*")))

    def make_key(self, tenant: str) -> str:
        """A new API key for `tenant`, made the way an operator does (`stepwise keys create`)."""
        out = subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "create", "--tenant", tenant], cwd=REPO,
                             env={**os.environ, **self.env, "STEPWISE_HOME": str(self.home)}, capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            (self.process.kill if kill else self.process.terminate)()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(home: Path, env: dict[str, str] | None = None, timeout: float = 180, host: str = "127.0.0.1",
                 port: int | None = None, repo: Path = REPO) -> Server:
    """A backend on `port` (default: a free one); `port` lets a test start it again where its clients look.
    `repo`: the checkout whose kernel_backend runs (a benchmark's older worktree)."""
    port = port or free_port()
    log_path = home / f"server-{port}.log"
    api_key = (env or {}).get("STEPWISE_LOCAL_KEY", "tml-test-key")
    # Like the embedded backend workbench.connect() starts (no per-tenant caps) unless env says otherwise.
    full_env = {**os.environ, "STEPWISE_HOME": str(home), "PYTHONUNBUFFERED": "1", "STEPWISE_LOCAL_KEY": api_key,
                "STEPWISE_EMBEDDED": "1", **(env or {})}
    log = open(log_path, "a")  # a restart on the same port adds to the same log
    process = subprocess.Popen(
        [sys.executable, "-m", "kernel_backend", "serve", "--host", host, "--port", str(port)],
        cwd=repo, env=full_env, stdout=log, stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/api/v1/healthz", timeout=1).status_code == 200:
                STARTED.append(Server(base_url, api_key, home, process, log_path, dict(env or {})))
                return STARTED[-1]
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"server did not answer within {timeout}s:\n{log_path.read_text()[-4000:]}")
