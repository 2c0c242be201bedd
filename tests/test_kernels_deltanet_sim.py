"""kernels/deltanet.cu + kernels/deltanet.py run on the CPU against the engine's NumPy twins (no GPU needed).

g++ compiles the kernel source with tests/cuda_sim_deltanet.cpp (fiber simulator of tests/cuda_sim.h: 32 lanes in
lockstep, software fp16); the launchers in kernels/deltanet.py run unchanged on `SimCupy`, a NumPy-backed
stand-in for the few CuPy calls they make, whose kernel launches go to the simulator. So argument order, strides,
grids, null pointers and validation are checked here too; tests/test_kernels_deltanet.py runs the same `check_*`
cases on a real GPU.

Twins: services.engine.layers (conv_window_ids + causal_conv; l2_norm, softplus, sigmoid as in
models/qwen35._deltanet; gated_delta_rule_tree), kernels.deltanet.walk_plan and state.SequenceState.commit.
Outputs are poisoned with NaN. Tolerances (max |error| / max |reference|, reference in float64): conv, norm, gates
1e-5; delta rule 1e-4 (fp32 state through up to 64 dependent updates, summation order differs); conv window commit
bit-exact. Bit for bit besides: the tree walk's outputs and the replayed commit's state against each node's
root -> node path run as a chain (`walk_path`: no plan, no stack, the same layout and state update).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from services.engine import layers

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "deltanet.cu"
HARNESS = Path(__file__).resolve().parent / "cuda_sim_deltanet.cpp"
BLOCK_HARNESS = HARNESS.parent / "cuda_sim_deltanet_block.cpp"  # kernels that synchronise whole blocks
KW = 4
TOL = 1e-5
TOL_RULE = 1e-4
TREE_SIZES = (1, 2, 7, 16, 23, 41, 64)


# ---------------------------------------------------------------------------------------------- shared cases
# Each check_* takes `xp` (cupy, or SimCupy here) and a seeded generator; kernels.deltanet is imported lazily so
# that the module imports without CuPy.


def random_tree(n: int, rng: np.random.Generator) -> np.ndarray:
    """Parents of a random tree in topological order (-1 = root), mixing chains, branches and extra roots."""
    parents = np.empty(n, np.int32)
    for t in range(n):
        r = rng.random()
        parents[t] = -1 if t == 0 or r < 0.08 else (t - 1 if r < 0.6 else int(rng.integers(0, t)))
    return parents


def rel_max(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    assert np.isfinite(x).all(), f"{int((~np.isfinite(x)).sum())} outputs unwritten or not finite"
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


def poisoned(xp, shape, dtype=np.float32):
    a = xp.empty(shape, dtype=dtype)
    a[...] = np.nan
    return a


def check_conv(xp, rng, T: int, C: int, f16: bool, chain: bool = False, portable: bool = False) -> None:
    from kernels import deltanet as dn

    t_max = T + 3  # rows past n_tokens must stay untouched
    parents = np.arange(-1, T - 1, dtype=np.int32) if chain else random_tree(T, rng)
    raw = rng.standard_normal((t_max, C)).astype(np.float16 if f16 else np.float32)
    window = rng.standard_normal((KW - 1, C)).astype(np.float32)
    w = (rng.standard_normal((C, KW)) * 0.5).astype(np.float32)
    par = np.full(t_max, -1, np.int32)
    par[:T] = parents
    out = poisoned(xp, (t_max, C))
    dn.conv_silu(xp.asarray(raw), xp.asarray(window), xp.asarray(w), parents=None if chain else xp.asarray(par),
                 n_tokens=xp.asarray(np.array([T], np.int32)), out=out, portable=portable)  # fmt: skip
    out = xp.asnumpy(out)
    ref = layers.causal_conv(window.astype(np.float64), raw[:T].astype(np.float64), w.astype(np.float64),
                             layers.conv_window_ids(parents, KW))  # fmt: skip
    assert rel_max(out[:T], ref) < TOL
    assert np.isnan(out[T:]).all(), "rows past n_tokens were written"


def check_norm_gate(xp, rng, T: int, Hk: int, Hv: int, dk: int, f16: bool, portable: bool = False) -> None:
    from kernels import deltanet as dn

    dv = 32
    C = 2 * Hk * dk + Hv * dv
    mixed_h = (rng.standard_normal((T, C)) * 2).astype(np.float32)
    ab = np.float16 if f16 else np.float32
    alpha = (rng.standard_normal((T, Hv)) * 3).astype(ab)
    b = (rng.standard_normal((T, Hv)) * 3).astype(ab)
    ssm_a = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    mixed = xp.asarray(mixed_h)
    g, beta = poisoned(xp, (T, Hv)), poisoned(xp, (T, Hv))
    n = T - 1  # the last row must stay as it was
    dn.qk_norm_gate(mixed, xp.asarray(alpha), xp.asarray(b), xp.asarray(ssm_a), xp.asarray(dt), n_k_heads=Hk,
                    head_k_dim=dk, n_tokens=n, g=g, beta=beta, portable=portable)  # fmt: skip
    got, g, beta = xp.asnumpy(mixed), xp.asnumpy(g), xp.asnumpy(beta)
    kd = Hk * dk
    q_ref = layers.l2_norm(mixed_h[:n, :kd].reshape(n, Hk, dk).astype(np.float64), 1e-6) * dk**-0.5
    k_ref = layers.l2_norm(mixed_h[:n, kd : 2 * kd].reshape(n, Hk, dk).astype(np.float64), 1e-6)
    assert rel_max(got[:n, :kd].reshape(n, Hk, dk), q_ref) < TOL
    assert rel_max(got[:n, kd : 2 * kd].reshape(n, Hk, dk), k_ref) < TOL
    assert np.array_equal(got[:n, 2 * kd :], mixed_h[:n, 2 * kd :]), "v was touched"
    assert np.array_equal(got[n:], mixed_h[n:]), "a row past n_tokens was touched"
    a64, b64 = alpha[:n].astype(np.float64), b[:n].astype(np.float64)
    assert rel_max(g[:n], ssm_a * layers.softplus(a64 + dt)) < TOL
    assert rel_max(beta[:n], layers.sigmoid(b64)) < TOL
    assert np.isnan(g[n:]).all() and np.isnan(beta[n:]).all()


def check_conv_norm_gate(xp, rng, T: int, Hk: int, Hv: int, dk: int, f16: bool, chain: bool = False,
                         rows: bool = True, portable: bool = False) -> None:
    """conv_qk_norm_gate: bit for bit conv_silu then qk_norm_gate (the two launches it replaces), raw rows kept
    alike, rows past n_tokens untouched."""
    from kernels import deltanet as dn

    dv = 32
    C = 2 * Hk * dk + Hv * dv + 16   # a last group of channels shorter than dk
    t_max = T + 2
    parents = np.arange(-1, T - 1, dtype=np.int32) if chain else random_tree(T, rng)
    par = np.full(t_max, -1, np.int32)
    par[:T] = parents
    dt_in = np.float16 if f16 else np.float32
    raw = (rng.standard_normal((t_max, C)) * 2).astype(dt_in)
    window = rng.standard_normal((KW - 1, C)).astype(np.float32)
    w = (rng.standard_normal((C, KW)) * 0.5).astype(np.float32)
    alpha = (rng.standard_normal((t_max, Hv)) * 3).astype(dt_in)
    b = (rng.standard_normal((t_max, Hv)) * 3).astype(dt_in)
    ssm_a = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    n = xp.asarray(np.array([T], np.int32))
    pa = None if chain else xp.asarray(par)
    args = [xp.asarray(a) for a in (raw, window, w)]
    gates = [xp.asarray(a) for a in (alpha, b, ssm_a, dt)]
    out, r_out = poisoned(xp, (t_max, C)), poisoned(xp, (t_max, C))
    g, beta = poisoned(xp, (t_max, Hv)), poisoned(xp, (t_max, Hv))
    got = dn.conv_qk_norm_gate(*args, *gates, n_k_heads=Hk, head_k_dim=dk, parents=pa, n_tokens=n, out=out,
                               rows_out=r_out if rows else None, g=g, beta=beta, portable=portable)
    assert got[0] is out and got[1] is g and got[2] is beta
    ref = poisoned(xp, (t_max, C))
    g_ref, b_ref = poisoned(xp, (t_max, Hv)), poisoned(xp, (t_max, Hv))
    dn.conv_silu(*args, parents=pa, n_tokens=n, out=ref, portable=portable)
    dn.qk_norm_gate(ref, *gates, n_k_heads=Hk, head_k_dim=dk, n_tokens=n, g=g_ref, beta=b_ref, portable=portable)
    for a, want, what in ((out, ref, "out"), (g, g_ref, "g"), (beta, b_ref, "beta")):
        a, want = xp.asnumpy(a), xp.asnumpy(want)
        assert np.array_equal(a[:T], want[:T]), f"{what} differs from the two launches"
        assert np.isnan(a[T:]).all(), f"{what}: a row past n_tokens was written"
    r_out = xp.asnumpy(r_out)
    if rows:  # each token's own raw row, as conv_silu(rows_out=) keeps it
        assert np.array_equal(r_out[:T], raw[:T].astype(np.float32)) and np.isnan(r_out[T:]).all()
    else:
        assert np.isnan(r_out).all()


def tree_inputs(T: int, Hk: int, Hv: int, dk: int, dv: int, rng: np.random.Generator, dtype=np.float32,
                decay: float = 0.5):  # fmt: skip
    """Host q, k (T, Hk*dk) l2-normalised (q scaled), v (T, Hv*dv), g <= 0 (|g| ~ decay), beta in (0, 1),
    s0 (Hv, dk, dv)."""
    q = layers.l2_norm(rng.standard_normal((T, Hk, dk)), 1e-6) * dk**-0.5
    k = layers.l2_norm(rng.standard_normal((T, Hk, dk)), 1e-6)
    v = rng.standard_normal((T, Hv * dv))
    g = (-np.abs(rng.standard_normal((T, Hv))) * decay).astype(np.float32)
    beta = layers.sigmoid(rng.standard_normal((T, Hv))).astype(np.float32)
    s0 = (rng.standard_normal((Hv, dk, dv)) * 0.3).astype(np.float32)
    return q.reshape(T, -1).astype(dtype), k.reshape(T, -1).astype(dtype), v.astype(dtype), g, beta, s0


def tree_twin(q, k, v, g, beta, s0, parents, Hk: int, dk: int):
    T, Hv, dv = len(parents), s0.shape[0], s0.shape[2]
    tiled = np.arange(Hv) % Hk  # value head h reads key head h mod H_k
    qh = q[:T].astype(np.float64).reshape(T, Hk, dk)[:, tiled]
    kh = k[:T].astype(np.float64).reshape(T, Hk, dk)[:, tiled]
    vh = v[:T].astype(np.float64).reshape(T, Hv, dv)
    return layers.gated_delta_rule_tree(qh, kh, vh, g[:T].astype(np.float64), beta[:T].astype(np.float64),
                                        s0.astype(np.float64), parents)  # fmt: skip


def check_chain_in_place(xp, rng, T: int, Hk: int, Hv: int, dk: int, dv: int, depth: int = 8,
                         portable: bool = False) -> None:  # fmt: skip
    """No parents, final state over s0: decode (T = 1) and the recurrent prefill."""
    from kernels import deltanet as dn

    q, k, v, g, beta, s0 = tree_inputs(T, Hk, Hv, dk, dv, rng)
    ref_out, ref_states = tree_twin(q, k, v, g, beta, s0, np.arange(-1, T - 1), Hk, dk)
    s = xp.asarray(s0)
    out = dn.gated_delta_tree(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(g), xp.asarray(beta), s,
                              final_state=s, depth=depth, portable=portable)  # fmt: skip
    assert rel_max(xp.asnumpy(out), ref_out) < TOL_RULE
    assert rel_max(xp.asnumpy(s), ref_states[-1]) < TOL_RULE


# ---------------------------------------------------------------------------------------------- tree walk


def clamp_parents(parents) -> np.ndarray:
    """A device list as the kernels read it: entries outside -1..t-1 are roots."""
    p = np.asarray(parents, np.int64)
    return np.where((p >= -1) & (p < np.arange(len(p))), p, -1).astype(np.int32)


def ddtree_parents(n: int, rng: np.random.Generator, k: int = 8, positions: int = 15) -> np.ndarray:
    """The verify batch of a DDTree of n - 1 drafted nodes (services/engine/ddtree.py) over random logits."""
    from services.engine import ddtree

    ids, logp = ddtree.topk_logprobs(rng.standard_normal((positions, 64)) * 3, k)
    _, parents = ddtree.build_ddtree(ids, logp, n - 1).verify_batch(0)
    return parents.astype(np.int32)


def profile_parents(width: int) -> np.ndarray:
    """bench/step_profile.py's tree_parents: a chain of half the nodes, one side branch off each of its first nodes."""
    chain = (width + 1) // 2
    par = [-1] + list(range(chain - 1))
    par += [i % max(1, chain - 1) for i in range(width - chain)]
    return np.array(par, np.int32)


