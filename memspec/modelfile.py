"""Ollama's Modelfile, read as Ollama's parser/parser.go reads it, and turned into the fields
of an /api/create request (Ollama >= 0.5's JSON form).

    mf = parse(Path("Modelfile").read_text())
    mf.commands                       # [Command("model", "smollm2:135m"), Command("system", ...)]
    fields = create_fields(mf)        # {"from": ..., "parameters": {...}, "system": ..., ...}

The grammar is Ollama's: one command per line (`FROM`, `PARAMETER name value`, `SYSTEM`,
`TEMPLATE`, `LICENSE`, `MESSAGE role text`, `ADAPTER`, and newer Ollama's `DRAFT`, `RENDERER`,
`PARSER`, `REQUIRES`), case-insensitive names, `#` comments, values in double quotes, or in
triple double quotes across lines. PARAMETER values are typed as Ollama types its options (int,
float, bool, a list for `stop`, repeated lines appended); a deprecated parameter is skipped
with a warning and an unknown one is an error, as in Ollama. This module knows the Modelfile
only: which fields memspec honours (TEMPLATE and ADAPTER are refused) is the server's call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memspec.errors import InvalidRequest

# Ollama's command names (isValidCommand); FROM becomes "model", as in Ollama.
COMMANDS = frozenset(
    {"from", "license", "template", "system", "adapter", "draft", "renderer", "parser",
     "parameter", "message", "requires"}
)  # fmt: skip
MESSAGE_ROLES = ("system", "user", "assistant")

# Ollama's api.Options (Runner and the predict options) by JSON name, with the type
# FormatParams converts a PARAMETER value to.
PARAMETER_TYPES: dict[str, type] = {
    "num_ctx": int, "num_batch": int, "num_gpu": int, "main_gpu": int, "use_mmap": bool,
    "num_thread": int, "draft_num_predict": int, "num_keep": int, "seed": int,
    "num_predict": int, "top_k": int, "top_p": float, "min_p": float, "typical_p": float,
    "repeat_last_n": int, "temperature": float, "repeat_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "stop": list,
}  # fmt: skip
# Accepted with a warning and dropped (parser.go's deprecatedParameters).
DEPRECATED_PARAMETERS = frozenset(
    {"penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock",
     "mirostat", "mirostat_tau", "mirostat_eta"}
)  # fmt: skip
MAX_MODELFILE = 1 << 20  # characters: a Modelfile is a few lines; weights go in blobs


class ModelfileError(InvalidRequest):
    """A Modelfile Ollama's parser would refuse (a 400 on /api/create)."""

    def __init__(self, message: str, line: int = 0, param: str = "modelfile"):
        super().__init__(f"(line {line}): {message}" if line > 0 else message, param=param)
        self.line = line


@dataclass(frozen=True)
class Command:
    name: str  # "model" for FROM, else the command's lowercased name or a parameter's name
    args: str


@dataclass
class Modelfile:
    commands: list[Command] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what create_fields dropped, and why

    def first(self, name: str) -> str | None:
        return next((c.args for c in self.commands if c.name == name), None)


# Parser states, as parser.go's.
_NIL, _NAME, _VALUE, _PARAMETER, _MESSAGE, _COMMENT = range(6)


def _is_space(ch: str) -> bool:
    return ch in " \t"


def _is_newline(ch: str) -> bool:
    return ch in "\r\n"


def _is_alpha(ch: str) -> bool:
    return ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def _next_state(ch: str, state: int) -> tuple[int, str, str | None]:
    """parseRuneForState: (next state, the character to keep or "", an error or None)."""
    if state == _NIL:
        if ch == "#":
            return _COMMENT, "", None
        if _is_space(ch) or _is_newline(ch):
            return _NIL, "", None
        return _NAME, ch, None
    if state == _NAME:
        if _is_alpha(ch):
            return _NAME, ch, None
        if _is_space(ch):
            return _VALUE, "", None
        return _NIL, "", "invalid"
    if state == _VALUE:
        if _is_newline(ch) or _is_space(ch):
            return _NIL, ch, None
        return _VALUE, ch, None
    if state == _PARAMETER:
        if _is_alpha(ch) or ch.isdigit() and ch.isascii() or ch == "_":
            return _PARAMETER, ch, None
        if _is_space(ch):
            return _VALUE, "", None
        return _NIL, "", "eof"
    if state == _MESSAGE:
        if _is_alpha(ch):
            return _MESSAGE, ch, None
        if _is_space(ch):
            return _VALUE, "", None
        return _NIL, "", "eof"
    # _COMMENT
    if _is_newline(ch):
        return _NIL, "", None
    return _COMMENT, "", None


def _unquote(s: str) -> tuple[str, bool]:
    """parser.go's unquote: a value in triple or single double quotes loses them, any other
    stays as it is; False while a quote is still open."""
    if s.startswith('"""'):
        if len(s) >= 6 and s.endswith('"""'):
            return s[3:-3], True
        return "", False
    if s.startswith('"'):
        if len(s) >= 2 and s.endswith('"'):
            return s[1:-1], True
        return "", False
    return s, True


_INVALID_COMMAND = (
    'command must be one of "from", "license", "template", "system", "adapter", "draft", '
    '"renderer", "parser", "parameter", "message", or "requires"'
)


