"""Audit 64d: contracts of images, tensor parallelism and the token-level scheduler that a
mutation audit found no test holding. The tensor-parallel layers run on two ranks in threads of
this process over a real gloo group (no worker process), against the whole unsharded layer; the
image fetching and processing cases call the product's functions; the scheduler cases drive it
with no model (as tests/test_scheduler.py does). The image cases that need a model are in
tests/test_vision.py, beside its checkpoints."""
from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from blockspec.distributed.group import TPGroup
from blockspec.distributed.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from blockspec.distributed.shard import Slice, rank_slice
from blockspec.engine.request import Request
from blockspec.multimodal import ImageError, ImageProcessorConfig, MediaPolicy, load_image, process_image
from blockspec.multimodal.fetch import domain_allowed
from blockspec.sampling import SamplingParams

T = TypeVar("T")


# -- tensor parallelism: the layers where ranks meet ---------------------------------------------

def on_ranks(size: int, work: Callable[[TPGroup], T]) -> list[T]:
    """work(rank's TPGroup) on `size` ranks, each a thread with its own gloo process group over
    one in-memory store: the collectives are the real ones, without spawning a process."""
    store = dist.HashStore()
    results: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            prefixed = dist.PrefixStore("audit64d", store)
            backend = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=30))
            group = dist.ProcessGroup(prefixed, rank, size)
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
            group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            results[rank] = work(TPGroup(rank, size, group, None))
        except BaseException as exc:     # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def take(tensor: torch.Tensor, where: Slice | None) -> torch.Tensor:
    """The part of a checkpoint tensor that rank_slice names (all of it for None)."""
    if where is None:
        return tensor
    return torch.cat([tensor.narrow(where.dim, start, stop - start) for start, stop in where.ranges], dim=where.dim)


