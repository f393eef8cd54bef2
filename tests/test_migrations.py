"""Schema migrations (kernel_backend/persistence/migrations): a database made by the release before migrations
(tests/data/release_before_migrations_database.py, that release's database.py verbatim) opens in today's server with
its rows, gains today's columns and is stamped with the newest revision; a new database is made and stamped; one
already stamped is upgraded in place and keeps its rows.

The server serves the tiny stand-in for the default model (tests/tiny_model.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys

import httpx
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from kernel_backend.persistence import migrations
from kernel_backend.persistence.database import Store
from servers import REPO, start_server
from tiny_model import stand_in_env

OLD = REPO / "tests" / "data" / "release_before_migrations_database.py"
KEY = "tml-made-by-the-release-before-migrations"


def head() -> str:
    return ScriptDirectory(str(migrations.HERE)).get_current_head()


def stamped(url: str) -> list[str]:
    with create_engine(url).connect() as conn:
        return [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]


@pytest.fixture
def old_release():
    spec = importlib.util.spec_from_file_location("release_before_migrations_database", OLD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass-like models look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_a_database_of_the_release_before_migrations_opens_in_todays_server(tmp_path, stepwise_home, tiny_model,
                                                                           old_release):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(stepwise_home / "models")
    url = f"sqlite:///{home / 'stepwise.db'}"
    old = old_release.Store(url)
    old.add(old_release.ApiKeyRow(key_hash=hashlib.sha256(KEY.encode()).hexdigest(), prefix=KEY[:12], tenant="kept"))
    assert "last_used_at" not in {c["name"] for c in inspect(old.engine).get_columns("api_keys")}
    assert "alembic_version" not in inspect(old.engine).get_table_names()
    old.engine.dispose()

    server = start_server(home, env=stand_in_env(tiny_model))
    try:
        reply = httpx.get(f"{server.base_url}/api/v1/usage", headers={"X-API-Key": KEY}, timeout=60)
        assert reply.status_code == 200, reply.text  # the old release's key, in today's server
        view = httpx.get(f"{server.base_url}/api/v1/admin/tenants", headers={"X-API-Key": server.api_key},
                         timeout=60).json()
        (kept,) = [t for t in view["tenants"] if t["tenant"] == "kept"]
        assert kept["keys"][0]["last_used_at"]  # today's column, on the old table
    finally:
        server.stop()
    assert stamped(url) == [head()]


def test_a_new_database_is_stamped_and_a_stamped_one_upgrades_in_place(tmp_path):
    url = f"sqlite:///{tmp_path / 'stepwise.db'}"
    store = Store(url)
    assert stamped(url) == [head()]
    with store.engine.begin() as conn:
        conn.execute(text("INSERT INTO api_keys (key_hash, prefix, tenant, created_at) "
                          "VALUES ('h', 'tml-x', 'kept', CURRENT_TIMESTAMP)"))
    store.engine.dispose()
    again = Store(url)  # an `alembic upgrade head` that has nothing to do
    with again.engine.connect() as conn:
        assert conn.execute(text("SELECT tenant FROM api_keys")).scalars().all() == ["kept"]
    assert stamped(url) == [head()]