def dfs_binary(depth: int, tails: bool = False) -> np.ndarray:
    """A complete binary tree in depth-first order; with tails, each leaf has one child more (so no light child is
    a leaf evaluated read-only): the shape that needs the most saved states (the bound)."""
    par: list[int] = []

    def build(p: int, d: int) -> None:
        me = len(par)
        par.append(p)
        if d:
            build(me, d - 1)
            build(me, d - 1)
        elif tails:
            par.append(me)

    build(-1, depth)
    return np.array(par, np.int32)


def tree_shape(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Parent lists of n nodes: random, chain, star, forest, deep (branches at the bottom of a long chain),
    ddtree (a real draft tree), profile (bench/step_profile.py's), binary (complete, depth first; n ignored)."""
    if kind == "random":
        return random_tree(n, rng)
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int32)
    if kind == "star":
        return np.array([-1] + [0] * (n - 1), np.int32)
    if kind == "forest":
        return np.array([-1 if t % 3 == 0 else t - 1 for t in range(n)], np.int32)
    if kind == "deep":  # a chain of 3/4 of the nodes, the rest in two-node branches off its deepest nodes
        c = max(1, 3 * n // 4)
        par = list(range(-1, c - 1))
        for j in range(n - c):
            par.append(c - 1 - (j // 2) % c if j % 2 == 0 else len(par) - 1)
        return np.array(par, np.int32)
    if kind == "ddtree":
        return ddtree_parents(n, rng)
    if kind == "profile":
        return profile_parents(n)
    if kind == "binary":
        return dfs_binary(n)
    raise ValueError(kind)


def walk_slots_used(parents, plan) -> int:
    """Walks a plan on the host with node ids for states: every node visited once, each starting from its parent's
    state (in registers, in the named stack slot, or s0 for a root); a read-only entry is a leaf and leaves the
    state in registers as it was. Returns the stack slots it used."""
    par = clamp_parents(parents)
    held, stack, seen, used = -1, {}, set(), 0
    for i, code in enumerate(np.asarray(plan).tolist()):
        n, ro, load, save = code & 0x7FFF, (code >> 15) & 1, (code >> 16) & 0xFF, (code >> 24) & 0xFF
        assert n < len(par) and n not in seen, f"plan[{i}] visits node {n} again or out of range"
        seen.add(n)
        src = held if load == 0 else (-1 if load == 1 else stack.get(load - 2, "empty"))
        assert src == par[n], f"plan[{i}]: node {n} starts from {src}, its parent is {par[n]}"
        used = max(used, load - 1)
        if ro:
            assert n not in par and save == 0, f"plan[{i}]: read-only node {n} has children or saves"
        else:
            held = n
        if save:
            stack[save - 1] = n
            used = max(used, save)
    assert len(seen) == len(par), "a node was not visited"
    return used


def check_plan(xp, parents, t_max: int | None = None, portable: bool = False) -> int:
    """tree_plan (the kernel) equals walk_plan (its twin) and is a valid walk within walk_stack_slots(t_max)."""
    from kernels import deltanet as dn

    T = len(parents)
    t_max = t_max or T
    par = np.full(t_max, -1, np.int32)
    par[:T] = parents
    out = xp.asarray(np.full(t_max, -7, np.int32))
    dn.tree_plan(xp.asarray(par), n_tokens=xp.asarray(np.array([T], np.int32)), out=out, portable=portable)
    got = xp.asnumpy(out)
    assert np.array_equal(got[:T], dn.walk_plan(par[:T])), f"plan differs from its twin for parents {par[:T]}"
    assert (got[T:] == -7).all(), "plan entries past n_tokens were written"
    used = walk_slots_used(par[:T], got[:T])
    assert used <= dn.walk_stack_slots(t_max)
    return used


def path_to(parents, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(int(node))
        node = int(parents[node])
    return path[::-1]


# a read-only leaf's output (token_output: from its parent's state before the update) against the same token at a
# chain's end (token_update: from the updated state): the same value formed in another order
TOL_LEAF = 2e-6


def check_walk_on_path(walk_out, chain_out, path, parents, what: str) -> None:
    """The walk's outputs on a root -> node path against the path run as a chain (walk_path): bit for bit on every
    node the walk updates the state for, within TOL_LEAF on a read-only leaf at the path's end (walk_plan's ro)."""
    from kernels import deltanet as dn

    plan = dn.walk_plan(parents)
    ro = {int(e) & 0x7FFF for e in plan if int(e) & (1 << 15)}
    n = len(path) - (1 if path[-1] in ro else 0)
    assert np.array_equal(walk_out[:n], chain_out[:n]), f"{what}: the walk's outputs differ from a chain's"
    if n < len(path):
        assert rel_max(walk_out[n:], chain_out[n:]) < TOL_LEAF, f"{what}: a read-only leaf's output"


def walk_path(xp, inputs, s0, path, **layout) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of a root -> node path run as a chain from s0 (gated_delta_tree without a plan: in order, the state
    in registers, no stack): (outputs (len(path), Hv * dv), final state). With the layout of a tree walk (or of a
    commit's replay: its cols_per_warp), the outputs equal the walk's on those nodes and the final state the
    replayed state of the path's last node bit for bit: the same state update on the same inputs.
    inputs: host q, k, v, g, beta of the step's rows."""
    from kernels import deltanet as dn

    rows = [xp.asarray(np.ascontiguousarray(a[np.asarray(path)])) for a in inputs]
    s = xp.asarray(s0)
    out = dn.gated_delta_tree(*rows, s, final_state=s, **layout)
    return xp.asnumpy(out).reshape(len(path), -1), xp.asnumpy(s)


def check_walk(xp, rng, parents, Hk: int, Hv: int, dk: int, dv: int, f16: bool = False, cols_per_warp: int = 8,
               warps: int = 2, depth: int = 8, decay: float = 0.5, explicit_plan: bool = False,
               portable: bool = False) -> None:  # fmt: skip
    """The walk against the token loop, and each root -> leaf path run as a chain (walk_path): bit for bit but for a
    read-only leaf's output (check_walk_on_path)."""
    from kernels import deltanet as dn

    T = len(parents)
    t_max = T + 2
    dt = np.float16 if f16 else np.float32
    q, k, v, g, beta, s0 = tree_inputs(t_max, Hk, Hv, dk, dv, rng, dt, decay)
    par = np.full(t_max, -1, np.int32)
    par[:T] = parents
    n_dev = xp.asarray(np.array([T], np.int32))
    dev = [xp.asarray(a) for a in (q, k, v, g, beta)]
    s0_d = xp.asarray(s0)
    layout = dict(cols_per_warp=cols_per_warp, warps=warps, portable=portable)
    out = poisoned(xp, (t_max, Hv * dv))
    if explicit_plan:
        plan = dn.tree_plan(xp.asarray(par), n_tokens=n_dev, portable=portable)
        dn.gated_delta_tree(*dev, s0_d, plan=plan, n_tokens=n_dev, out=out, depth=depth, **layout)
    else:
        dn.gated_delta_tree(*dev, s0_d, parents=xp.asarray(par), n_tokens=n_dev, out=out, depth=depth, **layout)
    out = xp.asnumpy(out)
    ref_out, _ = tree_twin(q, k, v, g, beta, s0, clamp_parents(parents), Hk, dk)
    assert rel_max(out[:T].reshape(T, Hv, dv), ref_out) < TOL_RULE
    assert np.isnan(out[T:]).all(), "rows past n_tokens were written"
    assert np.array_equal(xp.asnumpy(s0_d), s0), "the committed state was written"
    host_par = clamp_parents(parents)
    for leaf in sorted(set(range(T)) - set(host_par.tolist())):  # every node lies on some leaf's path
        path = path_to(host_par, leaf)
        chain_out, _ = walk_path(xp, (q, k, v, g, beta), s0, path, depth=depth, **layout)
        check_walk_on_path(out[path], chain_out, path, host_par, f"path to {leaf}")


def check_commit_replay(xp, rng, parents, Hk: int, Hv: int, dk: int, dv: int, L: int = 2, f16: bool = False,
                        cols_per_warp: int = 8, warps: int = 2, depth: int = 8, decay: float = 0.5, accepted=None,
                        chain: bool = False, device_parents=None, portable: bool = False) -> None:  # fmt: skip
    """Every accepted path of a tree (or the nodes in `accepted`), committed by replay (commit: state + conv
    window, all layers in one launch each): the state within TOL_RULE of SequenceState.commit over the token
    loop's states (float64) and bit for bit the final state of the path run as a chain (walk_path), whose
    outputs are the tree walk's on the path (bit for bit but for a read-only leaf's; the replay is the tree step's
    state of that node); the window bit-exact; nothing accepted (-1) or an index past T_max leaves both as they
    were. chain: the commit gets no parent list (a chain verify). device_parents: the list the device gets instead
    of `parents` (a corrupt one: read clamped)."""
    from kernels import deltanet as dn
    from services.engine.state import PendingStep, SequenceState  # needs gguf (kv cache codecs): imported here

    T = len(parents)
    host_par = clamp_parents(parents if device_parents is None else device_parents)
    t_max = T + 1
    dt = np.float16 if f16 else np.float32
    C = 2 * Hk * dk + Hv * dv
    mixed = np.zeros((L, t_max, C), dt)  # the model's layout: conv output rows (q | k | v), gates apart
    gates = np.zeros((L, 2, t_max, Hv), np.float32)
    s0 = np.zeros((L, Hv, dk, dv), np.float32)
    for i in range(L):
        q, k, v, g, beta, s0[i] = tree_inputs(t_max, Hk, Hv, dk, dv, rng, dt, decay)
        mixed[i] = np.concatenate([q, k, v], axis=1)
        gates[i] = g, beta
    window = rng.standard_normal((L, KW - 1, C)).astype(np.float32)
    raw = rng.standard_normal((L, t_max, C)).astype(dt)
    par = np.full(t_max, -1, np.int32)
    par[:T] = host_par if device_parents is None else np.asarray(device_parents, np.int32)
    par_d = None if chain else xp.asarray(par)
    kd = Hk * dk
    mixed_d, gates_d, raw_d = xp.asarray(mixed), xp.asarray(gates), xp.asarray(raw)
    layout = dict(cols_per_warp=cols_per_warp, warps=warps, depth=depth, portable=portable)

    inputs, walks, twins = [], [], []  # per layer: host q, k, v, g, beta; the tree walk's outputs; the token loop's
    for i in range(L):
        m = mixed_d[i]
        out = dn.gated_delta_tree(m[:, :kd], m[:, kd : 2 * kd], m[:, 2 * kd :], gates_d[i, 0], gates_d[i, 1],
                                  xp.asarray(s0[i]), parents=xp.asarray(par), n_tokens=T, **layout)  # fmt: skip
        walks.append(xp.asnumpy(out).reshape(t_max, -1))
        inputs.append((mixed[i, :, :kd], mixed[i, :, kd : 2 * kd], mixed[i, :, 2 * kd :], gates[i, 0], gates[i, 1]))
        mh = mixed[i].astype(np.float32)
        twins.append(tree_twin(mh[:, :kd], mh[:, kd : 2 * kd], mh[:, 2 * kd :], gates[i, 0], gates[i, 1], s0[i],
                               host_par, Hk, dk)[1])  # fmt: skip

    cfg = SimpleNamespace(recurrent_layers=[True] * L, ssm_n_v_heads=Hv, ssm_head_k_dim=dk, ssm_head_v_dim=dv,
                          ssm_conv_kernel=KW, ssm_conv_dim=C)  # fmt: skip
    nodes = list(range(T)) + [-1, t_max, 10 * t_max] if accepted is None else list(accepted)
    for a in nodes:
        state_d, window_d = xp.asarray(s0), xp.asarray(window)
        dn.commit(xp.asarray(np.array([a], np.int32)), par_d, mixed_d[:, :T, kd : 2 * kd], mixed_d[:, :T, 2 * kd :],
                  gates_d[:, 0, :T], gates_d[:, 1, :T], state_d, raw_d[:, :T], window_d, **layout)  # fmt: skip
        got, got_w = xp.asnumpy(state_d), xp.asnumpy(window_d)
        if not 0 <= a < T:
            assert np.array_equal(got, s0) and np.array_equal(got_w, window), f"accepted {a} changed the state"
            continue
        seq = SequenceState.allocate(cfg, 64)
        for i in range(L):
            seq.conv[i][:] = window[i]
        seq.pending = PendingStep(n_tokens=T, parents=host_par, ssm_states={i: twins[i] for i in range(L)},
                                  ssm_per_token=True, raw_rows={i: raw[i, :T].astype(np.float32) for i in range(L)})
        path = path_to(host_par, a)
        seq.commit(path)
        for i in range(L):
            chain_out, chain_state = walk_path(xp, inputs[i], s0[i], path, **layout)
            check_walk_on_path(walks[i][path], chain_out, path, host_par, f"layer {i}, node {a}")
            assert np.array_equal(got[i], chain_state), f"layer {i}, node {a}: replay != the tree step's state"
            assert rel_max(got[i], seq.ssm[i]) < TOL_RULE, f"layer {i}, node {a}"
            assert np.array_equal(got_w[i], seq.conv[i]), f"layer {i}, node {a}: conv window"


def check_corrupt_plan(xp, rng, portable: bool = False) -> None:
    """Garbage plan entries (nodes, loads, saves past their ranges) keep the walk inside its buffers: it writes only
    rows below n_tokens and never the committed state."""
    from kernels import deltanet as dn

    T, Hk, Hv, dk, dv = 9, 2, 4, 128, 32
    t_max = T + 3
    q, k, v, g, beta, s0 = tree_inputs(t_max, Hk, Hv, dk, dv, rng)
    plan = rng.integers(-(2**31), 2**31 - 1, size=t_max, dtype=np.int64).astype(np.int32)
    out = poisoned(xp, (t_max, Hv * dv))
    s0_d = xp.asarray(s0)
    dn.gated_delta_tree(*(xp.asarray(a) for a in (q, k, v, g, beta)), s0_d, plan=xp.asarray(plan),
                        n_tokens=xp.asarray(np.array([T], np.int32)), out=out, portable=portable)  # fmt: skip
    out = xp.asnumpy(out)
    assert np.isnan(out[T:]).all(), "a garbage plan wrote past n_tokens"
    assert np.array_equal(xp.asnumpy(s0_d), s0)


def check_layer_core(xp, rng, T: int, Hk: int, Hv: int, dk: int, dv: int, f16: bool, portable: bool = False) -> None:
    """conv -> norm + gates -> tree step on one layer, against the same lines of qwen35._deltanet."""
    from kernels import deltanet as dn

    kd = Hk * dk
    C = 2 * kd + Hv * dv
    parents = random_tree(T, rng)
    dt = np.float16 if f16 else np.float32
    raw = rng.standard_normal((T, C)).astype(dt)
    alpha = rng.standard_normal((T, Hv)).astype(dt)
    b = rng.standard_normal((T, Hv)).astype(dt)
    window = rng.standard_normal((KW - 1, C)).astype(np.float32)
    conv_w = (rng.standard_normal((C, KW)) * 0.5).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(Hv) * 0.5).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    s0 = (rng.standard_normal((Hv, dk, dv)) * 0.3).astype(np.float32)

    mixed = layers.causal_conv(window, raw.astype(np.float32), conv_w, layers.conv_window_ids(parents, KW))
    q = layers.l2_norm(mixed[:, :kd].reshape(T, Hk, dk), 1e-6) * np.float32(dk**-0.5)
    k = layers.l2_norm(mixed[:, kd : 2 * kd].reshape(T, Hk, dk), 1e-6)
    v = mixed[:, 2 * kd :].reshape(T, Hv, dv)
    tiled = np.arange(Hv) % Hk
    beta = layers.sigmoid(b.astype(np.float32))
    g = ssm_a * layers.softplus(alpha.astype(np.float32) + dt_bias)
    ref_out, _ = layers.gated_delta_rule_tree(q[:, tiled], k[:, tiled], v, g, beta, s0, parents)

    out, _ = dn.deltanet_core(xp.asarray(raw), xp.asarray(alpha), xp.asarray(b), xp.asarray(window), xp.asarray(conv_w),
                              xp.asarray(ssm_a), xp.asarray(dt_bias), xp.asarray(s0), n_k_heads=Hk, head_k_dim=dk,
                              parents=xp.asarray(parents), portable=portable)  # fmt: skip
    assert rel_max(xp.asnumpy(out), ref_out) < TOL_RULE


def check_bad_inputs(xp) -> None:
    from kernels import deltanet as dn

    f = np.float32
    with pytest.raises(ValueError, match="parents\\[2\\] = 2"):
        dn.device_parents(np.array([-1, 0, 2]))
    q = xp.asarray(np.zeros((3, 256), f))
    g = xp.asarray(np.zeros((3, 4), f))
    s0 = xp.asarray(np.zeros((4, 128, 32), f))
    v = xp.asarray(np.zeros((3, 128), f))
    with pytest.raises(ValueError, match="depth must be 2..16"):
        dn.gated_delta_tree(q, q, v, g, g, s0, depth=1)
    with pytest.raises(ValueError, match="final_state"):
        dn.gated_delta_tree(q, q, v, g, g, s0, parents=np.array([-1, 0, 0]), final_state=s0)
    with pytest.raises(ValueError, match="plan must be"):
        dn.gated_delta_tree(q, q, v, g, g, s0, plan=xp.asarray(np.zeros(2, np.int32)))
    pair, swap = xp.asarray(np.zeros((2, 4, 128, 32), f)), xp.asarray(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="alt and swap go together"):
        dn.gated_delta_tree(q, q, v, g, g, pair[0], alt=pair[1])
    with pytest.raises(ValueError, match="final_state must be alt"):
        dn.gated_delta_tree(q, q, v, g, g, pair[0], alt=pair[1], swap=swap, final_state=pair[0])
    with pytest.raises(ValueError, match="must not overlap"):
        dn.gated_delta_tree(q, q, v, g, g, pair[0], alt=pair[0], swap=swap)
    with pytest.raises(ValueError, match="laid out as s0"):
        dn.gated_delta_tree(q, q, v, g, g, pair[0], alt=pair[1, :2], swap=swap)
    with pytest.raises(ValueError, match="device int32"):
        dn.gated_delta_tree(q, q, v, g, g, pair[0], alt=pair[1], swap=xp.asarray(np.zeros(1, np.int64)))
    with pytest.raises(ValueError, match="1..1024"):
        dn.tree_plan(np.full(1025, -1))
    with pytest.raises(ValueError, match="features"):
        dn.gated_delta_tree(q, q, xp.asarray(np.zeros((3, 100), f)), g, g, s0)
    with pytest.raises(ValueError, match="float16 or float32"):
        dn.conv_silu(xp.asarray(np.zeros((2, 8), np.int32)), xp.asarray(np.zeros((3, 8), f)),
                     xp.asarray(np.zeros((8, 4), f)))  # fmt: skip
    with pytest.raises(ValueError, match="conv window"):
        dn.conv_silu(xp.asarray(np.zeros((2, 8), f)), xp.asarray(np.zeros((2, 8), f)), xp.asarray(np.zeros((8, 4), f)))


# ---------------------------------------------------------------------------------------------- the simulator

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float
_SIGNATURES = {  # harness entry: leading (launch) parameters, then the kernel's own
    "sim_conv": [I32, I32, I32, I32, P, I64, P, P, P, P, I32, I32, P, I64, I32],
    "sim_conv_rows": [I32, I32, I32, I32, P, I64, P, P, P, P, I32, I32, P, I64, P, I64, I32],
    "sim_norm": [I32, I32, I32, I32, I32, P, I64, I32, F32, F32, P, P, I64, P, P, I32, P, P, I64, P, I32],
    "sim_conv_norm": [I32, I32, I32, I32, I32, I32, P, I64, P, P, P, P, I32, I32, P, I64, P, I64, I32, F32, F32, P, P,
                      I64, P, P, I32, P, P, I64],
    "sim_plan": [I32, I32, P, P, I32, P],
    "sim_tree_walk": [I32, I32, I32, I32, I32, I32, P, P, I64, P, I64, P, P, I64, I32, I32, I32, P, P, P, I32, I32, P,
                      P, I64, P, I64, I32],
    "sim_commit_replay": [I32, I32, I32, I32, I32, I32, I32, P, P, I64, I64, P, P, I64, I64, I32, I32, I32, P, I64, P,
                          P, I32, P, I64],
    "sim_conv_commit": [I32, I32, I32, I32, P, I64, P, I64, I64, P, P, I32, I32],
}


class SimArray(np.ndarray):
    """A NumPy array that answers `.data.ptr` like a CuPy array (views keep their offset)."""

    @property
    def data(self):  # noqa: D401
        return SimpleNamespace(ptr=self.ctypes.data)


class SimKernel:
    def __init__(self, lib, name: str):
        m = re.fullmatch(r"(\w+)(?:<(.*)>)?", name)
        base, targs = m.group(1), [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]
        f16 = int(bool(targs) and targs[0] == "unsigned short")
        if base in ("conv_silu_kernel", "conv_silu_rows_kernel", "conv_commit_kernel"):
            assert targs[1] == str(KW), "the simulator instantiates the conv kernels for K = 4 only"
            fn = {"conv_silu_kernel": lib.sim_conv, "conv_silu_rows_kernel": lib.sim_conv_rows}.get(base)
            self.fn, self.lead = fn or lib.sim_conv_commit, [f16]
        elif base == "conv_qk_norm_gate_kernel":
            assert targs[1] == str(KW), "the simulator instantiates the conv kernels for K = 4 only"
            self.fn, self.lead = lib.sim_conv_norm, [f16, int(targs[2]), int(targs[3])]
        elif base == "qk_norm_gate_kernel":
            self.fn, self.lead = lib.sim_norm, [f16, int(targs[1])]
        elif base == "gdr_tree_plan_kernel":
            self.fn, self.lead = lib.sim_plan, []
        elif base in ("gdr_tree_walk_kernel", "gdr_commit_kernel"):
            fn = lib.sim_tree_walk if base == "gdr_tree_walk_kernel" else lib.sim_commit_replay
            self.fn, self.lead = fn, [f16, int(targs[1]), int(targs[2]), int(targs[3])]
        else:
            raise AssertionError(f"no simulator entry for {name}")
        self.grid_dims = 1 if base.startswith("gdr_tree") else 2
        self.smem_limit = lib.sim_smem_bytes()
        self.max_dynamic_shared_size_bytes = 48 * 1024  # CUDA's default; a launcher opts in above it

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        assert shared_mem <= self.smem_limit, f"{shared_mem} bytes of shared memory asked, the simulator has fewer"
        assert shared_mem <= self.max_dynamic_shared_size_bytes, "launched above 48 KiB without opting in"
        grid = tuple(grid) + (1,) * (self.grid_dims - len(grid))
        assert len(grid) == self.grid_dims and len(block) == 1 and block[0] % 32 == 0
        conv = []
        for a in args:
            if isinstance(a, np.ndarray) and a.ndim > 0:
                assert isinstance(a, SimArray), "a host array was passed where the kernel needs device memory"
                conv.append(a.ctypes.data)
            elif isinstance(a, np.uint64):
                assert int(a) == 0, "only null pointers travel as integers"
                conv.append(None)
            else:
                conv.append(a.item() if isinstance(a, np.generic) else a)
        err = self.fn(*self.lead, *grid, block[0], *conv)
        assert err == 0, f"simulated launch failed ({err}): a warp diverged or no instantiation matched"


class SimCupy:
    """The CuPy surface kernels/deltanet.py (and GpuSequenceState) use, on host memory, with kernel launches run
    by the simulator."""

    float32, float16, int32, uint16, uint8, uint64 = np.float32, np.float16, np.int32, np.uint16, np.uint8, np.uint64
    ndarray = SimArray
    cuda = SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0), alloc_pinned_memory=bytearray,
                           Device=lambda *a: SimpleNamespace(id=0),
                           get_current_stream=lambda: SimpleNamespace(is_capturing=lambda: SimCupy.capturing))
    capturing = False  # what the stream answers (a test sets it to launch as a graph capture would)

    def zeros(self, shape, dtype=np.float32) -> SimArray:
        a = self.empty(shape, dtype)
        a[...] = 0
        return a

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def empty(shape, dtype=np.float32) -> SimArray:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.empty(n + 256, np.uint8)
        off = (-raw.ctypes.data) % 256  # device allocations are 256-byte aligned
        a = raw[off : off + n].view(dtype).reshape(shape).view(SimArray)
        if np.dtype(dtype).kind == "f":
            a[...] = np.nan  # fresh device memory is garbage
        return a

    def asarray(self, x) -> SimArray:
        if isinstance(x, SimArray):
            return x
        x = np.asarray(x)
        a = self.empty(x.shape, x.dtype)
        a[...] = x
        return a

    @staticmethod
    def asnumpy(x) -> np.ndarray:
        return np.array(x).view(np.ndarray)


def _build_sim(tmp_path_factory, harness: Path) -> ctypes.CDLL:
    """deltanet.cu compiled into `harness` (g++, cached by the sources' digest) and loaded."""
    parts = (SOURCE, *sorted(SOURCE.parent.glob("*.cuh")), harness, HARNESS.parent / "cuda_sim.h")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:16]
    lib_path = tmp_path_factory.mktemp(harness.stem) / f"{harness.stem}_{digest}.so"
    cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", f'-DDN_SOURCE="{SOURCE}"', "-o", str(lib_path),
           str(harness)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    return ctypes.CDLL(str(lib_path))


@pytest.fixture(scope="session")
def sim_lib(tmp_path_factory):
    lib = _build_sim(tmp_path_factory, HARNESS)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.sim_smem_bytes.argtypes, lib.sim_smem_bytes.restype = [], ctypes.c_size_t
    return lib


@pytest.fixture(scope="session")
def sim_block_lib(tmp_path_factory):
    lib = _build_sim(tmp_path_factory, BLOCK_HARNESS)
    lib.sim_decode.argtypes = [I32, I32, I32, I32, I32, P, P, P, P, P, P, P, P, I32, I32, I32, I32, F32, F32, P, P,
                               P, I64, P, P, P, F32, P, I32]  # fmt: skip
    lib.sim_decode.restype = ctypes.c_int
    lib.sim_block_smem_bytes.argtypes, lib.sim_block_smem_bytes.restype = [], ctypes.c_size_t
    return lib


class SimBlockKernel(SimKernel):
    """gdr_decode_kernel on the block-mode simulator (its warps meet at __syncthreads)."""

    def __init__(self, lib, name: str):
        m = re.fullmatch(r"(\w+)<(.*)>", name)
        assert m and m.group(1) == "gdr_decode_kernel", f"no block-mode simulator entry for {name}"
        targs = [a.strip() for a in m.group(2).split(",")]
        assert targs[3] == str(KW), "the simulator instantiates the decode kernel for K = 4 only"
        self.fn, self.lead = lib.sim_decode, [int(targs[0] == "unsigned short"), int(targs[1]), int(targs[2])]
        self.grid_dims = 1
        self.smem_limit = lib.sim_block_smem_bytes()
        self.max_dynamic_shared_size_bytes = 48 * 1024


@pytest.fixture
def xp(sim_lib, sim_block_lib, monkeypatch):
    from kernels import loader

    fake = SimCupy(sim_lib)
    fake.block_lib = sim_block_lib

    def get_function(source, name, defines=(), **kw):
        if name.startswith("gdr_decode_kernel"):
            return SimBlockKernel(sim_block_lib, name)
        return SimKernel(sim_lib, name)

    monkeypatch.setattr(loader, "require", lambda: fake)
    monkeypatch.setattr(loader, "get_function", get_function)
    return fake


@pytest.mark.parametrize("T,f16,chain", [(1, False, False), (7, True, False), (23, False, False), (5, False, True)])
def test_conv_follows_parent_chains(xp, T: int, f16: bool, chain: bool) -> None:
    check_conv(xp, np.random.default_rng(T + 10 * f16), T, 200, f16, chain)  # C not a multiple of the block


def record_last_arg(monkeypatch, entry) -> list[int]:
    """The last argument (a kernel's `early`) of every simulated launch through the harness entry `entry`."""
    seen: list[int] = []
    call = SimKernel.__call__

    def record(self, grid, block, args, shared_mem=0):
        if self.fn is entry:
            seen.append(int(args[-1]))
        return call(self, grid, block, args, shared_mem)

    monkeypatch.setattr(SimKernel, "__call__", record)
    return seen


@pytest.mark.parametrize("T,chain", [(1, True), (2, False)])
def test_conv_loads_the_window_early_in_a_capture(xp, monkeypatch, T: int, chain: bool) -> None:
    """Launched inside a graph capture at up to PDL_UP_TO tokens, the conv loads its weights and first token's
    window taps before its grid dependency wait (`early`); the outputs still match the twin."""
    seen = record_last_arg(monkeypatch, xp.lib.sim_conv)
    from kernels import deltanet as dn

    rng = np.random.default_rng(40 + T)
    C = 200  # not a multiple of the block: idle threads load nothing
    parents = np.arange(-1, T - 1, dtype=np.int32) if chain else np.array([-1, -1][:T], np.int32)
    raw = rng.standard_normal((T, C)).astype(np.float32)
    window = rng.standard_normal((KW - 1, C)).astype(np.float32)
    w = (rng.standard_normal((C, KW)) * 0.5).astype(np.float32)
    got = []
    for capturing in (False, True):
        monkeypatch.setattr(SimCupy, "capturing", capturing)
        out = dn.conv_silu(xp.asarray(raw), xp.asarray(window), xp.asarray(w),
                           parents=None if chain else xp.asarray(parents))
        got.append(xp.asnumpy(out).copy())
    assert seen == [0, 1]
    assert np.array_equal(got[0], got[1])
    ref = layers.causal_conv(window.astype(np.float64), raw.astype(np.float64), w.astype(np.float64),
                             layers.conv_window_ids(parents, KW))  # fmt: skip
    assert rel_max(got[1], ref) < TOL


@pytest.mark.parametrize("dk,f16", [(128, False), (64, True)])
def test_qk_norm_and_gates(xp, dk: int, f16: bool) -> None:
    check_norm_gate(xp, np.random.default_rng(dk), 5, 3, 6, dk, f16)


@pytest.mark.parametrize("dk,f16,chain,rows", [(128, False, True, True), (64, True, False, True),
                                               (128, True, False, False), (64, False, True, False)])
def test_conv_qk_norm_gate_is_the_two_launches(xp, dk: int, f16: bool, chain: bool, rows: bool) -> None:
    check_conv_norm_gate(xp, np.random.default_rng(dk + 7 * f16), 1 if chain else 6, 2, 5, dk, f16, chain, rows)
    check_conv_norm_gate(xp, np.random.default_rng(3), 3, 1, 3, dk, f16, chain, rows)


@pytest.mark.parametrize("depth", [2, 8])
def test_chain_updates_state_in_place(xp, depth: int) -> None:
    check_chain_in_place(xp, np.random.default_rng(7), 9, 2, 4, 128, 32, depth)


@pytest.mark.parametrize("swapped", [0, 1])
def test_walk_loads_the_state_early_only_in_a_capture(xp, monkeypatch, swapped: int) -> None:
    """A one- or two-token chain on a ping-pong state: launched inside a graph capture the walk loads the committed
    state before its grid dependency wait (`early`), elsewhere after it; outputs and the final state are the same,
    and the committed half is the one swap names (against the float64 twin)."""
    from kernels import deltanet as dn

    rng = np.random.default_rng(31 + swapped)
    Hk, Hv, dk, dv = 2, 4, 128, 32
    seen = record_last_arg(monkeypatch, xp.lib.sim_tree_walk)
    for T in (1, 2):
        q, k, v, g, beta, s0 = tree_inputs(T, Hk, Hv, dk, dv, rng)
        got = []
        for capturing in (False, True):
            monkeypatch.setattr(SimCupy, "capturing", capturing)
            pair = xp.asarray(np.stack([s0, s0 * -0.5]) if not swapped else np.stack([s0 * -0.5, s0]))
            swap = xp.asarray(np.array([swapped], np.int32))
            out = dn.gated_delta_tree(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(g), xp.asarray(beta),
                                      pair[0], final_state=pair[1], alt=pair[1], swap=swap)  # fmt: skip
            got.append((xp.asnumpy(out).copy(), xp.asnumpy(pair).copy()))
        assert seen[-2:] == [0, 1]
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])
        ref_out, _ = tree_twin(q, k, v, g, beta, s0, np.arange(-1, T - 1), Hk, dk)
        assert rel_max(got[0][0], ref_out) < TOL_RULE


