"""What images add to a target forward. A sequence's rows that no image interrupts (decode and
verify rows, text-only prefill chunks such as a second turn's) rotate as 1-D RoPE at their cache
position + one shift (`rope_offset`), which the runner packs per sequence and the graphs add on
the device. A step with a prefill chunk that reaches an image's rows takes `step_rows`: M-RoPE
positions for every row and, for the image rows, the vision tower's tokens (and DeepStack
features).

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
    """None when no entry of the step reaches an image's rows: every row then rotates as 1-D RoPE
    at its cache position + its sequence's `rope_offset`, as a graphed step does."""
    if visual is None or not any(reached_images(entry) for entry in entries):
        return None
    columns, rows, embeds = [], [], []
    deepstack: list[list[torch.Tensor]] = []
    offset = 0
    for entry in entries:
        columns.append(rope_columns(entry))
        start, end = entry.start, entry.start + len(entry.tokens)
        touched = reached_images(entry)
        outputs = encoded(visual, entry.seq, [k for k, _, _ in touched], device)
        for k, lo, hi in touched:
            first, last = max(lo, start), min(hi, end)
            rows.append(torch.arange(first, last) - start + offset)
            embeds.append(outputs[k].embeds[first - lo:last - lo])
            deepstack.append([tap[first - lo:last - lo] for tap in outputs[k].deepstack])
        offset += end - start
    positions = torch.cat(columns, dim=1).to(device)                                       # [3, N]
    taps = tuple(torch.cat([parts[j] for parts in deepstack]) for j in range(len(deepstack[0])))
    return MultimodalRows(positions, torch.cat(rows).to(device), torch.cat(embeds), taps)


def rope_columns(entry: "Entry") -> torch.Tensor:
    """The M-RoPE (t, h, w) positions [3, n] of an entry's rows: the prompt's own, then every
    later row at its index + rope_delta on all three axes."""
    mm = entry.seq.request.multimodal
    start, end = entry.start, entry.start + len(entry.tokens)
    if mm is None:
        return torch.arange(start, end).expand(3, -1)
    prompt_end = min(end, mm.rope_positions.shape[1])
    tail = (torch.arange(max(start, prompt_end), end) + mm.rope_delta).expand(3, -1)
    return torch.cat((mm.rope_positions[:, start:prompt_end], tail), dim=1)


def rope_offset(entry: "Entry") -> int | None:
    """The shift from cache positions to rotary positions that every row of the entry shares, or
    None where it reaches an image's rows. Rows outside images are text: their three axes are
    equal (1-D RoPE) and count up by one, so rows that no image interrupts share one shift — 0
    before the first image, the shift after image k between it and the next, rope_delta after
    the last image and past the prompt (the prompt's last text row is its largest position)."""
    mm = entry.seq.request.multimodal
    if mm is None:
        return 0
    if entry.start >= mm.rope_positions.shape[1]:          # past the prompt (every decode row): no image
        return mm.rope_delta
    if reached_images(entry):
        return None
    return int(mm.rope_positions[0, entry.start]) - entry.start


def reached_images(entry: "Entry") -> list[tuple[int, int, int]]:
    """(index, first row, end row) of each image whose rows the entry's rows meet."""
    mm = entry.seq.request.multimodal
    if mm is None:
        return []
    start, end = entry.start, entry.start + len(entry.tokens)
    return [(k, lo, hi) for k, (lo, hi) in enumerate(mm.image_rows()) if lo < end and hi > start]


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
