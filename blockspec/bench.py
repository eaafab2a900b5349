"""`blockspec bench`: speed on random weights of real shapes, side by side with peers in one run.

Everything is a ratio to something measured in the same process: the bandwidth floor (weight
bytes / measured copy bandwidth), transformers' forward, z-lab's reference loop.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from blockspec.config import ModelConfig
from blockspec.engine.plain import generate_plain
from blockspec.engine.request import Request
from blockspec.engine.speculative import generate_dflash
from blockspec.loader import build_empty, resolve_device
from blockspec.models.dflash import DFlashDraftModel, DraftConfig, default_target_layer_ids
from blockspec.models.qwen3 import Qwen3ForCausalLM
from blockspec.sampling import SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=256,
                 intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, rope_theta=1e6, max_position_embeddings=40960, draft_layers=2),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960, draft_layers=5),
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, draft_layers=5),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, rope_theta=5e5, max_position_embeddings=131072, draft_layers=5),
}


def timed(fn: Callable[[], Any], repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() with the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), repeat=10)
    return 2 * src.numel() * 2 / (ms / 1e3)


def random_init(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model


def build_models(shape: dict[str, Any], device: torch.device, dtype: torch.dtype):
    target_cfg = {k: v for k, v in shape.items() if k != "draft_layers"}
    config = ModelConfig.from_hf(target_cfg, target_cfg["architectures"][0])
    target = random_init(build_empty(lambda: Qwen3ForCausalLM(config), device, dtype))
    layer_ids = default_target_layer_ids(config.num_hidden_layers, shape["draft_layers"])
    draft_cfg = dict(target_cfg, num_hidden_layers=shape["draft_layers"], block_size=16,
                     dflash_config={"mask_token_id": 151669, "target_layer_ids": layer_ids})
    draft = random_init(build_empty(lambda: DFlashDraftModel(DraftConfig.from_hf(draft_cfg)), device, dtype))
    return target_cfg, draft_cfg, target, draft


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def decode_ms(target, prompt_len: int, steps: int) -> float:
    """Plain decoding ms per token after a prompt of prompt_len (the real loop, host syncs included)."""
    run_plain_once(target, prompt_len, steps)          # warm-up: first-call costs are not per-token costs
    return run_plain_once(target, prompt_len, steps)


def run_plain_once(target, prompt_len: int, steps: int) -> float:
    request = Request("bench", list(range(1000, 1000 + prompt_len)), SamplingParams(max_tokens=steps + 1),
                      frozenset(), prompt_len + steps + 8)
    for _ in generate_plain(target, request):
        pass
    return request.stats.decode_s * 1e3 / max(1, request.stats.cycles)


def dflash_cycle_ms(target, draft, prompt_len: int, block_size: int, cycles: int) -> float:
    run_dflash_once(target, draft, prompt_len, block_size, cycles)   # warm-up
    return run_dflash_once(target, draft, prompt_len, block_size, cycles)


def run_dflash_once(target, draft, prompt_len: int, block_size: int, cycles: int) -> float:
    request = Request("bench", list(range(1000, 1000 + prompt_len)), SamplingParams(max_tokens=cycles * block_size),
                      frozenset(), prompt_len + cycles * block_size + 8)
    events = generate_dflash(target, draft, request, block_size)
    for i, _ in enumerate(events):
        if request.stats.cycles >= cycles:
            events.close()
            break
    return request.stats.decode_s * 1e3 / max(1, request.stats.cycles)


def forward_ms(target, context: int, width: int) -> float:
    """One target forward of `width` new tokens over `context` cached ones."""
    cache = target.make_cache(context + width + 8)
    device = target.lm_head.weight.device
    with torch.inference_mode():
        target(torch.randint(0, 1000, (1, context), device=device), cache)
        ids = torch.randint(0, 1000, (1, width), device=device)

        def step():
            target(ids, cache)
            cache.trim(context)
        return timed(step)


def draft_ms(target, draft, block_size: int) -> float:
    """One draft of a block after 8 newly committed positions (eager model or static runner)."""
    weight = target.lm_head.weight
    device = weight.device
    cache = draft.make_cache(4096)
    with torch.inference_mode():
        feats = torch.randn(1, 512, len(draft.target_layer_ids) * target.hidden_size, device=device, dtype=weight.dtype)
        draft(target.embed(torch.zeros(1, block_size, dtype=torch.long, device=device)), feats, cache)
        new = feats[:, :block_size // 2]
        block = target.embed(torch.zeros(1, block_size, dtype=torch.long, device=device))

        def step():
            h = draft(block, new, cache)
            draft.read_logits(h[0, 1:], target.lm_head).argmax(-1)
            cache.trim(512)
        return timed(step)


def prefill_tokens_per_s(target, num_tokens: int = 2048) -> float:
    device = target.lm_head.weight.device
    ids = torch.randint(0, 1000, (1, num_tokens), device=device)

    def step():
        with torch.inference_mode():
            target(ids, target.make_cache(num_tokens), num_logits=1)
    return num_tokens / (timed(step, repeat=5) / 1e3)


def main(args) -> int:
    device = resolve_device(args.device)
    if device.type != "cuda":
        raise ValueError("blockspec bench needs a CUDA device")
    if args.shape not in SHAPES:
        raise ValueError(f"unknown --shape {args.shape!r} ({', '.join(SHAPES)})")
    results = run(args.shape, device, args.vs)
    print_table(results)
    if args.out:
        write_profiles(args.shape, device, args.out)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def run(shape_name: str, device: torch.device, vs: list[str]) -> dict[str, Any]:
    from blockspec.engine.cuda_graphs import StaticDraft, StaticTarget
    torch.manual_seed(0)
    shape = SHAPES[shape_name]
    target_cfg, draft_cfg, target, draft = build_models(shape, device, torch.bfloat16)
    r: dict[str, Any] = {"shape": shape_name, "device": torch.cuda.get_device_name(device),
                         "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    r["copy_bandwidth_TBps"] = copy_bandwidth(device) / 1e12
    r["target_weight_GB"] = weight_bytes(target) / 1e9
    r["draft_weight_GB"] = weight_bytes(draft) / 1e9
    r["floor_ms_per_token"] = r["target_weight_GB"] / r["copy_bandwidth_TBps"]
    r["prefill_tok_s_2k"] = prefill_tokens_per_s(target)
    r["eager_decode_ms_ctx512"] = decode_ms(target, 512, 16)
    graphed = StaticTarget(target, max_len=8192, max_width=16, capture_layers=draft.target_layer_ids)
    graphed_draft = StaticDraft(draft, max_len=8192, max_block=16)
    r["draft_graph_check"] = draft_graph_check(target, draft, graphed_draft)
    r["graph_check"] = graph_check(target, graphed)
    for ctx in (512, 4096):
        r[f"decode_ms_ctx{ctx}"] = decode_ms(graphed, ctx, 64)
    for width in (1, 4, 8, 16):
        r[f"forward_ms_w{width}_ctx512"] = forward_ms(graphed, 512, width)
    r["draft_ms_block16_eager"] = draft_ms(target, draft, 16)
    r["draft_ms_block16"] = draft_ms(target, graphed_draft, 16)
    r["dflash_cycle_ms_b16_eager_draft"] = dflash_cycle_ms(graphed, draft, 512, 16, 24)
    for block in (8, 16):
        r[f"dflash_cycle_ms_b{block}"] = dflash_cycle_ms(graphed, graphed_draft, 512, block, 24)
    step = r["decode_ms_ctx512"]
    r["ratio_floor_over_decode"] = r["floor_ms_per_token"] / step
    r["ratio_verify16_over_step"] = r["forward_ms_w16_ctx512"] / r["forward_ms_w1_ctx512"]
    r["projected_tok_s_b16"] = {str(tau): tau * 1e3 / r["dflash_cycle_ms_b16"] for tau in (2, 4, 6.5, 8)}
    r["peak_memory_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    del graphed, graphed_draft
    torch.cuda.empty_cache()
    if "transformers" in vs:
        r["transformers"] = bench_transformers(target_cfg, target, device)
        r["ratio_transformers_step_over_ours"] = r["transformers"]["forward_ms_w1_ctx512"] / r["forward_ms_w1_ctx512"]
    if "hybrid" in vs:
        r["hybrid_qwen3_5_4b"] = bench_hybrid(device)
    if "zlab" in vs:
        r["zlab"] = bench_zlab(target_cfg, draft_cfg, target, draft, device)
        r["ratio_zlab_cycle_over_ours"] = r["zlab"]["cycle_ms_b16"] / r["dflash_cycle_ms_b16"]
        r["ratio_zlab_plain_over_ours"] = r["zlab"]["plain_ms_per_token"] / r["decode_ms_ctx512"]
    return r


def graph_check(target, graphed) -> dict[str, Any]:
    """Graph replay must compute what the eager static path computes, step by step.

    Teacher-forced over the same 32 tokens (greedy tokens of random bf16 weights hinge on
    near-ties, so comparing free-running outputs would test luck, not the graphs)."""
    device = target.lm_head.weight.device
    prompt = torch.arange(2000, 2100, device=device)[None]
    tokens = torch.randint(0, 150000, (1, 32), device=device, generator=torch.Generator(device).manual_seed(0))
    diffs = {}
    with torch.inference_mode():
        eager_cache, graph_cache = target.make_cache(256), graphed.make_cache(256)
        target(prompt, eager_cache), graphed(prompt, graph_cache)
        step_diff = 0.0
        for i in range(32):
            eager = target(tokens[:, i:i + 1], eager_cache).logits.float()
            replay = graphed(tokens[:, i:i + 1], graph_cache).logits.float()
            step_diff = max(step_diff, float((eager - replay).abs().max()))
        eager = target(tokens[:, :8], eager_cache).logits.float()
        replay = graphed(tokens[:, :8], graph_cache).logits.float()
        diffs["decode_step_logits_max_abs_diff"] = step_diff
        diffs["verify8_logits_max_abs_diff"] = float((eager - replay).abs().max())
        diffs["verify8_argmax_equal"] = bool(torch.equal(eager.argmax(-1), replay.argmax(-1)))
    return diffs


def hf_config(target_cfg: dict[str, Any]):
    from transformers import AutoConfig
    cfg = {k: v for k, v in target_cfg.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(target_cfg["model_type"], **cfg)


def bench_transformers(target_cfg, target, device) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, DynamicCache
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config(target_cfg), dtype=torch.bfloat16).eval()
    hf.load_state_dict(target.state_dict(), strict=False)
    out: dict[str, Any] = {}
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

            def fwd(width=width):
                hf(new, past_key_values=cache, use_cache=True)
                cache.crop(512)
            out[f"forward_ms_w{width}_ctx512"] = timed(fwd, repeat=10)
            out["prefill_ms_512"] = prefill
    del hf
    torch.cuda.empty_cache()
    return out


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


def print_table(r: dict[str, Any]) -> None:
    width = max(len(k) for k in r)
    for key, value in r.items():
        text = json.dumps(value) if isinstance(value, (dict, list)) else (f"{value:.4g}" if isinstance(value, float) else str(value))
        print(f"{key:<{width}}  {text}")


def bench_hybrid(device: torch.device) -> dict[str, Any]:
    """Qwen3.5-4B-like hybrid (random bf16 weights, eager): a verify of 16 followed by a partial
    rollback must cost what a fully accepted one costs — rollback selects a saved state, it
    never runs the target again."""
    from transformers import Qwen3_5TextConfig
    from blockspec.models import qwen3_5
    config = Qwen3_5TextConfig(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                               vocab_size=248320, max_position_embeddings=8192).to_dict()
    config["architectures"] = ["Qwen3_5ForCausalLM"]
    model = random_init(build_empty(lambda: qwen3_5.ARCH_SPEC.build(config, "Qwen3_5ForCausalLM"), device, torch.bfloat16))
    out: dict[str, Any] = {"weight_GB": weight_bytes(model) / 1e9}
    with torch.inference_mode():
        cache = model.make_cache(4096)
        model(torch.randint(0, 1000, (1, 512), device=device), cache)
        one = torch.randint(0, 1000, (1, 1), device=device)
        block = torch.randint(0, 1000, (1, 16), device=device)
        out["plain_step_ms"] = timed(lambda: model(one, cache, num_logits=1), repeat=10)

        def verify_then_keep(accepted: int) -> None:
            start = cache.length
            logits = model(block, cache, keep_steps=True).logits
            int(logits[0, 0, 0].argmax())      # the host reads the acceptance length here
            cache.trim(start + accepted + 1)
        for accepted in (15, 7, 3, 0):
            out[f"verify16_keep{accepted + 1}_ms"] = timed(lambda a=accepted: verify_then_keep(a), repeat=10)
    full = out["verify16_keep16_ms"]
    out["partial_over_full"] = {k: v / full for k, v in out.items() if k.startswith("verify16_keep")}
    out["verify16_over_plain_step"] = full / out["plain_step_ms"]
    del model
    torch.cuda.empty_cache()
    return out


def draft_graph_check(target, draft, graphed_draft) -> dict[str, Any]:
    """The replayed draft equals the eager draft over a sequence of cycles (bf16)."""
    weight = target.lm_head.weight
    gen = torch.Generator(weight.device).manual_seed(1)
    dim = len(draft.target_layer_ids) * target.hidden_size
    diff = 0.0
    with torch.inference_mode():
        block = target.embed(torch.full((1, 16), 151669, device=weight.device))
        eager_cache, static_cache = draft.make_cache(1024), graphed_draft.make_cache(1024)
        for num in (100, 3, 16, 1, 9):
            feats = torch.randn(1, num, dim, device=weight.device, dtype=weight.dtype, generator=gen)
            a, b = draft(block, feats, eager_cache), graphed_draft(block, feats, static_cache)
            diff = max(diff, float((a.float() - b.float()).abs().max()))
    return {"hidden_max_abs_diff": diff}


def write_profiles(shape_name: str, device: torch.device, out_path: str) -> None:
    """Kernel-time breakdown of one eager static forward of 1 and of 16 tokens, for whoever
    speeds this up next (graph replays hide kernels from the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    _, _, target, _ = build_models(SHAPES[shape_name], device, torch.bfloat16)
    cache = target.make_cache(1024)
    with torch.inference_mode():
        target(torch.randint(0, 1000, (1, 512), device=device), cache)
        for width in (1, 16):
            ids = torch.randint(0, 1000, (1, width), device=device)
            positions = torch.arange(512, 512 + width, device=device)
            for _ in range(2):
                target(ids, cache, positions=positions)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                target(ids, cache, positions=positions)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
            with open(out_path.replace(".json", f"_profile_w{width}.txt"), "w") as f:
                f.write(table)
