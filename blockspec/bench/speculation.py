"""`bench --compare-speculation` (issue 21): plain / fixed block / adaptive, side by side, with the
acceptance forced or following a latent profile (`--accept-profile`)."""
from __future__ import annotations

import json
import sys
import time
import zlib
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch

from blockspec.bench.common import SHAPES, bench_engine, build_models, forced_accept, release, run_batch
from blockspec.bench.forward import graph_replay_ms
from blockspec.engine import model_runner
from blockspec.sampling import device_longs


LATENT_CHUNK = 1024


class LatentProfile:
    """`--accept-profile latent:MEAN[:CONCENTRATION]`: an acceptance model for random weights in
    which the draft's reported confidence is informative, seeded and the same for every mode.

    Each output position j of request r has a latent acceptance probability π_{r,j} ~
    Beta(m·κ, (1 − m)·κ) and a uniform u_{r,j} (both drawn from a generator seeded by
    (seed, r)). The draft reports confidence π for the token it drafts at position j, and that
    draft is accepted iff u < π (so P(accept | confidence c) = c exactly; the engine still
    calibrates it online). A verify of d_1 … d_k at positions j+1 … j+k accepts the prefix up
    to the first failure, capped at k. m is solved so that verifying the whole block of T gives
    mean acceptance length MEAN: 1 + Σ_{i<T} m^i = MEAN (the positions are independent). κ
    (default 1) sets how spread the difficulties are: small κ, most positions near-certain
    and a few near-hopeless (what confidence can find); large κ, every position ≈ m (nothing
    to find: adaptive can then only choose between the whole block and none).
    The same position has the same π and u whichever cycle drafts it, so plain, fixed and
    adaptive runs see the same text difficulty."""

    def __init__(self, mean_length: float, block_size: int, concentration: float = 1.0, seed: int = 0) -> None:
        if not 1.0 <= mean_length <= block_size:
            raise ValueError(f"the latent profile's mean acceptance length must be in [1, {block_size}]")
        if concentration <= 0:
            raise ValueError("the latent profile's concentration must be positive")
        self.mean_length, self.block_size, self.concentration, self.seed = mean_length, block_size, concentration, seed
        self.m = solve_mean_probability(mean_length, block_size)
        self._latents: dict[str, tuple[list[float], list[float]]] = {}
        self._offsets: dict[str, int] = {}            # slots: each request's start in the flat copy
        self._flat_pi, self._flat_u, self._flat_len = np.empty(0), np.empty(0), 0

    def latents(self, request, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(π, u) of the request's output positions 0 … length − 1 (at least), drawn in chunks of
        LATENT_CHUNK positions, each from its own seeded generator: any length gives the same
        values at the same positions. Arrays, so a cycle reads its slots as slices: this bench's
        own host work wraps every DFlash cycle it times and must stay small beside the engine's
        (a Python loop over each sequence's slots cost ~30 µs a sequence a cycle on CPU)."""
        key = request.request_id
        pi, u = self._latents.get(key, (np.empty(0), np.empty(0)))
        if len(pi) < length:
            a, b = max(self.m * self.concentration, 1e-3), max((1 - self.m) * self.concentration, 1e-3)
            new_pi, new_u = [pi], [u]
            for chunk in range(len(pi) // LATENT_CHUNK, -(-length // LATENT_CHUNK)):
                gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}:{chunk}".encode()))   # stable
                gamma_a = torch._standard_gamma(torch.full((LATENT_CHUNK,), a, dtype=torch.float64), generator=gen)
                gamma_b = torch._standard_gamma(torch.full((LATENT_CHUNK,), b, dtype=torch.float64), generator=gen)
                new_pi.append((gamma_a / (gamma_a + gamma_b).clamp_min(1e-300)).numpy())
                new_u.append(torch.rand(LATENT_CHUNK, generator=gen, dtype=torch.float64).numpy())
            pi, u = np.concatenate(new_pi), np.concatenate(new_u)
            self._latents[key] = (pi, u)
        return pi, u

    def slots(self, seqs, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """(π, u) [B, num_slots] of each sequence's draft slots 1 … num_slots this cycle: output
        positions from num_cached − prompt_len + 1 on (the anchor is the one before). Gathered
        with one index from a flat copy of every request's values (`_flat`): a slice and a
        stack per sequence cost ~15 µs a sequence a cycle, twice (the drafts' confidences and
        the verdict), which the bench charged to the speculative modes' cycles."""
        if not seqs:
            return np.empty((0, num_slots)), np.empty((0, num_slots))
        offsets = self._offsets
        starts = np.fromiter(((offsets.get(seq.request.request_id) if seq.request.request_id in offsets
                               else self._place(seq.request)) + seq.num_cached - len(seq.request.prompt_ids) + 1
                              for seq in seqs), dtype=np.int64, count=len(seqs))
        index = starts[:, None] + np.arange(num_slots)[None]
        return self._flat_pi[index], self._flat_u[index]

    def _place(self, request) -> int:
        """The request's (π, u) over every position it can reach, appended to the flat copy."""
        pi, u = self.latents(request, request.max_model_len + self.block_size + 1)
        offset, end = self._flat_len, self._flat_len + len(pi)
        if end > len(self._flat_pi):                   # doubling: a copy now and then, not per request
            size = max(end, 2 * len(self._flat_pi))
            self._flat_pi = np.concatenate((self._flat_pi, np.empty(size - len(self._flat_pi))))
            self._flat_u = np.concatenate((self._flat_u, np.empty(size - len(self._flat_u))))
        self._flat_pi[offset: end], self._flat_u[offset: end] = pi, u
        self._flat_len = end
        self._offsets[request.request_id] = offset
        return offset

    def propose(self, real: Callable):
        def propose(out, seqs, confidence: bool = False):
            proposal = real(out, seqs, confidence)
            proposal.confidence = torch.from_numpy(self.slots(seqs, proposal.drafts.shape[1])[0])
            return proposal
        return propose

    def judge(self, real: Callable):
        """A judge() whose accepted counts follow the profile (set on the device: an early draft
        reads them there); the target's tokens are the real verdict's."""
        def judge(seqs, proposal, logits, processed=None, widths=None):
            verdict = real(seqs, proposal, logits, processed, widths)          # the same device work
            if proposal is None:
                return verdict
            num_slots = proposal.drafts.shape[1]
            pi, u = self.slots(seqs, num_slots)
            # a = the leading slots with u < π, never past the sequence's own k
            kept = (u < pi) & (np.arange(num_slots)[None] < np.asarray(widths if widths is not None
                                                                        else [num_slots] * len(seqs))[:, None])
            accepted = np.cumprod(kept, axis=1).sum(axis=1)
            verdict.accepted = device_longs(accepted, logits.device).view(-1, 1)
            return verdict
        return judge


def solve_mean_probability(mean_length: float, block_size: int) -> float:
    """m with 1 + Σ_{i=1}^{T−1} m^i = mean_length (bisection; the sum grows with m)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        mid = (low + high) / 2
        if 1 + sum(mid ** i for i in range(1, block_size)) < mean_length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def parse_accept_profile(text: str | None, block_size: int) -> LatentProfile | None:
    """`latent:MEAN[:CONCENTRATION]` → a LatentProfile; None → none."""
    if text is None:
        return None
    parts = text.split(":")
    if parts[0] != "latent" or len(parts) not in (2, 3):
        raise ValueError(f"--accept-profile must be latent:MEAN[:CONCENTRATION], not {text!r}")
    try:
        values = [float(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"--accept-profile must be latent:MEAN[:CONCENTRATION], not {text!r}") from None
    return LatentProfile(values[0], block_size, *values[1:])


# Each point is a closed loop of this many times its concurrency in requests (run_batch): the
# latent profile gives every request its own acceptance, and a batch's slowest requests would
# otherwise set its time.
ROUNDS = 3


def speculation_sweep(target, draft, block_size: int, concurrency: list[int], prompt_len: int, max_tokens: int,
                      speculation: str, accept_len: float | None = None,
                      profile: LatentProfile | None = None) -> dict[int, dict[str, Any]]:
    """throughput() for one speculation mode (fixed | adaptive; plain is draft=None) at each
    concurrency, on one engine seated for the largest (its graphs and cost table made once), the
    acceptance forced (--accept-len) or following the latent profile; plus the mean width chosen
    and, where graphs were captured, one replay of each forward of the batch's size."""
    engine = bench_engine(target, draft, block_size, max(concurrency), prompt_len, max_tokens, speculation)
    patches = []
    if draft is not None and profile is not None:
        patches = [mock.patch.object(model_runner, "propose", profile.propose(model_runner.propose)),
                   mock.patch.object(model_runner, "judge", profile.judge(model_runner.judge))]
    elif draft is not None and accept_len is not None:
        patches = [mock.patch.object(model_runner, "judge", forced_accept(accept_len))]
    out = {}
    for patch in patches:
        patch.start()
    try:
        for c in concurrency:
            run_batch(engine, c, prompt_len, 8)                                          # warm-up
            engine.counters.spec_widths.clear()
            early = list(engine.runner.early_rows)
            result = run_batch(engine, c, prompt_len, max_tokens, rounds=ROUNDS)
            widths = engine.counters.spec_widths
            cycles = sum(widths.values())
            result["mean_width"] = sum(k * n for k, n in widths.items()) / cycles if cycles else 0.0
            result["width_counts"] = {int(k): int(n) for k, n in sorted(widths.items())}
            # Rows drafted early and those the next step took (engine/model_runner.py draft_ahead):
            # a gap is draft work thrown away (another width planned, a sequence ended).
            result["early_rows_drafted"], result["early_rows_taken"] = (
                engine.runner.early_rows[0] - early[0], engine.runner.early_rows[1] - early[1])
            out[c] = {**result, **graph_replay_ms(engine, c), **policy_state(engine)}
            print(f"bench: {speculation if draft is not None else 'plain'} at {c}: {result['tok_s']:.1f} tok/s, "
                  f"{result['ms_per_cycle']:.2f} ms a step, width {result['mean_width']:.2f}, early rows "
                  f"{result['early_rows_taken']} of {result['early_rows_drafted']} taken", file=sys.stderr, flush=True)
    finally:
        for patch in reversed(patches):
            patch.stop()
        del engine
        release()
    return out


def policy_state(engine) -> dict[str, Any]:
    """What the adaptive policy priced its widths with: the cost table measured at startup and its
    online fit of the steps' real time (so a choice that loses can be traced to the table or the fit)."""
    speculation = engine.runner.speculation
    if speculation.mode != "adaptive" or speculation.costs is None:
        return {}
    return {"cost_table": speculation.costs.describe(),
            "fit": {"forward_scale": round(speculation.forward_scale, 3), "marginal": round(speculation.marginal_scale, 3),
                    "per_seq_ms": round(speculation.overhead_ms_per_seq, 4),
                    "per_token_ms": round(speculation.overhead_ms_per_token, 4), "stride": speculation.pace.stride}}


def compare_speculation(shape_name: str, device: torch.device, concurrency: list[int], block_size: int,
                        prompt_len: int, max_tokens: int, accept_len: float | None,
                        profile: LatentProfile | None, quantization: str | None = None) -> dict[str, Any]:
    """`bench --compare-speculation`: plain, fixed block and adaptive tok/s at each concurrency,
    one process, one set of random weights (DFlash 1 draft), one engine per mode. quantization
    "fp8": then the target quantized in place (the draft stays bf16) and the three modes again,
    each FP8 figure beside its bf16 one (`fp8`): issue 33's ratio for the mode users run."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, _, target, draft = build_models(SHAPES[shape_name], device, dtype, block_size)
    r: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                         "block_size": block_size, "prompt_len": prompt_len, "max_tokens": max_tokens,
                         "acceptance": f"latent m={profile.m:.4f} mean={profile.mean_length} "
                                       f"kappa={profile.concentration}" if profile else f"forced {accept_len}"}
    def all_modes() -> dict[str, dict[int, dict[str, Any]]]:
        return {"plain": speculation_sweep(target, None, 1, concurrency, prompt_len, max_tokens, "fixed"),
                "fixed": speculation_sweep(target, draft, block_size, concurrency, prompt_len, max_tokens, "fixed",
                                           accept_len, profile),
                "adaptive": speculation_sweep(target, draft, block_size, concurrency, prompt_len, max_tokens,
                                              "adaptive", accept_len, profile)}
    modes = all_modes()
    for c in concurrency:
        r[f"c{c}"] = speculation_row({mode: results[c] for mode, results in modes.items()})
    if quantization == "fp8":
        r["fp8"] = fp8_modes(r, target, concurrency, all_modes)
    return r


def fp8_modes(r: dict[str, Any], target, concurrency: list[int], all_modes: Callable) -> dict[str, Any]:
    """The target quantized in place (layers/fp8.py, as --quantization fp8 loads it), the three
    modes measured again, and each beside its bf16 figure in `r`."""
    from blockspec.kernels.fp8 import has_fp8
    from blockspec.layers import fp8
    device = target.lm_head.weight.device
    if not has_fp8(device):
        return {"error": f"{device} has no FP8 (compute capability 8.9 or later)"}
    fp8.quantize_model(target)
    modes = all_modes()
    out: dict[str, Any] = {"weight_format": fp8.weight_format(target)}
    for c in concurrency:
        row = speculation_row({mode: results[c] for mode, results in modes.items()})
        bf16 = r[f"c{c}"]
        out[f"c{c}"] = {**row, **{f"{mode}_fp8_over_bf16": round(row[f"{mode}_tok_s"] / bf16[f"{mode}_tok_s"], 3)
                                  for mode in ("plain", "fixed", "adaptive")}}
    return out


def speculation_row(row: dict[str, dict[str, Any]]) -> dict[str, float]:
    plain, fixed, adaptive = (row[k]["tok_s"] for k in ("plain", "fixed", "adaptive"))
    return {**cycle_parts(row), "plain_tok_s": round(plain, 1), "fixed_tok_s": round(fixed, 1), "adaptive_tok_s": round(adaptive, 1),
            "fixed_acceptance_length": round(row["fixed"]["mean_acceptance_length"], 3),
            "adaptive_acceptance_length": round(row["adaptive"]["mean_acceptance_length"], 3),
            "adaptive_mean_width": round(row["adaptive"].get("mean_width", 0.0), 2),
            "adaptive_width_counts": row["adaptive"].get("width_counts", {}),
            **{f"adaptive_{k}": row["adaptive"][k] for k in ("cost_table", "fit") if k in row["adaptive"]},
            "adaptive_over_plain": round(adaptive / plain, 3), "adaptive_over_fixed": round(adaptive / fixed, 3),
            "adaptive_over_best": round(adaptive / max(plain, fixed), 3)}


def cycle_parts(row: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Where a step's time goes (ms): each mode's wall time per step, and for plain and the fixed
    block its graphed forwards replayed alone; what is left of the fixed cycle is the host's
    work and the launches between the two forwards."""
    parts = {f"{mode}_ms_per_step": round(row[mode]["ms_per_cycle"], 3) for mode in ("plain", "fixed", "adaptive")}
    if "verify_graph_ms" in row["plain"]:
        parts["plain_forward_ms"] = round(row["plain"]["verify_graph_ms"], 3)
    fixed = row["fixed"]
    if "verify_graph_ms" in fixed and "propose_graph_ms" in fixed:
        parts.update(fixed_verify_ms=round(fixed["verify_graph_ms"], 3), fixed_draft_ms=round(fixed["propose_graph_ms"], 3),
                     fixed_outside_forwards_ms=round(fixed["ms_per_cycle"] - fixed["verify_graph_ms"]
                                                     - fixed["propose_graph_ms"], 3))
    return parts


def print_speculation_table(r: dict[str, Any]) -> None:
    print(f"{r['shape']} on {r['device']}, block {r['block_size']}, acceptance {r['acceptance']}, "
          f"{r['max_tokens']} new tokens")
    print(f"{'conc':>5} {'plain':>9} {'fixed':>9} {'adaptive':>9} {'a/plain':>8} {'a/fixed':>8} {'a/best':>7} "
          f"{'width':>6}")
    for key, row in r.items():
        if key.startswith("c") and isinstance(row, dict):
            print(f"{key[1:]:>5} {row['plain_tok_s']:>9} {row['fixed_tok_s']:>9} {row['adaptive_tok_s']:>9} "
                  f"{row['adaptive_over_plain']:>8} {row['adaptive_over_fixed']:>8} {row['adaptive_over_best']:>7} "
                  f"{row['adaptive_mean_width']:>6}")
            if "fixed_verify_ms" in row:
                print(f"{'':>5} fixed cycle {row['fixed_ms_per_step']} ms = verify {row['fixed_verify_ms']} + draft "
                      f"{row['fixed_draft_ms']} + outside the forwards {row['fixed_outside_forwards_ms']}; "
                      f"plain step {row['plain_ms_per_step']} ms (forward {row.get('plain_forward_ms')})")


def print_fp8_table(figures: dict[str, Any]) -> None:
    if "error" in figures:
        print(f"fp8: {figures['error']}")
        return
    print(f"fp8 target ({figures['weight_format']}) beside bf16, tok/s and fp8 ÷ bf16:")
    print(f"{'conc':>5} {'plain':>9} {'fixed':>9} {'adaptive':>9} {'plain×':>7} {'fixed×':>7} {'adapt×':>7} {'width':>6}")
    for key, row in figures.items():
        if key.startswith("c") and isinstance(row, dict):
            print(f"{key[1:]:>5} {row['plain_tok_s']:>9} {row['fixed_tok_s']:>9} {row['adaptive_tok_s']:>9} "
                  f"{row['plain_fp8_over_bf16']:>7} {row['fixed_fp8_over_bf16']:>7} {row['adaptive_fp8_over_bf16']:>7} "
                  f"{row['adaptive_mean_width']:>6}")


def main_compare_speculation(args, device: torch.device, concurrency: list[int], block_size: int) -> int:
    profile = parse_accept_profile(getattr(args, "accept_profile", None), block_size)
    if profile is None and args.accept_len is None:
        raise ValueError("--compare-speculation on random weights needs --accept-profile or --accept-len")
    result = compare_speculation(args.shape, device, concurrency, block_size, args.prompt_len, args.max_tokens,
                                 args.accept_len, profile, getattr(args, "quantization", None))
    print_speculation_table(result)
    if "fp8" in result:
        print_fp8_table(result["fp8"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
