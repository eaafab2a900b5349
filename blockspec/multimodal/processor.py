"""The Qwen2-VL image processor as Qwen3-VL and Qwen3.5 checkpoints configure it
(preprocessor_config.json), in Pillow and numpy: RGB (transparency over white), resize so both
sides are multiples of patch · merge and the area lies in [min_pixels, max_pixels] (aspect kept
as closely as that allows), rescale and normalise, then cut into patches listed in 2 × 2
merge-block order, each patch repeated over the temporal patch size (an image is one frame).
tests/test_vision.py holds it equal to transformers' processor."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import torch

from blockspec.multimodal.fetch import ImageError

if TYPE_CHECKING:          # Pillow is imported where an image is processed (the engine never needs it)
    from PIL import Image

MAX_ASPECT_RATIO = 200        # transformers refuses more extreme images; so do we (a 400)


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536                   # Qwen3-VL's published budget (size.shortest_edge)
    max_pixels: int = 16777216                # (size.longest_edge)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3                         # PIL.Image.Resampling.BICUBIC

    @staticmethod
    def from_dir(path: Path) -> "ImageProcessorConfig":
        """preprocessor_config.json of a checkpoint (Qwen3-VL's published defaults where absent)."""
        file = Path(path) / "preprocessor_config.json"
        d = json.loads(file.read_text()) if file.is_file() else {}
        size = d.get("size") or {}
        base = ImageProcessorConfig()
        return ImageProcessorConfig(
            patch_size=int(d.get("patch_size", base.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(d.get("merge_size", base.merge_size)),
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or base.min_pixels),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or base.max_pixels),
            image_mean=tuple(float(v) for v in d.get("image_mean", base.image_mean)),
            image_std=tuple(float(v) for v in d.get("image_std", base.image_std)),
            rescale_factor=float(d.get("rescale_factor", base.rescale_factor)),
            do_rescale=bool(d.get("do_rescale", True)), do_normalize=bool(d.get("do_normalize", True)),
            resample=int(d.get("resample", base.resample)),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageInput:
    """One processed image: what the vision tower reads and what the prompt holds for it."""
    pixel_values: torch.Tensor                # [P, C · Tp · ps · ps] fp32, patches in merge-block order
    grid: tuple[int, int, int]                # (t, h, w) in patches
    num_tokens: int                           # merged tokens: its placeholder rows in the prompt
    digest: bytes                             # sha256 of the resized image and settings: the prefix cache's key


def fitted_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """Sides rounded to multiples of patch · merge, scaled into the pixel budget (aspect kept)."""
    factor = config.factor
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} exceeds "
                         f"{MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > config.max_pixels:
        scale = math.sqrt(height * width / config.max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < config.min_pixels:
        scale = math.sqrt(config.min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    from PIL import Image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: Image.Image, config: ImageProcessorConfig) -> ImageInput:
    height, width = fitted_size(image.height, image.width, config)
    resized = to_rgb(image).resize((width, height), resample=config.resample)
    pixels = np.asarray(resized).transpose(2, 0, 1)                               # [C, H, W] uint8
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(config.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    patches, grid = patchify(pixels, config)
    # The resized RGB bytes and the settings determine the patches: hash those (3 bytes a pixel,
    # not the patches' 24).
    digest = hashlib.sha256(resized.tobytes() + repr((grid, config)).encode()).digest()
    return ImageInput(torch.from_numpy(np.ascontiguousarray(patches)), grid,
                      grid[0] * grid[1] * grid[2] // config.merge_size ** 2, digest)


def patchify(pixels: np.ndarray, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[C, H, W] → ([h · w, C · Tp · ps · ps], (1, h, w)): patches of each 2 × 2 block together,
    blocks in raster order; each patch's values ordered (channel, time, row, column)."""
    channels, height, width = pixels.shape
    ps, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    h, w = height // ps, width // ps
    blocks = pixels.reshape(channels, h // m, m, ps, w // m, m, ps).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, ps, ps))
    return frames.reshape(h * w, channels * tp * ps * ps), (1, h, w)
