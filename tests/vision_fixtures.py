"""Tiny random vision-language checkpoints written by transformers itself: Qwen3-VL (dense text
model with DeepStack), Qwen3.5 (hybrid) and Qwen3.5-MoE, each with a tiny vision tower, a
preprocessor_config.json of the real layout (small pixel budget) and the real Qwen3 tokenizer
with Qwen's multimodal chat template (image parts → <|vision_start|><|image_pad|><|vision_end|>)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fixtures import ENDOFTEXT_ID, IM_END_ID, QWEN3_VOCAB_SIZE
from tokenizer_fixtures import QWEN3_5_CHAT_TEMPLATE, special_token_ids, write_tokenizer_files

KINDS = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
SPECIALS = special_token_ids("qwen3")
IMAGE_TOKEN_ID = SPECIALS["<|image_pad|>"]
VIDEO_TOKEN_ID = SPECIALS["<|video_pad|>"]
VISION_START_ID = SPECIALS["<|vision_start|>"]
VISION_END_ID = SPECIALS["<|vision_end|>"]

PATCH = 4                          # pixels per patch side: a merged token covers 8 × 8 pixels
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "patch_size": PATCH,
                "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48}}
VISION = dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
TEXT = dict(vocab_size=QWEN3_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            eos_token_id=IM_END_ID, bos_token_id=ENDOFTEXT_ID)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
IDS = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
           vision_end_token_id=VISION_END_ID)


def hf_vl_model(kind: str) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    vision = dict(VISION, out_hidden_size=TEXT["hidden_size"])
    if kind == "qwen3_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        config = tf.Qwen3VLConfig(text_config=text, vision_config=dict(vision, deepstack_visual_indexes=[0, 1]),
                                  **IDS)
        return tf.Qwen3VLForConditionalGeneration(config)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    if kind == "qwen3_5":
        config = tf.Qwen3_5Config(text_config=dict(TEXT, **HYBRID, rope_parameters=rope), vision_config=vision, **IDS)
        return tf.Qwen3_5ForConditionalGeneration(config)
    if kind == "qwen3_5_moe":
        config = tf.Qwen3_5MoeConfig(text_config=dict(TEXT, **HYBRID, **EXPERTS, rope_parameters=rope),
                                     vision_config=vision, **IDS)
        return tf.Qwen3_5MoeForConditionalGeneration(config)
    raise ValueError(kind)


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every weight off its init, and sharp logits so greedy choices are clear-cut."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))
        model.model.language_model.norm.weight.add_(8.0)


def write_vl_checkpoint(directory: Path, kind: str) -> tuple[Path, torch.nn.Module]:
    """save_pretrained of a tiny random model of `kind`, its preprocessor config and tokenizer;
    returns the directory and the model as saved (the reference)."""
    from transformers import GenerationConfig
    model = hf_vl_model(kind).eval()
    randomise(model)
    model.generation_config = GenerationConfig(eos_token_id=[IM_END_ID, ENDOFTEXT_ID], bos_token_id=ENDOFTEXT_ID)
    model.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    write_tokenizer_files(directory, "qwen3")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN3_5_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return directory, model


def write_vl_draft(directory: Path, target_dir: Path, block_size: int = 8) -> Path:
    """A random DFlash draft for a multimodal target (the draft reads its text model's shape)."""
    from fixtures import write_dflash_draft
    shim = directory.parent / (directory.name + "-text-config")
    shim.mkdir(parents=True, exist_ok=True)
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    (shim / "config.json").write_text(json.dumps(text))
    return write_dflash_draft(directory, shim, block_size=block_size)


def hf_processor(directory: Path):
    """transformers' own Qwen3-VL processor (its Pillow image processor) for a checkpoint."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        # Without torchvision transformers cannot resolve the video processor's class; images need none.
        def check_argument_for_proper_class(self, name, arg):
            return None

    image_processor = Qwen2VLImageProcessorPil(**json.loads((directory / "preprocessor_config.json").read_text()))
    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(directory))


def random_image(height: int, width: int, seed: int, mode: str = "RGB"):
    import numpy as np
    from PIL import Image
    channels = 4 if mode == "RGBA" else 3
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def data_url(image, fmt: str = "PNG") -> str:
    import base64
    import io
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@dataclass(frozen=True)
class PlannedForward:
    """One forward of a runner as its dispatcher planned it."""
    draft: bool                        # the draft's propose (else the target's)
    mode: str                          # FULL, PIECEWISE or EAGER
    prefill: bool                      # it carries prefill chunks
    images: bool                       # a sequence with images has rows in it
    text: bool                         # so does one without
    image_rows: bool                   # a prefill chunk reaches an image's rows


def record_forwards(runner) -> list[PlannedForward]:
    """The plans of every forward the runner prepares from now on (appended as they run)."""
    from blockspec.engine.multimodal import rope_offset
    seen: list[PlannedForward] = []
    prepare = runner.prepare

    def spy(entries, num_prefill_seqs, plan, uniform=False):
        seen.append(PlannedForward(uniform, plan.mode, num_prefill_seqs > 0,
                                   any(e.seq.request.multimodal is not None for e in entries),
                                   any(e.seq.request.multimodal is None for e in entries),
                                   any(rope_offset(e) is None for e in entries)))
        return prepare(entries, num_prefill_seqs, plan, uniform)
    runner.prepare = spy
    return seen
