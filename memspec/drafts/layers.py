"""Recipe "layers": a GGUF with a subset of the transformer blocks (the rest unchanged).

Kept blocks are renumbered 0..n-1 in the order given, `<arch>.block_count` is set to n, and
every other tensor (embeddings, output norm/head) and metadata field (tokenizer, chat
template) is copied byte for byte. Untrained, such a model accepts little as a draft; it is
the starting point a distilled draft (memspec.drafts.distill) trains from.
"""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def write_layer_subset(src: Path, dst: Path, keep_layers: list[int]) -> None:
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
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
