"""The gateway on Ray (kernel_backend/execution/cluster.py): its own crash, and a cluster of more than one node.

`serve --workers 2`, the process that owns the Ray head and the engine workers, killed with SIGKILL mid-loop and
started again on the same home and port.

The standard is the in-process server's (tests/test_recovery.py): the SDK loop goes on across the restart (its own
retries carry it while the server is away), the requests in flight at the kill are answered by the rebuilt run, and
the final logprobs are those of an uninterrupted in-process run (1e-5). A killed gateway leaves no Ray process
behind: its head, its workers and Ray's agents go with it (they would eat a small machine's memory).

`ray start --head` and `ray start --address` on this machine stand in for two nodes of a cluster that `serve` joins
(STEPWISE_RAY_ADDRESS).

Backends of their own, on the tiny random stand-in for the default model, as tests/test_cluster.py's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from helpers import sft_datum, wait_until
from servers import free_port, start_server
from test_cluster import BASE, LR, QUESTIONS, cluster_report, in_process_logprobs, sdk_datum, train_steps
from tiny_model import stand_in_env

if importlib.util.find_spec("ray") is None:
    pytest.skip("the cluster tests need Ray: pip install -e '.[cluster]' (make install does)", allow_module_level=True)
import psutil  # noqa: E402 (Ray's dependency)

ENV = {"STEPWISE_WORKERS": "2", "STEPWISE_WORKER_THREADS": "1", "STEPWISE_RAY_NUM_CPUS": "2",
       "STEPWISE_RAY_OBJECT_STORE_MB": "128", "STEPWISE_SNAPSHOT_EVERY": "2", "STEPWISE_HEARTBEAT_S": "0.5",
       "STEPWISE_EMBEDDED": "0"}
STEPS, KILL_AFTER = 10, 4


def ray_processes(pid: int) -> list[psutil.Process]:
    """The processes a gateway started: Ray's head (gcs_server, raylet, agents) and its engine workers."""
    return psutil.Process(pid).children(recursive=True)


def journaled(home, model_id: str) -> int:
    """The run's requests the gateway accepted since its last snapshot (service/recovery.py's journal)."""
    with contextlib.closing(sqlite3.connect(home / "stepwise.db")) as db:
        return db.execute("select count(*) from journal where model_id = ?", (model_id,)).fetchone()[0]


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # it ended while we looked
        return False


def test_a_killed_gateway_comes_back_and_the_loop_ends_as_if_uninterrupted(tmp_path, stepwise_home, tiny_model,
                                                                             engine, tokenizer):
    """kill -9 of `serve --workers 2` once step 5's requests are accepted, started again on its home and port while
    the loop waits: the loop finishes with no failed call, its logprobs those of an uninterrupted in-process run
    (1e-5), each step billed once, and nothing of the killed gateway's Ray left running."""
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    env = {**ENV, **stand_in_env(tiny_model)}
    server = start_server(tmp_path, env=env, timeout=600)
    port = int(server.base_url.rsplit(":", 1)[1])
    restart = None
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=41).result()
        datums = [sft_datum(*QUESTIONS[1], tokenizer)] * 2
        data = [sdk_datum(d) for d in datums]
        left_behind = []
        for step in range(STEPS):
            fb = tc.forward_backward(data, "cross_entropy")
            optim = tc.optim_step(types.AdamParams(learning_rate=LR))
            if step == KILL_AFTER:  # step 5's two requests accepted (journaled), perhaps answered: kill -9 the gateway
                wait_until(lambda: journaled(tmp_path, tc.model_id) == 2, timeout=60, what="step 5 to be journaled")
                left_behind = ray_processes(server.process.pid)
                assert any("raylet" in p.name() for p in left_behind), left_behind
                server.stop(kill=True)

                def start_again():
                    nonlocal server
                    server = start_server(tmp_path, env=env, port=port, timeout=600)

                restart = threading.Thread(target=start_again)
                restart.start()
            fb.result()  # the SDK retries while the gateway is away; the rebuilt run answers
            optim.result()
        restart.join()
        got = tc.forward(data, "cross_entropy").result().loss_fn_outputs

        expected = in_process_logprobs(engine, 41, 4, datums, steps=STEPS)
        for a, b in zip(got, expected):
            assert abs(a["logprobs"].to_numpy() - b).max() <= 1e-5, abs(a["logprobs"].to_numpy() - b).max()
        # The killed gateway's Ray processes are gone: the new one has a head and workers of its own.
        wait_until(lambda: not any(running(p) for p in left_behind), timeout=5,
                   what=f"the killed gateway's Ray processes to end: {[p for p in left_behind if running(p)]}")
        assert not {p.pid for p in left_behind} & {p.pid for p in ray_processes(server.process.pid)}
        # Each step billed once: the optim_step in flight at the kill applied exactly once.
        rows = httpx.get(f"{server.base_url}/api/v1/usage", params={"training_run_id": tc.model_id},
                         headers={"X-API-Key": server.api_key}, timeout=30).json()["series"]
        assert sorted(r["step"] for r in rows if r["request_type"] == "OptimStep") == list(range(1, STEPS + 1))
        assert sum(r["request_type"] == "ForwardBackward" for r in rows) == STEPS
        # Rebuilt from the snapshot after step 4 (STEPWISE_SNAPSHOT_EVERY=2) and step 5's two requests since.
        assert "rebuilt from its snapshot at step 4 and 2 journaled requests" in server.log_path.read_text()
    finally:
        if restart is not None:
            restart.join()
        server.stop()


