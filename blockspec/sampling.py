"""Sampling parameters, logits → probabilities, and the lossless rejection rule of speculative
decoding (Leviathan et al. 2023; Chen et al. 2023), stated once here with its math."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from blockspec.kernels.readout import first_argmax


MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def check_seed(seed: int | None) -> None:
    """The one seed range check (server and CLI)."""
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}] (got {seed})")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0          # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Logits processing (engine/logits.py), vLLM's semantics; the defaults cost nothing.
    presence_penalty: float = 0.0          # − p · [token in the output]
    frequency_penalty: float = 0.0         # − f · (times the token is in the output)
    repetition_penalty: float = 1.0        # tokens of prompt + output: logit / r if > 0 else logit · r
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    min_tokens: int = 0                    # stop ids are masked until this many output tokens
    ignore_eos: bool = False               # only stop_token_ids end the output (not the model's EOS)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        check_seed(self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}]")

    @property
    def processes_logits(self) -> bool:
        """Anything that changes the distribution before temperature and the filters."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def is_greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow fp32; the distribution is argmax anyway (vLLM too).
        return self.temperature < 1e-5


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator: a fixed seed gives a fixed output, whatever ran before."""
    if params.is_greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → the distribution sampled from, after temperature/top-k/top-p/min-p (fp32).

    The same function shapes both the target's p and the draft's q, so the rejection rule
    preserves exactly this distribution.
    """
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is < top_p (the first token is always kept)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(dim=-1, keepdim=True)


def device_longs(values: list | np.ndarray, device: torch.device) -> torch.Tensor:
    """Host ints (nested lists too, or an int array) → a long tensor on the device, copied without
    waiting for the device (torch.tensor(values, device=cuda) copies from pageable memory and so
    waits for every queued kernel: the host would never run ahead of the device)."""
    is_cuda = device.type == "cuda"
    if isinstance(values, np.ndarray):        # no per-element conversion: one memcpy into pinned memory
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return host.pin_memory().to(device, non_blocking=True) if is_cuda else host.to(device)
    return torch.tensor(values, dtype=torch.long, pin_memory=is_cuda).to(device, non_blocking=is_cuda)


class Staged:
    """A device tensor's copy on its way to the host: on CUDA into pinned memory, non-blocking,
    with an event after it, so that reading it waits for this copy and not for the work enqueued
    after it (an early draft, engine/model_runner.py); on the CPU the tensor itself."""

    def __init__(self, values: torch.Tensor) -> None:
        self.event = None
        self.waited = 0.0           # seconds tolist waited for the device (the policy's pace reads it)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        self.values = values

    def tolist(self) -> list:
        if self.event is not None:
            started = time.perf_counter()
            self.event.synchronize()
            self.waited = time.perf_counter() - started
        return self.values.tolist()


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] → ids [...] (one draw per row): the exponential race argmax(p / E), E ~ Exp(1).
    That is torch.multinomial's own rule for one draw (the same ids from the same generator state,
    tests/test_acceptance.py) without its check of the probabilities, which reads the device: a
    host sync per call, per sequence per step when many sequences sample."""
    flat = probs.reshape(-1, probs.shape[-1])
    race = torch.empty_like(flat).exponential_(1.0, generator=generator)
    return first_argmax(flat / race).view(probs.shape[:-1])


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [N, V] → ids [N], row i drawn with params[i] (none greedy) and generators[i]: the
    same ids as sample(logits[i], params[i], generators[i]) row by row, in a few batched kernels
    and no host sync. Rows that share their filters are shaped together; each row's race noise
    comes from its own generator (so a row's id depends on nothing else in the batch)."""
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    if len(groups) == 1:
        probs = probs_from_logits(logits, params[0])
    else:
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for rows in groups.values():
            index = device_longs(rows, logits.device)
            probs[index] = probs_from_logits(logits[index], params[rows[0]])
    race = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        race[i].exponential_(1.0, generator=generator)
    return first_argmax(probs / race)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] → token ids [...]: argmax at temperature 0, else a seeded draw."""
    if params.is_greedy:
        return first_argmax(logits)
    return sample_from_probs(probs_from_logits(logits, params), generator)


def rejection_sample(draft_ids: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """The lossless rule for one sequence: returns (number of accepted drafts a, next token).

    draft_ids [n] were drawn from q [n, V]; p [n + 1, V] is the target's distribution at each
    draft position plus one more. Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection the token is drawn from normalize(max(p_i − q_i, 0)); if every draft
    is kept, a bonus token is drawn from p_n. Each emitted token is then distributed exactly as
    p (the residual makes up for the mass that acceptance under-covers).
    """
    n = draft_ids.shape[0]
    rows = torch.arange(n, device=p.device)
    p_d, q_d = p[rows, draft_ids], q[rows, draft_ids]
    u = torch.rand(n, device=p.device, generator=generator)
    # u · q < p  ⇔  u < p / q, without dividing by a zero q.
    rejected = (u * q_d >= p_d).nonzero()
    if rejected.numel() == 0:
        return n, int(sample_from_probs(p[n], generator))
    a = int(rejected[0, 0])
    residual = (p[a] - q[a]).clamp_min(0.0)
    total = residual.sum()
    # p == q on the support leaves no residual: then any draw from p is exact.
    dist = residual / total if total > 0 else p[a]
    return a, int(sample_from_probs(dist, generator))
