"""OutputProcessor: detokenize -> stop strings -> reasoning -> tool calls, any batching of ids."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.server.output import (
    OutputAccumulator,
    OutputDelta,
    OutputProcessor,
    StopStringFilter,
)
from blockspec.server.parsers import ToolCallDelta
from blockspec.server.streaming import TextChunks

# A toy byte-level vocabulary: every single byte, plus multi-char tokens, tokens that split tags
# ("<tool" + "_call>", "</th" + "ink>") and a stop string ("ST" + "OP"). "é" has no token of its
# own: it is two byte tokens, so a token boundary falls inside a UTF-8 character.
MULTI = [b"Hello", b" world", b"<tool", b"_call>", b"</tool_call>", b"</th", b"ink>", b"ST", b"OP",
         b'{"name": ', b'"arguments": ', b"\n\n"]
VOCAB = [bytes([b]) for b in range(256)] + MULTI


def tokenize(text: str) -> list[int]:
    """Greedy longest match over VOCAB."""
    data, ids, pos = text.encode(), [], 0
    while pos < len(data):
        best = max((i for i, tok in enumerate(VOCAB) if data.startswith(tok, pos)),
                   key=lambda i: len(VOCAB[i]))
        ids.append(best)
        pos += len(VOCAB[best])
    return ids


class FakeDetokenizer:
    """Incremental UTF-8 decoding over VOCAB: incomplete characters wait for their bytes."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: list[int]) -> str:
        return self._decoder.decode(b"".join(VOCAB[i] for i in ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def batchings(ids: list[int]) -> Iterator[list[list[int]]]:
    """All at once, every two-batch split, one id at a time (a DFlash block vs plain decode)."""
    yield [ids]
    for cut in range(1, len(ids)):
        yield [ids[:cut], ids[cut:]]
    yield [[i] for i in ids]


def make(stop: tuple[str, ...] = (), **options) -> OutputProcessor:
    return OutputProcessor(FakeDetokenizer(), list(stop), **options)


def run(batches: list[list[int]], finished: str = "stop", stop: tuple[str, ...] = (), **options):
    """Feed batches (the last one carries `finished`); return processor, deltas, accumulated."""
    processor = make(stop, **options)
    deltas: list[OutputDelta] = []
    total = OutputAccumulator()
    for number, batch in enumerate(batches):
        delta = processor.process(batch, finished if number == len(batches) - 1 else None)
        deltas.append(delta)
        total.add(delta)
    return processor, deltas, total


def check_ends_once(deltas: list[OutputDelta]) -> None:
    reasons = [d.finish_reason for d in deltas if d.finish_reason is not None]
    assert len(reasons) == 1


def test_tokenizer_fixture_splits_tags_and_characters() -> None:
    assert [VOCAB[i] for i in tokenize("<tool_call>")] == [b"<tool", b"_call>"]
    assert [VOCAB[i] for i in tokenize("</think>")] == [b"</th", b"ink>"]
    assert len(tokenize("é")) == 2


def test_plain_text_any_batching() -> None:
    text = "Hello world, café ünïcödé 東京!\n"
    ids = tokenize(text)
    for batches in batchings(ids):
        processor, deltas, total = run(batches, "length")
        assert total.content == text and total.reasoning == "" and total.tool_calls == []
        assert total.finish_reason == "length" and deltas[-1].finish_reason == "length"
        assert processor.completion_tokens == len(ids)
        assert "\ufffd" not in total.content
        check_ends_once(deltas)


def test_stop_string_split_across_tokens() -> None:
    ids = tokenize("Hello STOP world and more")
    stop_token = ids.index(VOCAB.index(b"OP"))
    assert VOCAB[ids[stop_token - 1]] == b"ST"
    for batches in batchings(ids):
        processor, deltas, total = run(batches, "length", stop=("STOP",))
        assert total.content == "Hello "
        assert total.finish_reason == "stop"
        hits = [d for d in deltas if d.stop_hit]
        assert len(hits) == 1 and hits[0].finish_reason == "stop"
        assert processor.completion_tokens == stop_token + 1  # counted up to the completing id
        assert "world" not in total.content
        check_ends_once(deltas)


def test_partial_stop_string_is_held_then_released() -> None:
    processor = make(stop=("</end>",))
    emitted = ""
    for token in tokenize("x </en"):
        delta = processor.process([token])
        emitted += delta.content
        assert not delta.stop_hit
        assert emitted in ("", "x", "x ")  # never any of "</en"
    assert emitted == "x "
    last = processor.process([], "length")
    assert last.content == "</en" and last.finish_reason == "length" and not last.stop_hit


def test_partial_stop_string_resolved_by_mismatch() -> None:
    for batches in batchings(tokenize("a</enX</end>b")):
        _, _, total = run(batches, "length", stop=("</end>",))
        assert total.content == "a</enX" and total.finish_reason == "stop"


def test_nothing_after_a_stop_is_emitted_or_counted() -> None:
    processor = make(stop=("STOP",))
    first = processor.process(tokenize("Hi STOP"))
    assert first.stop_hit and first.content == "Hi " and processor.is_finished
    tokens = processor.completion_tokens
    later = processor.process(tokenize("more text"), "stop")
    assert later == OutputDelta() and later.is_empty
    assert processor.completion_tokens == tokens and processor.finish_reason == "stop"


def test_stop_that_completes_first_wins_in_any_batching() -> None:
    # "bc" completes before "abcd" does, although "abcd" starts earlier.
    for batches in batchings(tokenize("xxabcdyy")):
        _, _, total = run(batches, "length", stop=("abcd", "bc"))
        assert total.content == "xxa"


def test_one_token_completing_two_stop_strings_cuts_at_the_one_ending_first() -> None:
    """"OP" is one token: it completes "TO" (ending a char earlier, so it wins) and "STOP"
    together, and "STOP" and "OP" on the same char (the longer wins); the order of the list
    decides nothing."""
    cases = [(("STOP", "TO"), "Hi S"), (("TO", "STOP"), "Hi S"), (("OP", "STOP"), "Hi "), (("STOP", "OP"), "Hi ")]
    for stops, content in cases:
        for batches in batchings(tokenize("Hi STOP!")):
            processor, _, total = run(batches, "length", stop=stops)
            assert (total.content, total.finish_reason) == (content, "stop"), (stops, batches)
            assert processor.completion_tokens == 5          # H i ␠ ST OP: counted up to the one that stopped


def test_stop_in_detokenizer_flush() -> None:
    # "é" split in two byte tokens; an incomplete trailing byte is decoded only by flush().
    ids = tokenize("aé")[:-1]
    processor = make(stop=("\ufffd",))
    delta = processor.process(ids, "length")
    assert delta.content == "a" and delta.stop_hit and delta.finish_reason == "stop"


def test_stop_strings_apply_to_raw_text_including_reasoning() -> None:
    text = "weighing STOP options</think>answer"
    for batches in batchings(tokenize(text)):
        _, _, total = run(batches, stop=("STOP",), reasoning=True, reasoning_started_in_prompt=True)
        assert total.reasoning == "weighing " and total.content == ""
        assert total.finish_reason == "stop"


def test_reasoning_started_in_prompt() -> None:
    text = "The user wants a city.\n</think>\n\nParis."
    for batches in batchings(tokenize(text)):
        _, deltas, total = run(batches, reasoning=True, reasoning_started_in_prompt=True)
        assert (total.reasoning, total.content) == ("The user wants a city.", "Paris.")
        assert all("think>" not in d.reasoning + d.content for d in deltas)


def test_reasoning_started_in_output() -> None:
    text = "<think>\nhmm\n</think>\n\nParis."
    for batches in batchings(tokenize(text)):
        _, _, total = run(batches, reasoning=True, reasoning_started_in_prompt=False)
        assert (total.reasoning, total.content) == ("hmm", "Paris.")


def test_reasoning_not_started_is_content() -> None:
    for batches in batchings(tokenize("Paris.")):
        _, _, total = run(batches, reasoning=True, reasoning_started_in_prompt=False)
        assert (total.reasoning, total.content) == ("", "Paris.")


def test_reasoning_off_leaves_tags_in_content() -> None:
    text = "<think>x</think>y"
    _, _, total = run([tokenize(text)])
    assert total.content == text and total.reasoning == ""


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
        },
    }
]
HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
ARGS = {"city": "Paris", "days": 2}


