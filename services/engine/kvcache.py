"""KV storage of the attention layers in f32, f16, q8_0 or tq3_0 (chosen per side), and attention over it.

Rows are written one token at a time and quantized row-locally (each head's row on its own), so a token's
stored K/V depend only on its own K/V values: a tree token and the same token decoded plainly are stored
alike, and commit() compacts accepted rows by copying their bytes. f32 is the exact NumPy reference and what
a SequenceState gets when no type is asked for.

TQ3_0 rows stay in the rotated domain (tq3.py): attention rotates the query per group instead of de-rotating
every key (rotation is orthogonal, so <Rq, Rk> = <q, k>), and when V is TQ3_0 the weighted sum is formed
from the rotated rows and the output is inverse-rotated once.

`auto` (the service default): V = tq3_0; K = q8_0 when n_head / n_head_kv >= K_Q8_MIN_GQA, else tq3_0.
Both fall back to f32 when head_dim is not a multiple of 64 (toy and test models only). Measured
(bench/tq3_accuracy.py, docs/benchmarks.md "TQ3_0 KV cache (CPU)"): on the embedded model at 2:1, TQ3_0 K
alone costs less than TQ3_0 V alone (mean next-token KL 1.0e-3 vs 2.9e-3), so K stays TQ3_0 there; the
synthetic attention error does not change with the ratio, so the 6:1 threshold rests on TheTom's turbo3
model measurements (perplexity collapse with 3-bit K at 7:1, +4.4 % at 4:1).
"""

from __future__ import annotations

import numpy as np

from .layers import masked_attention
from .quants import legacy, tq3

KV_TYPES = ("f32", "f16", "q8_0", "tq3_0")
CACHE_TYPE_CHOICES = ("auto", *KV_TYPES)
K_Q8_MIN_GQA = 6            # query heads per KV head from which `auto` keeps K at q8_0


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes one head's row of head_dim values takes in kv_type."""
    check_type(kv_type, head_dim)
    if kv_type == "f32":
        return 4 * head_dim
    if kv_type == "f16":
        return 2 * head_dim
    if kv_type == "q8_0":
        return head_dim // legacy.QK * 34
    return tq3.row_bytes(head_dim)


