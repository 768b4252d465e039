"""Flags several commands share. Those that mirror a setting are made from the settings model:
its field gives the flag's name, type, help and default, so a setting is described once."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any, get_args, get_origin

from pydantic.fields import FieldInfo

from memspec.config import DEFAULT_CONFIG_FILE, EXACTNESS, Settings
from memspec.kv_cache import KV_TYPES
from memspec.paths import use_data_dir

# The settings every command that loads the models takes, and those only the daemon takes.
MODEL_SETTINGS = (
    "target", "drafts", "backend", "device", "n_ctx", "n_threads", "n_gpu_layers",
    "weight_repack", "exactness", "k_max", "chat_template", "rpc", "tensor_split", "rpc_timeout_s",
    "kv_type_k", "kv_type_v", "draft_kv_type_k", "draft_kv_type_v", "flash_attn", "swa_full",
    "prefill_chunk",
)  # fmt: skip
SERVE_SETTINGS = (
    "host", "port", "budget", "policy", "max_queue", "parallel", "state_dir", "log_level",
    "allow_insecure_bind", "model_name", "embedding_model", "context_overflow",
    "keep_alive", "residency", "model_switch_wait_s", "pinned_models", "ollama_models",
)  # fmt: skip
# Checked on the command line only: the model takes any string (a TOML "INFO" stays valid).
CHOICES = {
    "backend": ["llama_cpp", "torch"],
    "exactness": list(EXACTNESS),
    "kv_type_k": list(KV_TYPES),
    "kv_type_v": list(KV_TYPES),
    "draft_kv_type_k": list(KV_TYPES),
    "draft_kv_type_v": list(KV_TYPES),
    "flash_attn": ["auto", "on", "off"],
    "context_overflow": ["error", "shift"],
    "residency": ["memspec", "lru"],
    "device": ["cpu", "cuda"],
    "log_level": ["debug", "info", "warning", "error"],
}
_SET_BY_FLAGS = "settings_flags"  # namespace attribute: the settings a parser has flags for


def add_settings_flags(p: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """One `--name` per settings field. A flag left out is None, so the environment, the TOML
    file and the field's default keep their say (Settings.load ignores None)."""
    names = tuple(names)
    for name in names:
        field = Settings.model_fields[name]
        kind = _flag_type(field.annotation)
        opts: dict[str, Any] = {"help": _help(field, kind)}
        if kind is bool:  # --name / --no-name; neither: None (the settings decide)
            opts.update(action=argparse.BooleanOptionalAction, default=None)
        else:
            parse = {int: int, float: float, list: _comma_list}.get(kind, str)
            opts.update(type=parse, choices=CHOICES.get(name))
        p.add_argument("--" + name.replace("_", "-"), **opts)
    p.set_defaults(**{_SET_BY_FLAGS: (p.get_default(_SET_BY_FLAGS) or ()) + names})


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, as Settings.load takes them."""
    names = getattr(args, _SET_BY_FLAGS, ())
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def model_flags(p: argparse.ArgumentParser) -> None:
    """--config and the model settings: for every command that loads the models."""
    p.add_argument("--config", help=f"TOML config file (default {DEFAULT_CONFIG_FILE} if present)")
    add_settings_flags(p, MODEL_SETTINGS)


def load_settings(args: argparse.Namespace) -> Settings:
    """The command's settings; their data_dir is where this process finds models and data."""
    settings = Settings.load(args.config, **settings_overrides(args))
    use_data_dir(settings.data_dir)
    return settings


def workload_flags(p: argparse.ArgumentParser, per_category: int, offset: int) -> None:
    """Which MT-Bench questions a run takes."""
    p.add_argument("--per-category", type=int, default=per_category, help="questions per category")
    p.add_argument("--offset", type=int, default=offset, help="skip this many per category")
    p.add_argument("--categories", nargs="*", help="only these MT-Bench categories")
    p.add_argument("--turns", type=int, choices=[1, 2], default=2, help="turns per question")


def _flag_type(annotation: Any) -> type:
    """int, float, bool, list (comma-separated) or str; pydantic converts str to the rest."""
    kind = next((a for a in get_args(annotation) if a is not type(None)), annotation)
    if list in (get_origin(annotation), get_origin(kind)):
        return list
    return kind if kind in (int, float, bool) else str


def _comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _help(field: FieldInfo, kind: type) -> str:
    text = field.description or ""
    if kind is list and "comma-separated" not in text:
        text = "comma-separated " + text
    default = field.get_default(call_default_factory=True)
    # An empty list or a description that names its own default says nothing more here.
    if default not in (None, []) and kind is not bool and "(default" not in text:
        shown = ",".join(map(str, default)) if kind is list else default
        text += f" (default: {shown})"
    return text.replace("%", "%%")  # argparse formats help with %
