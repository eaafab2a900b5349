"""The in-process API: load a target (and optionally a DFlash draft) and generate, many prompts
as one batch. A thin layer over the engine: it loads, configures once, and steps the engine on
the calling thread (the server instead runs the same engine on its own thread)."""
from __future__ import annotations

import functools
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from blockspec.config import ConfigError, EngineOptions, resolve_engine_config
from blockspec.engine.engine import Engine, QueueFullError
from blockspec.engine.request import GenerationStats, Request, TokenEvent
from blockspec.engine.model_runner import ModelRunner
from blockspec.loader import load_draft, load_model, load_tokenizer, resolve_device
from blockspec.multimodal import ImageInput, ImageProcessorConfig, MultimodalPrompt, expand_prompt
from blockspec.options import project
from blockspec.sampling import SamplingParams


def apply_threads(threads: int | None) -> None:
    """--threads: torch's intra-op threads for this process (None leaves torch's choice). Small
    models on a busy machine lose most of their speed to thread contention (BENCHMARKS.md)."""
    if threads is not None:
        import torch
        torch.set_num_threads(threads)


def start_tensor_parallel(opts: EngineOptions):
    """With --tensor-parallel-size > 1: this process as rank 0 of the group (workers started
    once per process), told to load `opts`; else None."""
    if opts.tensor_parallel_size == 1:
        return None
    from blockspec.distributed.launch import leader, rank_models
    from blockspec.distributed.runner import Load
    workers = leader(opts.tensor_parallel_size, resolve_device(opts.device).type)
    workers.send(Load(rank_models, (opts,)))
    return workers


def load_models(opts: EngineOptions, tp=None, show_progress: bool = False):
    """(target, draft or None, EngineConfig, the target's path): the whole target, or with a
    tensor-parallel group `tp` this rank's share of it (the draft is whole on every rank)."""
    if tp is None:
        loaded = load_model(opts.model, device=opts.device, dtype=opts.dtype, show_progress=show_progress,
                            quantization=opts.quantization)
    else:
        from blockspec.distributed.loading import load_sharded_model
        loaded = load_sharded_model(opts.model, tp, device=opts.device, dtype=opts.dtype,
                                    expert_parallel=opts.expert_parallel)
    target = loaded.model
    if target.lm_head.weight.device.type == "cpu":
        apply_threads(opts.threads)
    draft_model = load_draft(opts.draft, target, show_progress) if opts.draft else None
    config = resolve_engine_config(opts, target.config.max_position_embeddings,
                                   draft_model.block_size if draft_model is not None else None,
                                   target.lm_head.weight.device.type)
    return target, draft_model, config, loaded.path


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


