"""The routes (one line each: the work is in chat.py, completions.py, responses.py), auth, the
OpenAI-shaped error handlers, /health, /metrics, /v1/models and the x-request-id middleware."""
from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockspec.server.chat import create_chat_completion
from blockspec.server.completions import create_completion
from blockspec.server.errors import RETRY_AFTER_S, ApiError, error_body
from blockspec.server.ids import random_hex
from blockspec.server.replies import ModelCard, ModelList
from blockspec.server.responses import create_response
from blockspec.server.settings import ServerSettings
from blockspec.server.state import ServerState, memory_info


def api_key_check(settings: ServerSettings) -> Callable[[Request], Awaitable[None]]:
    """The routes' dependency. A coroutine, though it awaits nothing: FastAPI runs a plain
    function dependency on a worker thread (anyio's pool), a hop there and back per request that
    waits for the GIL behind the engine thread and every other request (half the event loop's
    time in a burst of 64 arrivals, measured), and whose first use imports anyio's backend and
    starts the pool's threads (the first burst's)."""
    expected = settings.api_key.encode() if settings.api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("x-api-key")
        authorization = request.headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        if given is None and scheme.lower() == "bearer":
            given = token.strip()
        if given is None or not hmac.compare_digest(given.encode(), expected):
            raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>'.")
    return check


def health(state: ServerState) -> JSONResponse:
    if state.draining:  # load balancers: send nothing more here
        return JSONResponse({"status": "draining"}, 503)
    if state.engine is None:
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": str(state.load_error)}, 503)
        return JSONResponse({"status": "loading"}, 503, {"Retry-After": str(RETRY_AFTER_S)})
    llm, engine = state.ready()
    settings = state.settings
    return JSONResponse({
        "status": "ok", "model": settings.model_name, "draft": settings.draft,
        "block_size": llm.block_size if llm.speculative else None,
        "running": engine.num_running, "waiting": engine.num_waiting,
        "uptime_s": round(time.monotonic() - state.started_at, 3), "memory": memory_info(),
    })


def model_list(state: ServerState) -> ModelList:
    max_model_len = state.llm.max_model_len if state.llm is not None else None
    return ModelList(data=[ModelCard(id=state.settings.model_name, max_model_len=max_model_len)])


def add_routes(app: FastAPI, state: ServerState) -> None:
    api = APIRouter(dependencies=[Depends(api_key_check(state.settings))])

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @api.post("/v1/responses")
    async def create_responses(request: Request) -> Response:
        return await create_response(state, request)

    @api.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> JSONResponse:
        raise ApiError(404, f"No response '{response_id}': this server stores no responses.", "response_id")

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(state).model_dump(mode="json"))

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        for card in model_list(state).data:
            if model_id in (card.id, state.settings.model):
                return JSONResponse(card.model_dump(mode="json"))
        raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                            f"'{state.settings.model_name}'.", "model")

    @app.get("/health")
    async def health_route() -> JSONResponse:
        return health(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)


def add_error_handlers(app: FastAPI) -> None:
    """Every error is the OpenAI error object; invalid input is 400, never 422."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, f"Invalid request: {exc.errors()[:1]}"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = 400 if exc.status_code == 422 else exc.status_code
        return JSONResponse(error_body(status, str(exc.detail)), status, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback.
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), 500)


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's own when it sent one (as vLLM and
    OpenAI echo it), else a fresh one. Pure ASGI, so streamed bodies pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given[:256] if given else random_hex(32).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
