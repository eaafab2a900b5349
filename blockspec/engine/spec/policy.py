"""Adaptive speculation (issues 21, 31): how many of its drafts each sequence verifies this step.

Verifying d_1 … d_k (k ∈ 0 … T − 1; k = 0 is a plain decode row) commits the accepted prefix
plus the target's own token. If p_i is the chance that d_i is accepted given d_1 … d_{i−1} were,
slot k of sequence r survives with S(r, k) = Π_{i ≤ k} p_i and the expected committed tokens are

    E(k) = 1 + Σ_{j ≤ k} S(r, j)                                        (expected_committed)

S never grows with k, so the best B slots of the whole batch (a global top-B by S) are always a
prefix of each sequence's block. The allocation (allocate, vLLM's DSpark rule): over every B,

    B* = argmax_B (N + Σ_{top B} S) / (draft_ms(sequences that draft) + target_ms(N + B) + host)

N sequences, each one plain row plus its chosen slots; the draft's blocks are W positions, the
narrowest of the table's widths holding the widest k + 1, and the argmax runs at each W (caps cut
to W − 1, the draft priced at W). A sequence left at k = 0 does not draft:
the draft forward covers only the others, so a draft that is not paying for a sequence costs it
nothing (its committed positions still reach the draft's context: every verified row's features
are appended by the target forward). The table (CostTable, measured at startup through the
graph dispatcher's hook, costs.py) prices each forward at the size it runs as: a graph's
bucket when the forwards are padded to captured shapes, else interpolated between points.

The widths are decided on the host before the step (Scheduler.verify_widths asks), from what
the previous steps observed: no device→host read between the draft and the verify, so the
verify's shape (its graph) is known when the step is scheduled. The p_i come from confidences:
the draft's own probability of each drafted token (DFlash 1: softmax of its logits at d_i, or
q_i(d_i) when it samples; DFlash 2: the walk's softmax over the candidate edges), calibrated
online (Calibration: a per-(slot group, confidence bin) estimate of P(accept | confidence),
engine-wide with a prior at the bin's centre, each sequence's own counts shrunk toward it) and
averaged per sequence over its recent cycles (Calibration.predicted).

Everything here is host arithmetic on small tensors: no model, no device.
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np
import torch

NUM_BINS = 10                       # confidence bins on [0, 1]
PRIOR_STRENGTH = 4.0                # pseudo-observations behind each prior
SEQUENCE_DECAY = 0.98               # a sequence's old observations fade (its text changes)
SLOT_EMA = 0.3                      # weight of the newest cycle in a sequence's per-slot prediction
ENGINE_EMA = 0.05                   # weight of each cycle in the engine-wide one a new sequence starts from
IDLE_MEMORY = 0.9                   # per step a sequence spends at k = 0: weight its recent prediction keeps
MAX_BACKOFF = 8                     # a sequence's relaxation slows 2× with each failed return, up to 2^this
# A sequence's settled prediction (Calibration.relax) is the average of its cycles with the
# engine's recent one as SETTLED_PRIOR cycles' worth of prior, a running average past SETTLED_MEMORY cycles.
SETTLED_PRIOR = 4.0
SETTLED_MEMORY = 16


def expected_committed(probs: Seq[float], k: int) -> float:
    """1 + Σ_{j ≤ k} Π_{i ≤ j} p_i: the expected tokens committed by verifying d_1 … d_k."""
    total, run = 1.0, 1.0
    for p in probs[:k]:
        run *= p
        total += run
    return total


def slot_group(slot: int) -> int:
    """Draft slot 0, 1 … (d_1, d_2 …) → 0 for d_1, 1 for d_2–d_3, 2 for d_4–d_7, 3 beyond:
    acceptance at equal confidence drifts with the distance from the anchor."""
    return min(3, int(math.log2(slot + 1)))


def clamp(x: np.ndarray, lo, hi) -> np.ndarray:
    """np.clip, without its per-call overhead (a tenth of the policy's host time on small arrays)."""
    return np.minimum(np.maximum(x, lo), hi)


def keeps_whole_block(seq) -> bool:
    """A sampling request with an explicit seed verifies its whole block whatever the load: its
    random draws (and so its output) then do not depend on what else runs (invariant 1)."""
    params = seq.request.params
    return not params.is_greedy and params.seed is not None


def confidence_bin(confidence: float) -> int:
    return min(NUM_BINS - 1, max(0, int(confidence * NUM_BINS)))


# ---- cost ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostTable:
    """Measured milliseconds: the target forward of a decode step by tokens, the draft forward by
    sequences. padded: the forwards run padded to the measured sizes (graph buckets), so a size
    costs the next point's time; else (eager) linear between points. Past the last point, the
    last segment's slope (a compute-bound forward grows linearly); before the first, the first
    point's time. A draft of 0 sequences is not run: 0 ms. draft_ms is the full block's;
    narrow: (width, ms at each draft_batch point) for the narrower blocks the draft may run."""
    target_rows: tuple[int, ...]
    target_ms: tuple[float, ...]
    draft_batch: tuple[int, ...]
    draft_ms: tuple[float, ...]
    padded: bool = False
    narrow: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        for xs, ys in ((self.target_rows, self.target_ms), (self.draft_batch, self.draft_ms),
                       *((self.draft_batch, ms) for _, ms in self.narrow)):
            if len(xs) != len(ys) or not xs or list(xs) != sorted(set(xs)):
                raise ValueError("a cost table needs strictly increasing points, one time each")

    @property
    def narrow_widths(self) -> tuple[int, ...]:
        return tuple(w for w, _ in self.narrow)

    @property
    def draft_widths(self) -> tuple[int | None, ...]:
        """Every draft block the table prices, for allocate: None (the full one), the narrower."""
        return (None, *self.narrow_widths)

    def target(self, rows: np.ndarray | int) -> np.ndarray:
        return self.lookup("target", np.asarray(rows, dtype=np.float64))

    def draft(self, batch: np.ndarray | int, width: int | None = None) -> np.ndarray:
        """The draft over `batch` blocks of `width` (a narrow width's, or the full block's)."""
        batch = np.asarray(batch, dtype=np.float64)
        return np.where(batch > 0, self.lookup(draft_name(width), batch), 0.0)

    def target_ms_of(self, rows: int) -> float:
        return self.scalar("target", rows)

    def draft_ms_of(self, batch: int) -> float:
        return self.scalar("draft", batch) if batch > 0 else 0.0

    @functools.cached_property
    def dense(self) -> dict[str, tuple[np.ndarray, list[float], float]]:
        """Every integer size up to the last point priced once (the policy asks every step, and a
        lookup is then one gather; numpy, whose per-call cost on these small arrays is a fraction
        of torch's): values, the same as floats, and the slope beyond."""
        out = {}
        curves = (("target", self.target_rows, self.target_ms), ("draft", self.draft_batch, self.draft_ms),
                  *((draft_name(w), self.draft_batch, ms) for w, ms in self.narrow))
        for name, xs, ys in curves:
            sizes = torch.arange(xs[-1] + 1, dtype=torch.float64)
            values = interpolate(pad_to(sizes, xs) if self.padded else sizes, xs, ys)
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            out[name] = (values.numpy(), values.tolist(), slope)
        return out

    def lookup(self, name: str, x: np.ndarray) -> np.ndarray:
        values, _, slope = self.dense[name]
        last = len(values) - 1
        return np.where(x > last, values[last] + slope * (x - last), values[np.minimum(x.astype(np.int64), last)])

    def scalar(self, name: str, x: int) -> float:
        _, values, slope = self.dense[name]
        last = len(values) - 1
        return values[last] + slope * (x - last) if x > last else values[max(0, x)]

    @staticmethod
    def analytic(flat_rows: int, ms_flat: float, ms_per_row: float, draft_ms: float,
                 draft_ms_per_seq: float = 0.0, max_rows: int = 8192) -> "CostTable":
        """A roofline-shaped table (no device needed; tests and a documented fallback): flat at
        ms_flat up to flat_rows (memory-bound), then ms_per_row for each row beyond."""
        flat_rows = max(1, flat_rows)
        end = max(flat_rows + 1, max_rows)
        rows, ms = ((1, flat_rows, end), (ms_flat, ms_flat)) if flat_rows > 1 else ((1, end), (ms_flat,))
        return CostTable(rows, (*ms, ms_flat + ms_per_row * (end - flat_rows)),
                         (1, max_rows), (draft_ms, draft_ms + draft_ms_per_seq * (max_rows - 1)))

    def describe(self) -> str:
        target = " ".join(f"{r}:{ms:.3g}" for r, ms in zip(self.target_rows, self.target_ms))
        draft = " ".join(f"{b}:{ms:.3g}" for b, ms in zip(self.draft_batch, self.draft_ms))
        how = "padded to these buckets" if self.padded else "interpolated"
        narrow = "".join(f"; width {w}: " + " ".join(f"{b}:{ms:.3g}" for b, ms in zip(self.draft_batch, times))
                         for w, times in self.narrow)
        return f"verify ms by tokens {target}; draft ms by sequences {draft}{narrow} ({how})"


def draft_name(width: int | None) -> str:
    return "draft" if width is None else f"draft{width}"


def interpolate(x: torch.Tensor, xs: Seq[int], ys: Seq[float]) -> torch.Tensor:
    """Piecewise-linear y(x) through (xs, ys), flat before xs[0], extended by the last slope."""
    px = torch.tensor(xs, dtype=torch.float64)
    py = torch.tensor(ys, dtype=torch.float64)
    if len(xs) == 1:
        return torch.full_like(x, float(py[0]))
    i = torch.searchsorted(px, x.clamp_min(px[0])).clamp(1, len(xs) - 1)
    x0, x1, y0, y1 = px[i - 1], px[i], py[i - 1], py[i]
    return y0 + (y1 - y0) * (x.clamp_min(px[0]) - x0) / (x1 - x0)


def pad_to(values: torch.Tensor, buckets: Seq[int]) -> torch.Tensor:
    """Each value rounded up to the next bucket (a captured graph's size); past the last, itself."""
    b = torch.tensor(buckets, dtype=values.dtype)
    i = torch.searchsorted(b, values).clamp_max(len(buckets) - 1)
    return torch.where(values <= b[-1], b[i], values)


# ---- allocation ----------------------------------------------------------------------------

@dataclass
class Allocation:
    widths: list[int]                # k_b: drafts each sequence verifies
    expected_tokens: float           # Σ_b E_b(k_b)
    ms: float                        # predicted step time (forwards + host work)
    draft_width: int | None = None   # the draft's block it was priced at (None: the full block)

    @property
    def rate(self) -> float:
        return self.expected_tokens / self.ms if self.ms > 0 else 0.0

    @property
    def runs_draft(self) -> bool:
        return any(self.widths)


def allocate(probs: np.ndarray | torch.Tensor, caps: Seq[int], costs: CostTable, floors: Seq[int] | None = None,
             fixed_ms: float = 0.0, per_token_ms: float = 0.0, margin: float = 0.0,
             draft_widths: Seq[int | None] = (None,), marginal: float = 1.0,
             max_rows: int | None = None, draft_paid: bool = False) -> Allocation:
    """probs [B, L] (predicted p of each draft slot), caps[b] ≤ L (the most drafts b may verify:
    its block, or fewer when max_tokens is near), floors[b] (drafts b must verify: a seeded
    sampling request keeps its whole block so its output stays reproducible) → the widths of the
    best global top-B (module docstring). fixed_ms, per_token_ms: the host work of a step beyond
    the forwards (learnt online, Speculation.record_cycle): a part per step, which makes more
    tokens per step worth more, and a part per committed token, which speculation cannot save.
    Every B is evaluated, not only up to the first drop: the draft's cost steps up with each
    sequence that starts drafting, and a padded forward costs its bucket, so a few more slots
    can be free. margin: every slot up to its cap is verified unless the best allocation's
    predicted rate beats that by this fraction (ragged widths cost host work and launches the
    table does not price: Speculation passes RAGGED_MARGIN); an allocation of no drafts beyond
    the floors (plain steps) needs no margin. draft_widths: the draft blocks to
    price it at (None: the full block of L + 1; a narrower width W cuts the caps to W − 1 and
    prices the draft at W): the best rate over them is taken, each width's scan over the one
    sort of the slots (this runs every step on the host). marginal: what the steps measured a
    draft and its verify rows to cost over a plain step, as a fraction of what the table says
    (learnt online, Speculation.record_cycle): the step is priced as the plain step's forward plus
    marginal × the table's extra for the drafts. max_rows: the step's token budget; only the best
    slots that fit beside the sequences' own rows are candidates (the floors always are), so
    "every slot up to its cap" means every slot that fits (round 48: at 256 sequences of blocks of
    16 under 2,048 tokens the allocation planned 4,096 rows, half the sequences sat out each step
    and adaptive ran at 0.82 × plain). draft_paid: the drafts exist already (Speculation.refined),
    one whole block for each sequence with a cap: their cost is the same whatever is verified,
    but it stays in the step's time, whose tokens a millisecond are maximised (without it, a
    verify row was priced against the verify alone, as if the step's rate were its verify's:
    on the CPU demo pair at 8 sequences adaptive refined blocks to k ≈ 2 where whole blocks ran
    1.1 × faster, round 56)."""
    num_seqs, num_slots = probs.shape
    if num_seqs == 0:
        return Allocation([], 0.0, 0.0)
    paid_ms = costs.draft_ms_of(int(np.count_nonzero(np.asarray(caps) > 0))) if draft_paid else None
    # numpy: this runs every step on the host, on arrays of at most a few thousand entries.
    p = probs.double().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs, dtype=np.float64)  # [B, L]
    caps_a = clamp(np.asarray(caps, dtype=np.int64), 0, num_slots)
    floors_a = np.zeros(num_seqs, dtype=np.int64) if floors is None else \
        np.minimum(np.asarray(floors, dtype=np.int64), caps_a)
    slot = np.arange(num_slots)
    survival = np.where(slot[None] >= caps_a[:, None], -1.0, np.cumprod(clamp(p, 0.0, 1.0), axis=1))
    # Forced slots first, then by survival. Equal scores may come in any order (a stable sort
    # costs 8× as much on the host every step): what is taken of a sequence is counted, not
    # named, and a sequence drafts from the first of its slots taken, wherever that lands.
    forced = slot[None] < floors_a[:, None]
    keys = np.where(forced, math.inf, survival).ravel()
    order = np.argsort(-keys)
    order = order[keys[order] >= 0]                                       # past a cap: never
    num_forced = int(forced.sum())
    best: Allocation | None = None
    # A floor verifies past any narrower block: then the full one only.
    for width in [w for w in draft_widths if w is None or not num_forced] or [None]:
        part = order if width is None else order[order % num_slots < width - 1]
        if max_rows is not None:
            part = part[: max(num_forced, max_rows - num_seqs)]
        candidate = scan(part, survival, num_seqs, num_slots, costs, width, num_forced, fixed_ms, per_token_ms,
                         margin, marginal, paid_ms)
        if best is None or candidate.rate > best.rate:
            best = candidate
    return best


