"""The JupyterLab server extension (workbench/lab/): GET /stepwise/sessions in a real Jupyter server
(pytest-jupyter's jp_fetch), reading a real backend through the registry file a kernel writes.

Each test gets its own STEPWISE_HOME, so only the registry files it writes are seen. The "kernel"
that announces a backend is this pytest process (a live pid), as connect() in a kernel would.
The backend is `tinker_server`, on the tiny random stand-in for the default model (tests/tiny_model.py):
what the extension lists (sessions, steps, losses, tokens, costs, checkpoints) is the same on any model.

pytest-jupyter's fixtures are imported into this module rather than loaded as a plugin
(`pytest_plugins`): as a plugin, its autouse fixtures (a fresh event loop, a ServerApp cleanup) and
its call hook would run for every test of the suite. So the tests are plain functions that run
jp_fetch on the fixture's loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tornado.httpclient import HTTPClientError

from pytest_jupyter.jupyter_core import (  # noqa: F401  (fixtures, used by name)
    echo_kernel_spec, jp_asyncio_loop, jp_config_dir, jp_data_dir, jp_env_config_path, jp_env_jupyter_path,
    jp_environ, jp_home_dir, jp_kernel_dir, jp_runtime_dir, jp_system_config_path, jp_system_jupyter_path)
from pytest_jupyter.jupyter_server import (  # noqa: F401
    jp_argv, jp_auth_header, jp_base_url, jp_configurable_serverapp, jp_fetch, jp_http_port, jp_logging_stream,
    jp_nbconvert_templates, jp_root_dir, jp_server_cleanup, jp_serverapp, jp_template_dir, jp_web_app)
from pytest_jupyter.pytest_tornasync import http_server, http_server_client, http_server_port, io_loop  # noqa: F401
from servers import free_port
from workbench.lab.backends import LabMemory

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"workbench.lab": True},
                          # jupyter_server's default: only the handler's own @authenticated guards it
                          "allow_unauthenticated_access": True,
                          "terminals_enabled": False}}


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "stepwise_home"  # not tmp_path itself: pytest-jupyter keeps Jupyter's runtime dir there
    (home / "runtime").mkdir(parents=True)
    monkeypatch.setenv("STEPWISE_HOME", str(home))
    return home


def announce(home, base_url: str, api_key: str, pid: int | None = None) -> None:
    """Write the registry file workbench.connect() writes for a kernel (here: for `pid`)."""
    pid = os.getpid() if pid is None else pid
    record = {"base_url": base_url, "api_key": api_key, "pid": pid, "started": "2026-01-01T00:00:00+00:00",
              "embedded": False, "backend_pid": None, "log": None}
    (home / "runtime" / f"{pid}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def trained_session(tinker_server):
    """A session on the shared test backend with two optim steps and a saved state."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    tokens = list(range(200, 232))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    losses = []
    for _ in range(2):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    path = tc.save_state("extension-test").result().path
    usage = httpx.get(f"{tinker_server.base_url}/api/v1/usage", params={"training_run_id": tc.model_id},
                      headers={"X-API-Key": tinker_server.api_key}).json()
    session_id = usage["series"][0]["session_id"]
    return {"session_id": session_id, "run": tc.model_id, "last_loss": losses[-1], "checkpoint": path}


@pytest.fixture
def fetch(jp_fetch, jp_asyncio_loop):  # noqa: F811 - pytest fixtures, imported to be found
    """jp_fetch, run to completion on the Jupyter server's loop."""
    return lambda *parts, **kwargs: jp_asyncio_loop.run_until_complete(jp_fetch(*parts, **kwargs))


def get_report(fetch, **params) -> dict:
    response = fetch("stepwise", "sessions", params=params)
    assert response.code == 200
    return json.loads(response.body)


