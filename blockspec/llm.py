"""The in-process API: load a target (and optionally a DFlash draft) and generate."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

from blockspec.engine.plain import generate_plain
from blockspec.engine.request import GenerationStats, Request, TokenEvent
from blockspec.engine.speculative import generate_dflash
from blockspec.loader import load_draft, load_model
from blockspec.sampling import SamplingParams
from blockspec.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats

    def as_json(self) -> dict:
        """The `generate --json` line of ARCHITECTURE.md §5."""
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "prompt_token_ids": self.prompt_token_ids, "stats": self.stats.as_dict()}


def static_runners(target, draft, max_len: int, block_size: int):
    """On CUDA, dense targets and drafts run as graph replays; hybrid targets stay eager for now."""
    from blockspec.engine.cuda_graphs import StaticDraft, StaticTarget
    from blockspec.models.qwen3 import Qwen3ForCausalLM
    if isinstance(target, Qwen3ForCausalLM):
        target = StaticTarget(target, max_len, block_size, draft.target_layer_ids if draft else ())
    if draft is not None and block_size > 1:
        draft = StaticDraft(draft, max_len, block_size)
    return target, draft


class LLM:
    """Owns one target (+ draft) and runs one request at a time on the calling thread."""

    def __init__(self, model: str, draft: str | None = None, block_size: int | None = None,
                 dtype: str = "auto", device: str = "auto", max_model_len: int | None = None,
                 show_progress: bool = True, cuda_graphs: bool = True) -> None:
        loaded = load_model(model, device=device, dtype=dtype, show_progress=show_progress)
        self.target = loaded.model
        self.model_path = loaded.path
        self.tokenizer = Tokenizer.from_dir(loaded.path)
        self.draft = load_draft(draft, self.target, show_progress) if draft else None
        if block_size is not None and block_size < 1:
            raise ValueError("block size must be at least 1")
        if self.draft is not None and block_size is not None and block_size > self.draft.block_size:
            raise ValueError(f"--block-size {block_size} exceeds the draft's block size {self.draft.block_size}")
        self.block_size = block_size or (self.draft.block_size if self.draft else 1)
        limit = self.target.config.max_position_embeddings
        self.max_model_len = min(max_model_len or 4096, limit) if max_model_len is None else max_model_len
        if self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if self.max_model_len > limit:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's {limit} positions")
        self._busy = threading.Lock()
        self.stop_ids = self.tokenizer.stop_token_ids | frozenset(self.target.config.eos_token_ids)
        if cuda_graphs and self.target.lm_head.weight.device.type == "cuda":
            self.target, self.draft = static_runners(self.target, self.draft, self.max_model_len, self.block_size)

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        return Request(request_id, prompt_ids, params, self.stop_ids, self.max_model_len)

    def stream(self, request: Request) -> Iterator[TokenEvent]:
        """Decode one request: DFlash when a draft is loaded, plain decoding otherwise.

        One stream at a time: on CUDA the static runners hold one cache per model, so a second
        stream interleaved with a live one would overwrite its state (invariant 2). Starting
        one while another is open raises instead; closing a stream frees the models."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating; close the running stream first")
        try:
            if self.draft is None:
                yield from generate_plain(self.target, request)
            else:
                yield from generate_dflash(self.target, self.draft, request, self.block_size)
        finally:
            self._busy.release()

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "gen") -> GenerationResult:
        request = self.make_request(request_id, prompt_ids, params)
        for _ in self.stream(request):
            pass
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        return GenerationResult(list(prompt_ids), list(request.output_ids), text,
                                request.finish_reason or "abort", request.stats)
