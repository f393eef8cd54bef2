"""The FastAPI application: routers, error mapping, and the service's lifetime."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernel_backend.api import tinker as tinker_routes
from kernel_backend.api import openai as openai_routes
from kernel_backend.api import usage as usage_routes
from kernel_backend.config import Settings
from kernel_backend.service import Gone, NotFound, RateLimited, Service
from kernel_backend.types import UserError


def create_app(settings: Settings | None = None, preload: list[str] | None = None) -> FastAPI:
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start(preload)
        yield
        service.stop()

    app = FastAPI(title="Stepwise training-session service", lifespan=lifespan)
    app.state.service = service
    app.include_router(tinker_routes.router)
    app.include_router(usage_routes.router)
    app.include_router(openai_routes.build_router("/oai/api/v1"))
    app.include_router(openai_routes.build_router("/v1"))

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        return JSONResponse({"detail": str(exc), "category": "user"}, status_code=400)

    @app.exception_handler(Gone)
    async def gone(request: Request, exc: Gone):
        return JSONResponse({"detail": str(exc)}, status_code=410)

    @app.exception_handler(RateLimited)
    async def rate_limited(request: Request, exc: RateLimited):
        # The SDK honours Retry-After and backs off.
        return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith(("/v1/", "/oai/")):
            return openai_routes.OpenAIError(exc.status_code, str(exc.detail)).response()
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # 422 with the fields that are wrong; the SDK raises UnprocessableEntityError with this text.
        errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        message = "invalid request: " + "; ".join(errors)
        if request.url.path.startswith(("/v1/", "/oai/")):  # OpenAI clients expect OpenAI's error shape
            param = ".".join(str(p) for p in exc.errors()[0]["loc"][1:]) if exc.errors() else None
            return openai_routes.OpenAIError(400, message, param=param).response()
        return JSONResponse({"detail": message}, status_code=422)

    return app


logging.getLogger("stepwise").setLevel(logging.INFO)
