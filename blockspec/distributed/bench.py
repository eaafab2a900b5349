"""`blockspec bench --tensor-parallel-size N --shape S`: plain, DFlash and DFlash 2 throughput of
a bench shape (random weights) with the target split over N ranks, through the engine as `serve`
runs it. Every rank draws its weights from one seed in the same order, so the replicated ones
(norms, routers, the draft) are the same everywhere; each engine a measurement builds is built on
every rank (a Load message per engine). The forced acceptance (`--accept-len`) is rank 0's accept.
"""
from __future__ import annotations

import functools
import time
from typing import Any
from unittest import mock

import torch

from blockspec.bench import common as bench
from blockspec.config import EngineConfig
from blockspec.distributed.group import TPGroup
from blockspec.distributed.launch import Workers, leader
from blockspec.distributed.runner import LeaderRunner, Load
from blockspec.distributed.shard import shard_config, shard_modules
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.loader import build_empty, resolve_device
from blockspec.models.dflash import DFlashDraftModel, DraftConfig
from blockspec.models.registry import ARCHITECTURES

_MODELS: dict[tuple, tuple] = {}           # (shape, layers, block size, ranks) → target, DFlash, DFlash 2


def shape_models(tp: TPGroup, shape_name: str, layers: int | None, block_size: int, expert_parallel: bool,
                 device: torch.device, dtype: torch.dtype) -> tuple:
    """This rank's share of the shape's target with random weights, and whole drafts (cached)."""
    key = (shape_name, layers, block_size, expert_parallel, tp.size)
    if key not in _MODELS:
        _MODELS.clear()
        torch.manual_seed(0)
        shape = dict(bench.SHAPES[shape_name], **({"num_hidden_layers": layers} if layers else {}))
        target_cfg, draft_cfg = bench.shape_configs(shape, block_size)
        arch = target_cfg["architectures"][0]
        spec = ARCHITECTURES[arch]()
        with torch.device("meta"):
            full = spec.build(target_cfg, arch).config
        local = shard_config(target_cfg, full, tp.size, expert_parallel)

        def build():
            module = spec.build(local, arch)
            shard_modules(module, tp, expert_parallel)
            return module
        target = bench.random_init(build_empty(build, device, dtype))
        draft = bench.random_init(build_empty(lambda: DFlashDraftModel(DraftConfig.from_hf(draft_cfg)), device, dtype))
        _MODELS[key] = (target, draft, bench.build_dflash2(draft_cfg, device, dtype))
    return _MODELS[key]


def rank_engine(tp: TPGroup, shape_name: str, layers: int | None, block_size: int, expert_parallel: bool,
                device: str, draft_kind: str, config: EngineConfig) -> tuple:
    """What a worker builds a runner from (Load's `make`): its models and rank 0's config."""
    torch_device = resolve_device(device)
    dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    target, dflash, dflash2 = shape_models(tp, shape_name, layers, block_size, expert_parallel, torch_device, dtype)
    return target, {"plain": None, "dflash": dflash, "dflash2": dflash2}[draft_kind], config


def throughput(workers: Workers, key: tuple, draft_kind: str, block_size: int, concurrency: int, prompt_len: int,
               max_tokens: int, accept_len: float | None) -> dict[str, float]:
    """bench.throughput on every rank: the same engine config, rank 0's runner leading."""
    config = EngineConfig(**{"max_model_len": prompt_len + max_tokens + 8, **bench.ENGINE_OPTIONS},
                          block_size=block_size if draft_kind != "plain" else 1, max_num_seqs=concurrency,
                          max_queue=concurrency, max_prefill_tokens=prompt_len, speculation="fixed",
                          tensor_parallel_size=workers.tp.size, expert_parallel=key[3])
    workers.send(Load(rank_engine, (*key, draft_kind, config)))
    with workers.loading():
        target, draft, _ = rank_engine(workers.tp, *key, draft_kind, config)
    engine = Engine(target, draft, config,
                    make_runner=functools.partial(LeaderRunner, tp=workers.tp, on_fatal=workers.fatal))
    forcing = accept_len is not None and draft is not None
    with mock.patch.object(model_runner, "judge", bench.forced_accept(accept_len) if forcing else model_runner.judge):
        bench.run_batch(engine, concurrency, prompt_len, 8)                               # warm-up
        return bench.run_batch(engine, concurrency, prompt_len, max_tokens)


def run(args, tp_size: int) -> dict[str, Any]:
    device = resolve_device(args.device)
    block_size = int(str(args.block_size).split(",")[0])
    concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    workers = leader(tp_size, device.type)
    key = (args.shape, getattr(args, "layers", None), block_size, args.expert_parallel, str(device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = shape_models(workers.tp, *key[:4], device, dtype)[0]
    r: dict[str, Any] = {"shape": args.shape, "tensor_parallel_size": tp_size, "expert_parallel": args.expert_parallel,
                         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "block_size": block_size,
                         "forced_acceptance_length": args.accept_len, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens,
                         "rank_step_weight_GB": bench.step_weight_bytes(target) / 1e9}
    if device.type == "cuda":
        r["copy_bandwidth_TBps"] = bench.copy_bandwidth(device) / 1e12
        r["floor_ms_per_token"] = r["rank_step_weight_GB"] / r["copy_bandwidth_TBps"]    # one rank's share
    kinds = ["plain", "dflash"] + ([] if getattr(args, "no_dflash2", False) else ["dflash2"])
    for c in concurrency:
        row = {kind: throughput(workers, key, kind, block_size, c, args.prompt_len, args.max_tokens, args.accept_len)
               for kind in kinds}
        r[f"c{c}"] = {"plain_tok_s": row["plain"]["tok_s"], "plain_ms_per_step": row["plain"]["ms_per_cycle"],
                      "dflash_tok_s": row["dflash"]["tok_s"], "dflash_ms_per_cycle": row["dflash"]["ms_per_cycle"],
                      "dflash_acceptance_length": row["dflash"]["mean_acceptance_length"]}
        if "dflash2" in row:
            r[f"c{c}"].update(dflash2_tok_s=row["dflash2"]["tok_s"], dflash2_ms_per_cycle=row["dflash2"]["ms_per_cycle"])
        if "floor_ms_per_token" in r:
            r[f"c{c}"]["plain_step_over_rank_floor"] = row["plain"]["ms_per_cycle"] / r["floor_ms_per_token"]
    return r
