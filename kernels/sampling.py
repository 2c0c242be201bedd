"""GPU per-row argmax and top-k log-probabilities over the vocabulary, and exact sampled draws (kernels/sampling.cu).

NumPy twins: `np.argmax(logits, axis=-1)` (greedy; lowest id on ties, as services/engine/sampling.py),
services.engine.ddtree.topk_logprobs (the k best ids and their log-softmax at a temperature, best first,
lower id on ties), which DDTree builds its tree from, and services.engine.sampling.target_distribution +
sample_from (penalties, temperature, top-k, top-p, min-p, then an inverse-CDF draw in id order) for `sample`:

    idx, val = argmax(logits)                 # logits cupy [rows, V] f32/f16/bf16 -> int32 [rows], f32 [rows]
    ids, logp = topk_logprobs(logits, k=8)    # int32 [rows, k], f32 [rows, k]
    tok_lp, ids, logp = token_logprobs(logits, tokens)   # f32 [rows], int32 / f32 [rows, 20]: OpenAI logprobs
    toks = sample(logits, rows, us, temperature=0.7, top_p=0.9, ...)   # host int64 [len(rows)]
    probs = distribution(logits, rows, temperature=0.7, top_p=0.9)     # device f64 [len(rows), V]

argmax / top-k are two launches each (per-chunk records, then a per-row merge), with no atomics and no host
sync: pass `workspace=` buffers (make_*_workspace) to reuse them, e.g. inside a captured CUDA graph.
Precision: argmax is exact on the stored values; log-probabilities are f32 (max, sum of exp) against the
f64 twin: absolute error ~1e-5 for a 248320-token vocabulary.

`sample` draws one token for each of the given rows with the uniform us[i] (one `rng.random()` of the request,
drawn on the host as sample_from does), in 3 launches plus 3 per active cut (top-k, top-p), one upload of the
uniforms and penalty windows and one copy of the tokens back: no vocabulary-sized transfer. Kept sets are
exactly the twin's (ties at each cut to the lower ids) but where a top-p cut is within float64 rounding of
top_p; kernels/sampling.cu (the `sxs` section) has the design and the precision.
"""

from __future__ import annotations

import math
import threading
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


def argmax(logits: Any, *, chunks: int | None = None, workspace: Any = None, out: tuple[Any, Any] | None = None,
           feed: tuple[Any, Any, Any, Any] | None = None):
    """(int32 [rows] index of each row's maximum (lowest on ties), f32 [rows] that maximum). NaN counts as
    the maximum, like np.argmax. feed = (tokens, positions, s_len, swap), int32 device arrays of a one-token chain
    step's values (swap may be None): the same launch writes the next such step's there: tokens[0] = the last row's
    argmax, s_len[0] += 1, positions[0] = the new s_len[0], swap[0] ^= 1 (twin: advance_twin)."""
    cupy = loader.require()
    x, rows, n, ld = _rows(logits)
    nxt = (_NULL,) * 4
    if feed is not None:
        for a in feed[:3] + ((feed[3],) if feed[3] is not None else ()):
            if not (isinstance(a, cupy.ndarray) and a.dtype == cupy.int32 and a.size >= 1):
                raise ValueError("feed takes int32 device arrays (tokens, positions, s_len, swap)")
        nxt = tuple(a if a is not None else _NULL for a in feed)
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
        ((rows + 3) // 4,), (128,), (part, np.int32(nch), np.int32(rows), idx, val, *nxt)
    )
    return idx, val


def advance_twin(ids: np.ndarray, tokens: np.ndarray, positions: np.ndarray, s_len: np.ndarray,
                 swap: np.ndarray | None) -> None:
    """argmax(feed=)'s NumPy twin: a one-token chain step's values advanced to the next step's, in place."""
    s = int(s_len[0]) + 1
    tokens[0], positions[0], s_len[0] = int(ids[-1]), s, s
    if swap is not None:
        swap[0] ^= 1


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


LOGPROB_K = 20  # token_logprobs' alternatives a row: one build serves every OpenAI top_logprobs (0..20)


