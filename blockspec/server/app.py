"""The app factory and `blockspec serve`.

A request's way through the package (ARCHITECTURE.md §1):

    routes.py → chat.py / completions.py / responses.py
      read body (413) → JSON (400) → pydantic (400, never 422) → model name (404)   request_building.py
      → queue room (503 + Retry-After, before tokenizing) → chat template / tokenize (400)
      → engine.submit → events cross from the engine thread (call_soon_threadsafe)  generation.py
      → OutputProcessor (the one output path for plain and DFlash) → SSE or one body   streaming.py

Every rejection happens before the first byte of a response. The engine thread is the only
code that touches the models; the server never does. A request that ends for any reason (stop
string, client gone, error) is aborted in the engine, which stops it within one cycle: nothing
generates for a request nobody reads (seeds #224).

`serve` loads and checks everything (model, draft, device, port) before it listens: a failure
is one line on stderr and exit 2, and nothing was announced.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
import threading
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from blockspec.server.logs import StatsLogger, configure_logging, startup_summary
from blockspec.server.routes import RequestIdMiddleware, add_error_handlers, add_routes
from blockspec.server.settings import ServerSettings
from blockspec.server.state import FINAL_WRITE_S, CountInFlight, EngineHandle, LLMFactory, ServerState

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("blockspec.server")

__all__ = ["ServerSettings", "StartupError", "create_app", "serve"]


class StartupError(ValueError):
    """serve could not start (the model, the device, the port): printed as one line, exit 2."""


def default_llm_factory(settings: ServerSettings) -> LLMFactory:
    def load() -> EngineHandle:
        from blockspec.llm import LLM
        return LLM(settings)           # the settings' engine options, as given
    return load


def create_app(llm: EngineHandle | LLMFactory | None = None, settings: ServerSettings | None = None) -> FastAPI:
    """The app. `llm`: a loaded LLM, a zero-argument factory returning one (called in a
    background thread at startup), or None to load from `settings`."""
    if settings is None:
        raise ValueError("create_app needs ServerSettings")
    if llm is None:
        factory = default_llm_factory(settings)
    elif callable(llm) and not hasattr(llm, "make_request"):
        factory = llm
    else:
        loaded = llm
        factory = lambda: loaded  # noqa: E731
    state = ServerState(settings, factory)
    state.on_loaded = lambda loaded: logger.info(startup_summary(loaded, settings))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        stats = asyncio.ensure_future(log_stats(state)) if settings.log_stats_interval > 0 else None
        yield
        if stats is not None:
            stats.cancel()
        await asyncio.to_thread(state.shutdown)  # after the drain of open requests

    app = FastAPI(title="blockspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestIdMiddleware)
    add_error_handlers(app)
    add_routes(app, state)
    # Further route modules (the playground's GET /) are added here, after the API's routes.
    if settings.ui:  # playground (#26): GET /, the chat page (blockspec/server/playground.py)
        from blockspec.server.playground import add_playground
        add_playground(app)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(CountInFlight, state=state)
    return app


async def log_stats(state: ServerState) -> None:
    """The periodic stats line, once the model is loaded (a load failure ends it)."""
    while state.engine is None and state.load_error is None:
        await asyncio.sleep(0.05)
    if state.llm is not None:
        await StatsLogger(state.llm, state.settings.log_stats_interval).run()


# ---------------------------------------------------------------------------------------------
# `blockspec serve`
# ---------------------------------------------------------------------------------------------


# The server's GIL switch interval (Python's default: 5 ms). The event loop gives the GIL up at each
# of its system calls (a socket read or write, the selector) and waits for it back until the thread
# holding it drops it, which a thread running Python (the engine's host work: all of it on a GPU,
# where the demo pair's step is < 1 ms of device time) does only when the interval runs out. So at
# 5 ms the loop made ~160 writes a second beside one busy Python thread, ~1,900 at 0.5 ms, while
# the busy thread lost nothing (measured on the dev machine's CPU: docs/ARCHITECTURE.md, "The first
# token's way through the host"); a burst's arrivals and streams are many system calls each.
SWITCH_INTERVAL_S = 0.0005


def use_switch_interval(value: str | None) -> None:
    """sys.setswitchinterval: SWITCH_INTERVAL_S, or BLOCKSPEC_SWITCH_INTERVAL's seconds (0.005,
    Python's default, for side-by-side measurements); a value that is not a positive number is
    named in a warning and the default kept (a tuning knob never stops the server)."""
    seconds = SWITCH_INTERVAL_S
    if value:
        try:
            seconds = float(value)
            if not seconds > 0:
                raise ValueError
        except ValueError:
            logger.warning("blockspec: BLOCKSPEC_SWITCH_INTERVAL=%r is not a positive number of seconds; "
                           "using %g", value, SWITCH_INTERVAL_S)
            seconds = SWITCH_INTERVAL_S
    sys.setswitchinterval(seconds)


def uvicorn_implementations(value: str | None) -> dict[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools (C; installed with blockspec, as
    with vLLM's `fastapi[standard]`) where importable, uvicorn's own choice ("auto"); with
    BLOCKSPEC_UVICORN=plain, asyncio's loop and h11 (pure Python), for side-by-side measurements.
    Any other value is named in a warning and "auto" kept."""
    if value == "plain":
        return {"loop": "asyncio", "http": "h11"}
    if value not in (None, "", "auto"):
        logger.warning("blockspec: BLOCKSPEC_UVICORN=%r is neither auto nor plain; using auto", value)
    return {"loop": "auto", "http": "auto"}