def test_lists_a_backends_sessions_with_steps_loss_tokens_cost_and_checkpoints(
        fetch, home, tinker_server, trained_session):
    announce(home, tinker_server.base_url, tinker_server.api_key)
    response = fetch("stepwise", "sessions")
    assert tinker_server.api_key not in response.body.decode()  # the browser never sees a key
    report = json.loads(response.body)

    assert report["message"] is None
    assert [b["base_url"] for b in report["backends"]] == [tinker_server.base_url]
    assert report["backends"][0]["error"] is None and report["backends"][0]["kernel_pids"] == [os.getpid()]
    ours = [s for s in report["sessions"] if s["session_id"] == trained_session["session_id"]]
    assert len(ours) == 1, [s["session_id"] for s in report["sessions"]]
    session = ours[0]
    assert session["backend"] == tinker_server.base_url
    assert (session["status"], session["base_model"], session["lora_rank"], session["steps"]) == ("active", BASE, 4, 2)
    assert session["last_loss"] == pytest.approx(trained_session["last_loss"])
    assert session["training_run_ids"] == [trained_session["run"]]
    assert session["train_tokens"] == 2 * 31 and session["cost"] > 0
    assert [c["tinker_path"] for c in session["checkpoints"]] == [trained_session["checkpoint"]]
    assert trained_session["checkpoint"].startswith("tinker://")
    # The running totals cover the active sessions, ours included, split by kind.
    running = report["running"]
    assert running["sessions"] >= 1 and running["cost"] >= session["cost"]
    assert sum(part["cost"] for part in running["by_kind"].values()) == pytest.approx(running["cost"])


def test_two_kernels_on_one_backend_list_it_once(fetch, home, tinker_server, trained_session):
    announce(home, tinker_server.base_url, tinker_server.api_key)
    announce(home, tinker_server.base_url, tinker_server.api_key, pid=os.getppid())  # another live process
    report = get_report(fetch)
    assert len(report["backends"]) == 1
    assert sorted(report["backends"][0]["kernel_pids"]) == sorted([os.getpid(), os.getppid()])
    ids = [s["session_id"] for s in report["sessions"]]
    assert len(ids) == len(set(ids))


def test_refuses_unauthenticated_calls(fetch, home):
    with pytest.raises(HTTPClientError) as error:
        fetch("stepwise", "sessions", headers={"Authorization": ""})
    assert error.value.code == 403


def test_no_backend_running_says_how_to_start_one(fetch, home):
    report = get_report(fetch)
    assert report["sessions"] == [] and report["backends"] == [] and report["running"]["cost"] == 0
    assert "No Stepwise backend is running" in report["message"]
    assert "workbench.connect()" in report["message"] and str(home / "runtime") in report["message"]


def test_a_dead_kernels_registry_file_is_ignored(fetch, home, tinker_server):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    announce(home, tinker_server.base_url, tinker_server.api_key, pid=gone.pid)
    (home / "runtime" / "garbage.json").write_text("{not json")
    report = get_report(fetch)
    assert report["backends"] == [] and "No Stepwise backend is running" in report["message"]


def test_a_backend_that_does_not_answer_is_named_with_the_fix(fetch, home):
    dead_url = f"http://127.0.0.1:{free_port()}"
    announce(home, dead_url, "tml-whatever")
    report = get_report(fetch)
    error = report["backends"][0]["error"]
    assert error.startswith("Backend stopped") and dead_url in error and "workbench.connect()" in error
    assert report["backends"][0]["stopped"] is True
    assert report["message"].startswith("No Stepwise backend answered")


def test_a_refused_key_is_reported(fetch, home, tinker_server):
    announce(home, tinker_server.base_url, "tml-revoked-or-unknown")
    report = get_report(fetch)
    assert "refused the kernel's API key" in report["backends"][0]["error"]
    assert report["sessions"] == []


def test_a_bad_limit_is_a_400_that_says_the_range(fetch, home):
    with pytest.raises(HTTPClientError) as error:
        fetch("stepwise", "sessions", params={"limit": "0"})
    assert error.value.code == 400
    assert "limit must be an integer from 1 to 1000" in error.value.response.reason


