"""The kernel warm-up (engine/warm.py): every variant of our Triton kernels a step can choose is
one the warm-up runs at startup.

- Over a grid of calls (query lengths, sequences, key bounds), the attention wrapper's choice is
  in the variant set the warm-up enumerates, for real head shapes and SM counts; the set holds
  nothing the grid never chooses.
- Through a request mix on CPU engines (cold prompts chunked over the budget, a prefix hit,
  prompts of unequal lengths together, long-context decode, DFlash verify; dense and hybrid;
  graph-shaped and eager), the variants the wrappers choose (their own choice, recorded where
  they launch; the torch reference computes the output) all lie in the runner's plan.
- The warm-up runs end to end under Triton's CPU interpreter on a tiny engine.
GPU: tests/gpu/test_warm_gpu.py counts Triton compilations after startup (none allowed).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import fixtures  # noqa: E402
from blockspec.engine import model_runner  # noqa: E402
from blockspec.engine.warm import kernel_plan  # noqa: E402
from blockspec.kernels import attention as K  # noqa: E402
from blockspec.kernels import gdn  # noqa: E402
from blockspec.layers import attention as layers_attention  # noqa: E402
from blockspec.layers.attention import AttentionMetadata, reference_paged_attention  # noqa: E402
from blockspec.loader import load_draft, load_model  # noqa: E402
from blockspec.models import qwen3_5  # noqa: E402
from blockspec.models.qwen3_5 import HybridConfig, Qwen3_5ForCausalLM  # noqa: E402
from blockspec.models.gated_delta import (prefill_kernel_serves, reference_step, step_kernel_serves,  # noqa: E402
                                          warm_layouts)
from helpers import make_engine, make_request, run_batch, run_interpreted  # noqa: E402

# -- the enumeration against every choice over a grid --------------------------------------------

QUERY_LENS = [*range(1, 18), 24, 31, 32, 33, 48, 64, 65, 100, 128, 129, 200, 271, 272, 300, 1000, 8192]
SEQS = [*range(1, 9), 12, 16, 32, 64, 256]


def key_grid(lo: int, hi: int) -> list[int]:
    return sorted({k for k in [lo, hi, *range(lo, min(hi, 4200), 128), *range(lo, hi, 8192)] if lo <= k <= hi})


@pytest.mark.parametrize("heads, sms", [
    (K.Heads(8, 4, 128, 2), 132),        # Qwen3-8B, bf16, H200
    (K.Heads(4, 4, 256, 2), 132),        # Qwen3.5-4B's gated attention (head 256)
    (K.Heads(2, 2, 32, 4), 64),          # the demo pair in fp32, the interpreter's SM count
    (K.Heads(1, 16, 128, 2), 132),       # MQA-like: one KV head, a wide group
])
def test_every_choice_over_a_grid_is_an_enumerated_variant(heads, sms):
    """Eager / PIECEWISE calls (any query length, sequences, live length up to the pool's) and
    FULL graphs' (the block, each bucket's slots, the capacity): the wrapper's choice for each
    call of the grid is in attention_variants, which has nothing else."""
    capacity = 40960
    eager = K.CallShapes((1, 8192), tuple(range(1, 257)), (1, capacity))
    full = K.CallShapes((16, 16), (1, 2, 4, 8, 16, 32, 48, 64, 256), (capacity, capacity))
    for shapes in (eager, full):
        variants = K.attention_variants(heads, shapes, sms)
        chosen = set()
        for q in [q for q in QUERY_LENS if shapes.query_lens[0] <= q <= shapes.query_lens[1]]:
            for seqs in [s for s in SEQS if s in shapes.seqs] or shapes.seqs:
                for keys in key_grid(*shapes.keys):
                    chosen.add(K.attention_variant(heads, q, seqs, keys, sms))
        assert chosen <= variants
        assert chosen == variants, sorted(variants - chosen, key=str)


# -- real steps choose only planned variants -----------------------------------------------------

class Recorder:
    """The kernels' launches on CPU: the variant each wrapper chose (attention's by site), with the
    torch reference computing what the kernel would."""

    def __init__(self, monkeypatch) -> None:
        self.attention: set[tuple[bool, bool, K.AttentionVariant]] = set()
        self.gdn: set[gdn.StepVariant] = set()
        for module in (layers_attention, model_runner):
            monkeypatch.setattr(module, "uses_kernels", lambda device: True)
        monkeypatch.setattr(K, "launch", self.launch)
        monkeypatch.setattr(qwen3_5, "step_kernel_fits", lambda x, width: step_kernel_serves(x.dtype, width))
        monkeypatch.setattr(qwen3_5, "prefill_kernel_fits", lambda x, width: prefill_kernel_serves(x.dtype, width))
        monkeypatch.setattr(gdn, "launch_step", self.launch_step)

    def launch(self, variant, q, k_pool, v_pool, block_tables, context_lens, positions, query_start, max_query_len,
               page_size, scale, is_causal, block_kv):
        self.attention.add((block_kv is not None, is_causal, variant))
        meta = AttentionMetadata(num_seqs=query_start.shape[0] - 1, width=0, input_ids=positions, positions=positions,
                                 slot_mapping=positions, block_tables=block_tables, context_lens=context_lens,
                                 max_context_len=block_tables.shape[1] * page_size, page_size=page_size, kv=[],
                                 query_start=query_start, max_rows=max_query_len)
        return reference_paged_attention(q, k_pool, v_pool, meta, context_lens, scale, is_causal, None, block_kv)

    def launch_step(self, variant, mixed, a, b, conv_weight, a_log, dt_bias, conv_pool, ssm_pool, slots, cu_seqlens,
                    max_rows, num_k_heads, k_dim, keep_steps, norm, space):
        self.gdn.add(variant)
        return reference_step(mixed, a, b, conv_weight, a_log, dt_bias, conv_pool, ssm_pool, slots, cu_seqlens,
                              max_rows, num_k_heads, k_dim, keep_steps, norm)


def request_mix(vocab: int) -> tuple[list, dict]:
    """A cold prompt over seven budgets, then (step 12) the same prompt again with a new tail (a
    prefix hit: a short chunk over a long cached context), prompts of unequal lengths together,
    a long-context decode."""
    gen = torch.Generator().manual_seed(3)
    words = lambda n: torch.randint(0, vocab - 1, (n,), generator=gen).tolist()     # noqa: E731
    cold = words(400)
    first = [make_request("cold", cold, max_tokens=12), make_request("short", words(5), max_tokens=30)]
    later = [make_request("hit", cold + words(7), max_tokens=8), make_request("mid", words(40), max_tokens=6)]
    return first, {12: later}


def tiny_hybrid(root: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The fixtures' hybrid shape (our own modules, default init) and a DFlash draft for it."""
    target = Qwen3_5ForCausalLM(HybridConfig.from_hf(dict(fixtures.HYBRID_TEXT), "Qwen3_5ForCausalLM")).eval()
    (root / "shape").mkdir(parents=True)
    (root / "shape" / "config.json").write_text(json.dumps({k: fixtures.HYBRID_TEXT[k]
                                                            for k in ("hidden_size", "num_hidden_layers", "vocab_size")}))
    draft_dir = fixtures.write_dflash_draft(root / "draft", root / "shape", target_layer_ids=[0, 2],
                                            mask_token_id=fixtures.HYBRID_VOCAB - 1)
    return target, load_draft(str(draft_dir), target)