def test_corrupt_device_parent_lists_stay_in_bounds(xp) -> None:
    # Entries outside -1..t-1 are read as roots (documented): no crash, no read of anything but s0 for them.
    from kernels import deltanet as dn

    rng = np.random.default_rng(8)
    T, Hk, Hv, dk, dv = 6, 2, 2, 128, 32
    q, k, v, g, beta, s0 = tree_inputs(T, Hk, Hv, dk, dv, rng)
    bad = xp.asarray(np.array([5, 0, 99, -7, 3, 4], np.int32))  # a device list is not checked on the host
    out = dn.gated_delta_tree(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(g), xp.asarray(beta),
                              xp.asarray(s0), parents=bad)  # fmt: skip
    ref_out, _ = tree_twin(q, k, v, g, beta, s0, np.array([-1, 0, -1, -1, 3, 4]), Hk, dk)
    assert rel_max(xp.asnumpy(out), ref_out) < TOL_RULE


WALK_SHAPES = [("random", 1), ("random", 2), ("random", 7), ("random", 23), ("random", 41), ("random", 64),
               ("chain", 16), ("star", 23), ("forest", 10), ("deep", 41), ("ddtree", 23), ("ddtree", 64),
               ("profile", 41), ("binary", 5)]  # fmt: skip


@pytest.mark.parametrize("kind,n", WALK_SHAPES)
def test_tree_plan_matches_its_twin(xp, kind: str, n: int) -> None:
    check_plan(xp, tree_shape(kind, n, np.random.default_rng(n)))


