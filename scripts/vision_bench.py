"""Images on the GPU (issue 35): a Qwen3.5-4B-shaped multimodal target with its vision tower and a
DFlash draft, random weights. Prints one JSON line: the tower's milliseconds for one 1024 × 1024
image (1024 tokens), the time to first token of a request holding that image and 64 text tokens
(tower + prefill + first token, through the engine), and output tok/s of the text that follows,
plain and DFlash (forced acceptance: random drafts are never right), with their ratio.

    python scripts/vision_bench.py [--shape tiny] [--accept-len 6.5] [--max-tokens 256]

The vision config is Qwen3.5-4B's published one (depth 24, width 1024, 16 heads, patch 16,
merge 2, out 2560, no DeepStack); the pixels are random (Pillow's preprocessing is host work,
measured separately by --process on a machine that has Pillow)."""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
from unittest import mock

import torch

from blockspec import bench
from blockspec.bench.common import forced_accept, synchronize
from blockspec.config import EngineConfig
from blockspec.engine import model_runner
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request
from blockspec.multimodal.processor import ImageInput
from blockspec.multimodal.prompt import expand_prompt
from blockspec.sampling import SamplingParams

IMAGE_TOKEN_ID, VISION_START_ID, VISION_END_ID = 248056, 248053, 248054
VISION = {"qwen3.5-4b": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
                             patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2560,
                             num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh"),
          "tiny": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, in_channels=3, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                       num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")}
TEXT = {"qwen3.5-4b": "qwen3.5-4b", "tiny": "tiny-moe"}
MROPE_SECTION = {"qwen3.5-4b": [11, 11, 10], "tiny": [1, 1, 2]}        # rotary dims / 2, split t, h, w


def multimodal_shape(name: str) -> dict:
    text = {k: v for k, v in bench.SHAPES[TEXT[name]].items() if k not in ("architectures",)}
    flat = {k: v for k, v in text.items() if k not in ("draft_layers", "draft")}
    arch = "Qwen3_5MoeForConditionalGeneration" if "num_experts" in flat else "Qwen3_5ForConditionalGeneration"
    rope = {"rope_type": "default", "rope_theta": flat["rope_theta"], "mrope_interleaved": True,
            "partial_rotary_factor": flat["partial_rotary_factor"], "mrope_section": MROPE_SECTION[name]}
    return {**text, "architectures": [arch], "text_config": {**flat, "vocab_size": 248320, "rope_parameters": rope},
            "vision_config": VISION[name], "image_token_id": IMAGE_TOKEN_ID,
            "vision_start_token_id": VISION_START_ID, "vocab_size": 248320}


def random_image(side: int, patch: int, seed: int) -> ImageInput:
    """A processed side × side image: [side² / patch², 3 · 2 · patch²] values in [−1, 1]."""
    grid = (1, side // patch, side // patch)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(grid[1] * grid[2], 3 * 2 * patch * patch, generator=gen) * 2 - 1
    digest = hashlib.sha256(pixels.numpy().tobytes()).digest()
    return ImageInput(pixels, grid, grid[1] * grid[2] // 4, digest)


def image_request(name: str, seed: int, max_tokens: int, max_model_len: int) -> Request:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1000, 100000, (64,), generator=gen).tolist()
    ids = text[:32] + [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] + text[32:]
    ids, prompt = expand_prompt(ids, [random_image(1024, 16, seed)], IMAGE_TOKEN_ID, 2)
    return Request(name, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(), max_model_len,
                   multimodal=prompt)


def run_engine(target, draft, args) -> dict[str, float]:
    """TTFT of the image request (after a warm-up one), then decode tok/s of its text."""
    block = args.block_size if draft is not None else 1
    config = EngineConfig(max_model_len=2048, block_size=block, max_num_seqs=4, max_queue=4,
                          max_num_batched_tokens=2048, max_prefill_tokens=2048, num_gpu_blocks=args.pages,
                          speculation="fixed", prefix_cache=False)
    engine = Engine(target, draft, config)
    forcing = draft is not None
    with mock.patch.object(model_runner, "judge", forced_accept(args.accept_len) if forcing
                           else model_runner.judge):
        for seed, tokens in ((1, 8), (2, args.max_tokens)):
            request = image_request(f"image-{seed}", seed, tokens, config.max_model_len)
            synchronize()
            submitted = time.perf_counter()
            engine.submit(request, lambda event: None)
            while not request.output_ids:
                engine.step()
            synchronize()
            ttft = time.perf_counter() - submitted
            started, before = time.perf_counter(), len(request.output_ids)
            while not request.is_finished:
                engine.step()
            synchronize()
            seconds = time.perf_counter() - started
    result = {"ttft_ms": ttft * 1e3, "tok_s": (len(request.output_ids) - before) / seconds,
              "mean_acceptance_length": request.stats.mean_acceptance_length, "prompt_tokens": len(request.prompt_ids)}
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3.5-4b", choices=sorted(VISION))
    parser.add_argument("--accept-len", type=float, default=6.5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pages", type=int, default=1024, help="KV pages of each engine")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, _, target, draft = bench.build_models(multimodal_shape(args.shape), device, dtype, args.block_size)
    image = random_image(1024, 16, 0)
    patches = image.pixel_values.to(device, dtype)
    with torch.inference_mode():
        tower_ms = bench.timed(lambda: target.visual(patches, [image.grid]), repeat=5, warmup=2)
    plain = run_engine(target, None, args)
    spec = run_engine(target, draft, args)
    print(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "image_tokens": image.num_tokens, "tower_ms_1024px": round(tower_ms, 2),
                      "plain": {k: round(v, 2) for k, v in plain.items()},
                      "dflash": {k: round(v, 2) for k, v in spec.items()},
                      "dflash_over_plain": round(spec["tok_s"] / plain["tok_s"], 3)}))


if __name__ == "__main__":
    main()
