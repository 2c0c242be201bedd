"""The array-backend seam: how model code turns stored tensors into arrays and multiplies by them.

NumPy is the reference backend (CPU, float32); the CuPy backend (GPU, quantized weights kept packed)
implements the same methods with the fused kernels in kernels/ (models/qwen35_gpu.py runs a model on it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .errors import UnsupportedModelError
from .formats import RawTensor
from .quants import dequantize


class NumpyBackend:
    """Float32 NumPy: weights are dequantized once at load, products go through BLAS."""

    name = "numpy"
    xp = np

    def weight(self, t: RawTensor | np.ndarray) -> np.ndarray:
        """A matrix (out, in) or vector ready for `linear`/elementwise use (float32, row-major)."""
        a = t.dequantize() if isinstance(t, RawTensor) else t
        return np.ascontiguousarray(a, dtype=np.float32)

    def stack(self, mats: list[np.ndarray]) -> np.ndarray:
        """Several matrices that read the same input as one (their output rows concatenated): one product."""
        return np.ascontiguousarray(np.concatenate([np.asarray(m) for m in mats], axis=0), dtype=np.float32)

    def embedding(self, t: RawTensor | np.ndarray) -> Any:
        # Embedding tables stay packed; rows are dequantized on lookup (a 27B table is 1.3 B values).
        return t

    def embed(self, table: Any, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if isinstance(table, RawTensor):
            rows, cols = table.shape
            data = table.data.reshape(rows, -1)[ids]
            return dequantize(data, table.qtype, (len(ids), cols)).astype(np.float32)
        return np.asarray(table[ids], dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x (T, in) @ w(out, in).T -> (T, out).

        Computed as (w @ x.T).T: BLAS then sees the weight as the big row-major operand and the T tokens as
        the small side, which OpenBLAS runs far better at verify widths than x @ w.T (a 16-token product
        costs ~1.7x one token instead of ~3.2x on a 2-core AVX-512 machine); the result is made
        contiguous because the elementwise code after it is slow on the transposed view.
        """
        return np.ascontiguousarray((w @ x.T).T)

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)


