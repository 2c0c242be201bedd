"""Read model files by content: GGUF and safetensors (+ config.json).

Tensors stay in their stored form (memory-mapped, zero copy) until RawTensor.dequantize() is called.
Anything malformed is reported as one ModelFormatError naming the file, the byte offset, what was
expected and what was found, never as a traceback from a parser library.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors import SafetensorError, safe_open

from . import quants
from .errors import ModelFormatError, UnsupportedModelError

Q = gguf.GGMLQuantizationType
GVT = gguf.GGUFValueType

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
# The safetensors library refuses headers above 100 MB; a bigger length field means garbage, not a model.
SAFETENSORS_MAX_HEADER = 100_000_000
# Nested GGUF arrays are legal but never deeper than 2 in practice; a bound keeps corrupt files from
# recursing without end.
GGUF_MAX_ARRAY_NESTING = 8

KIND_GGUF = "gguf"
KIND_SAFETENSORS = "safetensors"
_EITHER = "a GGUF file (magic 'GGUF') or a safetensors file"


@dataclass
class RawTensor:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value; safetensors F32/F16/BF16 map to the same ids
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a matrix, i.e. ggml ne reversed
    data: np.ndarray  # raw storage: uint8 blocks (quantized; BF16 as uint8 or uint16), or float arrays
    source: str  # file path, for error messages

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape` (F32 may come back as a read-only view of the mapped file)."""
        try:
            return quants.dequantize(self.data, self.qtype, self.shape)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{self.source}: tensor '{self.name}': {e}") from e
        except ValueError as e:
            raise ModelFormatError(
                self.source, f"tensor '{self.name}' storage to match its type and shape", str(e)
            ) from e

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def type_name(self) -> str:
        return quants.type_name(self.qtype)


@dataclass
class ModelFile:
    path: str  # the GGUF file read (also when a folder holding it was given), or the HF folder
    kind: str  # "gguf" | "safetensors"
    metadata: dict[str, Any]  # GGUF key -> python value; for safetensors the config.json dict ({} if none)
    tensors: dict[str, RawTensor] = field(default_factory=dict)

    def require(self, name: str) -> RawTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelFormatError(
                self.path, f"tensor '{name}'", f"it missing (file has {len(self.tensors)} tensors)"
            )
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


# --------------------------------------------------------------------------------------------------
# detection


def _read_head(path: Path, n: int = 16) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as f:
            return f.read(n), os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ModelFormatError(path, _EITHER, f"a file that cannot be read ({e.strerror or e})") from e


def _sniff(path: Path) -> str:
    head, size = _read_head(path)
    if size == 0:
        raise ModelFormatError(path, _EITHER, "an empty file (0 bytes)", offset=0)
    if head[:4] == GGUF_MAGIC:
        return KIND_GGUF
    # safetensors: u64 little-endian header length, then the JSON header, which always opens with '{'.
    if len(head) >= 9 and head[8:9] == b"{":
        return KIND_SAFETENSORS
    raise ModelFormatError(path, _EITHER, repr(head[:8]), offset=0)


def _scan_folder(folder: Path) -> tuple[str, list[Path]]:
    """The model files inside a folder: its safetensors shards (an HF checkpoint wins if both are
    present, since a stray GGUF beside it is usually a conversion), else its one GGUF file."""
    st_files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if st_files or indexes:
        return KIND_SAFETENSORS, st_files
    gguf_files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(gguf_files) == 1:
        return KIND_GGUF, gguf_files
    expected = "a model folder: *.safetensors (+ config.json) or a single *.gguf file"
    if gguf_files:
        names = ", ".join(p.name for p in gguf_files)
        raise ModelFormatError(folder, expected, f"{len(gguf_files)} GGUF files ({names}); pass one of them")
    listing = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(listing[:8]) + (", ..." if len(listing) > 8 else "")
    raise ModelFormatError(folder, expected, f"no model files (folder holds: {shown or 'nothing'})")


def detect_format(path: str | os.PathLike[str]) -> str:
    """Return "gguf" or "safetensors", decided by the bytes (for a folder: by the model files inside)."""
    p = Path(path)
    if p.is_dir():
        return _scan_folder(p)[0]
    if not p.exists():
        raise ModelFormatError(p, f"{_EITHER} or a model folder", "no such file or directory")
    return _sniff(p)


