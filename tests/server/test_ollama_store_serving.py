"""An Ollama store, laid out by the test as Ollama's source writes it, adopted read-only by a
real daemon and driven with the official `ollama` client.

Two models, their GGUF a hard link of the testbed's SmolLM2 (a blob used in place): one with
`.params` (a stop string, a token limit, greedy), `.system`, `.license` and a `.template`; one
with a `.projector`, listed but refused. The store's files hash the same before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from launcher import ADMIN_KEY, API_KEY, MODEL, running

from memspec.paths import models_dir
from tests.test_ollama_store import write_model

pytestmark = pytest.mark.models

GGUF = "smollm2-135m-q8_0.gguf"
CHAT = "smol:135m"
VISION = "hf.co/test/smolvision:Q8_0"
HISTORY = "myhost:5000/team/smolhistory:v1"
MESSAGES = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
]
QUESTION = "Name three primary colors."
SYSTEM = (
    "You are a helpful assistant who answers every question about colours, paint and art in "
    "a careful, friendly and complete way, and who never uses more words than needed."
)
# Also what changes nothing here: an option at its off value, a context wish beyond the
# daemon's, a hardware hint.
PARAMS = {"stop": [" "], "num_predict": 16, "temperature": 0, "mirostat": 0, "num_ctx": 131072,
          "num_thread": 2}  # fmt: skip
MIROSTAT = "smolmirostat:135m"
BROKEN = "smolbroken:135m"  # its blob the GGUF's first MiB: a bad model, not a crash


def _link_blob(store: Path, source: Path) -> None:
    """The GGUF as Ollama's blob of it: a hard link where the filesystem allows (no copy)."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    blob = store / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, blob)
    except OSError:
        shutil.copyfile(source, blob)


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under `root` by relative path: a file's SHA-256, a directory's mark."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    source = models_dir() / GGUF
    if not source.is_file():
        pytest.skip(f"{GGUF} is not in the models dir (memspec testbed fetch)")
    root = tmp_path_factory.mktemp("ollama") / "models"
    _link_blob(root, source)  # write_model then finds the blob already there
    gguf = source.read_bytes()
    write_model(
        root,
        "registry.ollama.ai/library/smol/135m",
        [
            ("application/vnd.ollama.image.model", gguf),
            ("application/vnd.ollama.image.template", b"{{ .System }} {{ .Prompt }}"),
            ("application/vnd.ollama.image.system", SYSTEM.encode()),
            ("application/vnd.ollama.image.params", json.dumps(PARAMS).encode()),
            ("application/vnd.ollama.image.license", b"Apache License 2.0 (test)"),
        ],
    )
    write_model(
        root,
        "hf.co/test/smolvision/Q8_0",
        [
            ("application/vnd.ollama.image.model", gguf),
            ("application/vnd.ollama.image.projector", b"not a real projector"),
        ],
    )
    write_model(
        root,
        "myhost:5000/team/smolhistory/v1",
        [
            ("application/vnd.ollama.image.model", gguf),
            ("application/vnd.ollama.image.messages", json.dumps(MESSAGES).encode()),
        ],
    )
    write_model(
        root,
        "registry.ollama.ai/library/smolmirostat/135m",
        [
            ("application/vnd.ollama.image.model", gguf),
            ("application/vnd.ollama.image.params", json.dumps({"mirostat": 2}).encode()),
        ],
    )
    write_model(
        root,
        "registry.ollama.ai/library/smolbroken/135m",
        [("application/vnd.ollama.image.model", gguf[: 1 << 20])],
    )
    del gguf
    yield root, snapshot(root)


@pytest.fixture(scope="module")
def daemon(store: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory):
    root, _ = store
    env = {"MEMSPEC_OLLAMA_MODELS": str(root)}
    with running(tmp_path_factory.mktemp("daemon"), "lookup", keys=True, env=env) as d:
        yield d


@pytest.fixture(scope="module")
def oc(daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, headers={"Authorization": f"Bearer {API_KEY}"})


def ask(oc: ollama.Client, messages: list[dict[str, str]], **options: Any) -> Any:
    return oc.chat(model=CHAT, messages=messages, options=options or None, stream=False)


def test_both_models_listed_with_the_manifests_digest(oc, store) -> None:
    root, _ = store
    listed = {m.model: m for m in oc.list().models}
    assert {CHAT, VISION, HISTORY} <= set(listed)
    raw = (root / "manifests/registry.ollama.ai/library/smol/135m").read_bytes()
    assert listed[CHAT].digest == hashlib.sha256(raw).hexdigest()
    assert listed[CHAT].details.format == "gguf" and listed[CHAT].details.family == "llama"


