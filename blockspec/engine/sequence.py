"""A Sequence: one request as the engine sees it — its tokens, pages, state slot and progress.

The K/V pools hold positions [0, num_cached) of the sequence's tokens. While prefilling,
num_cached climbs to prefill_len in chunks. While decoding, the last token (the anchor, x) is
committed but not yet fed: num_cached == num_tokens − 1, and one verify feeds the anchor and the
drafts at positions num_cached … num_cached + T − 1.
"""
from __future__ import annotations

import time

import torch

from blockspec.engine.request import Request
from blockspec.sampling import make_generator


class Sequence:
    def __init__(self, request: Request, device: torch.device) -> None:
        self.request = request
        self.block_table: list[int] = []
        self.state_slot: int | None = None
        self.num_cached = 0
        self.generator = make_generator(request.params, device)
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.num_preemptions = 0
        # engine/logits.py: made on the engine thread at the first forward that needs it
        self.logits_processor = None
        # Prefix cache (cache/prefix.py): the tree nodes this sequence pins (page i = node i's
        # page unless it computed its own copy); prefill chunk ends where a hybrid target takes
        # a snapshot; state-slot copies the runner makes: restore_from → its slot before its next
        # forward, its slot → snapshot_into after a prefill chunk, its state at the latest page
        # boundary crossed in decode → pending_slot (pending_boundary: that boundary).
        self.prefix_path: list = []
        self.snapshot_points: tuple[int, ...] = ()
        self.restore_from: int | None = None
        self.protected: int | None = None
        self.snapshot_into: int | None = None
        self.pending_slot: int | None = None
        self.pending_boundary: int | None = None
        # engine/multimodal.py: the vision tower's output per image index, kept while prefilling
        self.vision_outputs: dict = {}

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.request.output_ids

    @property
    def key_tokens(self) -> list[int]:
        """The prefix cache's view of tokens: image rows carry their image's digest (request.py)."""
        return self.request.prompt_keys + self.request.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.request.output_ids)

    @property
    def prefill_len(self) -> int:
        """Positions to compute before decoding: the prompt, or after a preemption everything
        but the last committed token (which becomes the anchor again, not resampled)."""
        return self.num_tokens - (1 if self.request.output_ids else 0)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_len

    @property
    def anchor(self) -> int:
        """The last committed token (read every decode step: no copy of the whole context)."""
        request = self.request
        return request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]

    def reset_for_recompute(self) -> None:
        """Preempted: pages and slot were handed back; compute everything again later."""
        self.block_table = []
        self.state_slot = None
        self.num_cached = 0
        self.prefix_path, self.snapshot_points = [], ()
        self.vision_outputs = {}
        self.num_preemptions += 1

    def mark_admitted(self) -> None:
        if self.admitted_at is None:
            self.admitted_at = self.request.admitted_at = time.perf_counter()


def completes_prefill(seq, num_tokens: int) -> bool:
    """Whether a chunk of num_tokens (from seq.num_cached on) reaches the end of its prefill: a
    Sequence, or a tensor-parallel worker's SeqView of one (distributed/runner.py)."""
    return seq.num_cached + num_tokens >= seq.prefill_len
