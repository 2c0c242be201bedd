"""Per-sequence inference state: KV rows of the attention layers, recurrent and conv state of DeltaNet layers.

A forward pass writes its tokens tentatively (KV rows past the committed length, per-token recurrent
checkpoints); `commit(path)` then keeps one root-to-node path of them. Speculative decoding commits the
accepted branch of a tree without a second target pass; plain decoding commits every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ContextOverflowError
from .kvcache import KVCache


def check_commit_path(path, parents: np.ndarray) -> list[int]:
    """`path` as ints, checked to be a root-to-node chain of the pending tokens (each the parent of the next)."""
    path = [int(i) for i in path]
    prev = -1
    for i in path:
        if not (0 <= i < len(parents)) or int(parents[i]) != prev:
            raise ValueError(f"commit path {path} is not a root-to-node chain of the pending tokens")
        prev = i
    return path


@dataclass
class PendingStep:
    """What the last forward wrote and has not yet been committed."""

    n_tokens: int
    parents: np.ndarray
    # per recurrent layer: per-token states (T, H, dk, dv), or only the final state (H, dk, dv) of a chain
    ssm_states: dict[int, np.ndarray] = field(default_factory=dict)
    ssm_per_token: bool = False
    raw_rows: dict[int, np.ndarray] = field(default_factory=dict)   # per recurrent layer: (T, conv_dim)


@dataclass
class SequenceState:
    max_ctx: int
    kv: dict[int, KVCache]              # attention layer -> its K/V rows (kvcache.py), max_ctx of them
    ssm: dict[int, np.ndarray]          # recurrent layer -> (H_v, dk, dv) float32
    conv: dict[int, np.ndarray]         # recurrent layer -> (K-1, conv_dim) last committed raw rows
    n_past: int = 0
    pending: PendingStep | None = None

    @classmethod
    def allocate(cls, cfg, max_ctx: int, cache_type_k: str = "f32", cache_type_v: str = "f32") -> SequenceState:
        """Zeroed state; KV in the given types (f32, f16, q8_0, tq3_0; f32 is the exact reference)."""
        kv, ssm, conv = {}, {}, {}
        for i, rec in enumerate(cfg.recurrent_layers):
            if rec:
                ssm[i] = np.zeros((cfg.ssm_n_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim), np.float32)
                conv[i] = np.zeros((cfg.ssm_conv_kernel - 1, cfg.ssm_conv_dim), np.float32)
            else:
                kv[i] = KVCache.allocate(max_ctx, cfg.n_head_kv, cfg.head_dim, cache_type_k, cache_type_v)
        return cls(max_ctx=max_ctx, kv=kv, ssm=ssm, conv=conv)

    @property
    def kv_k(self) -> dict[int, np.ndarray]:
        """K of every attention layer as float32 (max_ctx, Hkv, D); the live arrays for f32, else decoded copies."""
        return {i: c.k.dequantize() for i, c in self.kv.items()}

    @property
    def kv_v(self) -> dict[int, np.ndarray]:
        return {i: c.v.dequantize() for i, c in self.kv.items()}

    def check_room(self, n_new: int) -> None:
        if self.n_past + n_new > self.max_ctx:
            raise ContextOverflowError(self.n_past + n_new, self.max_ctx)

    def commit(self, path) -> None:
        """Keep the pending tokens `path` (root first, each the parent of the next) at n_past, n_past+1, ...

        KV rows of the branch are compacted into place, recurrent state is taken from the checkpoint of the
        path's last token, and the conv window is gathered along the path. Nothing is recomputed.
        """
        p = self.pending
        if p is None:
            raise RuntimeError("commit() without a pending forward pass")
        path = check_commit_path(path, p.parents)
        n = len(path)
        if n:
            base = self.n_past
            for d, i in enumerate(path):
                if i != d:
                    for cache in self.kv.values():
                        cache.move(base + d, base + i)
            for layer in self.ssm:
                st = p.ssm_states[layer]
                if p.ssm_per_token:
                    self.ssm[layer] = st[path[-1]].copy()
                else:
                    if path != list(range(p.n_tokens)):
                        raise ValueError("a chain forward without checkpoints can only be committed whole")
                    self.ssm[layer] = st
                k1 = self.conv[layer].shape[0]
                rows = np.concatenate([self.conv[layer], p.raw_rows[layer][path]], axis=0)
                self.conv[layer] = rows[-k1:].copy()
            self.n_past += n
        self.pending = None

    def truncate(self, n: int) -> None:
        """Forget committed tokens past n (attention-only models; recurrent state cannot be rewound)."""
        if self.ssm and n != self.n_past:
            raise ValueError("cannot truncate a model with recurrent layers; restore a snapshot instead")
        self.n_past = min(self.n_past, n)
        self.pending = None

    def snapshot(self) -> SequenceState:
        """A deep copy of the committed state (KV only up to n_past)."""
        return SequenceState(
            max_ctx=self.max_ctx,
            kv={i: c.copy() for i, c in self.kv.items()},
            ssm={i: a.copy() for i, a in self.ssm.items()},
            conv={i: a.copy() for i, a in self.conv.items()},
            n_past=self.n_past,
        )
