"""The logits-processing stage: what a request asks to change in the distribution before
temperature and the filters — logit_bias, min_tokens, repetition / frequency / presence
penalties (vLLM's semantics), and a grammar (structured output).

Lossless under DFlash. Every processor depends on the output so far, so a verify row is
processed with the state *after the candidate prefix* it follows:

    verify rows  y_0 … y_{T−1} of [x, d_1 … d_{T−1}]:  row i ← state after output + d_1 … d_i
    prefill row  (the first token):                      row 0 ← state after the empty output

and acceptance runs on the processed rows (greedy: argmax of the processed row; sampling: the
rejection rule with p = the processed target distribution and q = the distribution the drafts
were drawn from). Plain decoding processes its one row with the committed state, so the
processed distribution at every committed position is the same on both paths, and greedy DFlash
output equals greedy plain output with the same parameters.

State lives in one LogitsProcessor per Sequence, created and used on the engine thread only:
output token counts (a [V] tensor on the device), the prompt's token set (repetition penalty),
and the grammar matcher. It holds the *committed* state; processing a candidate prefix advances
the matcher along it and rolls it back before returning (xgrammar's matcher keeps a rollback
history), and `advance` adds what commit kept. A request without any of these never gets a
processor and pays nothing.

Order within a row (vLLM v1): logit_bias, min_tokens, then penalties, then the grammar mask.
min_tokens is not applied where the grammar has completed (there the grammar allows only the
end tokens, and masking them too would leave nothing to sample).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from blockspec.engine.request import Request

NEG_INF = float("-inf")


class LogitsProcessor:
    def __init__(self, request: Request, vocab_size: int, device: torch.device) -> None:
        params = request.params
        self.params, self.vocab_size, self.device = params, vocab_size, device
        self.num_output = 0
        self.stop_ids = torch.tensor(sorted(t for t in request.stop_ids if t < vocab_size), dtype=torch.long,
                                     device=device)
        self.bias = None
        biased = [(t, b) for t, b in params.logit_bias if t < vocab_size]
        if biased:
            ids, values = zip(*biased)
            self.bias = torch.zeros(vocab_size, device=device).index_put_(
                (torch.tensor(ids, device=device),), torch.tensor(values, device=device), accumulate=True)
        self.has_counts = bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)
        self.counts = self.prompt_seen = None
        if self.has_counts:
            self.counts = torch.zeros(vocab_size, device=device)
        if params.repetition_penalty != 1.0:
            self.prompt_seen = self._bincount(request.prompt_ids) > 0
        self.matcher = None
        if request.grammar is not None:
            self.matcher = make_matcher(request.grammar, sorted(request.grammar_stop_ids))
        self.advance(request.output_ids)            # a preempted or late-made processor catches up

    def _bincount(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([t for t in tokens if t < self.vocab_size], dtype=torch.long, device=self.device)
        return torch.bincount(ids, minlength=self.vocab_size).float()

    @torch.inference_mode()       # the counts were made inside the runner's inference mode
    def advance(self, tokens: list[int]) -> None:
        """Tokens became output (Request.commit): the committed state moves past them."""
        if not tokens:
            return
        # The one device allocation first, before any state moves: if it runs out of memory,
        # the processor is as it was (scheduler.commit undoes the request's side).
        counts = self._bincount(tokens) if self.counts is not None else None
        self.num_output += len(tokens)
        if counts is not None:
            self.counts += counts
        if self.matcher is not None:
            for token in tokens:
                if self.matcher.is_terminated():    # past the grammar's end (ignore_eos): nothing to follow
                    break
                self.matcher.accept_token(token)

    # -- processing --------------------------------------------------------------------------

    def rows(self, logits: torch.Tensor, prefix: list[int], offset: int = 0) -> torch.Tensor:
        """logits [n, V] → processed scores [n, V] (fp32, a new tensor). Row r is processed with
        the state after the committed output and prefix[: offset + r] (len(prefix) ≥ offset + n − 1).
        The committed state is unchanged afterwards."""
        scores = logits.to(torch.float32, copy=True)
        num_rows = scores.shape[0]
        completed = [False] * num_rows
        bitmask = None
        if self.matcher is not None:
            bitmask, completed = self._grammar_masks(prefix, offset, num_rows)
        if self.bias is not None:
            scores += self.bias
        if self.params.min_tokens:
            self._mask_stops(scores, offset, completed)
        if self.has_counts:
            self._penalise(scores, prefix, offset)
        if bitmask is not None:
            apply_bitmask(scores, bitmask)
        return scores

    def _mask_stops(self, scores: torch.Tensor, offset: int, completed: list[bool]) -> None:
        """Row r produces output token number num_output + offset + r (0-based)."""
        for r in range(scores.shape[0]):
            if self.num_output + offset + r < self.params.min_tokens and not completed[r]:
                scores[r, self.stop_ids] = NEG_INF

    def _penalise(self, scores: torch.Tensor, prefix: list[int], offset: int) -> None:
        num_rows = scores.shape[0]
        counts = self.counts.expand(num_rows, -1).clone()                           # [n, V]
        pairs = [(r, prefix[j]) for r in range(num_rows) for j in range(offset + r) if prefix[j] < self.vocab_size]
        if pairs:
            index = torch.tensor(pairs, dtype=torch.long, device=self.device)
            counts.index_put_((index[:, 0], index[:, 1]), torch.ones(len(pairs), device=self.device), accumulate=True)
        params = self.params
        if params.repetition_penalty != 1.0:
            seen = self.prompt_seen | (counts > 0)
            penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
            scores.copy_(torch.where(seen, penalised, scores))
        if params.frequency_penalty:
            scores -= params.frequency_penalty * counts
        if params.presence_penalty:
            scores -= params.presence_penalty * (counts > 0).float()

    def _grammar_masks(self, prefix: list[int], offset: int, num_rows: int) -> tuple[torch.Tensor, list[bool]]:
        """The matcher walked along prefix[: offset + num_rows − 1], one bitmask row per state,
        then rolled back. A token the grammar refuses ends the walk: the rows after it stay
        unmasked, and they are never used — that token has probability 0 in the processed row
        before it, so it is rejected there (greedy and sampled alike). A stop token ends it too:
        the output ends there."""
        import xgrammar
        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.vocab_size)        # all allowed
        completed = [False] * num_rows
        matcher = self.matcher
        walked, valid = 0, not matcher.is_terminated()

        def step(token: int) -> bool:
            nonlocal walked
            if not matcher.accept_token(token):
                return False
            walked += 1
            return not matcher.is_terminated()

        for token in prefix[:offset]:
            valid = valid and step(token)
        for r in range(num_rows):
            if not valid:
                break
            matcher.fill_next_token_bitmask(bitmask, r)
            completed[r] = matcher.is_completed()
            if r + 1 < num_rows:
                valid = step(prefix[offset + r])
        matcher.rollback(walked)
        return bitmask, completed

    # -- drafts --------------------------------------------------------------------------------

    def draft(self, logits: torch.Tensor, choose: Callable[[torch.Tensor], int]) -> list[int]:
        """DFlash 1 drafts for one sequence, slot by slot: slot j's logits are processed with the
        state after d_1 … d_{j−1} (so a grammar keeps every draft valid and acceptance high),
        then choose(scores [V]) picks d_j (argmax, or a draw from q = the filtered scores)."""
        drafts: list[int] = []
        for j in range(logits.shape[0]):
            drafts.append(choose(self.rows(logits[j: j + 1], drafts, offset=j)[0]))
        return drafts


def make_matcher(grammar: Any, stop_ids: list[int]) -> Any:
    import xgrammar
    return xgrammar.GrammarMatcher(grammar, override_stop_tokens=stop_ids)


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens → −inf, in place (scores [n, V] fp32; bitmask [n, ⌈V/32⌉] int32 on the
    host, xgrammar's layout: bit j of word w set ⇔ token 32·w + j allowed). Plain torch on the
    scores' device, so no kernel of xgrammar's is built or needed there."""
    words = bitmask.to(scores.device, non_blocking=True)
    shifts = torch.arange(32, device=scores.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : scores.shape[-1]]   # [n, V]
    scores.masked_fill_(~allowed, NEG_INF)
