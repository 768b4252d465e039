"""torch/transformers backend: the same GGUF loaded through transformers, KV in a DynamicCache.

transformers dequantizes the GGUF (`gguf_file=`) into an ordinary torch model, so this backend
is for CUDA devices and Hugging Face checkpoints rather than the CPU default (llama.cpp decodes
the same file several times faster there). Rejected candidates are dropped by cropping the
DynamicCache, which slices views of the cached tensors: nothing is copied.

Text handling mirrors llama.cpp on the same file (add_bos from the GGUF metadata, control
tokens detokenize to nothing, end-of-turn tokens found by name) so both backends produce the
same token ids and bytes for the same model.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import io
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from memspec.backends.base import Backend, BackendOptions
from memspec.errors import ModelLoadError

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 3, 4, 5, 6
_SPECIAL_TYPES = (_TT_CONTROL, _TT_USER_DEFINED)  # what llama.cpp's auto-detection looks at

# Token texts llama.cpp ends a generation on (llama-vocab.cpp's auto-detection: EOT texts, and
# the FIM pad / repo / file-separator tokens); kept in step so both backends stop on the same
# ids (tests/backends/test_torch_hf.py compares them).
_EOT_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",
        "</s>",
        # FIM pad, repo and file separator
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        "<|file_sep|>",
    }
)


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The few GGUF keys the backend needs beyond what transformers exposes."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")

    def get(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    types = reader.fields.get("tokenizer.ggml.token_type")
    # The text keys chat templates and the served model id are chosen from (llama.cpp's
    # backend has them all in Llama.metadata).
    text_keys = (
        "general.name", "general.architecture", "tokenizer.chat_template", "tokenizer.ggml.pre",
        "tokenizer.ggml.model",
    )  # fmt: skip
    return {
        "metadata": {k: str(v) for k in text_keys if (v := get(k)) is not None},
        "add_bos": get("tokenizer.ggml.add_bos_token"),
        "tokenizer_model": get("tokenizer.ggml.model"),
        "eot_id": get("tokenizer.ggml.eot_token_id"),
        # One int per token; read from the raw parts (contents() builds a slow Python list).
        "token_types": None
        if types is None
        else np.array([int(types.parts[i][0]) for i in types.data], dtype=np.int32),
    }


@contextlib.contextmanager
def _quiet_load() -> Iterator[io.StringIO]:
    """Silence transformers' loader (logging, warnings, tqdm bars on stderr) for one load.

    Yields the captured stderr so a failure can still say what the loader printed.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    buf = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(buf):
            warnings.simplefilter("ignore")
            yield buf
    finally:
        hf_logging.set_verbosity(level)


