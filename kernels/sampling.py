"""GPU per-row argmax and top-k log-probabilities over the vocabulary (kernels/sampling.cu).

NumPy twins: `np.argmax(logits, axis=-1)` (greedy; lowest id on ties, as services/engine/sampling.py) and
services.engine.ddtree.topk_logprobs (the k best ids and their log-softmax at a temperature, best first,
lower id on ties), which DDTree builds its tree from:

    idx, val = argmax(logits)                 # logits cupy [rows, V] f32/f16/bf16 -> int32 [rows], f32 [rows]
    ids, logp = topk_logprobs(logits, k=8)    # int32 [rows, k], f32 [rows, k]

Each is two launches (per-chunk records, then a per-row merge), with no atomics and no host sync: pass
`workspace=` buffers (make_*_workspace) to reuse them, e.g. inside a captured CUDA graph.
Precision: argmax is exact on the stored values; log-probabilities are f32 (max, sum of exp) against the
f64 twin: absolute error ~1e-5 for a 248320-token vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import loader
from .norm_rope import as_device, type_code

SOURCE = "sampling.cu"
THREADS = 256  # sss::THREADS
MAX_K = 8
MIN_CHUNK = 1024  # values per block at least

_sm_count: dict[int, int] = {}


def _sms() -> int:
    cupy = loader.require()
    dev = int(cupy.cuda.runtime.getDevice())
    if dev not in _sm_count:
        _sm_count[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _sm_count[dev]


def _rows(logits: Any) -> tuple[Any, int, int, int]:
    cupy = loader.require()
    x = as_device(logits)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"logits must be [rows, vocab], not shape {tuple(x.shape)}")
    item = x.dtype.itemsize
    if x.strides[1] != item or x.strides[0] % item:
        x = cupy.ascontiguousarray(x)
    rows, n = (int(s) for s in x.shape)
    if n >= 2**31:
        raise ValueError(f"vocabulary of {n} entries is too large")
    return x, rows, n, x.strides[0] // item


def chunks_for(rows: int, n: int) -> int:
    """Blocks per row: about four per SM in all, each over >= MIN_CHUNK values."""
    return max(1, min(math.ceil(4 * _sms() / rows), math.ceil(n / MIN_CHUNK)))


def make_argmax_workspace(rows: int, chunks: int) -> Any:
    cupy = loader.require()
    return cupy.empty((rows, chunks), dtype=cupy.uint64)


def argmax(logits: Any, *, chunks: int | None = None, workspace: Any = None, out: tuple[Any, Any] | None = None):
    """(int32 [rows] index of each row's maximum (lowest on ties), f32 [rows] that maximum). NaN counts as
    the maximum, like np.argmax."""
    cupy = loader.require()
    x, rows, n, ld = _rows(logits)
    nch = chunks or chunks_for(rows, n)
    chunk = math.ceil(n / nch)
    nch = math.ceil(n / chunk)
    part = workspace if workspace is not None else make_argmax_workspace(rows, nch)
    if part.dtype != cupy.uint64 or part.size < rows * nch:
        raise ValueError(f"workspace must be uint64 with >= {rows * nch} elements")
    idx, val = out if out is not None else (cupy.empty(rows, cupy.int32), cupy.empty(rows, cupy.float32))
    ti = type_code(x)
    loader.get_function(SOURCE, f"argmax_partial_kernel<{ti}>")(
        (nch, rows), (THREADS,), (x, np.int64(ld), np.int32(n), np.int32(chunk), part)
    )
    loader.get_function(SOURCE, "argmax_final_kernel")(
        ((rows + 3) // 4,), (128,), (part, np.int32(nch), np.int32(rows), idx, val)
    )
    return idx, val


def make_topk_workspace(rows: int, chunks: int, k: int) -> tuple[Any, Any, Any]:
    cupy = loader.require()
    return (cupy.empty((rows, chunks, 2), cupy.float32), cupy.empty((rows, chunks, k), cupy.float32),
            cupy.empty((rows, chunks, k), cupy.int32))  # fmt: skip


def topk_logprobs(
    logits: Any,
    k: int,
    temperature: float = 1.0,
    *,
    chunks: int | None = None,
    workspace: tuple[Any, Any, Any] | None = None,
    out: tuple[Any, Any] | None = None,
):
    """(int32 [rows, k] ids, f32 [rows, k] log-probabilities) of each row's k best tokens at `temperature`,
    best first, lower id on ties; k <= 8 and <= the vocabulary."""
    cupy = loader.require()
    x, rows, n, ld = _rows(logits)
    k = int(k)
    if not 1 <= k <= min(MAX_K, n):
        raise ValueError(f"k must be in 1..{min(MAX_K, n)}, not {k}")
    if not (temperature > 0 or temperature == 0):
        raise ValueError(f"temperature must be a number >= 0, not {temperature}")
    inv_temp = 1.0 / max(float(temperature), 1e-6)  # the twin's max(temperature, 1e-6)
    nch = chunks or chunks_for(rows, n)
    chunk = math.ceil(n / nch)
    nch = math.ceil(n / chunk)
    ms, pv, pi = workspace if workspace is not None else make_topk_workspace(rows, nch, k)
    if ms.size < rows * nch * 2 or pv.size < rows * nch * k or pi.size < rows * nch * k:
        raise ValueError("workspace too small (make_topk_workspace(rows, chunks, k))")
    ids, logp = out if out is not None else (cupy.empty((rows, k), cupy.int32), cupy.empty((rows, k), cupy.float32))
    ti = type_code(x)
    loader.get_function(SOURCE, f"topk_partial_kernel<{ti}, {k}>")(
        (nch, rows), (THREADS,), (x, np.int64(ld), np.int32(n), np.int32(chunk), np.float32(inv_temp), ms, pv, pi)
    )
    loader.get_function(SOURCE, f"topk_final_kernel<{k}>")((rows,), (THREADS,), (ms, pv, pi, np.int32(nch), logp, ids))
    return ids, logp