def test_reasoning_then_tool_call_both_formats() -> None:
    for call in (HERMES, XML):
        text = "Need the weather.\n</think>\n\n" + call
        for batches in batchings(tokenize(text)):
            _, deltas, total = run(
                batches, reasoning=True, reasoning_started_in_prompt=True,
                tools_enabled=True, tools=TOOLS,
            )
            assert total.reasoning == "Need the weather." and total.content == ""
            assert [(c.name, json.loads(c.arguments)) for c in total.tool_calls] == [
                ("get_weather", ARGS)
            ]
            assert total.tool_calls[0].id.startswith("call_")
            assert total.finish_reason == "tool_calls"
            for tag in ("<tool_call>", "</tool_call>", "<function=", "think>"):
                assert all(tag not in d.content + d.reasoning for d in deltas)


def test_tool_call_cut_by_length_is_content() -> None:
    text = "Sure. " + HERMES[:30]
    for batches in batchings(tokenize(text)):
        _, _, total = run(batches, "length", tools_enabled=True, tools=TOOLS)
        assert total.content == text and total.tool_calls == [] and total.finish_reason == "length"


def test_tool_call_then_length_keeps_the_call_and_says_length() -> None:
    _, _, total = run([tokenize(HERMES + "\nand")], "length", tools_enabled=True, tools=TOOLS)
    assert len(total.tool_calls) == 1 and total.finish_reason == "length"


