"""Chat templates on real models: the GGUF's own (SmolLM2), llama.cpp's built-in for the family
(Gemma 3, whose GGUF has none), the chat_template setting over both, and bad settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from launcher import TARGET_FILE, require_testbed

from memspec.backends.base import Backend, BackendOptions, load_backend
from memspec.backends.chat import (
    ARCH_TEMPLATES,
    ChatTemplateError,
    architecture_template,
    builtin_templates,
    render_builtin,
)
from memspec.config import Settings
from memspec.errors import InvalidRequest
from memspec.paths import models_dir

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MARKUP = ("<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "im_start", "im_end")

try:  # tests/launcher.py's helper (the Gemma family set up by scripts/setup.sh)
    from launcher import require_gemma
except ImportError:  # a launcher without it: this file's own check

    def require_gemma() -> Path:
        if not (models_dir() / GEMMA_FILE).is_file():
            pytest.fail(f"{GEMMA_FILE} missing: run scripts/setup.sh --family gemma3")
        return models_dir() / GEMMA_FILE


def gemma(chat_template: str | None = None) -> Backend:
    opts = BackendOptions(n_ctx=512, n_threads=1, chat_template=chat_template)
    return load_backend(require_gemma(), opts)


def smollm(chat_template: str | None = None) -> Backend:
    require_testbed()
    opts = BackendOptions(n_ctx=256, n_threads=1, chat_template=chat_template)
    return load_backend(models_dir() / TARGET_FILE, opts)


@pytest.fixture(scope="module")
def gemma_default():
    be = gemma()
    yield be
    be.close()


def greedy(be: Backend, prompt: list[int], n: int = 40) -> list[int]:
    """Plain greedy decoding, up to an end-of-generation token (kept) or n tokens."""
    be.reset()
    out: list[int] = []
    logits = be.eval(prompt, all_logits=False)
    while len(out) < n:
        out.append(int(np.argmax(logits[-1])))
        if out[-1] in be.eos_token_ids:
            break
        logits = be.eval(out[-1:], all_logits=False)
    return out


def test_smollm2_uses_its_gguf_template():
    be = smollm()
    try:
        assert be.chat_template.source == "gguf" and be.chat_template.warning is None
        prompt = be.chat_prompt(QUESTION)
        assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    finally:
        be.close()


def test_gemma_gets_llamas_builtin_gemma_template(gemma_default):
    be = gemma_default
    assert be.metadata["general.architecture"] == "gemma3"
    assert "tokenizer.chat_template" not in be.metadata  # nothing of its own
    assert be.chat_template.source == "builtin:gemma"
    prompt = be.chat_prompt([{"role": "system", "content": "Be brief."}, *QUESTION])
    # llama.cpp's template: no system turn (merged into the user's), "assistant" is "model".
    assert prompt == (
        "<start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    tokens = be.tokenize(prompt, add_bos=True, special=True)
    start = be.tokenize("<start_of_turn>", add_bos=False, special=True)
    assert len(start) == 1  # a control token, not text
    assert tokens[0] == be.bos_token_id and tokens[1] == start[0]  # one BOS, then the turn


def test_gemma_stops_at_end_of_turn(gemma_default):
    be = gemma_default
    eot = be.tokenize("<end_of_turn>", add_bos=False, special=True)
    assert eot == [106] and 106 in be.eos_token_ids


def test_gemma_answer_does_not_echo_the_markup(gemma_default):
    be = gemma_default
    out = greedy(be, be.tokenize(be.chat_prompt(QUESTION), add_bos=True, special=True))
    text = be.detokenize(out).decode(errors="replace")
    assert text.strip() and not any(m in text for m in MARKUP), text
    start = be.tokenize("<start_of_turn>", add_bos=False, special=True)[0]
    assert start not in out  # no new turn opened either (control tokens print nothing)


def test_chatml_is_what_made_gemma_echo_markup():
    """Why the built-in matters: the same question in ChatML (the old fallback) comes back
    with ChatML's markup in the answer (this base model's greedy output)."""
    be = gemma("chatml")
    try:
        assert be.chat_template.source == "setting:chatml"
        prompt = be.chat_prompt(QUESTION)
        assert prompt.startswith("<|im_start|>user\n")
        out = greedy(be, be.tokenize(prompt, add_bos=True, special=True))
        assert "<|im_" in be.detokenize(out).decode(errors="replace")
    finally:
        be.close()


def test_setting_names_a_builtin_over_the_gguf_template():
    be = smollm("gemma")
    try:
        assert be.chat_template.source == "setting:gemma"
        prompt = be.chat_prompt(QUESTION)
        assert prompt.startswith("<start_of_turn>user\n") and "<|im_start|>" not in prompt
    finally:
        be.close()


def test_setting_names_a_jinja_file(tmp_path):
    # Hugging Face's templates often begin with the BOS themselves: the tokenizer adds one
    # already, so the rendered prompt must not carry a second.
    path = tmp_path / "turns.jinja"
    path.write_text(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}{{ '<start_of_turn>model\\n' }}"
    )
    be = gemma(str(path))
    try:
        assert be.chat_template.source == f"setting:{path}"
        prompt = be.chat_prompt(QUESTION)
        assert prompt == (
            "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\n"
        )
        tokens = be.tokenize(prompt, add_bos=True, special=True)
        assert tokens.count(be.bos_token_id) == 1
    finally:
        be.close()


def test_gemma_runtime_serves_its_own_id_and_builtin_template():
    """What /admin/status and /v1/models report comes from here (chat_template, model_id)."""
    from memspec.runtime import Runtime

    settings = Settings.load(target=str(require_gemma()), drafts=[], n_ctx=512, n_threads=1)
    rt = Runtime(settings, calibrate_costs=False)
    try:
        assert rt.model_id == "gemma3:270m"
        assert rt.chat_template.status() == {"source": "builtin:gemma", "warning": None}
        tokens = rt.requests.prompt_tokens(messages=QUESTION)
        assert tokens.count(rt.target.bos_token_id) == 1 and tokens[0] == rt.target.bos_token_id
        assert (
            rt.target.detokenize(tokens[1:]).decode()
            == "user\nWhat is the capital of France?\nmodel\n"
        )
    finally:
        rt.close()


def test_runtime_takes_the_setting_from_the_environment(monkeypatch):
    from memspec.runtime import Runtime

    require_testbed()
    monkeypatch.setenv("MEMSPEC_CHAT_TEMPLATE", "llama3")
    settings = Settings.load(drafts=[], n_ctx=256, n_threads=1)
    rt = Runtime(settings, calibrate_costs=False)
    try:
        assert rt.chat_template.source == "setting:llama3"
        tokens = rt.requests.prompt_tokens(messages=QUESTION)
        text = rt.target.detokenize(tokens).decode()
        # SmolLM2's vocab has no Llama 3 control tokens: the markup is there as text.
        assert "<|start_header_id|>user<|end_header_id|>" in text
    finally:
        rt.close()


@pytest.mark.parametrize(
    "value,words",
    [
        ("gemma-7", "neither a readable Jinja file nor a built-in template"),
        ("/no/such/dir/chat.jinja", "cannot read /no/such/dir/chat.jinja"),
    ],
)
def test_bad_setting_fails_when_settings_load(value, words):
    with pytest.raises(ValueError, match=words):
        Settings.load(chat_template=value)


def test_broken_jinja_file_fails_when_settings_load(tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="is not a valid template"):
        Settings.load(chat_template=str(path))


def test_bad_setting_is_one_clear_cli_error(capsys):
    from memspec.cli.main import main

    assert main(["generate", "--prompt", "hi", "--chat", "--chat-template", "gemma-7"]) == 2
    err = capsys.readouterr().err
    assert "chat_template" in err and "gemma, " in err and "Traceback" not in err


def test_bad_setting_fails_the_backend_at_resolution():
    """What the runtime does at load (Settings check first; a file can vanish in between)."""
    be = smollm("/no/such/dir/chat.jinja")
    try:
        with pytest.raises(ChatTemplateError, match="cannot read"):
            be.chat_template  # noqa: B018 - resolving is the point
    finally:
        be.close()


def test_family_table_names_only_templates_llama_cpp_has():
    assert set(ARCH_TEMPLATES.values()) <= builtin_templates()
    assert {"gemma", "llama3", "chatml", "phi3"} <= builtin_templates()
    llama = {"general.architecture": "llama"}
    assert architecture_template(llama | {"tokenizer.ggml.pre": "llama-bpe"}) == "llama3"
    assert architecture_template(llama | {"tokenizer.ggml.pre": "smollm"}) is None


def test_no_template_known_falls_back_to_chatml_with_a_warning(caplog):
    from memspec.backends.chat import resolve_chat_template

    meta = {"general.architecture": "llama", "tokenizer.ggml.pre": "smollm"}
    t = resolve_chat_template(None, meta, "stripped-test-model.gguf")
    assert t.source == "chatml-fallback" and "stripped-test-model.gguf" in (t.warning or "")
    assert t.render(QUESTION).endswith("<|im_start|>assistant\n")
    resolve_chat_template(None, meta, "stripped-test-model.gguf")
    logged = [r for r in caplog.records if "stripped-test-model.gguf" in r.getMessage()]
    assert len(logged) == 1  # once per model, however often it is resolved


def test_builtin_renders_long_chats_whole():
    # More markup than the first buffer holds: llama.cpp says how much, and it is retried.
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(60)]
    text = render_builtin("gemma", turns)
    assert text.count("<start_of_turn>") == 61 and "turn 59<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")
    long = [{"role": "user", "content": "é" * 20_000}]
    assert render_builtin("chatml", long).count("é") == 20_000


def test_builtin_refuses_a_nul_it_could_not_carry():
    with pytest.raises(InvalidRequest, match="NUL"):
        render_builtin("gemma", [{"role": "user", "content": "a\0b"}])


def test_gemma_served_id(gemma_default):
    from memspec.model_id import gguf_general_name, model_aliases, served_model_id

    path = Path(gemma_default.path)
    name = gemma_default.metadata["general.name"]
    assert name == gguf_general_name(path) == "Gemma 3 270m"
    assert served_model_id(None, path) == "gemma3:270m"  # Ollama's library name
    assert "gemma-3-270m" in model_aliases("gemma3:270m", name, path)  # the id before it