def parse(text: str) -> Modelfile:
    """The Modelfile in `text`, command by command (ParseFile); ModelfileError, with the line,
    where Ollama's parser fails. It must have a FROM line."""
    if len(text) > MAX_MODELFILE:
        raise ModelfileError(f"the Modelfile is over {MAX_MODELFILE} characters")
    text = text.removeprefix("\ufeff")
    commands: list[Command] = []
    name = ""
    role = ""
    buf: list[str] = []
    state = _NIL
    line = 1
    for ch in text:
        if _is_newline(ch):
            line += 1
        nxt, keep, err = _next_state(ch, state)
        if err == "eof":
            raise ModelfileError(f"unexpected end of a command: {''.join(buf)[:80]!r}", line)
        if err is not None:
            raise ModelfileError(_INVALID_COMMAND, line)
        if nxt != state:
            word = "".join(buf)
            if state == _NAME:
                if word.lower() not in COMMANDS:
                    raise ModelfileError(_INVALID_COMMAND, line)
                lowered = word.lower()
                if lowered == "from":
                    name = "model"
                elif lowered == "parameter":
                    nxt = _PARAMETER
                elif lowered == "message":
                    nxt = _MESSAGE
                    name = lowered
                else:
                    name = lowered
            elif state == _PARAMETER:
                name = word
            elif state == _MESSAGE:
                if word not in MESSAGE_ROLES:
                    raise ModelfileError(
                        'message role must be one of "system", "user", or "assistant"', line
                    )
                role = word
            elif state == _VALUE:
                value, closed = _unquote(word.strip())
                if not closed or _is_space(keep):
                    # inside quotes, or a space within an unquoted value: keep reading
                    buf.append(keep)
                    continue
                commands.append(Command(name, f"{role}: {value}" if role else value))
                role = ""
            buf = []
            state = nxt
        if keep and keep.isprintable():  # Go's strconv.IsPrint: control characters dropped
            buf.append(keep)
    if state == _VALUE:
        value, closed = _unquote("".join(buf).strip())
        if not closed:
            raise ModelfileError(f"unexpected end of file in a quoted value: {''.join(buf)[:80]!r}")
        commands.append(Command(name, f"{role}: {value}" if role else value))
    elif state not in (_NIL, _COMMENT):
        raise ModelfileError(f"unexpected end of file after {''.join(buf)[:80]!r}")
    if not any(c.name == "model" for c in commands):
        raise ModelfileError("no FROM line")
    return Modelfile(commands)


def typed_parameter(name: str, value: str) -> Any:
    """A PARAMETER's text as the type Ollama's options give it (FormatParams); a list for
    `stop`. ModelfileError for an unknown name or a value that is not of its type."""
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ModelfileError(f"unknown parameter '{name}'")
    try:
        if kind is int:
            return int(value.strip(), 10)
        if kind is float:
            number = float(value.strip())
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError(value)
            return number
        if kind is bool:
            return _go_bool(value.strip())
    except ValueError:
        raise ModelfileError(f"invalid {kind.__name__} value [{value}] for {name}") from None
    return [value]


def _go_bool(text: str) -> bool:
    """strconv.ParseBool's spellings."""
    if text in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if text in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    raise ValueError(text)


def create_fields(mf: Modelfile) -> dict[str, Any]:
    """The /api/create fields a Modelfile means (Modelfile.CreateRequest, less the local file
    hashing, which the client or the server does for a FROM path): `from` (the FROM as
    written), `adapters` ({path: ""} for each ADAPTER: the server refuses them), `template`,
    `system`, `license` (a list), `messages`, `parameters`, and `draft`, `renderer`,
    `parser`, `requires` when given. The last SYSTEM or TEMPLATE wins, as in Ollama; licenses
    and messages add up; a repeated `stop` appends."""
    out: dict[str, Any] = {}
    params: dict[str, Any] = {}
    licenses: list[str] = []
    messages: list[dict[str, str]] = []
    for c in mf.commands:
        if c.name == "model":
            out["from"] = c.args
        elif c.name == "adapter":
            out.setdefault("adapters", {})[c.args] = ""
        elif c.name in ("template", "system", "renderer", "parser", "requires", "draft"):
            out[c.name] = c.args
        elif c.name == "license":
            licenses.append(c.args)
        elif c.name == "message":
            role, _, content = c.args.partition(": ")
            messages.append({"role": role, "content": content})
        elif c.name in DEPRECATED_PARAMETERS:
            mf.warnings.append(f"parameter {c.name} is deprecated")
        else:
            value = typed_parameter(c.name, c.args)
            if isinstance(value, list) and isinstance(params.get(c.name), list):
                params[c.name] = params[c.name] + value
            else:
                params[c.name] = value
    if params:
        out["parameters"] = params
    if messages:
        out["messages"] = messages
    if licenses:
        out["license"] = licenses
    return out


def looks_like_path(value: str) -> bool:
    """Whether a FROM names a file rather than a model: what Ollama's client tries as a path
    first (absolute, ~, ./ or ../, or a GGUF file name)."""
    return (
        value.startswith(("/", "~", "./", "../", "\\"))
        or value in (".", "..")
        or value.lower().endswith((".gguf", ".bin"))
    )
