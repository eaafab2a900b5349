"""The default mode: plain and DFlash (1 and 2) throughput through the engine at each concurrency,
the bandwidth floor, other block sizes, and the peers on the same weights."""
from __future__ import annotations

import time
from typing import Any
from unittest import mock

import torch

from blockspec.bench.common import (ENGINE_OPTIONS, SHAPES, build_dflash2, build_models, copy_bandwidth,
                                    forced_accept, run_batch, step_weight_bytes, weight_bytes)
from blockspec.bench.forward import (experts_kernel, forward_figures, graph_replay_ms, kernel_breakdown, kernel_name,
                                     readout_ms)
from blockspec.bench.peers import bench_transformers, bench_zlab
from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.layers.moe import SparseMoE, grouped_experts, select_experts_kernel
from blockspec.progress import track


def throughput(target, draft, block_size: int, concurrency: int, prompt_len: int, max_tokens: int,
               accept_len: float | None) -> dict[str, float]:
    """Output tok/s of `concurrency` requests decoded together through the engine (a warm-up
    batch first), and the decode milliseconds per cycle of the batch."""
    config = EngineConfig(**{"max_model_len": prompt_len + max_tokens + 8, **ENGINE_OPTIONS},
                          block_size=block_size if draft else 1, max_num_seqs=concurrency, max_queue=concurrency,
                          max_prefill_tokens=prompt_len,
                          speculation="fixed")      # the whole block: --compare-speculation measures adaptive
    engine = Engine(target, draft, config)
    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "accept", forced_accept(accept_len) if forcing else model_runner.accept):
        run_batch(engine, concurrency, prompt_len, 8)                                   # warm-up
        result = run_batch(engine, concurrency, prompt_len, max_tokens)
    return {**result, **graph_replay_ms(engine, concurrency)}


def run(shape_name: str, device: torch.device, vs: list[str], concurrency: list[int], accept_len: float | None,
        prompt_len: int, max_tokens: int, block_sizes: list[int], dflash2: bool = True,
        layers: int | None = None, breakdown: bool = False) -> dict[str, Any]:
    """layers: the shape's first `layers` layers only (a per-layer comparison where the whole
    model and a peer's copy do not both fit)."""
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
    for c in track(concurrency, f"bench {shape_name}", len(concurrency), "concurrency"):
        plain = throughput(target, None, 1, c, prompt_len, max_tokens, None)
        spec = throughput(target, draft, block_size, c, prompt_len, max_tokens, accept_len)
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
            spec2 = throughput(target, draft2, block_size, c, prompt_len, max_tokens, accept_len)
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
    return r
