"""One-token gemv ring shapes back to back: 40 launches of a product in one captured graph (programmatic dependent
launch between them, as in a step), over one matrix (L2-hot) or rotating copies past 600 MB (cold), per (k_warps,
stages); prints us a launch and the fraction of the copy roofline (the weight bytes at the measured copy bandwidth).

    python3 bench/ring_back_to_back.py
    python3 bench/ring_back_to_back.py --waves   # Q4_K x 5120 at row tiles around whole waves of resident blocks

H100 results: docs/gpu_quant_matmul.md, "gemv: few row tiles a SM"; --waves (H200): "wide and gemv on an H200".
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = ((12, (5120, 6144)), (14, (5120, 6144)), (12, (12288, 5120)), (12, (5120, 17408)), (12, (2048, 5120)))
RING_SHAPES = ((4, 2), (8, 2), (4, 4))
# --waves: 16-row tiles around multiples of the 4 x 2 ring's resident blocks (64 registers, 24 KB: 8 a SM, 1056 on
# 132 SMs), to see what a partly filled last wave costs
WAVE_TILES = (528, 1024, 1056, 1088, 1120, 1584, 2112, 2176, 2240)
LAUNCHES = 40


def main(argv: list[str] | None = None) -> int:
    waves = "--waves" in (sys.argv[1:] if argv is None else argv)
    shapes = tuple((12, (16 * t, 5120)) for t in WAVE_TILES) if waves else SHAPES
    ring_shapes = ((4, 2),) if waves else RING_SHAPES
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"ring_back_to_back: skipped: {reason}")
        return 0
    cupy = loader.require()
    import roofline
    from step_profile import replay_us

    from kernels import quant_gemv as qg
    from kernels import quant_matmul as qm
    from tests.quant_twins import random_weights

    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    copy_gbps = roofline.copy_bandwidth(cupy, 1 << 30)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)

    for qt, (n_out, k) in shapes:
        raw = random_weights(qt, n_out, k, rng)
        copies = max(2, int(600e6 // raw.nbytes))
        mats = [qm.QuantMatrix(qt, cupy.asarray(raw), (n_out, k), name="w") for _ in range(copies)]
        px = qm.pack_activations(cupy.asarray(rng.standard_normal((1, k)).astype(np.float32)), q16=True)
        y = cupy.empty((1, n_out), cupy.float32)
        res = {}
        for mode in ("hot", "cold"):
            for kw, st in ring_shapes:
                cfg = qg.GemvConfig(ring=True, k_warps=kw, stages=st)
                with stream:
                    for W in mats[:2]:   # builds, warms
                        qg.gemv(W, px, y, config=cfg)
                    stream.begin_capture()
                    for i in range(LAUNCHES):
                        qg.gemv(mats[0] if mode == "hot" else mats[i % copies], px, y, config=cfg)
                    graph = stream.end_capture()
                with stream:
                    res[f"{mode} {kw}x{st}"] = min(replay_us(cupy, graph) for _ in range(2)) / LAUNCHES
        roof = raw.nbytes / (copy_gbps * 1e3)   # us
        print(f"{qm.type_name(qt)} {n_out}x{k} ({raw.nbytes / 1e6:.1f} MB, {roof:.1f} us at copy bandwidth): "
              + ", ".join(f"{m} {t:.2f} us ({roof / t:.2f})" for m, t in res.items()), flush=True)
        del mats
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
