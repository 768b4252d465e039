"""Model names as Ollama reads them (its types/model/name.go), checked before any lookup.

    name = parse("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    name.host, name.namespace, name.model, name.tag   # hf.co, bartowski, SmolLM2-..., Q4_K_M
    parse("smollm2").display                          # "smollm2:latest"
    parse("../../etc/passwd")                         # InvalidModelName (a 400)

A name is `[host/][namespace/]model[:tag]`; left out, host is registry.ollama.ai, namespace
library and tag latest. Each part starts with a letter, digit or `_`, then letters, digits,
`_`, `-`, plus `.` (host, model, tag) and `:` (host only: `localhost:5000`); host is 1..350
characters, the others 1..80; ASCII only. A `/` or `:` that promises a part with nothing
after it (or before it) makes the name invalid, as does a fourth `/`. `scheme://` may lead a
name that has a host. Ollama answers 400 "invalid model name" for anything else, before it
looks for the model; so does this daemon, so that a path (`../../etc/passwd`, `/etc/passwd`),
a shell fragment or a 5,000-character name never reaches a file lookup.

File names the daemon serves a model under (`smollm2-135m-f32.gguf`, `qwen2.5-coder:1.5b`,
`SmolLM2-135M-Instruct.Q4_1`) are valid model parts: dots and case are allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memspec.errors import InvalidRequest

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# Ollama's part rules (isValidPart): the first character, then the rest, per kind.
_PARTS = {
    "host": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*"), 350),
    "namespace": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*"), 80),
    "model": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80),
    "tag": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80),
}
# The longest valid name: scheme, host, namespace, model, tag and their separators. Anything
# longer is refused before it is split (a 1 MiB "name" is not worth scanning).
MAX_NAME = 16 + 3 + 350 + 1 + 80 + 1 + 80 + 1 + 80


class InvalidModelName(InvalidRequest):
    """A name Ollama would refuse: a 400 "invalid model name ..." on every Ollama route."""

    def __init__(self, name: str, why: str = "not a model name", param: str = "model"):
        # (its code, invalid_model_name, is the server's table's: the core knows no HTTP)
        super().__init__(f"invalid model name {_short(name)}: {why}", param=param)


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = "https"
    explicit_tag: bool = False  # the name carried its own tag (else `latest` was implied)

    @property
    def display(self) -> str:
        """The shortest form Ollama shows (DisplayShortest): host and namespace only when not
        the defaults, the tag always (`smollm2:latest`)."""
        return f"{self._prefix()}{self.model}:{self.tag}"

    @property
    def local(self) -> str:
        """The name as written, less a default host and namespace: what the catalog of this
        daemon knows a model by (`registry.ollama.ai/library/smollm2:135m` -> `smollm2:135m`,
        `smollm2-135m-f32.gguf` stays as it is)."""
        return f"{self._prefix()}{self.model}" + (f":{self.tag}" if self.explicit_tag else "")

    @property
    def full(self) -> str:
        """host/namespace/model:tag, every part present (Ollama's store path, in one line)."""
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    def _prefix(self) -> str:
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/"
        return ""


def _short(name: str) -> str:
    """The name for an error message: quoted, cut when long (never echo 5,000 characters)."""
    text = name if len(name) <= 60 else f"{name[:40]}...({len(name)} characters)"
    return repr(text)


def _check(kind: str, part: str, name: str, param: str) -> None:
    pattern, longest = _PARTS[kind]
    if not part:
        raise InvalidModelName(name, f"the {kind} is empty", param)
    if len(part) > longest:
        raise InvalidModelName(name, f"the {kind} is longer than {longest} characters", param)
    if not part.isascii() or pattern.fullmatch(part) is None:
        extra = {"host": ", '.', ':'", "namespace": "", "model": ", '.'", "tag": ", '.'"}[kind]
        raise InvalidModelName(
            name,
            f"the {kind} {_short(part)} must start with a letter, digit or '_' and hold only "
            f"letters, digits, '_', '-'{extra}",
            param,
        )


def parse(name: str, *, param: str = "model") -> OllamaName:
    """`name` as Ollama parses it (ParseName), defaults filled in; InvalidModelName (a 400
    naming `param`) when Ollama would call it invalid."""
    if len(name) > MAX_NAME:
        raise InvalidModelName(name, f"the name is longer than {MAX_NAME} characters", param)
    rest, tag, explicit = name, DEFAULT_TAG, False
    # A tag follows the last ':' only when no '/' comes after it ('/' is not a tag character,
    # so `localhost:5000/ns/model` has a port, not a tag).
    if rest.rfind(":") > rest.rfind("/"):
        rest, _, tag = rest.rpartition(":")
        explicit = True
        _check("tag", tag, name, param)
    # Then model, namespace and host, each cut at the last '/' (a '/' promises a part: an
    # empty one is invalid); whatever is left of the host may hold `scheme://`.
    scheme, namespace, host = "https", DEFAULT_NAMESPACE, DEFAULT_HOST
    head, slash, model = rest.rpartition("/")
    if slash:
        host, slash, namespace = head.rpartition("/")
        if not slash:
            host = DEFAULT_HOST
        elif "://" in host:
            scheme, _, host = host.partition("://")
            scheme = scheme.lower() or "https"  # Ollama's default for an empty one
    _check("model", model, name, param)
    _check("namespace", namespace, name, param)
    _check("host", host, name, param)
    if scheme not in ("http", "https"):
        raise InvalidModelName(name, f"the scheme {_short(scheme)} is not http or https", param)
    return OllamaName(host, namespace, model, tag, scheme, explicit)


def check(name: str | None, *, param: str = "model") -> OllamaName | None:
    """parse() for a request's optional name: None or "" (the default model) passes as None."""
    return parse(name, param=param) if name else None
