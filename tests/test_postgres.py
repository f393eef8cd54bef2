"""The service on PostgreSQL: a real `serve` process whose database is a real PostgreSQL cluster (tests/postgres_server.py).

One cluster and one backend for the module. What a team's server meets: several tenants writing the ledger at once
(every row there once, none lost or doubled), a restart of the backend (runs, checkpoints, ledger and budgets still
there and loadable), PostgreSQL itself stopped and started under a running backend (a clear error while it is down,
not a hang, and the next requests work once it is back), and a `kill -9` of the backend mid-loop (the run comes back
from its snapshot and journal, bit for bit, as on SQLite: tests/test_recovery.py).

The server serves the tiny random stand-in for the default model (tests/tiny_model.py): this is about where
the rows go, not what a model learns.
"""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import numpy as np
import pytest
import tinker
from sqlalchemy import create_engine, text
from tinker import types

from postgres_server import postgres_cluster  # noqa: F401  (a fixture)
from servers import start_server
from test_recovery import train

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})


@pytest.fixture(scope="module")
def backend(postgres_cluster, tmp_path_factory, stepwise_home, tiny_model):  # noqa: F811
    """`serve` on the module's PostgreSQL; `backend.restart()` starts it again on the same port, home and database."""
    from tiny_model import stand_in_env

    home = tmp_path_factory.mktemp("pg-home")
    (home / "models").symlink_to(stepwise_home / "models")
    env = {"STEPWISE_DATABASE_URL": postgres_cluster.url, "STEPWISE_EMBEDDED": "0", "STEPWISE_SNAPSHOT_EVERY": "4",
           **stand_in_env(tiny_model)}

    class Backend:
        server = start_server(home, env=env)
        port = int(server.base_url.rsplit(":", 1)[1])

        def restart(self, kill: bool = False) -> None:
            self.server.stop(kill=kill)
            self.server = start_server(home, env=env, port=self.port)

    backend = Backend()
    yield backend
    backend.server.stop()