def test_tree_plan_many_random_trees_and_the_stack_bound(xp) -> None:
    from kernels import deltanet as dn

    rng = np.random.default_rng(4)
    for n in rng.integers(1, 65, size=40):
        check_plan(xp, random_tree(int(n), rng))
        check_plan(xp, np.array([-1] + [int(rng.integers(0, t)) for t in range(1, int(n))], np.int32))
    for depth in range(1, 6):
        # complete binary trees whose leaves have a child each need exactly the bound: 1..5 slots for 5..95 nodes
        par = dfs_binary(depth, tails=True)
        assert check_plan(xp, par) == depth == dn.walk_stack_slots(len(par))
        # without the tails the last level is read-only leaves: one slot fewer
        assert check_plan(xp, dfs_binary(depth)) == depth - 1


def test_tree_plan_of_corrupt_lists_and_past_n_tokens(xp) -> None:
    check_plan(xp, np.array([5, 0, 99, -7, 3, 4, 6, 2, -1, 8], np.int32))  # read clamped, as the twin does
    check_plan(xp, random_tree(12, np.random.default_rng(2)), t_max=20)


@pytest.mark.parametrize(
    "kind,n,dk,dv,cw,f16,warps,depth,decay,explicit",
    [("random", 1, 128, 64, 8, False, 4, 8, 0.5, False), ("random", 7, 64, 32, 8, True, 4, 8, 0.5, True),
     ("random", 23, 128, 32, 4, False, 1, 8, 0.5, False), ("random", 41, 128, 32, 8, False, 2, 2, 0.5, False),
     ("random", 64, 128, 32, 8, False, 4, 8, 0.5, True), ("star", 23, 128, 32, 8, False, 2, 8, 0.5, False),
     ("deep", 41, 64, 32, 8, True, 2, 8, 0.5, False), ("ddtree", 64, 128, 32, 8, False, 2, 8, 0.5, False),
     ("binary", 5, 128, 32, 8, False, 2, 8, 0.5, False), ("forest", 10, 128, 32, 8, False, 2, 8, 0.5, False),
     ("chain", 16, 128, 32, 8, False, 2, 8, 0.5, False), ("random", 23, 128, 32, 8, False, 2, 8, 30.0, False)],
)  # fmt: skip
def test_tree_walk_matches_token_loop_and_its_paths(xp, kind, n, dk, dv, cw, f16, warps, depth, decay,
                                                    explicit) -> None:  # fmt: skip
    rng = np.random.default_rng(200 + n)
    check_walk(xp, rng, tree_shape(kind, n, rng), 2, 4, dk, dv, f16, cw, warps, depth, decay, explicit)