def test_a_stopped_backends_sessions_stay_listed_with_their_checkpoints(fetch, home, tinker_server, trained_session):
    """The kernels shut down (their registry files go): the sessions stay, "ended", with their paths."""
    announce(home, tinker_server.base_url, tinker_server.api_key)
    before = get_report(fetch)
    (live,) = [s for s in before["sessions"] if s["session_id"] == trained_session["session_id"]]
    assert live["remembered"] is False and live["status"] == "active"
    (home / "runtime" / f"{os.getpid()}.json").unlink()

    report = get_report(fetch)
    assert report["backends"] == [] and "No Stepwise backend is running" in report["message"]
    (ended,) = [s for s in report["sessions"] if s["session_id"] == trained_session["session_id"]]
    assert (ended["remembered"], ended["status"], ended["steps"]) == (True, "ended", 2)
    assert [c["tinker_path"] for c in ended["checkpoints"]] == [trained_session["checkpoint"]]
    assert report["running"]["sessions"] == 0  # nothing of a stopped backend runs
    assert report["lab"] == before["lab"]  # what the lab spent does not fall
    assert trained_session["session_id"] not in [s["session_id"] for s in get_report(fetch, active_only="true")["sessions"]]


def test_lab_memory_marks_what_a_backend_that_does_not_answer_took_down():
    memory = LabMemory()
    row = {"backend": "http://b", "session_id": "s", "status": "active", "created_at": memory.since.isoformat(),
           "sampler_snapshots": [{"sampler_id": "s:sample:0"}], "checkpoints": [{"tinker_path": "tinker://r/x/y"}],
           "cost": 0.5}
    finished = {**row, "session_id": "f", "status": "finished"}
    memory.update([row, finished])
    by_id = lambda rows: {r["session_id"]: r for r in rows}  # noqa: E731
    # Announced, but stopped: its active session is unreachable, its snapshots gone, its checkpoints kept.
    gone = by_id(memory.remembered(set(), stopped={"http://b"}, announced={"http://b"}))
    assert (gone["s"]["status"], gone["s"]["sampler_snapshots"], gone["s"]["checkpoints"]) == \
        ("unreachable", [], row["checkpoints"])
    assert gone["f"]["status"] == "finished"
    assert by_id(memory.remembered(set(), stopped=set(), announced=set()))["s"]["status"] == "ended"  # no kernel
    # Alive (announced, not stopped: slow this once, or past its listing's limit): as it was last seen.
    assert by_id(memory.remembered({"f"}, stopped=set(), announced={"http://b"})) == \
        {"s": {**row, "remembered": True}}
    assert memory.totals()["sessions"] == 2 and memory.totals()["cost"] == 1.0
    # The home's backend came back at another URL (a kernel restarted after the first exited unused) and lists
    # the same session, finished: one session, counted once, not a live row beside a remembered "ended" one.
    memory.update([{**row, "backend": "http://b2", "status": "finished"}])
    assert memory.remembered({"s"}, stopped=set(), announced={"http://b2"}) == [by_id(memory.remembered(
        set(), stopped=set(), announced={"http://b2"}))["f"]]
    assert memory.totals()["sessions"] == 2 and memory.totals()["cost"] == 1.0
    small = LabMemory(most=1)
    small.update([row, {**finished, "created_at": "2000-01-01T00:00:00+00:00"}])
    assert [r["session_id"] for r in small.remembered(set(), set(), set())] == ["s"]  # the newest is kept


