"""The KV pool's size (engine/memory.py) off CUDA, the startup line, and graphs captured at
startup (their CPU analogue: the padded path, run eagerly, prepared for every batch size first)."""
from __future__ import annotations

import pytest
import torch

from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.memory import DEFAULT_KV_CACHE_MEMORY, page_bytes
from blockspec.loader import load_draft, load_model
from helpers import make_request, run_alone, run_batch


@pytest.fixture(scope="module")
def pair(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target)


def test_the_pool_is_kv_cache_memory_bytes_and_the_startup_line_says_so(pair, caplog):
    target, draft = pair
    per_page = page_bytes(target, draft, 16, torch.float32)
    config = EngineConfig(max_model_len=512, block_size=4, max_num_seqs=64, kv_cache_memory=40 * per_page + 7)
    with caplog.at_level("INFO", logger="blockspec.engine"):
        engine = Engine(target, draft, config)
    assert engine.cache.num_usable_pages == 40 and engine.kv_cache_tokens == 640
    assert engine.runner.target_kv.layers[0][0].shape[0] == 41 * 16            # + the padding page
    assert engine.max_concurrency == pytest.approx(640 / 516)
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert "KV cache 640 tokens (40 pages of 16" in line and "maximum concurrency at 512 tokens" in line
    assert "1.24x" in line


def test_never_more_pages_than_the_seats_can_use(pair):
    target, draft = pair
    config = EngineConfig(max_model_len=100, block_size=4, max_num_seqs=2)
    assert config.kv_cache_memory is None and DEFAULT_KV_CACHE_MEMORY > 100 * page_bytes(target, draft, 16, torch.float32)
    engine = Engine(target, draft, config)
    assert engine.cache.num_usable_pages == 2 * 7                      # 104 positions: 7 pages per seat


def test_num_gpu_blocks_overrides_the_measurement(pair):
    target, draft = pair
    engine = Engine(target, draft, EngineConfig(max_model_len=512, block_size=4, num_gpu_blocks=9))
    assert engine.cache.num_usable_pages == 8


def test_a_pool_smaller_than_one_sequence_is_refused_with_one_line(pair):
    target, draft = pair
    per_page = page_bytes(target, draft, 16, torch.float32)
    with pytest.raises(ConfigError) as info:
        Engine(target, draft, EngineConfig(max_model_len=512, block_size=4, kv_cache_memory=10 * per_page))
    message = str(info.value)
    assert "\n" not in message and "160 tokens" in message and "--max-model-len 512" in message
    assert "--kv-cache-memory" in message


def test_the_default_context_is_the_models(qwen3_dir):
    from blockspec.llm import LLM
    llm = LLM(str(qwen3_dir), show_progress=False, max_num_seqs=2)
    assert llm.max_model_len == llm.target.config.max_position_embeddings == 4096


def test_graphs_prepared_at_startup_serve_every_decode_step(pair):
    """warm_up before any request (the padded path eagerly: CPU's stand-in for capture), then a
    batch with arrivals: no step adds a FULL graph shape, and every output is alone's."""
    target, draft = pair
    config = EngineConfig(max_model_len=256, block_size=4, max_num_seqs=4)
    prompts = [list(range(100 + i, 110 + 3 * i)) for i in range(4)]

    def requests():
        return [make_request(f"r{i}", p, max_tokens=10 + i) for i, p in enumerate(prompts)]

    alone = {r.request_id: run_alone(lambda: Engine(target, draft, config), r) for r in requests()}

    def build():
        engine = Engine(target, draft, config)
        graphs = engine.runner.graphs = engine.runner.make_graphs(capture=False, bucket_keys=False)
        engine.runner.warm_up(kinds=("verify", "propose"))
        build.shapes = set(graphs.full)
        real = graphs.run_full

        def counted(kind, *args):
            build.graphed += kind == "verify"
            return real(kind, *args)
        graphs.run_full = counted
        return engine
    build.graphed = 0
    engine, runs = run_batch(build, requests()[:2], arrivals={3: requests()[2:]})
    graphs = engine.runner.graphs
    assert {desc.num_seqs for kind, desc, _ in build.shapes if kind == "propose"} == {1, 2, 4}
    assert {desc.num_tokens for kind, desc, _ in build.shapes if kind == "verify"} == set(graphs.full_tokens)
    assert set(graphs.full) == build.shapes                            # nothing new while serving
    assert build.graphed > 5                                           # decode-only steps took the graphs
    for run in runs:
        assert run.output_ids == alone[run.request.request_id].output_ids
        assert run.stats.acceptance_lengths == alone[run.request.request_id].stats.acceptance_lengths


