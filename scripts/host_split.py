"""Where a decode step's wall time goes on the host, fixed block vs adaptive, side by side in one
process (issue 31: adaptive measured 0.90× fixed at 8 sequences on the H200 with the same
acceptance, i.e. a slower cycle, not fewer tokens). Each engine phase is wrapped with a wall
clock; `collect` includes waiting for the device. Then the adaptive run again under cProfile,
its top functions by own time; or (--torch-profile) the fixed run under torch's profiler, the
host's ops and the device's kernels outside the graphs by own time (issue 31: the hybrid cycle's
~4 ms outside its two graphed forwards).

    python scripts/host_split.py --shape qwen3-8b --concurrency 8 [--profile] [--torch-profile] [--sync-debug]

--profile-modes picks which runs go under cProfile (default: adaptive), printed by own time and by
cumulative time; --sync-debug runs a few of the first mode's decode cycles with torch's
synchronisation debug mode on, each host↔device sync once with the frames that made it (a hybrid
step launched 6× slower than a dense one on the H200: a sync is the first suspect).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings
from collections import Counter, defaultdict
from unittest import mock

import torch

from blockspec.bench.common import SHAPES, bench_engine, build_models, release, run_batch, synchronize
from blockspec.bench.speculation import parse_accept_profile
from blockspec.engine import model_runner
from blockspec.cache import StatePool
from blockspec.engine.engine import Engine
from blockspec.engine.graphs import GraphDispatcher
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.spec.policy import Speculation
from blockspec.models import gated_delta
from blockspec.models.base import CausalLM

PHASES = {"schedule": (Scheduler, "schedule"), "planned_widths": (Speculation, "planned_widths"),
          "launch": (ModelRunner, "launch"), "propose_for": (ModelRunner, "propose_for"),
          "learn": (ModelRunner, "learn"), "send_events": (Engine, "_send_events"),
          "draft_ahead": (ModelRunner, "draft_ahead"),
          "collect": (ModelRunner, "collect"), "step": (Engine, "step"),
          # finer, for a --trace timeline (their times are inside the ones above)
          "finish_decode": (ModelRunner, "finish_decode"), "state_select": (StatePool, "select"),
          "snapshot_boundaries": (ModelRunner, "snapshot_page_boundaries"), "prepare": (ModelRunner, "prepare"),
          "graph_run": (GraphDispatcher, "run"), "postprocess_decode": (Scheduler, "postprocess_decode"),
          # the model's own compute on CPU (with graph_run): step − these is the host's work
          "compute_logits": (CausalLM, "compute_logits"), "forward_step": (ModelRunner, "forward_step"),
          "first_tokens": (ModelRunner, "first_tokens"), "commit": (Engine, "_commit"),
          "emit_tokens": (Engine, "_emit_tokens"), "take_inbox": (Engine, "_take_inbox"),
          "drop_aborted": (Engine, "_drop_aborted")}


PROFILE_ONLY = ""                  # --profile-only: a regex of the files the profile prints (e.g. the engine's own)
CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter          # --clock cpu: this thread's CPU time (a CPU shared with other work)


def timed_phases(totals: dict[str, float], named: bool = False) -> list:
    """Each phase wrapped with a wall clock into totals; named: also a `phase:` range for a
    --trace timeline (not otherwise: its own host time would be in the figures)."""
    patches = []
    for name, (owner, attr) in PHASES.items():
        real = getattr(owner, attr)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            started = clock()
            try:
                if not named:
                    return _real(*args, **kwargs)
                with torch.profiler.record_function(f"phase:{_name}"):
                    return _real(*args, **kwargs)
            finally:
                totals[_name] += clock() - started
        patches.append(mock.patch.object(owner, attr, wrapper))
    return patches


def decoding(engine, concurrency: int, cycles: int, name: str, seed: int) -> list:
    """`concurrency` requests of 128 random prompt tokens submitted and stepped past their
    prefill, with room for `cycles` more decode cycles: what the measured steps then run."""
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.runner.target.config.vocab_size            # the host shape's is small
    requests = [Request(f"{name}-{i}", torch.randint(min(1000, vocab // 2), min(100000, vocab), (128,),
                                                     generator=gen).tolist(),
                        SamplingParams(max_tokens=cycles * 16 + 16), frozenset(), engine.config.max_model_len)
                for i in range(concurrency)]
    for request in requests:
        engine.submit(request, lambda event: None)
    while not all(r.output_ids for r in requests):
        engine.step()
    return requests


def torch_profiled(engine, concurrency: int, cycles: int = 12, trace: str | None = None) -> str:
    """`cycles` decode cycles under torch.profiler, after every request's prefill (so only
    what a cycle runs is in it): the host's ops by own CPU time, then the device's by own
    device time (a graph's replay is one cudaGraphLaunch on the host)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    requests = decoding(engine, concurrency, cycles, "profiled", seed=1)
    synchronize()
    totals: dict[str, float] = defaultdict(float)
    phases = timed_phases(totals, named=True) if trace else []
    for p in phases:
        p.start()
    with torch_profile(activities=activities) as prof:
        for _ in range(cycles):
            engine.step()
        synchronize()
    for p in reversed(phases):
        p.stop()
    if trace:
        prof.export_chrome_trace(trace)
    while not all(r.is_finished for r in requests):
        engine.step()
    table = prof.key_averages()
    text = table.table(sort_by="self_cpu_time_total", row_limit=45)
    if torch.cuda.is_available():
        text += "\n" + table.table(sort_by="self_cuda_time_total", row_limit=25)
    return text


def synced_cycles(engine, concurrency: int, cycles: int = 6) -> str:
    """`cycles` decode steps with torch.cuda's sync debug mode on: every operation that waits for
    the device, with the blockspec frames that called it, counted (after every prefill)."""
    requests = decoding(engine, concurrency, cycles, "synced", seed=2)
    seen: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "blockspec" in f.filename or "scripts" in f.filename]
        where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))
        seen[f"{str(message)[:60]} @ {where}"] += 1
    real_show = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(cycles):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = real_show
    while not all(r.is_finished for r in requests):
        engine.step()
    lines = [f"{n:4d} × {what}" for what, n in seen.most_common()]
    return f"syncs in {cycles} decode steps ({sum(seen.values())} in all):\n" + "\n".join(lines)


