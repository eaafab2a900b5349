"""Plain (non-speculative) decoding: one target forward per token. The reference path."""
from __future__ import annotations

import time
from typing import Iterator

import torch
from torch import nn

from blockspec.engine.request import Request, TokenEvent
from blockspec.sampling import make_generator, sample


def prompt_tensor(request: Request, device: torch.device) -> torch.Tensor:
    return torch.tensor([request.prompt_ids], dtype=torch.long, device=device)


@torch.inference_mode()
def generate_plain(target: nn.Module, request: Request) -> Iterator[TokenEvent]:
    """Yield one TokenEvent per committed token; the last one carries finish_reason.

    The abort flag is checked before every forward, and a closed iterator runs nothing more:
    compute never outlives the request (seeds #224).
    """
    device = target.lm_head.weight.device
    generator = make_generator(request.params, device)
    cache = target.make_cache(request.max_model_len)
    started = time.perf_counter()
    logits = target(prompt_tensor(request, device), cache, num_logits=1).logits[:, -1]
    token = sample(logits, request.params, generator)                  # [1], stays on the device
    token_ids = token.tolist()                                          # waits for the prefill to finish
    request.stats.prefill_s = time.perf_counter() - started
    decode_started = time.perf_counter()
    while True:
        emitted = request.commit(token_ids)
        request.stats.decode_s = time.perf_counter() - decode_started
        if request.is_finished:
            yield TokenEvent(request.request_id, emitted, request.finish_reason, request.stats)
            return
        yield TokenEvent(request.request_id, emitted)
        if request.is_aborted:
            request.finish_reason = "abort"
            yield TokenEvent(request.request_id, [], "abort", request.stats)
            return
        logits = target(token[None], cache, num_logits=1).logits[:, -1]
        request.stats.cycles += 1
        request.stats.acceptance_lengths.append(1)   # each step commits one token
        token = sample(logits, request.params, generator)
        token_ids = token.tolist()                                      # the step's one device→host read
