"""The GBNF a request's structured-output fields ask for (memspec/server/structured.py)."""

from __future__ import annotations

import pytest

from memspec.errors import InvalidRequest
from memspec.server.structured import (
    json_schema_grammar,
    response_format_grammar,
    structured_output,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_shapes():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert "root ::=" in response_format_grammar({"type": "json_object"})
    openai = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    bare = {"type": "json_schema", "json_schema": SCHEMA}  # llama-server also takes this
    assert response_format_grammar(openai) == response_format_grammar(bare)
    assert response_format_grammar(openai) == json_schema_grammar(SCHEMA)


@pytest.mark.parametrize(
    ("args", "param"),
    [
        (({"type": "xml"}, None, None), "response_format"),
        (({"type": "json_schema", "json_schema": "no"}, None, None), "response_format"),
        ((None, None, ["not", "a", "schema"]), "json_schema"),
        (({"type": "json_object"}, 'root ::= "a"', None), "grammar"),  # two at once
    ],
)
def test_refusals_name_their_field(args, param):
    with pytest.raises(InvalidRequest) as e:
        structured_output(*args)
    assert e.value.param == param


def test_one_field_gives_its_grammar_and_name():
    assert structured_output(None, None, None) == (None, "grammar")
    assert structured_output(None, 'root ::= "a"', None) == ('root ::= "a"', "grammar")
    gbnf, param = structured_output(None, None, SCHEMA)
    assert param == "json_schema" and gbnf == json_schema_grammar(SCHEMA)
