"""Write GGUF files (metadata + tensors in chosen quant types) atomically: a crash leaves no partial file."""

from __future__ import annotations

import os
from collections.abc import Mapping

import gguf
import numpy as np

from .quants import quantize

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

OUT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


def _value_type(v) -> tuple[VT, VT | None]:
    if isinstance(v, bool):
        return VT.BOOL, None
    if isinstance(v, (int, np.integer)):
        return (VT.UINT32 if v >= 0 else VT.INT32), None
    if isinstance(v, (float, np.floating)):
        return VT.FLOAT32, None
    if isinstance(v, str):
        return VT.STRING, None
    if isinstance(v, (list, tuple)):
        first = v[0]
        if isinstance(first, bool):
            return VT.ARRAY, VT.BOOL
        if isinstance(first, (int, np.integer)):
            return VT.ARRAY, VT.INT32
        if isinstance(first, (float, np.floating)):
            return VT.ARRAY, VT.FLOAT32
        return VT.ARRAY, VT.STRING
    raise TypeError(f"cannot store {type(v).__name__} in GGUF metadata")


def write_gguf(path: str | os.PathLike, metadata: Mapping, tensors: Mapping[str, tuple[np.ndarray, int]]) -> None:
    """metadata: key -> python value (general.architecture required); tensors: name -> (float array, qtype).

    Arrays are in numpy order (out, in); quantized types need a row length that is a multiple of the block.
    """
    path = os.fspath(path)
    arch = metadata["general.architecture"]
    tmp = f"{path}.partial-{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    try:
        for key, val in metadata.items():
            if key == "general.architecture" or (isinstance(val, (list, tuple)) and len(val) == 0):
                continue
            vt, sub = _value_type(val)
            if vt == VT.ARRAY:
                val = [bool(x) if sub == VT.BOOL else x for x in val]
            w.add_key_value(key, val, vt, sub_type=sub)
        for name, (arr, qtype) in tensors.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            qtype = QT(qtype)
            if qtype == QT.F32:
                w.add_tensor(name, arr)
            elif qtype == QT.F16:
                w.add_tensor(name, arr.astype(np.float16))
            else:
                w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def pick_type(name: str, arr: np.ndarray, out_type: int) -> int:
    """llama.cpp's rule of thumb: 1-D tensors, norms and the DeltaNet conv/decay stay F32."""
    if arr.ndim < 2 or name.endswith(("norm.weight", "ssm_conv1d.weight", ".ssm_a", "ssm_dt.bias")):
        return QT.F32
    block = gguf.GGML_QUANT_SIZES[QT(out_type)][0]
    if arr.shape[-1] % block:
        return QT.F16 if out_type != QT.F32 else QT.F32
    return out_type
