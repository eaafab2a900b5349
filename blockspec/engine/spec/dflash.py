"""The DFlash cycle for a batch of B sequences (ARCHITECTURE.md §4), as three steps:

    propose: h = draft([x, MASK × (T − 1)])      one forward for all B blocks, non-causal within
             d[1..T−1] = sample(lm_head(h[1:]))  each, read out by the target's head (DFlash 2:
                                                 a walk over the selector's candidates)
    verify:  y = target([x, d1..dT−1])           one forward for all B blocks (model_runner)
    accept:  a_b = accepted prefix of sequence b  greedy: d_i == argmax y_{i−1}; sampling: the
             new tokens = x's successors d1..da, bonus   rejection rule; ragged across the batch
                                                 (judge: the device's part, before any read)

Every sequence keeps its own sampling parameters and generator, so its tokens are the same
whatever else runs in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.engine.sequence import Sequence
from blockspec.kernels.readout import argmax_confidence, draft_confidence, first_argmax
from blockspec.models.dflash2 import CandidateWalk
from blockspec.sampling import (Staged, device_longs, probs_from_logits, rejection_sample, sample_from_probs,
                               sample_rows)


@dataclass
class DraftReadout:
    """DFlash 1's draft output as the propose forward returns it (inside its graph): the logits
    [B, T − 1, V], their argmax `drafts` (every greedy sequence's; CandidateWalk.drafts is DFlash
    2's) and, for the adaptive policy, the draft's probability of that argmax (`draft_confidence`). Computed with the forward, they
    cost no launches between the draft and the verify; rows that sample or process their logits
    are drawn from the logits on the host side as before."""
    logits: torch.Tensor
    drafts: torch.Tensor
    confidence: torch.Tensor | None = None

    @staticmethod
    def of(logits: torch.Tensor, confidence: bool) -> "DraftReadout":
        """On CUDA one pass over the logits for both (kernels/readout.py); torch's ops elsewhere."""
        return DraftReadout(logits, *argmax_confidence(logits, confidence))


@dataclass
class Proposal:
    drafts: torch.Tensor                       # [B, T − 1] on the device
    probs: list[torch.Tensor | None]           # per sequence: q [T − 1, V] when it samples, else None
    confidence: torch.Tensor | None = None     # [B, T − 1]: the draft's own probability of each draft
    drafted: list[int] | None = None           # the widths drafted for, where the verify's were refined after
    observed: bool = True                      # whether the policy learns from this step (Speculation.step_observes)


def propose(out: torch.Tensor | DraftReadout | CandidateWalk, seqs: list[Sequence],
            confidence: bool = False) -> Proposal:
    """The draft's output for the (possibly padded) batch → the drafts of its first len(seqs) rows;
    with `confidence`, also the draft's probability of each (adaptive speculation, policy.py)."""
    if isinstance(out, CandidateWalk):
        walk = out.rows(len(seqs))
        proposal = walk_drafts(walk, seqs)
        if confidence:
            proposal.confidence = with_sampled(walk_confidence(walk, proposal.drafts), proposal)
        return proposal
    if isinstance(out, torch.Tensor):
        out = DraftReadout.of(out, confidence)
    n = len(seqs)
    logits = out.logits[:n]
    # Clones: a graph's readout lives in buffers the next draft forward overwrites.
    proposal = sample_drafts(logits, seqs, greedy=out.drafts[:n].clone())
    if confidence:
        chosen = out.confidence[:n] if out.confidence is not None else draft_confidence(logits, proposal.drafts)
        # Rows whose drafts are not the argmax: a processed greedy row gets the draft's
        # probability of what it chose, a sampled one q(d) (with_sampled).
        if any(seq.logits_processor is not None or q is not None for seq, q in zip(seqs, proposal.probs)):
            chosen = chosen.clone()
            for b, seq in enumerate(seqs):
                if seq.logits_processor is not None and proposal.probs[b] is None:
                    chosen[b] = draft_confidence(logits[b: b + 1], proposal.drafts[b: b + 1])[0].to(chosen.dtype)
        proposal.confidence = with_sampled(chosen, proposal)
    return proposal


def walk_confidence(walk: CandidateWalk, drafts: torch.Tensor) -> torch.Tensor:
    """DFlash 2: the walk's own probability of each step, softmax over the k edges leaving the
    candidate chosen one slot earlier (row 0 for the first slot), at the candidate taken; a draft
    outside the candidates (a processor's fallback) gets the score of candidate 0 (low, usually)."""
    taken = (walk.candidate_ids == drafts.unsqueeze(-1)).float().argmax(-1)                 # [B, L]
    previous = torch.cat((torch.zeros_like(taken[:, :1]), taken[:, :-1]), dim=1)
    index = previous[..., None, None].expand(*previous.shape, 1, walk.edge_scores.shape[-1])
    rows = walk.edge_scores.gather(2, index).squeeze(2)                                       # [B, L, k]
    return torch.softmax(rows.float(), dim=-1).gather(-1, taken.unsqueeze(-1)).squeeze(-1)


def with_sampled(confidence: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """A sequence that drew its drafts from q reports q_i(d_i) (what its acceptance depends on)."""
    for b, q in enumerate(proposal.probs):
        if q is not None:
            confidence[b] = q.gather(-1, proposal.drafts[b].unsqueeze(-1)).squeeze(-1).to(confidence.dtype)
    return confidence


def sample_drafts(logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None = None) -> Proposal:
    """Draft logits [B, T − 1, V] → drafts: argmax for greedy sequences (`greedy`, when the
    forward already took it: a tensor this may overwrite), a seeded draw from q (the same
    filters as the target's p) for sampling ones."""
    drafts = first_argmax(logits) if greedy is None else greedy
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for b, seq in enumerate(seqs):
        params = seq.request.params
        if seq.logits_processor is not None:
            drafts[b], probs[b] = processed_drafts(seq, logits[b])
        elif not params.is_greedy:
            probs[b] = probs_from_logits(logits[b], params)
            drafts[b] = sample_from_probs(probs[b], seq.generator)
    return Proposal(drafts, probs)


def processed_drafts(seq: Sequence, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence with a logits processor (engine/logits.py): slot j is processed with the
    state after d_1 … d_{j−1}, then d_j = argmax, or a draw from q_j = the filters on the
    processed slot (q is what rejection_sample must see: the drafts were drawn from it)."""
    params = seq.request.params
    q_rows: list[torch.Tensor] = []

    def choose(scores: torch.Tensor) -> int:
        if params.is_greedy:
            return int(scores.argmax())
        q_rows.append(probs_from_logits(scores, params))
        return int(sample_from_probs(q_rows[-1], seq.generator))

    drafts = seq.logits_processor.draft(logits, choose)
    return torch.tensor(drafts, dtype=torch.long, device=logits.device), (torch.stack(q_rows) if q_rows else None)


def walk_drafts(walk: CandidateWalk, seqs: list[Sequence]) -> Proposal:
    """DFlash 2: greedy sequences take the greedy walk (already done on the device for every
    row); a sampling sequence walks again, drawing each slot from its own generator."""
    drafts = walk.drafts.clone()
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for b, seq in enumerate(seqs):
        params = seq.request.params
        if seq.logits_processor is not None:
            drafts[b], probs[b] = processed_walk(walk, b, seq)
        elif not params.is_greedy:
            drafts[b], probs[b] = sample_walk(walk, b, params.temperature, seq.generator)
    return Proposal(drafts, probs)


def processed_walk(walk: CandidateWalk, row: int, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash 2 for a sequence with a logits processor: the walk again, slot by slot, over the
    candidates its processed state allows (the state after the drafts chosen so far: a grammar,
    min_tokens). Greedy takes the best allowed edge; sampling draws from q_i = softmax(allowed
    edges / temperature), zero elsewhere. When none of the k candidates is allowed, the draft is
    the state's best allowed token and q_i is one-hot on it — still the distribution it was drawn
    from, so the rejection rule stays exact. The next slot's row is the chosen candidate's (row 0
    after a fallback token, as for the anchor)."""
    params, processor = seq.request.params, seq.logits_processor
    ids, scores = walk.candidate_ids[row], walk.edge_scores[row]                 # [L, k], [L, k, k]
    drafts: list[int] = []
    q_rows: list[torch.Tensor] = []
    chosen = 0
    for i in range(ids.shape[0]):
        state = processor.rows(torch.zeros(1, walk.vocab_size, device=ids.device), drafts, offset=i)[0]   # 0 / −inf
        edges = scores[i, chosen].masked_fill(torch.isinf(state[ids[i]]), float("-inf"))
        q = torch.zeros(walk.vocab_size, device=ids.device)
        if torch.isinf(edges).all():
            chosen, token = 0, int(state.argmax())
            q[token] = 1.0
        elif params.is_greedy:
            chosen = int(edges.argmax())
            token = int(ids[i, chosen])
        else:
            q_k = torch.softmax(edges / params.temperature, dim=-1)
            chosen = int(torch.multinomial(q_k, 1, generator=seq.generator))
            token = int(ids[i, chosen])
            q.scatter_(0, ids[i], q_k)
        drafts.append(token)
        q_rows.append(q)
    probs = None if params.is_greedy else torch.stack(q_rows)
    return torch.tensor(drafts, dtype=torch.long, device=ids.device), probs


def sample_walk(walk: CandidateWalk, row: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's sampled walk → (drafts [L], q [L, V]).

    At slot i, given the candidate index p chosen at slot i − 1 (row 0 for the first slot, whose
    predecessor is the anchor), q_i = softmax(edge_scores[i, p] / temperature) over the k
    candidates (z-lab's rule) and zero elsewhere. The drafts are drawn from exactly these q_i,
    so rejection_sample with this q keeps the target's distribution: a token outside the
    candidates has q = 0 and comes only from the residual max(p − q, 0)."""
    ids, scores = walk.candidate_ids[row], walk.edge_scores[row]                 # [L, k], [L, k, k]
    chosen = torch.zeros(1, dtype=torch.long, device=ids.device)
    q_rows, path = [], []
    for i in range(ids.shape[0]):
        q = torch.softmax(scores[i].index_select(0, chosen)[0] / temperature, dim=-1)   # [k]
        chosen = torch.multinomial(q, 1, generator=generator)
        q_rows.append(q)
        path.append(chosen)
    q_full = torch.zeros(ids.shape[0], walk.vocab_size, device=ids.device).scatter_(1, ids, torch.stack(q_rows))
    return ids.gather(1, torch.stack(path)).view(-1), q_full


def process_verify(seqs: list[Sequence], proposal: Proposal | None, logits: torch.Tensor,
                   num_drafts: list[int] | None = None) -> dict[int, torch.Tensor]:
    """Target logits [B, T, V] → the processed rows [k_b + 1, V] of each sequence with a logits
    processor (row i with the state after d_1 … d_i; k_b = num_drafts[b], T − 1 when not given);
    the others are not touched."""
    processed = {}
    for b, seq in enumerate(seqs):
        if seq.logits_processor is not None:
            k = logits.shape[1] - 1 if num_drafts is None else num_drafts[b]
            drafts = proposal.drafts[b, :k].tolist() if proposal is not None else []
            processed[b] = seq.logits_processor.rows(logits[b, : k + 1], drafts)
    return processed


@dataclass
class Verdict:
    """A verify's outcome on the device, before any host read (`judge`): accepted [B, 1], the
    greedy rule's count (a sampling sequence that verifies drafts is decided on the host, by
    accept_sampled), and the target's tokens [B, T] (row 0 of a sampling sequence without
    drafts holds its draw). `staged`: their host copy [B, 1 + T], on its way (`stage`): the
    runner starts it before it launches anything the read should not wait for."""
    accepted: torch.Tensor
    target_ids: torch.Tensor
    staged: Staged | None = None

    def stage(self) -> "Verdict":
        self.staged = Staged(torch.cat((self.accepted, self.target_ids), dim=1))
        return self

    def host_rows(self) -> list[list[int]]:
        """[B][1 + T]: a_b, then the target's tokens."""
        return (self.staged or Staged(torch.cat((self.accepted, self.target_ids), dim=1))).tolist()


def judge(seqs: list[Sequence], proposal: Proposal | None, logits: torch.Tensor,
          processed: dict[int, torch.Tensor] | None = None, num_drafts: list[int] | None = None) -> Verdict:
    """Target logits [B, T, V] → the verify's Verdict, device ops only (see accept). Every
    sampling sequence that verifies no draft draws its token here (draw_plain)."""
    processed = processed or {}
    num_seqs, width = logits.shape[:2]
    num_drafts = [width - 1] * num_seqs if num_drafts is None else num_drafts
    target_ids = first_argmax(logits)                                           # [B, T]
    for b, scores in processed.items():
        target_ids[b, : scores.shape[0]] = first_argmax(scores)
    if proposal is None or width == 1:
        accepted = torch.zeros(num_seqs, 1, dtype=torch.long, device=logits.device)
    else:
        agree = (proposal.drafts[:, : width - 1] == target_ids[:, :-1]).long()
        if any(k != width - 1 for k in num_drafts):         # a draft past k_b was never verified
            verified = torch.arange(width - 1, device=logits.device)[None] < device_longs(
                num_drafts, logits.device)[:, None]
            agree = agree * verified
        accepted = agree.cumprod(1).sum(1, keepdim=True)                        # [B, 1]
    drawn = [b for b, seq in enumerate(seqs)
             if not seq.request.params.is_greedy and (proposal is None or num_drafts[b] == 0)]
    if drawn:
        draw_plain(seqs, drawn, logits, processed, target_ids)
    return Verdict(accepted, target_ids)


def accept(seqs: list[Sequence], proposal: Proposal | None, logits: torch.Tensor,
           processed: dict[int, torch.Tensor] | None = None, num_drafts: list[int] | None = None,
           verdict: Verdict | None = None) -> tuple[list[int], list[list[int]]]:
    """Target logits [B, T, V] → (accepted drafts a_b, the a_b + 1 new tokens of each sequence).
    num_drafts: k_b, the drafts sequence b verified (rows 0 … k_b of its logits are real);
    a_b ≤ k_b always (T − 1 each when not given). verdict: `judge`'s, made (and staged) when
    the verify was launched; judged now when not given.

    Greedy: d_i is kept while it equals the target's argmax after [x, d_1 … d_{i−1}]; the kept
    drafts then equal the target's own tokens, so the new tokens are target_ids[: a + 1].
    One device→host read serves every greedy sequence of the batch and every sampling one that
    verifies no draft (drawn together first, draw_plain). processed: sequence row →
    its processed rows [T, V] (process_verify), which replace its logits for both rules.

    Lossless for any k (adaptive speculation, issue 21): the prefix a verify of d_1 … d_k accepts
    is the full verify's accepted prefix cut at k, and row a's token (argmax, or the residual / p
    draw, the bonus from p_k after k kept drafts) depends only on [x, d_1 … d_a]; rows past k
    are never read."""
    processed = processed or {}
    num_drafts = [logits.shape[1] - 1] * len(seqs) if num_drafts is None else num_drafts
    if verdict is None:
        verdict = judge(seqs, proposal, logits, processed, num_drafts)
    host = verdict.host_rows()
    num_accepted = [row[0] for row in host]
    new_tokens = [row[1: row[0] + 2] for row in host]
    for b, seq in enumerate(seqs):
        if not seq.request.params.is_greedy and proposal is not None and num_drafts[b] > 0:
            k = num_drafts[b]
            num_accepted[b], new_tokens[b] = accept_sampled(seqs[b], proposal, b, processed.get(b, logits[b, : k + 1]),
                                                            k)
    return num_accepted, new_tokens


def draw_plain(seqs: list[Sequence], drawn: list[int], logits: torch.Tensor, processed: dict[int, torch.Tensor],
               target_ids: torch.Tensor) -> None:
    """The sampling sequences that verify no draft (plain decoding, or k_b = 0) draw their one
    token from row 0 together (sampling.sample_rows: what accept_sampled draws for each, with
    no host read per sequence); it goes where the one host read of the batch finds it,
    target_ids[b, 0]."""
    every = len(drawn) == len(seqs)
    index = None if every else device_longs(drawn, logits.device)
    rows = logits[:, 0] if every else logits[index, 0]
    if any(b in processed for b in drawn):
        rows = rows.clone()
        for i, b in enumerate(drawn):
            if b in processed:
                rows[i] = processed[b][0]
    tokens = sample_rows(rows, [seqs[b].request.params for b in drawn], [seqs[b].generator for b in drawn])
    if every:
        target_ids[:, 0] = tokens
    else:
        target_ids[index, 0] = tokens


def accept_sampled(seq: Sequence, proposal: Proposal | None, row: int, logits: torch.Tensor,
                   num_drafts: int) -> tuple[int, list[int]]:
    """The rejection rule (sampling.rejection_sample) for one sampling sequence over its k
    verified drafts; logits [k + 1, V]."""
    p = probs_from_logits(logits, seq.request.params)
    if proposal is None or num_drafts == 0:
        return 0, [int(sample_from_probs(p[0], seq.generator))]
    drafts = proposal.drafts[row, :num_drafts]
    q = proposal.probs[row]
    num_accepted, bonus = rejection_sample(drafts, p, q[:num_drafts] if q is not None else None, seq.generator)
    return num_accepted, drafts[:num_accepted].tolist() + [bonus]
