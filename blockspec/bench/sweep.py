"""The default mode: plain and DFlash (1 and 2) throughput through the engine at each concurrency,
the bandwidth floor, other block sizes, and the peers on the same weights."""
from __future__ import annotations

import sys
import time
from typing import Any
from unittest import mock

import torch

from blockspec.bench.common import (SHAPES, bench_engine, build_dflash2, build_models, copy_bandwidth,
                                    forced_accept, release, run_batch, step_weight_bytes, weight_bytes)
from blockspec.bench.forward import (experts_kernel, forward_figures, graph_replay_ms, kernel_breakdown, kernel_name,
                                     readout_ms)
from blockspec.bench.peers import bench_transformers, bench_zlab
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.layers.moe import SparseMoE, grouped_experts, select_experts_kernel


def measure(engine: Engine, concurrency: int, prompt_len: int, max_tokens: int,
            accept_len: float | None) -> dict[str, float]:
    """Output tok/s of `concurrency` requests decoded together through the engine (a warm-up
    batch first), and the decode milliseconds per cycle of the batch."""
    forcing = accept_len is not None and engine.runner.draft is not None
    with mock.patch.object(model_runner, "judge", forced_accept(accept_len) if forcing else model_runner.judge):
        run_batch(engine, concurrency, prompt_len, 8)                                   # warm-up
        result = run_batch(engine, concurrency, prompt_len, max_tokens)
    return {**result, **graph_replay_ms(engine, concurrency)}


def sweep(target, draft, block_size: int, concurrency: list[int], prompt_len: int, max_tokens: int,
          accept_len: float | None) -> dict[int, dict[str, float]]:
    """measure() at each concurrency on one engine, released afterwards (its pool and graphs)."""
    engine = bench_engine(target, draft, block_size, max(concurrency), prompt_len, max_tokens)
    try:
        out = {}
        for c in concurrency:
            out[c] = measure(engine, c, prompt_len, max_tokens, accept_len)
            print(f"bench: {'DFlash' if draft is not None else 'plain'} at {c}: {out[c]['tok_s']:.1f} tok/s, "
                  f"{out[c]['ms_per_cycle']:.2f} ms a step", file=sys.stderr, flush=True)
        return out
    finally:
        del engine
        release()


def throughput(target, draft, block_size: int, concurrency: int, prompt_len: int, max_tokens: int,
               accept_len: float | None) -> dict[str, float]:
    """measure() at one concurrency on an engine of its own."""
    return sweep(target, draft, block_size, [concurrency], prompt_len, max_tokens, accept_len)[concurrency]


