"""The logits-processing stage (engine/logits.py) and structured output (structured.py):
lossless under DFlash (greedy DFlash == greedy plain with the same processors, at every block
size, dense and hybrid, alone and in mixed batches), each processor doing what it says, and
sampled constrained output keeping the masked target distribution."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar
from scipy.stats import chisquare

import fixtures
from blockspec.engine.logits import LogitsProcessor
from blockspec.engine.request import Request
from blockspec.engine.spec.dflash import Proposal, accept, process_verify, processed_drafts, walk_drafts
from blockspec.loader import load_draft, load_model
from blockspec.models.dflash2 import CandidateWalk
from blockspec.sampling import SamplingParams
from blockspec.server.parsers import ToolCallParser
from blockspec.structured import (TOOL_CALL_OPEN, GrammarError, GrammarSpec, compile_grammar, grammar_compiler,
                                  tool_call_schema)
from blockspec.tokenizer import Tokenizer
from helpers import make_engine, padded, run_alone, run_batch

STOPS = frozenset({fixtures.IM_END_ID, fixtures.ENDOFTEXT_ID})
PROMPT = [int(t) for t in torch.randint(0, 151643, (24,), generator=torch.Generator().manual_seed(3))]
LOOPING_PROMPT = [int(t) for t in torch.randint(0, 151643, (20,), generator=torch.Generator().manual_seed(1))]  # greedy repeats itself
OTHER_PROMPT = [int(t) for t in torch.randint(0, 151643, (9,), generator=torch.Generator().manual_seed(4))]
ALPHA = 1e-4          # chi-square false-alarm rate per check (as tests/test_acceptance.py)

# Bounded everywhere, so a random model's constrained output always closes within max_tokens.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def dense(qwen3_dir, qwen3_draft_dir):
    target = load_model(str(qwen3_dir)).model
    return target, load_draft(str(qwen3_draft_dir), target), Tokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def grammars(dense):
    target, _, tokenizer = dense
    compiler = grammar_compiler(tokenizer, target.lm_head.weight.shape[0])
    return {"schema": compile_grammar(compiler, GrammarSpec("json_schema", SCHEMA)),
            "object": compile_grammar(compiler, GrammarSpec("json_object")),
            "tool": compile_grammar(compiler, GrammarSpec("tool_call", tool_call_schema(TOOLS, None))),
            "named": compile_grammar(compiler, GrammarSpec("tool_call", tool_call_schema(TOOLS, "get_weather")))}


def request(prompt=PROMPT, grammar=None, request_id="r", stops=STOPS, **params) -> Request:
    params.setdefault("max_tokens", 60)
    return Request(request_id, prompt, SamplingParams(**params), stops, 1024, grammar=grammar)


def plain(target, req: Request) -> Request:
    return run_alone(lambda: make_engine(target), req).request


def dflash(target, draft, req: Request, block_size: int) -> Request:
    return run_alone(lambda: make_engine(target, draft, block_size=block_size), req).request


def text_of(tokenizer, req: Request) -> str:
    ids = [t for t in req.output_ids if t not in req.stop_ids]
    return tokenizer.decode(ids)


# ---- structured output: lossless, valid ---------------------------------------------------------

def test_constrained_greedy_dflash_equals_plain_and_validates(dense, grammars):
    target, draft, tokenizer = dense
    reference = plain(target, request(grammar=grammars["schema"]))
    assert reference.finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(tokenizer, reference)), SCHEMA)
    unconstrained = plain(target, request())
    assert unconstrained.output_ids != reference.output_ids            # the grammar did something
    for block_size in (2, 4, 8, 16):
        run = dflash(target, draft, request(grammar=grammars["schema"]), block_size)
        assert run.output_ids == reference.output_ids, block_size


@pytest.mark.parametrize("kind", ["object", "tool", "named"])
def test_json_object_and_forced_tool_calls(dense, grammars, kind):
    target, draft, tokenizer = dense
    reference = plain(target, request(grammar=grammars[kind]))
    assert dflash(target, draft, request(grammar=grammars[kind]), 4).output_ids == reference.output_ids
    assert reference.finish_reason == "stop"
    text = text_of(tokenizer, reference)
    if kind == "object":
        assert isinstance(json.loads(text), dict)
        return
    parser = ToolCallParser(TOOLS)
    content, _ = parser.feed(text)
    rest, _ = parser.flush()
    assert (content + rest).strip() == "" and parser.num_calls == 1, text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    function = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(call["arguments"], function["parameters"])
    if kind == "named":
        assert call["name"] == "get_weather"


def test_dflash2_and_the_graph_path_with_processors(dense, grammars, qwen3_dir, tmp_path):
    """DFlash 2 re-walks its candidates under the processed state (engine/spec/dflash.py:
    processed_walk): lossless like DFlash 1. The graph path's padded batch processes the same
    rows."""
    target, draft, _ = dense
    draft2 = load_draft(str(fixtures.write_dflash2_draft(tmp_path / "d2", qwen3_dir)), target)
    specs = [dict(grammar=grammars["schema"], presence_penalty=0.5), dict(grammar=grammars["tool"], min_tokens=4)]
    for spec in specs:
        reference = plain(target, request(**spec)).output_ids
        assert dflash(target, draft2, request(**spec), 4).output_ids == reference
        engine = lambda: padded(make_engine(target, draft, block_size=4))       # noqa: E731
        assert run_alone(engine, request(**spec)).output_ids == reference


def test_min_tokens_yields_to_a_completed_grammar(dense):
    """Where the grammar allows only the end, min_tokens does not mask it (nothing would be left)."""
    target, draft, tokenizer = dense
    compiler = grammar_compiler(tokenizer, target.lm_head.weight.shape[0])
    grammar = compile_grammar(compiler, GrammarSpec("json_schema", {"type": "boolean"}))
    for run in (plain(target, request(grammar=grammar, min_tokens=10)),
                dflash(target, draft, request(grammar=grammar, min_tokens=10), 4)):
        assert run.finish_reason == "stop" and text_of(tokenizer, run) in ("true", "false")


def test_a_length_bounded_string_refuses_raw_control_characters(dense):
    """JSON forbids U+0000–U+001F unescaped in a string; xgrammar's run for a string with
    maxLength / minLength lets them through (a sampled tab broke a client's strict parse). Our
    grammar refuses them there as in any other string, in schemas and in tool calls, and still
    takes what it took; the token-level matcher over our tokenizer agrees. (Not asserted of
    xgrammar's own grammar: a release that mends it leaves ours the same.)"""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts
    from blockspec.structured import schema_grammar
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "city": {"type": "string", "minLength": 2}, "note": {"type": "string"}},
              "required": ["name", "city", "note"]}
    ours = schema_grammar(schema, strict=True)
    good, tabbed = '{"name": "Ada", "city": "Oslo", "note": "a\\tb"}', '{"name": "A\tda", "city": "Oslo", "note": ""}'
    controls = [f'{{"name": "Ada", "city": "O{chr(c)}slo", "note": ""}}' for c in (0, 1, 9, 0x1f)]
    assert accepts(ours, good) and not accepts(ours, tabbed) and not any(accepts(ours, text) for text in controls)
    assert not accepts(ours, '{"name": "Ada Lovelace", "city": "Oslo", "note": ""}')    # maxLength kept
    target, _, tokenizer = dense
    compiler = grammar_compiler(tokenizer, target.lm_head.weight.shape[0])
    tool = tool_call_schema([{"type": "function", "function": {"name": "f", "parameters": schema}}], "f")
    for spec, prefix in ((GrammarSpec("json_schema", schema), '{"name": "A'),
                         (GrammarSpec("tool_call", tool), TOOL_CALL_OPEN + '{"name": "f", "arguments": {"name": "A')):
        matcher = xgrammar.GrammarMatcher(compile_grammar(compiler, spec), terminate_without_stop_token=True)
        assert matcher.accept_string(prefix) and not matcher.accept_string("\t") and matcher.accept_string("da")


