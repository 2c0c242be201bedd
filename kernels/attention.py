"""GPU attention of a verify tree (T <= 64 new tokens) over an f16, Q8_0 or TQ3_0 KV cache (kernels/attention.cu).

NumPy twin: services.engine.layers.masked_attention over the committed rows plus the new rows, with the
tree's ancestor mask (services.engine.layers.ancestor_matrix), as models/base.py `_kv_attention` does:

    cache = KVCacheLayer(n_kv_heads=4, head_dim=256, max_ctx=32768, kind="q8_0", kind_v="tq3_0")  # per layer
    cache.store(k_new, v_new, s_len)            # rows s_len[0] .. s_len[0] + T - 1 (k after norm + RoPE)
    o = attention(q, cache, s_len, mask)        # q [T, H, D] -> o [T, H, D]; mask = tree_mask(parents)

`s_len` (committed length S, int32 [1]) and `mask` (uint64 [T], bit u of mask[t]: new token u is visible to
new token t; bit t is always set) are device arrays, so a captured CUDA graph replays with new lengths and
trees written into them. The number of K splits is fixed when launching (and so when capturing): it is
chosen from `s_hint` (the largest S the launch should be good for); any S up to the cache size is correct.
`gate` multiplies the output by sigmoid(gate) (the Qwen3.5 output gate; a strided view of the q|gate
projection is fine). Precision: q, K, V and the softmax weights enter the tensor cores as fp16 (Q8_0 K/V
are dequantized to fp16), accumulation is fp32: relative error ~1e-3 against the f64 twin.

K and V kinds are independent (`kind` for K, and for V unless `kind_v` is given). TQ3_0 (the format of
services/engine/quants/tq3.py; twin of the attention: services/engine/kvcache.py KVCache.attend) rows are
stored rotated: the attention kernel rotates each query row (TQ3_0 K) and the combine kernel inverse-rotates
the output once (TQ3_0 V). The store kernel's TQ3_0 blocks equal tq3.quantize_tq3_0's except where a
rotated value lies within float32 rounding of a centroid midpoint (the butterfly and the twin's matrix
product round differently), which moves that value one code and its group's norm by a rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import loader, norm_rope
from .norm_rope import NULL, as_device, out_code, type_code

SOURCE = "attention.cu"
KT = 32  # keys per tile (ssa::KT); cache rows are allocated in multiples of it
MAXW = 4  # warps per block (ssa::MAXW)
QPAD = 8  # ssa::QPAD
TQ3_LUT_BYTES = 512 * 4  # ssa::TQ3_LUT_WORDS: TQ3_0 pair tables in the partial kernel's shared memory
MAX_SPLITS = 1024  # ssa::MAX_SPLITS (the combine kernel's shared weights)
COMB_THREADS = 256  # attention.cu's COMB_THREADS: the combine kernel's block (head dims up to it)
MAX_TOKENS = 64  # the ancestor mask is one uint64 per token
# The partial attention under PDL with the rest of the chain (norm_rope.PDL_UP_TO). H100, 27B Q4_K_M step replays
# (bench/gemv_ab.py --step-ab attnpdl) against no PDL in the chain: with it 1.0042 / 0.9951 at widths 1 / 2, without
# it (the q/k norm, the store and the combine only) 0.9964 / 0.9963: its early blocks (two a SM, large shared memory)
# wait beside the products' ring blocks.
PARTIAL_PDL = False
HEAD_DIMS = (64, 128, 256)
KINDS = {"f16": 0, "q8_0": 1, "tq3_0": 2}

# TQ3_0 decode constants (services/engine/quants/tq3.py; kernels may not import services): the Lloyd-Max
# centroids and the rotation's sign vectors as bit masks (bit i set: sign -1), as in attention.cu.
TQ3_CENTROIDS = np.array([-0.190685, -0.117832, -0.065717, -0.021460,
                          0.021460, 0.065717, 0.117832, 0.190685], dtype=np.float32)  # fmt: skip
_TQ3_SIGN_WORDS = ((0xE46A0359, 0x42F85949, 0xA4C63BBB, 0x49F250A9), (0x16ACEE90, 0x3F628FDC, 0xB7A5357A, 0xBEA56562))

_smem_set: set[tuple] = set()
_sm_count: dict[int, int] = {}


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes of one cache row (one token, one KV head)."""
    if kind not in KINDS:
        raise ValueError(f"KV cache type must be one of {sorted(KINDS)}, not {kind!r}")
    return 2 * head_dim if kind == "f16" else head_dim // 32 * (34 if kind == "q8_0" else 14)


def tq3_group(head_dim: int) -> int:
    """TQ3_0 rotation group of a head_dim row: 128 values, 64 when head_dim is not a multiple of 128."""
    return 128 if head_dim % 128 == 0 else 64


def _tq3_rotation(g: int) -> np.ndarray:
    """float64 R = diag(signs2) H diag(signs1) / sqrt(g) (tq3.py's rotation), for host-side decoding."""
    signs = [np.array([-1.0 if (w >> (i % 32)) & 1 else 1.0 for w in words for i in range(32)])[:g]
             for words in _TQ3_SIGN_WORDS]  # fmt: skip
    h = np.ones((1, 1))
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    return signs[1][:, None] * h * signs[0][None, :] / np.sqrt(g)


