"""A prompt with images: each image's single placeholder token (the chat template writes
<|vision_start|><|image_pad|><|vision_end|>) expanded to one row per merged image token, and the
M-RoPE positions of every row, as transformers' get_rope_index computes them: text rows count up
on all three axes; an image's rows sit at (start, start + row, start + column) of its merged grid;
the text after it continues at start + max(rows, columns), i.e. one past the image's largest
position. Rows past the prompt (output, drafts) rotate at their index + rope_delta on all axes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.multimodal.fetch import ImageError
from blockspec.multimodal.processor import ImageInput


@dataclass
class MultimodalPrompt:
    images: list[ImageInput]
    starts: list[int]                   # first prompt row of each image's tokens
    rope_positions: torch.Tensor        # [3, L] (t, h, w) position of every prompt row
    rope_delta: int                     # max position + 1 − L: the shift of every later row
    merge_size: int

    def image_rows(self) -> list[tuple[int, int]]:
        """[start, end) of each image's rows in the prompt."""
        return [(start, start + image.num_tokens) for start, image in zip(self.starts, self.images)]

    def key_tokens(self, prompt_ids: list[int]) -> list[int]:
        """The prompt ids with each image row replaced by a negative id derived from the image's
        digest and the row's place in it: the prefix cache keys pages by these, so pages holding
        different images never match and the same image matches itself."""
        keys = list(prompt_ids)
        for (start, end), image in zip(self.image_rows(), self.images):
            base = int.from_bytes(image.digest[:8], "big")
            keys[start:end] = [-1 - (base + j) % (1 << 62) for j in range(end - start)]
        return keys


def expand_prompt(ids: list[int], images: list[ImageInput], image_token_id: int,
                  merge_size: int) -> tuple[list[int], MultimodalPrompt]:
    """ids holding one image_token_id per image (in order) → the expanded ids and their positions."""
    found = sum(1 for token in ids if token == image_token_id)
    if found != len(images):
        raise ImageError(f"the prompt has {found} image placeholders for {len(images)} images "
                         "(a message's text may not contain the image token itself)")
    expanded: list[int] = []
    starts: list[int] = []
    columns: list[torch.Tensor] = []
    next_position = 0
    text_run = 0

    def close_text() -> None:
        nonlocal next_position, text_run
        if text_run:
            columns.append(torch.arange(next_position, next_position + text_run).expand(3, -1))
            next_position += text_run
            text_run = 0

    queue = iter(images)
    for token in ids:
        if token != image_token_id:
            expanded.append(token)
            text_run += 1
            continue
        close_text()
        image = next(queue)
        t, h, w = image.grid[0], image.grid[1] // merge_size, image.grid[2] // merge_size
        starts.append(len(expanded))
        expanded += [image_token_id] * image.num_tokens
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        columns.append(torch.stack((tt, hh, ww)).reshape(3, -1) + next_position)
        next_position += max(h, w)
    close_text()
    positions = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - len(expanded) if len(expanded) else 0
    return expanded, MultimodalPrompt(images, starts, positions, delta, merge_size)