def scan(order: np.ndarray, survival: np.ndarray, num_seqs: int, num_slots: int, costs: CostTable,
         width: int | None, num_forced: int, fixed_ms: float, per_token_ms: float, margin: float,
         marginal: float = 1.0, paid_ms: float | None = None) -> Allocation:
    """allocate's rate at every prefix of `order` (slot indices, best first) → the best one.
    paid_ms: the draft already run (its cost, whatever is taken), else priced by who drafts."""
    taken = survival.ravel()[order]
    tokens = num_seqs + np.concatenate(([0.0], np.cumsum(taken)))
    rows = num_seqs + np.arange(len(order) + 1, dtype=np.float64)
    first = np.zeros(len(order), dtype=np.float64)
    first[np.unique(order // num_slots, return_index=True)[1]] = 1.0    # where each sequence starts drafting
    drafting = np.concatenate(([0.0], np.cumsum(first)))
    plain = costs.target_ms_of(num_seqs)
    forwards = costs.target(rows) + (paid_ms if paid_ms is not None else costs.draft(drafting, width))
    ms = plain + marginal * (forwards - plain) + fixed_ms + per_token_ms * tokens
    rate = tokens / ms
    rate[:num_forced] = -math.inf                                         # the floors are not optional
    best = int(np.argmax(rate))
    # The margin is what a ragged plan must win by; no drafts at all (best 0: a plain step) is
    # as uniform as the whole block, so it stands on any gain (else a draft that costs a little
    # more than it saves would still be verified whole: SmolLM2 at 16–64 requests, round 45).
    if best > num_forced and rate[best] < (1.0 + margin) * rate[-1]:
        best = len(order)
    widths = np.bincount(order[:best] // num_slots, minlength=num_seqs)
    return Allocation(widths.tolist(), float(tokens[best]), float(ms[best]), width)


def forwards_ms(costs: CostTable, widths: Seq[int], draft_width: int = 0, drafting: int | None = None) -> float:
    """What the table says a decode step of these widths costs: the target over Σ (1 + k_b)
    tokens, the draft over the sequences with k_b > 0 (blocks of draft_width; 0: the full block),
    or over `drafting` sequences where that differs (late widths: drafted for, then refined)."""
    drafting = sum(1 for k in widths if k > 0) if drafting is None else drafting
    draft = costs.draft_ms_of(drafting) if not draft_width or draft_width not in costs.narrow_widths else \
        float(costs.draft(drafting, draft_width))
    return costs.target_ms_of(len(widths) + sum(widths)) + draft


# ---- calibration ---------------------------------------------------------------------------

NUM_GROUPS = 4
BIN_CENTRES = (np.arange(NUM_BINS, dtype=np.float64) + 0.5) / NUM_BINS


class Calibration:
    """P(accept | slot group, confidence bin), vectorised over the batch (numpy: it runs every
    step on the host, on arrays of a few hundred entries).

    Engine-wide counts with a prior at the bin's centre (an uncalibrated draft is taken at its
    word until observed); each sequence (a row of the per-sequence tables, `rows` from
    Speculation) has its own decaying counts, shrunk toward the engine-wide estimate with
    PRIOR_STRENGTH pseudo-observations. `recent[row]` is the sequence's exponential average of
    its calibrated prefix products Π_{i ≤ j} p_i (an average of products, not a product of
    averages: what the next cycle's expected tokens are), from which the next plan is made."""

    def __init__(self, num_slots: int, prior_strength: float = PRIOR_STRENGTH, capacity: int = 64) -> None:
        self.strength, self.num_slots = prior_strength, num_slots
        self.engine_accepted = np.zeros((NUM_GROUPS, NUM_BINS))
        self.engine_seen = np.zeros((NUM_GROUPS, NUM_BINS))
        self.groups = np.array([slot_group(i) for i in range(num_slots)], dtype=np.int64)
        self.accepted = np.zeros((0, NUM_GROUPS, NUM_BINS))                          # [rows, G, bins]
        self.seen = np.zeros_like(self.accepted)
        self.recent = np.zeros((0, num_slots))                                         # [rows, L]
        self.settled = np.zeros((0, num_slots))        # [rows, L]: recent's slow average, from the default
        self.settled_cycles = np.zeros(0)                # [rows]: the cycles in it (at most SETTLED_MEMORY)
        self.engine_recent = np.full(num_slots, math.nan)     # what sequences' cycles realised lately
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` sequences' rows (doubling: rows are handed out one at a time)."""
        have = self.accepted.shape[0]
        if capacity <= have:
            return
        more = max(capacity, 2 * have) - have
        self.accepted = np.concatenate((self.accepted, np.zeros((more, NUM_GROUPS, NUM_BINS))))
        self.seen = np.concatenate((self.seen, np.zeros((more, NUM_GROUPS, NUM_BINS))))
        self.recent = np.concatenate((self.recent, np.full((more, self.num_slots), math.nan)))
        self.settled = np.concatenate((self.settled, np.full((more, self.num_slots), math.nan)))
        self.settled_cycles = np.concatenate((self.settled_cycles, np.zeros(more)))

    def reset(self, row: int) -> None:
        self.accepted[row] = 0.0
        self.seen[row] = 0.0
        self.recent[row] = math.nan
        self.settled[row] = math.nan
        self.settled_cycles[row] = 0.0

    def engine_estimate(self) -> np.ndarray:
        return (self.engine_accepted + self.strength * BIN_CENTRES) / (self.engine_seen + self.strength)

    @staticmethod
    def bins(confidence: np.ndarray) -> np.ndarray:
        return clamp((np.where(np.isnan(confidence), 0.0, confidence) * NUM_BINS).astype(np.int64), 0, NUM_BINS - 1)

    def calibrate(self, confidence, rows) -> np.ndarray:
        """confidence [B, L] (the draft's own probabilities; NaN past a narrower block), rows [B] →
        calibrated p [B, L] (NaN where the confidence is)."""
        confidence = np.asarray(confidence, dtype=np.float64)
        bins = self.bins(confidence)
        groups = self.groups[None]
        mine = np.asarray(rows, dtype=np.int64)[:, None]
        engine = self.engine_estimate()[groups, bins]
        calibrated = (self.accepted[mine, groups, bins] + self.strength * engine) / (self.seen[mine, groups, bins]
                                                                                     + self.strength)
        return np.where(np.isnan(confidence), math.nan, calibrated)

    def observe(self, confidence, calibrated, widths: Seq[int], accepted: Seq[int], rows,
                restart: np.ndarray | None = None) -> None:
        """After a verify: slots 1 … a of b were accepted, slot a + 1 (if ≤ k_b) rejected; later
        slots were not judged (acceptance is conditional on the prefix). Slots past a narrower
        block than L + 1 (NaN confidence) keep their old conditional chance on top of the new
        prefix. restart [B] (bool): rows whose recent prediction is this cycle's alone (a
        sequence's first verify after relax brought it back: what it held was a prior, not
        its evidence)."""
        bins = self.bins(np.asarray(confidence, dtype=np.float64))
        rows = np.asarray(rows, dtype=np.int64)
        slot = np.arange(self.num_slots)[None]
        k = np.asarray(widths, dtype=np.int64)[:, None]
        a = np.asarray(accepted, dtype=np.int64)[:, None]
        b, j = np.nonzero(slot < np.minimum(k, a + 1))                     # the judged (sequence, slot)s
        outcome = (j < a[b, 0]).astype(np.float64)
        mine, groups, judged_bins = rows[b], self.groups[j], bins[b, j]
        self.accepted[rows] *= SEQUENCE_DECAY
        self.seen[rows] *= SEQUENCE_DECAY
        np.add.at(self.accepted, (mine, groups, judged_bins), outcome)
        np.add.at(self.seen, (mine, groups, judged_bins), 1.0)
        np.add.at(self.engine_accepted, (groups, judged_bins), outcome)
        np.add.at(self.engine_seen, (groups, judged_bins), 1.0)
        products = np.cumprod(np.asarray(calibrated, dtype=np.float64), axis=1)
        old = self.recent[rows]
        tail = old.copy()                 # past a narrower block: the old chances (a restart's too)
        if restart is not None:
            old[restart] = math.nan
        fresh = np.where(np.isnan(old), products, (1 - SLOT_EMA) * old + SLOT_EMA * products)
        if np.isnan(products).any():
            fresh = np.cumprod(np.where(np.isnan(products), conditionals(tail), conditionals(fresh)), axis=1)
        self.recent[rows] = fresh
        settled = self.settled_of(rows)
        cycles = np.minimum(self.settled_cycles[rows] + 1.0, SETTLED_MEMORY)
        self.settled_cycles[rows] = cycles
        moved = settled + (fresh - settled) / (SETTLED_PRIOR + cycles)[:, None]
        self.settled[rows] = np.where(np.isnan(fresh), settled, moved)     # (a new row's unjudged tail)
        self.engine_recent = engine_average(self.engine_recent, fresh[~np.isnan(fresh).any(axis=1)])

    def relax(self, rows: np.ndarray, weight: np.ndarray) -> None:
        """Move these sequences' predictions `weight` [rows] of the way back to their settled ones
        (Speculation.allocation: those it left at k = 0, which nothing observes)."""
        if len(rows):
            weight = weight[:, None]
            self.recent[rows] = (1.0 - weight) * self.recent[rows] + weight * self.settled_of(rows)

    def settled_of(self, rows: np.ndarray) -> np.ndarray:
        """[B, L] these sequences' settled predictions (the default where they have none yet)."""
        settled = self.settled[rows]
        return np.where(np.isnan(settled), self.default()[None], settled)

    def default(self) -> np.ndarray:
        """[L] prefix products for a sequence with no cycles of its own: what the engine's sequences
        realised lately, or before any the engine-wide estimate of the top confidence bin."""
        if np.isnan(self.engine_recent).any():
            return np.cumprod(self.engine_estimate()[self.groups, NUM_BINS - 1])
        return self.engine_recent

    def predicted(self, rows) -> np.ndarray:
        """[B, L] per-slot p whose prefix products are each sequence's recent average ones; a
        sequence never drafted yet starts from what the engine's sequences realised lately (a
        draft that stopped paying is not tried whole again by every new request), and before any
        from the engine-wide estimate of the top confidence bin (a fresh draft is tried)."""
        products = self.recent[np.asarray(rows, dtype=np.int64)]
        products = np.where(np.isnan(products), self.default()[None], products)
        return clamp(conditionals(products), 0.0, 1.0)


def widths_for(plan: tuple[list, np.ndarray], seqs: Seq) -> np.ndarray | None:
    """A plan's (sequences, widths) read for these sequences, in their order, or None where one
    of them is not in it (an arrival). The batch it was made for (most steps) gets the plan's own
    array, read only: ahead_draft knows a kept plan by its identity."""
    planned, widths = plan
    if len(planned) == len(seqs) and all(a is b for a, b in zip(planned, seqs)):
        return widths
    by_id = {id(seq): (seq, int(k)) for seq, k in zip(planned, widths)}
    found = [by_id.get(id(seq), (None, 0)) for seq in seqs]
    if any(mine is not seq for (mine, _), seq in zip(found, seqs)):
        return None
    return np.fromiter((k for _, k in found), dtype=np.int64, count=len(found))


def engine_average(average: np.ndarray, cycles: np.ndarray) -> np.ndarray:
    """The engine-wide average after these cycles, cycle by cycle (the same whatever the batch):
    average ← (1 − ENGINE_EMA) · average + ENGINE_EMA · cycle, starting from the first cycle where
    there is none yet. The products ENGINE_EMA · cycle are taken for all cycles at once and the
    rest in place: the same roundings as one cycle at a time, without a loop's temporaries (at 64
    sequences the loop was most of what the policy learnt from a verify)."""
    if not len(cycles):
        return average
    if np.isnan(average).any():
        average, cycles = cycles[0], cycles[1:]
    average = np.array(average, dtype=np.float64)
    weighted = ENGINE_EMA * cycles
    for row in weighted:
        np.multiply(average, 1 - ENGINE_EMA, out=average)
        np.add(average, row, out=average)
    return average


def conditionals(products: np.ndarray) -> np.ndarray:
    """Prefix products [B, L] → each slot's chance given the slots before it."""
    previous = np.concatenate((np.ones_like(products[:, :1]), products[:, :-1]), axis=1)
    return products / np.maximum(previous, 1e-12)


# ---- the engine's speculation state ----------------------------------------------------------

MODES = ("adaptive", "fixed", "off")
LEARNING_BUDGET = 0.01              # learning cycles (whole blocks verified: new evidence) may
                                    # cost this fraction of the plain steps' time
WARMUP_OBSERVATIONS = 256           # judged drafts, engine-wide, before the calibration is trusted
HOST_WORK_MEMORY = 0.98             # forgetting factor of the host-work fit (per cycle)
VARIES = 1e-6                       # varies_apart: a term's share of its moment apart from others
# Narrower than every cap only when the table predicts this much more throughput: a ragged step
# costs what the table does not see (the partial draft's scatter, the verify rows' gather, a
# bucket change). On the H200 (Qwen3-8B shape, 8 sequences) adaptive chose 12.3 of 15 drafts
# for a predicted gain of a few per cent and ran 0.89 × the whole block.
RAGGED_MARGIN = 0.05
RESCAN_STEPS = 8                    # steps between pricings of every draft width (planned_widths)
DEPTH_PRIOR = 4.0                   # depth_ratio's prior: this many survivals realised as predicted
DEPTH_MEMORY = 0.995                # its forgetting factor, per observed verify
# The depth correction (Speculation.learn_depth, corrected) is learnt and applied where widths are
# late (CPU: Speculation.applies_depth, round 56), elsewhere only with BLOCKSPEC_ADAPTIVE_DEPTH=1
# until a GPU run has weighed it (round 51: on the CPU it made the whole block's predicted tokens
# what fixed k = 7 realises, 27.5 against 27.3, where they were 22.2; the GPU figures are without it).
APPLY_DEPTH = os.environ.get("BLOCKSPEC_ADAPTIVE_DEPTH", "") == "1"
# The measured choice between the policy and whole blocks (Arms), opt-in with
# BLOCKSPEC_ADAPTIVE_ARMS=1 until a GPU run has weighed it (round 52: on the SmolLM2 pair the
# policy's own host work made its steps 0.7–1.2 ms longer than fixed's for the same tokens).
MEASURE_ARMS = os.environ.get("BLOCKSPEC_ADAPTIVE_ARMS", "") == "1"
# The plain arm (Arms: windows at k = 0 against the policy's), BLOCKSPEC_PLAIN_ARM=1. Opt-in: on
# the CPU demo pair it was no better than the policy alone in paired runs (round 61, six pairs:
# adaptive ÷ best fixed 0.85-1.33 with it, 0.85-1.25 without, the 2-core machine's noise as large
# as either), though it once kept adaptive at 0.99-1.18 where the policy alone fell to 0.88-0.95
# (round 60: the step-time fit extrapolates to k = 0 unchecked, marginal_scale 0.48-0.65 against
# the steps' ~1.2); on the GPU its cost is unmeasured (a plain window at each load).
PLAIN_ARM = os.environ.get("BLOCKSPEC_PLAIN_ARM", "") == "1"
ARM_WINDOW = 8                      # decode steps an arm runs before the choice is made again
# ... the plain arm's: its steps' time barely varies (no draft, no acceptance), so a short window
# measures it, and its windows are the ones that cost where the policy pays (on the CPU demo pair
# at 8 requests, 8-step plain windows at each load took 0.84-0.86 × the best fixed width, round 61).
PLAIN_WINDOW = 2
ARM_EXPLORE = 8                     # once measured, a slower arm runs one window in this many × (gap)²
MAX_EXPLORE = 512                   # ... and at least one in this many
ARM_MEMORY = 0.95                   # each arm's tokens and seconds decay by this a step of its own


# The policy's own host work — learning from a verify (observe), the cost fit (record_cycle), the
# allocation (plan_ahead) — is done every `stride`-th time (Pace): where the host is the
# bottleneck it may cost this fraction of a step. Round 52: on the SmolLM2 pair (~2.5 ms steps,
# host-bound) that work took 0.6–0.9 ms a step and adaptive ran at 0.74–0.83 × fixed for the same
# tokens; on Qwen3-8B the device hides it (the host waits there anyway).
POLICY_BUDGET = 0.02
MAX_STRIDE = 16
PACE_MEMORY = 0.9                   # weight of the past in the pace's averages (per step)


class Pace:
    """How often the policy does its work: every step where the device hides it (the host's wait
    for the verdict would still cover it once more at stride 1), else every `stride`-th time, the stride
    the smallest that keeps the work within POLICY_BUDGET of a step. Each kind of work keeps its
    own count (a verify is learnt from, a step fitted, a plan made, each every stride-th time) and
    its own measured cost; in between, the calibration and the fit keep what they learnt and a
    plan made is kept (Speculation.plan_ahead). Engine thread only."""

    KINDS = ("observe", "fit", "plan")

    def __init__(self) -> None:
        self.stride = 1
        self.work_ms = dict.fromkeys(self.KINDS, 0.0)     # each kind's cost when it runs (average)
        self.step_ms = 0.0                                # a decode-only step's wall time (average)
        self.wait_ms = 0.0                                # the host's wait for its verdict (average)
        self.counts = dict.fromkeys(self.KINDS, 0)

    def due(self, kind: str) -> bool:
        """Whether this time's `kind` of work runs (counted)."""
        count = self.counts[kind]
        self.counts[kind] = count + 1
        return count % self.stride == 0

    def restart(self, kind: str) -> None:
        """The work ran out of turn (a plan the kept one could not serve): the next stride − 1 skip."""
        self.counts[kind] = 1

    def spent(self, kind: str, seconds: float) -> None:
        self.work_ms[kind] = average(self.work_ms[kind], seconds * 1e3)

    def stepped(self, seconds: float, waited: float) -> None:
        """A decode-only step took `seconds`, of which the host waited `waited` for the verdict."""
        self.step_ms = average(self.step_ms, seconds * 1e3)
        self.wait_ms = average(self.wait_ms, waited * 1e3)
        self.stride = self.choose()

    def choose(self) -> int:
        work = sum(self.work_ms.values())
        if work <= 0.0 or self.step_ms <= 0.0:
            return 1
        # The wait at stride 1: what the host waits now, less the work it would add back. Hidden
        # only where that still covers the work once more: the wait is read at one point of the
        # cycle, and work before a launch can leave the device idle at another (SmolLM2 at one
        # request, round 54: at stride 1 the host still waited 0.18 ms for the verdict, yet its
        # ~0.5 ms of policy work made the step 0.07 ms longer than fixed's).
        if self.wait_ms - work * (1.0 - 1.0 / self.stride) >= work:
            return 1
        return int(min(MAX_STRIDE, max(1, math.ceil(work / (POLICY_BUDGET * self.step_ms)))))


def average(old: float, new: float) -> float:
    """The pace's running average (the first value taken as it is)."""
    return new if old == 0.0 else PACE_MEMORY * old + (1.0 - PACE_MEMORY) * new


def varies_apart(moments: np.ndarray, term: int, others: list[int]) -> bool:
    """Whether `term` varied apart from `others` (one or two of them) in these sums of products: its
    moment left once they explain it (least squares; a vanishing ridge keeps the solve defined
    where the others are themselves collinear) is above VARIES of its whole. Closed forms: on the
    CPU, np.linalg.solve's overhead made this half of the fit's time (it runs at every learning
    cycle)."""
    m = moments
    whole = float(m[term, term])
    ridged = [float(m[o, o]) * (1.0 + 1e-9) + 1e-12 for o in others]
    c = [float(m[o, term]) for o in others]
    if len(others) == 1:
        explained = c[0] * c[0] / ridged[0]
    else:
        (a, d), b = ridged, float(m[others[0], others[1]])
        det = a * d - b * b
        explained = (d * c[0] * c[0] - 2.0 * b * c[0] * c[1] + a * c[1] * c[1]) / det
    return whole - explained > VARIES * whole


class Arms:
    """Whether the policy pays for itself at a load, measured: "policy" (the allocation, and what
    it learns from every verify) against "whole" (every sequence its cap, no allocation, nothing
    learnt: fixed's work), each by the tokens a second its own decode-only steps committed at this
    load (sequences, by power of two), in windows of ARM_WINDOW steps (the plain arm's:
    PLAIN_WINDOW) — each arm first, in turn, then the fastest, each slower one re-measured one
    window each ARM_EXPLORE × (the fastest's rate ÷ its own)² of its windows' steps, at most
    MAX_EXPLORE. Why the square: a re-measurement costs in proportion to the gap, so an arm close
    to the best (whose lead may change with the load) is checked often and one far behind rarely
    — the plain arm at one sequence, 5 × slower than the policy on the GPU, runs 0.5 % of the
    steps, where one window in eight would cost 10 % of the time.
    Why arms at all: where the host is the bottleneck (a small target's ~2 ms steps) the
    policy's ~0.5 ms of learning and planning a step is on the critical path and no plan repays
    it; where the device is, it is hidden and the policy's narrower verifies win (1.2–1.5 × fixed
    from 32 sequences, round 52). The plain arm ("plain", every sequence at k = 0) checks the
    step-time fit where it extrapolates to k = 0 (round 60)."""

    ARMS = ("policy", "whole")

    def __init__(self, arms: tuple[str, ...] = ARMS) -> None:
        """arms: those compared, "policy" first."""
        self.arms = arms
        self.sums: dict[int, dict[str, list[float]]] = {}     # load → arm → [tokens, seconds, steps]
        self.windows: dict[int, list] = {}                     # load → [arm, steps left, steps run]
        self.last: dict[int, dict[str, int]] = {}              # load → arm → the step its last window began

    def arm(self, load: int) -> str:
        """The arm of a step planned at this load (counts it against the window)."""
        window = self.windows.get(load)
        if window is None:
            window = self.windows[load] = ["policy", window_of("policy"), 0]
            self.last.setdefault(load, {})["policy"] = 0
        if window[1] <= 0:                                       # the window is run: the next one's arm
            arm = self.upcoming(load)
            window[:] = [arm, window_of(arm), window[2]]
            self.last.setdefault(load, {})[arm] = window[2]
        window[1] -= 1
        window[2] += 1
        return window[0]

    def upcoming(self, load: int) -> str:
        """The arm the next step at this load will take (plan_ahead asks, counting nothing)."""
        window = self.windows.get(load)
        if window is None:
            return "policy"
        return window[0] if window[1] > 0 else self.next_arm(load, window[0], window[2])

    def next_arm(self, load: int, current: str, step: int) -> str:
        """The arm of the window that starts at this load's step number `step` (the one before ran
        `current`)."""
        sums = self.sums.get(load, {})
        measured = [a for a in self.arms if sums.get(a, (0.0, 0.0, 0))[2] >= window_of(a)]
        if len(measured) < len(self.arms):                               # each measured first, in turn
            return self.arms[(self.arms.index(current) + 1) % len(self.arms)]
        best, *others = sorted(self.arms, key=lambda a: -self.rate(load, a))
        last = self.last.get(load, {})
        overdue = [(step - last.get(a, 0) - self.interval(load, best, a), a) for a in others]
        lateness, arm = max(overdue, default=(-1.0, best))
        return arm if lateness >= 0 else best

    def interval(self, load: int, best: str, other: str) -> float:
        """Steps from one window of `other`, slower than `best` at this load, to the next: its
        window × ARM_EXPLORE × the gap², at most MAX_EXPLORE windows."""
        ratio = self.rate(load, best) / max(self.rate(load, other), 1e-12)
        return window_of(other) * min(MAX_EXPLORE, ARM_EXPLORE * ratio * ratio)

    def rate(self, load: int, arm: str) -> float:
        tokens, seconds, _ = self.sums.get(load, {}).get(arm, (0.0, 0.0, 0))
        return tokens / seconds if seconds > 0 else 0.0

    def record(self, load: int, arm: str, tokens: int, seconds: float) -> None:
        sums = self.sums.setdefault(load, {}).setdefault(arm, [0.0, 0.0, 0])
        sums[0] = ARM_MEMORY * sums[0] + tokens
        sums[1] = ARM_MEMORY * sums[1] + seconds
        sums[2] += 1


def window_of(arm: str) -> int:
    """The steps of one window of this arm."""
    return PLAIN_WINDOW if arm == "plain" else ARM_WINDOW


def make_arms(plain: bool) -> Arms | None:
    """The arms compared at each load: the policy, whole blocks (BLOCKSPEC_ADAPTIVE_ARMS=1) and
    plain steps (plain); None where the policy runs alone."""
    arms = ("policy",) + (("whole",) if MEASURE_ARMS else ()) + (("plain",) if plain else ())
    return Arms(arms) if len(arms) > 1 else None


class Speculation:
    """What the engine asks each step (engine thread only): the scheduler, which widths (before
    anything runs); the runner, whether to report confidences; after the verify, what was
    accepted. `fixed` verifies every draft; `off` never gets here (no draft is loaded into the
    runner); `adaptive` allocates as above."""

    def __init__(self, mode: str, num_slots: int, costs: CostTable | None = None,
                 measure: Callable[[], CostTable] | None = None, max_rows: int | None = None,
                 plain_arm: bool = False) -> None:
        """max_rows: the step's token budget (max_num_batched_tokens): an allocation never plans
        more verify rows than a step holds (the scheduler would cut them unpriced). plain_arm: the
        policy's steps measured against plain ones (Arms; BLOCKSPEC_PLAIN_ARM)."""
        self.plain_arm = plain_arm
        if mode not in MODES:
            raise ValueError(f"speculation must be one of {', '.join(MODES)}")
        self.mode, self.num_slots, self.costs, self.max_rows = mode, num_slots, costs, max_rows
        self.measure = measure
        # Widths refined after the draft from its own confidences (`refined`): set by the runner
        # where reading the draft costs no device sync (CPU).
        self.late = False
        self.reset()

    def reset(self) -> None:
        """Forget everything learnt (the cost table stays): a fresh engine's policy."""
        num_slots = self.num_slots
        self.calibration = Calibration(max(1, num_slots))
        self._rows: dict[int, tuple[object, int]] = {}                   # id(seq) → (seq, table row)
        self._free_rows: list[int] = []
        self._floor = np.zeros(64, dtype=np.int64)                        # by row: see floors
        self._cycles_since_learning = 0
        self._chosen_width: int | None = None              # planned_widths: the draft width priced last
        self._rescan_load, self._steps_to_rescan = 0, 0
        self._steps = 0                                     # decode steps planned (planned_widths)
        self._idle: tuple[np.ndarray, int] = (np.zeros(0, dtype=np.int64), 0)   # allocation: rows left at k = 0, when
        self._returning = np.zeros(0, dtype=np.int64)     # rows brought back from k = 0, not judged yet
        self._backoff = np.zeros(64, dtype=np.int64)      # by row: failed returns in a row (allocation)
        self._ahead: tuple[list, np.ndarray] | None = None  # plan_ahead: (sequences, widths) for the next step
        self._plain_ahead: tuple[list, np.ndarray] | None = None     # the last one made for a plain step
        # A step's time beyond the table's forwards ≈ per_seq · B + per_token · committed tokens,
        # fitted online (least squares with forgetting) from the engine's wall time per step.
        self.overhead_ms_per_seq = 0.0
        self.overhead_ms_per_token = 0.0
        self.forward_scale = 1.0            # measured plain forwards ÷ the table's (fitted with the above)
        self.marginal_scale = 1.0           # measured cost of the drafts over a plain step ÷ the table's
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        # Survival by depth (decaying): realised, the plan's prediction, the cycle's own (late).
        self._depth = np.zeros((3, max(1, self.num_slots)))
        self.arms = make_arms(self.plain_arm)
        self.pace = Pace()
        self._kept: tuple[list, np.ndarray] | None = None   # plan_ahead's last allocation: (sequences, widths)
        self._ahead_read: tuple[np.ndarray, tuple] | None = None     # ahead_draft's answer, by plan
        self._warm = False                  # the calibration past WARMUP_OBSERVATIONS (never undone)
        self._intervals: dict[int, float] = {}                      # learning_interval by load, until a fit
        self.step_arm = "policy"            # the arm of the step planned last (the scheduler's Batch keeps it)
        self.step_learns = False            # whether the step planned last is a learning cycle
        self.step_observes = True           # whether its verify is learnt from (observe; its confidences read)

    @property
    def reads_confidences(self) -> bool:
        """Whether draft forwards should read out the draft's confidences (adaptive mode; unlike
        `adaptive`, this measures nothing: the cost table's own draft forwards ask it)."""
        return self.mode == "adaptive" and self.num_slots > 0

    @property
    def wants_confidences(self) -> bool:
        """Whether the step planned last reads its drafts' confidences to the host (adaptive, at
        the pace's turns and in learning cycles: the proposal's gather and host copy are skipped
        in the steps between)."""
        return (self.step_observes or self.late) and self.adaptive

    @property
    def adaptive(self) -> bool:
        """Whether widths are allocated (the first time: the cost table is measured now, unless
        the engine measured it at startup)."""
        if self.mode != "adaptive" or self.num_slots == 0:
            return False
        if self.costs is None and self.measure is not None:
            self.costs = self.measure()
        return self.costs is not None

    def rows(self, seqs: Seq) -> np.ndarray:
        """Each sequence's row in the calibration tables (given on first sight, kept until forget)."""
        get = self._rows.get
        out = [entry[1] if (entry := get(id(seq))) is not None and entry[0] is seq else self.new_row(seq)
               for seq in seqs]
        return np.array(out, dtype=np.int64)

    def new_row(self, seq) -> int:
        row = self._free_rows.pop() if self._free_rows else len(self._rows)
        self.calibration.grow(row + 1)
        self.calibration.reset(row)
        if row >= len(self._floor):
            more = np.zeros(max(row + 1, 2 * len(self._floor)) - len(self._floor), dtype=np.int64)
            self._floor = np.concatenate((self._floor, more))
            self._backoff = np.concatenate((self._backoff, more))
        self._floor[row] = self.num_slots if keeps_whole_block(seq) else 0
        self._backoff[row] = 0
        # The row's last sequence may still be listed as left idle or returning: not this one.
        if len(self._returning):
            self._returning = self._returning[self._returning != row]
        idle, since = self._idle
        if len(idle):
            self._idle = (idle[idle != row], since)
        self._rows[id(seq)] = (seq, row)
        return row

    def forget(self, seq) -> None:
        """The sequence ended: its row is free."""
        entry = self._rows.pop(id(seq), None)
        if entry is not None:
            self._free_rows.append(entry[1])

    def caps(self, seqs: Seq) -> np.ndarray:
        """Drafts worth verifying: the block's, fewer when fewer tokens are allowed."""
        allowed = np.fromiter((seq.request.num_allowed for seq in seqs), dtype=np.int64, count=len(seqs))
        return clamp(allowed - 1, 0, self.num_slots)

    def floors(self, rows: np.ndarray) -> np.ndarray:
        """A sampling request with an explicit seed verifies its whole block: its random draws
        (and so its output) then do not depend on the load (invariant 1: a fixed seed, a fixed
        output). Kept per row, from the request's parameters when the row was given."""
        return self._floor[rows]

    def planned_widths(self, seqs: Seq) -> list[int]:
        """k_b for each decoding sequence this step, final (the scheduler reserves pages and
        token budget for them; the runner drafts for the sequences with k_b > 0 and verifies
        exactly these). fixed: the whole block for everyone. adaptive: the allocation over each
        sequence's predicted p, or a learning cycle — every sequence its cap — now and then (and
        until the calibration has seen WARMUP_OBSERVATIONS judged drafts): what the confidences
        are worth is then observed even where the policy would verify nothing (without it, an
        underconfident draft would never be tried again). A learning cycle costs what a fixed
        block's costs; they are spaced so that their extra time stays within LEARNING_BUDGET of
        the plain steps' (every 100 cycles where a whole block costs 2 plain steps, every 1 500
        where it costs 16)."""
        ahead, self._ahead = self._ahead, None
        self._steps += 1
        if not self.adaptive:
            return [self.num_slots] * len(seqs)
        if not seqs:
            return []
        self.step_arm = self.arms.arm(len(seqs).bit_length()) if self.arms is not None else "policy"
        self.step_learns, self.step_observes = False, False
        if self.step_arm == "whole":
            return self.caps(seqs).tolist()        # (whole blocks learn nothing: their point is no policy work)
        if self.step_arm == "plain":
            return self.plain_widths(seqs)
        self._cycles_since_learning += 1
        if self.learns(len(seqs), self._cycles_since_learning):
            # A learning cycle's whole blocks are there to be learnt from: always observed.
            self._cycles_since_learning, self.step_learns, self.step_observes = 0, True, True
            return self.caps(seqs).tolist()
        self.step_observes = self.pace.due("observe")
        # (a plan made for a plain step, whose arm changed since with the rates: planned anew)
        widths = self.ahead_widths(ahead, seqs) if ahead is not None and ahead is not self._plain_ahead else None
        if widths is None:
            widths = self.allocation(seqs)
        if self.late:       # who drafts is planned; how much each greedy row verifies, refined after the draft
            return [cap if k > 0 and seq.request.params.is_greedy else k
                    for seq, k, cap in zip(seqs, widths, self.caps(seqs).tolist())]
        return widths

    def plain_widths(self, seqs: Seq) -> list[int]:
        """The plain arm's widths: k = 0, no draft; a seeded sampling request keeps its block."""
        return [int(cap) if keeps_whole_block(seq) else 0 for seq, cap in zip(seqs, self.caps(seqs))]

    def ahead_widths(self, ahead: tuple[list, np.ndarray], seqs: Seq) -> list[int] | None:
        """The widths plan_ahead made, for these sequences, or None (planned anew): each
        sequence's own, cut to its cap, where the plan covers every one of them (in any order;
        the allocation does not depend on the order, ties aside). A batch that lost sequences
        (they ended at step N) or whose caps step N's tokens lowered keeps the plan: re-pricing
        would give the others a few more slots for one step, but it runs on the critical path
        between the sync and the launch (~0.3 ms at 8 sequences on the H200's host) and drops the
        early draft made at the plan's width (ModelRunner.draft_ahead): in round 50's bench at
        8 sequences, that was about half the steps. A sequence the plan was not made for (an
        arrival it did not see) is planned anew, with the others."""
        widths = widths_for(ahead, seqs)
        return None if widths is None else np.minimum(widths, self.caps(seqs)).tolist()

    def plan_ahead(self, seqs: Seq) -> None:
        """While the device runs step N (after the engine's `learn`): the allocation planned_widths
        would make for these sequences at step N + 1, made now. It reads the same state — the
        observations of steps up to N − 1 (step N's are learnt during step N + 1), the idle
        sequences relaxed as of N + 1 — so only the caps can differ then (tokens committed at N).
        The engine passes the sequences step N decodes and those whose prompt it completes. Used
        if step N + 1 decodes only these sequences (in any order; those that ended at N left out),
        each cut to its cap then; else planned there (ahead_widths)."""
        if not self.adaptive or not seqs:
            return
        upcoming = self.arms.upcoming(len(seqs).bit_length()) if self.arms is not None else "policy"
        seqs = list(seqs)
        if upcoming == "plain":            # no early draft for a plain step (but a seeded request's)
            self._ahead = self._plain_ahead = (seqs, np.asarray(self.plain_widths(seqs), dtype=np.int64))
            return
        if upcoming != "policy" or self.learns(len(seqs), self._cycles_since_learning + 1):
            return                                         # whole blocks' and a learning cycle's widths are their caps
        kept = self.kept_widths(seqs) if self.pace.stride > 1 and not self.pace.due("plan") else None
        if kept is not None:
            self._ahead = (seqs, kept)                     # between the pace's turns: the plan made last
            return
        started = time.perf_counter()
        widths = np.asarray(self.allocation(seqs, ahead=1), dtype=np.int64)
        self._ahead = (seqs, widths)
        self._kept = (seqs, widths.copy())
        self.pace.restart("plan")
        self.pace.spent("plan", time.perf_counter() - started)

    def kept_widths(self, seqs: Seq) -> np.ndarray | None:
        """The last allocation's width of each of these sequences, or None where it has none for
        one of them (an arrival: planned anew, with the others)."""
        return None if self._kept is None else widths_for(self._kept, seqs)

    def ahead_draft(self) -> tuple[dict[int, int], int] | None:
        """plan_ahead's plan as an early draft reads it (engine/model_runner.py draft_ahead): each
        planned sequence's k (by id) and the draft width it implies (0: the full block); None
        where no plan was made (fixed, a learning cycle, the warm-up: every sequence drafts the
        full block next step, or is planned then)."""
        if self._ahead is None:
            return None
        seqs, widths = self._ahead
        if self._ahead_read is not None and self._ahead_read[0] is widths:
            return self._ahead_read[1]               # the kept plan, for the same sequences
        read = {id(seq): int(k) for seq, k in zip(seqs, widths)}, 0 if self.late else self.draft_width(seqs, widths.tolist())
        self._ahead_read = (widths, read)
        return read

    def learns(self, num_seqs: int, cycles: int) -> bool:
        """Whether a step `cycles` after the last learning cycle is one (or the warm-up's)."""
        if not self._warm:                   # (engine_seen only grows)
            self._warm = float(self.calibration.engine_seen.sum()) >= WARMUP_OBSERVATIONS
            if not self._warm:
                return True
        return cycles >= self.learning_interval(num_seqs)

    def allocation(self, seqs: Seq, ahead: int = 0) -> list[int]:
        """The widths of allocate() over these sequences' predicted acceptance (not a learning cycle).

        The sequences the last allocation left at k = 0 have their prediction moved back toward
        their settled one first (Calibration.settled: a slow average of their cycles that starts
        from the engine's), by 1 − IDLE_MEMORY^(steps since ÷ 2^backoff): a sequence that does not
        draft is never observed, so without it a few unlucky cycles would keep it from drafting
        until the next learning cycle (the CPU demo pair at one request, round 56: two cycles of
        one token each put a response's prediction at 1.7 tokens a whole block, where its cycles
        committed 3.3, and it decoded plain for the rest of its 48 tokens). Its backoff counts the
        returns that failed in a row (brought back to drafting, no draft accepted in the first
        verify observed since): a draft that does not pay for a sequence is tried again after
        ~7, 13, 26 … steps, not every few. ahead: planned for the next step (plan_ahead), whose
        relaxation is one step further on."""
        rows = self.rows(seqs)
        idle, since = self._idle
        if len(idle):
            steps = self._steps + ahead - since
            self.calibration.relax(idle, 1.0 - IDLE_MEMORY ** (steps / 2.0 ** self._backoff[idle]))
        load = len(seqs).bit_length()
        rescan = self._steps_to_rescan <= 0 or load != self._rescan_load
        widths = self.costs.draft_widths if rescan else (self._chosen_width,)
        if self.late:
            widths = (None,)                       # late: who drafts drafts the whole block (planned_widths)
        alloc = allocate(self.corrected(self.calibration.predicted(rows)), self.caps(seqs), self.costs, self.floors(rows),
                         fixed_ms=self.overhead_ms_per_seq * len(seqs), per_token_ms=self.overhead_ms_per_token,
                         margin=RAGGED_MARGIN, draft_widths=widths, marginal=self.marginal_scale,
                         max_rows=self.max_rows)
        if rescan:
            self._chosen_width, self._rescan_load, self._steps_to_rescan = alloc.draft_width, load, RESCAN_STEPS
        self._steps_to_rescan -= 1
        self.judge_returns(rows, np.asarray(alloc.widths) == 0, self._steps + ahead)
        return alloc.widths

    def judge_returns(self, rows: np.ndarray, left: np.ndarray, now: int) -> None:
        """After an allocation for step `now` that left rows[left] at k = 0: those it brought back
        to drafting (left at k = 0 by the one before) wait for their first verdict (judged_returns)."""
        idle = rows[left]
        back = rows[~left & np.isin(rows, self._idle[0])]
        if len(back):
            self._returning = np.union1d(self._returning, back)
        self._idle = (idle, now)

    def judged_returns(self, rows: np.ndarray, accepted: np.ndarray) -> None:
        """The first verify observed for these rows since they were brought back to drafting: each
        made it if a draft was accepted (its backoff is reset), else failed (its backoff grows)."""
        if not len(rows):
            return
        made_it = accepted > 0
        self._backoff[rows[made_it]] = 0
        self._backoff[rows[~made_it]] = np.minimum(self._backoff[rows[~made_it]] + 1, MAX_BACKOFF)
        self._returning = np.setdiff1d(self._returning, rows)

    def refined(self, seqs: Seq, confidence: torch.Tensor | None, widths: list[int]) -> list[int]:
        """Where `late` (the draft read at no cost: CPU), the step's widths once its drafts exist:
        the plan chose who drafts (a whole block each: planned_widths), and now the allocation
        over this cycle's own calibrated confidences — what the prefix products of past cycles
        only predict — chooses how many each verifies, the draft's cost already paid (a learning
        cycle, and whole-block arms, keep every draft). Why: on the CPU demo pair the
        acceptance rises along a response and the prediction from past cycles trails it (1.84
        tokens a cycle predicted against 2.55 realised, where this cycle's calibrated products
        give 2.50: round 52), so the plan narrowed where whole blocks paid. Greedy rows only (a
        sampling row's k is its plan's). Adaptive speculation is refused with tensor parallelism
        (config.py), whose leader sends the ranks the widths before the draft runs."""
        if not self.late or confidence is None or self.step_learns or self.step_arm != "policy" or not self.adaptive:
            return widths
        rows = self.rows(seqs)
        # A sampling row keeps its planned width: the rejection rule is exact only for a k fixed
        # before its drafts were drawn, and its confidences are q(d) of what was drawn.
        pinned = np.fromiter((k if not seq.request.params.is_greedy else 0 for seq, k in zip(seqs, widths)),
                             dtype=np.int64, count=len(seqs))
        conf = confidence.double().numpy()
        if conf.shape[1] < self.num_slots:
            conf = np.concatenate((conf, np.full((conf.shape[0], self.num_slots - conf.shape[1]), math.nan)), axis=1)
        probs = np.nan_to_num(self.calibration.calibrate(conf, rows), nan=0.0)
        caps = np.asarray(widths, dtype=np.int64)
        floors = np.maximum(np.minimum(self.floors(rows), caps), pinned)
        alloc = allocate(self.corrected(probs, against="cycle"), caps, self.costs, floors,
                         fixed_ms=self.overhead_ms_per_seq * len(seqs), per_token_ms=self.overhead_ms_per_token,
                         margin=RAGGED_MARGIN, marginal=self.marginal_scale, max_rows=self.max_rows, draft_paid=True)
        return alloc.widths

    def draft_width(self, seqs: Seq, widths: Seq[int]) -> int:
        """The draft's block for a step that verifies these k_b (0: the full block): under
        adaptive the narrowest of the table's widths that holds max k_b + 1 — a narrower block
        denoises fewer rows — unless a seeded request drafts (its drafts, and so its draws, must
        not depend on the batch: it always denoises the full block)."""
        need = max(widths, default=0) + 1
        if need <= 1 or not self.adaptive:
            return 0
        width = next((w for w in self.costs.narrow_widths if w >= need), 0)
        # (floors' rule, read from the requests: no calibration rows made for it on this path)
        if width and any(keeps_whole_block(seq) for seq, k in zip(seqs, widths) if k > 0):
            return 0
        return width

    def learning_interval(self, num_seqs: int) -> float:
        """Cycles between learning cycles: (whole-block cycle − plain step) / (budget × plain step)
        (kept by load until the next fit: it is asked twice a step)."""
        interval = self._intervals.get(num_seqs)
        if interval is None:
            interval = self._intervals[num_seqs] = self.interval_of(num_seqs)
        return interval

    def interval_of(self, num_seqs: int) -> float:
        fixed = self.overhead_ms_per_seq * num_seqs + self.overhead_ms_per_token * num_seqs
        # forwards_ms of num_seqs plain rows and of num_seqs whole blocks, without their lists
        # (this runs twice a step, on the critical path).
        plain = self.costs.target_ms_of(num_seqs) + fixed
        whole = self.costs.target_ms_of(num_seqs * (1 + self.num_slots)) + self.costs.draft_ms_of(num_seqs) + fixed
        return self.marginal_scale * (whole - plain) / (LEARNING_BUDGET * plain)

    def record_cycle(self, seconds: float, widths: Seq[int], num_tokens: int, draft_width: int = 0,
                     arm: str = "policy", waited: float = 0.0, drafting: int | None = None,
                     learns: bool = False) -> None:
        """The engine's wall time of a whole decode-only step (forwards, accept, commits) of
        these widths that committed num_tokens, against the table's forwards for it, fitted as

            scale · (plain + extra) + δ · extra + per_seq · B + per_token · tokens

        (plain: the table's forward of B plain rows; extra: what it adds for the drafts and their
        verify rows; marginal = (scale + δ) ÷ scale, the drafts' cost as a fraction of the table's;
        ridge least squares toward scale 1 and δ 0, forgetting HOST_WORK_MEMORY per step; scale and
        the host terms ≥ 0, marginal within [0.1, 10]: steps whose widths never vary leave δ at its
        prior and the fit is the table's forwards, scaled), so the allocation weighs tokens against
        the step's real time: the table may have been measured under another load (scale), its
        price of a draft row may be off
        (marginal: on the 2-core CPU the demo pair's startup table priced the rows of k = 7 over
        k = 3 at twice what the steps measured, and adaptive narrowed where the whole block paid),
        and the host's work per sequence and per committed token is not in it. The host terms are
        kept in the table's units (divided by the scale): maximising tokens per ms does not see it.
        waited: of `seconds`, the host's wait for the verdict (the pace: Pace.stepped); the fit
        itself runs at the pace's turns, and at every learning cycle (`learns`): where the policy
        keeps one width (SmolLM2: k = 3 in blocks of 4 at 16 and 64 requests), its whole blocks are
        the fit's only steps of other widths (not so in the warm-up, whose steps are all whole blocks:
        fitted at the pace's turns), so the only evidence of what drafts really cost — at
        stride 16 the fit saw one in sixteen of them, and priced drafts from the device table alone
        on a host-bound step. drafting: the sequences the draft ran for, where widths were refined
        after it (a sequence refined to k = 0 still paid its draft)."""
        if not self.adaptive or not widths:
            return
        self.pace.stepped(seconds, waited)
        if self.arms is not None:
            self.arms.record(len(widths).bit_length(), arm, num_tokens, seconds)
            if arm != "policy":
                return                       # the fit prices the policy's steps (whole blocks, plain: no work of it)
        # A learning cycle past the warm-up is always fitted (above); the warm-up's are all whole
        # blocks of one width, which the fit sees at the pace's turns as well as at every one
        # (on the CPU demo pair the fit's 0.28 ms a step was 2.5 % of a step there).
        if not self.pace.due("fit") and not (learns and self._warm):
            return
        started = time.perf_counter()
        self.fit(seconds, widths, num_tokens, draft_width, drafting)
        self.pace.spent("fit", time.perf_counter() - started)

    def fit(self, seconds: float, widths: Seq[int], num_tokens: int, draft_width: int,
            drafting: int | None = None) -> None:
        """record_cycle's least squares, one step more."""
        # numpy: a 4 × 4 solve every step, where torch's per-op overhead would cost more than the math.
        plain, extra = self.plain_and_extra(widths, draft_width, drafting)
        x = np.array([plain + extra, extra, float(len(widths)), float(num_tokens)])
        self._xtx = HOST_WORK_MEMORY * self._xtx + np.outer(x, x)
        self._xty = HOST_WORK_MEMORY * self._xty + x * (seconds * 1e3)
        theta = self.solve()
        scale = max(0.1, float(theta[0]))
        self.forward_scale = scale
        self.marginal_scale = min(10.0, max(0.1, 1.0 + float(theta[1]) / scale))
        self.overhead_ms_per_seq = max(0.0, float(theta[2])) / scale
        self.overhead_ms_per_token = max(0.0, float(theta[3])) / scale
        self._intervals.clear()

    def solve(self) -> np.ndarray:
        """The fit's θ = (scale, δ, per_seq, per_token) from the running sums: ridge least squares
        toward the prior (the table is right: scale 1, δ 0), each term's ridge 1e-3 of its own
        moment; the scale held at its prior while the plain forwards have not varied apart from
        the sequences, and δ while the drafts have not varied apart from both (`identified`)."""
        xtx, xty = self._xtx, self._xty
        # Each term's ridge in its own units (1e-3 of its own sum of squares): one ridge for all,
        # 1e-3 of the mean, was set by the per-sequence and per-token terms (tens to hundreds a
        # step) and held δ, whose term is a few ms, at its prior — at 64 SmolLM2 requests the
        # steps said wider verifies cost nothing and the fit kept the table's price (round 54).
        ridge = 1e-3 * np.diag(xtx) + 1e-12
        prior = np.array([1.0, 0.0, 0.0, 0.0])
        plain_varies, drafts_vary = self.identified()
        free = [t for t, ok in ((0, plain_varies), (1, drafts_vary), (2, True), (3, True)) if ok]
        held = [t for t in range(4) if t not in free]
        theta = prior.copy()
        a = xtx[np.ix_(free, free)] + np.diag(ridge[free])
        b = xty[free] + ridge[free] * prior[free] - xtx[np.ix_(free, held)] @ prior[held]
        theta[free] = np.linalg.solve(a, b)
        return theta

    def identified(self) -> tuple[bool, bool]:
        """Whether the steps' plain forwards varied apart from their sequences, and their drafts
        apart from both (each term's moment left over once the others explain it, least squares,
        over its whole: above VARIES). Where a term has not — every step at one load verifying the
        same widths, one sequence at the whole block most simply, makes all three one constant —
        the time the table does not explain has no owner, and a ridge shared it among them: with 8
        ms of host work a step, one sequence, a joint fit priced the drafts at 1.69 × the table
        (scale 1.23 × δ's 1.38), and a dearer draft is one the allocation stops verifying
        (tests/test_adaptive.py::test_steps_that_all_verify_one_width_leave_the_drafts_at_the_tables_price).
        Only steps of other loads can price the forwards apart from the host's work per
        sequence, and only steps of other widths the drafts apart from both."""
        # Over (plain, extra, sequences): the fit's first term is plain + extra.
        to_plain = np.array([[1.0, -1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        z = to_plain @ self._xtx[:3, :3] @ to_plain.T
        return varies_apart(z, 0, [2]), varies_apart(z, 1, [0, 2])

    def plain_and_extra(self, widths: Seq[int], draft_width: int = 0,
                        drafting: int | None = None) -> tuple[float, float]:
        """The table's forward of these sequences' plain rows, and what it adds for their drafts."""
        plain = forwards_ms(self.costs, [0] * len(widths))
        return plain, max(0.0, forwards_ms(self.costs, widths, draft_width, drafting) - plain)

    def predicted_step_ms(self, widths: Seq[int], num_tokens: int, draft_width: int = 0) -> float:
        """What the fit says a decode-only step of these widths committing num_tokens costs (the
        quantity record_cycle fits, and allocate maximises tokens per, up to the scale)."""
        plain, extra = self.plain_and_extra(widths, draft_width)
        return self.forward_scale * (plain + self.marginal_scale * extra + self.overhead_ms_per_seq * len(widths)
                                     + self.overhead_ms_per_token * num_tokens)

    def depth_ratio(self, against: str = "plan") -> np.ndarray:
        """[L]: the survival to each depth the verifies realised ÷ what a prediction gave them
        (observe: over the depths each verify judged, j < k_b, decaying by DEPTH_MEMORY a
        verify), with DEPTH_PRIOR of prior at 1. against: the plan's prediction (each sequence's
        recent products) or, late, the cycle's own calibrated chances the widths were refined from."""
        predicted = self._depth[1 if against == "plan" else 2]
        return (self._depth[0] + DEPTH_PRIOR) / (predicted + DEPTH_PRIOR)

    @property
    def applies_depth(self) -> bool:
        """Whether the depth correction is learnt and applied: with BLOCKSPEC_ADAPTIVE_DEPTH=1, and
        wherever widths are refined after the draft (late: CPU). There the refinement allocates
        over products of per-slot calibrated chances, which understate surviving deep into a block
        (acceptances run together), so it cut blocks short: on the CPU demo pair at 8 sequences
        it verified k ≈ 2 of 7 where whole blocks ran 1.1 × faster (round 56)."""
        return APPLY_DEPTH or self.late

    def learn_depth(self, rows: np.ndarray, widths: Seq[int], accepted: Seq[int],
                    predicted: np.ndarray | None = None) -> None:
        """Survival by depth, realised against predicted (before this verify is learnt), over the
        judged depths only (j < k_b: past them, a block accepted whole says nothing): the plan's
        prediction, and `predicted` [B, L] where given (late: the cycle's own chances)."""
        k = np.asarray(widths, dtype=np.int64)[:, None]
        a = np.asarray(accepted, dtype=np.int64)[:, None]
        depth = np.arange(self.num_slots)[None]
        judged = depth < k
        self._depth *= DEPTH_MEMORY
        self._depth[0] += np.where(judged, depth < a, 0.0).sum(axis=0)
        self._depth[1] += np.where(judged, np.cumprod(self.calibration.predicted(rows), axis=1), 0.0).sum(axis=0)
        if predicted is not None:
            self._depth[2] += np.where(judged, np.cumprod(predicted, axis=1), 0.0).sum(axis=0)

    def corrected(self, probs: np.ndarray, apply: bool | None = None, against: str = "plan") -> np.ndarray:
        """Predicted p [B, L] with each depth's survival scaled by depth_ratio (kept ≤ 1 and never
        growing with depth), where the correction applies (applies_depth); else probs as they are.
        against: which prediction's ratio (depth_ratio).
        Why: each slot's p is calibrated on its own, and their product understates the chance of
        surviving deep into a block (acceptances run together: on the CPU demo pair the products
        of calibrated p gave 2.09 drafted tokens a cycle where 2.40 were accepted, and the
        deepest slots 0.42–0.50 where they realised 0.67–0.97 given their prefix), so the
        allocation undervalues wide blocks against narrow ones (BENCHMARKS, round 51)."""
        if not (self.applies_depth if apply is None else apply):
            return probs
        survival = np.minimum(np.cumprod(probs, axis=1) * self.depth_ratio(against)[None, : probs.shape[1]], 1.0)
        return conditionals(np.minimum.accumulate(survival, axis=1))

    def observe(self, seqs: Seq, confidence: torch.Tensor | None, widths: Seq[int], accepted: Seq[int],
                drafted_widths: Seq[int] | None = None) -> None:
        """After a verify (its host read done) of a step planned to be learnt from (step_observes:
        the runner reads its confidences only then): confidence [B, L] of the drafting sequences'
        drafts (rows of sequences with k_b = 0 are not judged), calibrated and learnt from.
        drafted_widths: where the widths were refined after the draft (`refined`), those it was
        drafted for: a sequence refined to k = 0 is judged nowhere, but its calibrated products
        still move its prediction (else a hopeless draft, never verified, would be planned and
        drafted for ever)."""
        drafted = [b for b, k in enumerate(drafted_widths if drafted_widths is not None else widths) if k > 0]
        if confidence is None or not self.adaptive or not drafted:
            return
        started = time.perf_counter()
        self.learn_from(seqs, confidence, widths, accepted, drafted)
        self.pace.spent("observe", time.perf_counter() - started)

    def learn_from(self, seqs: Seq, confidence: torch.Tensor, widths: Seq[int], accepted: Seq[int],
                   drafted: list[int]) -> None:
        """observe's learning, for the drafting sequences `drafted`."""
        confidence = confidence.double().cpu().numpy()[drafted]
        if confidence.shape[1] < self.num_slots:                 # a narrower block: no word on the rest
            missing = np.full((confidence.shape[0], self.num_slots - confidence.shape[1]), math.nan)
            confidence = np.concatenate((confidence, missing), axis=1)
        rows = self.rows([seqs[b] for b in drafted])
        calibrated = self.calibration.calibrate(confidence, rows)
        if self.applies_depth:
            # Late, the widths were refined from this cycle's own calibrated chances: the survival
            # they predicted is what the realised one is held against.
            self.learn_depth(rows, [widths[b] for b in drafted], [accepted[b] for b in drafted],
                             np.nan_to_num(calibrated, nan=0.0) if self.late else None)
        mine = [accepted[b] for b in drafted]
        returning = np.isin(rows, self._returning) if len(self._returning) else None
        self.calibration.observe(confidence, calibrated, [widths[b] for b in drafted], mine, rows, returning)
        if returning is not None:
            self.judged_returns(rows[returning], np.asarray(mine)[returning])
