"""`stepwise admin tenants`: the operator's view of a running server (GET /api/v1/admin/tenants), as a table.

The server is the one serving $STEPWISE_HOME (its runtime/backend.json names its URL and key) unless --url is given;
the key is --key, else $STEPWISE_LOCAL_KEY, else the home's own (backend.json).
"""

from __future__ import annotations

import json
import os

import httpx

from kernel_backend import runtime
from kernel_backend.metering import format_cost


def print_tenants(settings, url: str | None, key: str | None, as_json: bool = False) -> None:
    record = runtime.running_backend(settings.home) or {}
    url = url or record.get("base_url")
    key = key or os.environ.get("STEPWISE_LOCAL_KEY") or record.get("local_key")
    if not url:
        raise SystemExit(f"stepwise admin: no server serves {settings.home} (no runtime/backend.json); "
                         "give its address with --url http://HOST:PORT")
    if not key:
        raise SystemExit("stepwise admin: give the operator's key with --key (or set STEPWISE_LOCAL_KEY)")
    try:
        reply = httpx.get(f"{url.rstrip('/')}/api/v1/admin/tenants", headers={"X-API-Key": key}, timeout=60)
    except httpx.HTTPError as error:
        raise SystemExit(f"stepwise admin: {url} did not answer ({type(error).__name__}: {error})") from None
    if reply.status_code != 200:
        detail = reply.json().get("detail", reply.text) if reply.headers.get("content-type", "").startswith(
            "application/json") else reply.text
        raise SystemExit(f"stepwise admin: {url} answered {reply.status_code}: {detail}")
    report = reply.json()
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'tenant':<24} {'spent':>12} {'train tok':>11} {'sample tok':>11} {'prefill tok':>12} {'sessions':>9} "
          f"{'runs':>5} {'ckpts':>6} {'storage':>10}  budgets / keys")
    for t in report["tenants"]:
        budgets = ", ".join(f"{b['scope']} {b['state']} {b['fraction']:.0%}" for b in t["budgets"] if b) or "no budget"
        live = [k for k in t["keys"] if not k["revoked_at"]]
        used = max((k["last_used_at"] for k in t["keys"] if k["last_used_at"]), default=None)
        print(f"{t['tenant']:<24} {format_cost(t['spend_usd']):>12} {t['tokens']['train']:>11,} {t['tokens']['sample']:>11,} "
              f"{t['tokens']['prefill']:>12,} {t['active_sessions']:>4}/{t['sessions']:<4} {t['training_runs']:>5} "
              f"{t['checkpoints']:>6} {t['storage_bytes'] / 1e6:>8.1f}MB  {budgets}; {len(live)} of {len(t['keys'])} "
              f"keys live, last used {used[:16].replace('T', ' ') if used else 'never'}")
