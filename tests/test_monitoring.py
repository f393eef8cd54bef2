"""What an operator watches (kernel_backend/api/monitoring.py, kernel_backend/service/metrics.py): GET /metrics read by
prometheus-client's own parser after a training loop, the request log's line per request, GET /api/v1/readyz.
(/readyz with PostgreSQL stopped: tests/test_postgres.py.)

The servers serve the tiny stand-in for the default model (tests/tiny_model.py): requests, tokens and caches are what
is counted, which any model's requests make.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from test_service_http import datum

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198]


def scrape(base_url: str, **headers) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics, parsed by prometheus-client: (name, sorted labels) -> value."""
    reply = httpx.get(f"{base_url}/metrics", headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain; version=")  # the text exposition format
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, have), v in samples.items() if n == name and set(labels.items()) <= set(have))


def test_metrics_after_a_training_loop_count_requests_tokens_latency_and_the_adapter_cache(tinker_server):
    before = scrape(tinker_server.base_url)  # from loopback: no key needed
    client = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=tinker_server.api_key)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    for _ in range(3):
        tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints(TOKENS[:6]), 2, types.SamplingParams(max_tokens=5, seed=0)).result()
    after = scrape(tinker_server.base_url)

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/api/v1/forward_backward"
    assert grew("stepwise_http_requests_total", route=route, method="POST", status="200") >= 3
    assert grew("stepwise_http_request_duration_seconds_count", route=route) >= 3
    assert grew("stepwise_http_request_duration_seconds_sum", route=route) > 0
    assert not any(n == "stepwise_http_requests_total" and re.search(r":train:\d", dict(labels)["route"])
                   for n, labels in after), "routes are counted by their template, never by their ids"
    assert grew("stepwise_tokens_total", kind="train") >= 3 * (len(TOKENS) - 1)  # a datum's input: all but the last
    assert grew("stepwise_tokens_total", kind="sample") >= 2  # two samples of up to 5 tokens
    assert grew("stepwise_jobs_total", request_type="ForwardBackward", outcome="done") >= 3
    assert grew("stepwise_jobs_total", request_type="OptimStep", outcome="done") >= 3
    assert value(after, "stepwise_workers", state="live") == 1
    assert value(after, "stepwise_adapter_cache_bytes") > 0
    assert value(after, "stepwise_adapter_cache_adapters", where="resident") >= 1
    assert ("stepwise_queue_depth", (("worker", "in-process"),)) in after

    # A bad request is counted under its status, and nothing else moves for it.
    bad = httpx.post(f"{tinker_server.base_url}/api/v1/forward_backward", json={"model_id": tc.model_id},
                     headers={"X-API-Key": tinker_server.api_key}, timeout=60)
    assert 400 <= bad.status_code < 500
    again = scrape(tinker_server.base_url)
    assert value(again, "stepwise_http_requests_total", route=route, status=str(bad.status_code)) >= 1
    assert value(again, "stepwise_tokens_total", kind="train") == value(after, "stepwise_tokens_total", kind="train")

    # The request log: a line per request at INFO, with its tenant, route template, status, time and tokens; no colour.
    log = tinker_server.log_path.read_text()
    lines = [line for line in log.splitlines() if " stepwise.requests INFO " in line and f"POST {route} 200 " in line]
    # (the shared server's log: other tests' tenants and retries too, a retry admitted once and so without tokens)
    assert all(re.search(rf"INFO \S+ POST {route} 200 [\d.]+ ms( tokens=\d+)?$", line) for line in lines), lines[:3]
    ours = [line for line in lines if f"INFO local POST {route} 200 " in line and line.endswith(f" tokens={len(TOKENS) - 1}")]
    assert len(ours) >= 3, lines[-5:]
    assert "\x1b[" not in log


def test_readyz_says_each_part_is_ready(tinker_server):
    reply = httpx.get(f"{tinker_server.base_url}/api/v1/readyz", timeout=60)
    assert reply.status_code == 200, reply.text
    checks = reply.json()["checks"]
    assert reply.json()["status"] == "ready" and all(check["ok"] for check in checks.values()), checks
    assert BASE in checks["models"]["detail"] and checks["database"]["detail"] == "sqlite"