class HostRowCache:
    """float32 rows of a token table kept on the host, each dequantized once into a bounded LRU cache.

    Dequantizing a K-quant row in NumPy costs ~0.1-0.2 ms, and a request's tokens repeat (drafted trees, the bonus
    token a drafter embeds again): a GPU model whose table stays on the host, and a GPU drafter service's block row,
    look rows up here. Thread-safe (a verifier's slots share their model)."""

    def __init__(self, table: Any, n_embd: int, max_bytes: int = 64 << 20):
        self.table = table                  # RawTensor or array (rows, n_embd), as NumpyBackend.embed takes it
        self.n_embd = int(n_embd)
        self.max_rows = max(1, int(max_bytes) // (4 * self.n_embd))
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0}

    def lookup(self, tokens: Any, out: np.ndarray | None = None) -> np.ndarray:
        """(len(tokens), n_embd) float32 rows, into `out` when given."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if out is None:
            out = np.empty((len(ids), self.n_embd), np.float32)
        cache = self._rows
        with self._lock:
            miss = []
            for i, t in enumerate(ids.tolist()):
                row = cache.get(t)
                if row is None:
                    miss.append(i)
                else:
                    cache.move_to_end(t)
                    out[i] = row
            if miss:
                rows = NumpyBackend().embed(self.table, ids[miss])
                out[miss] = rows
                for i, row in zip(miss, rows):
                    cache[int(ids[i])] = row.copy()      # its own row: a view would keep the block alive
                while len(cache) > self.max_rows:
                    cache.popitem(last=False)
            self.stats["hits"] += len(ids) - len(miss)
            self.stats["misses"] += len(miss)
        return out


F16_MAX = float(np.finfo(np.float16).max)   # the largest weight an F16-fallback matrix can hold

# ggml type ids the GPU path reads directly (F32 / F16 vectors and tables, Q8_0 tables decoded on the device)
_F32, _F16, _Q8_0 = 0, 1, 8


class GpuMatrix:
    """A weight matrix for the GPU: host GGUF bytes until `upload()`, then one kernels.quant_matmul.QuantMatrix.

    Uploading is deferred so that `CupyBackend.stack` can concatenate packed rows first and each weight byte
    goes to the device once. Storage types the matmul kernels lack (kernels.quant_matmul.SUPPORTED_QTYPES: F32, BF16,
    ...) are FALLBACK: dequantized on the host and uploaded as F16 (the kernel's F16 path), which `fallback` records;
    a matrix holding a value past F16's range is refused with its name rather than uploaded as infinities.
    """

    def __init__(self, qtype: int, rows: np.ndarray, shape: tuple[int, int], name: str, fallback: bool = False):
        self.qtype, self.rows, self.shape, self.name, self.fallback = int(qtype), rows, shape, name, fallback
        self.q = None

    @classmethod
    def of(cls, t: RawTensor | np.ndarray, name: str = "weight") -> GpuMatrix:
        from kernels import quant_matmul as qm

        if isinstance(t, RawTensor) and int(t.qtype) in qm.SUPPORTED_QTYPES:
            rows = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8).reshape(t.shape[0], -1)
            return cls(t.qtype, rows, tuple(t.shape), t.name)
        a = t.dequantize() if isinstance(t, RawTensor) else np.asarray(t, np.float32)
        if a.ndim != 2:
            raise ValueError(f"{name}: a weight matrix must be 2-D, not shape {a.shape}")
        label = getattr(t, "name", name)
        with np.errstate(over="ignore", invalid="ignore"):
            a16 = np.ascontiguousarray(a.astype(np.float16))
        if not np.isfinite(a16).all():
            # BF16 / F32 reach far past f16's range; a weight that rounds to inf would poison every logit silently
            big = float(np.max(np.abs(a), initial=0.0, where=np.isfinite(a)))
            kind = t.type_name if isinstance(t, RawTensor) else "float"
            where = f"{t.source}: tensor '{label}'" if isinstance(t, RawTensor) else label
            what = f"a value of magnitude {big:.4g}" if big > F16_MAX else "a non-finite value"
            raise UnsupportedModelError(
                f"{where}: the GPU takes {kind} matrices as F16, and this one holds {what} (F16 stops at "
                f"{F16_MAX:.0f}); run it on the CPU backend (--device cpu) or use a quantized file of the model")
        rows = a16.view(np.uint8).reshape(a.shape[0], -1)
        return cls(qm.F16, rows, tuple(a.shape), label, fallback=True)

    def upload(self) -> GpuMatrix:
        if self.q is None:
            from kernels.quant_matmul import QuantMatrix

            self.q = QuantMatrix(self.qtype, self.rows, self.shape, name=self.name)
            self.rows = None
        return self

    def matmul(self, x: Any, out: Any = None, accumulate: bool = False, stage: Any = None,
               wg_order: bool = False) -> Any:
        """x @ W^T (x: activations, a kernels.quant_matmul.PackedX or StagedNorm); accumulate: out += x @ W^T;
        stage: a StagedNorm of `out` to write for the next norm's product (can_stage_norm); wg_order: raw x packed in
        the wgmma order where the product then runs the wgmma build (QuantMatrix.matmul)."""
        return self.upload().q.matmul(x, out=out, accumulate=accumulate, stage=stage, wg_order=wg_order)

    def swiglu(self, x: Any, pair: bool = False) -> Any:
        """silu(g) * u of this stacked [gate | up] matrix's product, staged for the down product's ring gemv (a
        kernels.quant_matmul.PackedX of int16 staging only; can_fuse_swiglu says when). pair: gate|up's own launch
        shape with each gate tile's block and its up tile's block a thread block cluster (sm_90). Wider x (a PackedX
        of fp16 data): the wide kernel's SwiGLU launch, the down product's packed x (can_wide_swiglu says when)."""
        return self.upload().q.swiglu(x, pair=pair)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes if self.q is not None else int(self.rows.nbytes)


def _concat(mats: list[GpuMatrix]) -> GpuMatrix:
    """One matrix of the members' packed rows, concatenated (they share storage type and in-width); not uploaded."""
    if len(mats) == 1:
        return mats[0]
    rows = np.concatenate([m.rows for m in mats], axis=0)
    return GpuMatrix(mats[0].qtype, rows, (rows.shape[0], mats[0].shape[1]), "+".join(m.name for m in mats),
                     fallback=any(m.fallback for m in mats))


# GpuStack: while a step is captured, run a stack's later products on a side stream (see GpuStack._side_stream)
STACK_CONCURRENT = True
_side_streams: dict[int, Any] = {}


class GpuStack:
    """Matrices reading one input whose storage types differ: outputs side by side, one product per run of
    consecutive members that share a storage type and in-width.

    Each run is concatenated into one matrix (as CupyBackend.stack does for a uniform stack), so e.g. the DeltaNet
    input stack [attn_qkv Q6_K | attn_gate Q4_K | ssm_beta Q4_K | ssm_alpha Q4_K] costs 2 launches, not 4 (beta and
    alpha are 48-row matrices: a launch of their own costs about what their bytes do). Each run's product is
    written straight into its column slice of the stacked output (the kernels take a row stride), so no copy
    follows; only the v1 kernel (contiguous output only) goes through a temporary. `mats`: the runs.
    """

    def __init__(self, mats: list[GpuMatrix]):
        runs: list[list[GpuMatrix]] = []
        for m in mats:
            if runs and (runs[-1][0].qtype, runs[-1][0].shape[1]) == (m.qtype, m.shape[1]):
                runs[-1].append(m)
            else:
                runs.append([m])
        self.mats = [_concat(r) for r in runs]
        self.name = "+".join(m.name for m in mats)
        self.shape = (sum(m.shape[0] for m in mats), mats[0].shape[1])
        self.fallback = any(m.fallback for m in mats)

    def upload(self) -> GpuStack:
        for m in self.mats:
            m.upload()
        return self

    def matmul(self, x: Any, out: Any = None, accumulate: bool = False) -> Any:
        """x @ W^T of every matrix side by side (x: activations or a PackedX, packed once for all of them);
        accumulate: out += x @ W^T. out: float32 [T, out_features] with contiguous rows (row stride free)."""
        from kernels import loader
        from kernels.quant_matmul import PackedX, StagedNorm, pack_activations

        cupy = loader.require()
        if isinstance(x, (PackedX, StagedNorm)):
            packed, tokens = x, x.tokens
        else:
            x = cupy.asarray(x)
            tokens = x.shape[0]
            packed = pack_activations(x) if tokens <= 64 else x
        if accumulate and out is None:
            raise ValueError(f"{self.name}: accumulate=True adds into `out`, which is missing")
        y = out if out is not None else cupy.empty((tokens, self.shape[0]), cupy.float32)
        cols, col = [], 0
        for m in self.mats:
            cols.append((m, y[:, col:col + m.shape[0]]))   # each run into its columns: no copy after
            col += m.shape[0]
        side = self._side_stream(cupy, packed)
        if side is None:
            for m, o in cols:
                m.matmul(packed, out=o, accumulate=accumulate)
            return y
        # captured into a graph: the later runs on a side stream, so their blocks fill what the first run's last
        # wave leaves idle (a fork and a join in the graph)
        main = cupy.cuda.get_current_stream()
        fork, join = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
        fork.record(main)
        side.wait_event(fork)
        with side:
            for m, o in cols[1:]:
                m.matmul(packed, out=o, accumulate=accumulate)
            join.record(side)
        cols[0][0].matmul(packed, out=cols[0][1], accumulate=accumulate)
        main.wait_event(join)
        return y

    def _side_stream(self, cupy: Any, packed: Any) -> Any:
        """The stream the later runs go to, or None (one after another on the current stream): only while a CUDA
        graph is captured (STACK_CONCURRENT), only when every run is a gemv ring launch (no scratch, no allocation
        on the side stream: what the memory plan counts per stream stays as it is), and only once the device's side
        stream exists (made by an eager pass: stream creation stays out of captures)."""
        from kernels import quant_gemv
        from kernels.quant_matmul import PackedX, StagedNorm

        if len(self.mats) < 2 or not STACK_CONCURRENT or not isinstance(packed, (PackedX, StagedNorm)):
            return None
        dev = int(cupy.cuda.Device().id)
        main = cupy.cuda.get_current_stream()
        if not main.is_capturing():
            if dev not in _side_streams:
                _side_streams[dev] = cupy.cuda.Stream(non_blocking=True)
            return None
        side = _side_streams.get(dev)
        rings = all(quant_gemv.ring_takes(m.qtype, m.shape[1], packed.tokens, packed.q16 is not None)
                    for m in self.mats)
        return side if rings else None


def reads_staging(m: Any, tokens: int) -> bool:
    """Whether a GpuMatrix's product at this width is a ring gemv reading x's int16 staging alone (so a kernel before
    it may write kernels.quant_matmul.PackedX.q16 instead of a pack launch doing it)."""
    from kernels import quant_matmul as qm

    if not isinstance(m, GpuMatrix) or tokens > qm.Q16_TOKENS:
        return False
    q = m.upload().q
    return q.kernel == "v2" and qm.quant_gemv.ring_takes(q.qtype, q.in_features, tokens, True)


def can_fuse_swiglu(gate_up: Any, down: Any, tokens: int, pair: bool = False) -> bool:
    """Whether gate_up (a stacked [gate | up] GpuMatrix; a GpuStack cannot) stages SwiGLU for down (a GpuMatrix) at
    this width: kernels.quant_matmul.can_fuse_swiglu; pair: with its cluster pairs, which also need the device's
    thread block clusters."""
    from kernels import quant_matmul as qm

    if not (isinstance(gate_up, GpuMatrix) and isinstance(down, GpuMatrix)):
        return False
    if pair and not qm.quant_gemv.clusters_available():
        return False
    return qm.can_fuse_swiglu(gate_up.upload().q, down.upload().q, tokens, pair=pair)


def can_wide_swiglu(gate_up: Any, down: Any, tokens: int, order: int = 0) -> bool:
    """Whether gate_up (a stacked [gate | up] GpuMatrix; a GpuStack cannot) runs as the wide kernel's SwiGLU launch
    for down (a GpuMatrix) at this width with x in PackedX.order `order`, writing down's packed x itself
    (kernels.quant_wide.can_swiglu)."""
    from kernels import quant_wide

    if not (isinstance(gate_up, GpuMatrix) and isinstance(down, GpuMatrix)):
        return False
    return quant_wide.can_swiglu(gate_up.upload().q, down.upload().q, tokens, order)


def can_stage_norm(producer: Any, consumer: Any, tokens: int) -> bool:
    """Whether `producer` (a GpuMatrix writing the residual stream) can stage the RMSNorm that `consumer` (a
    GpuMatrix or GpuStack) reads, at this width: kernels.quant_matmul.can_stage_norm for it and every product of the
    consumer (then no pack launch runs between them)."""
    from kernels import quant_matmul as qm

    if not isinstance(producer, GpuMatrix) or not isinstance(consumer, (GpuMatrix, GpuStack)):
        return False
    mats = consumer.mats if isinstance(consumer, GpuStack) else [consumer]
    return all(qm.can_stage_norm(producer.upload().q, m.upload().q, tokens) for m in mats)


class GpuEmbedding:
    """A token table kept packed on the device (F32 / F16 / Q8_0 rows decoded there); other types stay on the
    host and only the looked-up rows are dequantized and uploaded (FALLBACK, marked by `on_host`)."""

    def __init__(self, t: RawTensor | np.ndarray):
        from kernels import loader

        cupy = loader.require()
        self.host = t
        self.shape = tuple(t.shape)
        q = int(t.qtype) if isinstance(t, RawTensor) else _F32
        self.on_host = q not in (_F32, _F16, _Q8_0)
        self.qtype = q
        self.dev = None
        if not self.on_host:
            data = np.asarray(t.data if isinstance(t, RawTensor) else np.asarray(t, np.float32))
            self.dev = cupy.asarray(np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(self.shape[0], -1))

    def lookup(self, ids: Any) -> Any:
        """float32 rows (len(ids), cols): decoded on the device by one launch (quant_matmul.embed_rows, the NumPy
        rows bit for bit), or for a host table dequantized there and uploaded."""
        from kernels import loader
        from kernels import quant_matmul as qm

        cupy = loader.require()
        if self.on_host:
            return cupy.asarray(NumpyBackend().embed(self.host, cupy.asnumpy(ids)))
        return qm.embed_rows(self.dev, self.qtype, self.shape[1], device_ids(ids))


def device_ids(ids: Any) -> Any:
    """Token ids as the contiguous int32 device vector embed_rows reads (no copy when they already are one)."""
    from kernels import loader

    cupy = loader.require()
    ids = cupy.asarray(ids).reshape(-1)
    if ids.dtype != cupy.int32:
        ids = ids.astype(cupy.int32)
    return cupy.ascontiguousarray(ids)


class CupyBackend:
    """GPU: matrices stay in their GGUF storage (kernels.quant_matmul), vectors are float32 device arrays.

    Activations go into the matmul kernel as fp16 (f32 is rounded by its packing step), products accumulate
    in fp32 and come back float32.
    """

    name = "cuda"

    def __init__(self, device: int = 0):
        from kernels import loader

        self.xp = loader.require()
        self.device = int(device)
        self.xp.cuda.Device(self.device).use()

    def weight(self, t: RawTensor | np.ndarray) -> Any:
        """GpuMatrix for a 2-D tensor (upload deferred, see GpuMatrix), float32 device array otherwise."""
        if len(t.shape) == 2:
            return GpuMatrix.of(t)
        return self.array(t)

    def array(self, t: RawTensor | np.ndarray) -> Any:
        """Any tensor as a float32 device array (norms, conv taps, gates: small, read as f32 by the kernels)."""
        a = t.dequantize() if isinstance(t, RawTensor) else np.asarray(t)
        return self.xp.asarray(np.ascontiguousarray(a, dtype=np.float32))

    def stack(self, mats: list[GpuMatrix]) -> GpuMatrix | GpuStack:
        """One matrix of concatenated packed rows when the storage types match, else a GpuStack."""
        if any(not isinstance(m, GpuMatrix) or m.q is not None for m in mats):
            raise ValueError("stack() takes GpuMatrix weights not uploaded yet")
        if len({m.qtype for m in mats}) == 1 and len({m.shape[1] for m in mats}) == 1:
            return _concat(mats) if len(mats) > 1 else GpuMatrix(mats[0].qtype, mats[0].rows, mats[0].shape,
                                                                 mats[0].name, mats[0].fallback)
        return GpuStack(mats)

    def embedding(self, t: RawTensor | np.ndarray) -> GpuEmbedding:
        return GpuEmbedding(t)

    def embed(self, table: GpuEmbedding, ids: Any) -> Any:
        return table.lookup(ids)

    def linear(self, x: Any, w: GpuMatrix | GpuStack) -> Any:
        """x (T, in) @ w(out, in).T -> (T, out) float32 on the device."""
        return w.matmul(x)

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)


def default_backend() -> NumpyBackend:
    return NumpyBackend()