@contextlib.contextmanager
def plan_counting(plans: Counter):
    """Counts Speculation.planned_widths' outcomes into `plans`: "ahead" (plan_ahead's plan
    taken), "anew" (allocated on the critical path), "learning" (every cap), "fixed"."""
    real_planned, real_ahead, real_allocation = (Speculation.planned_widths, Speculation.ahead_widths,
                                                 Speculation.allocation)
    state = {"in": False, "how": None}

    def planned(self, seqs):
        state["in"], state["how"] = True, None
        try:
            widths = real_planned(self, seqs)
        finally:
            state["in"] = False
        if seqs:
            plans[state["how"] or ("learning" if self.adaptive else "fixed")] += 1
        return widths

    def ahead(self, plan, seqs):
        widths = real_ahead(self, plan, seqs)
        if widths is not None and state["in"]:
            state["how"] = "ahead"
        return widths

    def allocation(self, seqs, ahead: int = 0):
        if state["in"]:
            state["how"] = "anew"
        return real_allocation(self, seqs, ahead)
    with mock.patch.object(Speculation, "planned_widths", planned), \
            mock.patch.object(Speculation, "ahead_widths", ahead), \
            mock.patch.object(Speculation, "allocation", allocation):
        yield


def measure(target, draft, mode: str, concurrency: int, block: int, profile, use_cprofile: bool,
            use_torch_profile: bool = False, label: str | None = None, sync_debug: bool = False,
            trace: str | None = None, padded: bool = False) -> dict:
    engine = bench_engine(target, draft, block if draft is not None else 1, concurrency, 128, 128, mode)
    if padded and engine.runner.device.type != "cuda":      # the plans (buckets, padding) CUDA graphs run
        engine.runner.graphs = engine.runner.make_graphs(capture=False)
    patches = []
    if draft is not None:
        patches = [mock.patch.object(model_runner, "propose", profile.propose(model_runner.propose)),
                   mock.patch.object(model_runner, "judge", profile.judge(model_runner.judge))]
    for p in patches:
        p.start()
    try:
        run_batch(engine, concurrency, 128, 8)
        totals: dict[str, float] = defaultdict(float)
        counting = timed_phases(totals)
        for p in counting:
            p.start()
        steps_before = engine.scheduler._num_steps
        early_before = list(engine.runner.early_rows)
        plans: Counter = Counter()
        with plan_counting(plans):
            result = run_batch(engine, concurrency, 128, 128, rounds=3)
        for p in reversed(counting):
            p.stop()
        steps = engine.scheduler._num_steps - steps_before
        out = {"tok_s": round(result["tok_s"], 1), "ms_per_cycle": round(result["ms_per_cycle"], 3),
               "acceptance": round(result["mean_acceptance_length"], 3), "steps": steps,
               **{f"{k}_ms": round(v * 1e3 / steps, 3) for k, v in totals.items()}}
        # µs per sequence per step: each phase, and the host's whole share (the step less the
        # model's forwards and logits, which on CPU run inside launch)
        per_seq = {k: round(v * 1e6 / steps / concurrency, 2) for k, v in totals.items()}
        per_seq["host"] = round(per_seq["step"] - per_seq.get("graph_run", 0) - per_seq.get("compute_logits", 0), 2)
        out["us_per_seq"] = per_seq
        # How each step's widths were planned (adaptive: ahead, anew on the critical path, or a
        # learning cycle), and the early drafts' rows: drafted, taken by the next step, arrivals'.
        out["plans"] = dict(plans)
        out["early_rows"] = [b - a for a, b in zip(early_before, engine.runner.early_rows)]
        print(json.dumps({"mode": label or mode, "concurrency": concurrency, **out}), flush=True)   # before any profile
        if use_cprofile:
            prof = cProfile.Profile()
            prof.enable()
            run_batch(engine, concurrency, 128, 128, rounds=2)
            prof.disable()
            text = io.StringIO()
            only = (PROFILE_ONLY,) if PROFILE_ONLY else ()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(*only, 30)
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(*only, 45)
            out["profile"] = text.getvalue()
        if use_torch_profile:
            out["profile"] = torch_profiled(engine, concurrency, trace=trace)
        if sync_debug and torch.cuda.is_available():
            out["profile"] = out.get("profile", "") + "\n" + synced_cycles(engine, concurrency)
    finally:
        for p in reversed(patches):
            p.stop()
        del engine
        release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="also the --profile-modes runs under cProfile")
    ap.add_argument("--profile-modes", default="adaptive")
    ap.add_argument("--profile-only", default="", help="print only functions whose file matches this regex "
                                                        "(e.g. blockspec/: the host's own code, not torch's ops)")
    ap.add_argument("--trace", help="with --torch-profile: the profiled cycles' timeline (Chrome trace JSON, "
                                    "engine phases named), for scripts/trace_gaps.py")
    ap.add_argument("--sync-debug", action="store_true",
                    help="also a few decode steps of the first mode with torch.cuda's sync debug mode on")
    ap.add_argument("--torch-profile", action="store_true", help="also the --torch-profile-modes runs under torch.profiler")
    ap.add_argument("--torch-profile-modes", default="fixed",
                    help="which modes --torch-profile profiles (adaptive beside fixed: issue 31's 0.3 ms a step at 8)")
    ap.add_argument("--padded", action="store_true",
                    help="on CPU: the padded plans CUDA graphs run (without capture), not exact shapes")
    ap.add_argument("--accept-profile", default="latent:6.5")
    ap.add_argument("--clock", choices=list(CLOCK), default="wall",
                    help="cpu: each phase's CPU time on the engine thread (steadier where others share the CPU; "
                         "run with OMP_NUM_THREADS=1 so the forwards run on that thread)")
    ap.add_argument("--modes", default="fixed,adaptive",
                    help="of plain (no draft), fixed, adaptive, and fixed-unfused: fixed with the GDN output norm "
                         "outside the recurrent kernel for every verify (models/gated_delta.FUSE_NORM_MAX_ROWS = 1)")
    args = ap.parse_args()
    global clock, PROFILE_ONLY
    PROFILE_ONLY = args.profile_only
    clock = CLOCK[args.clock]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, _, target, draft = build_models(SHAPES[args.shape], device, dtype, args.block_size)
    profile = parse_accept_profile(args.accept_profile, args.block_size)
    for c in args.concurrency:
        for i, mode in enumerate(args.modes.split(",")):
            unfused = (mock.patch.object(gated_delta, "FUSE_NORM_MAX_ROWS", 1) if mode == "fixed-unfused"
                       else contextlib.nullcontext())
            with unfused:
                plain = mode == "plain"                  # no draft: plain decoding's step
                r = measure(target, None if plain else draft, "fixed" if plain else mode.split("-")[0], c,
                            args.block_size, profile,
                            args.profile and mode in args.profile_modes.split(","),
                            args.torch_profile and mode in args.torch_profile_modes.split(","), label=mode,
                            sync_debug=args.sync_debug and i == 0, trace=args.trace if i == 0 else None,
                            padded=args.padded)
            text = r.pop("profile", None)
            if text:
                print(text, flush=True)


if __name__ == "__main__":
    main()