def test_invalid_schema_is_refused_by_name(dense):
    target, _, tokenizer = dense
    compiler = grammar_compiler(tokenizer, target.lm_head.weight.shape[0])
    with pytest.raises(GrammarError, match="nonsense"):
        compile_grammar(compiler, GrammarSpec("json_schema", {"type": "nonsense"}))


def test_mixed_batch_equals_each_alone(dense, grammars):
    """Constrained, penalised and free requests in one DFlash batch: each equals itself run
    alone on a plain engine (greedy), and the sampled constrained one equals itself alone on
    the same DFlash engine (its draws do not depend on the batch)."""
    target, draft, _ = dense
    specs = [dict(grammar=grammars["schema"]), dict(), dict(presence_penalty=1.0, logit_bias=((100, 5.0),)),
             dict(grammar=grammars["tool"], prompt=OTHER_PROMPT),
             dict(grammar=grammars["schema"], temperature=1.0, seed=7, prompt=OTHER_PROMPT)]
    _, runs = run_batch(lambda: make_engine(target, draft, block_size=4),
                        [request(request_id=f"r{i}", max_tokens=40, **spec) for i, spec in enumerate(specs)])
    # a request that changes nothing never gets a processor (no per-row work, no extra host read)
    assert [run.seq.logits_processor is None for run in runs] == [False, True, False, False, False]
    for i, (spec, run) in enumerate(zip(specs, runs)):
        if "temperature" in spec:
            alone = dflash(target, draft, request(request_id=f"r{i}", max_tokens=40, **spec), 4)
        else:
            alone = plain(target, request(request_id=f"r{i}", max_tokens=40, **spec))
        assert run.output_ids == alone.output_ids, spec