@pytest.fixture(scope="module")
def models(qwen3_dir, qwen3_draft_dir, tmp_path_factory):
    dense = load_model(str(qwen3_dir), dtype="float32").model
    hybrid, hybrid_draft = tiny_hybrid(tmp_path_factory.mktemp("warm"))
    return {"dense": (dense, load_draft(str(qwen3_draft_dir), dense), 151643),
            "hybrid": (hybrid, hybrid_draft, fixtures.HYBRID_VOCAB)}


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("padded", [True, False])
def test_steps_choose_only_variants_the_warm_up_runs(models, monkeypatch, kind, padded):
    target, draft, vocab = models[kind]
    recorder = Recorder(monkeypatch)
    plans = []

    def build():
        engine = make_engine(target, draft, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=512, prefix_cache=True)
        engine.runner.graphs = engine.runner.make_graphs(capture=False, padded=padded, bucket_keys=False)
        plans.append(kernel_plan(engine.runner, kernels=True))
        return engine
    first, arrivals = request_mix(vocab)
    engine, runs = run_batch(build, first, arrivals)
    assert all(run.request.is_finished for run in runs)
    assert next(run for run in runs if run.request.request_id == "hit").request.stats.cached_tokens >= 384
    plan = plans[0]
    planned = {(site.has_block, site.is_causal, v) for site, variants in plan.attention for v in variants}
    assert recorder.attention and recorder.attention <= planned, sorted(map(str, recorder.attention - planned))
    assert any(v.num_splits > 1 for _, _, v in recorder.attention)          # split-K steps were among them
    assert any(v.block_m == 64 for _, _, v in recorder.attention)           # and wide query tiles
    if kind == "hybrid":
        planned_gdn = set().union(*(variants for _, variants in plan.gdn))
        assert recorder.gdn and recorder.gdn <= planned_gdn, recorder.gdn - planned_gdn
        assert any(not v.keep for v in recorder.gdn)                         # short prefill chunks took it too
    else:
        assert not plan.gdn and not recorder.gdn