def test_bench_burst_reports_first_token_and_gap_percentiles(pair):
    from blockspec.bench import burst
    target, draft = pair
    result = burst(target, draft, 4, arrivals=3, decoding=2, prompt_len=40, max_tokens=4, accept_len=None,
                   max_num_batched_tokens=48)
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert 0 < result["gap_p50_ms"] <= result["gap_p99_ms"]


def test_bench_burst_with_a_latent_profile_runs_adaptive_on_its_confidences(pair, monkeypatch):
    """--accept-profile: the burst's DFlash engine is adaptive (the default), its drafts' confidences
    and verdicts the profile's (what lets it narrow and leave the budget to the prompt's chunks)."""
    from blockspec.bench import bursts
    from blockspec.bench.speculation import LatentProfile
    target, draft = pair
    seen, judged = [], []
    real_engine = bursts.Engine
    monkeypatch.setattr(bursts, "Engine", lambda t, d, config: seen.append(config.speculation) or real_engine(t, d, config))
    profile = LatentProfile(3.0, 4)
    real_judge = profile.judge
    profile.judge = lambda real: (lambda *a, **kw: judged.append(1) or real_judge(real)(*a, **kw))
    result = bursts.burst(target, draft, 4, arrivals=3, decoding=2, prompt_len=40, max_tokens=4, accept_len=None,
                          max_num_batched_tokens=48, profile=profile)
    assert seen == ["adaptive"] and judged
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert 0 < result["gap_p50_ms"] <= result["gap_p99_ms"]
    bursts.burst(target, draft, 4, arrivals=1, decoding=1, prompt_len=40, max_tokens=2, accept_len=None,
                 max_num_batched_tokens=48)
    assert seen == ["adaptive", "fixed"]


def test_memory_this_process_holds_beyond_its_tensors_is_not_the_pools(monkeypatch):
    """measured_pages (CUDA) on a simulated device of 100 GiB: 10 GiB of weights allocated, 8 GiB
    more reserved by this process that empty_cache cannot return (another engine's graph pools),
    5 GiB used by other processes, a profile that peaks 2 GiB above the weights and its pages. At
    utilization 0.5 the pool gets 50 − 5 − 18 − 2 (activations) − 2 (the graphs' reserve) = 23 GiB,
    not the 31 that counting only the allocated bytes gave."""
    from blockspec.engine import memory
    GiB = 1 << 30
    state = {"allocated": 10 * GiB, "peak": 10 * GiB}
    per_page = 1 << 20

    def profile(pages: int) -> None:
        state["peak"] = state["allocated"] + 2 * GiB + pages * per_page
    fake = {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "reset_peak_memory_stats": lambda device=None: None,
            "memory_allocated": lambda device=None: state["allocated"],
            "max_memory_allocated": lambda device=None: state["peak"],
            "memory_reserved": lambda device=None: state["allocated"] + 8 * GiB,
            "mem_get_info": lambda device=None: (100 * GiB - 5 * GiB - 18 * GiB, 100 * GiB)}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    config = EngineConfig(max_model_len=1024, max_num_seqs=4, gpu_memory_utilization=0.5)
    size = memory.measured_pages(config, torch.device("cuda"), per_page, profile)
    assert size.activation_bytes == 2 * GiB
    assert (size.num_pages - 1) * per_page == 23 * GiB
