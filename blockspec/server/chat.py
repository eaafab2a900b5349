"""POST /v1/chat/completions: the chat template in, reasoning / content / tool calls out,
streamed as chunks or one body."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from blockspec.server.errors import GenerationFailed, error_body
from blockspec.server.generation import (Choice, close_all, make_choices, meta_info, merged_deltas, submit_all,
                                         total_usage)
from blockspec.server.ids import new_id
from blockspec.server.images import check_images, with_images
from blockspec.server.logprobs import chat_logprobs
from blockspec.server.output import OutputAccumulator, OutputDelta, OutputProcessor
from blockspec.server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from blockspec.server.replies import (ChatChoiceLogprobs, ChatCompletion, ChatCompletionChoice, ChatCompletionChunk,
                                      ChatCompletionChunkChoice, ChatCompletionMessage, DeltaMessage, DeltaToolCall)
from blockspec.server.request_building import (Grammar, Prompt, chat_prompt_is_small, check_queue_room, read_body,
                                               render_chat, request_grammar)
from blockspec.server.settings import ServerSettings
from blockspec.server.state import EngineHandle, ServerState
from blockspec.server.streaming import DONE, SSEResponse, TextChunks, collected, ended_by, sse, with_finish_reason
from blockspec.tokenizer import IncrementalDetokenizer, Tokenizer


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    """From raw body to response; every refusal comes before anything is submitted."""
    arrival = time.perf_counter()               # the clock of the engine's stamps (request.py)
    body = await read_body(state, request, ChatCompletionRequest)
    llm, engine = state.ready()
    check_queue_room(engine, body.num_choices)
    check_images(llm, state.settings, body)
    prompt, grammar = await chat_prompt(llm, state.settings, body)
    response_id = new_id("chatcmpl-")
    choices = make_choices(state, llm, engine, response_id, [prompt], body, arrival,
                           lambda p: chat_processor(llm.tokenizer, p, body), grammar=grammar)
    submit_all(choices)  # last: every rejection above came before any work
    model = state.settings.model_name
    if body.stream:
        return SSEResponse(chat_chunks(choices, response_id, model, body, llm.tokenizer), lambda: close_all(choices))
    return await collected(choices, request, lambda outputs: chat_body(
        choices, outputs, response_id, model, body, llm.tokenizer).model_dump(mode="json"))


def build_chat_prompt(llm: EngineHandle, settings: ServerSettings, body: ChatCompletionRequest
                      ) -> tuple[Prompt, Grammar | None]:
    """The template rendered, its images in place, the grammar compiled: in this order, which is
    the order of their refusals (each a 400)."""
    prompt = with_images(llm, settings, body, render_chat(llm.tokenizer, body))
    return prompt, request_grammar(llm, body)


async def chat_prompt(llm: EngineHandle, settings: ServerSettings, body: ChatCompletionRequest
                      ) -> tuple[Prompt, Grammar | None]:
    """build_chat_prompt on the loop when the request is small (no thread hop: request_building's
    INLINE_PROMPT_CHARS says why), else in one worker-thread call."""
    if chat_prompt_is_small(body):
        return build_chat_prompt(llm, settings, body)
    return await asyncio.to_thread(build_chat_prompt, llm, settings, body)


def chat_processor(tokenizer: Tokenizer, prompt: Prompt, body: ChatCompletionRequest) -> OutputProcessor:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt.token_ids, skip_special_tokens=True)
    # A grammar constrains the output from its first token, so none of it is reasoning, even
    # where the template opened <think> in the prompt.
    return OutputProcessor(detokenizer, body.stop_strings, reasoning=prompt.reasoning,
                           reasoning_started_in_prompt=prompt.reasoning_started and body.grammar_request is None,
                           tools_enabled=body.tools_enabled, tools=body.tools,
                           max_tool_calls=1 if body.parallel_tool_calls is False else None)


def delta_message(delta: OutputDelta) -> DeltaMessage | None:
    calls = [DeltaToolCall.model_validate(call.to_openai()) for call in delta.tool_calls]
    if not (delta.content or delta.reasoning or calls):
        return None
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        tool_calls=calls or None)


async def chat_chunks(choices: list[Choice], response_id: str, model: str, body: ChatCompletionRequest,
                      tokenizer: Tokenizer) -> AsyncIterator[bytes]:
    created = int(time.time())                  # one time for every chunk of the stream

    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None,
              logprobs: ChatChoiceLogprobs | None = None,
              **extra: Any) -> bytes:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=response_id, model=model, created=created, choices=[choice], **extra))

    texts = {c.index: TextChunks(lambda text, index=c.index: chunk(index, DeltaMessage(content=text))) for c in choices}
    for choice in choices:
        yield chunk(choice.index, DeltaMessage(role="assistant", content=""))
    finished: set[int] = set()
    try:
        async for choice, delta in merged_deltas(choices):
            message = delta_message(delta)
            logprobs = chat_logprobs(tokenizer, delta.logprobs) if delta.logprobs else None
            cycles = choice.generation.spec_cycles.take() if choice.generation.spec_cycles else None  # playground (#26)
            if delta.content and message.reasoning_content is None and message.tool_calls is None \
                    and logprobs is None and not cycles:
                yield texts[choice.index](delta.content)
            elif message is not None or logprobs is not None or cycles:
                yield chunk(choice.index, message or DeltaMessage(content=""), logprobs=logprobs, spec_cycles=cycles)
            if delta.finish_reason is not None:
                finished.add(choice.index)
                meta = meta_info([choice]) if body.return_meta_info else None
                yield chunk(choice.index, DeltaMessage(), delta.finish_reason, meta_info=meta)
    except GenerationFailed as exc:
        for index in ended_by(exc, choices, finished):
            yield sse(with_finish_reason(chunk(index, DeltaMessage()), exc.finish_reason))
        yield sse(error_body(exc.status, exc.message))
    else:
        if body.include_usage:
            yield sse(ChatCompletionChunk(id=response_id, model=model, created=created, choices=[],
                                          usage=total_usage(choices)))
    yield DONE


def chat_choice(choice: Choice, output: OutputAccumulator, body: ChatCompletionRequest,
                tokenizer: Tokenizer) -> ChatCompletionChoice:
    calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
             for call in output.tool_calls]
    message = ChatCompletionMessage(content=output.content if output.content or not calls else None,
                                    reasoning_content=output.reasoning or None, tool_calls=calls or None)
    logprobs = chat_logprobs(tokenizer, output.logprobs) if body.num_logprobs is not None else None
    return ChatCompletionChoice(index=choice.index, message=message, finish_reason=output.finish_reason,
                                logprobs=logprobs)


def chat_body(choices: list[Choice], outputs: list[OutputAccumulator], response_id: str, model: str,
              body: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatCompletion:
    return ChatCompletion(id=response_id, model=model, usage=total_usage(choices),
                          choices=[chat_choice(c, o, body, tokenizer) for c, o in zip(choices, outputs)],
                          meta_info=meta_info(choices) if body.return_meta_info else None)
