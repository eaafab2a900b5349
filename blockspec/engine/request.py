"""A request's state: prompt, limits, committed output, stats, abort flag.

`commit` is the single place where new tokens become output, for plain and DFlash decoding
alike: it cuts at the first stop id (kept), at max_tokens and at the context limit, and decides
the finish reason. Nothing past the cut is emitted or counted (invariants 3, 4, 8).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from blockspec.engine.logprobs import TokenLogprob
from blockspec.sampling import SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    cycles: int = 0                       # verify passes (DFlash) or decode steps (plain)
    acceptance_lengths: list[int] = field(default_factory=list)
    verify_widths: list[int] = field(default_factory=list)    # per cycle: the drafts k it verified
    draft_tokens: int = 0                 # proposed by the draft and verified
    accepted_tokens: int = 0              # drafts the target agreed with (and that were kept)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    speculative: bool = False             # DFlash decoding (acceptance lengths are verify passes)
    cached_tokens: int = 0                # prompt tokens served by the prefix cache (usage)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "acceptance_lengths": list(self.acceptance_lengths),
                "verify_widths": list(self.verify_widths),
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "cached_tokens": self.cached_tokens}


@dataclass
class TokenEvent:
    """Tokens committed by one step; finish_reason is set on the request's last event only."""
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None      # stop | length | abort | error
    stats: GenerationStats | None = None  # on the last event
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token id, when the request asked for them


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stop_ids: frozenset[int], max_model_len: int, grammar: Any = None, multimodal: Any = None) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context limit is "
                             f"{max_model_len}, which leaves no room for output")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        # ignore_eos (vLLM): the model's end tokens no longer stop it; the request's own still do.
        self.stop_ids = (frozenset() if params.ignore_eos else frozenset(stop_ids)) | frozenset(params.stop_token_ids)
        # A compiled grammar (structured.py) the output must follow; its matcher lives with the
        # engine's Sequence (engine/logits.py). The model's end tokens close it.
        self.grammar = grammar
        self.grammar_stop_ids = frozenset(stop_ids) | frozenset(params.stop_token_ids)
        self.max_model_len = max_model_len
        # Output tokens the request may produce in all (max_tokens and the context): num_allowed
        # is asked for every decoding sequence every step (the adaptive policy's caps).
        self._output_limit = min(params.max_tokens, max_model_len - len(self.prompt_ids))
        # Images (multimodal/prompt.py MultimodalPrompt): prompt_ids hold their placeholder rows;
        # prompt_keys are the ids the prefix cache keys pages by (image rows by image content).
        self.multimodal = multimodal
        self.prompt_keys = multimodal.key_tokens(self.prompt_ids) if multimodal is not None else self.prompt_ids
        self.output_ids: list[int] = []
        self.num_logprobs: int | None = None     # None: no logprobs; k: each token's and its top k
        self.output_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.arrival_time = time.monotonic()
        # Where a first token's time goes (the server's stage histograms), perf_counter seconds set
        # on the engine thread: the submit, the first admission (Sequence.admitted_at) and the
        # first token's commit.
        self.submitted_at: float | None = None
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self._abort = threading.Event()

    def abort(self) -> None:
        """Thread-safe: the decoding loop stops at its next cycle boundary."""
        self._abort.set()

    @property
    def processes_logits(self) -> bool:
        return self.grammar is not None or self.params.processes_logits

    @property
    def is_aborted(self) -> bool:
        return self._abort.is_set()

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_allowed(self) -> int:
        """Output tokens this request may still produce (max_tokens and context limit)."""
        return max(0, self._output_limit - len(self.output_ids))

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append what may be emitted of `tokens` (and their logprobs); return exactly that part."""
        allowed = tokens[: self.num_allowed]
        if not self.stop_ids.isdisjoint(allowed):      # the common case tested in one call
            for i, token in enumerate(allowed):
                if token in self.stop_ids:
                    allowed = allowed[: i + 1]
                    self.finish_reason = "stop"
                    break
        self.output_ids.extend(allowed)
        if logprobs is not None:
            self.output_logprobs.extend(logprobs[: len(allowed)])
        self.stats.output_tokens = len(self.output_ids)
        if self.finish_reason is None and self.num_allowed == 0:
            self.finish_reason = "length"
        return allowed