def serve(settings: ServerSettings) -> int:
    """Load, bind, then run uvicorn until SIGINT/SIGTERM; those drain open requests, then stop
    the engine. A startup failure raises StartupError before anything listens."""
    import uvicorn
    configure_logging(settings.log_level)
    use_switch_interval(os.environ.get("BLOCKSPEC_SWITCH_INTERVAL"))
    llm = load(settings)
    sock = bind(settings.host, settings.port)
    app = create_app(llm, settings)
    config = uvicorn.Config(app, log_config=None, log_level=settings.log_level, access_log=settings.access_log,
                            timeout_graceful_shutdown=FINAL_WRITE_S,
                            **uvicorn_implementations(os.environ.get("BLOCKSPEC_UVICORN")))
    server = draining_server(config, app.state.server)
    failures: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    app.state.server.on_load_error = on_load_error
    if os.environ.get("BLOCKSPEC_GC_FREEZE", "1") != "0":         # =0: not frozen (side-by-side measurements)
        freeze_startup_heap()
    logger.info("listening on http://%s:%d", settings.host, settings.port)
    with _sigterm_as_clean_exit():
        server.run(sockets=[sock])
    if failures:
        raise StartupError(str(failures[0]))
    return 0


def freeze_startup_heap() -> None:
    """What startup made (the model's modules, CUDA graphs, the tokenizer's tables: ~230k objects
    for the demo pair) is kept for the server's life: moved out of the garbage collector's reach
    (gc.freeze, as vLLM does after its engine starts), so that an oldest-generation collection
    walks what requests made since, not all of it — one such pass over the demo pair's startup
    heap held the GIL, and so the engine thread and the event loop, for 60 ms on the dev CPU."""
    gc.collect()
    gc.freeze()


def load(settings: ServerSettings) -> EngineHandle:
    """The model, draft and pools, before the port: every failure is one StartupError line
    (the traceback at --log-level debug)."""
    from blockspec.llm import LLM
    from blockspec.loader import LoadError
    try:
        return LLM(settings)
    except (LoadError, ValueError, FileNotFoundError) as exc:
        logger.debug("loading failed", exc_info=True)
        raise StartupError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - torch / CUDA refusals: one line, not a traceback
        logger.debug("loading failed", exc_info=True)
        raise StartupError(f"could not load {settings.model}: {type(exc).__name__}: {exc}") from None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so a taken port fails as one line (and before uvicorn
    announces anything)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, UnicodeError) as exc:
        raise StartupError(f"cannot listen on --host {host} --port {port} ({exc}): "
                           "choose a free port, or a host address of this machine") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def draining_server(config: uvicorn.Config, state: ServerState) -> uvicorn.Server:
    """uvicorn's Server, but the first SIGTERM/SIGINT drains (ServerState.drain) while still
    listening, so new requests get a 503 rather than a refused connection; a second signal,
    or the drain's end, stops it."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.drain_task is not None or state.loop is None or self.should_exit:
                return super().handle_exit(sig, frame)
            self._captured_signals.append(sig)
            state.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if self.drain_task is None:
                self.drain_task = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await state.drain(state.settings.shutdown_timeout)
            finally:
                self.should_exit = True

    return DrainingServer(config)


class _sigterm_as_clean_exit:
    """uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that a no-op,
    so a drained server exits 0 rather than dying by the signal."""

    def __enter__(self) -> None:
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: None)

    def __exit__(self, *_: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
