"""Recipe "layers": a GGUF with a subset of the transformer blocks (the rest unchanged).

Kept blocks are renumbered 0..n-1 in the order given, `<arch>.block_count` is set to n, and
every other tensor (embeddings, output norm/head) and metadata field (tokenizer, chat
template) is copied byte for byte. Untrained, such a model accepts little as a draft; it is
the starting point a distilled draft (memspec.recipes.distill) trains from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def write_layer_subset(
    src: Path, dst: Path, keep_layers: list[int], overrides: Mapping[str, np.ndarray] | None = None
) -> None:
    """Write `keep_layers` of `src` to `dst`; `overrides` (by new name) replace tensors' data.

    Overrides are F32 arrays of the source tensor's shape (a distilled student's weights).
    """
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{src.name}: no general.architecture")
    arch = str(arch_field.contents())
    count_key = f"{arch}.block_count"
    n_blocks = int(reader.fields[count_key].contents())
    if not keep_layers:
        raise ValueError("keep_layers is empty")
    bad = [i for i in keep_layers if not 0 <= i < n_blocks]
    if bad or len(set(keep_layers)) != len(keep_layers):
        raise ValueError(
            f"keep_layers must be distinct indices in 0..{n_blocks - 1}: {keep_layers}"
        )
    new_index = {old: new for new, old in enumerate(keep_layers)}

    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = len(keep_layers) if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    tensors = []
    for t in reader.tensors:
        m = BLOCK.match(t.name)
        if m is None:
            tensors.append((t.name, t))
        elif int(m.group(1)) in new_index:
            tensors.append((f"blk.{new_index[int(m.group(1))]}.{m.group(2)}", t))
    overrides = overrides or {}
    unknown = set(overrides) - {name for name, _ in tensors}
    if unknown:
        raise ValueError(f"overrides name tensors the output does not have: {sorted(unknown)}")
    datas = []
    for name, t in tensors:
        if name in overrides:
            data = np.ascontiguousarray(overrides[name], dtype=np.float32)
            want = tuple(int(x) for x in reversed(t.shape))  # GGUF dims are innermost first
            if data.shape != want:
                raise ValueError(f"override {name}: shape {data.shape}, tensor is {want}")
            writer.add_tensor_info(
                name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType.F32
            )
        else:
            data = t.data
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, t.tensor_type)
        datas.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
