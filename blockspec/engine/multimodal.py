"""What images add to a target forward: M-RoPE positions for every row of the step and, for the
prefill rows that hold image tokens, the vision tower's tokens (and DeepStack features).

The tower runs in the prefill step that first reaches an image's rows, over all of that
sequence's images the chunk touches at once; its output stays with the sequence until its
prefill is done (a later chunk may hold the rest of an image's rows), then is dropped."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from blockspec.models.base import MultimodalRows
from blockspec.models.qwen3_vl import VisionOutput

if TYPE_CHECKING:
    from blockspec.engine.model_runner import Entry
    from blockspec.engine.sequence import Sequence


def step_rows(visual: torch.nn.Module | None, entries: list["Entry"], device: torch.device) -> MultimodalRows | None:
    """None when no sequence of the step has images (the rows rotate by their positions)."""
    if visual is None or not any(entry.seq.request.multimodal is not None for entry in entries):
        return None
    columns, rows, embeds = [], [], []
    deepstack: list[list[torch.Tensor]] = []
    offset = 0
    for entry in entries:
        mm = entry.seq.request.multimodal
        start, end = entry.start, entry.start + len(entry.tokens)
        if mm is None:
            columns.append(torch.arange(start, end).expand(3, -1))
        else:
            prompt_end = min(end, mm.rope_positions.shape[1])
            columns.append(mm.rope_positions[:, start:prompt_end])
            columns.append((torch.arange(max(start, prompt_end), end) + mm.rope_delta).expand(3, -1))
            touched = [(k, lo, hi) for k, (lo, hi) in enumerate(mm.image_rows()) if lo < end and hi > start]
            outputs = encoded(visual, entry.seq, [k for k, _, _ in touched], device)
            for k, lo, hi in touched:
                first, last = max(lo, start), min(hi, end)
                rows.append(torch.arange(first, last) - start + offset)
                embeds.append(outputs[k].embeds[first - lo:last - lo])
                deepstack.append([tap[first - lo:last - lo] for tap in outputs[k].deepstack])
        offset += end - start
    positions = torch.cat(columns, dim=1).to(device)                                       # [3, N]
    if not rows:
        return MultimodalRows(positions)
    taps = tuple(torch.cat([parts[j] for parts in deepstack]) for j in range(len(deepstack[0])))
    return MultimodalRows(positions, torch.cat(rows).to(device), torch.cat(embeds), taps)


def encoded(visual: torch.nn.Module, seq: "Sequence", indices: list[int],
            device: torch.device) -> dict[int, VisionOutput]:
    """The tower's output for images `indices` of seq, running it once for those not yet encoded."""
    missing = [k for k in indices if k not in seq.vision_outputs]
    if missing:
        images = [seq.request.multimodal.images[k] for k in missing]
        patches = torch.cat([image.pixel_values for image in images]).to(device, visual.dtype)
        out = visual(patches, [image.grid for image in images])
        sizes = [image.num_tokens for image in images]
        taps = [tap.split(sizes) for tap in out.deepstack]
        for i, (k, part) in enumerate(zip(missing, out.embeds.split(sizes))):
            seq.vision_outputs[k] = VisionOutput(part, [tap[i] for tap in taps])
    return seq.vision_outputs
