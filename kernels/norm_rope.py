"""GPU row norms, q/k head norm + partial NeoX RoPE and the SiLU / sigmoid gates (kernels/norm_rope.cu).

NumPy twins: services.engine.layers rms_norm, rope_neox, silu, sigmoid, composed as models/qwen35.py does:

    y, s = rms_norm(x, w, eps, residual=r)        # y = rms_norm(x + r) * w, s = x + r (the new residual)
    qn, kn = qk_norm_rope(q, k, q_w, k_w, pos, n_rot, theta, eps)   # per-head norm, then RoPE at pos[t]
    h = silu_mul(g, u)                            # silu(g) * u (SwiGLU between ffn_gate/up and ffn_down)
    o = gate_mul(x, gate)                         # x * sigmoid(gate) (Qwen3.5 attention output gate)
    o = norm_gate(o, z, w, eps)                   # rms_norm(o) * w * silu(z) per head (DeltaNet output)

Arrays are CuPy (NumPy is uploaded). Element types: float32, float16, and bfloat16 as raw bits in a uint16
array (or an ml_dtypes bfloat16 array); arithmetic is f32. `q`/`k`/`gate` may be strided views, e.g. the q
half of the interleaved q|gate projection, `qg.reshape(T, H, 2 * D)[..., :D]`, read in place. Positions
live in a device int32 array, so a captured CUDA graph replays with new positions written into it.
Results: the input type unless `out_dtype` says otherwise. Errors vs the f64 twin: ~1e-6 relative with f32
in and out; one rounding of the output type (f16: 5e-4, bf16: 4e-3) otherwise.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from . import loader

SOURCE = "norm_rope.cu"
NORM_THREADS = 256  # rms_norm_kernel block (ssn::NORM_THREADS)
HEAD_WARPS = 4  # head_norm_kernel rows per block (ssn::HEAD_WARPS)
# Programmatic dependent launch (kernels/pdl.cuh, loader.get_function's pdl; SPECSPLIT_PDL) for an attention layer's
# chain in steps of up to PDL_UP_TO tokens: qk_norm_rope here, then kernels/attention.py's KV store and combine (the
# partial attention: attention.PARTIAL_PDL). Each waits for its inputs first thing, so inside a captured step it
# starts as the kernel before it drains. H100, 27B Q4_K_M step replays (bench/gemv_ab.py --step-ab attnpdl): 0.9964 /
# 0.9963 of the chain without PDL at widths 1 / 2.
PDL = True
PDL_UP_TO = 2
MAX_HEAD_DIM = 256
BF16 = "bfloat16"
NULL = np.uint64(0)  # a null pointer kernel argument


def type_code(a: Any) -> int:
    """Kernel element type of an array: 0 f32, 1 f16, 2 bf16 (uint16 raw bits or an ml_dtypes bfloat16)."""
    dt = np.dtype(a.dtype)
    if dt == np.float32:
        return 0
    if dt == np.float16:
        return 1
    if dt == np.uint16 or dt.name == BF16:
        return 2
    raise ValueError(f"unsupported element type {dt} (float32, float16, or bfloat16 bits in uint16)")


def out_code(out_dtype: Any, default: int) -> tuple[int, Any]:
    """(kernel type code, cupy dtype to allocate) for an output type (None: same code as `default`)."""
    code = default if out_dtype is None else (2 if out_dtype in (BF16, "bf16") else type_code(np.empty(0, out_dtype)))
    return code, (np.float32, np.float16, np.uint16)[code]


def as_device(a: Any) -> Any:
    """cupy array (uploaded when NumPy); ml_dtypes bfloat16 arrives as its uint16 bits."""
    cupy = loader.require()
    if isinstance(a, np.ndarray) and a.dtype.name == BF16:
        a = a.view(np.uint16)
    return cupy.asarray(a)


def _contig(a: Any) -> Any:
    cupy = loader.require()
    return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)


def _weight(w: Any, n: int, name: str) -> Any:
    cupy = loader.require()
    if w is None:
        return NULL
    w = cupy.asarray(w, dtype=cupy.float32).reshape(-1)
    if w.size != n:
        raise ValueError(f"{name} has {w.size} values, expected {n}")
    return _contig(w)


def _blocks(total: int, threads: int = 256) -> int:
    return max(1, min((total + threads - 1) // threads, 65535))


def rms_norm(
    x: Any, w: Any, eps: float, *, residual: Any = None, out_dtype: Any = None, out: Any = None, sum_out: Any = None
) -> Any:
    """rms_norm(x [+ residual]) * w over the last axis. With `residual`: returns (y, s) where s = x + residual
    (same type as x); without: y. x: [..., n]; w: [n] (None: no weight)."""
    cupy = loader.require()
    x = _contig(as_device(x))
    n = int(x.shape[-1])
    rows = int(x.size // n) if n else 0
    if n < 1 or rows < 1:
        raise ValueError(f"rms_norm needs a non-empty [..., n] input, not shape {tuple(x.shape)}")
    ti = type_code(x)
    w = _weight(w, n, "norm weight")
    to, odt = out_code(out_dtype, ti)
    if out is None:
        out = cupy.empty(x.shape, dtype=odt)
    elif out.dtype != odt or out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous {np.dtype(odt)} array of shape {tuple(x.shape)}")
    res = residual is not None
    if res:
        residual = _contig(as_device(residual))
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {residual.dtype}{tuple(residual.shape)} must match x {x.dtype}{tuple(x.shape)}")
        if sum_out is None:
            sum_out = cupy.empty_like(x)
        elif sum_out.shape != x.shape or sum_out.dtype != x.dtype or not sum_out.flags.c_contiguous:
            raise ValueError("sum_out must be a contiguous array like x")
    kern = loader.get_function(SOURCE, f"rms_norm_kernel<{ti}, {to}, {int(res)}>")
    kern(
        (rows,),
        (NORM_THREADS,),
        (x, residual if res else x, sum_out if res else x, w, out, np.int32(n), np.float32(eps)),
    )
    return (out, sum_out) if res else out


@lru_cache(maxsize=64)
def _inv_freq_host(n_rot: int, theta: float) -> np.ndarray:
    # the exact float32 expression of services.engine.layers.rope_neox, so angles match bit for bit
    return (1.0 / (theta ** (np.arange(0, n_rot, 2, dtype=np.float32) / n_rot))).astype(np.float32)


_inv_freq_dev: dict[tuple, Any] = {}


def rope_inv_freq(n_rot: int, theta: float) -> Any:
    """Device float32 [n_rot / 2] inverse frequencies (cached per device)."""
    cupy = loader.require()
    key = (int(n_rot), float(theta), int(cupy.cuda.runtime.getDevice()))
    if key not in _inv_freq_dev:
        _inv_freq_dev[key] = cupy.asarray(_inv_freq_host(int(n_rot), float(theta)))
    return _inv_freq_dev[key]


def _head_view(x: Any, name: str) -> tuple[Any, int, int, int, int, int]:
    """(x, T, H, D, token stride, head stride) of a [T, H, D] array whose last axis is contiguous."""
    x = as_device(x)
    if x.ndim != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], not shape {tuple(x.shape)}")
    T, H, D = (int(s) for s in x.shape)
    item = x.dtype.itemsize
    if D % 32 or not 32 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {D} must be a multiple of 32 in 32..{MAX_HEAD_DIM}")
    if x.strides[2] != item or x.strides[0] % item or x.strides[1] % item:
        x = _contig(x)
    return x, T, H, D, x.strides[0] // item, x.strides[1] // item


def _positions(positions: Any, T: int) -> Any:
    cupy = loader.require()
    pos = cupy.asarray(positions)
    if pos.dtype != cupy.int32:
        pos = pos.astype(cupy.int32)
    if pos.shape != (T,):
        raise ValueError(f"positions must have shape ({T},), not {tuple(pos.shape)}")
    return _contig(pos)


def qk_norm_rope(
    q: Any,
    k: Any,
    q_w: Any,
    k_w: Any,
    positions: Any,
    n_rot: int,
    theta: float,
    eps: float,
    *,
    out_dtype: Any = None,
    q_out: Any = None,
    k_out: Any = None,
    portable: bool = False,
) -> tuple[Any, Any]:
    """rope_neox(rms_norm(q, q_w), pos) and the same for k, in one launch. q: [T, H, D], k: [T, Hkv, D]
    (strided views allowed); pos: int32 [T] (device buffer for graphs). k=None: q only (returns (q', None)).
    portable: the build without inline PTX (the HIP / fallback path)."""
    q, T, H, D, q_tok, q_head = _head_view(q, "q")
    tq = type_code(q)
    if k is not None:
        k, Tk, Hk, Dk, k_tok, k_head = _head_view(k, "k")
        if (Tk, Dk) != (T, D) or type_code(k) != tq:
            raise ValueError(f"k {k.dtype}{tuple(k.shape)} does not match q {q.dtype}{tuple(q.shape)}")
    else:
        Hk, k_tok, k_head = 0, 0, 0
    if not (0 <= n_rot <= D and n_rot % 2 == 0):
        raise ValueError(f"n_rot {n_rot} must be even and <= head_dim {D}")
    pos = _positions(positions, T)
    inv = rope_inv_freq(n_rot, theta) if n_rot else None
    to, odt = out_code(out_dtype, tq)
    q_out = _out(q_out, (T, H, D), odt, "q_out")
    k_out = _out(k_out, (T, Hk, D), odt, "k_out") if k is not None else None
    kern = loader.get_function(SOURCE, f"head_norm_kernel<{tq}, {to}, {D}, 0>",
                               ("SPECSPLIT_PORTABLE",) if portable else (), pdl=PDL and T <= PDL_UP_TO and not portable)
    rows = T * (H + Hk)
    kern(
        ((rows + HEAD_WARPS - 1) // HEAD_WARPS,),
        (32 * HEAD_WARPS,),
        (
            q, np.int64(q_tok), np.int64(q_head), np.int32(H), _weight(q_w, D, "q norm weight"), q_out,
            k if k is not None else q, np.int64(k_tok), np.int64(k_head), np.int32(Hk),
            _weight(k_w, D, "k norm weight") if k is not None else NULL, k_out if k is not None else q_out,
            np.int32(T), NULL, pos, inv if inv is not None else NULL, np.int32(n_rot),
            np.float32(eps),
        ),
    )  # fmt: skip
    return q_out, k_out


def _out(out: Any, shape: tuple[int, ...], dtype: Any, name: str) -> Any:
    cupy = loader.require()
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    if out.dtype != dtype or tuple(out.shape) != shape or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be a contiguous {np.dtype(dtype)} array of shape {shape}")
    return out


def norm_gate(o: Any, z: Any, w: Any, eps: float, *, out_dtype: Any = None, out: Any = None) -> Any:
    """rms_norm(o, w) * silu(z) per head (Gated DeltaNet output). o: [T, H, D] (view ok), z: like o."""
    o, T, H, D, o_tok, o_head = _head_view(o, "o")
    z = _contig(as_device(z))
    if tuple(z.shape) != (T, H, D) or z.dtype != o.dtype:
        raise ValueError(f"z {z.dtype}{tuple(z.shape)} must match o {o.dtype}{(T, H, D)}")
    ti = type_code(o)
    to, odt = out_code(out_dtype, ti)
    out = _out(out, (T, H, D), odt, "out")
    kern = loader.get_function(SOURCE, f"head_norm_kernel<{ti}, {to}, {D}, 1>")
    kern(
        ((T * H + HEAD_WARPS - 1) // HEAD_WARPS,),
        (32 * HEAD_WARPS,),
        (
            o, np.int64(o_tok), np.int64(o_head), np.int32(H), _weight(w, D, "norm weight"), out,
            o, np.int64(0), np.int64(0), np.int32(0), NULL, out,
            np.int32(T), z, NULL, NULL, np.int32(0), np.float32(eps),
        ),
    )  # fmt: skip
    return out


def silu_mul(g: Any, u: Any, *, out_dtype: Any = None, out: Any = None) -> Any:
    """silu(g) * u elementwise. g, u: [T, n] (rows may be strided, e.g. halves of one [T, 2n] array)."""
    g, u = as_device(g), as_device(u)
    if g.ndim == 1:
        g, u = g.reshape(1, -1), u.reshape(1, -1)
    if g.ndim != 2 or g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"g {g.dtype}{tuple(g.shape)} and u {u.dtype}{tuple(u.shape)} must be equal 2-D shapes")
    item = g.dtype.itemsize
    if g.strides[1] != item:
        g = _contig(g)
    if u.strides[1] != item:
        u = _contig(u)
    T, n = (int(s) for s in g.shape)
    ti = type_code(g)
    to, odt = out_code(out_dtype, ti)
    out = _out(out, (T, n), odt, "out")
    kern = loader.get_function(SOURCE, f"silu_mul_kernel<{ti}, {to}>")
    kern(
        (_blocks(T * n),),
        (256,),
        (g, np.int64(g.strides[0] // item), u, np.int64(u.strides[0] // item), out, np.int32(T), np.int32(n)),
    )
    return out


def gate_mul(x: Any, gate: Any, *, out_dtype: Any = None, out: Any = None) -> Any:
    """x * sigmoid(gate). x: [T, H, D] (made contiguous); gate: [T, H, D], may be a strided view (the gate
    half of the interleaved q|gate projection)."""
    x = _contig(as_device(x))
    if x.ndim != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], not shape {tuple(x.shape)}")
    gate = as_device(gate)
    if gate.shape != x.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} must equal x shape {tuple(x.shape)}")
    gi = gate.dtype.itemsize
    if gate.strides[2] != gi or gate.strides[0] % gi or gate.strides[1] % gi:
        gate = _contig(gate)
    T, H, D = (int(s) for s in x.shape)
    ti, tg = type_code(x), type_code(gate)
    to, odt = out_code(out_dtype, ti)
    out = _out(out, (T, H, D), odt, "out")
    kern = loader.get_function(SOURCE, f"gate_mul_kernel<{ti}, {tg}, {to}>")
    kern(
        (_blocks(T * H * D),),
        (256,),
        (x, gate, np.int64(gate.strides[0] // gi), np.int64(gate.strides[1] // gi), out, np.int32(T), np.int32(H),
         np.int32(D)),
    )  # fmt: skip
    return out