def token_logprobs(logits: Any, tokens: Any, *, chunks: int | None = None,
                   out: tuple[Any, Any, Any] | None = None) -> tuple[Any, Any, Any]:
    """(f32 [rows] log-probability of tokens[i] in row i, int32 [rows, LOGPROB_K] ids and f32 [rows, LOGPROB_K]
    log-probabilities of each row's best tokens, best first, lower id on ties), all at temperature 1, on the device:
    the generated tokens' OpenAI `logprobs`. logits: f32 rows; tokens: int32 device [rows]. NumPy twin:
    services.engine.logprobs.logprobs_of_row. `out`: the three arrays to write (rows of larger ones, say)."""
    cupy = loader.require()
    x, rows, n, ld = _rows(logits)
    if x.dtype != cupy.float32:
        raise ValueError(f"token_logprobs takes float32 logits, not {x.dtype}")
    k = min(LOGPROB_K, n)
    tok = cupy.ascontiguousarray(as_device(tokens).astype(cupy.int32, copy=False).reshape(-1))
    if int(tok.size) != rows:
        raise ValueError(f"{int(tok.size)} tokens for {rows} rows")
    nch = chunks or chunks_for(rows, n)
    chunk = math.ceil(n / nch)
    nch = math.ceil(n / chunk)
    ms, pv, pi = make_topk_workspace(rows, nch, k)
    if out is not None:
        tok_logp, ids, logp = out
        if tok_logp.shape != (rows,) or ids.shape != (rows, k) or logp.shape != (rows, k):
            raise ValueError(f"out must be shaped ({rows},), ({rows}, {k}), ({rows}, {k})")
    else:
        tok_logp = cupy.empty((rows,), cupy.float32)
        ids, logp = cupy.empty((rows, k), cupy.int32), cupy.empty((rows, k), cupy.float32)
    loader.get_function(SOURCE, f"topk_partial_kernel<0, {k}>")(
        (nch, rows), (THREADS,), (x, np.int64(ld), np.int32(n), np.int32(chunk), np.float32(1.0), ms, pv, pi)
    )
    loader.get_function(SOURCE, f"topk_token_final_kernel<{k}>")(
        (rows,), (THREADS,), (ms, pv, pi, np.int32(nch), logp, ids, x, np.int64(ld), tok, np.float32(1.0), tok_logp)
    )
    return tok_logp, ids, logp


# -- exact sampled draws ---------------------------------------------------------------------------------------

CHUNK = 4096          # sxs::CHUNK: values per block of a full-row pass
NB = 2048             # sxs::NB: histogram digits
RIN = 5               # sxs::RIN: ints per drawn row (logits row, penalty window as two runs of the token list)
MAX_LOGIT_BIAS = 1024  # a request's logit bias entries (the prep kernel indexes them with 16 bits)
STATE_BYTES = 128     # >= sizeof(sxs::RowState)
SELECT_LEVELS = 3     # radix digits of 11, 11 and 10 bits


def kernel_filters(temperature: float, top_k: int, top_p: float, min_p: float, n: int) -> tuple[float, int, float,
                                                                                                 float]:
    """(temperature, k, p, min_p) as the kernels take them: top-k off (0) unless 0 < top_k < n, as the twin;
    temperature <= 0 (greedy: the argmax after penalties, lowest id on ties) is top-1 at temperature 1."""
    if not temperature > 0:
        return 1.0, 1, 1.0, 0.0
    k = int(top_k) if 0 < int(top_k) < n else 0
    return float(temperature), k, float(top_p), float(min_p)


def select_passes(top_k: int, top_p: float) -> list[tuple[int, int]]:
    """The select launches as (lane, level): top-k's three levels (lane 0), then top-p's (lane 1)."""
    lanes = ([0] if top_k > 0 else []) + ([1] if top_p < 1.0 else [])
    return [(lane, level) for lane in lanes for level in range(SELECT_LEVELS)]


def draw_lane(top_k: int, top_p: float) -> int:
    """The cut the draw applies: 2 top-p's (within top-k's), 1 top-k's, 0 none."""
    return 2 if top_p < 1.0 else (1 if top_k > 0 else 0)


