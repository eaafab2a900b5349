"""The vision tower of Qwen3-VL, Qwen3.5 and Qwen3.5-MoE (`model.visual.*`, Hugging Face's names),
and the multimodal side of their text models: which token ids mark an image, M-RoPE sections.

An image arrives as patches (blockspec/multimodal/processor.py): [P, C · Tp · ps · ps] values, P =
t · h · w patches listed in 2 × 2 merge-block order. The tower embeds each patch (a Conv3d whose
kernel is its stride, i.e. one linear map of the flattened patch), adds a learned position table
resampled (bilinear, corners aligned) to the image's h × w grid, rotates q/k by 2-D positions
(row, column) in full bidirectional attention per image, and merges each 2 × 2 block into one
token of the text width. Qwen3-VL also taps chosen blocks (DeepStack): each tap is merged the same
way (norm after the merge) and added to the text stream after the first decoder layers, at the
image's token rows.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import ConfigError, ModelConfig, eos_ids
from blockspec.kernels.fused import rotate_half


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @staticmethod
    def from_hf(d: dict[str, Any]) -> "VisionConfig":
        """d: the checkpoint's whole config.json (vision_config plus the top-level token ids)."""
        v = d["vision_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
        rope = v.get("rope_parameters") or {}
        side = int(v.get("num_position_embeddings", 2304)) ** 0.5
        if side != int(side):
            raise ConfigError("vision num_position_embeddings must be a square (the learned position grid)")
        text = d.get("text_config") or {}
        return VisionConfig(
            depth=int(v.get("depth", 27)), hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 4304)), num_heads=int(v.get("num_heads", 16)),
            in_channels=int(v.get("in_channels", 3)), patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            out_hidden_size=int(v.get("out_hidden_size", text.get("hidden_size", 0))),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes") or ()),
            hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(d.get("image_token_id", text.get("image_token_id", 151655))),
            vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
        )


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
               "silu": F.silu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass
class VisionOutput:
    embeds: torch.Tensor                 # [n, text hidden]: one row per image token (merged block)
    deepstack: list[torch.Tensor]        # per DeepStack tap, [n, text hidden]


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch: the conv is one linear map of its flattened (C, T, ph, pw) values.
        weight = self.proj.weight.flatten(1)                                  # [E, C·T·ph·pw]
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)     # [P, E]


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        """x [P, E]; every image (lengths: its patches) attends to itself only, without a mask."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)   # [P, H, D]
        cos, sin = rope                                                                    # [P, 1, D] fp32
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        # [1, H, p, D] per image: 4-D inputs let SDPA pick a fused kernel (no p × p scores in memory)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qi, ki, vi)))[0]
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]  # [H, p, D] each
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).flatten(1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2 × 2 block of patches (consecutive rows) → one token of the text width. The main
    merger norms each patch before the merge; a DeepStack merger norms the merged vector."""

    def __init__(self, config: VisionConfig, norm_after_merge: bool) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.merged if norm_after_merge else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.norm_after_merge else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, norm_after_merge=True)
                                                   for _ in config.deepstack_visual_indexes)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        # 2-D rotary: a quarter of the head's dims rotate by the row, a quarter by the column (then doubled).
        half = (self.config.hidden_size // self.config.num_heads) // 2
        self.inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput:
        """patches [P, patch_dim] of all images in order, grids (t, h, w) in patches per image →
        per merged token (P / 4 rows) its embedding and DeepStack features."""
        x = self.patch_embed(patches)                                              # [P, E]
        x = x + self.position_table(grids).to(x.dtype)
        rope = self.rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]                 # attention per frame
        taps = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, lengths)
            if i in self.config.deepstack_visual_indexes:
                taps.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        return VisionOutput(self.merger(x), taps)

    def block_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order → [h · w, ...] in 2 × 2 merge-block order (the patches' order)."""
        m = self.config.spatial_merge_size
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2).reshape(h * w, *grid.shape[2:])

    def position_table(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square table resampled to each image's grid → [P, E]."""
        side = int(self.config.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)        # [1, E, side, side]
        rows = []
        for t, h, w in grids:
            resampled = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]   # [E, h, w]
            rows.append(self.block_order(resampled.permute(1, 2, 0), h, w).repeat(t, 1))
        return torch.cat(rows)

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, 1, head_dim] (fp32) of each patch's (row, column)."""
        coords = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            coords.append(self.block_order(torch.stack((rows, cols), dim=-1), h, w).repeat(t, 1))
        coords = torch.cat(coords).to(device)                                   # [P, 2]
        freqs = (coords[..., None].float() * self.inv_freq.to(device)).flatten(1)  # [P, 2 · D/4]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()


def text_config(d: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3-VL's text model: a Qwen3 (q/k norms) under `text_config`; ties and end tokens as
    transformers reads them (the outer config ties; the text config's eos wins)."""
    text = d.get("text_config") or d
    config = ModelConfig.from_hf(text, architecture)
    eos = text.get("eos_token_id")
    return dataclasses.replace(config, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                               eos_token_ids=eos_ids(d.get("eos_token_id") if eos is None else eos), raw=d)


# The (t, h, w) sections transformers assumes where a config names none (its rotary classes' defaults).
DEFAULT_MROPE_SECTION = {"Qwen3VLForConditionalGeneration": (24, 20, 20)}
QWEN3_5_MROPE_SECTION = (11, 11, 10)


def attach_vision(model: nn.Module, d: dict[str, Any]) -> nn.Module:
    """A multimodal checkpoint's target: its text model with the tower at `model.visual`."""
    rope = model.config.rope
    if not rope.mrope_section:
        architecture = (d.get("architectures") or [""])[0]
        rope = dataclasses.replace(rope, mrope_section=DEFAULT_MROPE_SECTION.get(architecture, QWEN3_5_MROPE_SECTION))
        model.model.rotary_emb.rope = rope
    if len(rope.mrope_section) != 3:
        raise ConfigError("a vision-language text model needs rope_parameters.mrope_section (t, h, w)")
    model.model.visual = VisionModel(VisionConfig.from_hf(d))
    return model


def multimodal_rename(name: str) -> str | None:
    """…ForConditionalGeneration names → ours: the text model's prefix becomes `model.`; the
    tower keeps `model.visual.`; multi-token-prediction heads are not served."""
    if name.startswith("mtp."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name