def test_stop_string_after_a_tool_call_says_tool_calls() -> None:
    for batches in batchings(tokenize(XML + "STOP junk")):
        _, _, total = run(batches, "length", stop=("STOP",), tools_enabled=True, tools=TOOLS)
        assert len(total.tool_calls) == 1 and total.content == ""
        assert total.finish_reason == "tool_calls"


def test_stop_string_inside_an_open_tool_call_keeps_its_text() -> None:
    text = '<tool_call>{"name": "get_weather"STOP}</tool_call>'
    _, _, total = run([tokenize(text)], stop=("STOP",), tools_enabled=True, tools=TOOLS)
    assert total.content == '<tool_call>{"name": "get_weather"' and total.finish_reason == "stop"


def test_tools_disabled_leaves_calls_in_content() -> None:
    _, _, total = run([tokenize(HERMES)])
    assert total.content == HERMES and total.tool_calls == [] and total.finish_reason == "stop"


def test_malformed_tool_call_is_content() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"days": }</tool_call> sorry'
    for batches in batchings(tokenize(text)):
        _, _, total = run(batches, tools_enabled=True, tools=TOOLS)
        assert total.content == text and total.tool_calls == [] and total.finish_reason == "stop"


def test_engine_finish_reasons_pass_through() -> None:
    for reason in ("length", "abort"):
        processor = make()
        delta = processor.process(tokenize("hi"), reason)
        assert delta.finish_reason == reason == processor.finish_reason
        assert processor.process([1], reason).is_empty