@pytest.mark.parametrize(
    "kind,n,f16,cw,decay,chain",
    [("random", 1, False, 8, 0.5, False), ("random", 2, True, 8, 0.5, True), ("random", 23, False, 8, 0.5, False),
     ("random", 64, False, 8, 0.5, False), ("ddtree", 41, True, 8, 0.5, False),
     ("deep", 23, False, 4, 0.5, False), ("star", 16, False, 8, 0.5, False), ("binary", 4, False, 8, 0.5, False),
     ("chain", 12, False, 8, 0.5, True), ("random", 16, False, 8, 30.0, False)],
)  # fmt: skip
def test_commit_replay_of_every_accepted_path(xp, kind, n, f16, cw, decay, chain) -> None:
    rng = np.random.default_rng(300 + n)
    check_commit_replay(xp, rng, tree_shape(kind, n, rng), 2, 4, 128, 32, f16=f16, cols_per_warp=cw, decay=decay,
                        chain=chain)  # fmt: skip


def test_commit_replay_reads_corrupt_parents_clamped(xp) -> None:
    bad = np.array([5, 0, 99, -7, 3, 4, 2, 6, 7, 1], np.int32)
    check_commit_replay(xp, np.random.default_rng(12), np.zeros(len(bad), np.int32), 2, 4, 64, 32,
                        device_parents=bad)  # fmt: skip