def tq3_decode(blocks: np.ndarray, head_dim: int, rotated: bool = False) -> np.ndarray:
    """(..., head_dim // 32 * 14) uint8 TQ3_0 rows -> (..., head_dim) float32 (rotated=True: as stored)."""
    b = np.asarray(blocks, dtype=np.uint8)
    b = b.reshape(*b.shape[:-1], head_dim // 32, 14)
    norm = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    low = (b[..., 2:10, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    high = np.unpackbits(b[..., 10:14], axis=-1, bitorder="little")
    idx = low.reshape(*b.shape[:-1], 32) | (high << 2)
    vals = (TQ3_CENTROIDS[idx] * norm[..., None]).reshape(*b.shape[:-2], head_dim)
    if rotated:
        return vals
    g = tq3_group(head_dim)
    r = _tq3_rotation(g).astype(np.float32)
    return (vals.reshape(*vals.shape[:-1], head_dim // g, g) @ r).reshape(vals.shape)


def _check_kind(kind: str, head_dim: int) -> int:
    if kind not in KINDS:
        raise ValueError(f"KV cache type must be one of {sorted(KINDS)}, not {kind!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the attention kernel (one of {HEAD_DIMS})")
    return KINDS[kind]


def tree_mask(parents: Any) -> np.ndarray:
    """uint64 [T]: bit u of row t set when new token u is t itself or one of its ancestors (parents[i] < i)."""
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    T = len(parents)
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"a tree has 1..{MAX_TOKENS} tokens, not {T}")
    bits = np.zeros(T, dtype=np.uint64)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError("parents must be topologically ordered: -1 <= parents[i] < i")
        bits[i] = (bits[p] if p >= 0 else np.uint64(0)) | np.uint64(1 << i)
    return bits


def _sm_count_now() -> int:
    cupy = loader.require()
    dev = int(cupy.cuda.runtime.getDevice())
    if dev not in _sm_count:
        _sm_count[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _sm_count[dev]


class KVCacheLayer:
    """One layer's K and V cache on the GPU: head-major [Hkv][ctx][D] rows of f16, GGUF Q8_0 or TQ3_0 blocks.

    `kind` is K's type and V's unless `kind_v` is given. `kind`, `code` and `row_bytes` describe K (they are
    V's too when both sides agree); `kind_v`, `code_v` and `row_bytes_v` describe V. decode_counters: the arrival
    counters decode_attention needs (`counters`; None without)."""

    def __init__(self, n_kv_heads: int, head_dim: int, max_ctx: int, kind: str = "f16", kind_v: str | None = None,
                 decode_counters: bool = False):
        cupy = loader.require()
        kind_v = kind if kind_v is None else kind_v
        self.code = _check_kind(kind, head_dim)
        self.code_v = _check_kind(kind_v, head_dim)
        if n_kv_heads < 1 or max_ctx < 1:
            raise ValueError(f"need n_kv_heads >= 1 and max_ctx >= 1, not {n_kv_heads}, {max_ctx}")
        self.kind, self.kind_v, self.n_kv_heads, self.head_dim = kind, kind_v, int(n_kv_heads), int(head_dim)
        self.max_ctx = int(max_ctx)
        self.ctx = KT * math.ceil(self.max_ctx / KT)  # whole tiles: the kernel reads KT rows at a time
        self.row_bytes = row_bytes(kind, head_dim)
        self.row_bytes_v = row_bytes(kind_v, head_dim)
        self.k = cupy.zeros(self.n_kv_heads * self.ctx * self.row_bytes, dtype=cupy.uint8)
        self.v = cupy.zeros(self.n_kv_heads * self.ctx * self.row_bytes_v, dtype=cupy.uint8)
        # decode_attention's arrival counters, one a query head (each launch leaves them at zero), for a cache that
        # asks for them (a target's); not in nbytes (the rows'): the memory plan counts them apart
        self.counters = (cupy.zeros(self.n_kv_heads * DECODE_MAX_GROUP, dtype=cupy.uint32) if decode_counters
                         else None)

    @property
    def kind_k(self) -> str:
        return self.kind

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes one token takes over the layer's KV heads."""
        return self.n_kv_heads * (self.row_bytes + self.row_bytes_v)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def store(self, k: Any, v: Any, s_len: Any, *, portable: bool = False) -> None:
        """Write k, v [T, Hkv, D] (f32/f16/bf16) to rows s_len[0] + t (rows past the cache are dropped; check
        S + T <= max_ctx before the call, the device cannot raise). portable: the build without inline PTX."""
        k, v = as_device(k), as_device(v)
        shape = (int(k.shape[0]), self.n_kv_heads, self.head_dim) if k.ndim == 3 else None
        if shape is None or tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != v.dtype:
            raise ValueError(f"k, v must both be [T, {self.n_kv_heads}, {self.head_dim}], not "
                             f"{k.dtype}{tuple(k.shape)} / {v.dtype}{tuple(v.shape)}")  # fmt: skip
        cupy = loader.require()
        k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
        ti = type_code(k)
        T = shape[0]
        units = T * self.n_kv_heads * sum(_store_units(c, self.head_dim) for c in (self.code, self.code_v))
        # under PDL in narrow steps: a link of the attention layer's chain (norm_rope.PDL_UP_TO)
        kern = loader.get_function(SOURCE, f"kv_store_kernel<{self.code}, {self.code_v}, {ti}>",
                                   ("SPECSPLIT_PORTABLE",) if portable else (),
                                   pdl=norm_rope.PDL and T <= norm_rope.PDL_UP_TO and not portable)
        kern(
            (max(1, min((units + 255) // 256, 65535)),),
            (256,),
            (k, v, self.k, self.v, _s_len(s_len), np.int32(T), np.int32(self.n_kv_heads), np.int32(self.head_dim),
             np.int64(self.ctx)),
        )  # fmt: skip

    def raw_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first n rows' stored bytes as uint8 NumPy [n, Hkv, row bytes] (K, V): KVStore.data's layout."""
        out = []
        for buf, rb in ((self.k, self.row_bytes), (self.v, self.row_bytes_v)):
            raw = buf.get().reshape(self.n_kv_heads, self.ctx, rb)[:, :n]
            out.append(np.ascontiguousarray(raw.transpose(1, 0, 2)))
        return out[0], out[1]

    def rows(self, n: int, rotated: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The first n rows as float32 NumPy [n, Hkv, D] (K, V), decoded on the host (for tests and checks).
        TQ3_0 rows are inverse-rotated to the model's domain unless rotated=True (then: as attention reads them)."""
        out = []
        for raw, kind in zip(self.raw_rows(n), (self.kind, self.kind_v)):
            if kind == "f16":
                vals = raw.reshape(-1).view(np.float16).astype(np.float32).reshape(n, self.n_kv_heads, self.head_dim)
            elif kind == "q8_0":
                blocks = raw.reshape(-1, 34)
                d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
                vals = (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(n, self.n_kv_heads, self.head_dim)
            else:
                vals = tq3_decode(raw, self.head_dim, rotated=rotated)
            out.append(vals)
        return out[0], out[1]


MOVE_UNITS = 128  # attention.cu's MOVE_UNITS: 4-byte units in the widest row a KVRowMover moves


def kv_move_rows_twin(buffers: list[np.ndarray], dst: np.ndarray, src: np.ndarray, n: int) -> None:
    """NumPy twin of KVRowMover: rows src[:n] of each [Hkv, ctx, row bytes] buffer copied to rows dst[:n] (read
    before any is written)."""
    for buf in buffers:
        buf[:, dst[:n]] = buf[:, src[:n]]


class KVRowMover:
    """Moves rows of a set of KV caches (every layer's K and V) in one launch (kv_move_rows_kernel): the KV half of
    a tree step's commit. The rows and their number are read from device buffers, so a captured launch serves every
    accepted path. Rows must move down the cache (dst[i] <= src[i], dst[i + 1] = dst[i] + 1, src rising), as a
    commit's do: the kernel then reads every row before any entry can overwrite it."""

    def __init__(self, caches: list[KVCacheLayer]):
        cupy = loader.require()
        if not caches:
            raise ValueError("KVRowMover needs at least one cache")
        heads = {c.n_kv_heads for c in caches}
        ctxs = {c.ctx for c in caches}
        if len(heads) != 1 or len(ctxs) != 1:
            raise ValueError(f"caches must share their KV heads and context, not {sorted(heads)} / {sorted(ctxs)}")
        self._bufs = [(c.k, c.row_bytes) for c in caches] + [(c.v, c.row_bytes_v) for c in caches]
        for _, rb in self._bufs:
            if rb % 4 or rb // 4 > MOVE_UNITS:
                raise ValueError(f"a {rb}-byte KV row is not 1..{MOVE_UNITS} 4-byte units")
        self.n_heads, self.ctx = heads.pop(), ctxs.pop()
        # device addresses (a NumPy array's own, where a NumPy stand-in for CuPy counts a state's bytes)
        ptrs = [getattr(b.data, "ptr", None) or b.ctypes.data for b, _ in self._bufs]
        self.bases = cupy.asarray(np.array(ptrs, dtype=np.uint64))
        self.units = cupy.asarray(np.array([rb // 4 for _, rb in self._bufs], dtype=np.int32))

    def __call__(self, dst: Any, src: Any, count: Any) -> None:
        """Move rows src[i] -> dst[i] (int64 device arrays) for i < count[0] (int32 device array) in every buffer."""
        cupy = loader.require()
        for name, a, dt in (("dst", dst, cupy.int64), ("src", src, cupy.int64), ("count", count, cupy.int32)):
            if not isinstance(a, cupy.ndarray) or a.dtype != dt or a.size < 1:
                raise ValueError(f"{name} must be a device {np.dtype(dt).name} array")
        kern = loader.get_function(SOURCE, "kv_move_rows_kernel")
        kern((self.n_heads, len(self._bufs)), (256,), (self.bases, self.units, np.int64(self.ctx), dst, src, count))


def _store_units(code: int, head_dim: int) -> int:
    """Store-kernel work units per row: values (f16), 32-value blocks (Q8_0) or rotation groups (TQ3_0)."""
    return head_dim if code == 0 else head_dim // 32 if code == 1 else head_dim // tq3_group(head_dim)


def _s_len(s_len: Any) -> Any:
    cupy = loader.require()
    if isinstance(s_len, (int, np.integer)):
        return cupy.asarray([int(s_len)], dtype=cupy.int32)
    s = cupy.asarray(s_len)
    if s.dtype != cupy.int32 or s.size < 1:
        raise ValueError("s_len must be a device int32 array holding S (or a Python int)")
    return s


def _mask(mask: Any, T: int) -> Any:
    cupy = loader.require()
    m = cupy.asarray(mask)
    if m.dtype != cupy.uint64 or m.shape != (T,):
        raise ValueError(f"mask must be uint64 [{T}] (see tree_mask), not {m.dtype}{tuple(m.shape)}")
    return cupy.ascontiguousarray(m)


def query_tiles(n_head: int, n_kv_heads: int, tokens: int) -> int:
    """m16 tiles of a KV head's query rows: G = n_head / n_kv_heads query heads times T tokens, 16 rows a tile."""
    return math.ceil(n_head // n_kv_heads * tokens / 16)


def grid_rows(n_head: int, n_kv_heads: int, tokens: int, kw: int | None = None) -> tuple[int, int]:
    """(blocks along x, KW warps per m16 tile) for T tokens: G*T query rows in MT m16 tiles; a block of
    MAXW warps takes MAXW / KW tiles, its KW warps per tile each take 1/KW of the keys. KW (1, 2 or 4) by
    default: 4 for one m16 tile (decode), 2 for two, else 1 (every K/V tile shared by 4 m16 tiles)."""
    m_tiles = query_tiles(n_head, n_kv_heads, tokens)
    if kw is None:
        kw = 4 if m_tiles == 1 else 2 if m_tiles == 2 else 1
    if kw not in (1, 2, 4):
        raise ValueError(f"kw must be 1, 2 or 4, not {kw}")
    return math.ceil(m_tiles / (MAXW // kw)), kw


# Warps per m16 tile at short contexts: KW = 2 (half the keys of a split each) for SHORT_KW_TILES m16 tiles of query
# rows (G T / 16: 11..32 tokens at the 27B's 6 query heads a KV head) when a launch sees at most SHORT_KW_ROWS cache
# rows (its s_hint + T; the engine's graph buckets of 512 / 1024 / 2048), SHORT_KW_ROWS_F16 with f16 K and V (4096),
# else grid_rows's. H100, one 27B layer, the launcher's splits for each KW (scratch sweeps, sessions 19 and 20;
# docs/gpu_kernels.md), us f16 / q8_0-tq3_0 KV: S = 512 T = 23 21.0 vs 23.1 / 23.9 vs 25.6, S = 2048 T = 23 26.4 vs
# 36.8 / 35.3 vs 39.2, T = 32 32.6 vs 44.5 / 42.6 vs 46.6; S = 4096 T = 16 / 23 / 32 f16 30.1 / 36.4 / 43.3 vs 37.6 /
# 44.3 / 52.0 but q8_0-tq3_0 41.3 / 52.9 / 64.9 vs 42.2 / 51.4 / 59.8; at S = 8192 and beyond KW = 2 loses from 23
# tokens (68.3 vs 58.8 at T = 23), with its own splits, KW = 1's, 1.5x or 2x its own alike; at 41 / 64 tokens and
# below 11 it does not win.
SHORT_KW_TILES = (5, 12)
SHORT_KW_ROWS = 2048
SHORT_KW_ROWS_F16 = 4096


def default_kw(n_head: int, n_kv_heads: int, tokens: int, rows: int, f16: bool = False) -> int:
    """attention()'s KW when none is given, for a launch over at most `rows` cache rows (s_hint + T): 2 for
    SHORT_KW_TILES m16 tiles up to SHORT_KW_ROWS rows (SHORT_KW_ROWS_F16 with f16=True: K and V both f16), else
    grid_rows's default."""
    limit = SHORT_KW_ROWS_F16 if f16 else SHORT_KW_ROWS
    if SHORT_KW_TILES[0] <= query_tiles(n_head, n_kv_heads, tokens) <= SHORT_KW_TILES[1] and rows <= limit:
        return 2
    return grid_rows(n_head, n_kv_heads, tokens)[1]


WS_CAP_BYTES = 24 << 20  # split workspace bound: it stays in L2 (50 MB on an H100) between the two kernels
# Blocks a SM the split count aims at: one whole wave of the partial kernel, which holds 2 blocks a SM at head dim 256
# where a tile's warps split the keys (221-254 registers a thread: __launch_bounds__(128, 2)). KW = 4 (one token)
# aimed at 3 on those blocks until session 33, i.e. 1.5 waves: on an H200 (27B layer, graph replays over rotated
# caches, the new combine) 66 splits a KV head against 99 ran S = 32768 75.2 vs 86.8 us (q8_0 K / tq3_0 V) and 49.5
# vs 65.5 (f16), S = 131072 246 vs 276, S = 4096 23.5 vs 25.2 (docs/gpu_kernels.md "Attention at long contexts").
SPLIT_BLOCKS_PER_SM = 2
# At one query tile a block (KW = 4: one or two tokens of the 27B) the tile's warps split the output dims instead of the
# keys (attn_partial_kernel's DS): each then holds a quarter of O's accumulators (116 registers a thread instead of
# 254 at head dim 256), so 3 blocks fit a SM (shared memory bounds it there), and the block's end merges no key slices.
# H200, one 27B layer (q8_0 K / tq3_0 V unless said), graph replays over rotated caches, us, keys vs dims at the best
# splits of each: T = 1 S = 32768 75.1 vs 70.0, f16 49.2 vs 45.8, S = 131072 245.8 vs 228.9, S = 4096 21.9 vs 18.4,
# S = 2048 16.6 vs 14.1; T = 2 S = 32768 77.3 vs 72.0. At KW = 2 (3..5 tokens) dims were not faster (S = 32768 T = 4
# 78.7 vs 78.7, S = 4096 23.2 vs 23.4): keys stay there. Its splits want fewer tiles: at least MIN_SPLIT_TILES_DS of
# the graph bucket's (the bucket can hold twice the rows a step sees).
DIM_SPLIT = True
SPLIT_BLOCKS_PER_SM_DS = 3
MIN_SPLIT_TILES, MIN_SPLIT_TILES_DS = 2, 4


def dim_split(kw: int) -> int:
    """attn_partial_kernel's DS for a launch of KW warps a query tile: 1 when they split the output dims."""
    return int(DIM_SPLIT and kw == 4)


def split_target(n_head: int, n_kv_heads: int, tokens: int, sms: int, kw: int | None = None) -> int:
    """The K splits that put one wave of partial blocks (SPLIT_BLOCKS_PER_SM a SM, SPLIT_BLOCKS_PER_SM_DS where
    the tile's warps split the dims) on `sms` SMs, before choose_splits's caps."""
    gx, kw = grid_rows(n_head, n_kv_heads, tokens, kw)
    per_sm = SPLIT_BLOCKS_PER_SM_DS if dim_split(kw) else SPLIT_BLOCKS_PER_SM
    return math.ceil(per_sm * sms / (gx * n_kv_heads))


def choose_splits(n_head: int, n_kv_heads: int, head_dim: int, tokens: int, s_hint: int, kind: str = "f16",
                  kind_v: str | None = None, kw: int | None = None) -> int:  # fmt: skip
    """K splits: split_target's whole wave of partial blocks, so every SM walks its share of the tiles in parallel;
    >= MIN_SPLIT_TILES key tiles per split (the double buffer has a tile to overlap; MIN_SPLIT_TILES_DS where the
    tile's warps split the dims), <= MAX_SPLITS, and a split workspace (written once, read once by the combine) of at
    most WS_CAP_BYTES.

    The kernel is latency-bound at the contexts a verify sees (S of a few thousand: the whole K/V of a layer is
    a few MB), so the blocks' serial chains of tiles are what to shorten: the old cap of the workspace at half
    the K/V bytes gave a 23-token tree at S = 512 one split, i.e. 12 blocks walking 17 tiles each."""
    tiles = math.ceil((s_hint + tokens) / KT)
    _, kw = grid_rows(n_head, n_kv_heads, tokens, kw)
    want = split_target(n_head, n_kv_heads, tokens, _sm_count_now(), kw)
    per = MIN_SPLIT_TILES_DS if dim_split(kw) else MIN_SPLIT_TILES
    for k in (kind, kind_v):
        if k is not None:
            row_bytes(k, head_dim)  # a clear error for an unknown kind
    ws_per_split = n_head * tokens * (head_dim + 2) * 4
    cap = max(1, min(tiles // per, WS_CAP_BYTES // ws_per_split, MAX_SPLITS))
    return max(1, min(want, cap))


def smem_bytes(kind: str, head_dim: int, kw: int, kind_v: str | None = None) -> int:
    """Dynamic shared memory of attn_partial_kernel (ssa::Layout): 2 stages of K + V tiles, the f16 tiles of
    the quantized sides (both swizzled [key][dim]), TQ3_0 group norms and pair tables, or the parked key-slice
    partials if larger; then the Q rows."""
    kind_v = kind if kind_v is None else kind_v
    stage = KT * (row_bytes(kind, head_dim) + row_bytes(kind_v, head_dim))
    deq = KT * head_dim * 2 * (2 - [kind, kind_v].count("f16"))
    deq += KT * (head_dim // tq3_group(head_dim)) * 4 * [kind, kind_v].count("tq3_0")  # TQ3_0 group norms
    deq += TQ3_LUT_BYTES if "tq3_0" in (kind, kind_v) else 0  # and its pair tables
    park = (MAXW - 1) * 16 * (head_dim + 2) * 4
    return max(2 * stage + deq, park) + MAXW // kw * 16 * (head_dim + QPAD) * 2


def make_workspace(n_head: int, tokens: int, head_dim: int, splits: int) -> tuple[Any, Any]:
    """The partial-output buffers for `splits` (allocate once before capturing a graph)."""
    cupy = loader.require()
    return (cupy.empty((splits, n_head * tokens, head_dim), dtype=cupy.float32),
            cupy.empty((splits, n_head * tokens, 2), dtype=cupy.float32))  # fmt: skip


def stages_output(n_head: int, head_dim: int) -> bool:
    """Whether attention(q16=) can write o's int16 staging for this head shape: a 16-value group in 16 lanes of a
    warp of the combine's D threads (D a multiple of 32) and whole 256-value chunks of H D."""
    return head_dim % 32 == 0 and (n_head * head_dim) % 256 == 0


def _check_q16(q16: Any, n_head: int, head_dim: int, tokens: int, out_dtype: Any) -> None:
    """o's int16 staging (q16=) of attention / decode_attention: a shape that can write it (stages_output, an f32 /
    f16 output) and a buffer of quant_matmul.q16_words(H D, T) words."""
    H, D = n_head, head_dim
    if not stages_output(H, D) or np.dtype(out_dtype) not in (np.float32, np.float16):
        raise ValueError(f"o's int16 staging takes D a multiple of 32, H D of 256 and an f32 / f16 output, not "
                         f"D = {D}, H D = {H * D}, {np.dtype(out_dtype)}")
    words = -(-H * D // 256) * tokens * 160
    if q16.dtype != np.uint32 or int(q16.size) != words or not q16.flags.c_contiguous:
        raise ValueError(f"q16 must be a contiguous uint32 array of {words} words")


def attention(
    q: Any,
    cache: KVCacheLayer,
    s_len: Any,
    mask: Any,
    *,
    splits: int | None = None,
    s_hint: int | None = None,
    gate: Any = None,
    out_dtype: Any = np.float32,
    out: Any = None,
    workspace: tuple[Any, Any] | None = None,
    portable: bool = False,
    kw: int | None = None,
    q16: Any = None,
    window: int = 0,
) -> Any:
    """o [T, H, D] = softmax(q K^T / sqrt(D) + mask) V over cache rows [0, S + T), times sigmoid(gate) if given.

    q: [T, H, D] f32/f16/bf16 (T <= 64, H a multiple of the cache's KV heads); s_len: device int32 [1] or an
    int; mask: uint64 [T] (tree_mask). splits: K splits (None: choose_splits from s_hint, default S when
    s_len is an int, else the cache size). workspace: make_workspace(H, T, D, splits) to reuse buffers. kw: warps
    per m16 tile of query rows (1, 2 or 4; None: default_kw's for s_hint + T rows). q16: a uint32 buffer
    (quant_matmul.q16_words(H D, T)) that also receives o's int16 staging (PackedX.q16 of the fp16-rounded o as
    [T, H D]; f32 / f16 out, D a multiple of 32, H D of 256) for the output projection's gemv ring, so no pack
    launch runs between them. window > 0: a sliding layer's window (the DFlash drafter's): new token t sees committed
    row j only from S - (window - 1) + t on, read in place (s_hint: the rows a split plan counts, at most window)."""
    cupy = loader.require()
    q = cupy.ascontiguousarray(as_device(q))
    if q.data.ptr % 16:  # the kernel reads q rows in 16-byte pieces
        q = q.copy()
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], not shape {tuple(q.shape)}")
    T, H, D = (int(s) for s in q.shape)
    Hkv = cache.n_kv_heads
    if D != cache.head_dim or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {Hkv} KV heads of dim {cache.head_dim}")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"attention takes 1..{MAX_TOKENS} new tokens, not {T}")
    if isinstance(s_len, (int, np.integer)) and int(s_len) + T > cache.max_ctx:
        raise ValueError(f"S + T = {int(s_len) + T} rows exceed the cache's {cache.max_ctx}")
    if s_hint is None:
        s_hint = int(s_len) if isinstance(s_len, (int, np.integer)) else cache.max_ctx - T
    window = int(window)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: none), not {window}")
    if window:
        s_hint = min(int(s_hint), window)
    s_dev = _s_len(s_len)
    m_dev = _mask(mask, T)
    tq = type_code(q)
    to, odt = out_code(out_dtype, 0)
    if q16 is not None:
        _check_q16(q16, H, D, T, odt)
    if kw is None:
        kw = default_kw(H, Hkv, T, max(0, int(s_hint)) + T, f16=cache.kind == "f16" and cache.kind_v == "f16")
    if splits is None:
        splits = choose_splits(H, Hkv, D, T, max(0, int(s_hint)), cache.kind, cache.kind_v, kw)
    splits = int(splits)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, not {splits}")
    gx, kw = grid_rows(H, Hkv, T, kw)
    if workspace is None:
        workspace = make_workspace(H, T, D, splits)
    ws_o, ws_ml = workspace
    if ws_o.shape != (splits, H * T, D) or ws_ml.shape != (splits, H * T, 2):
        raise ValueError(f"workspace does not fit {splits} splits of {H * T} rows (make_workspace)")
    if out is None:
        out = cupy.empty((T, H, D), dtype=odt)
    elif out.dtype != odt or tuple(out.shape) != (T, H, D) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous {np.dtype(odt)} array of shape {(T, H, D)}")

    defines = ("SPECSPLIT_PORTABLE",) if portable else ()
    chain = norm_rope.PDL and T <= norm_rope.PDL_UP_TO  # PDL: the attention layer's chain in a narrow step
    ds = dim_split(kw)
    kern = loader.get_function(SOURCE, f"attn_partial_kernel<{cache.code}, {cache.code_v}, {D}, {tq}, {kw}, {ds}>",
                               defines, pdl=chain and PARTIAL_PDL and not portable)
    smem = smem_bytes(cache.kind, D, kw, cache.kind_v)
    key = (cache.code, cache.code_v, D, tq, kw, ds, defines, int(cupy.cuda.runtime.getDevice()))
    if smem > 48 * 1024 and key not in _smem_set:
        kern.max_dynamic_shared_size_bytes = smem
        _smem_set.add(key)
    scale_log2 = np.float32(1.0 / math.sqrt(D) / math.log(2.0))
    kern(
        (gx, Hkv, splits),
        (32 * MAXW,),
        (q, cache.k, cache.v, s_dev, m_dev, np.int32(window), np.int32(T), np.int32(H), np.int32(Hkv),
         np.int64(cache.ctx), scale_log2, ws_o, ws_ml),
        shared_mem=smem,
    )  # fmt: skip

    if gate is not None:
        gate = as_device(gate)
        if tuple(gate.shape) != (T, H, D):
            raise ValueError(f"gate must be [T, H, D] = {(T, H, D)}, not {tuple(gate.shape)}")
        gi = gate.dtype.itemsize
        if gate.strides[2] != gi or gate.strides[0] % gi or gate.strides[1] % gi:
            gate = cupy.ascontiguousarray(gate)
        tg, g_tok, g_head = type_code(gate), gate.strides[0] // gi, gate.strides[1] // gi
    else:
        tg, g_tok, g_head = 0, 0, 0
    rg = tq3_group(D) if cache.kind_v == "tq3_0" else 0  # TQ3_0 V: the combine inverse-rotates the output
    comb = loader.get_function(SOURCE, f"attn_combine_kernel<{to}, {tg}, {rg}>", defines, pdl=chain and not portable)
    comb(
        (H * T,),
        (COMB_THREADS,),
        (ws_o, ws_ml, np.int32(splits), np.int32(T), np.int32(H), np.int32(Hkv), np.int32(D),
         gate if gate is not None else NULL, np.int64(g_tok), np.int64(g_head), out, q16 if q16 is not None else NULL),
    )  # fmt: skip
    return out


# One decode token's attention layer in one launch (attn_decode_kernel): the q/k head norms and RoPE, the KV store and
# the attention of a one-token chain step on CUDA cores, replacing qk_norm_rope + KVCacheLayer.store + attention (four
# launches) where the step's graph sees at most DECODE_MAX_ROWS cache rows (its s_hint + 1); past that the
# tensor-core chain. A block serves one query head over up to DECODE_KEYS_PER_SPLIT committed rows; more rows take
# more blocks a head, at most DECODE_BLOCKS_PER_SM a SM over the query heads. H100, 27B heads (24 over 4 KV heads,
# 256 dims), q8_0 K / tq3_0 V, 20 launches a graph, us a launch (scratch micro-benchmark, session 22): S = 40 one
# launch 8.8-9.3 (1..4 blocks a head) against 35.2 for the chain (13.7 its attention kernels alone); S = 500 17.7-18.6
# (4..8 blocks) against 39.1; S = 2000 36.8-44.6 against 46.0 and S = 6000 74.8 against 70.9: a block per head decodes
# each K / V tile once a query head, so its cost grows with S faster than the tensor cores'; the chain overlaps its
# launches with the products around it in a step, so past ~1k rows the one launch would lose. 27B Q4_K_M width-1 step
# replays (bench/gemv_ab.py --step-ab attndecode) against the chain: 0.9875 / 0.9894 at contexts 512 / 1000; under PDL
# 0.9881-0.9892 (its early blocks would wait beside the qkv product's); 256 / 32 keys a block 0.9936 / 1.0005. The first
# version (a block per KV head and split, its G heads in registers: 218 registers, a whole SM a block) ran 1.0195.
DECODE_WARPS = 4  # ssa::DEC_WARPS
DECODE_KEYS_PER_SPLIT = 128
DECODE_BLOCKS_PER_SM = 4
DECODE_MAX_ROWS = 1024
DECODE_MAX_GROUP = 16  # query heads a KV head (the arrival counters a cache keeps)
DECODE_PDL = False  # under PDL in a captured step its first tiles would stream before the grid wait


def decode_splits(n_head: int, s_hint: int) -> int:
    """Blocks a query head of decode_attention for a launch over at most s_hint committed rows."""
    want = math.ceil((max(0, int(s_hint)) + 1) / DECODE_KEYS_PER_SPLIT)
    return max(1, min(want, math.ceil(DECODE_BLOCKS_PER_SM * _sm_count_now() / n_head), MAX_SPLITS))


def decode_smem_bytes(kind: str, kind_v: str, head_dim: int) -> int:
    """Dynamic shared memory of attn_decode_kernel: two stages of K + V tiles; the q row, the new k and v rows,
    sigmoid(gate), and DECODE_WARPS - 1 parked partials (O, m, l)."""
    stage = KT * (row_bytes(kind, head_dim) + row_bytes(kind_v, head_dim))
    return 2 * stage + 4 * (4 * head_dim + (DECODE_WARPS - 1) * (head_dim + 2))


def make_decode_workspace(n_head: int, head_dim: int, splits: int) -> tuple[Any, Any]:
    """decode_attention's split partials for `splits` blocks a head (allocate once before capturing a graph: a buffer
    allocated inside a capture and freed after it would still be written by every replay)."""
    cupy = loader.require()
    return (cupy.empty((splits, n_head, head_dim), dtype=cupy.float32),
            cupy.empty((splits, n_head, 2), dtype=cupy.float32))  # fmt: skip


def decode_supported(cache: KVCacheLayer, n_head: int, s_hint: int) -> bool:
    """Whether decode_attention takes a one-token step of n_head query heads over this cache for a graph of at most
    s_hint committed rows."""
    Hkv = cache.n_kv_heads
    return (cache.counters is not None and cache.head_dim in HEAD_DIMS and n_head % Hkv == 0
            and 1 <= n_head // Hkv <= DECODE_MAX_GROUP and int(s_hint) + 1 <= DECODE_MAX_ROWS)


def decode_attention(
    q: Any,
    k: Any,
    v: Any,
    cache: KVCacheLayer,
    s_len: Any,
    positions: Any,
    q_norm: Any,
    k_norm: Any,
    n_rot: int,
    theta: float,
    eps: float,
    *,
    gate: Any = None,
    s_hint: int | None = None,
    splits: int | None = None,
    out: Any = None,
    q16: Any = None,
    workspace: tuple[Any, Any] | None = None,
    portable: bool = False,
) -> Any:
    """One token's attention layer: q' = rope(rms_norm(q) * q_norm), k' likewise with k_norm, (k', v) stored into cache
    row s_len[0], then o [1, H, D] = softmax(q' K^T / sqrt(D)) V over rows 0 .. s_len[0] (times sigmoid(gate) if
    given), in one launch (qk_norm_rope + KVCacheLayer.store + attention's result, up to rounding: f32 on CUDA cores
    where attention rounds to fp16 for its tensor cores; f16 and Q8_0 rows stored bit for bit as store() does).

    q, gate: [1, H, D] (the head axis may be strided, as in the q|gate projection); k, v: [1, Hkv, D] with the same
    head stride; f32 / f16. s_len, positions: device int32 [1] (or ints). splits: blocks a query head (None:
    decode_splits for s_hint, default the cache size). q16: as attention()'s (o's int16 staging for the output
    projection, written beside out). workspace: make_decode_workspace(H, D, splits) to reuse (with splits > 1). The
    caller checks S + 1 <= max_ctx (the device cannot raise)."""
    cupy = loader.require()
    q, _, H, D, _, q_head = norm_rope._head_view(q, "q")
    k, Tk, Hk, Dk, _, k_head = norm_rope._head_view(k, "k")
    v, Tv, Hv, Dv, _, v_head = norm_rope._head_view(v, "v")
    Hkv = cache.n_kv_heads
    if cache.counters is None:
        raise ValueError("decode_attention needs a cache made with decode_counters=True")
    if int(q.shape[0]) != 1 or Tk != 1 or Tv != 1:
        raise ValueError("decode_attention takes one token (q, k, v of shape [1, heads, head_dim])")
    if (Hk, Dk) != (Hkv, cache.head_dim) or (Hv, Dv) != (Hkv, cache.head_dim) or D != cache.head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit a cache of {Hkv} KV "
                         f"heads of dim {cache.head_dim}")
    ti = type_code(q)
    if ti == 2 or type_code(k) != ti or type_code(v) != ti:
        raise ValueError(f"q, k, v must share one type, f32 or f16, not {q.dtype} / {k.dtype} / {v.dtype}")
    if k_head != v_head:
        v = cupy.ascontiguousarray(v)
        k = cupy.ascontiguousarray(k)
        k_head = v_head = D
    if H % Hkv or not 1 <= H // Hkv <= DECODE_MAX_GROUP:
        raise ValueError(f"{H} query heads over {Hkv} KV heads: the one-token kernel takes 1..{DECODE_MAX_GROUP} a "
                         "KV head")
    if not (0 <= n_rot <= D and n_rot % 2 == 0):
        raise ValueError(f"n_rot {n_rot} must be even and <= head_dim {D}")
    if isinstance(s_len, (int, np.integer)) and int(s_len) + 1 > cache.max_ctx:
        raise ValueError(f"S + 1 = {int(s_len) + 1} rows exceed the cache's {cache.max_ctx}")
    G = H // Hkv
    if gate is not None:
        gate, Tg, Hg, Dg, _, g_head = norm_rope._head_view(gate, "gate")
        if (Tg, Hg, Dg) != (1, H, D) or type_code(gate) != ti:
            raise ValueError(f"gate must be like q {tuple(q.shape)} {q.dtype}, not {tuple(gate.shape)} {gate.dtype}")
    else:
        g_head = 0
    if s_hint is None:
        s_hint = int(s_len) if isinstance(s_len, (int, np.integer)) else cache.max_ctx - 1
    ns = decode_splits(H, s_hint) if splits is None else int(splits)
    if not 1 <= ns <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, not {ns}")
    if out is None:
        out = cupy.empty((1, H, D), dtype=cupy.float32)
    elif out.dtype != cupy.float32 or tuple(out.shape) != (1, H, D) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of shape {(1, H, D)}")
    if q16 is not None:
        _check_q16(q16, H, D, 1, np.float32)
    if ns == 1:  # one block a head: no partials (the kernel never touches the workspace)
        ws_o = ws_ml = out
    elif workspace is None:
        ws_o, ws_ml = make_decode_workspace(H, D, ns)
    else:
        ws_o, ws_ml = workspace
        if tuple(ws_o.shape) != (ns, H, D) or tuple(ws_ml.shape) != (ns, H, 2):
            raise ValueError(f"workspace does not fit {ns} splits of {H} heads (make_decode_workspace)")
    defines = ("SPECSPLIT_PORTABLE",) if portable else ()
    kern = loader.get_function(SOURCE, f"attn_decode_kernel<{cache.code}, {cache.code_v}, {D}, {ti}>", defines,
                               pdl=DECODE_PDL and norm_rope.PDL and not portable)
    smem = decode_smem_bytes(cache.kind, cache.kind_v, D)
    key = ("decode", cache.code, cache.code_v, D, ti, defines, int(cupy.cuda.runtime.getDevice()))
    if smem > 48 * 1024 and key not in _smem_set:
        kern.max_dynamic_shared_size_bytes = smem
        _smem_set.add(key)
    inv = norm_rope.rope_inv_freq(n_rot, theta) if n_rot else None
    kern(
        (ns, Hkv, G),
        (32 * DECODE_WARPS,),
        (q, np.int64(q_head), gate if gate is not None else NULL, np.int64(g_head), k, v, np.int64(k_head),
         norm_rope._weight(q_norm, D, "q norm weight"), norm_rope._weight(k_norm, D, "k norm weight"),
         norm_rope._positions(positions, 1), inv if inv is not None else NULL, np.int32(n_rot), np.float32(eps),
         cache.k, cache.v, _s_len(s_len), np.int64(cache.ctx), np.float32(1.0 / math.sqrt(D) / math.log(2.0)),
         ws_o, ws_ml, cache.counters, out, q16 if q16 is not None else NULL),
        shared_mem=smem,
    )  # fmt: skip
    return out
