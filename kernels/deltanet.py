"""GPU Gated DeltaNet for Qwen3.5 / Qwen3.6 linear-attention layers: conv, q/k norm + gates, tree step, commit.

Launchers for kernels/deltanet.cu (CuPy arrays in, CuPy arrays out; every kernel reads the token count and
the parent list from device buffers, so a captured CUDA graph replays for any tree up to T_max). NumPy twins
in services/engine: `conv_silu` = layers.causal_conv over layers.conv_window_ids; `qk_norm_gate` = the l2-norm,
dk^-0.5 and g / beta lines of models/qwen35._deltanet; `gated_delta_tree` = layers.gated_delta_rule_tree
(and, with no parents and no checkpoints, the recurrent prefill used instead of layers.gated_delta_rule_chunked);
`commit` = state.SequenceState.commit for the recurrent state and the conv window.

    mixed = conv_silu(raw, window, conv_w, parents=par_dev, n_tokens=n_dev)          # (T_max, conv_dim) f32
    g, beta = qk_norm_gate(mixed, alpha, b, ssm_a, dt_bias, n_k_heads=16, head_k_dim=128, n_tokens=n_dev)
    kd = 16 * 128
    o = gated_delta_tree(mixed[:, :kd], mixed[:, kd:2 * kd], mixed[:, 2 * kd:], g, beta, ssm_state,
                         parents=par_dev, n_tokens=n_dev, checkpoints=ckpt)           # (T_max, Hv, dv) f32
    commit(accepted_dev, par_dev, ckpt, ssm_state, raw, window)                        # after verification

State and checkpoints are float32; raw rows, alpha / b projections and q / k / v may be float16 or float32
(fp32 arithmetic throughout). A parent outside -1..t-1 in a device list is read as -1 (a root) so that a bad
list cannot make a kernel read outside its buffers; lists given as NumPy arrays are checked here.

Prefill uses the recurrent kernel (parents=None, no checkpoints), not the chunked WY form: on an H200 it was 1.9x
faster than the chunked form as a torch program (docs/gpu_deltanet.md has the why and all measurements).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import loader

SOURCE = "deltanet.cu"
MAX_GRID_Y = 65535  # tokens beyond this loop inside the kernels (grid-stride over t)
DEFAULT_DEPTH = 8  # tokens in flight in the tree step (docs/gpu_deltanet.md has the measurements)
DEFAULT_WARPS = 2
_smem_configured: set[tuple] = set()


def slot_bytes(head_k_dim: int, itemsize: int) -> int:
    """Shared-memory bytes of one token slot of gdr_tree_staged_kernel (k and q rows, v words, g / beta / parent)."""
    return 2 * head_k_dim * itemsize + 128 + 16


def _defines(portable: bool) -> tuple[str, ...]:
    return ("SPECSPLIT_PORTABLE",) if portable else ()


def _ctype(dtype: Any, what: str) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "float"
    if dtype == np.float16:
        return "unsigned short"
    raise ValueError(f"{what} must be float16 or float32, not {dtype}")


def _fn(name: str, portable: bool) -> Any:
    return loader.get_function(SOURCE, name, _defines(portable))


def _null() -> np.uint64:
    return np.uint64(0)


def _rows(a: Any, what: str, width: int | None = None, align: int = 4) -> tuple[Any, int]:
    """A 2-D cupy array with contiguous rows -> (array, row stride in elements); checks vector alignment."""
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D [tokens, features], not shape {tuple(a.shape)}")
    item = a.dtype.itemsize
    if width is not None and int(a.shape[1]) != width:
        raise ValueError(f"{what} has {int(a.shape[1])} features per row, expected {width}")
    if int(a.shape[0]) > 1 and (a.strides[0] % item or a.strides[0] < a.shape[1] * item):
        raise ValueError(f"{what}: rows must not overlap (row stride {a.strides[0]} bytes)")
    if int(a.shape[1]) > 1 and a.strides[1] != item:
        raise ValueError(f"{what}: each row must be contiguous")
    ld = a.strides[0] // item if int(a.shape[0]) > 1 else int(a.shape[1])
    if align > 1 and (a.data.ptr % (align * item) or ld % align):
        raise ValueError(f"{what}: rows must start on {align * item}-byte boundaries for vector loads")
    return a, ld


def _f32(a: Any, shape: tuple[int, ...], what: str) -> Any:
    if a.dtype != np.float32 or tuple(a.shape) != shape or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous float32 array of shape {shape}, not {a.dtype} {tuple(a.shape)}")
    return a


def device_parents(parents: Any, t_max: int | None = None) -> Any:
    """Parents as a device int32 array (NumPy input is checked: -1 or an earlier token for each entry)."""
    cupy = loader.require()
    if isinstance(parents, cupy.ndarray):
        if parents.dtype != np.int32 or parents.ndim != 1:
            raise ValueError("a device parent list must be a 1-D int32 cupy array")
        return parents
    p = np.asarray(parents)
    if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError("parents must be a 1-D integer array")
    bad = np.nonzero((p < -1) | (p >= np.arange(len(p))))[0]
    if len(bad):
        t = int(bad[0])
        raise ValueError(f"parents[{t}] = {int(p[t])}: each parent must be -1 or an earlier token")
    n = len(p) if t_max is None else max(t_max, len(p))
    out = np.full(n, -1, np.int32)
    out[: len(p)] = p
    return cupy.asarray(out)


def _n_tokens(n_tokens: Any, t_max: int) -> Any:
    cupy = loader.require()
    if n_tokens is None:
        return _null()
    if isinstance(n_tokens, cupy.ndarray):
        if n_tokens.dtype != np.int32 or n_tokens.size < 1:
            raise ValueError("n_tokens must be an int32 cupy array holding the token count in element 0")
        return n_tokens
    n = int(n_tokens)
    if not 0 <= n <= t_max:
        raise ValueError(f"n_tokens = {n} is outside 0..{t_max}")
    return cupy.asarray(np.array([n], np.int32))


def _parents_arg(parents: Any, t_max: int) -> Any:
    if parents is None:
        return _null()
    p = device_parents(parents, t_max)
    if int(p.size) < t_max:
        raise ValueError(f"the parent list has {int(p.size)} entries, the launch covers {t_max} tokens")
    return p


# ---------------------------------------------------------------------------------------------- conv


def conv_silu(
    raw: Any,
    window: Any,
    weight: Any,
    *,
    parents: Any = None,
    n_tokens: Any = None,
    out: Any = None,
    rows_out: Any = None,
    portable: bool = False,
) -> Any:
    """SiLU(depthwise causal conv) of T_max new raw rows whose windows follow their parent chains.

    raw: (T_max, C) float16/float32; window: (K-1, C) float32 committed raw rows (oldest first); weight: (C, K)
    float32; parents: None (a chain) or T_max parents (device int32, or NumPy to be checked and uploaded);
    n_tokens: None (= T_max), an int, or a device int32 [1] (rows past it are not written). -> (T_max, C) f32.
    rows_out: (>= T_max, C) float32 with contiguous rows, receives the raw rows in the same launch (the pre-conv
    rows commit_conv gathers; `raw` may then be a strided view of the projection, nothing copies it first).
    """
    cupy = loader.require()
    raw, ld_raw = _rows(cupy.asarray(raw), "raw", align=1)
    t_max, c = (int(s) for s in raw.shape)
    if weight.ndim != 2 or int(weight.shape[0]) != c or not 2 <= int(weight.shape[1]) <= 8:
        raise ValueError(f"conv weight must be (C={c}, K) with K in 2..8, not {tuple(weight.shape)}")
    kw = int(weight.shape[1])
    _f32(weight, (c, kw), "conv weight")
    _f32(window, (kw - 1, c), "conv window")
    if out is None:
        out = cupy.empty((t_max, c), dtype=cupy.float32)
    out, ld_out = _rows(out, "out", width=c, align=1)
    if out.dtype != np.float32 or int(out.shape[0]) < t_max:
        raise ValueError(f"out must be float32 with at least {t_max} rows")
    grid = ((c + 127) // 128, max(1, min(t_max, MAX_GRID_Y)))
    args = (raw, np.int64(ld_raw), window, weight, _parents_arg(parents, t_max), _n_tokens(n_tokens, t_max),
            np.int32(t_max), np.int32(c), out, np.int64(ld_out))  # fmt: skip
    if rows_out is None:
        _fn(f"conv_silu_kernel<{_ctype(raw.dtype, 'raw')}, {kw}>", portable)(grid, (128,), args)
        return out
    rows_out, ld_rows = _rows(rows_out, "rows_out", width=c, align=1)
    if rows_out.dtype != np.float32 or int(rows_out.shape[0]) < t_max:
        raise ValueError(f"rows_out must be float32 with at least {t_max} rows")
    kern = _fn(f"conv_silu_rows_kernel<{_ctype(raw.dtype, 'raw')}, {kw}>", portable)
    kern(grid, (128,), (*args, rows_out, np.int64(ld_rows)))
    return out


# ---------------------------------------------------------------------------------------------- norm + gates


def qk_norm_gate(
    mixed: Any,
    alpha: Any,
    b: Any,
    ssm_a: Any,
    dt_bias: Any,
    *,
    n_k_heads: int,
    head_k_dim: int,
    n_tokens: Any = None,
    eps: float = 1e-6,
    q_scale: float | None = None,
    g: Any = None,
    beta: Any = None,
    portable: bool = False,
) -> tuple[Any, Any]:
    """In place: l2-normalise the q and k heads at the start of each row of `mixed` (q also * dk^-0.5), and
    compute g = ssm_a * softplus(alpha + dt_bias), beta = sigmoid(b). Returns (g, beta), each (T_max, Hv) f32.

    mixed: (T_max, >= 2 * n_k_heads * head_k_dim) float32 (the conv output: q heads, k heads, v heads);
    alpha, b: (T_max, Hv) float16/float32 projections; ssm_a, dt_bias: (Hv,) float32.
    """
    cupy = loader.require()
    mixed, ld = _rows(mixed, "mixed", align=1)
    if mixed.dtype != np.float32:
        raise ValueError("mixed (the conv output) must be float32")
    t_max = int(mixed.shape[0])
    hk, dk = int(n_k_heads), int(head_k_dim)
    if dk not in (32, 64) and dk % 128:
        raise ValueError(f"head_k_dim must be 32, 64 or a multiple of 128, not {dk}")
    if int(mixed.shape[1]) < 2 * hk * dk:
        raise ValueError(f"mixed has {int(mixed.shape[1])} features, q and k need {2 * hk * dk}")
    if alpha.shape != b.shape or alpha.dtype != b.dtype or alpha.ndim != 2 or int(alpha.shape[0]) != t_max:
        raise ValueError(f"alpha and b must both be (T_max={t_max}, Hv) of one dtype")
    hv = int(alpha.shape[1])
    alpha, ld_ab = _rows(alpha, "alpha", align=1)
    _, ld_b = _rows(b, "b", align=1)
    if ld_b != ld_ab:
        raise ValueError("alpha and b must have the same row stride")
    _f32(ssm_a, (hv,), "ssm_a")
    _f32(dt_bias, (hv,), "dt_bias")
    g = cupy.empty((t_max, hv), cupy.float32) if g is None else _f32(g, (t_max, hv), "g")
    beta = cupy.empty((t_max, hv), cupy.float32) if beta is None else _f32(beta, (t_max, hv), "beta")
    scale = dk**-0.5 if q_scale is None else float(q_scale)
    kern = _fn(f"qk_norm_gate_kernel<{_ctype(alpha.dtype, 'alpha')}, {dk}>", portable)
    warps = 4
    grid = (max(1, (2 * hk + warps - 1) // warps), max(1, min(t_max, MAX_GRID_Y)))
    kern(grid, (32 * warps,), (mixed, np.int64(ld), np.int32(hk), np.float32(scale), np.float32(eps), alpha, b,
                               np.int64(ld_ab), ssm_a, dt_bias, np.int32(hv), g, beta, np.int64(hv),
                               _n_tokens(n_tokens, t_max), np.int32(t_max)))  # fmt: skip
    return g, beta


# ---------------------------------------------------------------------------------------------- delta rule


def gated_delta_tree(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    s0: Any,
    *,
    parents: Any = None,
    n_tokens: Any = None,
    checkpoints: Any = None,
    final_state: Any = None,
    out: Any = None,
    cols_per_warp: int = 8,
    warps: int = DEFAULT_WARPS,
    depth: int = DEFAULT_DEPTH,
    portable: bool = False,
) -> Any:
    """Gated delta rule over a tree (or a chain) of new tokens; returns out (T_max, Hv, dv) float32.

    q, k: (T_max, Hk * dk) normalised (q scaled), v: (T_max, Hv * dv), all float16 or all float32 with contiguous
    rows (views of the conv output are fine); g, beta: (T_max, Hv) float32; s0: (Hv, dk, dv) float32 committed
    state (read only unless it is also final_state). Value head h reads key head h % Hk.
    parents: None (a chain: decode, prefill) or a device/NumPy parent list; a tree needs `checkpoints`.
    checkpoints: (>= T_max, Hv, dk, dv) float32: the state after every token (the rollback points).
    final_state: (Hv, dk, dv) float32 to receive the last token's state (may be s0: an in-place chain step).
    cols_per_warp (4, 8), warps (1..4 per block): the layout (see kernels/deltanet.cu); depth: tokens whose inputs
    are in flight at once: 1 = gdr_tree_kernel (prefetch one token in registers), 2..16 = gdr_tree_staged_kernel
    (a cp.async ring of `depth` token slots per warp in shared memory).
    """
    cupy = loader.require()
    if s0.ndim != 3:
        raise ValueError(f"s0 must be (Hv, dk, dv), not shape {tuple(s0.shape)}")
    hv, dk, dv = (int(s) for s in s0.shape)
    _f32(s0, (hv, dk, dv), "s0")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k and v must share one dtype")
    vec = 4 if q.dtype == np.float32 else 8
    depth = int(depth)
    if not 1 <= depth <= 16:
        raise ValueError(f"depth must be 1..16 tokens, not {depth}")
    q, ld_qk = _rows(q, "q", align=vec)
    k, ld_k = _rows(k, "k", width=int(q.shape[1]), align=vec)
    if ld_k != ld_qk:
        raise ValueError("q and k must have the same row stride")
    t_max = int(q.shape[0])
    if int(q.shape[1]) % dk:
        raise ValueError(f"q has {int(q.shape[1])} features, not a multiple of dk = {dk}")
    hk = int(q.shape[1]) // dk
    if hk < 1 or hv % hk:
        raise ValueError(f"{hv} value heads cannot read {hk} key heads (h -> h % Hk needs Hk | Hv)")
    v, ld_v = _rows(v, "v", width=hv * dv, align=1 if v.dtype == np.float32 else 2)  # 4-byte words
    if int(v.shape[0]) != t_max or int(k.shape[0]) != t_max:
        raise ValueError("q, k and v must have the same number of rows")
    _f32(g, (t_max, hv), "g")
    _f32(beta, (t_max, hv), "beta")
    cw, nw = int(cols_per_warp), int(warps)
    if cw not in (4, 8) or not 1 <= nw <= 4 or dv % (cw * nw):
        raise ValueError(f"cols_per_warp in (4, 8), warps in 1..4 and dv = {dv} a multiple of their product")
    if dk % (32 // cw * 8):
        raise ValueError(f"dk = {dk} must be a multiple of {32 // cw * 8} for cols_per_warp = {cw}")
    if parents is not None and checkpoints is None:
        raise ValueError("a tree step (parents given) needs a checkpoints buffer to reload parent states from")
    if checkpoints is not None:
        if (checkpoints.dtype != np.float32 or checkpoints.ndim != 4 or int(checkpoints.shape[0]) < t_max
                or tuple(checkpoints.shape[1:]) != (hv, dk, dv) or not checkpoints.flags.c_contiguous):  # fmt: skip
            raise ValueError(f"checkpoints must be contiguous float32 (>= {t_max}, {hv}, {dk}, {dv})")
    if final_state is not None:
        _f32(final_state, (hv, dk, dv), "final_state")
    if out is None:
        out = cupy.empty((t_max, hv * dv), dtype=cupy.float32)
    out = out.reshape(int(out.shape[0]), -1) if out.ndim == 3 else out
    out, ld_out = _rows(out, "out", width=hv * dv, align=1)
    if out.dtype != np.float32 or int(out.shape[0]) < t_max:
        raise ValueError(f"out must be float32 with at least {t_max} rows")
    ct = _ctype(q.dtype, "q")
    smem = 0
    if depth == 1:
        kern = _fn(f"gdr_tree_kernel<{ct}, {dk}, {cw}>", portable)
    else:
        kern = _fn(f"gdr_tree_staged_kernel<{ct}, {dk}, {cw}, {depth}>", portable)
        smem = nw * depth * slot_bytes(dk, q.dtype.itemsize)
        if smem > 48 * 1024:
            key = (ct, dk, cw, depth, portable, int(cupy.cuda.runtime.getDevice()))
            if key not in _smem_configured:
                kern.max_dynamic_shared_size_bytes = smem  # opt in above the 48 KiB default
                _smem_configured.add(key)
    grid = (hv * dv // (cw * nw),)
    kern(grid, (32 * nw,), (q, k, np.int64(ld_qk), v, np.int64(ld_v), g, beta, np.int64(hv), np.int32(hk),
                            np.int32(hv), np.int32(dv), s0, _parents_arg(parents, t_max), _n_tokens(n_tokens, t_max),
                            np.int32(t_max), _null() if checkpoints is None else checkpoints,
                            _null() if final_state is None else final_state, out, np.int64(ld_out)),
         shared_mem=smem)  # fmt: skip
    return out.reshape(int(out.shape[0]), hv, dv)


# ---------------------------------------------------------------------------------------------- commit


def _layered(a: Any, inner: int, what: str) -> tuple[Any, int, int]:
    """(array, layers, layer stride in elements) for an array with an optional leading layer axis."""
    if a.ndim == inner:
        return a, 1, 0
    if a.ndim != inner + 1:
        raise ValueError(f"{what} must have {inner} dims, or {inner + 1} with a leading layer axis")
    return a, int(a.shape[0]), int(a.strides[0] // a.dtype.itemsize)


def commit_state(accepted: Any, checkpoints: Any, state: Any, *, portable: bool = False) -> None:
    """state[l] = checkpoints[l][accepted] on the device (accepted: device int32 [1]; < 0 keeps the state).

    checkpoints: ([L,] T_max, Hv, dk, dv) float32; state: ([L,] Hv, dk, dv) float32, each layer contiguous.
    """
    loader.require()  # a clear error without CuPy or a GPU
    state, layers, s_stride = _layered(state, 3, "state")
    checkpoints, c_layers, c_stride = _layered(checkpoints, 4, "checkpoints")
    if layers != c_layers or tuple(checkpoints.shape[-3:]) != tuple(state.shape[-3:]):
        raise ValueError(f"checkpoints {tuple(checkpoints.shape)} do not match state {tuple(state.shape)}")
    if state.dtype != np.float32 or checkpoints.dtype != np.float32:
        raise ValueError("state and checkpoints must be float32")
    n = int(np.prod(state.shape[-3:]))
    for a, what in ((state, "state"), (checkpoints, "checkpoints")):
        inner = a[0] if a.ndim > (3 if a is state else 4) else a
        if not inner.flags.c_contiguous or a.data.ptr % 16 or n % 4 or (s_stride % 4 if a is state else c_stride % 4):
            raise ValueError(f"{what}: each layer must be contiguous and 16-byte aligned")
    t_max = int(checkpoints.shape[-4])
    acc = _accepted(accepted)
    blocks = max(1, min((n // 4 + 255) // 256, 1024))
    _fn("ssm_commit_kernel", portable)(
        (blocks, layers), (256,),
        (checkpoints, np.int64(c_stride), state, np.int64(s_stride), acc, np.int32(t_max), np.int64(n)),
    )  # fmt: skip


def commit_conv(accepted: Any, parents: Any, raw: Any, window: Any, *, portable: bool = False) -> None:
    """window[l] = newest K-1 rows of [window[l] ; raw[l] rows along the root -> accepted path], on the device.

    raw: ([L,] T_max, C) float16/float32 pre-conv rows of the step; window: ([L,] K-1, C) float32 contiguous.
    """
    window, layers, w_stride = _layered(window, 2, "window")
    raw, r_layers, r_stride = _layered(raw, 2, "raw")
    if layers != r_layers or int(window.shape[-1]) != int(raw.shape[-1]):
        raise ValueError(f"raw {tuple(raw.shape)} does not match window {tuple(window.shape)}")
    if window.dtype != np.float32 or not window.flags.c_contiguous:
        raise ValueError("window must be contiguous float32")
    kw = int(window.shape[-2]) + 1
    if not 2 <= kw <= 8:
        raise ValueError(f"the conv window must hold 1..7 rows, not {kw - 1}")
    c = int(window.shape[-1])
    item = raw.dtype.itemsize
    if raw.strides[-1] != item:
        raise ValueError("raw rows must be contiguous")
    ld_raw = raw.strides[-2] // item
    t_max = int(raw.shape[-2])
    kern = _fn(f"conv_commit_kernel<{_ctype(raw.dtype, 'raw')}, {kw}>", portable)
    kern(((c + 127) // 128, layers), (128,),
         (window, np.int64(w_stride), raw, np.int64(ld_raw), np.int64(r_stride), _parents_arg(parents, t_max),
          _accepted(accepted), np.int32(t_max), np.int32(c)))  # fmt: skip


def commit(
    accepted: Any, parents: Any, checkpoints: Any, state: Any, raw: Any, window: Any, *, portable: bool = False
) -> None:
    """Keep the root -> `accepted` path of a verified tree: recurrent state from its checkpoint, conv window
    gathered along it (state.SequenceState.commit, without a host round trip; accepted is a device int32 [1])."""
    commit_state(accepted, checkpoints, state, portable=portable)
    commit_conv(accepted, parents, raw, window, portable=portable)


def _accepted(accepted: Any) -> Any:
    cupy = loader.require()
    if isinstance(accepted, cupy.ndarray):
        if accepted.dtype != np.int32 or accepted.size < 1:
            raise ValueError("accepted must be an int32 cupy array holding the node index in element 0")
        return accepted
    return cupy.asarray(np.array([int(accepted)], np.int32))


# ---------------------------------------------------------------------------------------------- one layer


def deltanet_core(
    raw: Any,
    alpha: Any,
    b: Any,
    window: Any,
    conv_weight: Any,
    ssm_a: Any,
    dt_bias: Any,
    state: Any,
    *,
    n_k_heads: int,
    head_k_dim: int,
    parents: Any = None,
    n_tokens: Any = None,
    checkpoints: Any = None,
    final_state: Any = None,
    portable: bool = False,
) -> tuple[Any, Any]:
    """conv -> q/k norm + gates -> delta rule of one layer (qwen35._deltanet between the projections and the
    output norm). Returns (out (T_max, Hv, dv) f32, mixed (T_max, conv_dim) f32 conv output)."""
    mixed = conv_silu(raw, window, conv_weight, parents=parents, n_tokens=n_tokens, portable=portable)
    g, beta = qk_norm_gate(mixed, alpha, b, ssm_a, dt_bias, n_k_heads=n_k_heads, head_k_dim=head_k_dim,
                           n_tokens=n_tokens, portable=portable)  # fmt: skip
    kd = n_k_heads * head_k_dim
    out = gated_delta_tree(mixed[:, :kd], mixed[:, kd : 2 * kd], mixed[:, 2 * kd :], g, beta, state,
                           parents=parents, n_tokens=n_tokens, checkpoints=checkpoints, final_state=final_state,
                           portable=portable)  # fmt: skip
    return out, mixed


def warmup(portable: bool = False) -> None:
    """Compile the Qwen3.6 variants up front (each is built on first use otherwise)."""
    for t in ("float", "unsigned short"):
        _fn(f"conv_silu_kernel<{t}, 4>", portable)
        _fn(f"qk_norm_gate_kernel<{t}, 128>", portable)
        _fn(f"gdr_tree_kernel<{t}, 128, 8>", portable)
        _fn(f"gdr_tree_staged_kernel<{t}, 128, 8, {DEFAULT_DEPTH}>", portable)
        _fn(f"conv_commit_kernel<{t}, 4>", portable)
    _fn("ssm_commit_kernel", portable)


def state_bytes(n_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """Bytes of one layer's recurrent state (one checkpoint slot)."""
    return 4 * n_v_heads * head_k_dim * head_v_dim