def test_corrupt_plan_stays_in_bounds(xp) -> None:
    check_corrupt_plan(xp, np.random.default_rng(13))


def test_shared_memory_sizes_match_the_kernels(xp, sim_lib) -> None:
    from kernels import deltanet as dn

    sim_lib.sim_walk_smem.restype = sim_lib.sim_commit_smem.restype = ctypes.c_longlong
    for f16, dk, cw, depth, slots, plan in ((0, 128, 8, 8, 5, 65), (1, 128, 8, 8, 0, 0), (0, 64, 8, 8, 3, 23),
                                            (1, 128, 4, 8, 4, 41), (0, 128, 8, 2, 1, 3)):  # fmt: skip
        want = sim_lib.sim_walk_smem(f16, dk, cw, depth, slots, plan)
        assert dn.walk_smem_bytes(dk, 2 if f16 else 4, cw, depth, slots, plan) == want
    for f16, dk, depth, t_max in ((0, 128, 8, 65), (1, 128, 8, 1), (0, 64, 8, 23), (1, 128, 2, 41)):
        assert dn.commit_smem_bytes(dk, 2 if f16 else 4, depth, t_max) == sim_lib.sim_commit_smem(f16, dk, depth, t_max)


def check_decode_step(xp, rng, Hk: int, Hv: int, dk: int, dv: int, f16: bool, swapped: int, capturing: bool,
                      warps: int = 2, cols: int = 8) -> None:
    """decode_step (one launch) against conv_silu + qk_norm_gate + gated_delta_tree on a one-token chain: out and
    the final state bit for bit, on a ping-pong state; the raw row kept; and against the float64 engine lines."""
    from kernels import deltanet as dn

    kd = Hk * dk
    C = 2 * kd + Hv * dv
    dt = np.float16 if f16 else np.float32
    proj = rng.standard_normal((1, C + 2 * Hv + 3)).astype(dt)  # the qkv row, alpha and b as views of one row
    window = rng.standard_normal((KW - 1, C)).astype(np.float32)
    conv_w = (rng.standard_normal((C, KW)) * 0.5).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(Hv) * 0.5).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    pair = (rng.standard_normal((2, Hv, dk, dv)) * 0.3).astype(np.float32)
    P_ = xp.asarray(proj)
    raw, alpha, b = P_[:, :C], P_[:, C + 3:C + 3 + Hv], P_[:, C + 3 + Hv:]
    swap = xp.asarray(np.array([swapped], np.int32))
    SimCupy.capturing = capturing
    try:
        outs = []
        for fused in (True, False):
            st = xp.asarray(pair)
            rows = poisoned(xp, (1, C))
            if fused:
                o = dn.decode_step(raw, xp.asarray(window), xp.asarray(conv_w), alpha, b, xp.asarray(ssm_a),
                                   xp.asarray(dt_bias), st[0], n_k_heads=Hk, final_state=st[1], alt=st[1], swap=swap,
                                   rows_out=rows, warps=warps, cols_per_warp=cols)  # fmt: skip
            else:
                mixed = dn.conv_silu(raw, xp.asarray(window), xp.asarray(conv_w))  # (rows: checked below)
                g, beta = dn.qk_norm_gate(mixed, alpha, b, xp.asarray(ssm_a), xp.asarray(dt_bias), n_k_heads=Hk,
                                          head_k_dim=dk)
                # (the walk takes up to 4 warps a block; a column's arithmetic does not depend on the block's)
                o = dn.gated_delta_tree(mixed[:, :kd], mixed[:, kd:2 * kd], mixed[:, 2 * kd:], g, beta, st[0],
                                        final_state=st[1], alt=st[1], swap=swap, warps=min(warps, 4),
                                        cols_per_warp=cols)
            outs.append((xp.asnumpy(o).copy(), xp.asnumpy(st).copy(), xp.asnumpy(rows).copy()))
    finally:
        SimCupy.capturing = False
    for a, ref in zip(outs[0][:2], outs[1][:2]):
        assert np.array_equal(a, ref)
    # the committed half is the one swap names; the other half receives the final state
    s_in, s_out = (pair[1], 0) if swapped else (pair[0], 1)
    ids = layers.conv_window_ids(np.array([-1]), KW)
    mixed = layers.causal_conv(window, proj[:, :C].astype(np.float32), conv_w, ids)
    q = layers.l2_norm(mixed[:, :kd].reshape(1, Hk, dk), 1e-6) * np.float32(dk**-0.5)
    k = layers.l2_norm(mixed[:, kd:2 * kd].reshape(1, Hk, dk), 1e-6)
    v = mixed[:, 2 * kd:].reshape(1, Hv, dv)
    tiled = np.arange(Hv) % Hk
    beta = layers.sigmoid(proj[:, C + 3 + Hv:].astype(np.float32))
    g = ssm_a * layers.softplus(proj[:, C + 3:C + 3 + Hv].astype(np.float32) + dt_bias)
    ref_out, ref_state = layers.gated_delta_rule_tree(q[:, tiled], k[:, tiled], v, g, beta, s_in, np.array([-1]))
    assert rel_max(outs[0][0], ref_out) < TOL_RULE
    assert rel_max(outs[0][1][s_out], ref_state) < TOL_RULE
    assert np.array_equal(outs[0][1][1 - s_out], pair[1 - s_out])  # the committed half is only read
    assert np.array_equal(outs[0][2], proj[:, :C].astype(np.float32))