def test_preempted_processed_requests_complete_exactly(dense, grammars):
    """A pool too small for four constrained / penalised sequences: the newest are preempted and
    recomputed; their processors keep the committed state, so each output is still its own."""
    target, draft, _ = dense
    specs = [dict(grammar=grammars["schema"]), dict(grammar=grammars["tool"], presence_penalty=0.5),
             dict(frequency_penalty=1.0, max_tokens=30), dict(grammar=grammars["named"], min_tokens=3)]
    prompts = [PROMPT[:7], PROMPT[7:15], OTHER_PROMPT, PROMPT[15:]]
    make = lambda i: request(prompts[i], request_id=f"p{i}", **specs[i])        # noqa: E731
    engine, runs = run_batch(lambda: make_engine(target, draft, block_size=4, num_pages=24, page_size=4),
                             [make(i) for i in range(4)])
    assert sum(run.seq.num_preemptions for run in runs) > 0
    for i, run in enumerate(runs):
        assert run.output_ids == plain(target, make(i)).output_ids, specs[i]


def test_sampled_constrained_output_is_always_valid(dense, grammars):
    target, draft, tokenizer = dense
    for seed in range(4):
        run = dflash(target, draft, request(grammar=grammars["schema"], temperature=1.0, seed=seed), 4)
        assert run.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(tokenizer, run)), SCHEMA)


def byte_grammar(vocab: int, schema: dict):
    """A grammar over a one-character-per-token vocabulary (the hybrid fixture's 256 ids):
    id i is chr(i) for printable ASCII, the rest have no text; id 0 is the stop token."""
    encoded = [chr(i) if 32 <= i < 127 else "" for i in range(vocab)]
    info = xgrammar.TokenizerInfo(encoded, vocab_size=vocab, stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema), any_whitespace=False)


def test_constrained_greedy_on_a_hybrid_target(tmp_path):
    target_dir = fixtures.write_hybrid_checkpoint(tmp_path / "hybrid")
    draft_dir = fixtures.write_dflash_draft(tmp_path / "draft", target_dir, target_layer_ids=[0, 2],
                                            mask_token_id=fixtures.HYBRID_VOCAB - 1)
    target = load_model(str(target_dir), dtype="float32").model
    draft = load_draft(str(draft_dir), target)
    grammar = byte_grammar(fixtures.HYBRID_VOCAB, SCHEMA)
    prompt = [5, 17, 99, 3, 42, 7, 200]
    make = lambda: request(prompt, grammar, stops=frozenset({0}), max_tokens=90, presence_penalty=0.5)  # noqa: E731
    reference = plain(target, make())
    assert reference.finish_reason == "stop"
    jsonschema.validate(json.loads("".join(chr(t) for t in reference.output_ids[:-1])), SCHEMA)
    for block_size in (2, 4, 8):
        assert dflash(target, draft, make(), block_size).output_ids == reference.output_ids, block_size
    # In a batch with a free and a penalised request: each equals itself alone on plain decoding.
    others = [request([9, 8, 7, 6], request_id="free", stops=frozenset(), max_tokens=40),
              request([1, 2, 3], request_id="pen", stops=frozenset(), max_tokens=40, frequency_penalty=1.0,
                      logit_bias=((65, 3.0),))]
    _, runs = run_batch(lambda: make_engine(target, draft, block_size=4), [make(), *others])
    alone = [reference.output_ids] + [plain(target, request(r.prompt_ids, request_id=r.request_id, stops=frozenset(),
                                                            max_tokens=40, **extra)).output_ids
                                      for r, extra in zip(others, [{}, dict(frequency_penalty=1.0, logit_bias=((65, 3.0),))])]
    assert [run.output_ids for run in runs] == alone
    # One valid token per position: the masked drafts are always right, so every block is accepted
    # whole (an unmasked random draft would almost never be).
    forced = byte_grammar(fixtures.HYBRID_VOCAB, {"const": "abcdefghijklmnopqrstuvw"})
    run = dflash(target, draft, request(prompt, forced, stops=frozenset({0}), max_tokens=90), 8)
    assert bytes(run.output_ids[:-1]).decode() == '"abcdefghijklmnopqrstuvw"' and run.output_ids[-1] == 0
    assert run.stats.acceptance_lengths[:3] == [8, 8, 8]
    # DFlash 2 too: its walk falls back to the grammar's token when no candidate is allowed.
    draft2 = load_draft(str(fixtures.write_dflash2_draft(tmp_path / "d2", target_dir, target_layer_ids=[0, 2],
                                                         mask_token_id=fixtures.HYBRID_VOCAB - 1,
                                                         conv_group_size=8)), target)
    run2 = dflash(target, draft2, request(prompt, forced, stops=frozenset({0}), max_tokens=90), 8)
    assert run2.output_ids == run.output_ids and run2.stats.acceptance_lengths[:3] == [8, 8, 8]
    assert dflash(target, draft2, make(), 4).output_ids == reference.output_ids


