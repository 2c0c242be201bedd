"""GPU Gated DeltaNet kernels (kernels/deltanet.cu) against the engine's NumPy twins, on a CUDA GPU.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else. The cases are the `check_*` functions of
tests/test_kernels_deltanet_sim.py (which runs them on the CPU simulator); here they run on the device at larger
shapes, every tree size T in (1, 2, 7, 16, 23, 41, 64) on random parent lists plus DDTree, star, deep, forest and
complete binary trees (65 nodes: the GPU model's widest tree), the Qwen3.6-27B head layout (16 key heads, 48
value heads, dk = dv = 128), fp16 and fp32 inputs, and the portable (no inline PTX) build. Tolerances, as stated
there: max |error| / max |reference| < 1e-5 for conv / norm / gates, < 1e-4 for the delta rule (fp32 state);
the tree walk's outputs (a read-only leaf's within 2e-6) and the replayed commit's state bit for bit those of each
node's path run as a chain, the conv window commit bit-exact. Plus CUDA-graph replays whose token count, parents
and accepted node change between replays.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import loader  # noqa: E402

_REASON = loader.unavailable_reason()     # the one check the engine uses too (CuPy, driver, a visible GPU)
if _REASON is not None:
    pytest.skip(f"GPU kernel tests skipped: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_kernels_deltanet_sim as cases  # noqa: E402

from kernels import deltanet as dn  # noqa: E402

pytestmark = pytest.mark.gpu
HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.6-27B
CONV_DIM = 2 * HK * DK + HV * DV


@pytest.mark.parametrize("T", cases.TREE_SIZES)
def test_conv_trees(T: int) -> None:
    rng = np.random.default_rng(T)
    cases.check_conv(cupy, rng, T, CONV_DIM, f16=False)
    cases.check_conv(cupy, rng, T, 1000, f16=True)


def test_conv_chain_prefill_and_portable() -> None:
    rng = np.random.default_rng(1)
    cases.check_conv(cupy, rng, 300, 640, f16=False, chain=True)
    cases.check_conv(cupy, rng, 23, 640, f16=True, portable=True)


@pytest.mark.parametrize("f16", [False, True])
def test_qk_norm_and_gates(f16: bool) -> None:
    rng = np.random.default_rng(2 + f16)
    cases.check_norm_gate(cupy, rng, 41, HK, HV, DK, f16)
    cases.check_norm_gate(cupy, rng, 3, 2, 6, 64, f16, portable=True)


@pytest.mark.parametrize("f16,swapped,warps,cols", [(False, 0, 2, 8), (True, 1, 2, 8), (False, 1, 4, 4),
                                                    (True, 0, 16, 8)])
def test_decode_step_is_the_three_launches(f16: bool, swapped: int, warps: int, cols: int) -> None:
    cases.check_decode_step(cupy, np.random.default_rng(5 + swapped), HK, HV, DK, DV, f16, swapped, False, warps, cols)


@pytest.mark.parametrize("f16,swapped", [(False, 0), (True, 1)])
def test_decode_step_output_norm_is_the_pack(f16: bool, swapped: int) -> None:
    """decode_step(q16=) at the 27B heads: the staging bit for bit the norm pack's (quant_matmul.pack_activations with
    the per-head norm and the gate) of the same o, out and the state bit for bit those without it."""
    from kernels import quant_matmul as qm

    rng = np.random.default_rng(80 + swapped)
    words = cases.check_decode_norm(cupy, rng, HK, HV, DK, DV, f16, swapped)
    outs, z, norm_w, _ = cases.decode_norm_case(cupy, np.random.default_rng(80 + swapped), HK, HV, DK, DV, f16,
                                                swapped)
    assert np.array_equal(outs[0][2], words)  # the same case
    o = cupy.asarray(outs[0][0].reshape(1, HV * DV))
    packed = qm.pack_activations(o, rms_weight=cupy.asarray(norm_w), eps=1e-5,
                                 gate=cupy.asarray(z.astype(np.float32)), q16=True)
    assert np.array_equal(cupy.asnumpy(packed.q16), words)


def test_decode_step_captured_loads_early_and_matches_eager() -> None:
    """decode_step captured into a CUDA graph (a PDL launch there: the state, conv weights and window read before the
    grid dependency wait) replays bit for bit what the eager launch computes."""
    rng = np.random.default_rng(9)
    C = CONV_DIM
    proj = cupy.asarray(rng.standard_normal((1, C + 2 * HV)).astype(np.float32))
    window = cupy.asarray(rng.standard_normal((3, C)).astype(np.float32))
    conv_w = cupy.asarray((rng.standard_normal((C, 4)) * 0.5).astype(np.float32))
    ssm_a = cupy.asarray(-np.exp(rng.standard_normal(HV) * 0.5).astype(np.float32))
    dt_bias = cupy.asarray(rng.standard_normal(HV).astype(np.float32))
    pair0 = (rng.standard_normal((2, HV, DK, DV)) * 0.3).astype(np.float32)
    swap = cupy.zeros(1, cupy.int32)
    got = []
    for captured in (False, True):
        st, out, rows = cupy.asarray(pair0), cupy.empty((1, HV * DV), cupy.float32), cupy.empty((1, C), cupy.float32)

        def launch(st=st, out=out, rows=rows) -> None:
            dn.decode_step(proj[:, :C], window, conv_w, proj[:, C:C + HV], proj[:, C + HV:], ssm_a, dt_bias, st[0],
                           n_k_heads=HK, final_state=st[1], alt=st[1], swap=swap, out=out, rows_out=rows)

        if captured:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                launch()
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        else:
            launch()
            cupy.cuda.Device().synchronize()
        got.append((cupy.asnumpy(out), cupy.asnumpy(st), cupy.asnumpy(rows)))
    for a, b in zip(*got):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("T,chain", [(1, True), (3, True), (23, False), (64, False)])
def test_conv_qk_norm_gate_is_the_two_launches(T: int, chain: bool) -> None:
    """The fused DeltaNet chain head at the 27B's widths (16 k heads of 128, 48 v heads): bit for bit conv_silu then
    qk_norm_gate, with and without the raw rows kept, portable too."""
    rng = np.random.default_rng(40 + T)
    cases.check_conv_norm_gate(cupy, rng, T, HK, HV, DK, False, chain)
    cases.check_conv_norm_gate(cupy, rng, T, HK, HV, DK, True, chain, rows=False)
    cases.check_conv_norm_gate(cupy, rng, T, 2, 6, 64, False, chain, portable=True)


@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("depth", [2, 8])
def test_chain_decode_and_recurrent_prefill(T: int, depth: int) -> None:
    cases.check_chain_in_place(cupy, np.random.default_rng(T), T, 4, 8, DK, DV, depth)


@pytest.mark.parametrize("kind,n", cases.WALK_SHAPES + [("ddtree", 65), ("random", 65)])
def test_tree_plan_matches_its_twin(kind: str, n: int) -> None:
    cases.check_plan(cupy, cases.tree_shape(kind, n, np.random.default_rng(n)))


def test_tree_plan_random_corrupt_and_portable() -> None:
    rng = np.random.default_rng(4)
    for n in rng.integers(1, 66, size=30):
        cases.check_plan(cupy, cases.random_tree(int(n), rng))
    cases.check_plan(cupy, np.array([5, 0, 99, -7, 3, 4, 6, 2, -1, 8], np.int32))
    cases.check_plan(cupy, cases.random_tree(12, rng), t_max=20)
    cases.check_plan(cupy, cases.random_tree(23, rng), portable=True)
    assert cases.check_plan(cupy, cases.dfs_binary(6, tails=True)) == 6  # 191 nodes: the bound, 6 slots


WALK_TREES = [("random", T) for T in cases.TREE_SIZES] + [("ddtree", 23), ("ddtree", 65), ("profile", 41),
                                                          ("binary", 5), ("star", 41), ("deep", 64), ("forest", 12)]


@pytest.mark.parametrize("kind,n", WALK_TREES)
def test_tree_walk_matches_token_loop_and_its_paths(kind: str, n: int) -> None:
    rng = np.random.default_rng(200 + n)
    parents = cases.tree_shape(kind, n, rng)
    cases.check_walk(cupy, rng, parents, 4, 12, DK, DV)  # 12 value heads over 4 key heads: h -> h % 4
    cases.check_walk(cupy, rng, parents, 4, 12, DK, DV, f16=True, warps=1, explicit_plan=True)


def test_tree_walk_qwen36_shape_and_variants() -> None:
    rng = np.random.default_rng(6)
    cases.check_walk(cupy, rng, cases.ddtree_parents(23, rng), HK, HV, DK, DV)
    cases.check_walk(cupy, rng, cases.ddtree_parents(65, rng), HK, HV, DK, DV)  # 5 stack slots: 60 KB a block
    cases.check_walk(cupy, rng, cases.random_tree(64, rng), 2, 4, DK, DV, cols_per_warp=4, warps=2)
    cases.check_walk(cupy, rng, cases.random_tree(41, rng), 2, 4, DK, DV, warps=4)  # the opt-in above 48 KB
    cases.check_walk(cupy, rng, cases.random_tree(7, rng), 2, 4, 64, 64, warps=1)  # dk 64
    cases.check_walk(cupy, rng, cases.dfs_binary(5), 2, 4, DK, DV, warps=4, depth=16)  # 157 KB
    cases.check_walk(cupy, rng, cases.random_tree(30, rng), 2, 4, DK, DV, depth=2)
    cases.check_walk(cupy, rng, cases.random_tree(16, rng), 2, 4, DK, DV, f16=True, portable=True)
    cases.check_walk(cupy, rng, cases.random_tree(23, rng), 2, 4, DK, DV, decay=30.0)  # strong decay


@pytest.mark.parametrize("kind,n,f16", [("random", 23, False), ("ddtree", 65, False), ("ddtree", 41, True),
                                        ("binary", 5, False), ("deep", 41, False), ("star", 16, False)])
def test_commit_replay_of_every_accepted_path(kind: str, n: int, f16: bool) -> None:
    rng = np.random.default_rng(300 + n)
    cases.check_commit_replay(cupy, rng, cases.tree_shape(kind, n, rng), 4, 12, DK, DV, L=3, f16=f16)


def test_commit_replay_qwen36_shape_and_variants() -> None:
    rng = np.random.default_rng(7)
    cases.check_commit_replay(cupy, rng, cases.ddtree_parents(23, rng), HK, HV, DK, DV, L=2,
                              accepted=[0, 3, 15, 16, 22, -1, 23])  # fmt: skip
    cases.check_commit_replay(cupy, rng, np.arange(-1, 15, dtype=np.int32), 4, 12, DK, DV, chain=True)
    cases.check_commit_replay(cupy, rng, cases.random_tree(41, rng), 2, 4, DK, DV, cols_per_warp=4, warps=1)
    cases.check_commit_replay(cupy, rng, cases.random_tree(23, rng), 2, 4, DK, DV, decay=30.0, warps=4, depth=16)
    cases.check_commit_replay(cupy, rng, cases.random_tree(16, rng), 2, 4, DK, DV, f16=True, portable=True)
    bad = np.array([5, 0, 99, -7, 3, 4, 2, 6, 7, 1], np.int32)
    cases.check_commit_replay(cupy, rng, np.zeros(len(bad), np.int32), 2, 4, DK, DV, device_parents=bad)


def test_corrupt_plan_stays_in_bounds() -> None:
    cases.check_corrupt_plan(cupy, np.random.default_rng(13))


@pytest.mark.parametrize("f16", [False, True])
def test_layer_core_matches_the_engine_lines(f16: bool) -> None:
    cases.check_layer_core(cupy, np.random.default_rng(9), 23, 4, 12, DK, DV, f16)


def test_bad_inputs_get_clear_errors() -> None:
    cases.check_bad_inputs(cupy)


def test_graph_replay_follows_device_token_count_and_parents() -> None:
    # One captured conv + plan + tree walk; each replay reads a new tree (T and parents) from device buffers.
    rng = np.random.default_rng(11)
    t_max, hk, hv, C = 41, 4, 8, 2 * 4 * DK + 8 * DV
    q, k, v, g, beta, s0 = cases.tree_inputs(t_max, hk, hv, DK, DV, rng)
    raw = rng.standard_normal((t_max, C)).astype(np.float32)
    window = rng.standard_normal((cases.KW - 1, C)).astype(np.float32)
    conv_w = (rng.standard_normal((C, cases.KW)) * 0.5).astype(np.float32)
    dev = {n: cupy.asarray(a) for n, a in dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0, raw=raw, window=window,
                                              conv_w=conv_w).items()}  # fmt: skip
    par_d = cupy.full(t_max, -1, dtype=cupy.int32)
    n_d = cupy.zeros(1, dtype=cupy.int32)
    plan = cupy.empty(t_max, cupy.int32)
    out = cupy.empty((t_max, hv * DV), dtype=cupy.float32)
    mixed = cupy.empty((t_max, C), dtype=cupy.float32)
    dn.warmup()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dn.conv_silu(dev["raw"], dev["window"], dev["conv_w"], parents=par_d, n_tokens=n_d, out=mixed)
        dn.tree_plan(par_d, n_tokens=n_d, out=plan)
        dn.gated_delta_tree(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], dev["s0"], plan=plan, n_tokens=n_d,
                            out=out)  # fmt: skip
        graph = stream.end_capture()
    for T in (23, 1, 41, 7):
        parents = cases.random_tree(T, rng)
        par_d[:T].set(parents)
        n_d.set(np.array([T], np.int32))
        out.fill(np.nan)
        mixed.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        ref_out, _ = cases.tree_twin(q, k, v, g, beta, s0, parents, hk, DK)
        got = cupy.asnumpy(out)
        assert cases.rel_max(got[:T].reshape(T, hv, DV), ref_out) < cases.TOL_RULE
        assert np.isnan(got[T:]).all()
        ref_mixed = cases.layers.causal_conv(window, raw[:T], conv_w, cases.layers.conv_window_ids(parents, cases.KW))
        assert cases.rel_max(cupy.asnumpy(mixed)[:T], ref_mixed) < cases.TOL


def test_graph_replay_of_plan_walk_and_commit() -> None:
    # One captured step (plan + walk of 2 layers) and one captured commit (replay + conv window, both layers);
    # each round writes a new tree, token count and accepted node into device buffers and replays both.
    rng = np.random.default_rng(12)
    t_max, hk, hv, L = 65, 4, 8, 2
    C = 2 * hk * DK + hv * DV
    kd = hk * DK
    mixed = np.stack([np.concatenate(cases.tree_inputs(t_max, hk, hv, DK, DV, rng)[:3], axis=1) for _ in range(L)])
    gates = np.stack([np.stack(cases.tree_inputs(t_max, hk, hv, DK, DV, rng)[3:5]) for _ in range(L)])
    s0 = (rng.standard_normal((L, hv, DK, DV)) * 0.3).astype(np.float32)
    raw = rng.standard_normal((L, t_max, C)).astype(np.float32)
    window = rng.standard_normal((L, cases.KW - 1, C)).astype(np.float32)
    m_d, gb_d, raw_d = cupy.asarray(mixed), cupy.asarray(gates), cupy.asarray(raw)
    state, win_d = cupy.asarray(s0), cupy.asarray(window)
    par_d = cupy.full(t_max, -1, dtype=cupy.int32)
    n_d = cupy.zeros(1, dtype=cupy.int32)
    acc_d = cupy.zeros(1, dtype=cupy.int32)
    plan = cupy.empty(t_max, cupy.int32)
    outs = [cupy.empty((t_max, hv * DV), cupy.float32) for _ in range(L)]
    dn.warmup()
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        dn.tree_plan(par_d, n_tokens=n_d, out=plan)
        for i in range(L):
            dn.gated_delta_tree(m_d[i, :, :kd], m_d[i, :, kd : 2 * kd], m_d[i, :, 2 * kd :], gb_d[i, 0], gb_d[i, 1],
                                state[i], plan=plan, n_tokens=n_d, out=outs[i])  # fmt: skip

    def commit():
        k, v = m_d[:, :, kd : 2 * kd], m_d[:, :, 2 * kd :]
        dn.commit(acc_d, par_d, k, v, gb_d[:, 0], gb_d[:, 1], state, raw_d, win_d)

    graphs = []
    with stream:
        for launches in (step, commit):
            launches()  # eagerly first, as the model does: kernels built, shared memory opted in, outside a capture
            stream.begin_capture()
            launches()
            graphs.append(stream.end_capture())
    for T in (23, 1, 65, 7, 41):
        parents = cases.ddtree_parents(T, rng) if T > 1 else np.array([-1], np.int32)
        accepted = int(rng.integers(0, T))
        par_d[:T].set(parents)
        n_d.set(np.array([T], np.int32))
        acc_d.set(np.array([accepted], np.int32))
        state.set(s0)
        win_d.set(window)
        for o in outs:
            o.fill(np.nan)
        graphs[0].launch(stream)
        stream.synchronize()
        path = cases.path_to(parents, accepted)
        chains = []  # per layer: the path run as a chain (outputs, final state), the tree step's bit for bit
        for i in range(L):
            inputs = (mixed[i, :, :kd], mixed[i, :, kd : 2 * kd], mixed[i, :, 2 * kd :], gates[i, 0], gates[i, 1])
            ref_out, _ = cases.tree_twin(*inputs, s0[i], parents, hk, DK)
            got = cupy.asnumpy(outs[i])
            assert cases.rel_max(got[:T].reshape(T, hv, DV), ref_out) < cases.TOL_RULE
            assert np.isnan(got[T:]).all()
            chains.append(cases.walk_path(cupy, inputs, s0[i], path))
            cases.check_walk_on_path(got[path], chains[i][0], path, parents, f"T={T}, layer {i}")
        graphs[1].launch(stream)
        stream.synchronize()
        got = cupy.asnumpy(state)
        for i in range(L):
            assert np.array_equal(got[i], chains[i][1]), f"T={T}, accepted {accepted}, layer {i}"
