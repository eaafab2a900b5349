"""Structured output: what a request's response_format / tool_choice asks for → a compiled
grammar (xgrammar) that the engine's logits processor (engine/logits.py) enforces token by token.

Why xgrammar (measured on the Qwen3 vocabulary, 151 936 entries, one CPU thread, a 27-token
JSON object): mask per token 0.02 ms mean / 0.16 ms max, against llguidance's 0.18 / 4.0 ms; its
matcher rolls back (DFlash advances it along drafts, then undoes that). llguidance compiles a
schema faster (1.5 ms vs 20 ms, once per request) and has no dependencies; the mask is paid at
every verified position of every cycle, compilation once, so the mask decides. ARCHITECTURE.md
§7 has the numbers.

JSON is generated compact (no free whitespace: `{"a": 1, "b": [2]}` with ", " and ": "), so a
model cannot spin on spaces forever; strict schemas forbid properties the schema does not name.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"   # Qwen's hermes format (server/parsers.py)


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: kind is json_object | json_schema | tool_call."""
    kind: str
    schema: dict[str, Any] | None = None
    strict: bool = True


@functools.lru_cache(maxsize=4)
def grammar_compiler(tokenizer: Any, vocab_size: int) -> Any:
    """One xgrammar GrammarCompiler per (tokenizer, model vocabulary); it caches compiled grammars."""
    import xgrammar
    return xgrammar.GrammarCompiler(tokenizer_info(tokenizer, vocab_size), max_threads=1)


def tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    """xgrammar's view of our tokenizer (tokenizer.backend is a `tokenizers.Tokenizer`).

    Special added tokens (<|im_start|>, <|im_end|> …) get no text, so the grammar never lets
    them into the output (xgrammar allows the stop ids only where the grammar may end); added
    tokens that are not special (<tool_call>, <think>) keep theirs, so the one-token form a
    trained model writes is allowed."""
    import xgrammar
    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    for index, added in backend.get_added_tokens_decoder().items():
        if added.special and index < vocab_size:
            encoded[index] = ""
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stops = [t for t in tokenizer.stop_token_ids if t < vocab_size]
    return xgrammar.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=stops or None, add_prefix_space=meta["add_prefix_space"])


def compile_grammar(compiler: Any, spec: GrammarSpec) -> Any:
    """spec → xgrammar CompiledGrammar; GrammarError names what is wrong with the schema."""
    import xgrammar
    try:
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            return compiler.compile_grammar(schema_grammar(spec.schema, spec.strict))
        if spec.kind == "tool_call":
            body = schema_grammar(spec.schema, strict=True)
            grammar = xgrammar.Grammar.concat(literal(TOOL_CALL_OPEN), body, literal(TOOL_CALL_CLOSE))
            return compiler.compile_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - whatever the client's schema trips on is the client's error
        raise GrammarError(error_text(exc)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


# xgrammar (0.2.9, and its main branch) writes a string with minLength / maxLength as a run of
# [^"\\\r\n]: a raw tab or any other control character U+0000–U+001F fits it, and JSON forbids
# them unescaped, so a strict parser (pydantic, what OpenAI's SDK parses with) rejects the output
# (seen as a sampled tab in a 6-character name). Its unconstrained strings exclude them already.
LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


def schema_grammar(schema: dict[str, Any], strict: bool) -> Any:
    """The xgrammar Grammar of a JSON schema, its length-bounded strings without raw control
    characters (the grammar's EBNF with that one character class narrowed, parsed again)."""
    return grammar_of_schema_text(json.dumps(schema), strict)


@functools.lru_cache(maxsize=256)
def grammar_of_schema_text(schema: str, strict: bool) -> Any:
    """schema_grammar by the schema's JSON text: a client sends the same schema with every
    request, and the compiler's cache is keyed by the grammar, which this builds (~1 ms again)."""
    import xgrammar
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if LOOSE_STRING_CHARACTER not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(LOOSE_STRING_CHARACTER, JSON_STRING_CHARACTER))


def literal(text: str) -> Any:
    import xgrammar
    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def tool_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON of one Qwen tool call {"name": …, "arguments": {…}}: for the named function, or
    (tool_choice "required") for any of the tools."""
    def one(function: dict[str, Any]) -> dict[str, Any]:
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}


def error_text(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/…cc:42: ")."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
