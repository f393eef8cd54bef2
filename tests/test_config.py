"""The backend's settings (kernel_backend/config.py): each STEPWISE_* variable declared once, typed, documented.

A bad value names the variable and stops the backend before anything starts; a misspelt variable is warned about
with the name it was probably meant to be; docs/configuration.md is the declarations' own output. No model runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernel_backend import config
from kernel_backend.config import SettingError, Settings
from servers import REPO


def test_each_variable_is_read_with_its_type_and_its_defaults_hold(monkeypatch):
    for name in [n for n in os.environ if n.startswith("STEPWISE_")]:
        monkeypatch.delenv(name)
    defaults = Settings()
    assert (defaults.max_batch_tokens, defaults.session_timeout_s, defaults.share_prefixes) == (65536, 300.0, True)
    assert defaults.max_stored_mb_per_tenant == 51200  # a shared server's cap; the embedded backend has none
    monkeypatch.setenv("STEPWISE_EMBEDDED", "1")
    monkeypatch.setenv("STEPWISE_SHARE_PREFIXES", "off")
    monkeypatch.setenv("STEPWISE_WORKER_DEVICES", "cuda:0, cuda:1")
    monkeypatch.setenv("STEPWISE_HEARTBEAT_S", "0.5")
    read = Settings()
    assert read.max_stored_mb_per_tenant == 0 and read.share_prefixes is False and read.heartbeat_s == 0.5
    assert read.worker_devices == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("name, value, says", [
    ("STEPWISE_MAX_BATCH_TOKENS", "64k", "is not an integer"),
    ("STEPWISE_SESSION_TIMEOUT_S", "five minutes", "is not a number"),
    ("STEPWISE_EMBEDDED", "maybe", "is not one of 1/0, true/false"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=f"{name}='{value}' {says}"):
        Settings()


def test_the_command_line_stops_on_a_bad_value_and_warns_of_a_misspelt_variable(tmp_path):
    env = {**os.environ, "STEPWISE_HOME": str(tmp_path)}
    bad = subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "list"], cwd=REPO, capture_output=True,
                         text=True, env={**env, "STEPWISE_TOKENS_PER_MINUTE": "many"}, timeout=60)
    assert bad.returncode != 0 and "stepwise keys: STEPWISE_TOKENS_PER_MINUTE='many' is not an integer" in bad.stderr
    misspelt = subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "list"], cwd=REPO, capture_output=True,
                              text=True, env={**env, "STEPWISE_TOKEN_PER_MINUTE": "100"}, timeout=60)
    assert misspelt.returncode == 0, misspelt.stderr
    assert ("warning: STEPWISE_TOKEN_PER_MINUTE is set but nothing reads it: did you mean STEPWISE_TOKENS_PER_MINUTE?"
            in misspelt.stderr)


def test_the_configuration_page_is_the_declarations_output():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config.markdown(), "regenerate it: python -m kernel_backend.config > docs/configuration.md"
    for name in config.variables():  # every variable the backend reads has a line of its own, with what it sets
        assert f"| `{name}` |" in page
    assert all(meta["help"] for meta in config.variables().values())