def test_params_are_defaults_and_the_requests_own_win(oc) -> None:
    user = [{"role": "user", "content": QUESTION}]
    default = ask(oc, user)
    # stop " " from the model's .params cuts the answer at its first space
    assert default.done_reason == "stop" and " " not in default.message.content
    # the request's own stop wins; num_predict 16 and temperature 0 still come from the model
    longer = ask(oc, user, stop=["zzzz"])
    assert " " in longer.message.content.strip() and longer.eval_count <= 16
    assert ask(oc, user, stop=["zzzz"]).message.content == longer.message.content  # greedy


def test_an_option_not_implemented_in_params_is_a_400_naming_it(oc) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model=MIROSTAT, messages=[{"role": "user", "content": "hi"}], stream=False)
    assert e.value.status_code == 400 and "mirostat" in str(e.value.error)
    assert ".params" in str(e.value.error)


def test_system_is_the_default_and_a_requests_own_replaces_it(oc) -> None:
    user = {"role": "user", "content": QUESTION}
    with_model_system = ask(oc, [user]).prompt_eval_count
    given_same = ask(oc, [{"role": "system", "content": SYSTEM}, user]).prompt_eval_count
    given_short = ask(oc, [{"role": "system", "content": "Hi."}, user]).prompt_eval_count
    assert with_model_system == given_same  # the model's system prompt, word for word
    assert given_short < with_model_system - 20  # a request's own replaces it


def test_generate_uses_the_models_system_unless_given_one(oc) -> None:
    chat = ask(oc, [{"role": "user", "content": QUESTION}])
    generated = oc.generate(model=CHAT, prompt=QUESTION, stream=False)
    assert generated.prompt_eval_count == chat.prompt_eval_count
    assert " " not in generated.response  # the model's stop applies here too
    own = oc.generate(model=CHAT, prompt=QUESTION, system="Hi.", stream=False)
    assert own.prompt_eval_count < chat.prompt_eval_count - 20


def test_messages_go_before_the_conversation(oc) -> None:
    """The .messages turns are put before a chat's own, as Ollama does: the same prompt as
    the default target (the same tokenizer and chat template) given them by the request."""
    user = {"role": "user", "content": QUESTION}
    from_layer = oc.chat(model=HISTORY, messages=[user], options={"num_predict": 1})
    given = oc.chat(model=MODEL, messages=[*MESSAGES, user], options={"num_predict": 1})
    plain = oc.chat(model=MODEL, messages=[user], options={"num_predict": 1})
    assert from_layer.prompt_eval_count == given.prompt_eval_count > plain.prompt_eval_count


