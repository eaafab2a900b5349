"""The peers on our weights (`--vs transformers`, `--vs zlab`), on CUDA."""
from __future__ import annotations

from typing import Any

import torch

from blockspec.bench.common import timed, weight_bytes


def hf_config(target_cfg: dict[str, Any]):
    from transformers import AutoConfig
    cfg = {k: v for k, v in target_cfg.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(target_cfg["model_type"], **cfg)


def transformers_layers(target_cfg: dict[str, Any], target: torch.nn.Module, device: torch.device) -> int:
    """All the target's layers if a second copy of its weights fits the device (with 10 % to
    spare), else the fewest whole cycles of the layer pattern (full_attention_interval) that do,
    at least 8 layers: forward times are then scaled by layers to a whole model's."""
    num_layers = target_cfg["num_hidden_layers"]
    free, _ = torch.cuda.mem_get_info(device)
    if weight_bytes(target) * 1.1 < free:
        return num_layers
    cycle = target_cfg.get("full_attention_interval", 1)
    return min(num_layers, max(8, cycle) // cycle * cycle)


def bench_transformers(target_cfg, target, device) -> dict[str, Any]:
    """transformers' forward of 1 and 16 tokens over a 512-token context, on our weights. Where two
    copies of the model do not fit (Qwen3.5-35B-A3B: 2 × 69 GB), the first layers only, and the
    times scaled by num_hidden_layers / layers (`scaled_to_all_layers`: embedding and head are
    then counted more than once, so the scaled figure overstates transformers' time slightly)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    layers = transformers_layers(target_cfg, target, device)
    cfg = dict(target_cfg, num_hidden_layers=layers)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.bfloat16).eval()
    hf.load_state_dict(target.state_dict(), strict=False)
    out: dict[str, Any] = {"layers": layers}
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (1, 512), device=device)
        for width in (1, 16):
            def step(width=width):
                cache = DynamicCache(config=hf.config)
                hf(ids, past_key_values=cache, use_cache=True)
            prefill = timed(step, repeat=3, warmup=1)
            cache = DynamicCache(config=hf.config)
            hf(ids, past_key_values=cache, use_cache=True)
            new = torch.randint(0, 1000, (1, width), device=device)
            can_crop = crop(cache, 512)
            out["cache_cropped"] = can_crop          # False (hybrids): the context grows by width per call

            def fwd(width=width, can_crop=can_crop):
                hf(new, past_key_values=cache, use_cache=True)
                if can_crop:
                    cache.crop(512)
            out[f"forward_ms_w{width}_ctx512"] = timed(fwd, repeat=10)
            out["prefill_ms_512"] = prefill
    if layers < target_cfg["num_hidden_layers"]:
        scale = target_cfg["num_hidden_layers"] / layers
        out["measured"] = {k: v for k, v in out.items() if k.endswith("ms_512") or "_ms_" in k}
        out.update({k: v * scale for k, v in out["measured"].items()}, scaled_to_all_layers=scale)
    del hf
    torch.cuda.empty_cache()
    return out


def crop(cache, length: int) -> bool:
    """Whether transformers' cache can be cut back to `length` (its recurrent layers cannot)."""
    try:
        cache.crop(length)
        return True
    except RuntimeError:
        return False


def bench_zlab(target_cfg, draft_cfg, target, draft, device) -> dict[str, Any]:
    """z-lab's reference loop (`dflash` wheel) on the same weights."""
    from dflash.model import DFlashDraftModel as ZDraft, dflash_generate
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(target_cfg), dtype=torch.bfloat16).eval()
        zcfg = hf_config(dict(draft_cfg, model_type="qwen3"))
        zcfg.dflash_config = draft_cfg["dflash_config"]
        zcfg.block_size = 16
        zcfg.num_target_layers = target_cfg["num_hidden_layers"]
        zdraft = ZDraft(zcfg).to(torch.bfloat16).eval()
    hf.load_state_dict(target.state_dict(), strict=False)
    zdraft.load_state_dict(draft.state_dict(), strict=False)
    ids = torch.randint(0, 1000, (1, 512), device=device)
    out = {}
    for block, key in ((1, "plain_ms_per_token"), (16, "cycle_ms_b16")):
        dflash_generate(zdraft, hf, ids, 8, None, block_size=block)  # warm-up
        stats = dflash_generate(zdraft, hf, ids, 48, None, block_size=block, return_stats=True)
        total_ms = stats.time_per_output_token * stats.num_output_tokens * 1e3
        out[key] = total_ms / (stats.num_output_tokens if block == 1 else max(1, len(stats.acceptance_lengths)))
    del hf, zdraft
    torch.cuda.empty_cache()
    return out