def open_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Open a GGUF file, a safetensors file, or a folder holding either (HF layout: shards + config.json)."""
    p = Path(path)
    if p.is_dir():
        kind, files = _scan_folder(p)
        if kind == KIND_GGUF:
            return _open_any(files[0])
        return _open_safetensors_folder(p, files)
    if not p.exists():
        raise ModelFormatError(p, f"{_EITHER} or a model folder", "no such file or directory")
    return _open_any(p)


def _open_any(path: Path) -> ModelFile:
    kind = _sniff(path)
    if kind == KIND_GGUF:
        return _open_gguf(path)
    # A lone safetensors file: its HF config.json, if any, sits beside it.
    tensors = _read_safetensors(path)
    return ModelFile(str(path), KIND_SAFETENSORS, _read_config(path.parent / "config.json"), tensors)


# --------------------------------------------------------------------------------------------------
# GGUF


class _Cursor:
    """Bounds-checked little-endian reads over a mapped file; every overrun becomes a ModelFormatError."""

    def __init__(self, path: Path, buf: mmap.mmap | bytes):
        self.path, self.buf, self.pos, self.size = path, buf, 0, len(buf)

    def fail(self, expected: str, found: str, offset: int | None = None) -> ModelFormatError:
        return ModelFormatError(self.path, expected, found, offset=self.pos if offset is None else offset)

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} ({n} bytes)", f"only {left} bytes left in the file (truncated?)")

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        self.pos += n

    def text(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} as UTF-8 text", repr(raw[:40]), offset=start) from None
        self.pos += n
        return value


_GGML_TYPE_IDS = frozenset(int(t) for t in gguf.GGML_QUANT_SIZES)
_VALUE_TYPES = ", ".join(f"{t.value}={t.name}" for t in GVT)


_U64 = struct.Struct("<Q")


_ARRAY_DTYPES: dict[int, np.dtype] = {
    GVT.UINT8: np.dtype("u1"),
    GVT.INT8: np.dtype("i1"),
    GVT.BOOL: np.dtype("?"),
    GVT.UINT16: np.dtype("<u2"),
    GVT.INT16: np.dtype("<i2"),
    GVT.UINT32: np.dtype("<u4"),
    GVT.INT32: np.dtype("<i4"),
    GVT.FLOAT32: np.dtype("<f4"),
    GVT.UINT64: np.dtype("<u8"),
    GVT.INT64: np.dtype("<i8"),
    GVT.FLOAT64: np.dtype("<f8"),
}


def _decode(raw: bytes) -> str:
    # Token strings are meant to be UTF-8 but nothing enforces it; keep the bytes rather than fail.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")


def _read_strings(cur: _Cursor, count: int, what: str) -> list[str]:
    """An array of strings; a tight loop, since a vocabulary (and its merges) holds ~250k of them."""
    buf, size, pos = cur.buf, cur.size, cur.pos
    out = []
    for i in range(count):
        if pos + 8 > size or pos + 8 + _U64.unpack_from(buf, pos)[0] > size:
            cur.pos = pos
            cur.skip_string(f"element {i} of {what}")  # re-reads it with a precise message
        n = _U64.unpack_from(buf, pos)[0]
        out.append(_decode(buf[pos + 8 : pos + 8 + n]))
        pos += 8 + n
    cur.pos = pos
    return out


def _read_gguf_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """One metadata value as Python data (int, float, bool, str or a list of them), bounds-checked."""
    dtype = _ARRAY_DTYPES.get(vtype)
    if dtype is not None:
        cur.need(dtype.itemsize, what)
        value = np.frombuffer(cur.buf, dtype, 1, cur.pos)[0].item()
        cur.pos += dtype.itemsize
        return value
    if vtype == GVT.STRING:
        start = cur.pos
        n = cur.u64(f"length of {what}")
        cur.need(n, what)
        cur.pos += n
        return _decode(bytes(cur.buf[start + 8 : start + 8 + n]))
    if vtype == GVT.ARRAY:
        if depth >= GGUF_MAX_ARRAY_NESTING:
            raise cur.fail(f"arrays nested at most {GGUF_MAX_ARRAY_NESTING} deep in {what}", "deeper nesting")
        etype_at = cur.pos
        etype = cur.u32(f"element type of {what}")
        count = cur.u64(f"element count of {what}")
        edtype = _ARRAY_DTYPES.get(etype)
        if edtype is not None:
            # Fixed-size elements: one bounds check and one view (token score arrays are 150k+ long).
            cur.need(count * edtype.itemsize, f"{count} elements of {what}")
            values = np.frombuffer(cur.buf, edtype, count, cur.pos).tolist()
            cur.pos += count * edtype.itemsize
            return values
        if etype in (GVT.STRING, GVT.ARRAY):
            # Every element takes at least 8 bytes, so an absurd count fails here and not after a long loop.
            cur.need(count * 8, f"{count} elements of {what}")
            if etype == GVT.STRING:
                return _read_strings(cur, count, what)
            return [_read_gguf_value(cur, etype, f"element {i} of {what}", depth + 1) for i in range(count)]
        raise cur.fail(f"an element type id ({_VALUE_TYPES}) for {what}", str(etype), offset=etype_at)
    raise cur.fail(f"a value type id ({_VALUE_TYPES}) for {what}", str(vtype), offset=cur.pos - 4)


@dataclass
class _GGUFTensorInfo:
    name: str
    qtype: int
    ne: tuple[int, ...]
    offset: int  # relative to the data section
    nbytes: int
    info_at: int  # where its tensor-info record starts, for messages


def _read_gguf_header(path: Path, buf: mmap.mmap | bytes) -> tuple[dict[str, Any], list[_GGUFTensorInfo], int]:
    """Walk the GGUF header the way ggml does, failing on the first thing that does not add up; returns the
    metadata, the tensor infos and where the data section starts.

    Read here rather than by gguf.GGUFReader, for two reasons: it trusts the file (a string length past the
    end gives a silently short view, a bad type id a bare ValueError, a truncated tensor a reshape error),
    and it makes a NumPy view per string, ~20 s for a Qwen3.6 vocabulary's 500k tokens and merges, where
    this walk takes well under a second. gguf-py stays the reference: tests compare both readings.
    """
    cur = _Cursor(path, buf)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise cur.fail("magic 'GGUF'", repr(magic), offset=0)
    cur.pos = 4
    version = cur.u32("GGUF version")
    if version not in GGUF_VERSIONS:
        if version & 0xFFFF == 0:
            found = f"version field {version:#010x}, i.e. a big-endian GGUF (not supported)"
        else:
            found = f"version {version}"
        raise cur.fail("GGUF version 2 or 3 (little-endian)", found, offset=4)
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata key/value count")
    # Smallest possible records: a KV is 8 (key length) + 4 (type) + 1 (u8 value) bytes, a tensor info
    # 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset) bytes.
    left = cur.size - cur.pos
    if n_kv * 13 + n_tensors * 32 > left:
        raise cur.fail(
            "tensor and key/value counts that fit in the file",
            f"{n_tensors} tensors and {n_kv} key/value pairs, more than the {left} bytes left can hold"
            " (truncated or corrupt?)",
            offset=8,
        )

    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        kv_at = cur.pos
        key = cur.text(f"key of metadata pair #{i}")
        if key in metadata:
            raise cur.fail(f"unique metadata keys (pair #{i})", f"'{key}' a second time", offset=kv_at)
        vtype_at = cur.pos
        vtype = cur.u32(f"value type of '{key}'")
        value_at = cur.pos
        metadata[key] = _read_gguf_value(cur, vtype, f"value of '{key}'")
        if key == gguf.Keys.General.ALIGNMENT:
            if vtype != GVT.UINT32:
                raise cur.fail("general.alignment of type UINT32", f"type id {vtype}", offset=vtype_at)
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail("general.alignment to be a power of two", str(alignment), offset=value_at)

    infos: list[_GGUFTensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        info_at = cur.pos
        name = cur.text(f"name of tensor #{i}")
        label = f"tensor '{name}'"
        if name in names:
            raise cur.fail("unique tensor names", f"{label} a second time", offset=info_at)
        names.add(name)
        n_dims = cur.u32(f"dimension count of {label}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise cur.fail(
                f"1 to {GGML_MAX_DIMS} dimensions for {label}", f"n_dims = {n_dims}", offset=cur.pos - 4
            )
        ne = tuple(cur.u64(f"dimension {d} of {label}") for d in range(n_dims))
        type_at = cur.pos
        qtype = cur.u32(f"ggml type of {label}")
        if qtype not in _GGML_TYPE_IDS:
            raise cur.fail(f"a known ggml type id for {label}", f"type id {qtype}", offset=type_at)
        offset_at = cur.pos
        offset = cur.u64(f"data offset of {label}")
        block, type_size = gguf.GGML_QUANT_SIZES[Q(qtype)]
        if ne[0] % block:
            raise cur.fail(
                f"{label} rows (ne0) to be a multiple of the {Q(qtype).name} block size {block}",
                f"ne0 = {ne[0]}",
                offset=info_at,
            )
        if offset % alignment:
            raise cur.fail(
                f"{label} data offset aligned to {alignment} bytes", f"offset {offset}", offset=offset_at
            )
        nbytes = math.prod(ne) // block * type_size
        infos.append(_GGUFTensorInfo(name, qtype, ne, offset, nbytes, info_at))

    data_start = -(-cur.pos // alignment) * alignment
    # Check in storage order so a chopped file names the first tensor it cuts into.
    for info in sorted(infos, key=lambda t: t.offset):
        start = data_start + info.offset
        end = start + info.nbytes
        if end > cur.size:
            have = max(0, cur.size - start)
            raise cur.fail(
                f"tensor '{info.name}' data of {info.nbytes} bytes"
                f" ({Q(info.qtype).name}, shape {info.ne[::-1]})",
                f"only {have} bytes before the end of the file at byte {cur.size} (truncated?)",
                offset=start,
            )
    return metadata, infos, data_start


def _open_gguf(path: Path) -> ModelFile:
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            metadata, infos, data_start = _read_gguf_header(path, buf)
        # one read-only mapping of the whole file; every tensor is a zero-copy view of it
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise ModelFormatError(path, "a readable GGUF file", f"an I/O error ({e.strerror or e})") from e
    tensors: dict[str, RawTensor] = {}
    for info in infos:
        shape = tuple(int(d) for d in reversed(info.ne))
        start = data_start + info.offset
        view = mm[start : start + info.nbytes]
        dtype = _TENSOR_DTYPES.get(info.qtype)
        if dtype is not None:       # plain element types: an array of the tensor's shape
            data = view.view(dtype).reshape(shape)
        else:                       # quantized: rows of blocks, as bytes
            block, type_size = gguf.GGML_QUANT_SIZES[Q(info.qtype)]
            data = view.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors[info.name] = RawTensor(info.name, info.qtype, shape, data, str(path))
    metadata = {k: v for k, v in metadata.items() if not k.startswith("GGUF.")}
    return ModelFile(str(path), KIND_GGUF, metadata, tensors)


# element types stored as plain arrays (gguf-py's reading of them too); everything else is blocks of bytes
_TENSOR_DTYPES: dict[int, np.dtype] = {
    Q.F32: np.dtype("<f4"),
    Q.F16: np.dtype("<f2"),
    Q.F64: np.dtype("<f8"),
    Q.I8: np.dtype("i1"),
    Q.I16: np.dtype("<i2"),
    Q.I32: np.dtype("<i4"),
    Q.I64: np.dtype("<i8"),
}


# --------------------------------------------------------------------------------------------------
# safetensors

# safetensors dtype -> (numpy storage dtype, ggml type id). BF16 is kept as its raw uint16 bits.
_ST_DTYPES: dict[str, tuple[np.dtype, Q]] = {
    "F32": (np.dtype("<f4"), Q.F32),
    "F16": (np.dtype("<f2"), Q.F16),
    "BF16": (np.dtype("<u2"), Q.BF16),
    "F64": (np.dtype("<f8"), Q.F64),
    "I8": (np.dtype("i1"), Q.I8),
    "I16": (np.dtype("<i2"), Q.I16),
    "I32": (np.dtype("<i4"), Q.I32),
    "I64": (np.dtype("<i8"), Q.I64),
}


def _safetensors_header(path: Path, size: int, head: bytes) -> tuple[dict[str, Any], int]:
    """Parse and check the JSON header; returns it and where the data section starts."""
    if size < 8:
        raise ModelFormatError(path, "an 8-byte safetensors header length", f"a {size}-byte file", offset=0)
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > SAFETENSORS_MAX_HEADER:
        raise ModelFormatError(
            path, "a safetensors header length under 100 MB", f"{n} bytes (corrupt?)", offset=0
        )
    if 8 + n > size:
        raise ModelFormatError(
            path,
            f"a JSON header of {n} bytes",
            f"only {size - 8} bytes after the length field (truncated?)",
            offset=8,
        )
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelFormatError(
            path, "a UTF-8 JSON header", "bytes that are not UTF-8", offset=8 + e.start
        ) from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, "a JSON header", f"invalid JSON ({e.msg})", offset=8 + e.pos) from e
    if not isinstance(header, dict):
        raise ModelFormatError(path, "a JSON object as header", type(header).__name__, offset=8)
    return header, 8 + n


def _read_safetensors(path: Path) -> dict[str, RawTensor]:
    head, size = _read_head(path)
    header, data_start = _safetensors_header(path, size, head)

    specs: list[tuple[str, np.dtype, Q, tuple[int, ...], int, int]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        label = f"tensor '{name}'"
        if not isinstance(entry, dict):
            raise ModelFormatError(path, f"{label} header entry to be an object", repr(entry)[:60], offset=8)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ModelFormatError(path, f"{label} shape as a list of sizes", repr(shape), offset=8)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelFormatError(path, f"{label} data_offsets [begin, end]", repr(offsets), offset=8)
        if not isinstance(dtype, str):
            raise ModelFormatError(path, f"{label} dtype as a string", repr(dtype), offset=8)
        if dtype not in _ST_DTYPES:
            raise UnsupportedModelError(
                f"{path}: tensor '{name}' has dtype {dtype!r}; supported: {', '.join(_ST_DTYPES)}"
            )
        np_dtype, qtype = _ST_DTYPES[dtype]
        want = math.prod(shape) * np_dtype.itemsize
        begin, end = offsets
        if end - begin != want:
            raise ModelFormatError(
                path,
                f"{want} bytes for {label} ({dtype} {shape})",
                f"data_offsets spanning {end - begin}",
                offset=8,
            )
        if data_start + end > size:
            raise ModelFormatError(
                path,
                f"{label} data in bytes [{data_start + begin}, {data_start + end})",
                f"the file ends at byte {size} (truncated?)",
                offset=data_start + begin,
            )
        specs.append((name, np_dtype, qtype, tuple(shape), begin, end))

    # Let the reference implementation judge what we do not check (overlaps, gaps, trailing bytes).
    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except SafetensorError as e:
        raise ModelFormatError(path, "a valid safetensors file", f"safetensors rejected it: {e}") from e

    # One read-only map per file; tensors are views into it, so nothing is read before it is used.
    # (safe_open().get_tensor would copy every tensor and cannot produce BF16 in numpy at all.)
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if specs else np.zeros(0, np.uint8)
    tensors: dict[str, RawTensor] = {}
    for name, np_dtype, qtype, shape, begin, end in specs:
        data = mapped[data_start + begin : data_start + end].view(np_dtype).reshape(shape)
        tensors[name] = RawTensor(name, int(qtype), shape, data, str(path))
    return tensors


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        config = json.loads(text)
    except UnicodeDecodeError as e:
        raise ModelFormatError(path, "UTF-8 JSON", "bytes that are not UTF-8", offset=e.start) from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(path, "a JSON object", f"invalid JSON ({e.msg})", offset=e.pos) from e
    except OSError as e:
        raise ModelFormatError(path, "a readable config.json", f"an I/O error ({e.strerror or e})") from e
    if not isinstance(config, dict):
        raise ModelFormatError(path, "a JSON object", type(config).__name__, offset=0)
    return config


def _open_safetensors_folder(folder: Path, files: list[Path]) -> ModelFile:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    weight_map: dict[str, str] | None = None
    if indexes:
        index_path = indexes[0]
        index = _read_config(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelFormatError(
                index_path, "a 'weight_map' object of tensor name -> shard file", repr(weight_map)[:80]
            )
        files = sorted({folder / shard for shard in weight_map.values()})
        for shard in files:
            if not shard.is_file():
                raise ModelFormatError(index_path, f"shard '{shard.name}' beside the index", "no such file")

    tensors: dict[str, RawTensor] = {}
    for shard in files:
        if (kind := _sniff(shard)) != KIND_SAFETENSORS:
            raise ModelFormatError(shard, "a safetensors shard", f"a {kind.upper()} file", offset=0)
        for name, tensor in _read_safetensors(shard).items():
            if weight_map is not None and weight_map.get(name) != shard.name:
                continue  # the index says another shard owns it (or it is not part of the model)
            if name in tensors:
                raise ModelFormatError(
                    shard, f"tensor '{name}' in one shard only", f"it also in {tensors[name].source}"
                )
            tensors[name] = tensor
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            shard = folder / weight_map[missing[0]]
            raise ModelFormatError(
                shard,
                f"tensor '{missing[0]}' (listed in {indexes[0].name})",
                f"it missing ({len(missing)} missing)",
            )
    return ModelFile(str(folder), KIND_SAFETENSORS, _read_config(folder / "config.json"), tensors)
