"""Options are declared once (EngineOptions, ServerSettings) and every surface is made from them."""
import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from blockspec.cli import build_parser
from blockspec.config import ConfigError, EngineConfig, EngineOptions
from blockspec.options import GENERATE, SERVE, HelpFormatter, add_flags, from_namespace, option, options_of
from blockspec.server.settings import ServerSettings


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command, cls", [("serve", ServerSettings), ("generate", EngineOptions),
                                          ("bench", EngineOptions)])
def test_every_option_is_a_flag_of_its_commands_with_its_default(command, cls):
    parser = subparser(command)
    by_dest = {a.dest: a for a in parser._actions}
    declared = [(f, opt) for f, opt, _ in options_of(cls) if command in opt.commands]
    assert declared
    for f, opt in declared:
        action = by_dest[f.name]
        flag = "--" + f.name.replace("_", "-")
        assert action.option_strings[0] == flag and action.default == f.default
        if isinstance(f.default, bool):               # a switch: --x / --no-x
            assert action.option_strings == [flag, "--no-" + flag[2:]]
    text = parser.format_help()
    if command == "serve":
        assert "(default: 64)" in text and "(default: 127.0.0.1)" in text and "(none: 256 on" in text and "(default: 8000)" in text


def test_a_new_field_is_a_flag_a_keyword_and_validated_in_one_place():
    @dataclass(frozen=True)
    class Extended(EngineOptions):
        fraction: float = option(0.9, "share of something", (SERVE,))
        switch: bool = option(True, "turn something on", (SERVE, GENERATE))

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_flags(parser, Extended, SERVE)
    args = parser.parse_args(["--fraction", "0.5", "--no-switch", "--max-num-seqs", "3"])
    made = from_namespace(Extended, args, SERVE)
    assert (made.fraction, made.switch, made.max_num_seqs) == (0.5, False, 3)
    assert "(default: 0.9)" in parser.format_help()


def test_server_settings_and_engine_config_carry_every_engine_option():
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    assert names <= {f.name for f in dataclasses.fields(ServerSettings)}
    assert names <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_bad_values_and_unknown_keywords_fail_before_loading():
    from blockspec.llm import LLM
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        EngineOptions(max_num_seqs=0)
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        ServerSettings(model="m", max_num_seqs=0)
    with pytest.raises(TypeError):
        LLM("/nonexistent", not_an_option=1)
