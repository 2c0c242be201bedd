"""End-to-end decode speed of the GPU engine at long context by KV cache type (f16 vs q8_0 vs TQ3_0), in one run.

For each context length and each K/V type pair the same loaded target gets a fresh sequence state whose KV
cache holds `context` rows, then the engine's own passes are timed (CUDA graphs on, as served): plain greedy
decode (width-1 forward, argmax on the host, commit) in tokens/s, and one width-23 verify (chain, per-token
checkpoints, logits for every row). Every number is also given relative to f16/f16 at the same context.

The KV rows are random N(0, 1) vectors written by the model's own store kernel (quantized on the device like
real rows), not a real prompt: attention time does not depend on the values, and a real 32K-token prefill of
the 27B shape would dominate the run. The recurrent (DeltaNet) state is zeros for the same reason.

    python3 bench/kv_decode.py --make-synthetic DIR [--context 4096 32768] [--kv f16/f16 q8_0/tq3_0 tq3_0/tq3_0]
    python3 bench/kv_decode.py --model PATH.gguf ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_bench import add_model_source, device_name, load_gpu_model  # noqa: E402

FILL_CHUNK = 4096       # rows per store launch while filling the cache
VERIFY_WIDTH = 23


def _argmax_rows(logits) -> np.ndarray:
    """Per-row argmax: on the device when the model keeps its logits there, else over host rows."""
    if hasattr(logits, "argmax_rows"):
        return logits.argmax_rows()
    return np.argmax(np.asarray(logits), axis=-1)


def fill_kv(model, state, context: int, seed: int = 0) -> None:
    """Write `context` random K/V rows into every attention layer's cache and mark them committed."""
    import cupy

    cfg = model.cfg
    rng = cupy.random.default_rng(seed)
    for cache in state.kv.values():
        for s in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - s)
            k = rng.standard_normal((n, cfg.n_head_kv, cfg.head_dim), dtype=cupy.float32)
            v = rng.standard_normal((n, cfg.n_head_kv, cfg.head_dim), dtype=cupy.float32)
            cache.store(k, v, s)
    cupy.cuda.Device().synchronize()
    state.n_past = context


def time_config(model, context: int, kv_k: str, kv_v: str, steps: int, reps: int) -> dict[str, Any]:
    """Plain greedy decode tokens/s and the width-23 verify time with K/V types kv_k/kv_v after `context` rows."""
    import cupy

    state = model.new_state(context + steps + VERIFY_WIDTH + 16, kv_k, kv_v)
    kinds = {(getattr(c, "kind_k", c.kind), getattr(c, "kind_v", c.kind)) for c in state.kv.values()}
    fill_kv(model, state, context)
    kv_bytes = sum(int(c.nbytes) for c in state.kv.values())
    per_token = sum(int(c.bytes_per_token) for c in state.kv.values())

    def step(tok: int) -> int:
        out = model.forward(state, [tok], logits="last")
        state.commit([0])
        return int(_argmax_rows(out.logits)[-1])

    tok = 1
    for _ in range(3):                      # warm-up: capture of the width-1 graph, kernel builds
        tok = step(tok)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step(tok)
    cupy.cuda.Device().synchronize()
    decode_s = time.perf_counter() - t0

    toks = np.random.default_rng(1).integers(0, model.cfg.n_vocab, size=VERIFY_WIDTH)
    times = []
    for r in range(reps + 1):               # round 0 captures
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out = model.forward(state, toks, checkpoints=True, logits="all")
        _argmax_rows(out.logits)            # what a greedy verify needs from every row
        cupy.cuda.Device().synchronize()
        state.pending = None                # nothing committed: every pass sees the same context
        if r:
            times.append(time.perf_counter() - t0)
    res = {"context": context, "kv": f"{kv_k}/{kv_v}", "stored_as": sorted(f"{a}/{b}" for a, b in kinds),
           "kv_bytes": kv_bytes, "kv_bytes_per_token": per_token, "decode_tps": steps / decode_s,
           "step_ms": decode_s / steps * 1e3, "verify23_ms": statistics.median(times) * 1e3}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source(ap, "the synthetic Qwen3.6-27B Q4_K_M file")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--kv", nargs="+", default=["f16/f16", "q8_0/tq3_0", "tq3_0/tq3_0"], help="K/V type pairs")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per configuration")
    ap.add_argument("--reps", type=int, default=5, help="timed width-23 verifies per configuration")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason:
        print(f"kv_decode: no GPU here: {reason}")
        return 1
    import cupy

    pairs = [tuple(p.split("/")) for p in args.kv]
    if any(len(p) != 2 for p in pairs):
        ap.error("--kv takes K/V pairs such as f16/f16 or q8_0/tq3_0")
    t_start = time.perf_counter()
    rep: dict[str, Any] = {"device": device_name(cupy), "argv": sys.argv[1:] if argv is None else argv, "runs": []}
    path = args.model
    if args.make_synthetic:
        from services.engine.synthetic import make_synthetic

        path = make_synthetic(args.shape, args.make_synthetic, layers=args.layers).target_path
    model, _, rep["load"] = load_gpu_model(path)
    rep["n_layer"] = model.cfg.n_layer
    print(f"[{time.perf_counter() - t_start:6.1f} s] loaded {path}", flush=True)
    for ctx in args.context:
        base = None
        for k, v in pairs:
            r = time_config(model, ctx, k, v, args.steps, args.reps)
            cupy.get_default_memory_pool().free_all_blocks()     # the state (and its graphs) went with the call
            if base is None:
                base = r
            r["decode_tps_vs_first"] = r["decode_tps"] / base["decode_tps"]
            r["verify23_vs_first"] = r["verify23_ms"] / base["verify23_ms"]
            r["kv_bytes_vs_first"] = r["kv_bytes_per_token"] / base["kv_bytes_per_token"]
            rep["runs"].append(r)
            print(f"[{time.perf_counter() - t_start:6.1f} s] context {ctx:>6} KV {r['kv']:<12} (stored "
                  f"{','.join(r['stored_as'])}): decode {r['decode_tps']:6.1f} tok/s ({r['decode_tps_vs_first']:.3f}"
                  f" x {pairs[0][0]}/{pairs[0][1]}), verify-23 {r['verify23_ms']:6.2f} ms "
                  f"({r['verify23_vs_first']:.3f} x), KV {r['kv_bytes_per_token']} B/token "
                  f"({r['kv_bytes_vs_first']:.3f} x)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rep, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
