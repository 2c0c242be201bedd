"""GPU Gated DeltaNet for Qwen3.5 / Qwen3.6 linear-attention layers: conv, q/k norm + gates, tree step, commit.

Launchers for kernels/deltanet.cu (CuPy arrays in, CuPy arrays out; every kernel reads the token count and
the parent list from device buffers, so a captured CUDA graph replays for any tree up to T_max). NumPy twins
in services/engine: `conv_silu` = layers.causal_conv over layers.conv_window_ids; `qk_norm_gate` = the l2-norm,
dk^-0.5 and g / beta lines of models/qwen35._deltanet; `gated_delta_tree` = layers.gated_delta_rule_tree
(outputs; with no parents, the recurrent prefill used instead of layers.gated_delta_rule_chunked); `commit` =
state.SequenceState.commit for the recurrent state and the conv window; `tree_plan` = `walk_plan` below.

    plan = tree_plan(par_dev, n_tokens=n_dev)                                         # once per step
    mixed = conv_silu(raw, window, conv_w, parents=par_dev, n_tokens=n_dev)          # (T_max, conv_dim) f32
    g, beta = qk_norm_gate(mixed, alpha, b, ssm_a, dt_bias, n_k_heads=16, head_k_dim=128, n_tokens=n_dev)
    kd = 16 * 128
    q, k, v = mixed[:, :kd], mixed[:, kd:2 * kd], mixed[:, 2 * kd:]
    o = gated_delta_tree(q, k, v, g, beta, ssm_state, plan=plan, n_tokens=n_dev)      # (T_max, Hv, dv) f32
    commit(accepted_dev, par_dev, k, v, g, beta, ssm_state, raw, window)              # after verification

The tree step writes no per-node states: it walks the tree depth first with the states it must come back to in
shared memory, and the commit recomputes the accepted path's state from the committed one (`commit_replay`: the
path's k / v / g / beta, kept from the step, through the same state update; docs/gpu_deltanet.md has the why
and the numbers). The per-node checkpoint path it replaced (`checkpoints=`, `commit_state`, the register-prefetch
depth 1) was removed after commit 3a971f3, where it can be found.

The state is float32; raw rows, alpha / b projections and q / k / v may be float16 or float32
(fp32 arithmetic throughout). A parent outside -1..t-1 in a device list is read as -1 (a root) so that a bad
list cannot make a kernel read outside its buffers; lists given as NumPy arrays are checked here.

Prefill uses the recurrent walk as a chain (parents=None), not the chunked WY form: on an H200 it was 1.9x
faster than the chunked form as a torch program (docs/gpu_deltanet.md has the why and all measurements).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import loader

SOURCE = "deltanet.cu"
MAX_GRID_Y = 65535  # tokens beyond this loop inside the kernels (grid-stride over t)
DEFAULT_DEPTH = 8  # tokens in flight in the tree step and the commit (docs/gpu_deltanet.md has the measurements)
# Programmatic dependent launch (kernels/pdl.cuh, loader.get_function's pdl; SPECSPLIT_PDL) for a layer's chain of
# conv, q/k norm + gates and tree walk at up to PDL_UP_TO tokens: each waits for its inputs first thing, so inside a
# captured step it starts as the kernel ahead of it drains instead of after it. H100, synthetic 27B step replay
# (bench/gemv_ab.py --step-ab dnpdl): 1 token -1.7 / -1.8 %, 2 tokens -0.8 %, 3 +0.5 %, 4 +1.3 %, 23 +1.9 %.
PDL = True
PDL_UP_TO = 2
# The tree walk's committed-state load and the conv's window taps and weights ahead of their grid dependency waits
# (so they overlap the launches before them) where it is safe: PDL launches captured into a graph (_early).
EARLY_STATE = True
DEFAULT_WARPS = 2
DEFAULT_COLS = 8  # state columns a warp owns; the tree step and commit_replay must agree (their sums' order)
PLAN_MAX = 1024  # nodes of a planned tree walk (gdr_tree_plan_kernel packs an index in 16 bits)
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a block may opt in to (sm_80 / sm_90)


def slot_bytes(head_k_dim: int, itemsize: int, with_q: bool = True) -> int:
    """Shared-memory bytes of one token slot of the ring (dn::Slot): the k row (and the q row: the tree step's, not the
    commit's), each lane's v word, g / beta."""
    return (2 if with_q else 1) * head_k_dim * itemsize + 128 + 16


def walk_stack_slots(t_max: int) -> int:
    """States a tree walk of up to t_max nodes keeps at once: floor(log2(t_max + 1)) - 1 (a light child's subtree
    holds at most half of its parent's, so each saved state halves what is left under it)."""
    return max(0, (int(t_max) + 1).bit_length() - 2)


def walk_smem_bytes(head_k_dim: int, itemsize: int, cols_per_warp: int, depth: int, n_slots: int,
                    plan_ints: int) -> int:
    """Shared-memory bytes of one warp of gdr_tree_walk_kernel (WalkSmem): token ring, state stack, plan."""
    return depth * slot_bytes(head_k_dim, itemsize) + n_slots * head_k_dim * cols_per_warp * 4 + 16 * (
        (plan_ints + 3) // 4)


def commit_smem_bytes(head_k_dim: int, itemsize: int, depth: int, t_max: int) -> int:
    """Shared-memory bytes of one warp of gdr_commit_kernel (CommitSmem): ring of k rows, the path, the parents."""
    return depth * slot_bytes(head_k_dim, itemsize, with_q=False) + 2 * 16 * ((t_max + 3) // 4)


def walk_plan(parents: Any) -> np.ndarray:
    """NumPy twin of gdr_tree_plan_kernel: the tree walk's visit order and its state loads / saves, int32 (T,).

    Entry i: node | ro << 15 | load << 16 | save << 24 for the i-th visited node; ro = 1 for a light leaf (not its
    parent's heavy child) evaluated read-only on its parent's state; load 0 = continue from the state in registers
    (the parent's: visited last, or before it only read-only leaves), 1 = the committed state, 2 + j = stack slot j;
    save 0 = none, 1 + j = into slot j. Depth first from the roots in index order; a node's children: its light
    leaves (in index order), its other light children (in index order), the one with the largest subtree (lowest
    index on ties) last. Only nodes with a light child that is not a leaf save; a slot is taken while its node's
    light children are walked (a stack, simulated here)."""
    par = [int(p) if -1 <= int(p) < t else -1 for t, p in enumerate(np.asarray(parents).reshape(-1).tolist())]
    T = len(par)
    size, nch = [1] * T, [0] * T
    kids: list[list[int]] = [[] for _ in range(T + 1)]  # kids[T]: the roots
    for t in reversed(range(T)):
        if par[t] >= 0:
            size[par[t]] += size[t]
            nch[par[t]] += 1
    for t, p in enumerate(par):
        kids[p if p >= 0 else T].append(t)
    heavy = [-1] * T
    for p in range(T):
        for c in kids[p]:
            if heavy[p] < 0 or size[c] > size[heavy[p]]:
                heavy[p] = c
    ro = [par[t] >= 0 and nch[t] == 0 and t != heavy[par[t]] for t in range(T)]
    saves = [any(not ro[c] and c != heavy[t] for c in kids[t]) for t in range(T)]
    order: list[int] = []
    todo = list(reversed(kids[T]))
    while todo:
        n = todo.pop()
        order.append(n)
        light = [c for c in kids[n] if c != heavy[n]]
        visit = [c for c in light if ro[c]] + [c for c in light if not ro[c]] + ([heavy[n]] if heavy[n] >= 0 else [])
        todo += list(reversed(visit))
    plan = np.zeros(T, np.int32)
    slot: dict[int, int] = {}
    live, held = 0, -2  # held: the node whose state is in registers (-1: the committed state)
    for i, n in enumerate(order):
        p = par[n]
        if p < 0:
            load = 0 if i == 0 else 1
        elif held == p:
            load = 0
        else:
            load = 2 + slot[p]
        if p >= 0 and n == heavy[p] and saves[p]:  # p's last child: its slot is the stack's top, free from here on
            live -= 1
        save = 0
        if saves[n]:
            slot[n] = live
            live += 1
            save = 1 + slot[n]
        if not ro[n]:
            held = n
        plan[i] = n | (1 << 15 if ro[n] else 0) | load << 16 | save << 24
    return plan


def _defines(portable: bool) -> tuple[str, ...]:
    return ("SPECSPLIT_PORTABLE",) if portable else ()


def _ctype(dtype: Any, what: str) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "float"
    if dtype == np.float16:
        return "unsigned short"
    raise ValueError(f"{what} must be float16 or float32, not {dtype}")


def _fn(name: str, portable: bool, pdl: bool = False) -> Any:
    return loader.get_function(SOURCE, name, _defines(portable), pdl=pdl and PDL and not portable)


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


def _conv_operands(raw: Any, window: Any, weight: Any, out: Any, rows_out: Any) -> tuple:
    """A conv launch's checked operands: (raw, its row stride, K, out (made when None), its row stride, rows_out or
    None, its row stride or 0)."""
    cupy = loader.require()
    raw, ld_raw = _rows(cupy.asarray(raw), "raw", align=1)
    t_max, c = (int(s) for s in raw.shape)
    kw = _conv_taps(window, weight, c)
    if out is None:
        out = cupy.empty((t_max, c), dtype=cupy.float32)
    out, ld_out = _rows(out, "out", width=c, align=1)
    if out.dtype != np.float32 or int(out.shape[0]) < t_max:
        raise ValueError(f"out must be float32 with at least {t_max} rows")
    rows_out, ld_rows = _rows_out(rows_out, c, t_max)
    return raw, ld_raw, kw, out, ld_out, rows_out, ld_rows


def _conv_taps(window: Any, weight: Any, c: int) -> int:
    """K of a checked conv weight (C, K), K in 2..8, and its window (K - 1, C), both float32."""
    if weight.ndim != 2 or int(weight.shape[0]) != c or not 2 <= int(weight.shape[1]) <= 8:
        raise ValueError(f"conv weight must be (C={c}, K) with K in 2..8, not {tuple(weight.shape)}")
    kw = int(weight.shape[1])
    _f32(weight, (c, kw), "conv weight")
    _f32(window, (kw - 1, c), "conv window")
    return kw


def _rows_out(rows_out: Any, c: int, t_max: int) -> tuple[Any, int]:
    """A checked rows_out (float32, C wide, at least t_max rows) and its row stride; (None, 0) for None."""
    if rows_out is None:
        return None, 0
    rows_out, ld_rows = _rows(rows_out, "rows_out", width=c, align=1)
    if rows_out.dtype != np.float32 or int(rows_out.shape[0]) < t_max:
        raise ValueError(f"rows_out must be float32 with at least {t_max} rows")
    return rows_out, ld_rows


def _gate_operands(alpha: Any, b: Any, ssm_a: Any, dt_bias: Any, t_max: int, g: Any, beta: Any) -> tuple:
    """The gates' checked operands: (alpha, the row stride of alpha and b, Hv, g, beta; g / beta made when None)."""
    cupy = loader.require()
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
    return alpha, ld_ab, hv, g, beta


def _head_k_dim(n_k_heads: int, head_k_dim: int, channels: int, what: str) -> tuple[int, int]:
    hk, dk = int(n_k_heads), int(head_k_dim)
    if dk not in (32, 64) and dk % 128:
        raise ValueError(f"head_k_dim must be 32, 64 or a multiple of 128, not {dk}")
    if channels < 2 * hk * dk:
        raise ValueError(f"{what} has {channels} features, q and k need {2 * hk * dk}")
    return hk, dk


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
    raw, ld_raw, kw, out, ld_out, rows_out, ld_rows = _conv_operands(raw, window, weight, out, rows_out)
    t_max, c = (int(v) for v in raw.shape)
    grid = ((c + 127) // 128, max(1, min(t_max, MAX_GRID_Y)))
    args = (raw, np.int64(ld_raw), window, weight, _parents_arg(parents, t_max), _n_tokens(n_tokens, t_max),
            np.int32(t_max), np.int32(c), out, np.int64(ld_out))  # fmt: skip
    pdl = t_max <= PDL_UP_TO
    early = np.int32(_early(pdl, portable))  # the window and weights ahead of the grid wait (ConvPre)
    if rows_out is None:
        _fn(f"conv_silu_kernel<{_ctype(raw.dtype, 'raw')}, {kw}>", portable, pdl=pdl)(grid, (128,), (*args, early))
        return out
    kern = _fn(f"conv_silu_rows_kernel<{_ctype(raw.dtype, 'raw')}, {kw}>", portable, pdl=pdl)
    kern(grid, (128,), (*args, rows_out, np.int64(ld_rows), early))
    return out


def _early(pdl: bool, portable: bool) -> bool:
    """Whether a chain kernel launched now may load what was committed before the step (a walk's state, a conv's
    window) ahead of its grid dependency wait: a PDL launch captured into a graph, which starts only after every
    earlier launch, and in whose step nothing writes those before the kernel reads them (EARLY_STATE)."""
    return bool(EARLY_STATE and pdl and PDL and not portable
                and loader.require().cuda.get_current_stream().is_capturing())


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
    loader.require()  # CuPy's absence as its clear error, before any operand is looked at
    mixed, ld = _rows(mixed, "mixed", align=1)
    if mixed.dtype != np.float32:
        raise ValueError("mixed (the conv output) must be float32")
    t_max = int(mixed.shape[0])
    hk, dk = _head_k_dim(n_k_heads, head_k_dim, int(mixed.shape[1]), "mixed")
    alpha, ld_ab, hv, g, beta = _gate_operands(alpha, b, ssm_a, dt_bias, t_max, g, beta)
    scale = dk**-0.5 if q_scale is None else float(q_scale)
    kern = _fn(f"qk_norm_gate_kernel<{_ctype(alpha.dtype, 'alpha')}, {dk}>", portable, pdl=t_max <= PDL_UP_TO)
    warps = 4
    grid = (max(1, (2 * hk + warps - 1) // warps), max(1, min(t_max, MAX_GRID_Y)))
    kern(grid, (32 * warps,), (mixed, np.int64(ld), np.int32(hk), np.float32(scale), np.float32(eps), alpha, b,
                               np.int64(ld_ab), ssm_a, dt_bias, np.int32(hv), g, beta, np.int64(hv),
                               _n_tokens(n_tokens, t_max), np.int32(t_max)))  # fmt: skip
    return g, beta


CONV_NORM_WARPS = 4  # conv_qk_norm_gate's warps per block (one per DK channels; H100 27B step: 4 beat 1 at 1 / 3 /
# 23 tokens by 0.1-0.4 %)


def conv_qk_norm_gate(
    raw: Any,
    window: Any,
    weight: Any,
    alpha: Any,
    b: Any,
    ssm_a: Any,
    dt_bias: Any,
    *,
    n_k_heads: int,
    head_k_dim: int,
    parents: Any = None,
    n_tokens: Any = None,
    out: Any = None,
    rows_out: Any = None,
    g: Any = None,
    beta: Any = None,
    eps: float = 1e-6,
    q_scale: float | None = None,
    portable: bool = False,
) -> tuple[Any, Any, Any]:
    """conv_silu then qk_norm_gate on its output in one launch (conv_qk_norm_gate_kernel): the same arguments and
    the same bits. raw, alpha and b: one dtype (columns of one projection). Returns (out, g, beta)."""
    raw, ld_raw, kw, out, ld_out, rows_out, ld_rows = _conv_operands(raw, window, weight, out, rows_out)
    t_max, c = (int(v) for v in raw.shape)
    hk, dk = _head_k_dim(n_k_heads, head_k_dim, c, "raw")
    if alpha.dtype != raw.dtype:
        raise ValueError(f"alpha and b must be of raw's dtype {raw.dtype}, not {alpha.dtype}")
    alpha, ld_ab, hv, g, beta = _gate_operands(alpha, b, ssm_a, dt_bias, t_max, g, beta)
    scale = dk**-0.5 if q_scale is None else float(q_scale)
    warps = CONV_NORM_WARPS
    grid = (-(-c // (dk * warps)), max(1, min(t_max, MAX_GRID_Y)))
    kern = _fn(f"conv_qk_norm_gate_kernel<{_ctype(raw.dtype, 'raw')}, {kw}, {dk}, {int(rows_out is not None)}>",
               portable, pdl=t_max <= PDL_UP_TO)
    kern(grid, (32 * warps,), (
        raw, np.int64(ld_raw), window, weight, _parents_arg(parents, t_max), _n_tokens(n_tokens, t_max),
        np.int32(t_max), np.int32(c), out, np.int64(ld_out), rows_out if rows_out is not None else np.uint64(0),
        np.int64(ld_rows), np.int32(hk), np.float32(scale), np.float32(eps), alpha, b, np.int64(ld_ab), ssm_a,
        dt_bias, np.int32(hv), g, beta, np.int64(hv)))  # fmt: skip
    return out, g, beta


# ---------------------------------------------------------------------------------------------- delta rule


def tree_plan(parents: Any, *, n_tokens: Any = None, t_max: int | None = None, out: Any = None,
              portable: bool = False) -> Any:
    """The walk of a tree (gdr_tree_plan_kernel; NumPy twin `walk_plan`): int32 (t_max,) on the device, entry i
    for the i-th visited node (entries past n_tokens are not written). One launch of one warp per step: every
    layer's tree step reads the same plan. parents: a device int32 list (entries outside -1..t-1 read as roots)
    or a NumPy list (checked); t_max defaults to its length, at most PLAN_MAX."""
    cupy = loader.require()
    p = device_parents(parents, t_max)
    t_max = int(p.size) if t_max is None else int(t_max)
    if not 1 <= t_max <= PLAN_MAX or int(p.size) < t_max:
        raise ValueError(f"a planned tree walk takes 1..{PLAN_MAX} tokens and a parent for each, not {t_max} "
                         f"with {int(p.size)} parents")
    if out is None:
        out = cupy.empty(t_max, cupy.int32)
    if out.dtype != np.int32 or out.ndim != 1 or int(out.size) < t_max or not out.flags.c_contiguous:
        raise ValueError(f"plan must be a contiguous int32 vector of at least {t_max} entries")
    _fn("gdr_tree_plan_kernel", portable)((1,), (32,), (p, _n_tokens(n_tokens, t_max), np.int32(t_max), out),
                                           shared_mem=9 * 4 * t_max)  # fmt: skip
    return out


def _opt_in_smem(kern: Any, name: str, smem: int) -> None:
    if smem > SMEM_LIMIT:
        raise ValueError(f"{name} needs {smem} bytes of shared memory a block, over {SMEM_LIMIT}: use fewer warps "
                         "or a smaller depth")
    # opt in above the 48 KiB default (the attribute lives on the compiled function: one driver call to read it)
    if smem > 48 * 1024 and kern.max_dynamic_shared_size_bytes < smem:
        kern.max_dynamic_shared_size_bytes = smem


def gated_delta_tree(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    s0: Any,
    *,
    parents: Any = None,
    plan: Any = None,
    n_tokens: Any = None,
    final_state: Any = None,
    alt: Any = None,
    swap: Any = None,
    out: Any = None,
    cols_per_warp: int = DEFAULT_COLS,
    warps: int = DEFAULT_WARPS,
    depth: int = DEFAULT_DEPTH,
    portable: bool = False,
) -> Any:
    """Gated delta rule over a tree (or a chain) of new tokens; returns out (T_max, Hv, dv) float32.

    q, k: (T_max, Hk * dk) normalised (q scaled), v: (T_max, Hv * dv), all float16 or all float32 with contiguous
    rows (views of the conv output are fine); g, beta: (T_max, Hv) float32; s0: (Hv, dk, dv) float32 committed
    state (read only unless it is also final_state). Value head h reads key head h % Hk.

    gdr_tree_walk_kernel: a tree is walked depth first from `plan` (tree_plan's; built here from `parents` when
    not given, one extra launch), the states it comes back to kept in shared memory; nothing but `out` is
    written, and the commit recomputes the accepted node's state (commit_replay). No parents and no plan: a chain
    (decode, prefill, a chain verify); final_state (Hv, dk, dv) float32, which may be s0 itself (an in-place
    step), receives the last token's state.
    alt, swap: a ping-pong state (s0 and alt its two halves, final_state alt or None; swap a device int32 [1]):
    when swap[0] != 0 the committed state is alt and a chain's final state goes to s0. A chain's commit then flips
    swap instead of copying the final state over the committed one, and a captured launch serves both ways.
    cols_per_warp (4, 8), warps (1..4 per block): the layout (see kernels/deltanet.cu); depth: tokens whose inputs
    are in flight at once, 2..16 (a cp.async ring of `depth` token slots per warp in shared memory).
    """
    if s0.ndim != 3:
        raise ValueError(f"s0 must be (Hv, dk, dv), not shape {tuple(s0.shape)}")
    hv, dk, dv = (int(s) for s in s0.shape)
    _f32(s0, (hv, dk, dv), "s0")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k and v must share one dtype")
    vec = 4 if q.dtype == np.float32 else 8
    depth = int(depth)
    if not 2 <= depth <= 16:
        raise ValueError(f"depth must be 2..16 tokens, not {depth}")
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
    if parents is not None or plan is not None:
        if final_state is not None:
            raise ValueError("final_state is a chain's last state (a tree walk ends on an arbitrary node)")
        if t_max > PLAN_MAX:
            raise ValueError(f"a planned tree walk takes at most {PLAN_MAX} tokens")
        if plan is None:
            plan = tree_plan(parents, n_tokens=n_tokens, t_max=t_max, portable=portable)
        if plan.dtype != np.int32 or plan.ndim != 1 or int(plan.size) < t_max or not plan.flags.c_contiguous:
            raise ValueError(f"plan must be a contiguous int32 vector of at least {t_max} entries (tree_plan)")
    alt_off = _state_operands(s0, final_state, alt, swap)
    out, ld_out = _out_rows(out, t_max, hv * dv)
    n_slots = walk_stack_slots(t_max) if plan is not None else 0
    pdl = t_max <= PDL_UP_TO
    kern = _fn(f"gdr_tree_walk_kernel<{_ctype(q.dtype, 'q')}, {dk}, {cw}, {depth}>", portable, pdl=pdl)
    name = "gdr_tree_walk_kernel"
    early = int(_early(pdl, portable))  # the committed state ahead of the grid dependency wait
    smem = nw * walk_smem_bytes(dk, q.dtype.itemsize, cw, depth, n_slots, t_max if plan is not None else 0)
    _opt_in_smem(kern, name, smem)
    kern((hv * dv // (cw * nw),), (32 * nw,),
         (q, k, np.int64(ld_qk), v, np.int64(ld_v), g, beta, np.int64(hv), np.int32(hk), np.int32(hv), np.int32(dv), s0,
          _null() if plan is None else plan, _n_tokens(n_tokens, t_max), np.int32(t_max), np.int32(n_slots),
          _null() if final_state is None else final_state, _null() if swap is None else swap, np.int64(alt_off), out,
          np.int64(ld_out), np.int32(early)), shared_mem=smem)  # fmt: skip
    return out.reshape(int(out.shape[0]), hv, dv)


def decode_step(
    raw: Any,
    window: Any,
    weight: Any,
    alpha: Any,
    b: Any,
    ssm_a: Any,
    dt_bias: Any,
    s0: Any,
    *,
    n_k_heads: int,
    final_state: Any = None,
    alt: Any = None,
    swap: Any = None,
    out: Any = None,
    rows_out: Any = None,
    eps: float = 1e-6,
    q_scale: float | None = None,
    cols_per_warp: int = DEFAULT_COLS,
    warps: int = DEFAULT_WARPS,
    portable: bool = False,
    gate: Any = None,
    norm_weight: Any = None,
    norm_eps: float = 1e-6,
    q16: Any = None,
) -> Any:
    """One decode token of a DeltaNet layer in one launch (gdr_decode_kernel): conv_silu (rows_out as there), then
    qk_norm_gate, then gated_delta_tree on a one-token chain, with the same bits; returns out (1, Hv, dv) float32.

    raw: (1, C) float16/float32, the token's qkv projection (C = 2 Hk dk + Hv dv: q heads, k heads, v heads); window
    (K-1, C) / weight (C, K) float32 as conv_silu's; alpha, b: (1, Hv) of raw's dtype; ssm_a, dt_bias: (Hv,)
    float32; s0, final_state, alt, swap: gated_delta_tree's for a chain (dk from s0). The conv window is not
    advanced (the commit does that from rows_out, as after conv_silu).

    q16: a uint32 buffer of quant_matmul.q16_words(Hv dv, 1) that also receives the layer's output norm
    rms_norm(out_h) * norm_weight * silu(gate_h) per value head as the output projection's int16 staging
    (PackedX.q16), the bits of quant_matmul.pack_activations(out, rms_weight=norm_weight, eps=norm_eps,
    gate=gate).q16, so no pack launch runs before ssm_out's gemv; gate: (1, Hv dv) of raw's dtype; norm_weight:
    (dv,) float32. Needs a block per value head (warps * cols_per_warp == dv), dv a multiple of 16 up to 256 and
    Hv dv of 256 (norm_stages says whether a shape can)."""
    cupy = loader.require()
    if s0.ndim != 3:
        raise ValueError(f"s0 must be (Hv, dk, dv), not shape {tuple(s0.shape)}")
    hv, dk, dv = (int(x) for x in s0.shape)
    _f32(s0, (hv, dk, dv), "s0")
    raw, _ = _rows(cupy.asarray(raw), "raw", align=1)
    if int(raw.shape[0]) != 1:
        raise ValueError(f"decode_step takes one token, not {int(raw.shape[0])}")
    c = int(raw.shape[1])
    hk, dk = _head_k_dim(n_k_heads, dk, c, "raw")
    if c != 2 * hk * dk + hv * dv or hv % hk:
        raise ValueError(f"raw has {c} channels; q, k and v of {hk} key and {hv} value heads need "
                         f"{2 * hk * dk + hv * dv} (and Hk | Hv)")
    kw = _conv_taps(window, weight, c)
    if alpha.dtype != raw.dtype:
        raise ValueError(f"alpha and b must be of raw's dtype {raw.dtype}, not {alpha.dtype}")
    if alpha.shape != b.shape or alpha.dtype != b.dtype or tuple(alpha.shape) != (1, hv):
        raise ValueError(f"alpha and b must both be (1, Hv={hv}) of one dtype")
    alpha, _ = _rows(alpha, "alpha", align=1)
    b, _ = _rows(b, "b", align=1)
    _f32(ssm_a, (hv,), "ssm_a")
    _f32(dt_bias, (hv,), "dt_bias")
    rows_out, _ = _rows_out(rows_out, c, 1)
    cw, nw = int(cols_per_warp), int(warps)
    if cw not in (4, 8) or not 2 <= nw <= 16 or dv % (cw * nw) or dk % (32 // cw * 8):
        raise ValueError(f"cols_per_warp in (4, 8), warps in 2..16, dv = {dv} a multiple of their product and dk = "
                         f"{dk} of {32 // cw * 8}")
    alt_off = _state_operands(s0, final_state, alt, swap)
    out, _ = _out_rows(out, 1, hv * dv)
    if q16 is not None:
        gate, norm_weight = _norm_operands(q16, gate, norm_weight, raw.dtype, hv, dv, cw, nw)
    scale = dk**-0.5 if q_scale is None else float(q_scale)
    pdl = PDL_UP_TO >= 1
    kern = _fn(f"gdr_decode_kernel<{_ctype(raw.dtype, 'raw')}, {dk}, {cw}, {kw}>", portable, pdl=pdl)
    early = int(_early(pdl, portable))  # the state, conv weights and window ahead of the grid dependency wait
    smem = 4 * (2 * dk + (2 if q16 is not None else 1) * nw * cw + 2)
    kern((hv * dv // (cw * nw),), (32 * nw,),
         (raw, window, weight, _null() if rows_out is None else rows_out, alpha, b, ssm_a, dt_bias, np.int32(hk),
          np.int32(hv), np.int32(dv), np.int32(c), np.float32(scale), np.float32(eps), s0,
          _null() if final_state is None else final_state, _null() if swap is None else swap, np.int64(alt_off), out,
          _null() if q16 is None else gate, _null() if q16 is None else norm_weight, np.float32(norm_eps),
          _null() if q16 is None else q16, np.int32(early)), shared_mem=smem)  # fmt: skip
    return out.reshape(1, hv, dv)


def norm_stages(hv: int, dv: int, cols_per_warp: int = DEFAULT_COLS) -> bool:
    """Whether decode_step(q16=) can write the output norm's staging for Hv value heads of dv: a block per head
    (dv / cols_per_warp warps, at most 16), 16-value groups inside a head, whole 256-value chunks."""
    return dv % cols_per_warp == 0 and 2 <= dv // cols_per_warp <= 16 and dv % 16 == 0 and (hv * dv) % 256 == 0


def _norm_operands(q16: Any, gate: Any, norm_weight: Any, dtype: Any, hv: int, dv: int, cw: int, nw: int) -> tuple:
    """decode_step's output-norm operands checked: (gate row, norm weight)."""
    if cw * nw != dv or not norm_stages(hv, dv, cw):
        raise ValueError(f"the output norm's staging needs a block per value head (warps * cols_per_warp = dv = {dv}, "
                         f"not {cw * nw}), dv a multiple of 16 and Hv * dv = {hv * dv} of 256")
    if gate is None or norm_weight is None:
        raise ValueError("q16 (the output norm's staging) needs gate and norm_weight")
    if gate.dtype != dtype or tuple(gate.shape) != (1, hv * dv):
        raise ValueError(f"gate must be (1, Hv * dv = {hv * dv}) of raw's dtype {dtype}, not "
                         f"{gate.dtype}{tuple(gate.shape)}")
    gate, _ = _rows(gate, "gate", align=1)
    _f32(norm_weight, (dv,), "norm_weight")
    words = -(-(hv * dv) // 256) * (32 * 4 + 16 + 16)  # quant_matmul.q16_words(Hv dv, 1)
    if q16.dtype != np.uint32 or int(q16.size) != words or not q16.flags.c_contiguous:
        raise ValueError(f"q16 must be a contiguous uint32 array of {words} words (quant_matmul.q16_words)")
    return gate, norm_weight


def _state_operands(s0: Any, final_state: Any, alt: Any, swap: Any) -> int:
    """Checks a delta-rule launch's final state against s0 (Hv, dk, dv) and its ping-pong pair; returns alt's offset
    (_swap_offset)."""
    if final_state is not None:
        _f32(final_state, tuple(s0.shape), "final_state")
    alt_off = _swap_offset(s0, alt, swap, "s0")
    if swap is not None and final_state is not None and final_state.data.ptr != alt.data.ptr:
        raise ValueError("with swap, final_state must be alt (the half a chain's final state goes to)")
    return alt_off


def _out_rows(out: Any, t_max: int, width: int) -> tuple[Any, int]:
    """A delta-rule launch's float32 output rows [>= t_max, width] (made when None; (T, Hv, dv) accepted): (out as
    rows, its row stride)."""
    cupy = loader.require()
    if out is None:
        out = cupy.empty((t_max, width), dtype=cupy.float32)
    out = out.reshape(int(out.shape[0]), -1) if out.ndim == 3 else out
    out, ld_out = _rows(out, "out", width=width, align=1)
    if out.dtype != np.float32 or int(out.shape[0]) < t_max:
        raise ValueError(f"out must be float32 with at least {t_max} rows")
    return out, ld_out


def _swap_offset(state: Any, alt: Any, swap: Any, what: str) -> int:
    """The distance in floats from `state` to its ping-pong twin `alt` (0 without one); checks the pair."""
    if (alt is None) != (swap is None):
        raise ValueError("alt and swap go together (a ping-pong state and its selector)")
    if swap is None:
        return 0
    if swap.dtype != np.int32 or int(swap.size) < 1:
        raise ValueError("swap must be a device int32 array of at least one element")
    if alt.dtype != state.dtype or alt.shape != state.shape or alt.strides != state.strides:
        raise ValueError(f"alt must be laid out as {what}: {state.dtype} {tuple(state.shape)}")
    diff = int(alt.data.ptr) - int(state.data.ptr)
    if diff % 4 or abs(diff) < state.nbytes:
        raise ValueError(f"alt must not overlap {what}")
    return diff // 4


# ---------------------------------------------------------------------------------------------- commit


def _layered(a: Any, inner: int, what: str) -> tuple[Any, int, int]:
    """(array, layers, layer stride in elements) for an array with an optional leading layer axis."""
    if a.ndim == inner:
        return a, 1, 0
    if a.ndim != inner + 1:
        raise ValueError(f"{what} must have {inner} dims, or {inner + 1} with a leading layer axis")
    return a, int(a.shape[0]), int(a.strides[0] // a.dtype.itemsize)


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


def commit_replay(
    accepted: Any,
    parents: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    *,
    alt: Any = None,
    swap: Any = None,
    cols_per_warp: int = DEFAULT_COLS,
    warps: int = DEFAULT_WARPS,
    depth: int = DEFAULT_DEPTH,
    portable: bool = False,
) -> None:
    """state[l] <- its state after the root -> `accepted` path of the last tree step, recomputed on the device by
    the tree step's own state update over the path's tokens (gdr_commit_kernel, all layers in one launch, in
    place): state.SequenceState.commit's checkpoint, without one per node. accepted: device int32 [1] (< 0 keeps
    the state); parents: the step's list (None: a chain, path 0..accepted).

    k: ([L,] T_max, Hk * dk) and v: ([L,] T_max, Hv * dv) of the step (float16 or float32, the tree step's
    inputs: views of the conv output rows, with the same row and layer strides); g, beta: ([L,] T_max, Hv)
    float32; state: ([L,] Hv, dk, dv) float32, each layer contiguous. cols_per_warp must be the tree step's (the
    reduction order is the layout's): the state then equals the tree step's state for that node bit for bit.
    alt, swap: a ping-pong state (gated_delta_tree's): when swap[0] != 0 the committed state is alt (laid out as
    state), replayed there in place.
    """
    loader.require()  # a clear error without CuPy or a GPU
    alt_off = _swap_offset(state, alt, swap, "state")
    state, layers, s_stride = _layered(state, 3, "state")
    if state.dtype != np.float32 or not (state[0] if state.ndim == 4 else state).flags.c_contiguous:
        raise ValueError("state must be float32 with each layer contiguous")
    hv, dk, dv = (int(x) for x in state.shape[-3:])
    arrays = {}
    for a, what in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        a, n, stride = _layered(a, 2, what)
        if n != layers:
            raise ValueError(f"{what} has {n} layers, the state {layers}")
        _rows(a[0] if a.ndim == 3 else a, what, align=1)
        arrays[what] = (a, stride, a.strides[-2] // a.dtype.itemsize)  # the buffer's row stride, also for one row
    (k, lk, ld_k), (v, lv, ld_v) = arrays["k"], arrays["v"]
    (g, lg, ld_g), (beta, lb, ld_b) = arrays["g"], arrays["beta"]
    if k.dtype != v.dtype:
        raise ValueError("k and v must share one dtype")
    t_max, hk_dk = int(k.shape[-2]), int(k.shape[-1])
    if hk_dk % dk or hv % (hk_dk // dk):
        raise ValueError(f"k has {hk_dk} features: not key heads of dk = {dk} that divide {hv} value heads")
    if tuple(v.shape[-2:]) != (t_max, hv * dv):
        raise ValueError(f"v must be (T_max={t_max}, {hv * dv}), not {tuple(v.shape[-2:])}")
    if ld_k != ld_v or (layers > 1 and lk != lv):
        raise ValueError("k and v must have the same row and layer strides (views of the conv output rows)")
    for a, what in ((g, "g"), (beta, "beta")):
        if a.dtype != np.float32 or tuple(a.shape[-2:]) != (t_max, hv):
            raise ValueError(f"{what} must be float32 (T_max={t_max}, Hv={hv}), not {a.dtype} {tuple(a.shape[-2:])}")
    if ld_g != ld_b or (layers > 1 and lg != lb):
        raise ValueError("g and beta must have the same strides")
    item = k.dtype.itemsize
    if k.data.ptr % 16 or (ld_k * item) % 16 or (lk * item) % 16:
        raise ValueError("k rows must start on 16-byte boundaries (cp.async)")
    if item == 2 and (v.data.ptr % 4 or ld_k % 2 or lk % 2):
        raise ValueError("float16 v rows must start on 4-byte boundaries")
    cw, nw, depth = int(cols_per_warp), int(warps), int(depth)
    if cw not in (4, 8) or not 1 <= nw <= 4 or dv % (cw * nw) or dk % (32 // cw * 8) or not 2 <= depth <= 16:
        raise ValueError("cols_per_warp in (4, 8) dividing dv and dk's layout, warps in 1..4, depth in 2..16")
    ct = _ctype(k.dtype, "k")
    name = f"gdr_commit_kernel<{ct}, {dk}, {cw}, {depth}>"
    kern = _fn(name, portable)
    smem = nw * commit_smem_bytes(dk, item, depth, t_max)
    _opt_in_smem(kern, name, smem)
    kern((hv * dv // (cw * nw), layers), (32 * nw,),
         (k, v, np.int64(ld_k), np.int64(lk), g, beta, np.int64(ld_g), np.int64(lg),
          np.int32(hk_dk // dk), np.int32(hv), np.int32(dv), state, np.int64(s_stride), _parents_arg(parents, t_max),
          _accepted(accepted), np.int32(t_max), _null() if swap is None else swap, np.int64(alt_off)),
         shared_mem=smem)  # fmt: skip


def commit(accepted: Any, parents: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, raw: Any, window: Any, *,
           portable: bool = False, **layout: int) -> None:
    """Keep the root -> `accepted` path of a verified tree: recurrent state replayed along it (commit_replay, which
    takes the layout keywords: cols_per_warp, warps, depth), conv window gathered along it (commit_conv);
    state.SequenceState.commit without a host round trip (accepted is a device int32 [1])."""
    commit_replay(accepted, parents, k, v, g, beta, state, portable=portable, **layout)
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
                           parents=parents, n_tokens=n_tokens, final_state=final_state, portable=portable)  # fmt: skip
    return out, mixed


def warmup(portable: bool = False) -> None:
    """Compile the Qwen3.6 variants up front (each is built on first use otherwise)."""
    for t in ("float", "unsigned short"):
        _fn(f"conv_silu_kernel<{t}, 4>", portable)
        _fn(f"qk_norm_gate_kernel<{t}, 128>", portable)
        _fn(f"gdr_tree_walk_kernel<{t}, 128, 8, {DEFAULT_DEPTH}>", portable)
        _fn(f"gdr_commit_kernel<{t}, 128, 8, {DEFAULT_DEPTH}>", portable)
        _fn(f"conv_commit_kernel<{t}, 4>", portable)
    _fn("gdr_tree_plan_kernel", portable)
