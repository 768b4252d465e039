"""The chat template a target renders conversations with, chosen once when it loads.

In order (`resolve_chat_template`):
  1. the `chat_template` setting: a Jinja file, or the name of one of llama.cpp's built-in
     templates ("gemma", "llama3", "chatml", ...: `builtin_templates()`);
  2. the GGUF's own `tokenizer.chat_template`, rendered by our sandboxed Jinja;
  3. llama.cpp's built-in template for the model's family (`general.architecture`, the vocab);
  4. ChatML, with a warning: many small models use it, but a model that does not know it
     tends to echo the markup back.
Built-in templates are rendered by llama.cpp's own `llama_chat_apply_template`, so a prompt
is byte for byte what llama.cpp makes of the same template. `ChatTemplate.source` says which
one won: `setting:<name|file>`, `gguf`, `builtin:<name>` or `chatml-fallback`.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from memspec.errors import InvalidRequest

log = logging.getLogger(__name__)

# Used when nothing better is known: ChatML, which SmolLM2 and many small models use.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# general.architecture -> llama.cpp's built-in template, for a GGUF that carries no template.
# Only families with one chat format; "llama" is decided by its vocab (architecture_template).
ARCH_TEMPLATES: dict[str, str] = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "llama4": "llama4",
    "phi3": "phi3",
    "qwen2": "chatml",
    "qwen2moe": "chatml",
    "qwen3": "chatml",
    "qwen3moe": "chatml",
    "command-r": "command-r",
    "cohere2": "command-r",
    "exaone": "exaone3",
    "exaone4": "exaone4",
    "granite": "granite",
    "granitemoe": "granite",
    "minicpm": "minicpm",
    "orion": "orion",
    "rwkv6": "rwkv-world",
    "rwkv7": "rwkv-world",
    "gpt-oss": "gpt-oss",
    "hunyuan-moe": "hunyuan-moe",
    "hunyuan-dense": "hunyuan-dense",
    "seed_oss": "seed_oss",
}
# llama.cpp's pre-tokenizer name for the Llama 3 vocab (convert_hf_to_gguf writes it).
LLAMA3_PRE = "llama-bpe"

_warned: set[str] = set()  # models whose ChatML fallback was logged (once per process)


class ChatTemplateError(ValueError):
    """The chat_template setting names no built-in template and no readable Jinja file."""


@cache
def builtin_templates() -> frozenset[str]:
    """The built-in template names of the llama.cpp that llama-cpp-python loaded."""
    import llama_cpp

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return frozenset(name.decode() for name in names if name)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' `tojson`, which chat templates are written against (tools, tool-call
    # arguments): Jinja's own escapes <, >, & and ' as HTML, which no model was trained on.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    # transformers' global too (Llama 3.x templates print today's date with it).
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest(f"messages[{i}] needs 'role' and 'content'", param="messages")


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with a Jinja chat template (ChatML when None); `tools` (OpenAI's
    list of functions) reach the template as transformers passes them."""
    _check_messages(messages)
    extra = {"tools": tools} if tools else {}
    return _compile(template or CHATML).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=bos_token,
        eos_token=eos_token,
        **extra,
    )


def render_builtin(name: str, messages: list[dict[str, str]]) -> str:
    """Render `messages` with llama.cpp's built-in template `name`, generation prompt added."""
    import llama_cpp

    _check_messages(messages)
    encoded = []
    for i, m in enumerate(messages):
        role, content = str(m["role"]).encode(), str(m["content"]).encode()
        if b"\0" in role or b"\0" in content:  # C strings: the text would end there
            raise InvalidRequest(
                f"messages[{i}] contains a NUL character, which this chat template cannot carry",
                param="messages",
            )
        encoded.append((role, content))
    chat = (llama_cpp.llama_chat_message * len(encoded))()
    for item, (role, content) in zip(chat, encoded, strict=True):
        item.role, item.content = role, content  # `encoded` keeps the bytes alive
    size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(encoded), True, buf, size)
        if n < 0:
            raise RuntimeError(f"llama.cpp cannot render built-in chat template {name!r}")
        if n <= size:  # it returns the length it needs; a short buffer holds a truncated prompt
            return buf.raw[:n].decode("utf-8")
        size = n + 1


