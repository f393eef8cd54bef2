"""The gateway's own crash on Ray (kernel_backend/execution/cluster.py): `serve --workers 2`, the process that owns the
Ray head and the engine workers, killed with SIGKILL mid-loop and started again on the same home and port.

The standard is the in-process server's (tests/test_recovery.py): the SDK loop goes on across the restart (its own
retries carry it while the server is away), the requests in flight at the kill are answered by the rebuilt run, and
the final logprobs are those of an uninterrupted in-process run (1e-5). A killed gateway leaves no Ray process
behind: its head, its workers and Ray's agents go with it (they would eat a small machine's memory).

A backend of its own (it is killed), on the tiny random stand-in for the default model, as tests/test_cluster.py's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sqlite3
import threading

import httpx
import pytest
import tinker
from tinker import types

from helpers import sft_datum, wait_until
from servers import start_server
from test_cluster import BASE, LR, QUESTIONS, in_process_logprobs, sdk_datum
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


def test_a_killed_gateway_comes_back_and_the_loop_ends_as_if_uninterrupted(tmp_path, stepwise_home, tiny_model,
                                                                             engine, tokenizer):
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
        alive = lambda: [p for p in left_behind if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # noqa: E731
        wait_until(lambda: not alive(), timeout=5, what=f"the killed gateway's Ray processes to end: {alive()}")
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
