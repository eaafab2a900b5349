"""Log-probabilities of committed tokens under the target's raw distribution (vLLM's default
`raw_logprobs`: log-softmax of the model's logits, before temperature, filters or penalties).

They come from forwards the engine runs anyway: the prefill's last row for the first token, the
verify forward's rows for the tokens a cycle commits (row i scores token i of the cycle). Plain
decoding is the same cycle with T = 1, so both paths score each token from its own position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()      # the k most likely (id, logprob), best first


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] → log-probabilities [T, V] in fp32 (taken before anything edits the logits)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Rows [≥ n, V] of log-probabilities → the n = len(token_ids) tokens' entries (row i scores
    token i), each with its num_top best alternatives. One device→host read."""
    n = len(token_ids)
    ids = torch.tensor(token_ids, device=logprobs.device).view(n, 1)
    chosen = logprobs[:n].gather(1, ids).view(n)
    if num_top > 0:
        top = logprobs[:n].topk(num_top, dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
    else:
        values, indices = [[]] * n, [[]] * n
    return [TokenLogprob(token, value, tuple(zip(top_ids, top_values)))
            for token, value, top_ids, top_values in zip(token_ids, chosen.tolist(), indices, values)]
