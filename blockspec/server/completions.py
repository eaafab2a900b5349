"""POST /v1/completions: raw text or token ids in (several prompts, each n times), text out,
with echo and the legacy logprobs shape."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from blockspec.server.errors import GenerationFailed, error_body
from blockspec.server.generation import Choice, close_all, make_choices, meta_info, merged_deltas, submit_all, total_usage
from blockspec.server.ids import new_id
from blockspec.server.logprobs import completion_logprobs
from blockspec.server.output import OutputAccumulator, OutputProcessor
from blockspec.server.protocol import CompletionRequest
from blockspec.server.replies import Completion, CompletionChoice
from blockspec.server.request_building import (Prompt, check_queue_room, completion_prompt, completion_prompts_are_small,
                                               read_body)
from blockspec.server.state import ServerState
from blockspec.server.streaming import DONE, SSEResponse, TextChunks, collected, ended_by, sse, with_finish_reason
from blockspec.tokenizer import IncrementalDetokenizer, Tokenizer


async def create_completion(state: ServerState, request: Request) -> Response:
    """From raw body to response; every refusal comes before anything is submitted."""
    arrival = time.perf_counter()               # the clock of the engine's stamps (request.py)
    body = await read_body(state, request, CompletionRequest)
    llm, engine = state.ready()
    check_queue_room(engine, body.num_choices * len(body.prompts))

    def build() -> list[Prompt]:
        return [completion_prompt(llm.tokenizer, p) for p in body.prompts]

    # On the loop when small (request_building.INLINE_PROMPT_CHARS says why), else a worker thread.
    prompts = build() if completion_prompts_are_small(body.prompts) else await asyncio.to_thread(build)
    response_id = new_id("cmpl-")

    def processor_for(prompt: Prompt) -> OutputProcessor:
        detokenizer = IncrementalDetokenizer(llm.tokenizer, prompt.token_ids, skip_special_tokens=True)
        return OutputProcessor(detokenizer, body.stop_strings)

    def echo_for(prompt: Prompt) -> str:
        if not body.echo:
            return ""
        return prompt.text if prompt.text is not None else llm.tokenizer.decode(prompt.token_ids)

    choices = make_choices(state, llm, engine, response_id, prompts, body, arrival, processor_for, echo_for)
    submit_all(choices)  # last: every rejection above came before any work
    model = state.settings.model_name
    if body.stream:
        return SSEResponse(completion_chunks(choices, response_id, model, body, llm.tokenizer),
                           lambda: close_all(choices))
    return await collected(choices, request, lambda outputs: completion_body(
        choices, outputs, response_id, model, body, llm.tokenizer).model_dump(mode="json"))


async def completion_chunks(choices: list[Choice], response_id: str, model: str, body: CompletionRequest,
                            tokenizer: Tokenizer) -> AsyncIterator[bytes]:
    created = int(time.time())                  # one time for every chunk of the stream

    def chunk(choice: CompletionChoice, **extra: Any) -> bytes:
        return sse(Completion(id=response_id, model=model, created=created, choices=[choice], **extra))

    texts = {c.index: TextChunks(lambda text, index=c.index: chunk(CompletionChoice(index=index, text=text)))
             for c in choices}
    offsets = {choice.index: len(choice.echo) for choice in choices}
    for choice in choices:
        if choice.echo:
            yield chunk(CompletionChoice(index=choice.index, text=choice.echo))
    finished: set[int] = set()
    try:
        async for choice, delta in merged_deltas(choices):
            logprobs = None
            if delta.logprobs:
                logprobs, offsets[choice.index] = completion_logprobs(tokenizer, delta.logprobs, offsets[choice.index])
            cycles = choice.generation.spec_cycles.take() if choice.generation.spec_cycles else None  # playground (#26)
            if delta.content and logprobs is None and not cycles:
                yield texts[choice.index](delta.content)
            elif delta.content or logprobs is not None or cycles:
                yield chunk(CompletionChoice(index=choice.index, text=delta.content, logprobs=logprobs), spec_cycles=cycles)
            if delta.finish_reason is not None:
                finished.add(choice.index)
                meta = meta_info([choice]) if body.return_meta_info else None
                yield chunk(CompletionChoice(index=choice.index, text="", finish_reason=delta.finish_reason),
                            meta_info=meta)
    except GenerationFailed as exc:
        for index in ended_by(exc, choices, finished):
            final = sse(Completion(id=response_id, model=model, created=created,
                                   choices=[CompletionChoice(index=index, text="")]))
            yield sse(with_finish_reason(final, exc.finish_reason))
        yield sse(error_body(exc.status, exc.message))
    else:
        if body.include_usage:
            yield sse(Completion(id=response_id, model=model, created=created, choices=[], usage=total_usage(choices)))
    yield DONE


def completion_choice(choice: Choice, output: OutputAccumulator, body: CompletionRequest,
                      tokenizer: Tokenizer) -> CompletionChoice:
    logprobs = None
    if body.num_logprobs is not None:
        logprobs, _ = completion_logprobs(tokenizer, output.logprobs, len(choice.echo))
    return CompletionChoice(index=choice.index, text=choice.echo + output.content,
                            finish_reason=output.finish_reason, logprobs=logprobs)


def completion_body(choices: list[Choice], outputs: list[OutputAccumulator], response_id: str, model: str,
                    body: CompletionRequest, tokenizer: Tokenizer) -> Completion:
    return Completion(id=response_id, model=model, usage=total_usage(choices),
                      choices=[completion_choice(c, o, body, tokenizer) for c, o in zip(choices, outputs)],
                      meta_info=meta_info(choices) if body.return_meta_info else None)
