"""The served model's tokenizer without the Hugging Face Hub (kernel_backend/api/hub.py, workbench/client/tokenizers.py).

A client process on a machine with no Hub: the SDK's get_tokenizer() asks the Hub by the model's name and, without
HF_HUB_OFFLINE=1, waits ~45 s in retries. With HF_ENDPOINT=<server>/hf a plain script gets the server's own files;
a notebook connected with workbench.connect() gets them with nothing set. Each client here starts with an empty
Hugging Face cache and none of the HF_* switches, so only the server can have answered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from kernel_backend.engine import base_models

BASE = base_models.DEFAULT_MODEL
TEXT = "Zorblax's pet is named Quibbleton."

SCRIPT = """
import json, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
if sys.argv[3] == "workbench":
    import workbench
    service = workbench.connect(sys.argv[1], sys.argv[2])
sampler_tok = service.create_sampling_client(base_model=sys.argv[4]).get_tokenizer()
trainer_tok = service.create_lora_training_client(base_model=sys.argv[4], rank=4).get_tokenizer()
chat = sampler_tok.apply_chat_template([{"role": "user", "content": sys.argv[5]}], add_generation_prompt=True)
print(json.dumps({"ids": sampler_tok.encode(sys.argv[5]), "trainer_ids": trainer_tok.encode(sys.argv[5]),
                  "chat": list(chat["input_ids"])}))
"""


def client_env(tmp_path, **extra) -> dict[str, str]:
    """A client's environment with no Hugging Face setting of ours or the suite's and an empty cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "STEPWISE_"))}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "STEPWISE_HOME": str(tmp_path / "stepwise"), **extra}


def run_client(server, how: str, env: dict[str, str]) -> tuple[dict, str]:
    """What the client script printed, and its stderr."""
    run = subprocess.run([sys.executable, "-c", SCRIPT, server.base_url, server.api_key, how, BASE, TEXT],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def served_commit(server) -> str:
    reply = httpx.head(f"{server.base_url}/hf/{BASE}/resolve/main/tokenizer.json")
    assert reply.status_code == 200, reply.text
    return reply.headers["X-Repo-Commit"]


def expected(tokenizer) -> dict:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True)
    return {"ids": tokenizer.encode(TEXT), "trainer_ids": tokenizer.encode(TEXT), "chat": list(chat["input_ids"])}


def test_a_plain_sdk_script_gets_the_tokenizer_from_the_server_with_hf_endpoint(tinker_server, tokenizer, tmp_path):
    got, _ = run_client(tinker_server, "sdk", client_env(tmp_path, HF_ENDPOINT=f"{tinker_server.base_url}/hf"))
    assert got == expected(tokenizer)
    # The client's Hugging Face cache holds the server's revision: the files came from the server, not a Hub.
    repo = tmp_path / "hf" / "hub" / f"models--{BASE.replace('/', '--')}"
    assert (repo / "refs" / "main").read_text() == served_commit(tinker_server)


def test_a_notebook_connected_to_the_server_gets_the_tokenizer_from_it(tinker_server, tokenizer, tmp_path):
    got, stderr = run_client(tinker_server, "workbench", client_env(tmp_path))
    assert got == expected(tokenizer)
    # No download bars: in a notebook they would sit under the cell beside the run's own progress.
    assert "Fetching" not in stderr and "Download" not in stderr and "%|" not in stderr, stderr[-2000:]
    caches = list((tmp_path / "stepwise" / "tokenizers").glob(f"*/models--{BASE.replace('/', '--')}/refs/main"))
    assert [c.read_text() for c in caches] == [served_commit(tinker_server)]
    assert not (tmp_path / "hf" / "hub").exists()  # the Hub's own cache untouched: nothing asked it


@pytest.mark.parametrize("path, code", [
    (f"{BASE}/resolve/main/model.safetensors", "EntryNotFound"),       # weights are never served
    (f"{BASE}/resolve/main/..%2F..%2Fconfig.json", "EntryNotFound"),  # no way out of the file list
    (f"{BASE}/resolve/0123456789abcdef0123456789abcdef01234567/tokenizer.json", "RevisionNotFound"),
    ("someone/not-served/resolve/main/tokenizer.json", "RepoNotFound"),
    ("api/models/someone/not-served/revision/main", "RepoNotFound"),
])
def test_what_the_hub_route_does_not_serve_is_the_hubs_own_404(tinker_server, path, code):
    reply = httpx.get(f"{tinker_server.base_url}/hf/{path}")
    assert (reply.status_code, reply.headers.get("X-Error-Code")) == (404, code), reply.text
    assert reply.json()["error"]


def test_the_hub_route_serves_the_served_folders_files(tinker_server, tiny_model):
    folder = tiny_model  # what tinker_server serves under the default model's name
    reply = httpx.get(f"{tinker_server.base_url}/hf/{BASE}/resolve/main/tokenizer.json")
    assert reply.status_code == 200 and reply.content == (folder / "tokenizer.json").read_bytes()
    info = httpx.get(f"{tinker_server.base_url}/hf/api/models/{BASE}/revision/main").json()
    assert info["sha"] == served_commit(tinker_server)
    assert {s["rfilename"] for s in info["siblings"]} == {f for f in base_models.HUB_CACHE_FILES if (folder / f).exists()}
