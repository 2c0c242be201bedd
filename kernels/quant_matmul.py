"""GPU matrix products on GGUF-packed weights: `QuantMatrix(W).matmul(x) == x @ dequantize(W).T`.

The weights go to the GPU once, in their GGUF block layout, and are never expanded to full precision in
memory: kernels/quant_matmul.cu dequantizes each block in registers and multiplies it with every token of
x (up to 64 tokens per kernel launch, e.g. a speculative verify tree), so one call reads each weight byte
once whatever the width. NumPy twin: services.engine.quants.dequantize.

    W = QuantMatrix.from_raw(model_file.require("blk.0.ffn_up.weight"))   # or QuantMatrix(qtype, bytes, shape)
    y = W.matmul(x)            # x: cupy [T, in] float16 (or float32) -> y: cupy [T, out] float32

Supported storage types: F16, Q8_0, Q4_K, Q6_K (what a Qwen3.6 Q4_K_M file holds in its matrices).
Activations: fp16 is the native input; float32 input is rounded to fp16 by the packing kernel. Products
accumulate in fp32 on the tensor cores (mma.sync m16n8k16), and the weights are dequantized to fp16 on the
way (so results carry fp16 rounding of x and of each dequantized weight: relative error ~3e-4).

Several matrices that read the same x (q/k/v, gate/up) can share one `pack_activations(x)` result.
With `splits > 1` (chosen automatically when there are few output rows, e.g. ffn_down) the K dimension is
split across thread blocks that add into y with fp32 atomics: results can then differ in the last bits
between runs when splits > 2. Pass `splits=1` for bitwise-reproducible output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import loader

SOURCE = "quant_matmul.cu"

# ggml type ids (gguf.GGMLQuantizationType values)
F16 = 1
Q8_0 = 8
Q4_K = 12
Q6_K = 14

# qtype -> (name, values per block, bytes per block, shared-memory bytes per row slot)
_TYPES: dict[int, tuple[str, int, int, int]] = {
    F16: ("F16", 1, 2, 528),
    Q8_0: ("Q8_0", 32, 34, 304),
    Q4_K: ("Q4_K", 256, 144, 144),
    Q6_K: ("Q6_K", 256, 210, 240),
}
SUPPORTED_QTYPES = frozenset(_TYPES)

WARPS = 4  # warps per thread block (kernel constant ss::WARPS)
ROWS_PER_WARP = 32  # ss::ROWS_PER_WARP
ROWS_PER_BLOCK = WARPS * ROWS_PER_WARP
STAGES = 2  # ss::STAGES
CHUNK = 256  # ss::CHUNK
THREADS = 32 * WARPS
MAX_TOKENS = 64  # tokens per kernel launch; matmul() loops over wider inputs
PAD_BYTES = 1024  # readable slack after the last weight row (the kernel's 16-byte copies overrun by < 512)

_smem_configured: set[tuple] = set()
_sm_count: dict[int, int] = {}


def type_name(qtype: int) -> str:
    entry = _TYPES.get(int(qtype))
    return entry[0] if entry else f"type id {int(qtype)}"


def smem_bytes(qtype: int) -> int:
    """Dynamic shared memory one thread block of the kernel for `qtype` uses."""
    return WARPS * STAGES * ROWS_PER_WARP * _TYPES[int(qtype)][3]


def _defines(portable: bool) -> tuple[str, ...]:
    return ("SPECSPLIT_PORTABLE",) if portable else ()


def qmm_function(qtype: int, n_tiles: int, portable: bool = False) -> Any:
    """The compiled kernel for one storage type and one token-tile count (1..8 tiles of 8 tokens)."""
    qtype = int(qtype)
    if qtype not in _TYPES:
        raise ValueError(f"no GPU matmul kernel for {type_name(qtype)}")
    if not 1 <= n_tiles <= MAX_TOKENS // 8:
        raise ValueError(f"n_tiles must be 1..{MAX_TOKENS // 8}, not {n_tiles}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"qmm_kernel<{qtype}, {n_tiles}>", defines)
    smem = smem_bytes(qtype)
    key = (qtype, n_tiles, defines, _device_id())
    if smem > 48 * 1024 and key not in _smem_configured:
        fn.max_dynamic_shared_size_bytes = smem  # opt in above the 48 KiB default
        _smem_configured.add(key)
    return fn


def pack_function(in_f32: bool, portable: bool = False) -> Any:
    return loader.get_function(SOURCE, f"pack_x_kernel<{1 if in_f32 else 0}>", _defines(portable))


def warmup(qtypes=tuple(_TYPES), n_tiles=range(1, MAX_TOKENS // 8 + 1), portable: bool = False) -> None:
    """Compile the kernels up front (each is built on first use otherwise)."""
    for q in qtypes:
        for nt in n_tiles:
            qmm_function(q, nt, portable)
    pack_function(False, portable)
    pack_function(True, portable)


def _device_id() -> int:
    cupy = loader.require()
    return int(cupy.cuda.runtime.getDevice())


def sm_count() -> int:
    dev = _device_id()
    if dev not in _sm_count:
        cupy = loader.require()
        _sm_count[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _sm_count[dev]


@dataclass(frozen=True)
class PackedX:
    """Activations re-laid out for the kernel (see pack_x_kernel): fp16, tokens padded to a multiple of 8."""

    data: Any  # cupy uint16 array of in_features * padded_tokens halves
    tokens: int
    in_features: int

    @property
    def n_tiles(self) -> int:
        return (self.tokens + 7) // 8

    @property
    def padded_tokens(self) -> int:
        return 8 * self.n_tiles


def pack_activations(x: Any, *, portable: bool = False, out: Any = None) -> PackedX:
    """x: cupy (or numpy) [T, K] or [K] float16/float32, T <= 64, K a multiple of 32 -> PackedX."""
    cupy = loader.require()
    x = cupy.asarray(x)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"activations must be [tokens, features], not shape {tuple(x.shape)}")
    if x.dtype not in (np.float16, np.float32):
        x = x.astype(np.float32)
    tokens, k = (int(s) for s in x.shape)
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"pack_activations takes 1..{MAX_TOKENS} tokens, not {tokens}")
    if k % 32:
        raise ValueError(f"in_features must be a multiple of 32, not {k}")
    item = x.dtype.itemsize
    if x.strides[1] != item or x.strides[0] % item or x.strides[0] < k * item:
        x = cupy.ascontiguousarray(x)
    ldx = x.strides[0] // item
    padded = 8 * ((tokens + 7) // 8)
    size = k * padded
    if out is None:
        out = cupy.empty(size, dtype=cupy.uint16)
    elif out.dtype != cupy.uint16 or out.size != size or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint16 array of {size} elements")
    units = (k // 8) * padded
    blocks = max(1, min((units + 255) // 256, 8192))
    kern = pack_function(x.dtype == np.float32, portable)
    kern((blocks,), (256,), (x, np.int64(ldx), np.int32(tokens), np.int32(k), np.int32(padded), out))
    return PackedX(out, tokens, k)


class QuantMatrix:
    """A weight matrix [out_features, in_features] kept on the GPU in its GGUF block layout."""

    def __init__(self, qtype: int, data: Any, shape: tuple[int, ...], *, name: str = "weight"):
        cupy = loader.require()
        qtype = int(qtype)
        if qtype not in _TYPES:
            supported = ", ".join(v[0] for v in _TYPES.values())
            raise ValueError(f"{name}: no GPU matmul for {type_name(qtype)} (supported: {supported})")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"{name}: a weight matrix must be 2-D [out, in], not shape {shape}")
        n_out, k = shape
        _, per_block, block_bytes, _ = _TYPES[qtype]
        if n_out < 1 or k < 32 or k % per_block or k % 32:
            raise ValueError(
                f"{name}: in_features {k} must be a positive multiple of {max(per_block, 32)} for {type_name(qtype)}"
            )
        self.name = name
        self.qtype = qtype
        self.shape = shape
        self.row_bytes = k // per_block * block_bytes
        self.nbytes = n_out * self.row_bytes  # weight bytes (what one call streams)

        if isinstance(data, cupy.ndarray):
            raw = cupy.ascontiguousarray(data).reshape(-1).view(cupy.uint8)
        else:
            raw = np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8)
        if raw.size != self.nbytes:
            raise ValueError(
                f"{name}: {type_name(qtype)} data for shape {shape} must be {self.nbytes} bytes, found {raw.size}"
            )
        buf = cupy.empty(self.nbytes + PAD_BYTES, dtype=cupy.uint8)
        buf[self.nbytes :] = 0
        if isinstance(raw, cupy.ndarray):
            buf[: self.nbytes] = raw
        else:
            buf[: self.nbytes].set(raw)
        if buf.data.ptr % 16:
            raise RuntimeError("device allocation is not 16-byte aligned")
        self._buf = buf

    @classmethod
    def from_raw(cls, tensor: Any) -> QuantMatrix:
        """From a services.engine.formats.RawTensor (qtype, shape in numpy order, raw storage)."""
        return cls(tensor.qtype, tensor.data, tensor.shape, name=getattr(tensor, "name", "weight"))

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def device_buffer(self) -> Any:
        """The packed bytes on the GPU (plus PAD_BYTES of zeros)."""
        return self._buf

    def n_chunks(self) -> int:
        return (self.in_features + CHUNK - 1) // CHUNK

    def grid_rows(self) -> int:
        return (self.out_features + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK

    def choose_splits(self, tokens: int = 1) -> int:
        """K splits so that there are about 4 thread blocks per SM, each with >= 4 chunks of K."""
        want = round(4 * sm_count() / self.grid_rows())
        if want <= 1:
            return 1
        return max(1, min(want, self.n_chunks() // 4))

    def matmul(self, x: Any, *, out: Any = None, splits: int | None = None, portable: bool = False) -> Any:
        """y = x @ W^T as a cupy float32 array [T, out] ([out] for a 1-D x).

        x: cupy/numpy [T, in] or [in] float16/float32 (any T; launches of <= 64 tokens), or a PackedX.
        out: optional contiguous float32 [T, out] to write into. splits: K splits (None: automatic).
        portable: use the kernels built without inline PTX (the HIP / fallback path), for testing.
        """
        cupy = loader.require()
        n_out, k = self.shape
        squeeze = False
        if isinstance(x, PackedX):
            if x.in_features != k:
                raise ValueError(f"{self.name}: activations have {x.in_features} features, the matrix takes {k}")
            tokens = x.tokens
        else:
            x = cupy.asarray(x)
            if x.ndim == 1:
                squeeze = True
                x = x.reshape(1, -1)
            if x.ndim != 2 or int(x.shape[1]) != k:
                raise ValueError(f"{self.name}: activations of shape {tuple(x.shape)} do not fit in_features {k}")
            tokens = int(x.shape[0])
        if tokens < 1:
            raise ValueError(f"{self.name}: no tokens to multiply")
        if out is None:
            out = cupy.empty((tokens, n_out), dtype=cupy.float32)
        elif out.dtype != cupy.float32 or tuple(out.shape) != (tokens, n_out) or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out must be a contiguous float32 array of shape {(tokens, n_out)}")

        if isinstance(x, PackedX):
            self._launch(x, out, splits, portable)
        else:
            for start in range(0, tokens, MAX_TOKENS):
                stop = min(tokens, start + MAX_TOKENS)
                packed = pack_activations(x[start:stop], portable=portable)
                self._launch(packed, out[start:stop], splits, portable)
        return out.reshape(n_out) if squeeze else out

    def _launch(self, packed: PackedX, out: Any, splits: int | None, portable: bool) -> None:
        cupy = loader.require()
        n_out, k = self.shape
        s = self.choose_splits(packed.tokens) if splits is None else int(splits)
        s = max(1, min(s, self.n_chunks()))
        kern = qmm_function(self.qtype, packed.n_tiles, portable)
        if s > 1:  # the splits add into y with atomics
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memsetAsync(out.data.ptr, 0, out.nbytes, stream.ptr)
        kern(
            (self.grid_rows(), s),
            (THREADS,),
            (
                self._buf,
                np.int64(self.row_bytes),
                np.int32(n_out),
                np.int32(k),
                packed.data,
                np.int32(packed.tokens),
                out,
            ),
            shared_mem=smem_bytes(self.qtype),
        )

    def __repr__(self) -> str:
        return f"QuantMatrix({self.name!r}, {self.type_name}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB)"


def flops(tokens: int, shape: tuple[int, int]) -> int:
    return 2 * tokens * shape[0] * shape[1]


def bytes_per_weight(qtype: int) -> float:
    _, per_block, block_bytes, _ = _TYPES[int(qtype)]
    return block_bytes / per_block