class TorchBackend(Backend):
    def __init__(self, path: Path, options: BackendOptions):
        super().__init__()
        self.path = path
        self.options = options
        self.device = options.device
        self._model: Any = None
        self._tok: Any = None
        self._cache: Any = None
        try:
            self._load(path, options)
        except ModelLoadError:
            self.close()
            raise
        except Exception as e:  # corrupt file, unsupported architecture, CUDA missing, ...
            self.close()  # nothing half-loaded stays resident
            raise ModelLoadError(
                f"failed to load {path.name} with torch: {e}", param="model"
            ) from e

    def _load(self, path: Path, options: BackendOptions) -> None:
        if options.kv_cache.quantized:
            raise ModelLoadError(
                f"KV cache types ({options.kv_cache.describe()}) are llama.cpp's: the torch "
                "backend keeps its cache in the model's dtype; set kv_type_k/kv_type_v to f16",
                param="kv_type_k",
            )
        try:
            import torch

            importlib.import_module("transformers")
            # transformers' GGUF loader needs both, and says so only deep in a traceback.
            importlib.import_module("accelerate")
            importlib.import_module("gguf")
        except ImportError as e:
            raise ModelLoadError(
                f"the torch backend needs torch, transformers, accelerate and gguf ({e}); "
                "install the extra: pip install 'memspec[torch]'",
                param="model",
            ) from e
        import transformers
        from packaging.version import Version
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if options.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(
                f"device {options.device!r} asked for, but torch sees no CUDA device", param="model"
            )
        if options.n_threads:
            torch.set_num_threads(options.n_threads)  # process-wide: torch has one pool
        # F32 on CPU (no fast half kernels there); half on CUDA, where it is the fast path.
        self._dtype = torch.float32 if options.device == "cpu" else torch.float16

        try:
            meta = _gguf_metadata(path)
        except Exception as e:  # the gguf reader fails on bad offsets/shapes with numpy errors
            raise ModelLoadError(
                f"failed to load {path.name}: corrupt or truncated GGUF ({e})", param="model"
            ) from e
        load_kw: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
        # `torch_dtype` was renamed `dtype` in 4.56 (the old name now warns).
        new_dtype_kw = Version(transformers.__version__) >= Version("4.56")
        dtype_kw = {"dtype" if new_dtype_kw else "torch_dtype": self._dtype}
        with _quiet_load() as log:
            try:
                self._tok = AutoTokenizer.from_pretrained(str(path.parent), **load_kw)
                self._model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), **dtype_kw, **load_kw
                )
            except Exception as e:
                tail = log.getvalue().strip().splitlines()[-3:]
                hint = f" (loader said: {' | '.join(tail)})" if tail else ""
                raise ModelLoadError(
                    f"failed to load {path.name} with torch: {e}{hint}", param="model"
                ) from e
        self._model = self._model.to(options.device).eval()

        cfg = self._model.config
        self.n_ctx = options.n_ctx
        self.n_vocab = int(cfg.vocab_size)
        self.n_layers = int(cfg.num_hidden_layers)
        n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        self._weight_bytes = sum(
            t.numel() * t.element_size()
            for t in [*self._model.parameters(), *self._model.buffers()]
        )
        # Keyword names moved between transformers releases (cache vs past_key_values).
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"

        tok = self._tok
        bos = tok.bos_token_id
        self.bos_token_id = int(bos) if bos is not None else None
        # llama.cpp adds BOS unless the GGUF says not to (SmolLM2 says not to).
        add_bos = meta["add_bos"]
        self._add_bos = True if add_bos is None else bool(add_bos)
        pieces: list[str] = tok.convert_ids_to_tokens(list(range(self.n_vocab)))
        types = meta["token_types"]
        eos_ids = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
        if meta["eot_id"] is not None:
            eos_ids.add(int(meta["eot_id"]))
        for i, piece in enumerate(pieces):
            if piece in _EOT_TEXTS and (types is None or types[i] in _SPECIAL_TYPES):
                eos_ids.add(i)
        self.eos_token_ids = frozenset(eos_ids)
        self._bos_text = pieces[bos] if bos is not None else ""
        self._eos_text = pieces[tok.eos_token_id] if tok.eos_token_id is not None else ""
        self.metadata: dict[str, str] = meta["metadata"]
        self._piece_bytes = self._build_piece_table(pieces, types, meta["tokenizer_model"])
        self._cache = self._new_cache()
        self.n_embd = int(cfg.hidden_size)
        self._captured: Any = None
        if options.features:
            # The output layer's input is the features by definition (after the final norm,
            # already cut to the rows logits_to_keep keeps), whatever the architecture or the
            # transformers release calls it; output_hidden_states would also keep every layer.
            head = self._model.get_output_embeddings()
            head.register_forward_pre_hook(self._capture_features)

    @property
    def hf_model(self) -> Any:
        """The transformers model itself, for recipes that batch many sequences at once
        (memspec.recipes.corpus.TorchGreedy) outside the one-sequence Backend interface."""
        return self._model

    def _capture_features(self, module: Any, args: tuple[Any, ...]) -> None:
        self._captured = args[0]

    def _build_piece_table(
        self, pieces: list[str], types: np.ndarray | None, tokenizer_model: str | None
    ) -> list[bytes]:
        """Exact bytes of each token, as llama.cpp renders it with special=False.

        Per-token bytes (not decode() of a token list) keep streaming exact: a multi-byte
        character split across tokens comes out whole once its last byte arrives.
        """
        byte_level = tokenizer_model == "gpt2" or (
            tokenizer_model is None
            and type(self._tok.backend_tokenizer.decoder).__name__ == "ByteLevel"
        )
        to_byte = _byte_decoder()
        table: list[bytes] = []
        for i, piece in enumerate(pieces):
            kind = int(types[i]) if types is not None else 1
            if piece is None or kind in (_TT_CONTROL, _TT_UNUSED):
                table.append(b"")  # control tokens print nothing, as in llama.cpp
            elif kind == _TT_USER_DEFINED:
                table.append(piece.encode("utf-8"))
            elif kind == _TT_BYTE and piece.startswith("<0x"):
                table.append(bytes([int(piece[3:-1], 16)]))
            elif byte_level and all(c in to_byte for c in piece):
                table.append(bytes(to_byte[c] for c in piece))
            elif tokenizer_model == "llama":  # SentencePiece: ▁ stands for a space
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
            else:
                table.append(self._tok.decode([i]).encode("utf-8"))
        return table

    # --- text -------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        # split_special_tokens=True reads "<|im_start|>" as plain text, like llama.cpp's
        # parse_special=False; BOS is ours to add, as llama.cpp decides it.
        ids = self._tok.encode(text, add_special_tokens=False, split_special_tokens=not special)
        if add_bos and self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return [int(t) for t in ids]

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self._piece_bytes[t] for t in tokens)

    # --- compute ------------------------------------------------------------------------
    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self._model.config)
        except TypeError:  # transformers < 4.56 builds its layers lazily, without a config
            return DynamicCache()

    def _forward(self, tokens: list[int], all_logits: bool, copy: bool = True) -> np.ndarray:
        import torch

        n_past = len(self.tokens)
        dev = self._model.device
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        # Positions continue from what the cache holds (it is never left padded or shifted).
        pos = torch.arange(n_past, n_past + len(tokens), device=dev).unsqueeze(0)
        kwargs = {self._cache_kw: self._cache, self._keep_kw: 0 if all_logits else 1}
        t = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self._model(input_ids=ids, position_ids=pos, use_cache=True, **kwargs)
                logits = out.logits[0].float()
                if self._captured is not None:
                    feats = self._captured[0].float().cpu().numpy()
                    self._captured = None
                    feats.flags.writeable = False
                    self._features = feats
                if logits.is_cuda:
                    torch.cuda.synchronize()  # so decode_s holds the kernels, not their launch
        except Exception:
            self._crop_to(n_past)  # leave the cache as `self.tokens` says, even mid-way
            raise
        self.decode_s += time.perf_counter() - t
        return logits.cpu().numpy()

    def _crop_to(self, n: int) -> None:
        import torch

        with torch.inference_mode():
            layers = getattr(self._cache, "layers", None)
            if layers is None:  # older transformers: one crop for all layers, absolute length
                self._cache.crop(n)
                return
            # Per layer, so a forward that failed half-way through the stack is undone too.
            # A negative count removes that many tokens in every transformers release.
            for layer in layers:
                extra = layer.get_seq_length() - n
                if extra > 0:
                    layer.crop(-extra)

    def _truncate_kv(self, n: int) -> None:
        if n == 0:
            self._cache = self._new_cache()  # drop the storage too, not just a view of it
        else:
            self._crop_to(n)

    def close(self) -> None:
        on_cuda = self.device.startswith("cuda")
        self._model = self._tok = self._cache = None
        self.tokens = []
        gc.collect()
        if on_cuda:
            import torch

            torch.cuda.empty_cache()

    def describe(self) -> dict[str, object]:
        import torch

        return {
            **super().describe(),
            "device": self.device,
            "dtype": str(self._dtype).removeprefix("torch."),
            "n_threads": torch.get_num_threads(),
            # Measured: a position's logits move by ~4e-5 with the batch on CPU (oneDNN/MKL
            # pick kernels by shape), so a near-tie can flip; the daemon warns.
            "batch_invariant": False,
        }

    # --- memory -------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        # Dequantized: a Q4 file takes F32 room once loaded; the file size would understate it.
        return self._weight_bytes

    def kv_bytes_per_token(self) -> int:
        elem = self._dtype.itemsize  # the cache holds K and V in the model's dtype
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * elem
