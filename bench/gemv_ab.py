"""The gemv kernel fed from the pack's int16 staging (PackedX.q16) against quantizing x in every block, in one run:
per matrix (27B shapes, T = 1 and 2, graph-replayed calls rotating over weight copies) and in the synthetic model's
decode step (width 1 and 2, graph replay, off / on interleaved). Prints ratios on / off.

    python3 bench/gemv_q16_ab.py [--no-matrices] [--model PATH] [--context 512] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MATRICES = [  # (type, rows, cols, name): the 27B Q4_K_M decode step's largest gemv launches
    ("Q4_K", 34816, 5120, "ffn_gate+up"),
    ("Q4_K", 5120, 17408, "ffn_down Q4_K"),
    ("Q6_K", 5120, 17408, "ffn_down Q6_K"),
    ("Q4_K", 5120, 6144, "ssm_out"),
    ("Q4_K", 12288, 5120, "attn_qkv"),
    ("Q6_K", 248320, 5120, "output"),
]


def weight_copies(cupy, qm, tname: str, n_out: int, k: int) -> list:
    """Random copies of one matrix, enough (up to 8) that graph-replayed calls rotating over them read > 600 MB."""
    import roofline

    qtype = {"Q4_K": qm.Q4_K, "Q6_K": qm.Q6_K}[tname]
    nbytes = n_out * k * (144 if qtype == qm.Q4_K else 210) // 256
    copies = max(1, min(8, (600 << 20) // nbytes + 1))
    return [roofline.random_matrix(cupy, qm, qtype, (n_out, k)) for _ in range(copies)]


def per_matrix(cupy, qm, tokens: int) -> list[dict]:
    import roofline

    rows = []
    for tname, n_out, k, label in MATRICES:
        mats = weight_copies(cupy, qm, tname, n_out, k)
        copies = len(mats)
        x = cupy.random.standard_normal((tokens, k), dtype=cupy.float32)
        on = qm.pack_activations(x, q16=True)
        off = qm.PackedX(on.data, tokens, k)
        out = cupy.empty((tokens, n_out), cupy.float32)
        res = {}
        for _rep in range(2):
            for how, px in (("off", off), ("on", on)):
                calls = [lambda W=W, px=px, o=out: W.matmul(px, out=o, kernel="gemv") for W in mats]
                calls *= max(1, 8 // copies)
                us, _, _ = roofline.time_calls(cupy, calls)
                res.setdefault(how, []).append(us)
        row = {"matrix": label, "tokens": tokens, "off_us": round(min(res["off"]), 2),
               "on_us": round(min(res["on"]), 2)}
        row["ratio"] = round(row["on_us"] / row["off_us"], 3)
        rows.append(row)
        print(f"gemv {label:14s} T={tokens}: staged in-kernel {row['off_us']:8.2f} us, from q16 {row['on_us']:8.2f} us"
              f"  on/off {row['ratio']:.3f}", flush=True)
        del mats
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def step(cupy, qm, path: str, context: int) -> list[dict]:
    from gpu_bench import model_at_context
    from step_profile import replay_us

    t0 = time.time()
    model, state, rng = model_at_context(path, context)
    print(f"step: loaded {path} and its context in {time.time() - t0:.0f} s", flush=True)
    shipped = getattr(qm, "Q16_TOKENS", None)  # None: a tree from before PackedX.q16 (timed as it is, "off")
    modes = (("off", 0), ("on", shipped)) if shipped is not None else (("off", None),)
    rows = []
    try:
        for width in (1, 2):
            toks = [int(t) for t in rng.integers(0, model.cfg.n_vocab, size=width)]
            par = [-1] + list(range(width - 1)) if width > 1 else None
            res: dict[str, list[float]] = {}
            for _rep in range(3):
                for how, q in modes:
                    if q is not None:
                        qm.Q16_TOKENS = q
                    model.use_graphs = True
                    state.graphs.clear()
                    for _ in range(2):  # warm-up + capture
                        model.forward(state, toks, parents=par, checkpoints=par is not None, logits="all")
                        state.pending = None
                    g = next(iter(state.graphs.values()), None)
                    if g is None:
                        raise RuntimeError(f"no graph: {model.graph_blocker}")
                    res.setdefault(how, []).append(replay_us(cupy, g.graph))
            row = {"width": width, "runs": res}
            for how in res:
                row[f"{how}_us"] = round(statistics.median(res[how]), 1)
            if "on" in res:
                row["ratio"] = round(row["on_us"] / row["off_us"], 4)
            rows.append(row)
            parts = [f"{how} {row[how + '_us']} us (runs {[round(v) for v in res[how]]})" for how in res]
            print(f"step width {width}: {', '.join(parts)}; on/off {row.get('ratio')}", flush=True)
    finally:
        if shipped is not None:
            qm.Q16_TOKENS = shipped
        state.graphs.clear()
    return rows


def main(argv: list[str]) -> int:
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"gemv_q16_ab: skipped: {reason}")
        return 0
    cupy = loader.require()
    from kernels import quant_matmul as qm

    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    context = int(argv[argv.index("--context") + 1]) if "--context" in argv else 512
    out = {}
    if "--no-matrices" not in argv:
        out["matrices"] = per_matrix(cupy, qm, 1) + per_matrix(cupy, qm, 2)
    if model:
        out["step"] = step(cupy, qm, model, context)
    if "--json" in argv:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
