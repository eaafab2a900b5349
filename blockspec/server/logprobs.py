"""Logprobs in the two OpenAI shapes: chat (`choices[].logprobs.content[]`) and the legacy
completions one (parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists).

The numbers are the engine's (engine/logprobs.py: the target's raw log-softmax); here they only
get their token texts. A token's text is its own decode, special tokens shown, as vLLM does;
-inf (never from finite logits) is written as vLLM's -9999.0, since JSON has no infinity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from blockspec.engine.logprobs import TokenLogprob
from blockspec.server.replies import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0


def finite(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else value


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
    def top(token_id: int, value: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=finite(value), bytes=list(text.encode("utf-8")))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[top(*pair) for pair in entry.top]))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob], offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for tokens whose text starts at `offset` of the choice's text; returns it
    and the offset after the last token. top_logprobs holds the top k and the chosen token (so up
    to k + 1 entries, as OpenAI documents)."""
    result = CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(finite(entry.logprob))
        result.text_offset.append(offset)
        top = {token_text(tokenizer, token_id): finite(value) for token_id, value in entry.top}
        top.setdefault(text, finite(entry.logprob))
        result.top_logprobs.append(top)
        offset += len(text)
    return result, offset
