"""memspec.modelfile: Ollama's Modelfile grammar (parser/parser.go) and the /api/create fields
it means. No models: the quick tier runs these."""

from __future__ import annotations

import pytest

from memspec.modelfile import Command, ModelfileError, create_fields, looks_like_path, parse

FULL = '''# a comment line
FROM ./smollm2.gguf
PARAMETER temperature 0.7
PARAMETER stop "<|im_end|>"
PARAMETER stop user:
parameter num_ctx 512
SYSTEM """You are
a "pirate"."""
LICENSE MIT
license """Apache
2.0"""
MESSAGE user hi there
MESSAGE assistant "ahoy"
'''


def test_commands_as_ollama_reads_them() -> None:
    mf = parse(FULL)
    assert mf.commands == [
        Command("model", "./smollm2.gguf"),
        Command("temperature", "0.7"),
        Command("stop", "<|im_end|>"),
        Command("stop", "user:"),
        Command("num_ctx", "512"),
        Command("system", 'You are\na "pirate".'),
        Command("license", "MIT"),
        Command("license", "Apache\n2.0"),
        Command("message", "user: hi there"),
        Command("message", "assistant: ahoy"),
    ]


def test_create_fields_types_parameters_and_gathers_lists() -> None:
    fields = create_fields(parse(FULL))
    assert fields == {
        "from": "./smollm2.gguf",
        "parameters": {"temperature": 0.7, "stop": ["<|im_end|>", "user:"], "num_ctx": 512},
        "system": 'You are\na "pirate".',
        "license": ["MIT", "Apache\n2.0"],
        "messages": [
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "ahoy"},
        ],
    }
    assert isinstance(fields["parameters"]["num_ctx"], int)


def test_last_system_wins_and_unquoted_values_keep_their_spaces() -> None:
    fields = create_fields(parse("FROM llama3.2:1b\nSYSTEM first\nSYSTEM  second one  \n"))
    assert fields == {"from": "llama3.2:1b", "system": "second one"}


def test_template_adapter_and_newer_commands_are_passed_on_for_the_server_to_judge() -> None:
    text = 'FROM m\nTEMPLATE "{{ .Prompt }}"\nADAPTER ./lora.gguf\nDRAFT ./d.gguf\nREQUIRES 0.9'
    fields = create_fields(parse(text))
    assert fields["template"] == "{{ .Prompt }}"
    assert fields["adapters"] == {"./lora.gguf": ""}
    assert fields["draft"] == "./d.gguf"
    assert fields["requires"] == "0.9"


def test_deprecated_parameters_are_dropped_with_a_warning() -> None:
    mf = parse("FROM m\nPARAMETER mirostat 1\nPARAMETER seed 42")
    assert create_fields(mf) == {"from": "m", "parameters": {"seed": 42}}
    assert mf.warnings == ["parameter mirostat is deprecated"]


def test_bool_and_crlf_lines() -> None:
    fields = create_fields(parse("FROM m\r\nPARAMETER use_mmap false\r\nSYSTEM hi\r\n"))
    assert fields == {"from": "m", "parameters": {"use_mmap": False}, "system": "hi"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("SYSTEM hi", "no FROM line"),
        ("FOO bar\nFROM m", '(line 1): command must be one of "from"'),
        ("FROM m\nMESSAGE bot hi", '(line 2): message role must be one of "system"'),
        ('FROM m\nSYSTEM """never closed', "unexpected end of file in a quoted value"),
        ("FROM m\nPARAMETER", "unexpected end of file"),
        ("FROM m\nPARAMETER x-y 1", "unexpected end of a command"),
        ("FR0M m", '(line 1): command must be one of "from"'),
    ],
)
def test_parse_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ModelfileError) as e:
        parse(text)
    assert message in e.value.message
    assert e.value.param == "modelfile"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM m\nPARAMETER typo 1", "unknown parameter 'typo'"),
        ("FROM m\nPARAMETER temperature hot", "invalid float value [hot] for temperature"),
        ("FROM m\nPARAMETER top_k 1.5", "invalid int value [1.5] for top_k"),
        ("FROM m\nPARAMETER use_mmap maybe", "invalid bool value [maybe] for use_mmap"),
        ("FROM m\nPARAMETER temperature nan", "invalid float value [nan] for temperature"),
    ],
)
def test_parameter_values_are_typed_as_ollama_types_them(text: str, message: str) -> None:
    with pytest.raises(ModelfileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        create_fields(parse(text))


def test_a_huge_modelfile_is_refused_before_parsing() -> None:
    with pytest.raises(ModelfileError, match="over"):
        parse("FROM m\n" + "#" * (2 << 20))


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ("./m.gguf", True),
        ("/models/m.gguf", True),
        ("~/m.gguf", True),
        ("../m", True),
        ("smollm2-135m-f32.gguf", True),
        ("llama3.2:1b", False),
        ("hf.co/user/repo:Q4_K_M", False),
    ],
)
def test_looks_like_path(value: str, path: bool) -> None:
    assert looks_like_path(value) is path