# ---- penalties, logit_bias, min_tokens, ignore_eos -----------------------------------------------

PROCESSORS = {"presence": dict(presence_penalty=1.5), "frequency": dict(frequency_penalty=1.0),
              "repetition": dict(repetition_penalty=1.4), "bias": dict(logit_bias=((124449, -100.0), (100, 3.0))),
              "all": dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias=((100, 4.0),), min_tokens=3)}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_processors_dflash_equals_plain_and_change_the_output(dense, name):
    target, draft, _ = dense
    reference = plain(target, request(LOOPING_PROMPT, max_tokens=30, **PROCESSORS[name]))
    assert reference.output_ids != plain(target, request(LOOPING_PROMPT, max_tokens=30)).output_ids
    for block_size in (2, 4, 8) if name == "all" else (2, 8):
        assert dflash(target, draft, request(LOOPING_PROMPT, max_tokens=30, **PROCESSORS[name]), block_size).output_ids \
            == reference.output_ids, block_size


def test_logit_bias_min_tokens_and_ignore_eos(dense):
    target, draft, _ = dense
    forced = dict(logit_bias=((fixtures.IM_END_ID, 100.0),))
    assert plain(target, request(**forced)).output_ids == [fixtures.IM_END_ID]
    for run in (plain(target, request(min_tokens=5, **forced)), dflash(target, draft, request(min_tokens=5, **forced), 4)):
        # 5 tokens with every stop id masked, then the biased end token
        assert len(run.output_ids) == 6 and run.output_ids[-1] == fixtures.IM_END_ID
        assert STOPS.isdisjoint(run.output_ids[:5]) and run.finish_reason == "stop"
    ignoring = plain(target, request(max_tokens=7, ignore_eos=True, **forced))
    assert ignoring.output_ids == [fixtures.IM_END_ID] * 7 and ignoring.finish_reason == "length"
    stopping = plain(target, request(max_tokens=7, ignore_eos=True, stop_token_ids=(100,),
                                     logit_bias=((100, 100.0),)))
    assert stopping.output_ids == [100] and stopping.finish_reason == "stop"      # its own stop ids still stop


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's rules, one token at a time: bias; repetition on prompt ∪ output (divide positive
    logits, multiply negative); frequency · count and presence on the output."""
    scores = logits.double().clone()
    for token, bias in params.logit_bias:
        scores[token] += bias
    for token in range(scores.shape[0]):
        count = output.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            scores[token] = scores[token] / r if scores[token] > 0 else scores[token] * r
        scores[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return scores


def test_logit_bias_comes_before_the_penalties():
    """vLLM's order: the repetition penalty scales the *biased* logit. Biased tokens the output
    has seen (prompt token 3, output token 6) tell the orders apart: bias then penalty gives
    (1 + 3) / 2 = 2 and (-1 - 1) · 2 = -4; penalty then bias would give 3.5 and -3."""
    params = SamplingParams(max_tokens=8, repetition_penalty=2.0, frequency_penalty=0.5,
                            logit_bias=((3, 3.0), (6, -1.0)))
    req = Request("r", [3, 5], params, frozenset(), 100)
    req.commit([6])
    processor = LogitsProcessor(req, 8, torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 1.0, -1.0, 0.0]])
    row = processor.rows(logits, [])[0]
    assert row[3].item() == pytest.approx(2.0)
    assert row[6].item() == pytest.approx(-4.0 - 0.5)           # then frequency · count (1)
    assert row[5].item() == pytest.approx(0.5)                  # seen, unbiased: penalised alone
    torch.testing.assert_close(row.double(), reference_penalties(logits[0], req.prompt_ids, req.output_ids, params))


def test_rows_follow_the_drafts_and_leave_the_state_as_it_was():
    vocab, gen = 12, torch.Generator().manual_seed(0)
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5,
                            logit_bias=((3, 1.0), (5, -2.0)), min_tokens=4, max_tokens=20)
    req = Request("r", [1, 2, 2], params, frozenset({11}), 100)
    req.commit([4, 4])
    processor = LogitsProcessor(req, vocab, torch.device("cpu"))
    processor.advance([7])
    req.commit([7])
    logits, drafts = torch.randn(4, vocab, generator=gen) * 3, [4, 9, 1]
    before = processor.counts.clone()
    rows = processor.rows(logits, drafts)
    for i in range(4):
        expected = reference_penalties(logits[i], req.prompt_ids, req.output_ids + drafts[:i], params)
        expected[11] = float("-inf") if len(req.output_ids) + i < 4 else expected[11]     # min_tokens
        torch.testing.assert_close(rows[i].double(), expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(processor.counts, before) and processor.num_output == 3


def test_the_matcher_is_rolled_back_after_a_candidate_walk(dense, grammars):
    target, _, tokenizer = dense
    req = request(grammar=grammars["schema"])
    vocab = target.lm_head.weight.shape[0]
    processor = LogitsProcessor(req, vocab, torch.device("cpu"))
    prefix = tokenizer.encode('{"name": "ab"')
    processor.advance(prefix[:2])
    before = processor.rows(torch.zeros(1, vocab), [])
    walked = processor.rows(torch.zeros(3, vocab), prefix[2:])
    assert torch.equal(processor.rows(torch.zeros(1, vocab), []), before)            # rolled back
    assert torch.equal(walked[0], before[0]) and not torch.equal(walked[1], walked[0])
    # a refused candidate ends the walk: the rows after it are left unmasked (and never used)
    refused = tokenizer.encode("}")
    assert torch.isinf(before[0, refused]).all()
    walked = processor.rows(torch.zeros(3, vocab), refused + prefix[2:])
    assert torch.equal(walked[0], before[0]) and torch.isfinite(walked[1:]).all()
    assert torch.equal(processor.rows(torch.zeros(1, vocab), []), before)


# ---- sampling: the rejection rule on processed distributions --------------------------------------

TINY = ["a", "b", "c", "d", ""]       # 4 one-letter tokens and an end token (id 4)


DRAFTS = ("dflash1", "dflash2", "dflash2-fallback")


@pytest.mark.parametrize("drafter", DRAFTS)
def test_rejection_sampling_on_masked_distributions_keeps_the_masked_target(drafter):
    """Grammar (a|b)(a|c|d) on a 5-token vocabulary; a fixed target (row 0, and row 1 after the
    first token) and a draft that proposes from other scores: DFlash 1 logits, a DFlash 2 walk
    whose candidates the grammar partly refuses, or one whose first-slot candidates it refuses
    entirely (the walk falls back to the grammar's own token, q one-hot). The first emitted token
    must follow the masked p_0, and the second, given the first was an accepted draft, the masked
    p_1 after it — each checked by chi-square (false alarm 1e-4 per check), masked tokens never."""
    info = xgrammar.TokenizerInfo(TINY, vocab_size=len(TINY), stop_token_ids=[4])
    grammar = xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar('root ::= ("a" | "b") ("a" | "c" | "d")')
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, len(TINY), generator=gen) * 1.5
    target[0, :2] = torch.tensor([0.5, 0.1])            # both first tokens common enough to check what follows
    draft_logits = target[:2] + torch.randn(2, len(TINY), generator=gen)        # close, not equal
    candidates = {"dflash2": [[0, 1], [2, 1]], "dflash2-fallback": [[2, 3], [3, 0]]}.get(drafter)
    first, second = np.zeros(len(TINY)), {0: np.zeros(len(TINY)), 1: np.zeros(len(TINY))}
    for trial in range(2000):
        req = Request("r", [1], SamplingParams(temperature=1.0, seed=trial, max_tokens=10), frozenset({4}), 100,
                      grammar=grammar)
        seq = _Seq(req, len(TINY))
        if candidates is None:
            drafts, q = processed_drafts(seq, draft_logits)
            proposal = Proposal(drafts.view(1, -1), [q])
        else:
            walk = CandidateWalk(torch.tensor([candidates]), torch.randn(1, 2, 2, 2, generator=gen),
                                 torch.zeros(1, 2, dtype=torch.long), len(TINY))
            proposal = walk_drafts(walk, [seq])
        num_accepted, tokens = accept([seq], proposal, target.view(1, 3, -1),
                                      process_verify([seq], proposal, target.view(1, 3, -1)))
        first[tokens[0][0]] += 1
        if num_accepted[0] >= 1:
            second[tokens[0][0]][tokens[0][1]] += 1
    check_frequencies(first, masked_softmax(target[0], [0, 1]))
    for token in (0, 1) if drafter != "dflash2-fallback" else (0,):        # the fallback always drafts "a"
        check_frequencies(second[token], masked_softmax(target[1], [0, 2, 3]))


class _Seq:
    """What the DFlash accept path reads of a Sequence."""

    def __init__(self, req: Request, vocab: int) -> None:
        self.request = req
        self.generator = torch.Generator().manual_seed(req.params.seed)
        self.logits_processor = LogitsProcessor(req, vocab, torch.device("cpu"))


def masked_softmax(logits: torch.Tensor, allowed: list[int]) -> np.ndarray:
    probs = np.zeros(logits.shape[0])
    values = torch.softmax(logits[allowed].double(), 0).numpy()
    probs[allowed] = values
    return probs


def check_frequencies(counts: np.ndarray, expected: np.ndarray) -> None:
    assert counts[expected == 0].sum() == 0, counts
    kept = expected > 0
    assert counts.sum() > 200
    assert chisquare(counts[kept], counts.sum() * expected[kept]).pvalue > ALPHA, (counts, expected)


def test_constrained_demo_pair_keeps_its_acceptance():
    """The shipped demo pair (a trained draft): constrained greedy DFlash at its block size 8
    equals plain, and masking the drafts keeps acceptance where it is without a grammar (τ ≈ 3)."""
    from blockspec import demo
    from blockspec.llm import LLM
    settings = dict(device="cpu", show_progress=False, cuda_graphs=False, max_model_len=512)
    plain_llm = LLM(str(demo.TARGET_DIR), **settings)
    spec_llm = LLM(str(demo.TARGET_DIR), draft=str(demo.DRAFT_DIR), block_size=8, **settings)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "count": {"type": "integer"},
                                               "items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 4}},
              "required": ["name", "count", "items"], "additionalProperties": False}
    tokenizer = plain_llm.tokenizer
    grammar = compile_grammar(grammar_compiler(tokenizer, plain_llm.target.lm_head.weight.shape[0]),
                              GrammarSpec("json_schema", schema))
    runs = []
    for llm in (plain_llm, spec_llm):
        req = llm.make_request("r", tokenizer.encode(demo.DEFAULT_PROMPT), SamplingParams(max_tokens=64))
        req.grammar = grammar
        llm.generate_requests([req])
        runs.append(req)
    assert runs[0].output_ids == runs[1].output_ids and runs[1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(tokenizer, runs[1])), schema)
    assert runs[1].stats.mean_acceptance_length > 2.5


def test_bench_forced_acceptance_wraps_the_new_accept(dense):
    """The bench replaces accept() to force an acceptance length; it must take the processed rows."""
    from blockspec import bench
    target, draft, _ = dense
    result = bench.throughput(target, draft, 4, 2, 16, 12, 2.5)
    assert result["mean_acceptance_length"] > 2.0


def test_bitmask_application_equals_xgrammars():
    """Our torch masking (any device, no kernel build) reads xgrammar's bitmask layout exactly."""
    from blockspec.engine.logits import apply_bitmask
    vocab, gen = 151936, torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    ours = torch.randn(3, vocab, generator=gen)
    theirs = ours.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    apply_bitmask(ours, bitmask)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any() and torch.isfinite(ours).any()
