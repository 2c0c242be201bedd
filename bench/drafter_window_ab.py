"""Where the GPU drafter's pass past its sliding window spends its time (models/dflash_gpu.py), measured in one run.

    python3 bench/drafter_window_ab.py --model TARGET.gguf --draft DRAFTER.gguf [--context 512] [--long 2600]

One pass (3 appended feature rows, a 16-token block, top-8), graph replay, median of 20, on a fresh session per
variant, at the short context and past the window: `shipped` (the sliding layers pass their window to the attention
kernel, which reads the window's tiles in place); `full attention` (the sliding layers attend to the whole context as
the full ones do, no window: timing only); `no sliding attention` (the sliding layers' attention left out: its output
is the zero q rows; timing only). Ratios to the shipped pass at the short context are printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def pass_replay_ms(dr, cupy, ctx: int, n_new: int = 3, reps: int = 20) -> float:
    """Median replay time (ms) of the drafter's captured pass at `ctx` committed rows, on a fresh session."""
    feats = cupy.random.standard_normal((ctx + n_new, dr.cfg.n_features), dtype=cupy.float32)
    s = dr.new_session()
    dr.append_context(s, feats[:ctx], ctx)
    start = ctx + n_new
    dr.use_graphs = True
    for _ in range(2):   # capture, then a replay through the API
        s.truncate(ctx)
        dr.draft_topk(s, feats[ctx:start], 7, start, 8)
    g = next((g for k, g in s.graphs.items() if k[0] == n_new), None)
    if g is None:
        raise RuntimeError(f"no captured pass: {dr.graph_blocker}")
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(reps):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        g.graph.launch(stream)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    s.drop_graphs()
    return statistics.median(times) * 1e3


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--long", type=int, default=2600)
    args = ap.parse_args(argv)
    import cupy
    from gpu_bench import load_gpu_model

    from services.engine.models import dflash_gpu
    from services.engine.models.dflash_gpu import load_gpu_drafter

    model, _, _ = load_gpu_model(args.model)
    dr = load_gpu_drafter(args.draft, model)
    print(f"drafter: {dr.cfg.n_layer} layers, sliding {dr.cfg.layer_causal}, window {dr.cfg.sliding_window}, "
          f"heads {dr.cfg.n_head} / {dr.cfg.n_head_kv} x {dr.cfg.head_dim}", flush=True)
    shipped_attention = dflash_gpu.att.attention

    def full_attention(q, cache, s_len, mask, **kw):
        kw["window"] = 0
        return shipped_attention(q, cache, s_len, mask, **kw)

    def no_sliding_attention(q, cache, s_len, mask, **kw):
        return q * 0 if kw.get("window") else shipped_attention(q, cache, s_len, mask, **kw)

    variants = {"shipped": shipped_attention, "full attention": full_attention,
                "no sliding attention": no_sliding_attention}
    rows = {}
    try:
        for _rep in range(2):
            for name, attention in variants.items():
                dflash_gpu.att.attention = attention
                for ctx in (args.context, args.long):
                    if ctx == args.context and name != "shipped":
                        continue
                    rows.setdefault((name, ctx), []).append(pass_replay_ms(dr, cupy, ctx))
    finally:
        dflash_gpu.att.attention = shipped_attention
    base = statistics.median(rows[("shipped", args.context)])
    for (name, ctx), v in rows.items():
        m = statistics.median(v)
        print(f"{name:22s} ctx {ctx:5d}: {m:.3f} ms (runs {[round(x, 3) for x in v]}), x{m / base:.3f} of the "
              f"shipped pass at {args.context}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