def own_address() -> str | None:
    """This machine's address on its network (not loopback), or None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_metrics_off_loopback_need_the_operators_key_and_the_log_can_be_json_lines(tmp_path, stepwise_home, tiny_model):
    from servers import start_server
    from tiny_model import stand_in_env

    address = own_address()
    if address is None:
        pytest.skip("this machine has no address but loopback: a remote scraper cannot be played")
    (tmp_path / "models").symlink_to(stepwise_home / "models")
    server = start_server(tmp_path, host="0.0.0.0", env={**stand_in_env(tiny_model), "STEPWISE_LOG_FORMAT": "json"})
    try:
        remote = server.base_url.replace("127.0.0.1", address)
        assert httpx.get(f"{remote}/metrics", timeout=60).status_code == 401
        stranger = server.make_key("monitoring-stranger")
        assert httpx.get(f"{remote}/metrics", headers={"X-API-Key": stranger}, timeout=60).status_code == 403
        samples = scrape(remote, **{"X-API-Key": server.api_key})
        assert value(samples, "stepwise_http_requests_total", route="/metrics", status="403") == 1
        lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
        requests = [line for line in lines if line["logger"] == "stepwise.requests"]
        assert {(r["route"], r["status"], r["tenant"]) for r in requests} >= {
            ("/metrics", 401, None), ("/metrics", 403, "monitoring-stranger")}, requests
        assert all({"time", "level", "message", "method", "ms", "tokens"} <= set(r) for r in requests)
    finally:
        server.stop()


def test_the_operators_view_lists_each_tenant_as_its_own_usage_says_and_a_revoked_key_stops_at_once(tinker_server):
    """GET /api/v1/admin/tenants (and `stepwise admin tenants`): each tenant's spend and tokens equal its own
    /usage's, with its runs, checkpoints, storage, budgets and keys (made, last used, revoked)."""
    from kernel_backend.metering import format_cost
    from servers import REPO

    def rest(key, method, path, **kwargs):
        return httpx.request(method, tinker_server.base_url + path, headers={"X-API-Key": key}, timeout=60, **kwargs)

    trainer, sampler = tinker_server.make_key("ops-trainer"), tinker_server.make_key("ops-sampler")
    tc = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=trainer).create_lora_training_client(
        base_model=BASE, rank=4).result()
    for _ in range(2):
        tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.save_state("ops").result()
    other = tinker.ServiceClient(base_url=tinker_server.base_url, api_key=sampler).create_sampling_client(base_model=BASE)
    other = other.result() if hasattr(other, "result") else other
    other.sample(types.ModelInput.from_ints(TOKENS[:6]), 1, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert rest(tinker_server.api_key, "PUT", "/api/v1/budgets/tenant/ops-sampler", json={"budget_usd": 5}).status_code == 200

    assert rest(trainer, "GET", "/api/v1/admin/tenants").status_code == 403  # a tenant's key sees only itself
    view = rest(tinker_server.api_key, "GET", "/api/v1/admin/tenants").json()
    tenants = {t["tenant"]: t for t in view["tenants"]}
    for name, key in (("ops-trainer", trainer), ("ops-sampler", sampler)):
        own = rest(key, "GET", "/api/v1/usage").json()["totals"]
        row = tenants[name]
        assert row["spend_usd"] == own["cost"] and row["requests"] == own["requests"], (row, own)
        assert row["tokens"] == {kind: own[f"{kind}_tokens"] for kind in ("prefill", "sample", "train")}
        (made,) = row["keys"]
        assert made["prefix"] == key[:12] and made["last_used_at"] and made["revoked_at"] is None, made
    assert tenants["ops-trainer"]["tokens"]["train"] == 2 * (len(TOKENS) - 1)
    assert (tenants["ops-trainer"]["training_runs"], tenants["ops-trainer"]["checkpoints"]) == (1, 1)
    assert tenants["ops-trainer"]["storage_bytes"] > 0 and tenants["ops-sampler"]["tokens"]["sample"] >= 1
    assert [(b["scope"], b["budget_usd"]) for b in tenants["ops-sampler"]["budgets"]] == [("tenant", 5)]

    # The command prints the same view; a revoked key is refused at its next request, and the view says when.
    command = [sys.executable, "-m", "kernel_backend", "admin", "tenants", "--url", tinker_server.base_url,
               "--key", tinker_server.api_key]
    env = {**os.environ, **tinker_server.env, "STEPWISE_HOME": str(tinker_server.home)}
    table = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    (line,) = [row for row in table.splitlines() if row.startswith("ops-trainer ")]
    assert f" {format_cost(tenants['ops-trainer']['spend_usd'])} " in line and "1 of 1 keys live" in line, table
    subprocess.run([sys.executable, "-m", "kernel_backend", "keys", "revoke", sampler[:12]], cwd=REPO, env=env,
                   check=True, capture_output=True)
    assert rest(sampler, "GET", "/api/v1/usage").status_code == 401
    (revoked,) = next(t for t in rest(tinker_server.api_key, "GET", "/api/v1/admin/tenants").json()["tenants"]
                      if t["tenant"] == "ops-sampler")["keys"]
    assert revoked["revoked_at"] is not None
