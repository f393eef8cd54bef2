"""What an operator watches: a log line per request, GET /metrics (Prometheus), GET /api/v1/readyz, and every
tenant at a glance (GET /api/v1/admin/tenants).

- `RequestLog`, the app's outermost middleware: one INFO line per HTTP request on the "stepwise.requests" logger
  (tenant, method, route, status, milliseconds, tokens admitted), and the request counted in the service's metrics
  (kernel_backend/service/metrics.py) under its route's template, never its ids.
- GET /metrics: the metrics in Prometheus' text format, to loopback clients and to the operator's key.
- GET /api/v1/admin/tenants (the operator's key): each tenant's spend, tokens, sessions, runs, checkpoints, storage,
  budgets and keys (kernel_backend/service/operator.py); `stepwise admin tenants` prints it.
- GET /api/v1/readyz: 200 when the service can do work (its base models loaded, the database answering, the
  checkpoint store listing), else 503 saying which is not; GET /api/v1/healthz (api/tinker.py) only says it is alive.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from kernel_backend import runtime
from kernel_backend.api.auth import operator_of
from kernel_backend.errors import redact_paths
from kernel_backend.service import budgets, operator

log = logging.getLogger("stepwise.requests")
router = APIRouter()

READY_TIMEOUT_S = 5.0  # each readiness check: a store or database that hangs is not ready
_checks = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="stepwise-readyz")


class RequestLog:
    """Log and count each HTTP request once it is answered (a streamed answer: once its last byte is sent)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None) or "unmatched"  # the template: /api/v1/sessions/{id}
            service = scope["app"].state.service
            service.metrics.requests.labels(route, scope["method"], str(status[0])).inc()
            service.metrics.latency.labels(route).observe(seconds)
            notes = budgets.notes()
            log.info("%s %s %s %d %.1f ms%s", notes.get("tenant", "-"), scope["method"], route, status[0],
                     seconds * 1000, f" tokens={notes['tokens']}" if notes.get("tokens") else "",
                     extra={"request": {"tenant": notes.get("tenant"), "method": scope["method"], "route": route,
                                        "status": status[0], "ms": round(seconds * 1000, 1),
                                        "tokens": notes.get("tokens", 0)}})


class JsonLines(logging.Formatter):
    """STEPWISE_LOG_FORMAT=json: one JSON object a line (time, level, logger, message; a request's own fields)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "request", None) or {})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(log_format: str) -> None:
    """The server's log: plain lines (the default) or JSON lines; no colour codes either way."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


@router.get("/metrics")
def metrics(request: Request):
    """The service's metrics (kernel_backend/service/metrics.py) in Prometheus' text format: for a scraper on this
    machine, or anywhere with the operator's key."""
    if not (request.client and runtime.is_loopback(request.client.host)):
        operator_of(request)  # 401 / 403 unless the operator's credential
    return Response(generate_latest(request.app.state.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/v1/admin/tenants")
def admin_tenants(request: Request):
    """Every tenant's spend, tokens, sessions, runs, checkpoints, storage, budgets and keys (the operator's key only)."""
    operator_of(request)
    return operator.tenants_report(request.app.state.service)


@router.get("/api/v1/readyz")
def readyz(request: Request):
    """Whether this server can do work now; each check's answer, and a 503 naming what is not ready."""
    svc = request.app.state.service

    def models() -> str:
        loaded = sorted(svc.executor.facts())
        if not loaded:
            raise RuntimeError("no base model loaded yet (still starting, or no engine worker live)")
        return ", ".join(loaded)

    def database() -> str:
        with svc.store.session() as s:
            s.execute(text("SELECT 1"))
        return svc.store.engine.dialect.name

    def store() -> str:
        svc.storage.reachable()
        return str(svc.storage.url or "local folder")

    checks, ready = {}, True
    running = {name: _checks.submit(check) for name, check in (("models", models), ("database", database),
                                                                ("checkpoint_store", store))}
    for name, future in running.items():
        try:
            checks[name] = {"ok": True, "detail": redact_paths(future.result(timeout=READY_TIMEOUT_S))}
        except concurrent.futures.TimeoutError:
            ready, checks[name] = False, {"ok": False, "detail": f"no answer within {READY_TIMEOUT_S:g} s"}
        except Exception as error:  # noqa: BLE001 - what is not ready, in words
            message = redact_paths(str(error).splitlines()[0] if str(error) else type(error).__name__)
            ready, checks[name] = False, {"ok": False, "detail": f"{type(error).__name__}: {message}"}
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks}, status_code=200 if ready else 503)