# -- the warm-up itself under the interpreter ----------------------------------------------------

CHILD = """
import json, logging, sys, tempfile, pathlib
sys.path.insert(0, %r)
from blockspec.engine import warm
from blockspec.kernels import attention, gdn
from helpers import make_engine
from test_warm import tiny_hybrid
from blockspec.models.gated_delta import warm_layouts
launches = {"attention": 0, "gdn": 0}
def counted(name, fn):
    def run(*args, **kwargs):
        launches[name] += 1
        return fn(*args, **kwargs)
    return run
attention.launch = counted("attention", attention.launch)
gdn.launch_step = counted("gdn", gdn.launch_step)
target, draft = tiny_hybrid(pathlib.Path(tempfile.mkdtemp()))
# 24 sequences of 4 rows: decode groups past the fused norm's 64 rows too
engine = make_engine(target, draft, block_size=4, max_num_seqs=24, max_num_batched_tokens=128, max_model_len=512)
runner = engine.runner
runner.graphs = runner.make_graphs(capture=False, bucket_keys=False)
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("blockspec.engine").addHandler(handler)
logging.getLogger("blockspec.engine").setLevel(logging.INFO)
warm.uses_kernels = lambda device: True          # as on CUDA: the startup's own call
plan = warm.warm_kernels(runner)
print(json.dumps({"planned": plan.num_variants, "log": lines, "attention": launches["attention"], "gdn": launches["gdn"],
                  "attention_planned": sum(len(v) for _, v in plan.attention),
                  "gdn_norms": sorted({v.norm for _, variants in plan.gdn for v in variants}),
                  "gdn_planned": sum(len(v) for _, v in plan.gdn),
                  "layouts": len(warm_layouts(plan.gdn[0][0], runner.dtype, runner.device)),
                  "slot0_clear": all(float(s[0].abs().max()) == 0.0 for s in runner.states.ssm),
                  "describe": plan.describe()}))
"""


def test_the_warm_up_runs_every_planned_variant_under_the_interpreter():
    """A hybrid target with a DFlash draft (target attention, the draft's block attention, the
    GDN step kernels), through the startup's own call: every planned variant launched once, the
    padding slot left clear, the count and time in the startup log."""
    done = run_interpreted(CHILD % str(Path(__file__).parent), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["attention"] == result["attention_planned"] > 0
    assert result["gdn"] == result["layouts"] * result["gdn_planned"] > 0 and result["gdn_norms"] == [False, True]
    assert result["layouts"] >= 2                 # views of the projection and PIECEWISE's staged copies
    assert result["planned"] == result["attention"] + result["gdn_planned"]
    assert result["slot0_clear"]
    assert [line for line in result["log"] if line.startswith(f"blockspec: warmed {result['planned']} kernel variants in ")
            and result["describe"] in line]


def specialization(t: torch.Tensor) -> tuple:
    """What Triton keys a compiled kernel on for a tensor argument and its strides: the pointer's
    16-byte alignment, each stride's divisibility by 16 (and whether it is 1)."""
    return t.data_ptr() % 16 == 0, tuple((s % 16 == 0, s == 1) for s in t.stride())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gdn_warm_up_layouts_cover_every_step_layout(tmp_path, dtype):
    """The decode rows of a step reach the GDN step kernels as rows [P, P + R) of the projection's
    views (FULL graphs, eager steps) or of a PIECEWISE graph's contiguous staging copies, P being
    the step's prefill rows: for every P, each argument's specialization is one the warm-up ran."""
    target, _ = tiny_hybrid(tmp_path)
    layer = next(m for m in target.modules() if isinstance(m, qwen3_5.GatedDeltaNet)).to(dtype)
    warmed = {tuple(map(specialization, layout)) for layout in warm_layouts(layer, dtype, torch.device("cpu"))}
    for rows in (1, 3, 8):
        projected = [t[0] for t in layer.project(torch.zeros(1, 40, layer.in_proj.in_features, dtype=dtype))]
        staged = [torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t) for t in projected]
        for source in (projected, staged):
            for start in range(16):
                step = tuple(specialization(t[start:start + rows]) for t in source)
                assert step in warmed, (rows, start, source is staged)


# -- fla's chunk form: always a batch of one ------------------------------------------------------