def test_a_session_follows_its_notebook_when_it_is_renamed(fetch, home, tinker_server, jp_serverapp,  # noqa: F811
                                                           echo_kernel_spec):  # noqa: F811 - fixtures
    """Named "Untitled.ipynb" when its kernel connected; the notebook is renamed (JupyterLab PATCHes
    the Jupyter session's path); the report names the notebook's new path, found by the kernel's pid."""
    created = json.loads(fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": "Untitled.ipynb", "type": "notebook", "kernel": {"name": "echo"}})).body)
    try:
        kernel_pid = jp_serverapp.kernel_manager.get_kernel(created["kernel"]["id"]).provisioner.pid
        # The session the kernel's connect() would open: named after the notebook, carrying its pid.
        client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key,
                                      display_name="Untitled.ipynb", user_metadata={"local_pid": str(kernel_pid)})
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        session_id = tc.model_id.split(":")[0]
        announce(home, tinker_server.base_url, tinker_server.api_key)

        def ours():
            (row,) = [s for s in get_report(fetch)["sessions"] if s["session_id"] == session_id]
            return row
        assert (ours()["notebook"], ours()["kernel_pid"]) == ("Untitled.ipynb", kernel_pid)
        fetch("api", "sessions", created["id"], method="PATCH", body=json.dumps({"path": "work/renamed.ipynb"}))
        row = ours()
        assert (row["notebook"], row["display_name"]) == ("work/renamed.ipynb", "Untitled.ipynb")
    finally:
        fetch("api", "sessions", created["id"], method="DELETE")
    # The kernel is gone: the session keeps the notebook it last ran.
    assert ours()["notebook"] == "work/renamed.ipynb"


def test_a_kernel_shut_down_while_the_report_is_made_is_left_out(fetch, jp_serverapp, echo_kernel_spec,  # noqa: F811
                                                                  monkeypatch):
    """The report lists the server's sessions, then asks the kernel manager for each one's process: a kernel shut
    down in between (jupyter_server answers its id with an HTTPError 404) is one kernel fewer, not a failed report;
    nor is a session that names no kernel."""
    created = json.loads(fetch("api", "sessions", method="POST", body=json.dumps(
        {"path": "alive.ipynb", "type": "notebook", "kernel": {"name": "echo"}})).body)
    try:
        sessions = jp_serverapp.session_manager
        listed = sessions.list_sessions

        async def with_gone_ones():
            return [*await listed(), {"id": "x", "path": "gone.ipynb", "kernel": {"id": "no-such-kernel"}},
                    {"id": "y", "path": "starting.ipynb", "kernel": None}]
        monkeypatch.setattr(sessions, "list_sessions", with_gone_ones)
        report = get_report(fetch)
        assert "sessions" in report
        monkeypatch.setattr(sessions, "list_sessions", listed)
    finally:
        fetch("api", "sessions", created["id"], method="DELETE")


def test_a_backend_slow_to_answer_keeps_its_sessions_as_last_read(monkeypatch):
    """A timeout (a busy machine) is not a stop: the session stays active, its snapshots listed."""
    import asyncio
    import socket

    from workbench.lab import backends

    monkeypatch.setattr(backends, "TIMEOUT_S", 0.5)
    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        memory = LabMemory()
        memory.update([{"backend": url, "session_id": "s", "status": "active", "created_at": memory.since.isoformat(),
                        "sampler_snapshots": [{"sampler_id": "s:sample:0"}], "checkpoints": []}])
        slow = backends.Backend(base_url=url, api_key="k", embedded=True, started="", kernel_pids=[os.getpid()])
        report = asyncio.run(backends.read_report([slow], lab=memory))
    (listed,) = report["backends"]
    assert listed["stopped"] is False and "did not answer within 0.5 s" in listed["error"]
    (row,) = report["sessions"]
    assert (row["status"], row["remembered"], row["sampler_snapshots"]) == ("active", True, [{"sampler_id": "s:sample:0"}])


