"""The FastAPI application: routers, error mapping, the request-size limit and the service's lifetime.

Every error answer is JSON in its route's shape: `{"detail": ...}` on the Tinker and usage routes
(with `"category"` for bad input and server errors), Anthropic's `{"type": "error", "error": {...}}`
on /v1/messages, OpenAI's `{"error": {...}}` elsewhere under /v1 and /oai. A 5xx never carries exception text or a server path: it says what failed and that the
server log has the details.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernel_backend.api import monitoring
from kernel_backend.api import anthropic as anthropic_routes, budgets as budget_routes, hub as hub_routes, openai as openai_routes, rest as rest_routes, tinker as tinker_routes, usage as usage_routes
from kernel_backend.service import Service, budgets
from kernel_backend import errors
from kernel_backend.config import Settings
from kernel_backend.errors import RateLimited, redact_paths

log = logging.getLogger("stepwise.api")


def create_app(settings: Settings | None = None, preload: list[str] | None = None) -> FastAPI:
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start(preload)
        yield
        service.stop()

    max_body = service.settings.max_body_bytes

    app = FastAPI(title="Stepwise training-session service", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=max_body)
    app.add_middleware(monitoring.RequestLog)  # inside RequestKey: it reads what the request was noted with
    app.add_middleware(RequestKey)

    def error(request: Request, status: int, message: str, headers=None, category: str | None = None) -> JSONResponse:
        """An error answer in the shape of the route's protocol."""
        if anthropic_routes.is_anthropic(request.url.path):  # Anthropic's clients expect Anthropic's shape
            return anthropic_routes.error_response(status, message, headers)
        if request.url.path.startswith(("/v1/", "/oai/")):  # OpenAI clients expect OpenAI's error shape
            response = openai_routes.OpenAIError(status, message).response()
            response.headers.update(headers or {})
            return response
        body = {"detail": message} if category is None else {"detail": message, "category": category}
        return JSONResponse(body, status_code=status, headers=headers)

    def too_large(request: Request) -> JSONResponse:
        return error(request, 413, f"request body is over this server's limit of {max_body} bytes "
                                   "(STEPWISE_MAX_BODY_BYTES); send the batch in smaller requests")

    include_routes(app)

    # The errors callers are answered with (kernel_backend/errors.py): each its status and category.
    async def caller_error(request: Request, exc: Exception):
        status, category = next(errors.HTTP[kind] for kind in type(exc).__mro__ if kind in errors.HTTP)
        # The SDK honours Retry-After and backs off; no client retries a 402 (our client/config tells the tinker
        # SDK not to pause on it either).
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, RateLimited) else None
        return error(request, status, redact_paths(str(exc)), headers=headers, category=category)

    for kind in errors.HTTP:
        app.add_exception_handler(kind, caller_error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 413:
            return too_large(request)
        return error(request, exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(OperationalError)
    async def database_unreachable(request: Request, exc: OperationalError):
        # PostgreSQL down or restarting (SQLite: locked past its busy timeout): nothing was done, the request may be
        # sent again; the SDK retries a 503 by itself. The pool's pre-ping reconnects once the database is back.
        log.warning("%s %s: the database is unreachable: %s", request.method, request.url.path,
                    redact_paths(str(exc.orig)).splitlines()[0] if exc.orig else type(exc).__name__)
        return error(request, 503, "the service's database is unreachable just now (STEPWISE_DATABASE_URL); nothing "
                                   "was done: send the request again in a few seconds", headers={"Retry-After": "5"},
                     category="server")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        # A bug on our side. The traceback goes to the log; the client gets JSON without internals.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error(request, 500, f"internal server error ({type(exc).__name__}) while handling {request.url.path}; "
                                   "the server log has the details", category="server")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # 422 with the fields that are wrong; the SDK raises UnprocessableEntityError with this text.
        errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        message = "invalid request: " + "; ".join(errors)
        if anthropic_routes.is_anthropic(request.url.path):
            return anthropic_routes.error_response(400, message)
        if request.url.path.startswith(("/v1/", "/oai/")):  # OpenAI clients expect OpenAI's error shape
            param = ".".join(str(p) for p in exc.errors()[0]["loc"][1:]) if exc.errors() else None
            return openai_routes.OpenAIError(400, message, param=param).response()
        return JSONResponse({"detail": message}, status_code=422)

    return app


def include_routes(app: FastAPI) -> None:
    """Every route the server answers (create_app's app; tests build the OpenAPI schema from it alone)."""
    app.include_router(tinker_routes.router)
    app.include_router(rest_routes.router)
    app.include_router(usage_routes.router)
    app.include_router(budget_routes.router)
    app.include_router(openai_routes.build_router("/oai/api/v1"))
    app.include_router(openai_routes.build_router("/v1"))
    app.include_router(anthropic_routes.router)
    app.include_router(hub_routes.router)  # the served models' tokenizers for clients without the Hub
    app.include_router(monitoring.router)  # /metrics and /api/v1/readyz


class RequestKey:
    """A holder, per request, for the API key that sent it (budgets.request_key): the auth dependency fills it in,
    and the work the request queues is charged to that key's budget."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            budgets.new_request_holder()
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse a request body over `max_bytes` (413) before it is read: at once when its Content-Length
    says so, else as soon as the streamed bytes pass the limit. 0 means no limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = StarletteHTTPException(413)  # answered by the app's handler, in the route's error shape
        received = 0

        async def limited_receive():
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, limited_receive, send)


logging.getLogger("stepwise").setLevel(logging.INFO)
