"""The FP8 weight-only kernel against bf16 (cuBLAS through F.linear) at the Qwen3-8B linear
shapes, graphed, at M = 1, 16, 256 rows; the FP8 × FP8 kernel at 256; per-channel scales
against 128 × 128 blocks (speed here; accuracy: the relative error of each against the bf16
product); the auto-chosen tiles with the K split turned off. Then the sweep of the weight-only
variants (issue 33) at M = 1, 2, 4, 8, 16: the GEMV (rows a program, column tile, scale blocks an
iteration, warps, x broadcast, prefetch), tl.dot over 1-4 scale blocks an iteration (column tile,
warps, stages), each at K splits 1, 2, 4, 8 summed in the kernel; the chosen tiles
(`weight_only_tiles`) and, at one row, round 42's (the split summed by a second launch).

COPIES distinct weights per graph, so no weight is still in L2 from the replay before (a real
step reads every layer's weights once).

The sweep stays within --sweep-budget seconds (each row count gets its share, what one leaves
passes to the next; the most likely winners are timed first) and prints what it has: per
(M, linear) the three fastest and the chosen tiles, per M the best uniform tiles (one set for
the four linears, each at its best split) and one layer's sum of the best per linear against
the chosen tiles'. Every variant compiles a kernel (~0.5-2 s); --compile-workers processes
compile them ahead into Triton's on-disk cache while the main process times.

Usage: python scripts/fp8_kernel_bench.py [--out FILE] [--no-sweep | --sweep-only]
                                          [--sweep-budget SECONDS] [--compile-workers N]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from blockspec.bench import copy_bandwidth, graphed, timed
from blockspec.kernels import fp8 as K
from blockspec.layers import fp8

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096), "down_proj": (4096, 12288)}
ROWS = (1, 16, 256)
COPIES = 8
SWEEP_ROWS = (1, 2, 4, 8, 16)
SPLITS = (1, 2, 4, 8)
DEVICE = "cuda"          # the sweep's (a smoke run drives it on the CPU, Triton interpreted)


def per_linear_us(fn, copies: int) -> float:
    return timed(graphed(fn, torch.device(DEVICE)), repeat=30, warmup=3) * 1e3 / copies


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def shape_rows(name: str, out_features: int, in_features: int, bandwidth: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
               for _ in range(COPIES)]
    per_channel = fp8.ScaleBlock(rows=1, cols=in_features)
    blocks = [fp8.quantize(w) for w in weights]
    channels = [fp8.quantize(w, per_channel) for w in weights]
    rows = []
    for m in ROWS:
        x = (torch.randn(m, in_features, device="cuda", generator=gen)).to(torch.bfloat16)
        bf16_us = per_linear_us(lambda: [F.linear(x, w) for w in weights], COPIES)
        block_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None) for q, s in blocks],
                                 COPIES)
        channel_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, per_channel, None) for q, s in channels],
                                   COPIES)
        chosen = K.weight_only_tiles(m, out_features, in_features, K.num_sms(torch.device("cuda", 0)))
        unsplit = replace(chosen, split_k=1)
        unsplit_us = per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None, unsplit)
                                            for q, s in blocks], COPIES)
        ref = F.linear(x.float(), weights[0].float())
        row = {"linear": name, "N": out_features, "K": in_features, "M": m, "bf16_us": round(bf16_us, 2),
               "fp8_block_us": round(block_us, 2), "fp8_channel_us": round(channel_us, 2),
               "split_k": chosen.split_k, "fp8_block_unsplit_us": round(unsplit_us, 2),
               "bf16_over_fp8_block": round(bf16_us / block_us, 3),
               "fp8_block_GBps": round(out_features * in_features / block_us / 1e3, 1),
               "bf16_GBps": round(2 * out_features * in_features / bf16_us / 1e3, 1),
               "copy_GBps": round(bandwidth / 1e9, 1),
               "rel_err_block": relative_error(K.weight_only_linear(x, *blocks[0], fp8.ScaleBlock(), None), ref),
               "rel_err_channel": relative_error(K.weight_only_linear(x, *channels[0], per_channel, None), ref)}
        if m == 256:
            row["fp8_fp8_us"] = round(per_linear_us(
                lambda: [K.fp8_fp8_linear(x, q, s, fp8.ScaleBlock(), None) for q, s in blocks], COPIES), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ── the sweep ──────────────────────────────────────────────────────────────────────────────

def gemv(rows: int, block_n: int, k_blocks: int, warps: int, broadcast: bool = True, prefetch: bool = False,
         summed: bool = True) -> K.WeightOnlyTiles:
    return K.WeightOnlyTiles(rows, block_n, warps, 2, 1, gemv=True, k_blocks=k_blocks, reduce_in_kernel=summed,
                             broadcast_x=broadcast, prefetch=prefetch)


def dot(block_n: int, k_blocks: int, warps: int, stages: int) -> K.WeightOnlyTiles:
    return K.WeightOnlyTiles(16, block_n, warps, stages, 1, k_blocks=k_blocks, reduce_in_kernel=True)


# tl.dot tiles for 2-16 rows: round 42's 32 columns at 1, 2 and 4 scale blocks an iteration, then wider.
DOTS = [dot(32, 1, 4, 4), dot(32, 2, 4, 4), dot(32, 4, 4, 3), dot(64, 2, 4, 4), dot(64, 1, 4, 4),
        dot(32, 2, 4, 3), dot(64, 4, 8, 3), dot(16, 4, 4, 4), dot(32, 1, 4, 6)]


def candidates(m: int) -> list[K.WeightOnlyTiles]:
    """The variants timed at m rows (split_k set per shape later), most likely winners first:
    ≤ ~110 distinct kernels over all five row counts."""
    if m == 1:
        return [gemv(1, 32, 4, 4, broadcast=False),         # round 42's tiles, the split summed in the kernel
                gemv(1, 32, 4, 4), gemv(1, 16, 8, 4), gemv(1, 16, 4, 4), gemv(1, 32, 2, 4), gemv(1, 64, 2, 4),
                gemv(1, 32, 8, 8), gemv(1, 64, 4, 8), gemv(1, 32, 4, 8), gemv(1, 16, 4, 4, prefetch=True),
                gemv(1, 32, 2, 4, prefetch=True), gemv(1, 16, 8, 8, prefetch=True)]
    if m == 2:
        return [gemv(2, 16, 4, 4), gemv(2, 32, 2, 4), gemv(2, 32, 4, 8), gemv(2, 64, 2, 8),
                gemv(2, 16, 4, 4, prefetch=True), gemv(2, 32, 4, 4), gemv(2, 16, 8, 4),   # ~230 registers, these two
                gemv(2, 32, 4, 4, broadcast=False)] + DOTS
    if m == 4:
        return [gemv(4, 16, 4, 4), gemv(4, 32, 2, 4), gemv(4, 16, 2, 4), gemv(4, 32, 4, 8), gemv(4, 16, 8, 8),
                gemv(4, 16, 2, 4, prefetch=True), gemv(2, 32, 4, 4)] + DOTS
    if m == 8:
        return ([gemv(8, 16, 4, 4), gemv(8, 16, 2, 4)] + DOTS[:4] + [gemv(8, 32, 2, 8), gemv(8, 32, 4, 8),
                                                                     gemv(4, 16, 4, 4)] + DOTS[4:])
    return DOTS + [gemv(16, 16, 2, 4), gemv(16, 16, 4, 8), gemv(8, 16, 4, 4)]


def effective_splits(tiles: K.WeightOnlyTiles, in_features: int) -> list[int]:
    """SPLITS as weight_only_linear would cut K (duplicates dropped)."""
    return sorted({K.k_split(in_features, K.BLOCK * tiles.k_blocks, split)[0] for split in SPLITS})


def compile_key(m: int, tiles: K.WeightOnlyTiles, in_features: int) -> tuple:
    """What decides the kernel Triton compiles (the sizes' divisibility aside, equal here)."""
    split, k_per_split = K.k_split(in_features, K.BLOCK * tiles.k_blocks, tiles.split_k)
    return (m == 1, m % 16 == 0, m % tiles.block_m == 0, replace(tiles, split_k=min(split, 2)),
            in_features % k_per_split == 0)


_COMPILE_WEIGHTS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def compile_one(m: int, tiles: K.WeightOnlyTiles, in_features: int) -> str | None:
    """In a worker process: one launch of the variant on a 128-column weight (the same kernel
    the full shape compiles, into Triton's on-disk cache; a few µs of GPU). The error, if any."""
    if in_features not in _COMPILE_WEIGHTS:
        _COMPILE_WEIGHTS[in_features] = (torch.zeros(128, in_features, dtype=fp8.FP8, device=DEVICE),
                                         torch.ones(1, in_features // fp8.BLOCK, device=DEVICE))
    q, scale = _COMPILE_WEIGHTS[in_features]
    try:
        K.weight_only_linear(torch.zeros(m, in_features, dtype=torch.bfloat16, device=DEVICE), q, scale,
                             fp8.ScaleBlock(), None, tiles)
        torch.cuda.synchronize()
    except Exception as error:           # shared memory or registers: the timing loop reports it
        return str(error)[:200]
    return None


def sweep_entries(m: int, sms: int) -> list[tuple[str, dict[str, list[K.WeightOnlyTiles]]]]:
    """(label, {linear: tiles with their K split}) for m rows: the chosen tiles first (at one
    row, round 42's two launches next), then every candidate at each effective split."""
    chosen = {name: [K.weight_only_tiles(m, n, k, sms)] for name, (n, k) in SHAPES.items()}
    entries = [("chosen", chosen)]
    if m == 1:
        entries.append(("round42", {name: [replace(t[0], reduce_in_kernel=False)] for name, t in chosen.items()}))
    for tiles in candidates(m):
        entries.append(("sweep", {name: [replace(tiles, split_k=split) for split in effective_splits(tiles, k)]
                                  for name, (n, k) in SHAPES.items()}))
    return entries


def compile_jobs(sms: int) -> dict[tuple, tuple[int, K.WeightOnlyTiles, int]]:
    """Every distinct kernel of the sweep, in the order the timing loop needs them."""
    jobs: dict[tuple, tuple[int, K.WeightOnlyTiles, int]] = {}
    for m in SWEEP_ROWS:
        for _, per_linear in sweep_entries(m, sms):
            for name, tiles_list in per_linear.items():
                for tiles in tiles_list:
                    jobs.setdefault(compile_key(m, tiles, SHAPES[name][1]), (m, tiles, SHAPES[name][1]))
    return jobs


def start_compiles(workers: int, sms: int) -> tuple[ProcessPoolExecutor | None, dict[tuple, Future]]:
    if workers <= 0:
        return None, {}
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    return pool, {key: pool.submit(compile_one, *job) for key, job in compile_jobs(sms).items()}


def tiles_label(tiles: K.WeightOnlyTiles) -> str:
    kind = "gemv" if tiles.gemv else "dot"
    flags = ((" sum-in-kernel", tiles.reduce_in_kernel), (" broadcast-x", tiles.broadcast_x),
             (" prefetch", tiles.prefetch))
    extra = "".join(flag for flag, on in flags if on)
    return (f"{kind} m{tiles.block_m} n{tiles.block_n} kb{tiles.k_blocks} w{tiles.num_warps} s{tiles.num_stages}"
            f"{extra}")


def time_variant(x: torch.Tensor, blocks: list, tiles: K.WeightOnlyTiles) -> float:
    return per_linear_us(lambda: [K.weight_only_linear(x, q, s, fp8.ScaleBlock(), None, tiles) for q, s in blocks],
                         COPIES)


def sweep_rows(m: int, label: str, per_linear: dict, inputs: dict, deadline: float) -> tuple[list[dict], bool]:
    """Times one entry at m rows until the deadline; (rows, whether it finished)."""
    out = []
    for name, tiles_list in per_linear.items():
        n, k = SHAPES[name]
        x, blocks = inputs[name]
        for tiles in tiles_list:
            if time.perf_counter() > deadline:
                return out, False
            row = {"M": m, "linear": name, "label": label, "config": tiles_label(tiles), "split_k": tiles.split_k,
                   "tiles": asdict(tiles)}
            try:
                us = time_variant(x, blocks, tiles)
            except Exception as error:          # a tile that does not fit (shared memory, registers)
                print(json.dumps({**row, "error": str(error)[:160]}), flush=True)
                continue
            out.append({**row, "us": round(us, 2), "GBps": round(n * k / us / 1e3, 1)})
    return out, True


def report_rows(m: int, rows: list[dict]) -> dict:
    """Prints, per linear, the three fastest and the chosen tiles; per M the best uniform
    configs; returns one layer's sums."""
    best_us, chosen_us, best_tiles = 0.0, 0.0, {}
    for name in SHAPES:
        mine = [r for r in rows if r["linear"] == name]
        if not mine:
            continue
        ranked = sorted(mine, key=lambda r: r["us"])
        chosen = [r for r in mine if r["label"] in ("chosen", "round42")]
        fields = ("label", "config", "split_k", "us", "GBps")
        print(json.dumps({"M": m, "linear": name, "fastest": [{k: r[k] for k in fields} for r in ranked[:3]],
                          "chosen": [{k: r[k] for k in fields} for r in chosen]}), flush=True)
        best_us += ranked[0]["us"]
        best_tiles[name] = {k: ranked[0][k] for k in ("config", "split_k", "us")}
        chosen_us += next((r["us"] for r in chosen if r["label"] == "chosen"), float("nan"))
    uniform = uniform_configs(rows)
    print(json.dumps({"M": m, "best_uniform": uniform[:3]}), flush=True)
    return {"best_us": round(best_us, 2), "chosen_us": round(chosen_us, 2), "best_tiles": best_tiles,
            "best_uniform": uniform[:3]}


def uniform_configs(rows: list[dict]) -> list[dict]:
    """Configs timed on all four linears, by one layer's sum (each linear at its best split)."""
    by_config: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["label"] == "sweep":
            mine = by_config.setdefault(r["config"], {})
            if r["linear"] not in mine or r["us"] < mine[r["linear"]]["us"]:
                mine[r["linear"]] = r
    complete = [(sum(r["us"] for r in per.values()), config, per) for config, per in by_config.items()
                if len(per) == len(SHAPES)]
    return [{"config": config, "layer_us": round(total, 2), "splits": {name: per[name]["split_k"] for name in SHAPES}}
            for total, config, per in sorted(complete, key=lambda c: c[0])]


def sweep(budget: float, workers: int) -> dict:
    """The weight-only variants at SWEEP_ROWS within `budget` seconds."""
    device = torch.device(DEVICE)
    sms = K.num_sms(device)
    start = time.perf_counter()
    pool, futures = start_compiles(workers, sms)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    weights = {name: [fp8.quantize(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02) for _ in range(COPIES)]
               for name, (n, k) in SHAPES.items()}
    rows, per_layer, complete = [], {}, True
    for i, m in enumerate(SWEEP_ROWS):
        deadline = start + budget * (i + 1) / len(SWEEP_ROWS)      # time a row count leaves passes on
        inputs = {name: (torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16), weights[name])
                  for name, (n, k) in SHAPES.items()}
        mine: list[dict] = []
        for label, per_linear in sweep_entries(m, sms):
            claim_compiles(futures, m, per_linear)
            timed_rows, finished = sweep_rows(m, label, per_linear, inputs, deadline)
            mine += timed_rows
            if not finished:
                complete = False
                break
        rows += mine
        per_layer[m] = report_rows(m, mine)
        print(json.dumps({"M": m, "timed": len(mine), "elapsed_s": round(time.perf_counter() - start, 1)}), flush=True)
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)         # what a stop left queued is dropped
    summary = {m: {k: v[k] for k in ("best_us", "chosen_us")} for m, v in per_layer.items()}
    print(json.dumps({"per_layer_us (sum of the best per linear vs the chosen tiles)": summary}), flush=True)
    return {"budget_s": budget, "elapsed_s": round(time.perf_counter() - start, 1), "complete": complete,
            "sms": sms, "rows": rows, "per_layer": per_layer}


FP8_FP8_ROWS = (256, 512)


def fp8_fp8_sweep(budget: float) -> dict:
    """The FP8 × FP8 kernel's tiles (Fp8Fp8Tiles) at FP8_FP8_ROWS against cuBLAS's bf16 and the
    shipped tiles, per linear, within `budget` seconds shared by the (rows, linear) entries (the
    shipped tiles and bf16 first, always)."""
    start = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    grid = [K.Fp8Fp8Tiles(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8)
            for st in (3, 4, 5)]
    rows, per_layer, entry = [], {}, 0
    for m in FP8_FP8_ROWS:
        sums = {"bf16": 0.0, "shipped": 0.0, "best": 0.0}
        for name, (n, k) in SHAPES.items():
            entry += 1
            deadline = start + budget * entry / (len(FP8_FP8_ROWS) * len(SHAPES))   # what one leaves passes on
            x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            dense = [(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
            blocks = [fp8.quantize(w) for w in dense]
            bf16_us = per_linear_us(lambda: [F.linear(x, w) for w in dense], COPIES)
            shipped = K.fp8_fp8_tiles(m, n, K.num_sms(torch.device(DEVICE)))
            timed_tiles = []
            for tiles in [shipped] + [t for t in grid if t != shipped]:
                if timed_tiles and time.perf_counter() > deadline:     # the shipped tiles always
                    break
                try:
                    us = per_linear_us(lambda: [K.fp8_fp8_linear(x, q, s, fp8.ScaleBlock(), None, tiles)
                                                for q, s in blocks], COPIES)
                except Exception as error:                     # shared memory or registers
                    print(json.dumps({"M": m, "linear": name, "tiles": asdict(tiles), "error": str(error)[:120]}))
                    continue
                timed_tiles.append((us, tiles))
            ranked = sorted(timed_tiles, key=lambda t: t[0])
            shipped_us = next(us for us, t in timed_tiles if t == shipped)
            row = {"M": m, "linear": name, "bf16_us": round(bf16_us, 2), "shipped": asdict(shipped),
                   "shipped_us": round(shipped_us, 2), "timed": len(timed_tiles),
                   "fastest": [{"tiles": asdict(t), "us": round(us, 2)} for us, t in ranked[:3]]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            sums["bf16"] += bf16_us
            sums["shipped"] += shipped_us
            sums["best"] += ranked[0][0]
        per_layer[m] = {key: round(v, 2) for key, v in sums.items()}
        print(json.dumps({"M": m, "per_layer_us": per_layer[m]}), flush=True)
    return {"budget_s": budget, "elapsed_s": round(time.perf_counter() - start, 1), "rows": rows,
            "per_layer": per_layer}


def claim_compiles(futures: dict[tuple, Future], m: int, per_linear: dict) -> None:
    """The timing loop is about to compile what the workers have not: drop those jobs from their
    queue. Nothing waits: a kernel a worker is still compiling is compiled here too (the cache
    takes either), so a slow worker start costs nothing."""
    for name, tiles_list in per_linear.items():
        for tiles in tiles_list:
            future = futures.get(compile_key(m, tiles, SHAPES[name][1]))
            if future is not None:
                future.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--no-sweep", action="store_true")
    mode.add_argument("--sweep-only", action="store_true", help="only the sweep (no bf16 / FP8 × FP8 rows)")
    parser.add_argument("--sweep-budget", type=float, default=120.0, help="seconds the sweep may take (default 120)")
    parser.add_argument("--compile-workers", type=int, default=8,
                        help="processes compiling the sweep's kernels ahead (0: compile as they are timed)")
    parser.add_argument("--rows", default=None, help="the sweep's row counts (default 1,2,4,8,16)")
    parser.add_argument("--fp8-fp8-sweep", action="store_true",
                        help="only the FP8 × FP8 kernel's tiles at 256 and 512 rows (--sweep-budget seconds)")
    args = parser.parse_args()
    global SWEEP_ROWS
    if args.rows:
        SWEEP_ROWS = tuple(int(r) for r in args.rows.split(","))
    import triton
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copies": COPIES}
    if args.fp8_fp8_sweep:
        result["fp8_fp8_sweep"] = fp8_fp8_sweep(args.sweep_budget)
    elif not args.sweep_only:
        bandwidth = copy_bandwidth(torch.device("cuda"))
        result["rows"] = [r for name, (n, k) in SHAPES.items() for r in shape_rows(name, n, k, bandwidth)]
        total = {m: {key: sum(r[key] for r in result["rows"] if r["M"] == m)
                     for key in ("bf16_us", "fp8_block_us", "fp8_channel_us")} for m in ROWS}
        result["per_layer_us"] = total          # one Qwen3-8B layer's four linears
        print(json.dumps({"per_layer_us": total}))
    if not args.no_sweep and not args.fp8_fp8_sweep:
        result["sweep"] = sweep(args.sweep_budget, args.compile_workers)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