def test_accumulator_merges_argument_fragments() -> None:
    total = OutputAccumulator()
    total.add(OutputDelta(tool_calls=[ToolCallDelta(0, "", id="call_a", name="f")]))
    second = [ToolCallDelta(0, '{"x": '), ToolCallDelta(1, "{}", id="call_b", name="g")]
    total.add(OutputDelta(tool_calls=second))
    total.add(OutputDelta(tool_calls=[ToolCallDelta(0, "1}")], finish_reason="tool_calls"))
    assert [(c.id, c.name, json.loads(c.arguments)) for c in total.tool_calls] == [
        ("call_a", "f", {"x": 1}),
        ("call_b", "g", {}),
    ]
    assert total.finish_reason == "tool_calls"


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the stop string that completes first (ties: the longer), or all of it."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    if not ends:
        return text, False
    return text[: min(ends)[1]], True


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc \n", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=5),
)
def test_stop_filter_matches_reference_for_any_split(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    stop_filter = StopStringFilter(stops)
    released, hit = "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = stop_filter.feed(text[a:b])
        released += piece
        expected_prefix, _ = reference_stop(text[:b], stops)
        assert expected_prefix.startswith(released) or hit  # never ahead of the truth
        if hit:
            break
    if not hit:
        released += stop_filter.flush()
    assert (released, hit) == reference_stop(text, stops)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab STOP\n", max_size=24),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=4),
)
def test_processor_counts_tokens_up_to_the_stop(text: str, cuts: list[int]) -> None:
    ids = tokenize(text)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    processor, deltas, total = run([ids[a:b] for a, b in zip(bounds, bounds[1:])] or [[]],
                                   "length", stop=("STOP", "\n\n"))
    expected, is_stop = reference_stop(text, ["STOP", "\n\n"])
    assert total.content == expected
    assert total.finish_reason == ("stop" if is_stop else "length")
    # The count ends at the first id whose text completes the stop string.
    decoded, needed = "", len(ids)
    for count, token in enumerate(ids, 1):
        decoded += VOCAB[token].decode()
        if reference_stop(decoded, ["STOP", "\n\n"])[1]:
            needed = count
            break
    assert processor.completion_tokens == needed
    check_ends_once(deltas)


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    """parallel_tool_calls: false (max_tool_calls=1): the second call of the output is dropped,
    whatever the batching; finish_reason stays tool_calls."""
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"y": 2}}</tool_call>')
    for batches in batchings(tokenize(text)):
        _, _, both = run(batches, tools_enabled=True, tools=None)
        assert [call.name for call in both.tool_calls] == ["a", "b"]
        _, _, first = run(batches, tools_enabled=True, tools=None, max_tool_calls=1)
        assert [(call.name, json.loads(call.arguments)) for call in first.tool_calls] == [("a", {"x": 1})]
        assert first.finish_reason == "tool_calls"


# -- the streamed chunks' fast path (server/streaming.py TextChunks) ------------------------------

TRICKY_TEXTS = ["plain", 'a"b\\c', "\n\t\r\b\f", "".join(chr(i) for i in range(32)), "\x7f é中文😀",
                "\u2028\u2029 </script> a/b", "\ufffd", "", TextChunks.MARK, "x" * 5000]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_text_chunks_equal_the_models_rendered_each_time(kind):
    """The template's bytes for any text equal pydantic's for the same chunk (escapes included),
    also for a model name holding the template's own marker."""
    from blockspec.server.replies import (ChatCompletionChunk, ChatCompletionChunkChoice, Completion,
                                          CompletionChoice, DeltaMessage)
    from blockspec.server.streaming import sse

    def render(text: str) -> bytes:
        if kind == "chat":
            choice = ChatCompletionChunkChoice(index=3, delta=DeltaMessage(content=text))
            return sse(ChatCompletionChunk(id="chatcmpl-1", model="m" + TextChunks.MARK, created=7, choices=[choice]))
        return sse(Completion(id="cmpl-1", model="m" + TextChunks.MARK, created=7,
                              choices=[CompletionChoice(index=3, text=text)]))
    fast = TextChunks(render)
    for text in TRICKY_TEXTS:
        assert fast(text) == render(text), repr(text)


def test_a_failed_stream_ends_only_its_unfinished_choices_the_failed_one_first():
    """n = 3, choice 2 already sent its finish reason: the server stopping (abort) ends choice 1
    (the one that failed) then 0, never 2 a second time; an error ends none (it has no reason)."""
    from types import SimpleNamespace

    from blockspec.server.errors import GenerationFailed
    from blockspec.server.streaming import ended_by

    choices = [SimpleNamespace(index=i) for i in range(3)]
    stopped = GenerationFailed(503, "the server shut down", finish_reason="abort")
    stopped.index = 1
    assert ended_by(stopped, choices, finished={2}) == [1, 0]
    assert ended_by(stopped, choices, finished=set()) == [1, 0, 2]
    failed = GenerationFailed(500, "generation failed")
    failed.index = 1
    assert ended_by(failed, choices, finished=set()) == []
