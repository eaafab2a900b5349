"""Audit 65: invariants of the prefix cache, structured output, the output parsers and stop
strings, the streamed detokenizer and the request lifecycle that planted bugs got past (each
test here fails with its mutant in scripts/mutation_check.py, group audit65)."""
from __future__ import annotations

import pytest
import torch

import fixtures
from blockspec.cache import PageAllocator
from blockspec.cache.prefix import PrefixCache

PAGE = 4


# -- the prefix cache ---------------------------------------------------------------------------

def test_a_snapshot_a_sequence_will_resume_from_is_never_taken_for_another():
    """A hybrid hit resumes from its node's snapshot at the sequence's next forward (admit
    protects the slot until then). With the one snapshot slot protected, a chunk asking for a
    slot gets none: taking it would overwrite the state the sequence is about to restore. Once
    the sequence has run (unprotect), the slot is the least recently used one and is taken."""
    pages = PageAllocator(16)
    cache = PrefixCache(PAGE, pages, [7], needs_snapshots=True)
    tokens = [1] * 5
    block_table = pages.allocate(2)
    path: list = []
    cache.insert(path, tokens, block_table, 1)
    cache.attach_snapshot(path[0], cache.take_snapshot_slot())
    hit = cache.match(tokens, 4)
    assert hit.snapshot == 7 and hit.nodes == path
    cache.protect(7)
    assert cache.take_snapshot_slot() is None
    assert path[0].snapshot == 7 and cache.match(tokens, 4).snapshot == 7
    cache.check()
    cache.unprotect(7)
    assert cache.take_snapshot_slot() == 7 and path[0].snapshot is None
    assert cache.match(tokens, 4).nodes == []
    cache.check()


# -- structured output ----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from blockspec.tokenizer import Tokenizer
    return Tokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from blockspec.structured import grammar_compiler
    return grammar_compiler(tokenizer, fixtures.QWEN3_VOCAB_SIZE)


def accepts(compiled, text: str) -> bool:
    """Whether the grammar takes `text` whole, as a complete output."""
    import xgrammar
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_a_strict_schema_refuses_properties_it_does_not_name_and_a_loose_one_takes_them(compiler):
    """strict (OpenAI's json_schema.strict, our default): the output has the schema's properties
    only, as if additionalProperties were false; strict false leaves JSON Schema's default."""
    from blockspec.structured import GrammarSpec, compile_grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict = compile_grammar(compiler, GrammarSpec("json_schema", schema, strict=True))
    loose = compile_grammar(compiler, GrammarSpec("json_schema", schema, strict=False))
    assert accepts(strict, '{"a": 1}') and accepts(loose, '{"a": 1}')
    assert not accepts(strict, '{"a": 1, "b": 2}')
    assert accepts(loose, '{"a": 1, "b": 2}')


def test_json_object_output_is_compact(compiler):
    """json_object allows no free whitespace (a model could spin on spaces until max_tokens):
    ", " and ": " between items, nothing else."""
    from blockspec.structured import GrammarSpec, compile_grammar
    grammar = compile_grammar(compiler, GrammarSpec("json_object"))
    assert accepts(grammar, '{"a": 1, "b": [2, 3]}')
    for spaced in ('{ "a": 1}', '{"a": 1 }', '{"a":  1}', '{"a": [2 ]}', '{"a": 1,\n"b": 2}'):
        assert not accepts(grammar, spaced), spaced


def test_a_named_tool_choice_allows_that_tool_only(compiler):
    """tool_choice {"function": {"name": n}}: the grammar's call names n, whatever other tools
    the request lists; "required" (no name) takes any of them."""
    from blockspec.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GrammarSpec, compile_grammar, tool_call_schema
    named = compile_grammar(compiler, GrammarSpec("tool_call", tool_call_schema(TOOLS, "noop")))
    anyone = compile_grammar(compiler, GrammarSpec("tool_call", tool_call_schema(TOOLS, None)))
    noop = TOOL_CALL_OPEN + '{"name": "noop", "arguments": {}}' + TOOL_CALL_CLOSE
    weather = TOOL_CALL_OPEN + '{"name": "get_weather", "arguments": {"city": "Oslo"}}' + TOOL_CALL_CLOSE
    assert accepts(named, noop) and not accepts(named, weather)
    assert accepts(anyone, noop) and accepts(anyone, weather)