def penalty_windows(rows, history=None, paths=None, last_n: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(rin int32 [len(rows), RIN], tok int32): drawn row i reads logits row rows[i] and counts the window
    (history + paths[i])[-last_n:] (last_n -1: all of it, 0: none) as runs (offset, length) of tok: the shared
    history once, then every row's own path (a speculative node's tokens after the root)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    rin = np.zeros((len(rows), RIN), np.int32)
    rin[:, 0] = rows
    if last_n == 0:
        return rin, np.zeros(0, np.int32)
    h = np.asarray(history if history is not None else (), dtype=np.int64).reshape(-1)
    if last_n > 0:
        h = h[max(0, len(h) - last_n):]
    parts, off = [h], len(h)
    for i in range(len(rows)):
        p = np.asarray(paths[i] if paths is not None else (), dtype=np.int64).reshape(-1)
        drop = max(0, len(h) + len(p) - last_n) if last_n > 0 else 0
        hs = min(drop, len(h))
        ps = drop - hs
        rin[i, 1:] = (hs, len(h) - hs, off + ps, len(p) - ps)
        parts.append(p)
        off += len(p)
    # ids outside int32 can be no token id: any value that is not one is ignored by the kernel, as by the twin
    tok = np.clip(np.concatenate(parts), -1, 2**31 - 1).astype(np.int32)
    return rin, tok