def ledger(server, key: str) -> list[dict]:
    reply = httpx.get(f"{server.base_url}/api/v1/usage", params={"limit": 10000}, headers={"X-API-Key": key}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["series"]


def test_a_training_run_s_rows_are_in_postgresql(backend, postgres_cluster):  # noqa: F811
    server = backend.server
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    fb = tc.forward_backward([datum(TOKENS)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert np.isfinite(fb.result().metrics["loss:sum"])
    path = tc.save_state("on-postgres").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=server.api_key)
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [path]

    with create_engine(postgres_cluster.url).connect() as conn:  # the rows are in PostgreSQL itself
        assert conn.execute(text("select count(*) from models where id = :id"), {"id": tc.model_id}).scalar() == 1
        assert conn.execute(text("select count(*) from checkpoints where tinker_path = :p"), {"p": path}).scalar() == 1
        kinds = {r[0] for r in conn.execute(text("select request_type from futures where model_id = :id"), {"id": tc.model_id})}
        assert {"CreateModel", "ForwardBackward", "OptimStep", "SaveWeights"} <= kinds


def test_the_ledger_under_concurrent_writers_holds_each_request_once(backend, postgres_cluster):  # noqa: F811
    """Three tenants train and sample at once, each from threads of its own; every tenant's ledger then holds what its
    client sent and got, row for row, and PostgreSQL's table agrees with the route."""
    server = backend.server
    steps, rows_per_step = 3, 2
    tenants = {name: server.make_key(name) for name in ("pg-ada", "pg-bo", "pg-cy")}
    sent: dict[str, Counter] = {}
    errors: list[BaseException] = []

    def work(tenant: str, key: str, trains: bool) -> None:
        try:
            client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            tokens = TOKENS[: 6 + len(tenant)]
            count = Counter()
            if trains:
                tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
                for _ in range(steps):
                    tc.forward_backward([datum(tokens)] * rows_per_step, "cross_entropy").result()
                    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                    count["train_tokens"] += rows_per_step * (len(tokens) - 1)
                    count["ForwardBackward"] += 1
                    count["OptimStep"] += 1
            else:
                sampler = client.create_sampling_client(base_model=BASE).result()
                for _ in range(steps):
                    out = sampler.sample(types.ModelInput.from_ints(tokens), 2,
                                         types.SamplingParams(max_tokens=6, temperature=1.0)).result()
                    count["sample_tokens"] += sum(len(s.tokens) for s in out.sequences)
                    count["prefill_tokens"] += len(tokens)
                    count["Sample"] += 1
            sent.setdefault(tenant, Counter()).update(count)
        except BaseException as e:  # noqa: BLE001  (the main thread reports it)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t, k, trains)) for t, k in tenants.items() for trains in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for tenant, key in tenants.items():
        rows = ledger(server, key)
        got = Counter({kind: sum(r[kind] for r in rows) for kind in ("train_tokens", "sample_tokens", "prefill_tokens")})
        got.update(Counter(r["request_type"] for r in rows if r["request_type"] in ("ForwardBackward", "OptimStep", "Sample")))
        assert +got == +sent[tenant], (tenant, got, sent[tenant])
        assert len({r["id"] for r in rows}) == len(rows)
    with create_engine(postgres_cluster.url).connect() as conn:
        by_tenant = dict(conn.execute(text("select tenant, sum(train_tokens) from usage where tenant like 'pg-%' "
                                           "group by tenant")).all())
    assert {t: int(v) for t, v in by_tenant.items()} == {t: sent[t]["train_tokens"] for t in tenants}


def test_a_restarted_backend_keeps_runs_checkpoints_ledger_and_budgets(backend):
    server = backend.server
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    for _ in range(2):
        tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    path = tc.save_state("before-restart").result().path
    headers = {"X-API-Key": server.api_key}
    put = httpx.put(f"{server.base_url}/api/v1/budgets/run/{tc.model_id}", json={"budget_usd": 5.0}, headers=headers)
    assert put.status_code == 200, put.text
    rows_before = [r for r in ledger(server, server.api_key) if r["training_run_id"] == tc.model_id]

    backend.restart()
    server = backend.server
    rest = tinker.RestClient(base_url=server.base_url, api_key=server.api_key)
    assert rest.get_training_run(tc.model_id).result().training_run_id == tc.model_id
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [path]
    assert [r for r in ledger(server, server.api_key) if r["training_run_id"] == tc.model_id] == rows_before
    budgets = httpx.get(f"{server.base_url}/api/v1/budgets", headers=headers).json()["budgets"]
    assert any(b["scope"] == "run" and b["target"] == tc.model_id and b["budget_usd"] == 5.0 for b in budgets), budgets
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    loaded = client.create_training_client_from_state(path).result()
    after = loaded.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert after == before


def test_postgresql_stopped_under_a_running_backend_is_a_clear_error_and_its_return_heals(backend, postgres_cluster):  # noqa: F811
    server = backend.server
    headers = {"X-API-Key": server.api_key}
    assert httpx.get(f"{server.base_url}/api/v1/budgets", headers=headers).status_code == 200  # a pooled connection
    ready = httpx.get(f"{server.base_url}/api/v1/readyz", timeout=60)
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == {"ok": True, "detail": "postgresql"}
    postgres_cluster.stop()
    try:
        reply = httpx.get(f"{server.base_url}/api/v1/budgets", headers=headers, timeout=60)
        assert reply.status_code == 503, reply.text
        assert "database" in reply.text.lower(), reply.text
        assert "Traceback" not in reply.text
        # Not ready while the database is down (a load balancer stops sending work), and it says which part; alive.
        ready = httpx.get(f"{server.base_url}/api/v1/readyz", timeout=60)
        assert ready.status_code == 503 and ready.json()["status"] == "not ready", ready.text
        checks = ready.json()["checks"]
        assert not checks["database"]["ok"] and checks["models"]["ok"] and checks["checkpoint_store"]["ok"], checks
        assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=60).status_code == 200
    finally:
        postgres_cluster.start()
    # The pool hands out no dead connection: the first request after PostgreSQL is back works, and so does training.
    assert httpx.get(f"{server.base_url}/api/v1/budgets", headers=headers, timeout=60).status_code == 200
    assert httpx.get(f"{server.base_url}/api/v1/readyz", timeout=60).status_code == 200
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    assert np.isfinite(tc.forward_backward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"])


def test_a_killed_backend_on_postgresql_comes_back_and_the_run_ends_bit_identical(backend):
    """test_recovery's loop (a LoRA and a full fine-tuning run, snapshots every 4 steps): once left alone, once with
    the backend killed (-9) mid forward_backward after the step-4 snapshot; the same logprobs at the end."""
    expected, _ = train(backend.server)
    restarts: list[threading.Thread] = []

    def crash(step, phase, future):
        if (step, phase) == (6, "forward_backward"):
            backend.server.process.kill()
            backend.server.process.wait()
            restarts.append(threading.Thread(target=backend.restart))
            restarts[-1].start()

    try:
        got, model_id = train(backend.server, crash)
    finally:
        for thread in restarts:
            thread.join()
    assert len(restarts) == 1
    for a, b in zip(got, expected):
        assert np.array_equal(a, b), np.abs(a - b).max()
    log = backend.server.log_path.read_text()  # rebuilt from its step-4 snapshot (and the journal since), not its creation
    assert any(f"run {model_id}:" in line and "rebuilt from its snapshot at step 4" in line for line in log.splitlines()), \
        log[-3000:]


def test_a_finished_request_s_outcome_waits_for_postgresql_to_come_back(postgres_cluster, caplog):  # noqa: F811
    """The engine finishes a request while PostgreSQL is down: its outcome and ledger row wait for the database
    (Store.finish_future) instead of being dropped, which would leave the client polling a pending future for ever."""
    from helpers import new_id, wait_until
    from kernel_backend.persistence.database import FutureRow, Store, UsageRow

    store = Store(postgres_cluster.url)
    request_id = new_id("pg-outage")
    with store.session.begin() as s:
        s.add(FutureRow(request_id=request_id, dedupe_key=request_id, tenant="pg-outage", request_type="ForwardBackward"))
    usage = UsageRow(request_id=request_id, tenant="pg-outage", request_type="ForwardBackward", base_model=BASE,
                     train_tokens=7, cost=0.0)
    postgres_cluster.stop()
    finishing = threading.Thread(target=store.finish_future, args=(request_id, "done", b"{}", "application/json", usage))
    try:
        with caplog.at_level("WARNING", logger="stepwise.database"):
            finishing.start()
            wait_until(lambda: any(request_id in r.getMessage() for r in caplog.records), timeout=60,
                       what="finish_future to meet the outage")
    finally:
        postgres_cluster.start()
    finishing.join(timeout=60)
    assert not finishing.is_alive()
    row = store.get(FutureRow, request_id)
    assert (row.status, row.result) == ("done", b"{}")
    with create_engine(postgres_cluster.url).connect() as conn:
        assert conn.execute(text("select train_tokens from usage where request_id = :r"), {"r": request_id}).all() == [(7,)]


def test_sizes_and_token_budgets_past_32_bits_fit_and_an_older_database_is_widened(postgres_cluster):  # noqa: F811
    """PostgreSQL's INTEGER is 32-bit: a checkpoint over 2 GiB (a full fine-tune) and a budget of billions of tokens
    need BIGINT; a database made when they were INTEGER is altered at start."""
    from kernel_backend.persistence.database import Store

    db = create_engine(postgres_cluster.url)
    Store(postgres_cluster.url)  # the tables exist
    with db.begin() as conn:  # as the release before migrations made them: 32-bit, and no alembic_version
        conn.execute(text("ALTER TABLE checkpoints ALTER COLUMN size_bytes TYPE INTEGER"))
        conn.execute(text("ALTER TABLE budgets ALTER COLUMN tokens TYPE INTEGER"))
        conn.execute(text("DROP TABLE alembic_version"))
    Store(postgres_cluster.url)
    with db.connect() as conn:
        kinds = dict(conn.execute(text("select table_name || '.' || column_name, data_type from information_schema.columns "
                                       "where column_name in ('size_bytes', 'tokens') and table_name in "
                                       "('checkpoints', 'budgets')")).all())
    assert kinds == {"checkpoints.size_bytes": "bigint", "budgets.tokens": "bigint"}


def test_a_backup_of_postgresql_restores_into_a_new_database_that_then_takes_new_work(backend, postgres_cluster, tmp_path):  # noqa: F811
    """`stepwise backup` of the running server's PostgreSQL, `stepwise restore` into a new database and home: the same
    ledger, a checkpoint that loads bit for bit, and new rows after the restored ones (the id sequences were moved past
    them: a new session, run and step all insert)."""
    import os
    import subprocess
    import sys

    from servers import REPO

    server = backend.server
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    path = tc.save_state("before-backup").result().path
    rows = ledger(server, server.api_key)

    with create_engine(postgres_cluster.url, isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text("CREATE DATABASE restored"))
    new_url = postgres_cluster.url.rsplit("/", 1)[0] + "/restored"
    home = tmp_path / "restored-home"
    home.mkdir()
    (home / "models").symlink_to(server.home / "models")

    def stepwise(env_home, url, *args):
        env = {**os.environ, **server.env, "STEPWISE_HOME": str(env_home), "STEPWISE_DATABASE_URL": url}
        return subprocess.run([sys.executable, "-m", "kernel_backend", *args], cwd=REPO, env=env, capture_output=True,
                              text=True)

    made = stepwise(server.home, postgres_cluster.url, "backup", "--to", str(tmp_path / "backup"))
    assert made.returncode == 0 and "postgres:***@" not in made.stdout, made.stderr
    restored = stepwise(home, new_url, "restore", "--from", str(tmp_path / "backup"))
    assert restored.returncode == 0, restored.stderr
    moved = start_server(home, env={**server.env, "STEPWISE_DATABASE_URL": new_url})
    try:
        assert ledger(moved, moved.api_key) == rows
        client = tinker.ServiceClient(base_url=moved.base_url, api_key=moved.api_key)
        loaded = client.create_training_client_from_state(path).result()
        assert loaded.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data == before
        loaded.forward_backward([datum(TOKENS)], "cross_entropy").result()  # new ledger rows, after the restored ids
        loaded.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert len(ledger(moved, moved.api_key)) > len(rows)
    finally:
        moved.stop()
