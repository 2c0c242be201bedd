"""Launch a few quantized products once each (after a warm-up) so that Nsight Compute can profile them:
`bash bench/ncu_run.sh` runs this under `ncu` (hardware counters: DRAM throughput, occupancy, warp stalls).

Cases are `TYPE:ROWS:COLS:TOKENS[:KERNEL]`, e.g. `Q4_K:17408:5120:1:gemv`; KERNEL as QuantMatrix.matmul takes it
(default: its automatic choice). Random weights (bench/roofline.random_matrix), random fp16 x. `walk:T`: one
DeltaNet layer's tree walk (gdr_tree_walk_kernel, 27B shapes) over bench/step_profile's tree of T nodes.
`attn:K/V:S:T`: one 27B attention layer (24 query / 4 KV heads of 256) over S committed cache rows of kinds K / V
(f16, q8_0, tq3_0; random rows written by the store kernel) for T chain tokens, the launcher's own splits.
"""

from __future__ import annotations

import sys

DEFAULT = [
    "Q4_K:34816:5120:1",    # ffn_gate+ffn_up stacked, plain decode
    "Q4_K:5120:17408:1",    # ffn_down (Q4_K layers)
    "Q6_K:5120:17408:1",    # ffn_down (Q6_K layers)
    "Q4_K:5120:6144:1",     # ssm_out / attn_output
    "Q4_K:34816:5120:23",   # the same at a width-23 verify
    "Q4_K:5120:17408:23",
]


def walk_inputs(cupy, T: int) -> tuple:
    """One DeltaNet layer's tree-walk inputs at Qwen3.6-27B shapes (16 key heads, 48 value heads, dk = dv = 128) on
    bench/step_profile's tree of T nodes: (q, k, v, g, beta, s0, plan; plan None for one token)."""
    import numpy as np
    from step_profile import tree_parents

    from kernels import deltanet as dn

    hk, hv, d = 16, 48, 128
    rng = np.random.default_rng(0)

    def rnd(shape, scale=1.0):
        return cupy.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

    q, k, v = rnd((T, hk * d), 0.09), rnd((T, hk * d), 0.09), rnd((T, hv * d))
    g, beta = -cupy.abs(rnd((T, hv), 0.5)), cupy.full((T, hv), 0.5, cupy.float32)
    s0 = rnd((hv, d, d), 0.1)
    plan = dn.tree_plan(cupy.asarray(np.array(tree_parents(T), np.int32))) if T > 1 else None
    return q, k, v, g, beta, s0, plan


def walk(cupy, T: int) -> None:
    """One layer's gdr_tree_walk_kernel (walk_inputs)."""
    from kernels import deltanet as dn

    *inputs, plan = walk_inputs(cupy, T)
    dn.gated_delta_tree(*inputs, plan=plan)
    cupy.cuda.Device().synchronize()
    print(f"case walk:{T}: launched", flush=True)


def attn(cupy, spec: str) -> None:
    """One layer's attention (attn_partial_kernel + attn_combine_kernel) as `attn:K/V:S:T` says."""
    from kernels import attention as at

    kinds, S, T = spec.split(":")[1:4]
    kk, kv = kinds.split("/")
    S, T = int(S), int(T)
    H, HKV, D = 24, 4, 256
    cache = at.KVCacheLayer(HKV, D, -(-(S + T) // at.KT) * at.KT, kk, kv)
    for start in range(0, S + T, 4096):
        n = min(4096, S + T - start)
        rows = cupy.random.standard_normal((2, n, HKV, D), dtype=cupy.float32)
        cache.store(rows[0], rows[1], start)
    q = (cupy.random.standard_normal((T, H, D), dtype=cupy.float32) * 0.5).astype(cupy.float16)
    mask = cupy.asarray(at.tree_mask(list(range(-1, T - 1))))
    at.attention(q, cache, S, mask, out_dtype=cupy.float16)
    cupy.cuda.Device().synchronize()
    print(f"case {spec}: launched ({at.choose_splits(H, HKV, D, T, S, kk, kv)} splits)", flush=True)


def main(argv: list[str]) -> int:
    from kernels import loader

    cupy = loader.require()
    import roofline

    from kernels import quant_matmul as qm

    cases = argv or DEFAULT
    names = {"F16": qm.F16, "Q8_0": qm.Q8_0, "Q4_K": qm.Q4_K, "Q6_K": qm.Q6_K}
    for case in cases:
        if case.startswith("walk:"):
            walk(cupy, int(case[5:]))
            continue
        if case.startswith("attn:"):
            attn(cupy, case)
            continue
        parts = case.split(":")
        qtype, rows, cols, tokens = names[parts[0]], int(parts[1]), int(parts[2]), int(parts[3])
        kernel = parts[4] if len(parts) > 4 else None
        W = roofline.random_matrix(cupy, qm, qtype, (rows, cols))
        x = (cupy.random.standard_normal((tokens, cols), dtype=cupy.float32)).astype(cupy.float16)
        px = qm.pack_activations(x)
        out = cupy.empty((tokens, rows), cupy.float32)
        W.matmul(px, out=out, kernel=kernel)  # one launch: ncu replays it with caches flushed
        cupy.cuda.Device().synchronize()
        print(f"case {case}: launched", flush=True)
        del W
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    sys.exit(main(sys.argv[1:]))
