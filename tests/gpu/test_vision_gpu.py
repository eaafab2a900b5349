"""Images on the GPU (issue 35): the vision tower on CUDA against the same tower on CPU (fp32) and
in bf16 on a 1024 × 1024 image (fused attention over 4096 patches); whole VL targets decoding
an image request next to text requests with CUDA graphs on, DFlash equal to plain and batched
equal to alone; the graphs' replay of image sequences' steps (FULL decode / verify and propose,
PIECEWISE text chunks after an image) equal to the eager engine's."""
from __future__ import annotations

import hashlib

import pytest
import torch

from blockspec.engine.graphs import EAGER, FULL, PIECEWISE
from blockspec.llm import LLM
from blockspec.multimodal.processor import ImageInput
from blockspec.sampling import SamplingParams
from vision_fixtures import (IMAGE_TOKEN_ID, KINDS, VISION_END_ID, VISION_START_ID, record_forwards,
                             write_vl_checkpoint, write_vl_draft)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def random_image(height: int, width: int, patch: int, seed: int) -> ImageInput:
    """A processed image of height × width pixels: random values, no Pillow needed."""
    grid = (1, height // patch, width // patch)
    pixels = torch.rand(grid[1] * grid[2], 3 * 2 * patch * patch, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return ImageInput(pixels, grid, grid[1] * grid[2] // 4, hashlib.sha256(pixels.numpy().tobytes()).digest())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vision-gpu")
    return {kind: write_vl_checkpoint(root / kind, kind)[0] for kind in KINDS}


def test_tower_on_cuda_equals_cpu_and_bf16_runs_a_large_image(checkpoints):
    cpu = LLM(str(checkpoints["qwen3_vl"]), device="cpu", show_progress=False, max_model_len=512,
              kv_cache_memory=16 << 20).target.visual
    gpu = LLM(str(checkpoints["qwen3_vl"]), device="cuda", dtype="float32", show_progress=False, max_model_len=512,
              cuda_graphs=False, num_gpu_blocks=64).target.visual
    images = [random_image(40, 56, 4, 1), random_image(72, 32, 4, 2)]
    patches = torch.cat([i.pixel_values for i in images])
    grids = [i.grid for i in images]
    with torch.inference_mode():
        ref, got = cpu(patches, grids), gpu(patches.cuda(), grids)
        torch.testing.assert_close(got.embeds.cpu(), ref.embeds, atol=1e-4, rtol=1e-4)
        for tap, ref_tap in zip(got.deepstack, ref.deepstack):
            torch.testing.assert_close(tap.cpu(), ref_tap, atol=1e-4, rtol=1e-4)
        large = random_image(1024, 1024, 4, 3)
        full = gpu(large.pixel_values.cuda(), [large.grid]).embeds
        half = gpu.to(torch.bfloat16)(large.pixel_values.cuda().bfloat16(), [large.grid]).embeds
    assert torch.isfinite(half).all()
    assert ((half.float() - full).norm() / full.norm()).item() < 3e-2


@pytest.mark.parametrize("kind", KINDS)
def test_image_and_text_requests_dflash_equals_plain_with_graphs(kind, checkpoints, tmp_path):
    draft = write_vl_draft(tmp_path / "draft", checkpoints[kind])
    common = dict(device="cuda", show_progress=False, max_model_len=1024, num_gpu_blocks=256, max_num_seqs=4)
    plain, spec = LLM(str(checkpoints[kind]), **common), LLM(str(checkpoints[kind]), draft=str(draft), **common)

    def requests(llm: LLM, tag: str):
        image_ids, prompt = llm.image_prompt([11, 12, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, 13, 14],
                                             [random_image(40, 56, 4, 5)])
        return [llm.make_request(f"{tag}-image", image_ids, GREEDY, multimodal=prompt),
                llm.make_request(f"{tag}-text", [21, 22, 23, 24, 25], GREEDY)]

    alone = []
    for request in requests(plain, "alone"):
        plain.generate_requests([request])
        alone.append(request.output_ids)
    for llm, tag in ((plain, "plain"), (spec, "spec")):
        batch = requests(llm, tag)
        llm.generate_requests(batch)
        assert [r.output_ids for r in batch] == alone, tag


@pytest.mark.parametrize("kind", KINDS)
def test_image_sequences_replay_graphs_like_the_eager_engine(kind, checkpoints, tmp_path):
    """fp32, an image request (40 text rows after its image) beside a text request, prefilled in
    chunks of a 24-token budget, plain and DFlash: with graphs captured, every decode / verify step
    and every propose holding the image sequence replays a FULL graph, its text-only chunks a
    PIECEWISE one, only chunks reaching image rows run eagerly; outputs equal the same engine's
    with cuda_graphs=False."""
    draft = write_vl_draft(tmp_path / "draft", checkpoints[kind])
    common = dict(device="cuda", dtype="float32", show_progress=False, max_model_len=1024, num_gpu_blocks=256,
                  max_num_seqs=4, max_num_batched_tokens=24)
    tail = list(range(13, 53))
    for draft_dir in (None, str(draft)):
        outputs, seen = {}, []
        for graphs in (False, True):
            llm = LLM(str(checkpoints[kind]), draft=draft_dir, cuda_graphs=graphs, **common)
            if graphs:
                assert llm.engine.runner.graphs.num_graphs > 0
                seen = record_forwards(llm.engine.runner)
            image_ids, prompt = llm.image_prompt([11, 12, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] + tail,
                                                 [random_image(40, 56, 4, 6)])
            batch = [llm.make_request("image", image_ids, GREEDY, multimodal=prompt),
                     llm.make_request("text", [21, 22, 23, 24, 25], GREEDY)]
            llm.generate_requests(batch)
            outputs[graphs] = [r.output_ids for r in batch]
        assert outputs[True] == outputs[False], draft_dir
        with_images = [f for f in seen if f.images]
        assert {f.mode for f in with_images if not f.prefill} == {FULL}, draft_dir
        assert any(f.text and not (f.prefill or f.draft) for f in with_images), draft_dir
        assert {f.mode for f in with_images if f.prefill and not f.image_rows} == {PIECEWISE}, draft_dir
        assert {f.mode for f in with_images if f.image_rows} == {EAGER}, draft_dir
        assert (draft_dir is not None) == any(f.draft for f in with_images)