def check_type(kv_type: str, head_dim: int) -> None:
    """A clear ValueError for an unknown type or one the head size cannot hold."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r}; expected one of {', '.join(KV_TYPES)}")
    if kv_type == "q8_0" and head_dim % legacy.QK:
        raise ValueError(f"q8_0 KV needs head_dim to be a multiple of {legacy.QK}, got {head_dim}")
    if kv_type == "tq3_0" and head_dim % 64:
        raise ValueError(f"tq3_0 KV needs head_dim to be a multiple of 64, got {head_dim}")


def resolve_cache_types(cfg, cache_type_k: str = "auto", cache_type_v: str = "auto") -> tuple[str, str]:
    """The concrete (K, V) types for a model: `auto` resolved by the rule in the module docstring, checked."""
    k, v = str(cache_type_k).lower(), str(cache_type_v).lower()
    tq_ok = cfg.head_dim % 64 == 0
    if v == "auto":
        v = "tq3_0" if tq_ok else "f32"
    if k == "auto":
        ratio = cfg.n_head // max(cfg.n_head_kv, 1)
        k = ("q8_0" if ratio >= K_Q8_MIN_GQA else "tq3_0") if tq_ok else "f32"
    for side, t in (("K", k), ("V", v)):
        try:
            check_type(t, cfg.head_dim)
        except ValueError as e:
            raise ValueError(f"{side} cache: {e}") from None
    return k, v


def n_attention_layers(cfg) -> int:
    return sum(1 for rec in cfg.recurrent_layers if not rec)


def kv_bytes_per_token(cfg, cache_type_k: str, cache_type_v: str) -> int:
    """KV bytes one token of context takes over all attention layers."""
    per_layer = cfg.n_head_kv * (row_bytes(cache_type_k, cfg.head_dim) + row_bytes(cache_type_v, cfg.head_dim))
    return n_attention_layers(cfg) * per_layer


def kv_info(cfg, cache_type_k: str, cache_type_v: str, n_ctx: int) -> dict:
    """Memory accounting for logs and --json output: bytes per token, and for n_ctx tokens of one sequence."""
    per_tok = kv_bytes_per_token(cfg, cache_type_k, cache_type_v)
    return {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "kv_bytes_per_token": per_tok,
            "kv_bytes_per_token_f16": kv_bytes_per_token(cfg, "f16", "f16"),
            "n_ctx": int(n_ctx), "kv_bytes": per_tok * int(n_ctx)}


class KVStore:
    """One side (K or V) of one attention layer: max_ctx rows of (n_head_kv, head_dim) values in kv_type."""

    def __init__(self, kv_type: str, max_ctx: int, n_head_kv: int, head_dim: int, _data: np.ndarray | None = None):
        check_type(kv_type, head_dim)
        self.kv_type, self.max_ctx, self.n_head_kv, self.head_dim = kv_type, max_ctx, n_head_kv, head_dim
        self.rotated = kv_type == "tq3_0"          # rows are stored in tq3's rotated domain
        if _data is not None:
            self.data = _data
        elif kv_type in ("f32", "f16"):
            self.data = np.zeros((max_ctx, n_head_kv, head_dim), np.float32 if kv_type == "f32" else np.float16)
        else:
            width = 34 if kv_type == "q8_0" else tq3.BLOCK_BYTES
            self.data = np.zeros((max_ctx, n_head_kv, head_dim // 32, width), np.uint8)

    @property
    def bytes_per_token(self) -> int:
        return self.n_head_kv * row_bytes(self.kv_type, self.head_dim)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Store rows (T, n_head_kv, head_dim) float32 at positions start .. start + T - 1."""
        T = rows.shape[0]
        if self.kv_type == "f32":
            self.data[start:start + T] = rows
        elif self.kv_type == "f16":
            self.data[start:start + T] = rows.astype(np.float16)
        elif self.kv_type == "q8_0":
            blocks = legacy.quantize_q8_0(np.asarray(rows, np.float32).reshape(-1, legacy.QK))
            self.data[start:start + T] = blocks.reshape(T, self.n_head_kv, -1, 34)
        else:
            self.data[start:start + T] = tq3.quantize_tq3_0(rows)

    def move(self, dst: int, src: int) -> None:
        self.data[dst] = self.data[src]

    def read(self, n: int) -> np.ndarray:
        """Rows 0 .. n-1 as float32 as attention reads them (TQ3_0: still rotated)."""
        d = self.data[:n]
        if self.kv_type == "f32":
            return d
        if self.kv_type == "f16":
            return d.astype(np.float32)
        if self.kv_type == "q8_0":
            return legacy.dequantize_q8_0(d.reshape(-1, 34)).reshape(n, self.n_head_kv, self.head_dim)
        return tq3.dequantize_tq3_0(d, rotated=True)

    def dequantize(self, n: int | None = None) -> np.ndarray:
        """Rows 0 .. n-1 (default: all) as float32 in the model's own domain."""
        x = self.read(self.max_ctx if n is None else n)
        return tq3.inverse_rotate(x) if self.rotated else x

    def copy(self) -> KVStore:
        return KVStore(self.kv_type, self.max_ctx, self.n_head_kv, self.head_dim, _data=self.data.copy())


class KVCache:
    """K and V of one attention layer."""

    def __init__(self, k: KVStore, v: KVStore):
        self.k, self.v = k, v

    @classmethod
    def allocate(cls, max_ctx: int, n_head_kv: int, head_dim: int, cache_type_k: str = "f32",
                 cache_type_v: str = "f32") -> KVCache:
        return cls(KVStore(cache_type_k, max_ctx, n_head_kv, head_dim),
                   KVStore(cache_type_v, max_ctx, n_head_kv, head_dim))

    @property
    def bytes_per_token(self) -> int:
        return self.k.bytes_per_token + self.v.bytes_per_token

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k.write(start, k)
        self.v.write(start, v)

    def move(self, dst: int, src: int) -> None:
        self.k.move(dst, src)
        self.v.move(dst, src)

    def attend(self, q: np.ndarray, n: int, visible: np.ndarray) -> np.ndarray:
        """Attention of q (T, H, D) over rows 0 .. n-1 with the (T, n) visibility mask; (T, H, D) float32.

        With TQ3_0 K the query is rotated (keys stay rotated); with TQ3_0 V the output, a weighted sum of
        rotated rows, is inverse-rotated once. f32/f32 is masked_attention on the stored arrays, unchanged.
        """
        qq = tq3.rotate(q) if self.k.rotated else q
        out = masked_attention(qq, self.k.read(n), self.v.read(n), visible)
        return tq3.inverse_rotate(out) if self.v.rotated else out

    def copy(self) -> KVCache:
        return KVCache(self.k.copy(), self.v.copy())
