"""Answering: server-sent events that stop the generation when the client goes away, or one
body collected while watching for the client leaving."""
from __future__ import annotations

import asyncio
import json
import logging
from json.encoder import encode_basestring
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from blockspec.server.errors import ApiError, GenerationFailed
from blockspec.server.generation import Choice, close_all
from blockspec.server.output import OutputAccumulator

logger = logging.getLogger("blockspec.server")

DONE = b"data: [DONE]\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    """Server-sent events that stop the generation when the client goes away.

    The body and a watcher for http.disconnect run side by side; whichever ends first ends
    the other, and `on_close` (the Generation's abort) always runs.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self._send_body(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, watcher):
                task.cancel()
            self.on_close()
            results = await asyncio.gather(body, watcher, return_exceptions=True)
            await self.chunks.aclose()
        if isinstance(results[0], Exception):  # a bug, not a disconnect: show it
            logger.error("a stream failed", exc_info=results[0])

    async def _send_body(self, send: Send) -> None:
        headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:  # the client went away mid-send
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(choices: list[Choice], request: Request) -> list[OutputAccumulator] | None:
    """Collect every choice's whole output, or abort them all and return None if the client
    leaves first (or one fails: then the others stop too)."""
    async def collect_all() -> list[OutputAccumulator]:
        return await asyncio.gather(*(c.generation.collect() for c in choices))

    collect = asyncio.ensure_future(collect_all())  # a task: cancelling it leaves nothing unretrieved
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server stopping)
        collect.cancel()
        close_all(choices)
        raise
    finally:
        watcher.cancel()
    if not collect.done():  # the client left first
        collect.cancel()
        close_all(choices)
        return None
    try:
        return collect.result()
    finally:
        close_all(choices)


class TextChunks:
    """The SSE bytes of one stream's chunks that differ only in one text field (a content
    delta): the reference chunk (pydantic) rendered once around a marker, then per token event
    prefix + the text escaped as pydantic escapes it + suffix — a tenth of the time of building
    and serializing the models for every event (tests/test_output.py holds the two equal)."""

    MARK = "\u0001blockspec-text\u0001"

    def __init__(self, render: Callable[[str], bytes]) -> None:
        self.prefix, mark, self.suffix = render(self.MARK).rpartition(encode_basestring(self.MARK)[1:-1].encode())
        if not mark:
            raise ValueError("the chunk does not carry its text as given")

    def __call__(self, text: str) -> bytes:
        return self.prefix + encode_basestring(text)[1:-1].encode() + self.suffix


def sse(payload: pydantic.BaseModel | dict[str, Any]) -> bytes:
    text = payload.model_dump_json() if isinstance(payload, pydantic.BaseModel) else json.dumps(payload)
    return b"data: " + text.encode() + b"\n\n"


def ended_by(exc: GenerationFailed, choices: list[Choice], finished: set[int]) -> list[int]:
    """The choices a failed stream ends with exc's finish reason (abort: the server stopped),
    before its error event: every choice not finished yet, the failed one first (merged_deltas
    closed them all), so a client of n > 1 sees each choice end. An error has no finish reason."""
    if exc.finish_reason is None:
        return []
    rest = [c.index for c in choices if c.index not in finished and c.index != exc.index]
    return [exc.index, *rest]


def with_finish_reason(event: bytes, finish_reason: str) -> dict[str, Any]:
    """An SSE chunk's payload with a finish reason outside OpenAI's set (abort: ended by us)."""
    payload = json.loads(event[len(b"data: "):])
    payload["choices"][0]["finish_reason"] = finish_reason
    return payload


async def collected(choices: list[Choice], request: Request,
                    build: Callable[[list[OutputAccumulator]], dict[str, Any]]) -> Response:
    """The non-streamed answer: every choice's whole output as `build` shapes it; a failed
    generation is its error object, a client gone first a 499 nobody reads."""
    try:
        outputs = await until_disconnect(choices, request)
    except GenerationFailed as exc:
        return ApiError(exc.status, exc.message).response()
    if outputs is None:
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(build(outputs))