def test_each_draft_slots_grammar_state_is_the_one_after_the_drafts_before_it(tokenizer, compiler):
    """DFlash drafts slot by slot (LogitsProcessor.draft): slot j is processed with the state
    after the committed output and d_1 … d_j (rows with an offset); each such walk is rolled
    back whole, so the committed state is as it was and slot j's row equals a processor's that
    committed d_1 … d_j."""
    from blockspec.engine.logits import LogitsProcessor
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    from blockspec.structured import GrammarSpec, compile_grammar
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = compile_grammar(compiler, GrammarSpec("json_schema", schema))
    vocab, cpu = fixtures.QWEN3_VOCAB_SIZE, torch.device("cpu")

    def processor() -> LogitsProcessor:
        return LogitsProcessor(Request("r", [1, 2, 3], SamplingParams(max_tokens=30), frozenset({fixtures.IM_END_ID}),
                                       1024, grammar=grammar), vocab, cpu)

    walking, zeros = processor(), torch.zeros(1, vocab)
    committed = walking.rows(zeros, [])
    drafts = tokenizer.encode('{"name": "ab')
    assert len(drafts) >= 3
    for j in range(1, len(drafts) + 1):
        row = walking.rows(zeros, drafts, offset=j)
        assert torch.equal(walking.rows(zeros, []), committed), j          # rolled back whole
        reference = processor()
        reference.advance(drafts[:j])
        assert torch.equal(row, reference.rows(zeros, [])), j
        assert not torch.equal(row, committed)


# -- the streamed detokenizer ------------------------------------------------------------------

class ByteFallbackTokenizer:
    """A SentencePiece-style vocabulary (Llama's decoder: ▁ for spaces, <0xNN> byte tokens for
    characters it lacks, the first leading space stripped): "€" is 3 byte tokens, "😀" 4."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, normalizers
        pieces = [("<unk>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
        pieces += [(w, -1.0) for w in ("▁Hello", "▁world", "▁", "uro", "!")]
        self.backend = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
        self.backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        self.backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                  decoders.Fuse(), decoders.Strip(" ", 1, 0)])

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


BYTE_FALLBACK_TEXT = "Hello €uro 😀 world!"


def test_byte_fallback_tokens_stream_whole_characters_and_lose_nothing():
    """Every prefix of the output, one token at a time: the chunks add up to the whole decode,
    none holds a replacement character unless the decode itself ends in an unfinished one, and
    the bytes of "€" and "😀" come out together with the token that completes them."""
    from blockspec.tokenizer import IncrementalDetokenizer
    tokenizer = ByteFallbackTokenizer()
    ids = tokenizer.encode(BYTE_FALLBACK_TEXT)
    assert sum(tokenizer.decode([i]).startswith("\ufffd") for i in ids) == 7        # 3 + 4 byte tokens
    for end in range(len(ids) + 1):
        detokenizer = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
        chunks = [detokenizer.add([i]) for i in ids[:end]]
        last = detokenizer.flush()
        whole = tokenizer.decode(ids[:end])
        assert "".join(chunks) + last == whole, end
        assert not any("\ufffd" in chunk for chunk in chunks), end
        assert last == ("\ufffd" * (len(whole) - len(whole.rstrip("\ufffd")))), end
    detokenizer = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
    chunks = [detokenizer.add([i]) for i in ids] + [detokenizer.flush()]
    assert chunks == ["Hello", " ", "", "", "€", "uro", " ", "", "", "", "😀", " world", "!", ""]


def test_byte_fallback_output_continuing_a_prompt_cut_inside_a_character():
    """A prompt that ends one or two byte tokens into "€": the stream starts with the whole
    character and goes on as the text continues the prompt."""
    from blockspec.tokenizer import IncrementalDetokenizer
    tokenizer = ByteFallbackTokenizer()
    ids = tokenizer.encode(BYTE_FALLBACK_TEXT)
    euro = ids.index(tokenizer.encode("€")[-3])
    for cut in (euro + 1, euro + 2):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])  # type: ignore[arg-type]
        text = "".join(detokenizer.add([i]) for i in ids[cut:]) + detokenizer.flush()
        assert text == "€uro 😀 world!", cut


# -- the output side of a request: stop strings, tool calls, reasoning -----------------------------

def test_the_token_that_completes_a_stop_string_keeps_its_logprob():
    """With stop strings the ids are counted one at a time and the count ends at the id that
    completes one (it is a completion token): its logprob is reported with it, one per counted
    id, in a single batch (a DFlash block) and one id at a time alike."""
    from test_output import make, tokenize
    ids = tokenize("Hello STOP world")
    logprobs = [f"lp{i}" for i in range(len(ids))]
    for batches in ([ids], [[i] for i in ids]):
        processor, got, start = make(stop=("STOP",)), [], 0
        for batch in batches:
            delta = processor.process(batch, None, logprobs[start:start + len(batch)])
            got += delta.logprobs
            start += len(batch)
            if delta.finish_reason is not None:
                break
        assert processor.finish_reason == "stop" and processor.completion_tokens == ids.index(tokenize("OP")[0]) + 1
        assert got == logprobs[:processor.completion_tokens]


@pytest.fixture(scope="module")
def tokenizer_server(tokenizer):
    """An in-process server over the scripted engine (tests/test_server.py): the answer is
    whatever ids the test puts in llm.word."""
    from blockspec.server.app import ServerSettings
    from servers import InProcessServer, wait_until
    from test_server import ScriptedLLM
    import httpx
    llm = ScriptedLLM(tokenizer)
    llm.release.set()
    with InProcessServer(lambda: llm, ServerSettings(model="scripted")) as server:
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)
        yield llm, server


def answer(tokenizer_server, text: str, body: dict) -> tuple[dict, list]:
    """The scripted model answers `text` then <|im_end|>: the whole response and the stream's events."""
    import httpx
    from test_server import sse_payloads
    llm, server = tokenizer_server
    llm.word = llm.tokenizer.encode(text) + [llm.tokenizer.encode("<|im_end|>")[0]]
    body = {"max_tokens": 200, **body}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
    streamed = sse_payloads(httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True},
                                       timeout=30).content)
    return whole, streamed


