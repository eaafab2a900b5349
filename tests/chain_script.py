"""The scripted target's script (fixtures.write_chain_checkpoint): after a chat prompt its greedy
output is REASONING in <think>, then one Qwen tool call, then <|im_end|>."""
from __future__ import annotations

from pathlib import Path

import fixtures
from blockspec.tokenizer import Tokenizer

REASONING = "The user asks for the weather in Paris."
CALL = '{"name":"get_weather","arguments":{"city": "Paris"}}'
SCRIPT = f"<think>{REASONING}</think><tool_call>{CALL}</tool_call>"
NEWLINE_ID = 198   # the chat template's generation prompt ends "<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def write_scripted_pair(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """The scripted target and a random DFlash draft (block 4) for it."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    script = tokenizer.encode(SCRIPT)
    assert tokenizer.decode(script) == SCRIPT and NEWLINE_ID not in script
    chain = [NEWLINE_ID, *script, fixtures.IM_END_ID]
    target = fixtures.write_chain_checkpoint(root / "target", chain, tokenizer_dir=tokenizer_dir)
    return target, fixtures.write_dflash_draft(root / "draft", target, block_size=4)
