"""Render a chat with the Jinja template stored in the model file (tokenizer.chat_template)."""

from __future__ import annotations

from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a GGUF carries no template: ChatML, which SmolLM2 and many small models use.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(
    template: str | None, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = ""
) -> str:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            from memspec.errors import InvalidRequest

            raise InvalidRequest(f"messages[{i}] needs 'role' and 'content'", param="messages")
    return _compile(template or CHATML).render(
        messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
    )