def test_row_parallel_embedding_and_lm_head_on_two_ranks_equal_the_whole_layers():
    """Each rank holds the checkpoint slices rank_slice names: o_proj (with a bias, as Qwen3's
    attention_bias gives it) sums its ranks' partial products and adds the bias once; the vocab-
    parallel embedding looks up every id, the first and the last of each rank's rows included;
    the lm_head's gathered logits of several rows are the whole vocabulary's, in order."""
    gen = torch.Generator().manual_seed(64)
    hidden, inter, vocab, tp = 8, 12, 10, 2
    o_proj = torch.nn.Linear(inter, hidden, bias=True)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(hidden, inter, generator=gen))
        o_proj.bias.copy_(torch.randn(hidden, generator=gen))
    table, head = torch.randn(vocab, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    x, stream = torch.randn(3, inter, generator=gen), torch.randn(3, hidden, generator=gen)
    ids = torch.arange(vocab)
    full = SimpleNamespace(num_key_value_heads=2)
    names = {"o": "model.layers.0.self_attn.o_proj", "embed": "model.embed_tokens.weight", "head": "lm_head.weight"}

    def work(group: TPGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def where(name: str, shape) -> Slice | None:
            return rank_slice(name, tuple(shape), full, tp, group.rank)
        layer = RowParallelLinear(inter // tp, hidden, True, group)
        columns = where(names["o"] + ".weight", o_proj.weight.shape)
        embed, lm_head = VocabParallelEmbedding(vocab, hidden, group), VocabParallelLMHead(hidden, vocab, group)
        with torch.no_grad():
            layer.weight.copy_(take(o_proj.weight, columns))
            layer.bias.copy_(take(o_proj.bias, where(names["o"] + ".bias", o_proj.bias.shape)))
            embed.weight.copy_(take(table, where(names["embed"], table.shape)))
            lm_head.weight.copy_(take(head, where(names["head"], head.shape)))
            own = take(x, Slice(1, columns.ranges))       # the rank's heads' outputs: its columns of o_proj's input
            return layer(own), embed(ids), lm_head(stream)

    with torch.no_grad():
        expected = (o_proj(x), table, F.linear(stream, head))
    for rank, outputs in enumerate(on_ranks(tp, work)):
        for name, got, want in zip(("o_proj", "embedding", "lm_head"), outputs, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("tp,heads,kv", [(2, 4, 1), (4, 8, 2), (4, 4, 1), (2, 4, 2)])
def test_each_rank_reads_the_kv_heads_its_query_heads_use(tp, heads, kv):
    """GQA under tensor parallelism: rank r's query heads are the r-th 1/tp of them; the K and V
    rows it reads must be the KV heads those query heads attend with (query head h uses KV head
    h // (heads / kv)), whole heads, shared by consecutive ranks where tp exceeds the KV heads."""
    head_dim, hidden = 4, 16
    full = SimpleNamespace(num_key_value_heads=kv)
    group_size = heads // kv
    for rank in range(tp):
        (q_lo, q_hi), = rank_slice("model.layers.3.self_attn.q_proj.weight", (heads * head_dim, hidden),
                                   full, tp, rank).ranges
        query_heads = range(q_lo // head_dim, q_hi // head_dim)
        for proj in ("k_proj", "v_proj"):
            where = rank_slice(f"model.layers.3.self_attn.{proj}.weight", (kv * head_dim, hidden), full, tp, rank)
            (lo, hi), = where.ranges
            assert where.dim == 0 and lo % head_dim == 0 and hi - lo == max(1, kv // tp) * head_dim, (rank, where)
            kv_heads = range(lo // head_dim, hi // head_dim)
            # the rank's local query head j attends with its local KV head j // (local heads / local kv heads)
            local_group = len(query_heads) // len(kv_heads)
            assert [kv_heads[j // local_group] for j in range(len(query_heads))] == \
                [h // group_size for h in query_heads], (rank, proj)


# -- images: fetching under the media policy and the processor's refusals ------------------------

def test_allowed_domains_match_a_host_or_its_subdomains_only():
    """An allowed domain lets its subdomains in, never a host that merely ends in its letters
    (evilexample.org is not example.org): refused before anything is fetched."""
    policy = MediaPolicy(allowed_domains=("example.org",))
    assert domain_allowed("https://example.org/a.png", policy)
    assert domain_allowed("https://images.example.org/a.png", policy)
    for url in ("https://evilexample.org/a.png", "https://example.org.evil.com/a.png", "https://org/a.png"):
        assert not domain_allowed(url, policy), url
        with pytest.raises(ImageError, match="only from example.org"):
            load_image(url, policy)


def test_a_local_image_over_the_byte_limit_is_refused(tmp_path):
    """file:// URLs read under the same byte limit as data: and http(s) images."""
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(64).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "big.png")
    size = (tmp_path / "big.png").stat().st_size
    assert load_image(f"file://{tmp_path}/big.png", MediaPolicy(local_dir=tmp_path, max_bytes=size)).size == (64, 64)
    with pytest.raises(ImageError, match=f"limit of {size - 1} bytes"):
        load_image(f"file://{tmp_path}/big.png", MediaPolicy(local_dir=tmp_path, max_bytes=size - 1))


def test_an_image_beyond_the_aspect_ratio_limit_is_refused():
    """transformers' processor refuses an aspect ratio over 200 (a 400 from the server, not a
    prompt of thousands of tokens of a 1-pixel strip); 200 itself is served."""
    from PIL import Image
    config = ImageProcessorConfig(patch_size=4, min_pixels=16 * 16, max_pixels=48 * 48)
    assert process_image(Image.new("RGB", (400, 2)), config).num_tokens > 0
    for size in ((402, 2), (2, 402)):
        with pytest.raises(ImageError, match="aspect ratio 201 exceeds 200"):
            process_image(Image.new("RGB", size), config)


# -- the context and the scheduler's seats ------------------------------------------------------

def test_a_prompt_that_fills_the_context_is_refused_and_one_shorter_gets_one_token():
    params = SamplingParams(max_tokens=100)
    with pytest.raises(ValueError, match="the prompt has 8 tokens; the context limit is 8"):
        Request("full", list(range(1, 9)), params, frozenset(), 8)
    assert Request("fits", list(range(1, 8)), params, frozenset(), 8).num_allowed == 1


def test_a_prompt_that_fills_the_context_is_a_400_naming_the_prompt():
    """The server's path (make_engine_request, an engine handle of an 8-token context): the
    request is refused as the client's error, naming its prompt, not run for no output."""
    from blockspec.server.errors import ApiError
    from blockspec.server.protocol import CompletionRequest
    from blockspec.server.request_building import Prompt, make_engine_request
    llm = SimpleNamespace(tokenizer=None, vocab_size=1000, max_model_len=8,
                          make_request=lambda rid, ids, params: Request(rid, ids, params, frozenset(), 8))
    body = CompletionRequest.model_validate({"prompt": list(range(1, 9)), "max_tokens": 1})
    with pytest.raises(ApiError, match="context limit is 8") as refused:
        make_engine_request(llm, "r", Prompt(list(range(1, 9))), body)
    assert (refused.value.status, refused.value.param) == (400, "prompt")
    served = make_engine_request(llm, "r", Prompt(list(range(1, 8))), body)
    assert served.num_allowed == 1


def test_no_more_than_max_num_seqs_run_and_the_waiting_are_admitted_oldest_first():
    """max_num_seqs = 2 with room for everyone: at most two sequences run in any step; each
    later one is admitted when a seat frees, in arrival order."""
    from test_scheduler import finish_done, make_scheduler, make_seq, run_step
    scheduler = make_scheduler(num_pages=512, max_num_seqs=2)
    seqs = [make_seq(f"s{i}", 5, max_tokens=6 + 3 * i) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    admitted: list[str] = []
    for _ in range(200):
        if not scheduler.has_work:
            break
        batch = scheduler.schedule()
        assert len(scheduler.running) <= 2 and len(batch.decode) + len(batch.prefill) <= 2
        admitted += [s.request_id for s in scheduler.running if s.request_id not in admitted]
        run_step(scheduler, batch)
        finish_done(scheduler)
    assert admitted == [s.request_id for s in seqs] and all(s.request.is_finished for s in seqs)


def test_prompts_prefill_at_most_max_prefill_tokens_a_step_whatever_the_budget_leaves():
    """max_prefill_tokens = 10 under a budget of 64: the prompts' chunks of a step add up to 10
    at most, oldest prompt first, the rest of the budget left unused by prompts."""
    from test_scheduler import make_scheduler, make_seq, run_step
    scheduler = make_scheduler(num_pages=512, max_prefill_tokens=10, max_num_batched_tokens=64)
    a, b = make_seq("a", 25), make_seq("b", 7)
    scheduler.add(a)
    scheduler.add(b)
    chunks = []
    while a.is_prefilling or b.is_prefilling:
        batch = scheduler.schedule()
        chunks.append([(seq.request_id, length) for seq, length in batch.prefill])
        run_step(scheduler, batch)
    assert chunks == [[("a", 10)], [("a", 10)], [("a", 5), ("b", 5)], [("b", 2)]]
