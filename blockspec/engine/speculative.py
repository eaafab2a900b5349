"""The DFlash cycle for one sequence (ARCHITECTURE.md §4).

    prefill:  target(prompt) → first token x, features F of the prompt
    loop:     B = min(block_size, tokens still allowed)
              h = draft([x, MASK × (B−1)], new features)      # one forward
              d = sample(lm_head(h[1:]))                      # B − 1 draft tokens, from q
              y = target([x, d])                              # one verify forward
              a = accepted prefix; bonus from y[a]            # a + 1 new tokens
              commit (cut at stop id / max_tokens / context); trim target cache to the
              committed length (recurrent layers pick their state at position a);
              features of [x, d1 … da] feed the next draft; x = bonus

B never exceeds the tokens still allowed, so the last block is shortened rather than overshot.
With B = 1 (block size 1, or one token left) nothing is drafted: the cycle is a plain step.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch
from torch import nn

from blockspec.engine.plain import prompt_tensor
from blockspec.engine.request import Request, TokenEvent
from blockspec.sampling import (SamplingParams, make_generator, probs_from_logits, rejection_sample,
                                sample, sample_from_probs)


def propose(draft: nn.Module, target: nn.Module, anchor: torch.Tensor, block_len: int, features: torch.Tensor,
            draft_cache, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft block_len − 1 tokens after `anchor` [1] → (draft ids [B − 1], q [B − 1, V] or None)."""
    block = torch.full((1, block_len), draft.mask_token_id, dtype=torch.long, device=features.device)
    block[0, :1] = anchor                                                # stays on the device
    hidden = draft(target.embed(block), features, draft_cache)          # [1, B, H]
    logits = draft.read_logits(hidden[0, 1:], target.lm_head)            # [B − 1, V]: slot i predicts d_i
    if params.is_greedy:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, params)
    return sample_from_probs(q, generator), q


def accept(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
           generator) -> tuple[int, list[int], torch.Tensor]:
    """drafts [n], target logits [n + 1, V] → (accepted a, the a + 1 new tokens, bonus [1] on the device)."""
    if params.is_greedy:
        # d_i is kept while it equals the target's argmax after [x, d_1 … d_{i−1}]; the kept
        # drafts then equal the target's own tokens, so the new tokens are target_ids[: a + 1].
        target_ids = logits.argmax(-1)                                   # [n + 1]
        a = (drafts == target_ids[:-1]).long().cumprod(0).sum()
        host = torch.cat((a[None], target_ids)).tolist()                 # the cycle's one device→host read
        num_accepted = host[0]
        return num_accepted, host[1: num_accepted + 2], target_ids[num_accepted: num_accepted + 1]
    if drafts.numel() == 0:
        bonus = int(sample(logits[0], params, generator))
        return 0, [bonus], torch.tensor([bonus], device=logits.device)
    num_accepted, bonus = rejection_sample(drafts, probs_from_logits(logits, params), q, generator)
    new_tokens = drafts[:num_accepted].tolist() + [bonus]
    return num_accepted, new_tokens, torch.tensor([bonus], device=logits.device)


@torch.inference_mode()
def generate_dflash(target: nn.Module, draft: nn.Module, request: Request,
                    block_size: int | None = None) -> Iterator[TokenEvent]:
    """Yield one TokenEvent per verify pass; the last one carries finish_reason.

    The abort flag is checked at the top of every cycle; a closed iterator runs nothing more.
    """
    block_size = min(block_size or draft.block_size, draft.block_size)
    request.stats.speculative = True
    params = request.params
    device = target.lm_head.weight.device
    generator = make_generator(params, device)
    # block size 1 never drafts: no features to capture or keep
    layer_ids = draft.target_layer_ids if block_size > 1 else ()
    target_cache = target.make_cache(request.max_model_len)
    draft_cache = draft.make_cache(request.max_model_len)

    started = time.perf_counter()
    out = target(prompt_tensor(request, device), target_cache, capture_layers=layer_ids, num_logits=1)
    anchor = sample(out.logits[:, -1], params, generator)              # x: [1], on the device
    pending = out.features                                              # [1, P, K·H], not yet in the draft
    first = anchor.tolist()                                             # waits for the prefill to finish
    request.stats.prefill_s = time.perf_counter() - started
    decode_started = time.perf_counter()
    emitted = request.commit(first)
    while not request.is_finished:
        yield TokenEvent(request.request_id, emitted)
        if request.is_aborted:
            request.finish_reason = "abort"
            yield TokenEvent(request.request_id, [], "abort", request.stats)
            return
        block_len = min(block_size, request.num_allowed)
        drafts, q = torch.empty(0, dtype=torch.long, device=device), None
        if block_len > 1:
            drafts, q = propose(draft, target, anchor, block_len, pending, draft_cache, params, generator)
            pending = None
        verify_start = target_cache.length
        out = target(torch.cat((anchor, drafts))[None], target_cache, capture_layers=layer_ids, keep_steps=True)
        a, new_tokens, anchor = accept(drafts, q, out.logits[0], params, generator)
        emitted = request.commit(new_tokens)
        # x and d_1 … d_a stay in the target cache; the bonus (the next x) is fed by the next verify.
        target_cache.trim(verify_start + a + 1)
        if layer_ids:
            committed = out.features[:, : a + 1]
            pending = committed if pending is None else torch.cat((pending, committed), dim=1)
        record_cycle(request, num_drafts=block_len - 1, num_accepted=min(a, len(emitted)), committed=len(emitted))
        request.stats.decode_s = time.perf_counter() - decode_started
    yield TokenEvent(request.request_id, emitted, request.finish_reason, request.stats)


def record_cycle(request: Request, num_drafts: int, num_accepted: int, committed: int) -> None:
    stats = request.stats
    stats.cycles += 1
    stats.draft_tokens += num_drafts
    stats.accepted_tokens += num_accepted
    stats.acceptance_lengths.append(committed)