class LLM:
    """Owns one engine (target + optional draft, their pools) and runs it on the calling thread."""

    def __init__(self, model: str | EngineOptions, show_progress: bool = True, **options: Any) -> None:
        """`model`: a checkpoint directory or hub id, with any EngineOptions field as a keyword
        argument (draft=, block_size=, dtype=, device=, max_model_len=, max_num_seqs=, ...), or an
        EngineOptions instance. Unknown keywords are a TypeError, bad values a ConfigError."""
        opts = (project(model, EngineOptions, **options) if isinstance(model, EngineOptions)
                else EngineOptions(model=model, **options))
        if opts.model is None:
            raise ConfigError("LLM needs a model (a checkpoint directory or hub id)")
        self.options = opts
        self.workers = start_tensor_parallel(opts)
        with self.workers.loading() if self.workers is not None else nullcontext():
            target, draft_model, self.config, self.model_path = load_models(opts, self.tp, show_progress)
            self.tokenizer = load_tokenizer(self.model_path)
        make_runner = ModelRunner
        if self.workers is not None:
            from blockspec.distributed.runner import LeaderRunner
            make_runner = functools.partial(LeaderRunner, tp=self.tp, on_fatal=self.workers.fatal)
        self.engine = Engine(target, draft_model, self.config, make_runner=make_runner)
        self.stop_ids = self.tokenizer.stop_token_ids | frozenset(target.config.eos_token_ids)
        self._events: dict[str, deque[TokenEvent]] = {}

    @property
    def tp(self):
        """The tensor-parallel group (distributed/group.py), None on one device."""
        return self.workers.tp if self.workers is not None else None

    def close(self) -> None:
        """Free the workers' share of this model (the group stays for the next LLM, until exit)."""
        if self.workers is not None:
            from blockspec.distributed.runner import Unload
            self.workers.send(Unload())
            self.workers = None

    @property
    def target(self):
        return self.engine.runner.target

    @property
    def draft(self):
        return self.engine.runner.draft

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- what the server and its logs read (the public surface; never the modules) -----------

    @property
    def speculative(self) -> bool:
        """DFlash decoding (a draft and a block size above 1), else plain."""
        return self.draft is not None

    @property
    def speculation_policy(self) -> str:
        """What the startup line says of the speculation: the mode and the block it drafts."""
        if not self.speculative:
            return "none (plain decoding)"
        if self.config.speculation == "adaptive":
            return f"adaptive (0..{self.block_size - 1} drafts verified a step, blocks of {self.block_size})"
        return f"fixed block size {self.block_size}"

    @property
    def vocab_size(self) -> int:
        """Rows of the logits: the token ids logit_bias and grammars may name."""
        return int(self.target.lm_head.out_features)

    @property
    def dtype(self) -> str:
        return str(self.target.lm_head.weight.dtype).removeprefix("torch.")

    @property
    def weight_format(self) -> str:
        """The target's weights: `fp8_e4m3` (layers/fp8.py) or their dtype; the draft is never FP8."""
        from blockspec.layers.fp8 import weight_format
        return weight_format(self.target)

    @property
    def weight_bytes_per_step(self) -> int:
        """Target weight bytes one decode step reads (scales included, unchosen experts not)."""
        from blockspec.layers.fp8 import step_weight_bytes
        return step_weight_bytes(self.target)

    @property
    def device(self) -> str:
        return str(self.target.lm_head.weight.device)

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV pool holds (page 0 is the padding rows' scratch page)."""
        return (self.config.total_pages - 1) * self.config.page_size

    @property
    def max_concurrency(self) -> int:
        """Sequences of the full context decoded at once: the pool's share or --max-num-seqs."""
        return min(self.config.max_num_seqs, self.kv_cache_tokens // self.config.max_positions_per_seq)

    @property
    def graphs_summary(self) -> str:
        """"off", or the buckets each graph mode serves (engine/graphs.py)."""
        graphs = self.engine.runner.graphs
        if not graphs.capture:
            return "off"
        return graphs.describe()

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     multimodal: MultimodalPrompt | None = None) -> Request:
        if multimodal is not None and (self.target.visual is None or self.workers is not None):
            raise ValueError("this model takes no images (its checkpoint has no vision tower, or it runs "
                             "tensor parallel)")
        return Request(request_id, prompt_ids, params, self.stop_ids, self.max_model_len, multimodal=multimodal)

    @property
    def takes_images(self) -> bool:
        """A vision tower on one device: tensor-parallel workers see no request's images
        (distributed/runner.py: RequestView), so their forwards would not match rank 0's."""
        return self.target.visual is not None and self.workers is None

    def image_prompt(self, prompt_ids: list[int], images: list[ImageInput]) -> tuple[list[int], MultimodalPrompt]:
        """Prompt ids with one image placeholder token per image (what the chat template writes)
        → the ids with each placeholder expanded to the image's rows, and their M-RoPE positions."""
        vision = self.target.visual.config
        return expand_prompt(prompt_ids, images, vision.image_token_id, vision.spatial_merge_size)

    @functools.cached_property
    def image_processor(self) -> ImageProcessorConfig:
        """The checkpoint's preprocessor_config.json (multimodal/processor.py)."""
        return ImageProcessorConfig.from_dir(self.model_path)

    def stream(self, request: Request) -> Iterator[TokenEvent]:
        """Decode one request, yielding its events; other open streams advance in the same steps
        (each keeps its own events). Closing the iterator aborts the request: the next step
        drops it before any compute."""
        events = self._events[request.request_id] = deque()
        self.engine.submit(request, events.append)
        try:
            while True:
                while events:
                    event = events.popleft()
                    yield event
                    if event.finish_reason is not None:
                        return
                self.engine.step()
        finally:
            self._events.pop(request.request_id, None)
            if not request.is_finished:
                request.abort()

    def generate_requests(self, requests: list[Request]) -> None:
        """Run requests together as one batch until every one has finished."""
        for request in requests:
            while True:
                try:
                    self.engine.submit(request, lambda event: None)
                    break
                except QueueFullError:     # more prompts than the queue holds: make room first
                    self.engine.step()
        while not all(r.is_finished for r in requests):
            self.engine.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationResult]:
        """Several prompts (token ids) at once, like vLLM's LLM.generate(list)."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.make_request(f"gen-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, all_params))]
        self.generate_requests(requests)
        return [self.result(r) for r in requests]

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "gen") -> GenerationResult:
        request = self.make_request(request_id, prompt_ids, params)
        self.generate_requests([request])
        return self.result(request)

    def result(self, request: Request) -> GenerationResult:
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        return GenerationResult(list(request.prompt_ids), list(request.output_ids), text,
                                request.finish_reason or "abort", request.stats)