class SampleWorkspace:
    """Device buffers of `sample` / `distribution` for up to `rows` draws over rows of n values. Histograms and
    counters start zeroed and every launch leaves them so; one workspace serves one stream at a time."""

    def __init__(self, rows: int, n: int):
        cp = loader.require()
        self.rows, self.n = int(rows), int(n)
        self.nch = -(-self.n // CHUNK)
        self.device = int(cp.cuda.runtime.getDevice())
        self.pm = cp.zeros((rows, 2 * self.nch), cp.uint32)
        self.state = cp.zeros((rows, STATE_BYTES), cp.uint8)
        self.hcnt = cp.zeros((rows, NB), cp.uint32)
        self.hlo = cp.zeros((rows, NB), cp.uint64)
        self.hhi = cp.zeros((rows, NB), cp.uint64)
        self.counters = cp.zeros(rows, cp.uint32)
        self.rmass = cp.zeros((rows, self.nch), cp.float64)
        self.rties = cp.zeros((rows, self.nch), cp.uint32)
        self.tokens = cp.zeros(rows, cp.int32)
        self.scratch = None                                   # penalised rows (rows, n) f32, made when needed
        self.host_tokens = _pinned(cp, rows, np.int32)
        self._host_in = self._dev_in = None
        self._uploaded = None                                  # event: the last upload has read the pinned bytes

    def fits(self, rows: int, n: int) -> bool:
        return rows <= self.rows and n == self.n

    def penalised_rows(self) -> Any:
        if self.scratch is None:
            self.scratch = loader.require().empty((self.rows, self.n), np.float32)
        return self.scratch

    def upload(self, us: np.ndarray, rin: np.ndarray, tok: np.ndarray, bias_vals: np.ndarray | None = None,
               bias_ids: np.ndarray | None = None) -> tuple[Any, ...]:
        """(us f64, rin int32, tok int32 or a null pointer, bias values f64 and ids int32 or null pointers) on the
        device, from one copy out of pinned memory."""
        cp = loader.require()
        bias_vals = np.zeros(0, np.float64) if bias_vals is None else np.asarray(bias_vals, np.float64)
        bias_ids = np.zeros(0, np.int32) if bias_ids is None else np.asarray(bias_ids, np.int32)
        r = len(us)
        o_rin = 8 * r
        o_tok = o_rin + -(-rin.nbytes // 8) * 8
        o_bv = o_tok + -(-tok.nbytes // 8) * 8
        o_bi = o_bv + bias_vals.nbytes
        total = o_bi + bias_ids.nbytes
        if self._host_in is None or self._host_in.size < total:
            size = max(4096, 2 * total)
            self._host_in, self._dev_in = _pinned(cp, size, np.uint8), cp.empty(size, cp.uint8)
            self._uploaded = None
        if self._uploaded is not None:
            self._uploaded.synchronize()
        h = self._host_in
        h[:o_rin].view(np.float64)[:] = us
        h[o_rin:o_rin + rin.nbytes].view(np.int32)[:] = rin.reshape(-1)
        h[o_tok:o_tok + tok.nbytes].view(np.int32)[:] = tok
        h[o_bv:o_bi].view(np.float64)[:] = bias_vals
        h[o_bi:total].view(np.int32)[:] = bias_ids
        stream = cp.cuda.get_current_stream()
        if isinstance(self._dev_in, np.ndarray):     # a NumPy stand-in for CuPy (the CPU simulation's tests)
            self._dev_in[:total] = h[:total]
        else:
            self._dev_in[:total].set(h[:total], stream=stream)
        self._uploaded = stream.record()
        d = self._dev_in
        tok_d = d[o_tok:o_tok + tok.nbytes].view(cp.int32) if tok.size else _NULL
        bv_d = d[o_bv:o_bi].view(cp.float64) if bias_vals.size else _NULL
        bi_d = d[o_bi:total].view(cp.int32) if bias_ids.size else _NULL
        return d[:o_rin].view(cp.float64), d[o_rin:o_rin + rin.nbytes].view(cp.int32), tok_d, bv_d, bi_d


_NULL = np.uint64(0)
_local = threading.local()
_reserved_rows = [0]   # draws a new workspace holds at least (reserve_rows)


def reserve_rows(rows: int) -> None:
    """Make every workspace, when first made, for at least `rows` draws (the verifier's planned width, set at
    start-up): a workspace then never grows while serving (memory_plan counts one of that size per slot)."""
    _reserved_rows[0] = max(_reserved_rows[0], int(rows))


def _pinned(cupy: Any, n: int, dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    return np.ndarray((int(n),), dt, buffer=cupy.cuda.alloc_pinned_memory(max(1, int(n) * dt.itemsize)))


def workspace_for(rows: int, n: int) -> SampleWorkspace:
    """This thread's workspace on the current device, grown to `rows` draws over n values when needed."""
    cp = loader.require()
    dev = int(cp.cuda.runtime.getDevice())
    cache = getattr(_local, "ws", None)
    if cache is None:
        cache = _local.ws = {}
    ws = cache.get(dev)
    if ws is None or not ws.fits(rows, n):
        keep = ws.rows if ws is not None and ws.n == n else 0
        cache[dev] = ws = None     # the old buffers go back to the pool before the new ones are taken
        ws = cache[dev] = SampleWorkspace(max(rows, keep, _reserved_rows[0]), n)
    return ws


def _float_rows(logits: Any) -> tuple[Any, int, int]:
    x, _, n, ld = _rows(logits)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
        ld = n
    return x, n, ld


def _enqueue(logits: Any, rows, us, temperature: float, top_k: int, top_p: float, min_p: float,
             repetition_penalty: float, presence_penalty: float, frequency_penalty: float, history, paths,
             last_n: int, workspace: SampleWorkspace | None, logit_bias=()):
    """Everything up to the draw's chunk choice; returns what the last launch (scan or probs) takes."""
    x, n, ld = _float_rows(logits)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size == 0:
        raise ValueError("no rows to sample")
    if rows.min() < 0 or rows.max() >= x.shape[0]:
        raise ValueError(f"rows must be in 0..{x.shape[0] - 1}")
    nr = len(rows)
    us = np.broadcast_to(np.asarray(us, dtype=np.float64), (nr,))
    ws = workspace if workspace is not None else workspace_for(nr, n)
    if not ws.fits(nr, n):
        raise ValueError(f"workspace holds {ws.rows} draws over {ws.n} values, not {nr} over {n}")
    temp, k, p, mp = kernel_filters(temperature, top_k, top_p, min_p, n)
    if not temperature > 0:
        us = np.zeros(nr)
    pen = last_n != 0 and (repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0)
    rin, tok = penalty_windows(rows, history, paths, last_n if pen else 0)
    bias = [(int(i), float(v)) for i, v in logit_bias if 0 <= int(i) < n]
    if len(bias) > MAX_LOGIT_BIAS or len({i for i, _ in bias}) != len(bias):
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} distinct token ids")
    us_d, rin_d, tok_d, bv_d, bi_d = ws.upload(us, rin, tok, np.array([v for _, v in bias], np.float64),
                                               np.array([i for i, _ in bias], np.int32))
    nch = ws.nch
    pen = pen or bool(bias)     # the bias is applied where the penalties are: into the workspace's rows
    if pen:
        z, ldz, zsel = ws.penalised_rows(), n, 0
    else:
        z, ldz, zsel = x, ld, 1
    f = loader.get_function
    f(SOURCE, "sample_prep_kernel")(
        (nch, nr), (THREADS,),
        (x, np.int64(ld), rin_d, np.int32(n), tok_d, np.float64(repetition_penalty), np.float64(frequency_penalty),
         np.float64(presence_penalty), z if pen else _NULL, np.int64(ldz), ws.pm, ws.state, bi_d, bv_d,
         np.int32(len(bias))),
    )  # fmt: skip
    common = (z, np.int64(ldz), np.int32(zsel), rin_d, np.int32(n))
    for lane, level in select_passes(k, p):
        f(SOURCE, f"sample_select_kernel<{lane}>")(
            (nch, nr), (THREADS,),
            (*common, np.int32(level), np.float64(temp), np.int32(k), np.float64(p), ws.pm, ws.state, ws.hcnt,
             ws.hlo, ws.hhi, ws.counters),
        )  # fmt: skip
    lane = np.int32(draw_lane(k, p))
    f(SOURCE, "sample_draw_sum_kernel")(
        (nch, nr), (THREADS,),
        (*common, np.float64(temp), lane, np.float64(mp), us_d, ws.pm, ws.state, ws.rmass, ws.rties, ws.counters),
    )  # fmt: skip
    return ws, nr, common, (np.float64(temp), lane, np.float64(mp))


def sample_async(logits: Any, rows, us, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, history=None, paths=None, last_n: int = 0,
                 workspace: SampleWorkspace | None = None, logit_bias=()) -> Any:
    """`sample`'s launches, without waiting: device int32 [len(rows)] tokens (the workspace's: read them before
    the next call on it)."""
    ws, nr, common, tail = _enqueue(logits, rows, us, temperature, top_k, top_p, min_p, repetition_penalty,
                                    presence_penalty, frequency_penalty, history, paths, last_n, workspace,
                                    logit_bias)
    loader.get_function(SOURCE, "sample_draw_scan_kernel")((nr,), (THREADS,), (*common, *tail, ws.pm, ws.state,
                                                                                ws.tokens))
    return ws.tokens[:nr]


def sample(logits: Any, rows, us, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
           history=None, paths=None, last_n: int = 0, workspace: SampleWorkspace | None = None,
           logit_bias=()) -> np.ndarray:
    """int64 [len(rows)]: a token drawn from each logits row rows[i] (device [rows, V]) with the uniform us[i] in
    [0, 1), from the twin's distribution: the logit bias ((id, value) pairs), penalties over the window
    (history + paths[i])[-last_n:], temperature,
    top-k, top-p, min-p (temperature <= 0: the argmax after penalties; us unused). -1 for a row the twin rejects
    (a NaN, +inf, or no finite value), -2 if a cut could not be placed (the caller samples that row on the host).
    Waits for the draws (one small copy of the tokens)."""
    cp = loader.require()
    x, n, _ = _float_rows(logits)
    nr = int(np.size(rows))
    ws = workspace if workspace is not None else workspace_for(nr, n)
    toks = sample_async(x, rows, us, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, history=history, paths=paths, last_n=last_n,
                        workspace=ws, logit_bias=logit_bias)
    out = ws.host_tokens[:nr]
    cp.asnumpy(toks, out=out, blocking=False)
    cp.cuda.get_current_stream().synchronize()
    return out.astype(np.int64)


def distribution(logits: Any, rows, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 history=None, paths=None, last_n: int = 0, workspace: SampleWorkspace | None = None,
                 logit_bias=()) -> Any:
    """Device float64 [len(rows), V]: the distribution `sample` draws from for each row (the twin's
    target_distribution), NaN rows where the twin raises. For tests and inspection: sample never builds it."""
    cp = loader.require()
    ws, nr, common, tail = _enqueue(logits, rows, 0.0, temperature, top_k, top_p, min_p, repetition_penalty,
                                    presence_penalty, frequency_penalty, history, paths, last_n, workspace,
                                    logit_bias)
    out = cp.empty((nr, ws.n), cp.float64)
    loader.get_function(SOURCE, "sample_probs_kernel")(
        (ws.nch, nr), (THREADS,), (*common, *tail, ws.pm, ws.state, ws.rties, out, np.int64(ws.n))
    )
    return out / out.sum(axis=1, keepdims=True)
