"""How many K/V pages the engine gets (vLLM's way): measured, not reserved for the worst case.

On CUDA, after the weights (target and draft) are loaded, one forward at the full token budget
(max_num_batched_tokens through the target, max_num_seqs blocks through the draft, the logits
of every verify row) runs on a throwaway pool; its peak is what activations need. The pages then
fill what gpu_memory_utilization of the device leaves after weights, that peak, other
processes' memory and a reserve for the CUDA graphs (the activations of their largest batch,
the whole token budget, which live in the graphs' own memory pool, and a hybrid target's shared
verify stash). Elsewhere the pool is kv_cache_memory bytes. Either
way it is never larger than max_num_seqs sequences of max_model_len can use, and an explicit
num_gpu_blocks (num_pages) overrides the measurement.

A pool smaller than one sequence of max_model_len is refused with one line (ConfigError).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from blockspec.config import ConfigError, EngineConfig

DEFAULT_KV_CACHE_MEMORY = 4 << 30          # bytes of K/V off CUDA when --kv-cache-memory is not given
GiB = float(1 << 30)


@dataclass(frozen=True)
class PoolSize:
    num_pages: int                 # including the padding page 0
    page_bytes: int                # target + draft K/V bytes of one page
    source: str                    # "override", "measured", "kv-cache-memory" or "worst-case" (the cap)
    activation_bytes: int = 0      # peak of the profiling forward beyond weights and its pool
    graph_reserve_bytes: int = 0

    def usable_tokens(self, page_size: int) -> int:
        return (self.num_pages - 1) * page_size


def kv_bytes_per_slot(model_config, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one position in every attention layer of a model."""
    return 2 * num_layers * model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize


def page_bytes(target, draft, page_size: int, dtype: torch.dtype) -> int:
    per_slot = kv_bytes_per_slot(target.config, target.num_attention_layers, dtype)
    if draft is not None:
        per_slot += kv_bytes_per_slot(draft.config, draft.config.num_hidden_layers, dtype)
    return per_slot * page_size


def size_pool(config: EngineConfig, target, draft, device: torch.device, dtype: torch.dtype,
              profile: Callable[[int], None] | None, graph_bytes: int = 0) -> PoolSize:
    """The pool's pages. profile(num_pages) runs the full-budget forward on a throwaway pool of
    that many pages (CUDA only); graph_bytes: what the graphs hold beyond their activations
    (a hybrid target's shared verify stash)."""
    per_page = page_bytes(target, draft, config.page_size, dtype)
    if config.page_override is not None:
        return PoolSize(config.page_override, per_page, "override")
    if per_page == 0:                       # no attention layer anywhere: pages cost nothing
        return PoolSize(config.worst_case_pages, per_page, "worst-case")
    if device.type == "cuda" and profile is not None:
        size = measured_pages(config, device, per_page, profile, graph_bytes)
    else:
        size = PoolSize(pages_in(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, per_page), per_page,
                        "kv-cache-memory")
    if size.num_pages > config.worst_case_pages:      # more than the seats can ever use
        size = PoolSize(config.worst_case_pages, per_page, "worst-case", size.activation_bytes,
                        size.graph_reserve_bytes)
    check_one_sequence_fits(config, size)
    return size


def measured_pages(config: EngineConfig, device: torch.device, per_page: int,
                   profile: Callable[[int], None], graph_bytes: int = 0) -> PoolSize:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)                   # weights (target + draft)
    profile_pages = 2 + -(-config.max_num_batched_tokens // config.page_size) + config.max_num_seqs
    profile(profile_pages)
    torch.cuda.synchronize(device)
    activation = max(0, torch.cuda.max_memory_allocated(device) - before - profile_pages * per_page)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    others = max(0, total - free - reserved)                                 # other processes, CUDA context
    # What this process holds that empty_cache could not return (another engine's CUDA graph pools
    # in the same process — tests, the bench's side-by-side engines — or segments its live tensors
    # pin) is no more free than the weights are: counting only the allocated bytes gave such a
    # process's pool gigabytes it did not have (tests/gpu/test_ragged_graphs.py after graph tests).
    held = max(before, reserved)
    # Piecewise graphs reach the whole token budget: their activations, as the profile's.
    graph_reserve = activation + graph_bytes if config.cuda_graphs else 0
    budget = int(total * config.gpu_memory_utilization) - others - held - activation - graph_reserve
    if budget < 2 * per_page:
        raise ConfigError(f"no memory left for the KV cache: {total / GiB:.1f} GiB × {config.gpu_memory_utilization} "
                          f"holds the weights ({before / GiB:.1f} GiB) and activations ({activation / GiB:.1f} GiB) "
                          f"only; raise --gpu-memory-utilization or lower --max-num-batched-tokens")
    return PoolSize(pages_in(budget, per_page), per_page, "measured", activation, graph_reserve)


def pages_in(budget: int, per_page: int) -> int:
    """The pages `budget` bytes of K/V hold, and page 0 (padding rows write there) on top."""
    return 1 + budget // per_page


def check_one_sequence_fits(config: EngineConfig, size: PoolSize) -> None:
    if size.num_pages - 1 < config.pages_per_seq:
        tokens = size.usable_tokens(config.page_size)
        hint = ("raise --gpu-memory-utilization or --num-gpu-blocks" if size.source == "measured"
                else "raise --kv-cache-memory or --num-gpu-blocks")
        raise ConfigError(f"the KV cache holds {tokens} tokens, less than one sequence of --max-model-len "
                          f"{config.max_model_len} (+ a block of {config.block_size}); lower --max-model-len or {hint}")


def dummy_sequence(num_pages: int, state_slot: int = 0) -> SimpleNamespace:
    """What `ModelRunner.prepare` and `forward` read of a sequence, for a profiling or capture
    forward: pages 1 … num_pages − 1 of a throwaway pool, the padding state slot, a request
    without images."""
    return SimpleNamespace(block_table=list(range(1, num_pages)), state_slot=state_slot,
                           request=SimpleNamespace(multimodal=None))


def startup_line(config: EngineConfig, size: PoolSize) -> str:
    tokens = size.usable_tokens(config.page_size)
    gib = (size.num_pages * size.page_bytes) / GiB
    how = {"override": "--num-gpu-blocks", "measured": f"{config.gpu_memory_utilization:g} of the device",
           "kv-cache-memory": "--kv-cache-memory",
           "worst-case": f"{config.max_num_seqs} sequences of --max-model-len, all memory allows"}[size.source]
    return (f"blockspec: KV cache {tokens:,} tokens ({size.num_pages - 1:,} pages of {config.page_size}, "
            f"{gib:.2f} GiB, from {how}); maximum concurrency at {config.max_model_len:,} tokens per request: "
            f"{tokens / config.max_positions_per_seq:.2f}x; prefix cache {'on' if config.prefix_cache else 'off'}")


class StageCost:
    """A startup stage's wall time and the device memory it kept, for its log line: made when
    the stage starts, `done()` when it ends (after the device has finished its work)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.start = device, time.perf_counter()
        self.free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0

    def done(self) -> str:
        """'X.Y s, N MiB'."""
        kept = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            kept = self.free - torch.cuda.mem_get_info(self.device)[0]
        return f"{time.perf_counter() - self.start:.1f} s, {kept / (1 << 20):.0f} MiB"