def test_the_fla_chunk_runs_a_padded_group_as_one_varlen_batch():
    """make_fla_chunk hands fla (here a stand-in with its varlen contract: B = 1, cu_seqlens,
    initial / final states per sequence, q and k normalised in the kernel) the group's real rows
    only, so fla's batch-keyed kernels see one shape; each sequence's output rows and final state
    are those of the padded group through the torch form (padding inert), padding rows zero."""
    from blockspec.models.gated_delta import chunk_gated_delta_rule, make_fla_chunk
    from test_hybrid import gdn_inputs
    calls = []

    def fla_varlen(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
        calls.append((q.shape[1], cu_seqlens.tolist()))
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            out, final = chunk_gated_delta_rule(*(x[:, start:end] for x in (q, k, v, g, beta)),
                                                initial_state[n:n + 1])
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    q, k, v, g, beta, state = (x.double() for x in gdn_inputs(70, seed=4))
    lengths = [70, 23]
    valid = (torch.arange(70)[None] < torch.tensor(lengths)[:, None])[..., None]
    g, beta = g * valid, beta * valid
    out, final = make_fla_chunk(fla_varlen)(q, k, v, g, beta, state, lengths)
    ref_out, ref_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert calls == [(93, [0, 70, 93])]
    assert out.shape == ref_out.shape and final.dtype == torch.float32
    assert (out - ref_out)[valid[..., 0]].abs().max() < 1e-6 and (out[~valid[..., 0]] == 0).all()
    assert (final.double() - ref_final).abs().max() < 1e-5
    uniform_out, _ = make_fla_chunk(fla_varlen)(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], state)
    assert calls[-1] == (46, [0, 23, 46])
    assert (uniform_out - chunk_gated_delta_rule(*(x[:, :23] for x in (q, k, v, g, beta)), state)[0]).abs().max() < 1e-6


# -- the request path ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_request_warm_up_leaves_nothing_behind(models, kind):
    """warm_requests (the server's startup on CUDA) runs its requests and leaves the engine as a
    fresh one: every page and state slot free, an empty prefix cache with zero counts, zero
    counters, nothing learnt by the adaptive policy; and what it serves next is what a fresh
    engine serves, greedy and seeded sampling, batched."""
    from blockspec.engine.engine import EngineCounters
    from blockspec.engine.warm import WARM_SAMPLING, warm_requests
    target, draft, vocab = models[kind]

    def build():
        return make_engine(target, draft, block_size=4, max_num_seqs=4, max_model_len=256, prefix_cache=True,
                           speculation="adaptive")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (7, 30)]
    mix = lambda: [make_request("g", prompts[0], max_tokens=12, max_model_len=256),       # noqa: E731
                   make_request("s", prompts[1], max_tokens=12, max_model_len=256, temperature=0.9, seed=4)]
    _, fresh = run_batch(build, mix())
    warmed = build()
    free = lambda: (warmed.cache.pages.num_free, warmed.cache.slots.num_free if warmed.cache.slots else 0)  # noqa: E731
    before = free()
    warm_requests(warmed, vocab)
    assert warmed.counters == EngineCounters()
    assert free() == before
    prefix = warmed.cache.prefix
    assert prefix.num_nodes == 0 and prefix.queries == prefix.hits == 0
    spec = warmed.runner.speculation
    assert spec.calibration.engine_seen.sum() == 0 and not spec._rows and spec.overhead_ms_per_seq == 0.0
    assert not warmed.has_work and len(WARM_SAMPLING) >= 4
    _, after = run_batch(lambda: warmed, mix())
    assert [run.output_ids for run in after] == [run.output_ids for run in fresh]
    narrow = make_engine(target, draft, block_size=4, max_num_seqs=1, max_queue=1, max_model_len=64)
    warm_requests(narrow, vocab)                 # more warm-up requests than its queue holds
    assert not narrow.has_work and narrow.counters == EngineCounters()


def test_the_warm_up_reads_no_more_logit_rows_than_a_step_can(models, monkeypatch):
    """The warm-up's logits stage runs at each graph bucket, but a step reads the logits of its
    verify rows and its chunks' last rows only — never more rows than every decoding sequence's
    block, the figure the memory profile measured. At the bucket's own size, 2,048 rows of a
    248k vocabulary were 2 GiB the pool was never sized for (the 35B MoE on an 80 GB card)."""
    target, draft, _ = models["dense"]
    engine = make_engine(target, draft, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    runner = engine.runner
    runner.graphs = runner.make_graphs(capture=False, bucket_keys=False)
    rows: list[int] = []
    real = target.compute_logits
    monkeypatch.setattr(target, "compute_logits", lambda hidden: (rows.append(hidden.shape[0]), real(hidden))[1])
    runner.warm_up()
    assert max(runner.graphs.piecewise_tokens) == 64 and runner.max_decode_seqs * runner.width == 8
    assert rows and max(rows) == 8
