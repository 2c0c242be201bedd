"""Building blocks shared by the model files: norms, RoPE, masked attention, SwiGLU, Gated DeltaNet.

All functions are plain float32 NumPy on one sequence (no batch axis); they are the reference the GPU
kernels are checked against.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; `w` is the plain multiplicative weight (GGUF convention)."""
    y = x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))
    return y * w if w is not None else y


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    # FLA / HF convention: x * rsqrt(sum(x^2) + eps)
    return x * (1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x).astype(x.dtype)


def rope_neox(x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """NeoX (half-split) rotary embedding on the first `n_rot` dims of each head.

    x: (T, H, D); positions: (T,). Dims past n_rot pass through (partial rotary, as in Qwen3.5).
    """
    half = n_rot // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, n_rot, 2, dtype=np.float32) / n_rot))
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]          # (T, half)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:n_rot] = x2 * cos + x1 * sin
    return out


# Index arrays and masks that depend only on a step's tree shape, built once per shape: a verify pass asks for
# the same ones in every layer, and speculative decoding repeats shapes across steps. Entries are read-only.
_SHAPE_CACHE: dict = {}
_SHAPE_CACHE_MAX = 512


def _shape_cached(key, build):
    hit = _SHAPE_CACHE.get(key)
    if hit is None:
        if len(_SHAPE_CACHE) >= _SHAPE_CACHE_MAX:
            _SHAPE_CACHE.clear()
        hit = build()
        for a in hit if isinstance(hit, tuple) else (hit,):
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
        _SHAPE_CACHE[key] = hit
    return hit


def _parents_key(parents) -> bytes:
    return np.ascontiguousarray(parents, dtype=np.int64).tobytes()


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """A[i, j] = True when new token j is token i or one of its ancestors (parents[i] < i, -1 = none).

    The result is shared per tree shape and read-only.
    """
    def build() -> np.ndarray:
        T = len(parents)
        if T and np.array_equal(parents, np.arange(-1, T - 1)):
            return np.tril(np.ones((T, T), dtype=bool))
        a = np.zeros((T, T), dtype=bool)
        for i, p in enumerate(parents):
            if p >= 0:
                a[i] = a[p]
            a[i, i] = True
        return a

    return _shape_cached(("anc", _parents_key(parents)), build)


def masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray | None) -> np.ndarray:
    """Grouped-query attention of T queries over S keys.

    q: (T, H, D); k, v: (S, Hkv, D); visible: (T, S) bool, or None when every query sees every key. Query
    head h reads KV head h // (H / Hkv). Returns (T, H, D). The products are batched matmuls (BLAS), which at
    these sizes cost a fraction of the equivalent einsum contractions.
    """
    T, H, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    g = H // Hkv
    qh = q.reshape(T, Hkv, g, D).transpose(1, 2, 0, 3).reshape(Hkv, g * T, D)      # rows (g, T) per KV head
    scores = (qh @ k.transpose(1, 2, 0)).reshape(Hkv, g, T, S)
    scores *= np.float32(1.0 / np.sqrt(D))
    if visible is not None and not visible.all():
        scores = np.where(visible[None, None], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p.reshape(Hkv, g * T, S) @ v.transpose(1, 0, 2)                    # (Hkv, g*T, D)
    return out.reshape(Hkv, g, T, D).transpose(2, 0, 1, 3).reshape(T, H, D).astype(np.float32)


# OpenBLAS multiplies by a weight matrix far more cheaply per token in some batch widths than in others
# (measured on this repository's AVX-512 machine, one thread, the default model's products): one token is a
# GEMV that streams the weights once; from two tokens on it is a GEMM that also packs them, ~2.4x one token
# whether 2 or 8 tokens (in a full forward, where the weights come from memory, 2 GEMVs are still ~5% cheaper
# than a 2-token GEMM; 3 GEMVs are dearer than a 4-wide GEMM); and a GEMM of an odd width or one that is not a
# multiple of 4 is slow (15 columns cost 1.6x 16, 23 cost 1.3x 24, 7 cost 1.5x 8). Small batches are therefore
# split or zero-padded; each real row is the product of that row alone, so results do not change.
PAD_MAX_ROWS = 64
GEMV_MAX_ROWS = 2


def padded_rows(t: int) -> int:
    """Rows to give a GEMM of t token rows: t past PAD_MAX_ROWS or at a multiple of 4, else the next multiple of 4
    (of 8 when that is at most 3 rows more)."""
    if t > PAD_MAX_ROWS or t % 4 == 0:
        return t
    return -(-t // 8) * 8 if t % 8 > 4 else -(-t // 4) * 4


def linear_rows(linear, x, w):
    """`linear(x, w)` for a NumPy batch of token rows, split into GEMVs or zero-padded as measured fastest."""
    t = x.shape[0]
    if not isinstance(x, np.ndarray) or t == 1:
        return linear(x, w)
    if t <= GEMV_MAX_ROWS:
        return np.concatenate([linear(x[r:r + 1], w) for r in range(t)], axis=0)
    n = padded_rows(t)
    if n == t:
        return linear(x, w)
    xp = np.zeros((n,) + x.shape[1:], dtype=x.dtype)
    xp[:t] = x
    return linear(xp, w)[:t]


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, linear) -> np.ndarray:
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def swiglu_stacked(x: np.ndarray, w_gate_up, w_down, linear) -> np.ndarray:
    """SwiGLU with the gate and up projections stacked into one matrix (gate rows first): one product."""
    gu = linear(x, w_gate_up)
    n = gu.shape[-1] // 2
    return linear(silu(gu[:, :n]) * gu[:, n:], w_down)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet


def conv_window_ids(parents: np.ndarray, width: int) -> np.ndarray:
    """For each new token, the rows of [committed window (width-1 rows) ; new raw rows] its causal conv reads.

    The window follows the parent chain, so a tree token convolves over its own ancestors; when the chain
    reaches the committed context the remaining taps come from the committed window (oldest row first).
    Shared per tree shape and read-only.
    """
    def build() -> np.ndarray:
        T = len(parents)
        base = width - 1
        if np.array_equal(parents, np.arange(-1, T - 1)):
            return (np.arange(T)[:, None] + np.arange(width)[None, :]).astype(np.int64)
        ids = np.empty((T, width), dtype=np.int64)
        for t in range(T):
            chain = []
            cur = t
            while len(chain) < width and cur >= 0:
                chain.append(base + cur)
                cur = int(parents[cur])
            c = base - 1
            while len(chain) < width:
                chain.append(c)
                c -= 1
            ids[t] = chain[::-1]
        return ids

    return _shape_cached(("conv", width, _parents_key(parents)), build)


def causal_conv(window: np.ndarray, raw: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Depthwise causal conv + SiLU. window: (K-1, C) committed raw rows; raw: (T, C); w: (C, K)."""
    buf = np.concatenate([window, raw], axis=0)
    # one multiply-add per tap over (T, C) rows instead of a (T, K, C) einsum: ~1.7x cheaper at verify widths
    # (and bit-identical to the einsum in our checks: the K taps are summed in the same order)
    acc = buf[ids[:, 0]] * w[:, 0]
    for j in range(1, w.shape[1]):
        acc += buf[ids[:, j]] * w[:, j]
    return silu(acc)


def gated_delta_rule_tree(q, k, v, g, beta, s0, parents):
    """Token-by-token gated delta rule where token t starts from its parent's state.

    q, k: (T, H, dk) normalised (q already scaled), v: (T, H, dv), g, beta: (T, H), s0: (H, dk, dv).
    Returns outputs (T, H, dv) and the state after every token (T, H, dk, dv): the rollback checkpoints.
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    out = np.empty((T, H, dv), dtype=np.float32)
    states = np.empty((T, H, dk, dv), dtype=np.float32)
    alpha = np.exp(g)
    for t in range(T):
        p = int(parents[t])
        s = (s0 if p < 0 else states[p]) * alpha[t][:, None, None]
        kv = np.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - kv)
        s = s + k[t][:, :, None] * delta[:, None, :]
        states[t] = s
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, states


class TreeStates:
    """Per-node recurrent states of a WY tree pass, built on demand: S_t = e^{G_t} S0 + sum_j e^{G_t-G_j} k_j u_j^T.

    Indexing gives node t's state (H, dk, dv), i.e. the rollback checkpoint a commit needs, without
    materialising all T of them (a verify commits one node per layer).
    """

    def __init__(self, s0: np.ndarray, kh: np.ndarray, u: np.ndarray, decay: np.ndarray, eg: np.ndarray):
        self.s0, self.kh, self.u, self.decay, self.eg = s0, kh, u, decay, eg

    def __len__(self) -> int:
        return self.kh.shape[1]

    def __getitem__(self, t: int) -> np.ndarray:
        w = self.decay[:, t, :]                                              # (H, T), 0 off t's path
        on = np.flatnonzero(w.any(axis=0))
        kw = self.kh[:, on] * w[:, on, None]                                 # (H, n, dk)
        return (self.eg[:, t, None, None] * self.s0 + kw.transpose(0, 2, 1) @ self.u[:, on]).astype(np.float32)

    def all(self) -> np.ndarray:
        return np.stack([self[t] for t in range(len(self))])


FLUSH_LOG = 69.0            # e^-69 ~ 1e-30: decay factors below it are flushed to zero (see gated_delta_rule_tree_wy)


def _wy_tree_consts(anc: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Per tree shape: the ancestor mask as float64, the strict-ancestor mask, and how many doubling steps
    invert (I + A) for it (A is nonzero on strict ancestors only, so A^d = 0 past the longest root path d)."""
    def build():
        T = anc.shape[0]
        longest = int(anc.sum(axis=1).max()) if T else 1
        strict = (anc & ~np.eye(T, dtype=bool)).astype(np.float32)
        return anc.astype(np.float64), strict, int(np.ceil(np.log2(max(longest, 1))))

    return _shape_cached(("wy", anc.shape[0], np.packbits(anc).tobytes()), build)


def gated_delta_rule_tree_wy(q, k, v, g, beta, s0, parents, anc: np.ndarray | None = None):
    """The tree recurrence of `gated_delta_rule_tree` in one WY (chunked) pass, for a verify tree of <= ~64 tokens.

    Along any root-to-node path the tree is a chain, and the chain's WY system only couples a token to its
    ancestors; so the strictly-lower-triangular masks of the chunked form become ancestor masks, and one
    solve gives every node's "new value" u_t = (I + A)^-1 beta_t (v_t - e^{G_t} S0^T k_t). Then
    o_t = e^{G_t} q_t S0 + sum_{j anc-or-self} e^{G_t-G_j} (q_t.k_j) u_j, G_t the log-decay summed along t's path.
    Outputs (T, H, dv) equal the token loop's to float32 rounding; the per-node states come as a `TreeStates`
    (evaluated per node on demand).

    The solve: A is nilpotent (strict ancestors only), so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...; the factors
    are multiplied out on the (T, T) matrices (ceil(log2(longest path)) squarings and products, each far
    cheaper than one on the (T, dv) right-hand side), then applied once. Measured ~3x cheaper here than
    np.linalg.solve (whose per-call cost dominates at these sizes), and ~2x cheaper than applying each factor
    to the right-hand side in turn.
    """
    if anc is None:
        anc = ancestor_matrix(np.asarray(parents))
    anc64, strict, n_doublings = _wy_tree_consts(anc)
    gam = np.ascontiguousarray(g.T, dtype=np.float64) @ anc64.T                # (H, T): G_t over t's path
    # G_t - G_j <= 0 for every ancestor j of t; elsewhere it is masked out (clamped first so exp cannot overflow).
    # Factors below e^-FLUSH_LOG are set to 0: far below float32 resolution next to the path's own terms, and
    # left in they turn into subnormal float32 values that make every product touching them ~10x slower
    # (strongly decaying heads reach G = -30 per token on the default model).
    diff = np.minimum(gam[:, :, None] - gam[:, None, :], 0.0)
    decay = (np.where(diff > -FLUSH_LOG, np.exp(diff), 0.0) * anc64).astype(np.float32)
    eg = np.where(gam > -FLUSH_LOG, np.exp(gam), 0.0).astype(np.float32)   # (H, T)
    kh = k.transpose(1, 0, 2)                                                # (H, T, dk)
    qh = q.transpose(1, 0, 2)
    bh = beta.T[:, :, None]                                                  # (H, T, 1)

    # The solve runs in float64: powers of A reach far below float32's normal range (subnormals again).
    a = ((kh @ kh.transpose(0, 2, 1)) * strict * decay * bh).astype(np.float64)              # A
    rhs = (v.transpose(1, 0, 2) * bh).astype(np.float64) - \
        ((kh * eg[:, :, None]) * bh).astype(np.float64) @ s0.astype(np.float64)           # beta (v - e^G S0^T k)
    inv = np.eye(a.shape[-1]) - a                                            # (I + A)^-1, one factor at a time
    for _ in range(n_doublings - 1):
        a = a @ a
        inv = inv + inv @ a
    u = (inv @ rhs).astype(np.float32)                                       # (H, T, dv): the new values
    out = (qh * eg[:, :, None]) @ s0 + ((qh @ kh.transpose(0, 2, 1)) * decay) @ u
    return out.transpose(1, 0, 2).astype(np.float32), TreeStates(s0, kh, u, decay, eg)


def gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk: int = 64):
    """Chunked (WY) form of the gated delta rule for prefill: same outputs as the token loop, final state only.

    Shapes as in `gated_delta_rule_tree` (a linear chain). Returns (out (T, H, dv), final state (H, dk, dv)).
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T

    def padded(a):
        if pad == 0:
            return a
        return np.concatenate([a, np.zeros((pad,) + a.shape[1:], dtype=a.dtype)], axis=0)

    # (H, N, C, ...) layout; padded tokens have g = 0 and beta = 0, so they leave the state untouched.
    qc = padded(q).reshape(n_chunks, chunk, H, dk).transpose(2, 0, 1, 3)
    kc = padded(k).reshape(n_chunks, chunk, H, dk).transpose(2, 0, 1, 3)
    vc = padded(v).reshape(n_chunks, chunk, H, dv).transpose(2, 0, 1, 3)
    gc = padded(g).reshape(n_chunks, chunk, H).transpose(2, 0, 1).astype(np.float64)
    bc = padded(beta).reshape(n_chunks, chunk, H).transpose(2, 0, 1)

    gam = np.cumsum(gc, axis=-1)                                             # (H, N, C)
    diff = gam[..., :, None] - gam[..., None, :]
    lower_incl = np.tril(np.ones((chunk, chunk), dtype=bool))
    decay = np.where(lower_incl, np.exp(np.where(lower_incl, diff, 0.0)), 0.0).astype(np.float32)
    eg = np.exp(gam).astype(np.float32)
    eg_last = np.exp(gam[..., -1:] - gam).astype(np.float32)                 # exp(gamma_C - gamma_i)
    g_last = np.exp(gam[..., -1]).astype(np.float32)                         # (H, N)

    kk = np.einsum("hnid,hnjd->hnij", kc * bc[..., None], kc)
    L = np.tril(kk * decay, k=-1)
    eye = np.eye(chunk, dtype=np.float32)
    Tm = np.linalg.inv(eye + L).astype(np.float32)                            # unit lower triangular
    U = Tm @ (vc * bc[..., None])                                            # (H, N, C, dv)
    W = Tm @ (kc * (bc * eg)[..., None])                                     # (H, N, C, dk)
    qk = np.einsum("hnid,hnjd->hnij", qc, kc) * decay                        # incl. diagonal

    out = np.empty((H, n_chunks, chunk, dv), dtype=np.float32)
    s = s0.astype(np.float32).copy()
    for n in range(n_chunks):
        v_new = U[:, n] - W[:, n] @ s
        out[:, n] = (qc[:, n] * eg[:, n, :, None]) @ s + qk[:, n] @ v_new
        s = g_last[:, n, None, None] * s + np.einsum("hcd,hce->hde", kc[:, n] * eg_last[:, n, :, None], v_new)
    out = out.transpose(1, 2, 0, 3).reshape(n_chunks * chunk, H, dv)[:T]
    return out, s