RAY = str(Path(sys.executable).with_name("ray"))


@contextlib.contextmanager
def two_node_cluster():
    """A Ray cluster of two nodes on this machine (`ray start --head`, then `ray start --address`), one CPU each, in a
    temp dir of its own; yields its address. Ended by killing its own processes (never `ray stop`: that stops every
    Ray on the machine)."""
    temp_dir = tempfile.mkdtemp(prefix="stepwise-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Token authentication, as Ray asks of a node or driver joining a cluster that `ray start` made here.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    common = ["--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temp_dir}", f"--object-store-memory={128 << 20}"]
    try:
        head = subprocess.run([RAY, "start", "--head", f"--port={free_port()}", "--include-dashboard=false", *common],
                              env=env, capture_output=True, text=True, timeout=300)
        found = re.search(r"ray start --address='([^']+)'", head.stdout + head.stderr)
        assert head.returncode == 0 and found, head.stdout + head.stderr
        address = found.group(1)
        node = subprocess.run([RAY, "start", f"--address={address}", *common], env=env, capture_output=True, text=True,
                              timeout=300)
        assert node.returncode == 0, node.stdout + node.stderr

        def nodes_alive() -> int:
            status = subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, text=True,
                                    timeout=120).stdout
            return len(re.findall(r"^ 1 node_", status.split("Pending:")[0], flags=re.M))

        wait_until(lambda: nodes_alive() == 2, timeout=120, what="the second node to join", every=1)
        yield address
    finally:
        ours = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
        for process in ours + [child for p in ours for child in _children(p)]:
            with contextlib.suppress(psutil.Error):
                process.kill()


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def test_the_gateway_joins_a_ray_cluster_and_spreads_its_workers_over_its_nodes(tmp_path, stepwise_home, tiny_model,
                                                                                 engine, tokenizer):
    """`serve` with STEPWISE_RAY_ADDRESS and STEPWISE_WORKERS=2 joins a cluster of two nodes: one worker on each, a
    run trains as on one process (1e-5); the gateway killed (kill -9) and started again joins the same cluster and
    rebuilds its runs, which train on as if nothing happened; and the cluster outlives the gateway (it is not the
    gateway's to stop)."""
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    with two_node_cluster() as address:
        env = {"STEPWISE_RAY_ADDRESS": address, "STEPWISE_WORKERS": "2", "STEPWISE_WORKER_THREADS": "1",
               "STEPWISE_HEARTBEAT_S": "0.5", "STEPWISE_EMBEDDED": "0", "RAY_AUTH_MODE": "token",
               **stand_in_env(tiny_model)}
        server = start_server(tmp_path, timeout=600, env=env)
        try:
            report = cluster_report(server)
            assert report["ray_address"] == address
            workers = report["workers"]
            assert [w["state"] for w in workers] == ["live", "live"], workers
            assert len({w["node_id"] for w in workers}) == 2, workers  # one on each node

            client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
            datums = [sft_datum(*QUESTIONS[3], tokenizer)]
            data = [sdk_datum(d) for d in datums]
            runs = [client.create_lora_training_client(base_model=BASE, rank=4, seed=61 + i).result() for i in range(2)]
            placed = cluster_report(server)["runs"]
            assert sorted(placed[tc.model_id]["workers"][0] for tc in runs) == ["worker-0", "worker-1"], placed
            for i, tc in enumerate(runs):
                train_steps(tc, data, steps=2)
                got = tc.forward(data, "cross_entropy").result().loss_fn_outputs
                expected = in_process_logprobs(engine, 61 + i, 4, datums, steps=2)
                assert abs(got[0]["logprobs"].to_numpy() - expected[0]).max() <= 1e-5

            # Its workers die with it (Ray ends a dead driver's actors); started again on its home and port, it starts
            # two of its own on the cluster and rebuilds both runs from their journals before it serves.
            port = int(server.base_url.rsplit(":", 1)[1])
            server.stop(kill=True)
            server = start_server(tmp_path, timeout=600, env=env, port=port)
            assert [w["state"] for w in cluster_report(server)["workers"]] == ["live", "live"]
            for i, tc in enumerate(runs):
                train_steps(tc, data, steps=1)
                got = tc.forward(data, "cross_entropy").result().loss_fn_outputs
                expected = in_process_logprobs(engine, 61 + i, 4, datums, steps=3)
                assert abs(got[0]["logprobs"].to_numpy() - expected[0]).max() <= 1e-5
            assert "rebuilt 2 training runs" in server.log_path.read_text()
        finally:
            server.stop()
        # The gateway stopped its workers, not the cluster: both raylets still run.
        raylets = [p for p in psutil.process_iter(["name", "cmdline"])
                   if p.info["name"] == "raylet" and address.rsplit(":", 1)[1] in " ".join(p.info["cmdline"] or [])]
        assert len(raylets) == 2, raylets
