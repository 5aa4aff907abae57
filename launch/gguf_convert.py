"""A GGUF file's weights in another block type (Q4_0, Q4_1 or Q8_0), written by the gguf package's
own quantizer: the benchmark's and the tests' Q8_0 (and Q4_0) files from the shipped Q4_1 one.

Every 2-D tensor stored quantized or in float (the linears and the token embedding) is
dequantized by gguf's reference and quantized again to the target type; norms (1-D) and the
metadata are copied as they are. Cached under the tandem cache directory by source file version.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

_TARGETS = {"q4_0": 2, "q4_1": 3, "q8_0": 8}


def convert(src: str, dst: str, target: str) -> str:
    import gguf
    from gguf.quants import dequantize, quantize

    if target not in _TARGETS:
        raise ValueError(f"target {target!r}: one of {', '.join(_TARGETS)}")
    qtype = gguf.GGMLQuantizationType(_TARGETS[target])
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = f"{dst}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # [out, in]
        if len(shape) == 2 and shape[1] % 32 == 0:
            weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            data, kind = quantize(weight, qtype), qtype
        else:
            data, kind = np.asarray(t.data), t.tensor_type
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, dst)
    return dst


def converted(src: str, target: str) -> str:
    """`src` in `target` blocks, converted once into the cache directory (the source itself where it
    is all `target` already)."""
    from tandem.runtime.model_files import cache_dir, file_cache_key

    dst = Path(cache_dir()) / f"gguf-{file_cache_key(src)}-{target}.gguf"
    if not dst.is_file():
        convert(src, str(dst), target)
    return str(dst)