def test_each_run_carries_the_lineage_the_sidebar_draws_its_tree_from(fetch, home, tinker_server, trained_session):
    # A fork of the trained run (from its state after step 2), in a session of its own: the sidebar's tree
    # (extension/src/format.ts, runTree and runName) reads its name and lineage from the run's user_metadata.
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    fork = client.create_training_client_from_state_with_optimizer(
        trained_session["checkpoint"], user_metadata={"name": "the fork"}).result()
    announce(home, tinker_server.base_url, tinker_server.api_key)
    sessions = get_report(fetch)["sessions"]
    runs = {run["training_run_id"]: run for s in sessions for run in s["runs"]}
    assert runs[fork.model_id]["user_metadata"] == {"name": "the fork"}  # the user's own; the lineage is ours:
    assert (runs[fork.model_id]["parent_run_id"], runs[fork.model_id]["fork_step"]) == (trained_session["run"], 2)
    assert runs[trained_session["run"]]["parent_run_id"] is None
    assert runs[trained_session["run"]]["cost"] > 0 and runs[fork.model_id]["cost"] == 0.0


def test_loss_tokens_counts_what_each_loss_sums_over():
    from kernel_backend.metering import loss_tokens
    from kernel_backend.types import Datum

    sft = Datum(tokens=[1, 2, 3, 4], loss_fn_inputs={"weights": np.array([0, 0, 1, 1], np.float32)})
    plain = Datum(tokens=[1, 2, 3], loss_fn_inputs={})
    rl = Datum(tokens=[1, 2, 3, 4, 5], loss_fn_inputs={"advantages": np.array([0, 0, 0.5, -0.5, 0.5], np.float32)})
    assert loss_tokens([sft, plain], "cross_entropy") == 2 + 3  # weights, else one a token
    assert loss_tokens([rl], "importance_sampling") == 3  # the tokens with an advantage (the prompt's have none)
    assert loss_tokens([plain], "ppo") == 0


def test_runs_say_their_loss_per_token_its_step_and_the_steps_skipped(fetch, home, tinker_server):
    """Issue 56: the sidebar shows a run's loss per token as the notebooks print it (loss:sum over the loss's
    weights; a step's passes added up), the step it belongs to, and optimizer steps with no forward_backward (an
    RL step whose groups all tied) as skipped, never the step before's loss as the last step's. A session named
    by connect(name=...) carries the name in its user_metadata."""
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key,
                                  display_name="warehouse-agent", user_metadata={"name": "warehouse-agent"})
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    tokens = list(range(300, 332))
    weights = np.zeros(31, np.float32)
    weights[10:] = 1.0  # the prompt's 10 tokens count for nothing
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": weights})
    adam = types.AdamParams(learning_rate=1e-3)
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(adam).result()
    # step 2: two passes (gradient accumulation), one step
    sums = [tc.forward_backward([datum] * n, "cross_entropy").result().metrics["loss:sum"] for n in (1, 2)]
    tc.optim_step(adam).result()
    tc.optim_step(adam).result()  # step 3: nothing to train on

    # An RL run: its loss per token is over the tokens that carry an advantage.
    rl = client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    advantages = np.zeros(31, np.float32)
    advantages[20:] = 0.5
    rl_datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "logprobs": np.full(31, -2.0, np.float32),
                                           "advantages": advantages})
    rl_loss = rl.forward_backward([rl_datum], "importance_sampling").result().metrics["loss:sum"]
    rl.optim_step(adam).result()

    announce(home, tinker_server.base_url, tinker_server.api_key)
    (session,) = [s for s in get_report(fetch)["sessions"] if tc.model_id in s["training_run_ids"]]
    assert session["user_metadata"]["name"] == "warehouse-agent" and session["display_name"] == "warehouse-agent"
    runs = {r["training_run_id"]: r for r in session["runs"]}
    sft = runs[tc.model_id]
    assert (sft["steps"], sft["skipped_steps"], sft["loss_step"]) == (3, 1, 2)
    assert sft["loss_per_token"] == pytest.approx(sum(sums) / (3 * 21), rel=1e-5)
    assert sft["last_loss"] == pytest.approx(sums[-1])  # the newest pass's sum, as before
    other = runs[rl.model_id]
    assert (other["steps"], other["skipped_steps"], other["loss_step"]) == (1, 0, 1)
    assert other["loss_per_token"] == pytest.approx(rl_loss / 11, rel=1e-5)