def test_show_says_what_the_layers_mean(daemon, oc) -> None:
    shown = oc.show(CHAT)
    assert shown.license == "Apache License 2.0 (test)"
    assert '"stop"' not in shown.parameters and "stop" in shown.parameters
    assert "temperature" in shown.parameters and "num_predict" in shown.parameters
    raw = httpx.post(
        daemon.url + "/api/show",
        json={"model": CHAT},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert raw["system"] == SYSTEM
    assert "not executed" in raw["memspec"]["template"]
    assert raw["memspec"]["store"] == "ollama" and raw["memspec"]["refused"] is None
    # the GGUF's own chat template (Jinja), not the Go template of the layer
    assert ".Prompt" not in shown.template and "<|im_start|>" in shown.template


def test_projector_model_is_refused_naming_the_layer(daemon, oc) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model=VISION, messages=[{"role": "user", "content": "hi"}], stream=False)
    assert e.value.status_code in (400, 422) and ".projector" in str(e.value.error)
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model=VISION, prompt="hi", stream=False)
    assert ".projector" in str(e.value.error)
    shown = httpx.post(
        daemon.url + "/api/show",
        json={"model": VISION},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert ".projector" in shown["memspec"]["refused"]
    v1 = httpx.post(
        daemon.url + "/v1/chat/completions",
        json={"model": VISION, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert v1.status_code == 422 and ".projector" in v1.json()["error"]["message"]
    assert v1.json()["error"]["code"] == "model_layer_unsupported"
    # the daemon serves on
    assert ask(oc, [{"role": "user", "content": QUESTION}]).message.role == "assistant"


def test_ps_names_the_store_model(oc) -> None:
    ask(oc, [{"role": "user", "content": QUESTION}])
    running_models = {m.model: m for m in oc.ps().models}
    assert CHAT in running_models
    assert running_models[CHAT].digest == {m.model: m for m in oc.list().models}[CHAT].digest


def test_a_bad_blob_is_a_bad_model(daemon, oc) -> None:
    assert BROKEN not in {m.model for m in oc.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model=BROKEN, messages=[{"role": "user", "content": "hi"}], stream=False)
    assert e.value.status_code == 422 and "not a usable GGUF" in str(e.value.error)
    status = httpx.get(
        daemon.url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    assert any(b["name"] == BROKEN for b in status["bad_models"])
    assert any(b["name"] == VISION and ".projector" in b["reason"] for b in status["bad_models"])
    assert ask(oc, [{"role": "user", "content": QUESTION}]).message.role == "assistant"


def test_v1_applies_the_models_params_and_system_under_the_requests_own(daemon, oc) -> None:
    """/v1 gets a store model's defaults as Ollama's OpenAI routes do (they become its
    ChatRequest, whose handler applies the layers): .params' stop and num_predict, .system,
    .messages; the request's own fields win. temperature is the request's or OpenAI's 1.0
    (Ollama's openai.go sets it on every request), so these greedy checks send 0."""
    v1 = openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)
    user = {"role": "user", "content": QUESTION}
    native = ask(oc, [user])  # /api/chat: the model's params (greedy) and system
    plain = v1.chat.completions.create(model=CHAT, messages=[user], temperature=0)
    assert plain.choices[0].message.content == native.message.content
    assert " " not in native.message.content and plain.choices[0].finish_reason == "stop"
    assert plain.usage.prompt_tokens == native.prompt_eval_count  # the model's system prompt
    # the request's own stop wins; the model's num_predict 16 still holds
    longer = v1.chat.completions.create(model=CHAT, messages=[user], temperature=0, stop="zzzz")
    assert longer.choices[0].message.content == ask(oc, [user], stop=["zzzz"]).message.content
    assert " " in longer.choices[0].message.content.strip()
    assert longer.usage.completion_tokens <= 16
    short = v1.chat.completions.create(
        model=CHAT, messages=[user], temperature=0, stop="zzzz", max_tokens=3
    )
    assert short.usage.completion_tokens == 3  # the request's own limit wins
    # a system (or developer) message of the request's own replaces the model's
    for role in ("system", "developer"):
        own = v1.chat.completions.create(
            model=CHAT, messages=[{"role": role, "content": "Hi."}, user], max_tokens=1
        )
        assert own.usage.prompt_tokens < plain.usage.prompt_tokens - 20, role
    # .messages go before the conversation, as on /api/chat
    history = v1.chat.completions.create(model=HISTORY, messages=[user], max_tokens=1)
    given = v1.chat.completions.create(model=MODEL, messages=[*MESSAGES, user], max_tokens=1)
    assert history.usage.prompt_tokens == given.usage.prompt_tokens
    # a params option this daemon does not implement: OpenAI's 400 naming it and the layer
    with pytest.raises(openai.BadRequestError) as e:
        v1.chat.completions.create(model=MIROSTAT, messages=[user], max_tokens=1)
    assert "mirostat" in e.value.message and ".params" in e.value.message


def test_v1_completions_apply_the_models_params_not_its_system(daemon, oc) -> None:
    """/v1/completions runs the prompt as it is: the model's stop and num_predict apply, no
    system prompt is added (as /api/generate with raw)."""
    v1 = openai.OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = "The three primary colors are"
    store = v1.completions.create(model=CHAT, prompt=prompt, temperature=0)
    raw = oc.generate(model=CHAT, prompt=prompt, raw=True, stream=False)
    assert store.choices[0].text == raw.response and " " not in store.choices[0].text.strip()
    assert store.usage.prompt_tokens == raw.prompt_eval_count  # the prompt alone
    own = v1.completions.create(model=CHAT, prompt=prompt, temperature=0, stop=["zzzz"])
    limited = v1.completions.create(
        model=HISTORY, prompt=prompt, temperature=0, stop=["zzzz"], max_tokens=16
    )
    # the model's num_predict 16: as the same GGUF without .params given max_tokens 16
    assert own.choices[0].text == limited.choices[0].text
    assert own.choices[0].text.startswith(store.choices[0].text)


def test_the_store_is_unchanged(store, oc) -> None:
    """Last: after the listings, chats and shows above, every file hashes the same and the
    directory's listing is the same (nothing written, nothing left beside the blobs)."""
    root, before = store
    oc.list()
    oc.show(CHAT)
    assert snapshot(root) == before
