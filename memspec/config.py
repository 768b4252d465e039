"""All settings in one pydantic-settings model, frozen once loaded.

Precedence: CLI flags > environment (MEMSPEC_*) > TOML file (--config, else
/etc/memspec/config.toml when it exists) > defaults. A Settings never changes after load: a
variant is a copy (`settings.model_copy(update=...)`), and the daemon's live tuning replaces
its copy in one place (memspec.server.tuning).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from memspec.kv_cache import KVCache, KVType, resolve_flash_attn
from memspec.units import parse_duration_s, parse_size  # noqa: E402

DEFAULT_CONFIG_FILE = Path("/etc/memspec/config.toml")


# What greedy output promises (Settings.exactness).
EXACTNESS = ("bitwise", "numeric")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMSPEC_", extra="forbid", frozen=True)

    # Models (a description is also the --help text of the field's flag: memspec.cli.flags)
    data_dir: Path | None = None  # default: ./data beside the checkout (MEMSPEC_DATA_DIR)
    target: str = Field("smollm2-135m-f32.gguf", description="GGUF file in models dir, or a path")
    model_name: str | None = Field(
        None,
        description="name served at /v1/models and /api/tags (default: Ollama's library name "
        "for the target, e.g. qwen2.5-coder:1.5b, else the file stem as an id)",
    )
    chat_template: str | None = Field(
        None,
        description="chat template: a Jinja file, or a llama.cpp built-in name such as gemma, "
        "llama3, chatml (default: the GGUF's own, else the built-in for its family, else ChatML)",
    )
    embedding_model: str | None = Field(
        None,
        description="GGUF (models dir, or a path) that serves /api/embed and /v1/embeddings "
        "(default: the target, on its loaded weights); its context loads on the first "
        "embedding request and is charged to the budget",
    )
    drafts: list[str] | None = Field(
        None,
        description="draft ids to preload, in order (default: the target's whole family, every "
        "built draft that speaks its tokenizer, as far as the budget holds them; the working "
        "set then keeps what the policy predicts is worth most)",
    )
    manifest_dir: Path | None = None  # default: drafts/ in the checkout
    ollama_models: str | None = Field(
        None,
        description="the Ollama store to serve read-only (its models listed under Ollama's "
        "names, blobs used in place, nothing written there): a path, or none (default: "
        "$OLLAMA_MODELS, else ~/.ollama/models, else /usr/share/ollama/.ollama/models)",
    )
    follow_symlinks: bool = Field(
        False, description="follow symlinks that leave the models dir (serve what they point to)"
    )
    # Drafts for whatever arrives (memspec.draft_builds): a served model without a built
    # family gets one in the background, at low priority, serving with prompt lookup meanwhile.
    build_drafts: bool = Field(
        True,
        description="build the draft family of every served model that has none (pulled, "
        "created, or found at start), one at a time in a low-priority child process",
    )
    build_drafts_only: list[str] | None = Field(
        None,
        description="recipe ids those background builds make (default: every recipe of the "
        "family not marked on_demand: self-drafts, the CI-size datastore; a sibling is found)",
    )
    # Several models under one budget (memspec.scheduler.residency): any model in the models
    # dir is served by name; the target is the default and the one loaded at start.
    keep_alive: str = Field(
        "-1",
        description="how long a model stays loaded after its last request, as Ollama's "
        "keep_alive: a duration (5m, 1h30m, 300), -1 (until the budget needs the room) or 0",
    )
    residency: Literal["memspec", "lru"] = Field(
        "memspec",
        description="which targets stay resident: memspec (predicted demand, switches in "
        "runs) or lru (Ollama's: first come first served, least recently used unloaded)",
    )
    model_switch_wait_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="cap on how long a request for a model that must load waits while the "
        "model it displaces still has requests queued (residency memspec: the wait is 8x the "
        "switch's measured loads, at most this)",
    )
    queue_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="longest a request waits in the queue (for a slot or for its model to "
        "load) before it gets a 503 saying why, with Retry-After",
    )
    pinned_models: list[str] = Field(
        default_factory=list, description="models never unloaded once loaded (names)"
    )
    backend: str = Field("llama_cpp", description="model backend")
    device: str = Field("cpu", description="torch backend device")
    n_ctx: Annotated[int, Field(ge=16, le=1 << 20)] | Literal["auto"] = Field(
        2048,
        description="context length per slot in tokens, or auto: the longest that fits the "
        "budget beside the target and the drafts it preloads, at most the model's trained "
        "context (`memspec plan` shows it)",
    )
    prefill_chunk: int = Field(
        512,
        ge=16,
        le=1 << 16,
        description="prompt tokens a sequence feeds per round: a long prompt is fed in chunks "
        "between the other sequences' rounds, and a cancelled request stops between chunks",
    )
    context_overflow: Literal["error", "shift"] = Field(
        "error",
        description="a chat whose prompt and max_tokens exceed the context: error (400 "
        "context_length_exceeded) or shift (keep the system prompt, drop the oldest turns)",
    )
    kv_type_k: KVType = Field(
        "f16", description="the target's K cache type: f16, q8_0 (half the bytes) or q4_0"
    )
    kv_type_v: KVType = Field(
        "f16", description="the target's V cache type: f16, q8_0 or q4_0 (needs flash_attn)"
    )
    draft_kv_type_k: KVType | None = Field(
        None, description="model drafts' K cache type (default: the target's)"
    )
    draft_kv_type_v: KVType | None = Field(
        None, description="model drafts' V cache type (default: the target's)"
    )
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto",
        description="flash attention: auto is on where a V cache is quantized (llama.cpp needs "
        "it) or layers are on a GPU, else off",
    )
    swa_full: bool = Field(
        False,
        description="sliding-window layers (Gemma 2/3) keep a full-size cache, llama.cpp's "
        "own default; off (llama-server's), they keep the window: 5x less KV on Gemma 3 at a "
        "long context, and a cached prefix is reused only while its window is held",
    )
    n_threads: int | None = Field(
        None, ge=1, le=1024, description="CPU threads (default: all cores)"
    )
    n_gpu_layers: int = Field(
        0, ge=-1, le=100_000, description="layers offloaded to the GPU (-1: all)"
    )
    weight_repack: bool = Field(
        True,
        description="load the target with llama.cpp's repacked weights (its faster CPU kernels "
        "for Q4_0, Q4_K, IQ4_NL...); the row rule keeps output bit-exact (docs/daemon.md)",
    )
    exactness: str = Field(
        "bitwise",
        description="bitwise: a position's logits never depend on its batch (the row rule), so "
        "greedy output is the target's own token for token; numeric: the repacked kernels' "
        "batched paths as llama-server runs them, the same distribution, greedy output may "
        "differ where the top two logits tie within the kernels' rounding (docs/daemon.md)",
    )
    rpc: list[str] = Field(
        [],
        description="ggml RPC workers (HOST:PORT, comma-separated) the target's layers are split "
        "over (`memspec rpc-worker`); drafts stay on this device",
    )
    tensor_split: list[float] = Field(
        [],
        description="the target's layers per rpc worker, as weights (comma-separated), and "
        "optionally one more for this device (default: the workers share equally)",
    )
    rpc_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a forward pass over rpc workers that takes longer fails"
    )
    # Speculation and memory (policies: memspec.scheduler.rounds and .policies)
    k_max: int = Field(8, ge=0, le=64, description="longest draft per round")
    policy: str = Field("memspec", description="draft policy: memspec, auto, ucb, exp3, fixed:<id>")
    predictor: Path | None = None  # acceptance predictor artifact; default predictors/*.json
    budget: str | int = Field("2GiB", description="memory for target + drafts + KV, e.g. 1.5GiB")
    # Server
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="port")
    api_key: SecretStr | None = None  # Bearer key for /v1 (env MEMSPEC_API_KEY); never logged
    admin_key: SecretStr | None = None  # Bearer key for /admin; falls back to api_key
    allow_insecure_bind: bool = Field(False, description="allow binding off loopback with no key")
    api_keys: list[SecretStr] = []  # more /v1 keys, one per client: each its own prefix cache
    # With no key set, a request whose Host is not loopback, `host` or one of these is refused
    # (403): a web page that rebinds its own DNS name to 127.0.0.1 cannot reach the daemon.
    allowed_hosts: list[str] = Field(
        [], description="extra Host names accepted with no key set (comma-separated)"
    )
    cors_origins: list[str] = Field(
        [],
        description="browser origins allowed to call the API (CORS), e.g. http://my.app; "
        "loopback origins always are; '*' only with no key set",
    )
    # A client that sends its headers or body this slowly gets a 408 and is disconnected; it
    # would otherwise hold a connection (and a file descriptor) for as long as it likes.
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    body_timeout_s: float = Field(30.0, gt=0, le=3600)
    # Open connections at most (uvicorn limit_concurrency: 503 above it); 0: sized from the
    # process's file descriptors and the memory budget (memspec.server.serve.connection_cap).
    max_connections: int = Field(0, ge=0, le=100_000)
    admin_queue: int = Field(4, ge=1, le=64)  # admin jobs waiting; then 429
    # A tuned state in place at this many starts in a row that never got ready (failed, or
    # killed: OOM at a budget above MemoryMax, say) is moved aside at the next start.
    tune_failed_starts: int = Field(2, ge=1, le=100)
    max_queue: int = Field(
        16, ge=0, le=100_000, description="requests queued beyond the slots; then 429"
    )
    parallel: int = Field(
        0,
        ge=0,
        le=64,
        description="sequence slots decoded together in one batch (0: as many as the budget "
        "fits beside the drafts, at most 8; `memspec plan` says how many)",
    )
    max_body: str | int = "1MiB"  # request body limit (413 above it)
    max_prompt_chars: int = Field(
        default=200_000, ge=1, le=1 << 30
    )  # before tokenizing (400 above it)
    default_max_tokens: int = Field(
        default=512, ge=1, le=1 << 20
    )  # chat completions without max_tokens
    prefix_cache: str | int = "256MiB"  # multi-session KV snapshots (0: off); within budget
    state_dir: Path | None = Field(None, description="tuned settings dir (default <data>/state)")
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, le=3600
    )  # in-flight streams are cut after it
    log_level: str = Field("info", description="log level")

    @field_validator("budget", "max_body", "prefix_cache")
    @classmethod
    def _budget(cls, v: str | int) -> str | int:
        parse_size(v)  # fail at load with a clear message
        return v

    @model_validator(mode="after")
    def _cors(self) -> Settings:
        keyed = any(
            k is not None and k.get_secret_value().strip()
            for k in (self.api_key, self.admin_key, *self.api_keys)
        )
        if keyed and "*" in self.cors_origins:  # any page could then drive a keyed API
            raise ValueError("cors_origins '*' is refused while an API or admin key is set")
        return self

    @model_validator(mode="after")
    def _kv_types(self) -> Settings:
        self.kv_cache  # noqa: B018 - a quantized V with flash_attn off fails at load
        self.draft_kv_cache  # noqa: B018
        return self

    @property
    def kv_cache(self) -> KVCache:
        """The target's KV cache types, flash attention resolved."""
        quantized_v = {self.kv_type_v, self.draft_kv_type_v or self.kv_type_v} != {"f16"}
        fa = resolve_flash_attn(self.flash_attn, quantized_v, self.n_gpu_layers)
        return KVCache(self.kv_type_k, self.kv_type_v, fa, self.swa_full)

    @property
    def draft_kv_cache(self) -> KVCache:
        """Model drafts' KV cache types (the target's unless set), with the same attention."""
        return KVCache(
            self.draft_kv_type_k or self.kv_type_k,
            self.draft_kv_type_v or self.kv_type_v,
            self.kv_cache.flash_attn,
            self.swa_full,
        )

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, v: str | int | float) -> str:
        parse_duration_s(v)  # "5m", "-1", 300: a clear message at load for anything else
        return str(v)

    @property
    def keep_alive_s(self) -> float | None:
        """keep_alive in seconds; None: no expiry (a negative duration)."""
        seconds = parse_duration_s(self.keep_alive)
        return None if seconds < 0 else seconds

    @field_validator("exactness")
    @classmethod
    def _exactness(cls, v: str) -> str:
        if v not in EXACTNESS:
            raise ValueError(f"exactness must be one of {', '.join(EXACTNESS)}, not {v!r}")
        return v

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v:  # an unknown name or unreadable file fails here, before anything loads
            from memspec.backends.chat import template_setting

            template_setting(v)
        return v or None

    @property
    def budget_bytes(self) -> int:
        return parse_size(self.budget)

    # Set by load(), not a setting.
    config_file: Path | None = Field(default=None, exclude=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _CONFIG_FILE_OVERRIDE.get("path")
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """Build settings from CLI overrides (None values ignored), env, TOML and defaults."""
        path = Path(config_file) if config_file else None
        if path is None and DEFAULT_CONFIG_FILE.is_file():
            path = DEFAULT_CONFIG_FILE
        if path is not None and not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        _CONFIG_FILE_OVERRIDE["path"] = path
        try:
            s = cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _CONFIG_FILE_OVERRIDE.pop("path", None)
        return s.model_copy(update={"config_file": path})


_CONFIG_FILE_OVERRIDE: dict[str, Path | None] = {}


# --- the environment read outside Settings ------------------------------------------------------
# Settings is the daemon's configuration; these are the few variables read before or beside it
# (paths, the manifest dir, build threads, clients' defaults). This module is the one that
# reads the environment: the rest of the package asks here.


def env_data_dir() -> Path | None:
    """$MEMSPEC_DATA_DIR (memspec.paths: where models, data and caches live)."""
    return _env_path("MEMSPEC_DATA_DIR")


def env_manifest_dir() -> Path | None:
    """$MEMSPEC_MANIFEST_DIR (memspec.drafts.manifest: the draft manifests)."""
    return _env_path("MEMSPEC_MANIFEST_DIR")


def env_llama_server() -> Path | None:
    """$MEMSPEC_LLAMA_SERVER: a llama-server binary for the peer benchmarks."""
    return _env_path("MEMSPEC_LLAMA_SERVER")


def build_threads() -> int:
    """$MEMSPEC_BUILD_THREADS, default 1: long corpus generation leaves the other cores to
    whoever shares the machine."""
    return int(os.environ.get("MEMSPEC_BUILD_THREADS", "1"))


def client_env(default_url: str) -> dict[str, str | None]:
    """Defaults of a client of the daemon (memspec-ctl, bench load): url, admin_key, api_key
    from $MEMSPEC_URL, $MEMSPEC_ADMIN_KEY, $MEMSPEC_API_KEY."""
    return {
        "url": os.environ.get("MEMSPEC_URL") or default_url,
        "admin_key": os.environ.get("MEMSPEC_ADMIN_KEY"),
        "api_key": os.environ.get("MEMSPEC_API_KEY"),
    }


def systemd_env() -> dict[str, str]:
    """What systemd tells its service: NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID
    (memspec.server.notify)."""
    keys = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    return {k: os.environ[k] for k in keys if k in os.environ}


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def settings_error(e: ValidationError) -> str:
    """One line for a settings error (pydantic's own message spans several)."""
    parts = []
    for err in e.errors()[:3]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "settings"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid settings: " + "; ".join(parts)