def run(shape_name: str, device: torch.device, vs: list[str], concurrency: list[int], accept_len: float | None,
        prompt_len: int, max_tokens: int, block_sizes: list[int], dflash2: bool = True,
        layers: int | None = None, breakdown: bool = False, quantization: str | None = None) -> dict[str, Any]:
    """layers: the shape's first `layers` layers only (a per-layer comparison where the whole
    model and a peer's copy do not both fit). quantization "fp8": after every bf16 figure, the
    target quantized in place and its plain step and DFlash cycle measured again (`fp8_side_by_side`)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_size = block_sizes[0]
    shape = dict(SHAPES[shape_name], **({"num_hidden_layers": layers} if layers else {}))
    target_cfg, draft_cfg, target, draft = build_models(shape, device, dtype, max(block_sizes))
    r: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                         "block_size": block_size, "forced_acceptance_length": accept_len,
                         "prompt_len": prompt_len, "max_tokens": max_tokens,
                         "num_hidden_layers": shape["num_hidden_layers"]}
    r["target_weight_GB"] = weight_bytes(target) / 1e9
    r["step_weight_GB"] = step_weight_bytes(target) / 1e9          # = target_weight_GB for dense targets
    r["draft_weight_GB"] = weight_bytes(draft) / 1e9
    moe_layers = [m for m in target.modules() if isinstance(m, SparseMoE)]
    if moe_layers:
        r["moe_kernel"] = kernel_name(select_experts_kernel(device, dtype))
    draft2 = build_dflash2(draft_cfg, device, dtype) if dflash2 else None
    if draft2 is not None:
        r["draft2_weight_GB"] = weight_bytes(draft2) / 1e9
    if device.type == "cuda":
        r["copy_bandwidth_TBps"] = copy_bandwidth(device) / 1e12
        r["floor_ms_per_token"] = r["step_weight_GB"] / r["copy_bandwidth_TBps"]
    if breakdown:
        if target.recurrent_shapes or moe_layers:
            r["breakdown"] = "dense targets only"
        else:
            for width in sorted({1, *block_sizes}):
                r[f"breakdown_w{width}"] = kernel_breakdown(target, device, width, prompt_len)
    plains = sweep(target, None, 1, concurrency, prompt_len, max_tokens, None)
    specs = sweep(target, draft, block_size, concurrency, prompt_len, max_tokens, accept_len)
    spec2s = sweep(target, draft2, block_size, concurrency, prompt_len, max_tokens, accept_len) if draft2 else {}
    for c in concurrency:
        plain, spec = plains[c], specs[c]
        r[f"c{c}"] = {"plain_tok_s": plain["tok_s"], "plain_ms_per_step": plain["ms_per_cycle"],
                      "dflash_tok_s": spec["tok_s"], "dflash_ms_per_cycle": spec["ms_per_cycle"],
                      "dflash_acceptance_length": spec["mean_acceptance_length"],
                      "dflash_over_plain": spec["tok_s"] / plain["tok_s"],
                      "dflash_cycle_over_plain_step": spec["ms_per_cycle"] / plain["ms_per_cycle"]}
        r[f"c{c}"].update(forward_figures(plain, spec, block_size))
        if c == concurrency[0]:
            for other in block_sizes[1:]:
                extra = throughput(target, draft, other, c, prompt_len, max_tokens, accept_len)
                r[f"c{c}"].update({f"dflash_b{other}_tok_s": extra["tok_s"],
                                   f"dflash_b{other}_ms_per_cycle": extra["ms_per_cycle"],
                                   f"dflash_b{other}_cycle_over_plain_step": extra["ms_per_cycle"] / plain["ms_per_cycle"],
                                   **forward_figures(plain, extra, other)})
            if moe_layers and "grouped-moe" in vs:
                with experts_kernel(moe_layers, grouped_experts):
                    grouped = throughput(target, None, 1, c, prompt_len, max_tokens, None)
                r[f"c{c}"].update({"grouped_moe_plain_ms_per_step": grouped["ms_per_cycle"],
                                   "grouped_moe_step_over_ours": grouped["ms_per_cycle"] / plain["ms_per_cycle"]})
        if draft2 is not None:
            spec2 = spec2s[c]
            r[f"c{c}"].update({"dflash2_tok_s": spec2["tok_s"], "dflash2_ms_per_cycle": spec2["ms_per_cycle"],
                               "dflash2_cycle_over_dflash1": spec2["ms_per_cycle"] / spec["ms_per_cycle"]})
        readers = {"dflash1": draft, **({"dflash2": draft2} if draft2 is not None else {})}
        r[f"c{c}"].update(readout_ms(readers, target.lm_head, c, block_size, device))
    first, last = f"c{concurrency[0]}", f"c{concurrency[-1]}"
    r["plain_throughput_ratio_last_over_first"] = r[last]["plain_tok_s"] / r[first]["plain_tok_s"]
    r["dflash_throughput_ratio_last_over_first"] = r[last]["dflash_tok_s"] / r[first]["dflash_tok_s"]
    if "floor_ms_per_token" in r:
        r["ratio_floor_over_plain_step_c1"] = r["floor_ms_per_token"] / r[first]["plain_ms_per_step"]
        r["ratio_plain_step_over_floor_c1"] = r[first]["plain_ms_per_step"] / r["floor_ms_per_token"]
    if device.type == "cuda" and "transformers" in vs:
        try:
            r["transformers"] = bench_transformers(target_cfg, target, device)
        except Exception as error:                   # a peer failing must not lose our own figures
            r["transformers"] = {"error": repr(error)[:500]}
        if "forward_ms_w1_ctx512" in r["transformers"]:
            r["ratio_transformers_step_over_ours"] = (r["transformers"]["forward_ms_w1_ctx512"]
                                                      / r[first]["plain_ms_per_step"])
    if device.type == "cuda" and "zlab" in vs:
        r["zlab"] = bench_zlab(target_cfg, draft_cfg, target, draft, device)
        r["ratio_zlab_plain_over_ours"] = r["zlab"]["plain_ms_per_token"] / r[first]["plain_ms_per_step"]
        r["ratio_zlab_cycle_over_ours"] = r["zlab"]["cycle_ms_b16"] / r[first]["dflash_ms_per_cycle"]
    if quantization == "fp8":
        r["fp8_side_by_side"] = fp8_side_by_side(r, target, draft, block_size, concurrency, prompt_len, max_tokens,
                                                 accept_len)
        print_side_by_side(r["fp8_side_by_side"])
    return r


def fp8_side_by_side(r: dict[str, Any], target, draft, block_size: int, concurrency: list[int], prompt_len: int,
                     max_tokens: int, accept_len: float | None) -> dict[str, Any]:
    """The target quantized in place (layers/fp8.py, as --quantization fp8 loads it; the draft
    stays bf16), then plain and DFlash at each concurrency beside the bf16 figures of `r`."""
    from blockspec.layers import fp8
    from blockspec.kernels.fp8 import has_fp8
    device = target.lm_head.weight.device
    if not has_fp8(device):
        return {"error": f"{device} has no FP8 (compute capability 8.9 or later)"}
    fp8.quantize_model(target)
    out: dict[str, Any] = {"weight_format": fp8.weight_format(target),
                           "step_weight_GB": fp8.step_weight_bytes(target) / 1e9}
    if "copy_bandwidth_TBps" in r:
        out["floor_ms_per_token"] = out["step_weight_GB"] / r["copy_bandwidth_TBps"]
    plains = sweep(target, None, 1, concurrency, prompt_len, max_tokens, None)
    specs = sweep(target, draft, block_size, concurrency, prompt_len, max_tokens, accept_len)
    for c in concurrency:
        plain, spec, bf16 = plains[c], specs[c], r[f"c{c}"]
        out[f"c{c}"] = {"bf16_plain_ms_per_step": bf16["plain_ms_per_step"], "fp8_plain_ms_per_step": plain["ms_per_cycle"],
                        "bf16_dflash_ms_per_cycle": bf16["dflash_ms_per_cycle"],
                        "fp8_dflash_ms_per_cycle": spec["ms_per_cycle"],
                        "bf16_dflash_tok_s": bf16["dflash_tok_s"], "fp8_dflash_tok_s": spec["tok_s"],
                        "fp8_plain_tok_s": plain["tok_s"],
                        "fp8_over_bf16_dflash_tok_s": spec["tok_s"] / bf16["dflash_tok_s"],
                        "fp8_dflash_acceptance_length": spec["mean_acceptance_length"]}
    return out


def print_side_by_side(figures: dict[str, Any]) -> None:
    if "error" in figures:
        print(f"fp8: {figures['error']}")
        return
    print(f"fp8 target ({figures['weight_format']}, {figures['step_weight_GB']:.2f} GB per step) beside bf16:")
    print(f"{'conc':>5} {'plain bf16':>11} {'plain fp8':>10} {'cycle bf16':>11} {'cycle fp8':>10} "
          f"{'tok/s bf16':>11} {'tok/s fp8':>10} {'fp8/bf16':>9}")
    for key, row in figures.items():
        if key.startswith("c") and isinstance(row, dict):
            print(f"{key[1:]:>5} {row['bf16_plain_ms_per_step']:>11.3f} {row['fp8_plain_ms_per_step']:>10.3f} "
                  f"{row['bf16_dflash_ms_per_cycle']:>11.3f} {row['fp8_dflash_ms_per_cycle']:>10.3f} "
                  f"{row['bf16_dflash_tok_s']:>11.1f} {row['fp8_dflash_tok_s']:>10.1f} "
                  f"{row['fp8_over_bf16_dflash_tok_s']:>9.3f}")