@pytest.mark.parametrize("f16,swapped,capturing,warps,cols", [(False, 0, False, 2, 8), (True, 1, True, 2, 8),
                                                             (False, 1, True, 4, 4), (True, 0, False, 4, 8)])
def test_decode_step_is_the_three_launches(xp, f16: bool, swapped: int, capturing: bool, warps: int,
                                           cols: int) -> None:
    check_decode_step(xp, np.random.default_rng(41 + swapped + 2 * warps), 2, 6, 128, 32, f16, swapped, capturing,
                      warps, cols)


@pytest.mark.parametrize("warps", [8, 16])
def test_decode_step_on_wide_blocks(xp, warps: int) -> None:
    """decode_step on blocks of 8 / 16 warps (16: a value head of 128 columns each) is bit for bit the walk on blocks
    of 4."""
    check_decode_step(xp, np.random.default_rng(60 + warps), 1, 2, 128, 128, warps == 16, 0, warps == 8, warps, 8)


def decode_norm_case(xp, rng, Hk: int, Hv: int, dk: int, dv: int, f16: bool, swapped: int = 0) -> tuple:
    """decode_step's operands with its output norm's (gate row and norm weight as the engine passes them: views of
    the projection row), the launch with q16 and the one without: (o with q16, o without, q16 words, the gate row
    and norm weight as NumPy arrays, o's float64 norm reference rms_norm(o_h) * w * silu(z_h) [Hv dv])."""
    from kernels import deltanet as dn

    kd = Hk * dk
    C = 2 * kd + Hv * dv
    dt = np.float16 if f16 else np.float32
    proj = rng.standard_normal((1, C + Hv * dv + 2 * Hv)).astype(dt)  # [qkv | z | alpha | b], one row
    window = xp.asarray(rng.standard_normal((KW - 1, C)).astype(np.float32))
    conv_w = xp.asarray((rng.standard_normal((C, KW)) * 0.5).astype(np.float32))
    ssm_a = xp.asarray(-np.exp(rng.standard_normal(Hv) * 0.5).astype(np.float32))
    dt_bias = xp.asarray(rng.standard_normal(Hv).astype(np.float32))
    pair = (rng.standard_normal((2, Hv, dk, dv)) * 0.3).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    P_ = xp.asarray(proj)
    raw, z = P_[:, :C], P_[:, C:C + Hv * dv]
    alpha, b = P_[:, C + Hv * dv:C + Hv * dv + Hv], P_[:, C + Hv * dv + Hv:]
    swap = xp.asarray(np.array([swapped], np.int32))
    words = -(-(Hv * dv) // 256) * 160
    outs = []
    for staged in (True, False):
        st = xp.asarray(pair)
        q16 = xp.asarray(np.full(words, 0xDEADBEEF, np.uint32)) if staged else None
        o = dn.decode_step(raw, window, conv_w, alpha, b, ssm_a, dt_bias, st[0], n_k_heads=Hk, final_state=st[1],
                           alt=st[1], swap=swap, warps=dv // 8, gate=z if staged else None,
                           norm_weight=xp.asarray(norm_w) if staged else None, norm_eps=1e-5, q16=q16)
        outs.append((xp.asnumpy(o).copy(), xp.asnumpy(st).copy(), None if q16 is None else xp.asnumpy(q16).copy()))
    o = outs[0][0].reshape(Hv, dv).astype(np.float64)
    zz = proj[0, C:C + Hv * dv].astype(np.float64).reshape(Hv, dv)
    ref = o / np.sqrt((o * o).mean(axis=1, keepdims=True) + 1e-5) * norm_w * (zz / (1 + np.exp(-zz)))
    return outs, proj[:, C:C + Hv * dv], norm_w, ref.reshape(-1)


def check_decode_norm(xp, rng, Hk: int, Hv: int, dk: int, dv: int, f16: bool, swapped: int = 0) -> np.ndarray:
    """decode_step(q16=): out and the state bit for bit those without it; the staging (every word written) holds the
    output norm: q * scale within fp16 and int16 rounding of the float64 norm of the kernel's own o, each group's
    scale max |x| / 32767 and sum its values'. Returns the q16 words."""
    outs, _, _, ref = decode_norm_case(xp, rng, Hk, Hv, dk, dv, f16, swapped)
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    words = outs[0][2]
    nch = Hv * dv // 256
    q = words[:nch * 32 * 4].view(np.int16).astype(np.float64).reshape(nch * 16, 16)
    scale = words[nch * 128:nch * 144].view(np.float32).astype(np.float64)
    sums = words[nch * 144:].view(np.float32).astype(np.float64)
    g = ref.reshape(nch * 16, 16)
    amax = np.abs(g).max(axis=1)
    assert np.allclose(scale, amax / 32767, rtol=2e-3, atol=0)
    assert np.abs(q).max() == 32767  # every group's largest value at full scale
    err = np.abs(q * scale[:, None] - g).max(axis=1)
    assert (err <= amax * (2.0**-10 + 2.0 / 32767)).all(), "staged values off the norm past fp16 + int16 rounding"
    assert np.allclose(sums, g.sum(axis=1), rtol=0, atol=float(np.abs(g).max()) * 16 * 2.0**-10)
    return words


@pytest.mark.parametrize("f16,swapped,dv", [(False, 0, 128), (True, 1, 128), (False, 1, 32)])
def test_decode_step_stages_the_output_norm(xp, f16: bool, swapped: int, dv: int) -> None:
    """The one-token layer's output norm * silu(z) written as ssm_out's int16 staging by decode_step itself (a block
    per value head; 2 / 4 heads of 128, 8 of 32)."""
    Hv = 256 // dv * 2
    check_decode_norm(xp, np.random.default_rng(70 + dv + swapped), 1, Hv, 64 if dv == 32 else 128, dv, f16, swapped)


def test_decode_step_norm_refusals(xp) -> None:
    from kernels import deltanet as dn

    Hk, Hv, dk, dv = 1, 2, 128, 128
    C = 2 * Hk * dk + Hv * dv
    z = lambda *shape, dt=np.float32: xp.asarray(np.zeros(shape, dt))  # noqa: E731
    args = (z(1, C), z(KW - 1, C), z(C, KW), z(1, Hv), z(1, Hv), z(Hv), z(Hv), z(Hv, dk, dv))
    q16 = xp.asarray(np.zeros(160, np.uint32))
    norm = dict(gate=z(1, Hv * dv), norm_weight=z(dv), q16=q16)
    with pytest.raises(ValueError, match="a block per value head"):
        dn.decode_step(*args, n_k_heads=Hk, warps=4, **norm)
    with pytest.raises(ValueError, match="needs gate and norm_weight"):
        dn.decode_step(*args, n_k_heads=Hk, warps=16, q16=q16)
    with pytest.raises(ValueError, match="gate must be"):
        dn.decode_step(*args, n_k_heads=Hk, warps=16, **{**norm, "gate": z(1, Hv * dv, dt=np.float16)})
    with pytest.raises(ValueError, match="norm_weight"):
        dn.decode_step(*args, n_k_heads=Hk, warps=16, **{**norm, "norm_weight": z(dv + 1)})
    with pytest.raises(ValueError, match="160 words"):
        dn.decode_step(*args, n_k_heads=Hk, warps=16, **{**norm, "q16": xp.asarray(np.zeros(159, np.uint32))})
    assert dn.norm_stages(48, 128) and not dn.norm_stages(3, 128) and not dn.norm_stages(8, 24, 8)


def test_decode_step_refusals(xp) -> None:
    from kernels import deltanet as dn

    Hk, Hv, dk, dv = 2, 4, 128, 32
    C = 2 * Hk * dk + Hv * dv
    z = lambda *shape, dt=np.float32: xp.asarray(np.zeros(shape, dt))  # noqa: E731
    args = (z(1, C), z(KW - 1, C), z(C, KW), z(1, Hv), z(1, Hv), z(Hv), z(Hv), z(Hv, dk, dv))
    with pytest.raises(ValueError, match="one token"):
        dn.decode_step(z(2, C), *args[1:], n_k_heads=Hk)
    with pytest.raises(ValueError, match="channels"):
        dn.decode_step(z(1, C + 4), z(KW - 1, C + 4), z(C + 4, KW), *args[3:], n_k_heads=Hk)
    with pytest.raises(ValueError, match="warps in 2..16"):
        dn.decode_step(*args, n_k_heads=Hk, warps=1)
    with pytest.raises(ValueError, match="multiple of their product"):  # 8 warps of 8 columns: 64, dv is 32
        dn.decode_step(*args, n_k_heads=Hk, warps=8)
    with pytest.raises(ValueError, match="dtype"):
        dn.decode_step(*args[:3], z(1, Hv, dt=np.float16), z(1, Hv, dt=np.float16), *args[5:], n_k_heads=Hk)


def test_layer_core_matches_the_engine_lines(xp) -> None:
    check_layer_core(xp, np.random.default_rng(3), 6, 2, 4, 64, 32, f16=False)


def test_bad_inputs_get_clear_errors(xp) -> None:
    check_bad_inputs(xp)


@pytest.mark.parametrize("fused", [False, True])
def test_gpu_model_deltanet_steps_and_commits_match_the_numpy_engine(xp, monkeypatch, fused: bool) -> None:
    """models/qwen35_gpu's DeltaNet layer (_deltanet), its tree plan and GpuSequenceState.commit, run on the
    simulator (the projections and the output norm in NumPy), against models/qwen35's _deltanet and
    SequenceState.commit on the same weights: a DDTree verify step and the commit of one of its paths, a plain
    decode step (a chain's final state), a checkpointed chain and the commit of its prefix. fused: the launches a
    GPU model makes by default (conv with its raw rows, conv + norm in one launch, a decode token's layer in one
    launch: deltanet.decode_step; the output norm's pack in NumPy)."""
    from services.engine.models import qwen35, qwen35_gpu
    from services.engine.models.base import StepContext
    from services.engine.state import PendingStep, SequenceState

    rng = np.random.default_rng(21)
    Hk, Hv, dk, dv, n_embd, L = 2, 4, 128, 32, 48, 2
    kd = Hk * dk
    cd = 2 * kd + Hv * dv
    cfg = SimpleNamespace(recurrent_layers=[True] * L, ssm_n_k_heads=Hk, ssm_n_v_heads=Hv, ssm_head_k_dim=dk,
                          ssm_head_v_dim=dv, ssm_conv_kernel=KW, ssm_conv_dim=cd, ssm_key_dim=kd, rms_eps=1e-6,
                          n_embd=n_embd, n_head_kv=1, head_dim=64, n_vocab=32)  # fmt: skip
    weights = []
    for _ in range(L):
        weights.append(dict(ssm_in=(rng.standard_normal((n_embd, cd + Hv * dv + 2 * Hv)) * 0.3).astype(np.float32),
                            ssm_out=(rng.standard_normal((Hv * dv, n_embd)) * 0.1).astype(np.float32),
                            ssm_conv1d=(rng.standard_normal((cd, KW)) * 0.5).astype(np.float32),
                            ssm_norm=(1 + 0.1 * rng.standard_normal(dv)).astype(np.float32),
                            ssm_a=-np.exp(rng.standard_normal(Hv) * 0.5).astype(np.float32),
                            ssm_dt=rng.standard_normal(Hv).astype(np.float32)))  # fmt: skip

    class Mat:  # QuantMatrix.matmul's place: a float32 product on the host
        def __init__(self, w):
            self.w = w

        def matmul(self, x):
            return xp.asarray(np.asarray(x, np.float32) @ self.w)

    def norm_gate(o, z, w, eps):  # nr.norm_gate's NumPy twin (the lines of qwen35._deltanet)
        return xp.asarray(layers.rms_norm(np.asarray(o), w, eps) * layers.silu(np.asarray(z)))

    def pack_norm_gate(o, rms_weight, eps, gate, order=0):  # the fused path's output norm pack, as norm_gate
        assert order == 0  # (the wgmma order only where its build is)
        T = int(o.shape[0])
        return norm_gate(np.asarray(o).reshape(T, Hv, dv), np.asarray(gate).reshape(T, Hv, dv), rms_weight,
                         eps).reshape(T, Hv * dv)

    monkeypatch.setattr(qwen35_gpu.nr, "norm_gate", norm_gate)
    monkeypatch.setattr(qwen35_gpu.nr.loader, "require", lambda: xp)
    monkeypatch.setattr(qwen35_gpu.qm, "pack_activations", pack_norm_gate)
    w_gpu = [{k: Mat(v) if k in ("ssm_in", "ssm_out") else xp.asarray(v) for k, v in w.items()} for w in weights]
    gpu_self = SimpleNamespace(cfg=cfg, fused_launches=fused, _out_proj=lambda W, o, sink: W.matmul(o),
                               pack_order=lambda tokens, *readers: 0)  # (no wgmma build on the CPU)
    np_self = SimpleNamespace(cfg=cfg, _lin=lambda x, w: np.asarray(x, np.float32) @ w)
    gst = qwen35_gpu.GpuSequenceState(cfg, 64, "f16", "f16")
    gst.graph_commits = False
    nst = SequenceState.allocate(cfg, 64)
    init = [(rng.standard_normal((Hv, dk, dv)) * 0.3).astype(np.float32) for _ in range(L)]
    for i in range(L):
        gst.ssm[i] = nst.ssm[i] = init[i]
        gst.conv[i] = nst.conv[i] = rng.standard_normal((KW - 1, cd)).astype(np.float32)

    def step(parents, checkpoints: bool):
        T = len(parents)
        par = np.asarray(parents, np.int64)
        chain = bool((par == np.arange(-1, T - 1)).all())
        per_token = checkpoints or not chain
        h = rng.standard_normal((T, n_embd)).astype(np.float32)
        gst.stage.h_parents[:T] = par
        gst.stage.h_swap[0] = gst.parity
        gst.stage.upload()
        st = qwen35_gpu._Step(T=T, S=gst.n_past, parents=par, is_chain=chain, per_token=per_token, positions=None)
        qwen35_gpu.plan_tree_walk(gst, st)
        pending = PendingStep(n_tokens=T, parents=par, ssm_per_token=per_token)
        anc = layers.ancestor_matrix(par)
        ctx = StepContext(state=nst, pending=pending, positions=None, parents=par, is_chain=chain,
                          visible=np.concatenate([np.ones((T, nst.n_past), bool), anc], axis=1), checkpoints=per_token)
        for i in range(L):
            got = np.asarray(qwen35_gpu.Qwen35GpuModel._deltanet(gpu_self, i, w_gpu[i], xp.asarray(h), gst, st))
            want = qwen35.Qwen35Model._deltanet(np_self, i, weights[i], h, ctx)
            assert rel_max(got, want) < 1e-4, f"layer {i}, step {par.tolist()}"
        gst.pending = qwen35_gpu.GpuPending(n_tokens=T, parents=par, per_token=per_token, is_chain=chain)
        nst.pending = pending

    def commit(path):
        gst.commit(path)
        nst.commit(path)
        assert gst.n_past == nst.n_past
        for i in range(L):
            assert rel_max(np.asarray(gst.ssm[i]), nst.ssm[i]) < TOL_RULE, f"layer {i} state after {path}"
            assert np.array_equal(np.asarray(gst.conv[i]), nst.conv[i]), f"layer {i} conv window after {path}"

    tree = ddtree_parents(23, rng)
    step(tree, True)
    commit(path_to(tree, int(np.flatnonzero(tree == 16)[-1])))  # a path through a side branch
    step([-1], False)  # plain decode: the chain's final state into the pair's other half, committed by a flip
    commit([0])
    assert gst.parity == 1
    step([-1], False)  # plain decode from the second half: back into the first
    commit([0])
    step(list(range(-1, 3)), False)  # a chain without checkpoints, abandoned: the committed half stays as it was
    gst.pending = nst.pending = None
    step([-1], False)
    commit([0])
    step(list(range(-1, 7)), True)  # a checkpointed chain (on the pair's second half): commit a prefix
    commit([0, 1, 2, 3])
    step([-1], True)  # a one-node verify (one row: its row strides come from the buffer)
    commit([0])
    step(tree, True)
    commit(path_to(tree, 15))  # the top-1 chain to its end
    assert gst.parity == 1, "a tree's commit replays in place: the pair keeps its committed half"
