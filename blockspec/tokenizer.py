"""Text <-> token ids for the server: HF `tokenizers` for encoding, the model's own chat template in a
sandboxed Jinja environment, the set of stop ids, and streaming detokenization.

Chat templates come from the model directory (untrusted), so they run in Jinja's immutable sandbox
with the same globals and filters transformers gives them (`raise_exception`, `strftime_now`,
an HTML-unescaped `tojson`): a template renders here exactly as `apply_chat_template` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

# Tokens that end a chat turn in the common template families (ChatML, Llama 3). A model stops on
# whichever of them its vocabulary has, even when generation_config names only one.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")

# Older names clients use for an assistant turn's reasoning; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """The chat template refused the conversation (its `raise_exception`) or failed to render.

    A ValueError, so the server answers it with a 400 naming the template's own message.
    """


class Tokenizer:
    """A model's tokenizer: ids, chat template and stop ids. Build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | dict[str, str] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        generation_eos_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_templates = _as_named_templates(chat_template)
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.generation_eos_ids = tuple(generation_eos_ids)
        self.stop_token_ids = self._collect_stop_ids()
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: blockspec needs the fast-tokenizer file tokenizer.json "
                "in the model directory (save it with transformers' tokenizer.save_pretrained)")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(path / "tokenizer_config.json")
        _add_missing_tokens(backend, config.get("added_tokens_decoder", {}))
        generation_config = _read_json(path / "generation_config.json")
        return cls(
            backend,
            chat_template=_read_chat_template(path, config),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            generation_eos_ids=_as_id_list(generation_config.get("eos_token_id")),
        )

    # ---- ids ----

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's eos token, else generation_config's first eos id."""
        token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        if token_id is None and self.generation_eos_ids:
            return self.generation_eos_ids[0]
        return token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids.

        add_special_tokens adds what the tokenizer's post-processor adds (e.g. Llama's BOS); chat
        prompts never want it, since the template already writes bos_token.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the model's chat template (no tokenizing).

        template_kwargs reach the template as variables (enable_thinking, ...) and override the
        special-token variables (bos_token, eos_token, ...) of the same name.
        """
        template = self._template(has_tools=bool(tools))
        variables = {**self._special_token_variables(), **template_kwargs}
        try:
            return template.render(
                messages=[_normalize_message(message) for message in messages],
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except Exception as error:  # the sandbox's refusals, a missing loader, a range too big…
            raise ChatTemplateError(f"chat template failed to render: {type(error).__name__}: {error}") from error

    def encode_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids of a conversation: the rendered template, tokenized with specials recognised."""
        text = self.apply_chat_template(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def _template(self, has_tools: bool) -> jinja2.Template:
        name = _pick_template_name(self.chat_templates, has_tools)
        if name not in self._compiled:
            self._compiled[name] = _make_jinja_env().from_string(self.chat_templates[name])
        return self._compiled[name]

    def _special_token_variables(self) -> dict[str, str]:
        # Only the tokens that exist: a None would render as the text "None".
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                  "pad_token": self.pad_token, "unk_token": self.unk_token}
        return {name: token for name, token in tokens.items() if token is not None}

    def _collect_stop_ids(self) -> frozenset[int]:
        stop_ids = set(self.generation_eos_ids)
        for token in (self.eos_token, *TURN_END_TOKENS):
            token_id = self.token_to_id(token) if token else None
            if token_id is not None:
                stop_ids.add(token_id)
        return frozenset(stop_ids)


class IncrementalDetokenizer:
    """Streams the text of generated ids, never splitting a character.

    vLLM's offsets: `tokens[:read]` of the window are already emitted. Each step decodes the window
    with and without the new tokens and emits the difference, so a token whose text depends on its
    left neighbour (byte-level pieces of one UTF-8 character, SentencePiece's leading space) comes
    out right, while each step decodes only the last few tokens. Text ending in U+FFFD is an
    incomplete character and is held back until the next token completes it (or `flush`).
    Invariant: the concatenation of every `add` and `flush` equals `tokenizer.decode(all_ids)`
    (without prompt_ids; with them, the text as it continues the prompt).
    """

    _NUM_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context for the first output tokens

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = list(prompt_ids or [])[-self._NUM_PROMPT_CONTEXT:]
        self._num_read = len(self._window)

    def add(self, token_ids: Sequence[int]) -> str:
        """Text completed by `token_ids` (possibly empty)."""
        self._window.extend(token_ids)
        return self._emit(is_final=False)

    def flush(self) -> str:
        """Everything still held back, incomplete characters included (as U+FFFD)."""
        return self._emit(is_final=True)

    def _emit(self, is_final: bool) -> str:
        if self._num_read == len(self._window):
            return ""
        read_text = self._decode(self._window[:self._num_read])
        full_text = self._decode(self._window)
        if full_text.endswith("\ufffd") and not is_final:
            return ""
        # The emitted tokens become the next step's left context; older ones are dropped.
        self._window = self._window[self._num_read:]
        self._num_read = len(self._window)
        return full_text[_common_prefix_length(read_text, full_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


# ---- helpers ----

def _make_jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (same whitespace rules, same helpers)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') and sorts keys; templates were written against HF's.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _normalize_message(message: Message) -> dict[str, Any]:
    """A template-ready copy of an OpenAI-style message.

    Keys set to None are dropped (templates test for presence; a None renders as "None"),
    all-text content parts become one string (templates like Qwen3's render only string content),
    reasoning gets the name templates read, and tool-call arguments sent as a JSON string (the
    OpenAI wire format) become a dict (templates do `arguments | tojson` or iterate them).
    """
    normalized = {key: value for key, value in dict(message).items() if value is not None}
    if "content" in normalized:
        normalized["content"] = _join_text_parts(normalized["content"])
    reasoning = next((normalized[key] for key in _REASONING_FIELDS if key in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    if "tool_calls" in normalized:
        normalized["tool_calls"] = [_parse_tool_call(call) for call in normalized["tool_calls"]]
    return normalized


def _join_text_parts(content: Any) -> Any:
    # Newline-joined as vLLM does; content with non-text parts (images) is left for the template.
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    return content


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)


def _parse_tool_call(tool_call: Mapping[str, Any]) -> dict[str, Any]:
    tool_call = dict(tool_call)
    if isinstance(tool_call.get("function"), Mapping):
        tool_call["function"] = _parse_arguments(tool_call["function"])
    elif "arguments" in tool_call:
        tool_call = _parse_arguments(tool_call)
    return tool_call


def _parse_arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(
                f"tool call {function.get('name')!r} has arguments that are not valid JSON ({error}): "
                f"{arguments!r}") from error
    return function


def _as_named_templates(chat_template: str | dict[str, str] | None) -> dict[str, str]:
    if chat_template is None:
        return {}
    if isinstance(chat_template, str):
        return {"default": chat_template}
    return dict(chat_template)


def _pick_template_name(templates: Mapping[str, str], has_tools: bool) -> str:
    # Some models ship several named templates; transformers picks "tool_use" when tools are given.
    if has_tools and "tool_use" in templates:
        return "tool_use"
    if "default" in templates:
        return "default"
    if len(templates) == 1:
        return next(iter(templates))
    if not templates:
        raise ValueError(
            "the model has no chat template (no chat_template.jinja, none in tokenizer_config.json): "
            "use /v1/completions with a raw prompt, or add a chat_template.jinja to the model directory")
    raise ValueError(f"the model's chat templates {sorted(templates)} include no 'default' one to use")


def _read_chat_template(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja wins over chat_template.json, which wins over tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _token_text(token: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json writes a token either as its text or as a serialized AddedToken.
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _as_id_list(eos_token_id: int | list[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def _add_missing_tokens(backend: BackendTokenizer, added_tokens_decoder: Mapping[str, Mapping[str, Any]]) -> None:
    """Add tokens that tokenizer_config.json declares but tokenizer.json lacks, as transformers does.

    They take the next free ids, as in transformers; a well-formed model directory lists them in order.
    """
    for _, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        content = entry["content"]
        if backend.token_to_id(content) is not None:
            continue
        token = AddedToken(content, single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
                           rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", False),
                           special=entry.get("special", True))
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _common_prefix_length(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    # Only when the left context itself ends mid-character (a prompt cut inside a UTF-8 sequence).
    length = 0
    for char_a, char_b in zip(a, b):
        if char_a != char_b:
            break
        length += 1
    return length
