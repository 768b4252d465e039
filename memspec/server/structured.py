"""Structured output: the GBNF an OpenAI or llama-server request asks for.

`response_format` (json_object, json_schema), llama-server's `json_schema` and llama.cpp's
`grammar` become one GBNF, which the engine masks the target with (memspec/engine/grammar.py).
JSON schemas are turned into GBNF by llama.cpp's own converter, as llama-cpp-python ships it.
"""

from __future__ import annotations

import json
from typing import Any

from memspec.errors import InvalidRequest


def json_schema_grammar(
    schema: dict[str, Any] | bool, param: str = "response_format", name: str = ""
) -> str:
    """GBNF for values `schema` accepts, by llama.cpp's converter (json_schema_to_grammar, as
    llama-cpp-python ships it); its root rule is `name` ("root" when empty)."""
    from llama_cpp.llama_grammar import SchemaConverter

    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequest("a JSON schema must be an object", param=param)
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        converter.visit(resolved, name)
    except Exception as e:  # noqa: BLE001 - the converter raises bare errors on bad schemas
        raise InvalidRequest(
            f"the JSON schema cannot be turned into a grammar: {e}", param=param
        ) from None
    return converter.format_grammar()


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The GBNF an OpenAI `response_format` asks for (None: free text)."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format json_schema needs a json_schema object", param="response_format"
            )
        # OpenAI's own shape {"name", "schema", "strict"}; llama-server also takes the schema
        # itself, or {"schema": ...} without a name.
        schema = spec.get("schema", spec if "name" not in spec else {})
        return json_schema_grammar(schema)
    raise InvalidRequest(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def structured_output(
    response_format: dict[str, Any] | None,
    grammar: str | None,
    json_schema: dict[str, Any] | bool | None,
) -> tuple[str | None, str]:
    """(GBNF, the field it came from) for a request's response_format, llama.cpp's `grammar`
    or llama-server's `json_schema`; at most one of them may constrain the output."""
    asked = [
        (name, value)
        for name, value in (
            ("response_format", response_format_grammar(response_format)),
            ("grammar", grammar or None),
            (
                "json_schema",
                json_schema_grammar(json_schema, "json_schema")
                if json_schema is not None
                else None,
            ),
        )
        if value is not None
    ]
    if len(asked) > 1:
        raise InvalidRequest(
            f"{' and '.join(n for n, _ in asked)} both constrain the output; send one",
            param=asked[1][0],
        )
    return (asked[0][1], asked[0][0]) if asked else (None, "grammar")