@dataclass(frozen=True)
class ChatTemplate:
    """A resolved chat template: Jinja text, or a llama.cpp built-in name, and where from."""

    source: str  # setting:<name|file> | gguf | builtin:<name> | chatml-fallback
    jinja: str | None = None
    builtin: str | None = None
    warning: str | None = None  # why the daemon's chats may be poor (status shows it)

    def render(
        self,
        messages: list[dict[str, Any]],
        bos_token: str = "",
        eos_token: str = "",
        adds_bos: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` with the generation prompt. `adds_bos`: the
        tokenizer puts BOS in front itself, so a template's own leading BOS is dropped (a
        Jinja template copied from Hugging Face often starts with one: two would reach the
        model). `tools` go to a Jinja template (`takes_tools`); a built-in one has no place
        for them (the caller describes them in a message instead: server/tools.py)."""
        if self.builtin is not None:
            text = render_builtin(self.builtin, messages)
        else:
            text = render_chat(self.jinja, messages, bos_token, eos_token, tools)
        if adds_bos and bos_token and text.startswith(bos_token):
            text = text[len(bos_token) :]
        return text

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders `tools` itself (a Jinja template that reads them)."""
        return self.jinja is not None and "tools" in self.jinja

    def status(self) -> dict[str, str | None]:
        return {"source": self.source, "warning": self.warning}


def architecture_template(metadata: Mapping[str, str]) -> str | None:
    """llama.cpp's built-in template for the model family the GGUF metadata names, if known."""
    arch = metadata.get("general.architecture", "")
    if arch == "llama":  # one architecture, many chat formats: the vocab tells Llama 3 apart
        return "llama3" if metadata.get("tokenizer.ggml.pre") == LLAMA3_PRE else None
    return ARCH_TEMPLATES.get(arch)


def template_setting(setting: str) -> ChatTemplate:
    """The `chat_template` setting as a template: a file if one is there (or the value looks
    like a path), else a built-in name. ChatTemplateError if it is neither."""
    path = Path(setting).expanduser()
    looks_like_path = "/" in setting or path.suffix in (".jinja", ".j2", ".tmpl", ".txt")
    if path.is_file() or looks_like_path:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ChatTemplateError(f"chat_template: cannot read {setting}: {why}") from None
        try:
            _compile(text)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"chat_template: {setting} is not a valid template: {e}"
            ) from None
        return ChatTemplate(f"setting:{setting}", jinja=text)
    if setting not in builtin_templates():
        raise ChatTemplateError(
            f"chat_template: {setting!r} is neither a readable Jinja file nor a built-in "
            f"template ({', '.join(sorted(builtin_templates()))})"
        )
    return ChatTemplate(f"setting:{setting}", builtin=setting)


def resolve_chat_template(
    setting: str | None, metadata: Mapping[str, str], model: str = "the model"
) -> ChatTemplate:
    """The template a target renders chats with (the order is the module's docstring)."""
    if setting:
        return template_setting(setting)
    own = metadata.get("tokenizer.chat_template")
    if own:
        try:
            _compile(own)
            return ChatTemplate("gguf", jinja=own)
        except jinja2.TemplateError as e:  # a template our sandbox cannot run: keep looking
            log.warning("%s: its chat template does not compile here (%s)", model, e)
    name = architecture_template(metadata)
    if name is not None and name in builtin_templates():
        return ChatTemplate(f"builtin:{name}", builtin=name)
    arch = metadata.get("general.architecture", "?")
    warning = (
        f"{model} has no chat template and llama.cpp has none for its family ({arch}): chats "
        "use ChatML; set chat_template (a Jinja file or a built-in name) if it answers poorly"
    )
    if model not in _warned:
        _warned.add(model)
        log.warning(warning)
    return ChatTemplate("chatml-fallback", jinja=CHATML, warning=warning)