def test_text_and_a_tool_call_in_one_streamed_piece_both_reach_the_client(tokenizer_server):
    """A block of ids can hold the end of the content and a whole tool call: that delta's chunk
    carries both (a chunk of its text alone would lose the call)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    whole, streamed = answer(tokenizer_server, "Checking." + call,
                             {"messages": [{"role": "user", "content": "weather?"}], "tools": tools})
    message = whole["choices"][0]["message"]
    assert message["content"] == "Checking." and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    deltas = [c["delta"] for e in streamed[:-1] for c in e["choices"]]
    pieces = [piece for d in deltas for piece in d.get("tool_calls") or []]
    assert [(p["index"], p["function"]) for p in pieces] == [(0, {"name": "get_weather",
                                                                  "arguments": '{"city": "Rome"}'})]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert [c["finish_reason"] for e in streamed[:-1] for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


def test_a_grammar_constrained_answer_after_an_opened_think_tag_is_content(tokenizer_server):
    """A prompt whose template (here: the continued final message) opened <think> makes the
    output reasoning until </think>; a grammar constrains the output from its first token, so
    the JSON it produces is the content, whole and streamed."""
    body = {"messages": [{"role": "user", "content": "json please"}, {"role": "assistant", "content": "<think>"}],
            "add_generation_prompt": False, "continue_final_message": True,
            "response_format": {"type": "json_object"}}
    whole, streamed = answer(tokenizer_server, '{"a": 1}', body)
    message = whole["choices"][0]["message"]
    assert message["content"] == '{"a": 1}' and message.get("reasoning_content") is None
    deltas = [c["delta"] for e in streamed[:-1] for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == '{"a": 1}'
    assert not any(d.get("reasoning_content") for d in deltas)
    # without the grammar the same answer is reasoning (the test's premise)
    whole, _ = answer(tokenizer_server, '{"a": 1}', {k: v for k, v in body.items() if k != "response_format"})
    assert whole["choices"][0]["message"]["reasoning_content"] == '{"a": 1}'


# -- the request lifecycle --------------------------------------------------------------------------

def test_a_block_cut_at_a_stop_id_or_max_tokens_keeps_the_logprobs_of_its_committed_tokens_only():
    """A verify block commits up to its first stop id (kept) and up to max_tokens: the logprobs
    kept are exactly those of the committed tokens, so the engine's event (the request's last
    len(tokens) logprobs) carries each committed token's own, none of a draft past the cut."""
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    stop = Request("s", [1, 2], SamplingParams(max_tokens=10), frozenset({11}), 100)
    assert stop.commit([5, 6], ["a", "b"]) == [5, 6]
    assert stop.commit([7, 11, 8, 9], ["c", "d", "e", "f"]) == [7, 11] and stop.finish_reason == "stop"
    assert stop.output_logprobs == ["a", "b", "c", "d"]
    length = Request("l", [1, 2], SamplingParams(max_tokens=3), frozenset({11}), 100)
    assert length.commit([5, 6, 7, 8], ["a", "b", "c", "d"]) == [5, 6, 7] and length.finish_reason == "length"
    assert length.output_logprobs == ["a", "b", "c"]


def test_the_output_fills_the_context_exactly():
    """Prompt and output together fill max_model_len, no more and no less: a 6-token prompt in a
    context of 10 may have exactly 4 output tokens, the last cut from a longer block ends it
    with length; a max_tokens below that room is the limit instead."""
    from blockspec.engine.request import Request
    from blockspec.sampling import SamplingParams
    request = Request("c", list(range(6)), SamplingParams(max_tokens=100), frozenset(), 10)
    assert request.num_allowed == 4
    assert request.commit([20, 21, 22]) == [20, 21, 22] and request.finish_reason is None
    assert request.commit([23, 24, 25]) == [23] and request.finish_reason == "length"
    assert len(request.prompt_ids) + len(request.output_ids) == 10
    assert Request("m", list(range(6)), SamplingParams(max_tokens=3), frozenset(), 10).num_allowed == 3
