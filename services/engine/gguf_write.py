"""Write GGUF files (metadata + tensors in chosen quant types) atomically: a crash leaves no partial file."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

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
    with _atomic_writer(path, metadata["general.architecture"]) as w:
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


@contextmanager
def _atomic_writer(path: str, arch: str) -> Iterator[gguf.GGUFWriter]:
    """A GGUFWriter on a file beside `path`: what the block added is written and renamed over `path` at its end;
    on any error the partial file is removed and `path` is left as it was."""
    tmp = f"{path}.partial-{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    try:
        yield w
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


def rewrite_metadata(src: str | os.PathLike, dst: str | os.PathLike, updates: Mapping) -> None:
    """Copy the GGUF `src` to `dst` with metadata keys set (value None: removed); tensors are copied byte for
    byte and every other key keeps its stored type. dst may be src: the copy is written aside and renamed."""
    r = gguf.GGUFReader(os.fspath(src))
    with _atomic_writer(os.fspath(dst), r.fields["general.architecture"].contents()) as w:
        for key, field in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture" or key in updates:
                continue
            vt = field.types[0]
            w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1] if vt == VT.ARRAY else None)
        for key, val in updates.items():
            if val is not None:   # ints as INT32: llama.cpp's penalty_last_n may be -1
                vt = VT.INT32 if isinstance(val, (int, np.integer)) and not isinstance(val, bool) else None
                w.add_key_value(key, val, vt or _value_type(val)[0])
        for t in r.tensors:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)   # the byte shape: gguf derives the logical one
