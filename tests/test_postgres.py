"""The service on PostgreSQL: a real server process whose database is a real PostgreSQL cluster.

The cluster is made by the test (initdb in a temporary folder, a free loopback port) and
stopped afterwards. Without PostgreSQL's server binaries the test is skipped, saying how to
install them.

The server serves the tiny random stand-in for the default model (tests/tiny_model.py): this is about where
the rows go, not what a model learns.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from servers import free_port, start_server

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@pytest.fixture(scope="module")
def postgres_url():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries not found; `apt-get install postgresql` to run this test")
    # Not under pytest's tmp folder: that is private to root, and the server runs as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="stepwise-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    # PostgreSQL refuses to run as root: run it as the `postgres` system user when we are root.
    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser; cannot start PostgreSQL as a non-root user")
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
        shutil.chown(sockets, "postgres")
    subprocess.run([*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "postgres"], check=True, capture_output=True)
    port = free_port()
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-o", options, "-w", "-l", str(root / "log"), "start"],
                   check=True, capture_output=True)
    yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def test_training_run_on_postgres(postgres_url, stepwise_home, tiny_model, tmp_path):
    from tiny_model import stand_in_env

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")
    server = start_server(home, env={"STEPWISE_DATABASE_URL": postgres_url, **stand_in_env(tiny_model)})
    try:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 9690, 198, 2683, 359]),
            loss_fn_inputs={"target_tokens": np.array([9690, 198, 2683, 359, 2])},
        )
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert np.isfinite(fb.result().metrics["loss:sum"])
        path = tc.save_state("on-postgres").result().path
        rest = tinker.RestClient(base_url=server.base_url, api_key=server.api_key)
        assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [path]
    finally:
        server.stop()

    # The rows are in PostgreSQL itself.
    from sqlalchemy import create_engine, text

    with create_engine(postgres_url).connect() as conn:
        assert conn.execute(text("select count(*) from models where id = :id"), {"id": tc.model_id}).scalar() == 1
        assert conn.execute(text("select count(*) from checkpoints where tinker_path = :p"), {"p": path}).scalar() == 1
        kinds = {r[0] for r in conn.execute(text("select request_type from futures where model_id = :id"), {"id": tc.model_id})}
        assert {"CreateModel", "ForwardBackward", "OptimStep", "SaveWeights"} <= kinds
