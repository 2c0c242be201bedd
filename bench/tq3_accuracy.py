"""Accuracy of the KV cache types (TQ3_0, q8_0, f16) against the exact f32 cache, on the CPU, in one run.

Prints three tables:
1. round trip: per-group relative squared error E||x - x~||^2 / ||x||^2 of TQ3_0 on Gaussian, Student-t (df 3),
   outlier-channel vectors and the default model's real K/V rows, as a ratio to the TurboQuant_mse bound for
   3 bits, sqrt(3) pi / 2 * 4^-3 = 0.0425 (Zandieh et al., arXiv:2504.19874, Thm. 1), and to the 3-bit
   Lloyd-Max optimum for a Gaussian, 0.03454; q8_0 beside it.
2. attention: relative error ||o - o_f32|| / ||o_f32|| of single-token attention output over 1K, 8K and 32K
   context, per K/V combination and GQA ratio (1, 2, 6), synthetic keys with a few large channels, with
   peaked (score std 3) and flat (score std 1) attention; f16/f16 is the floor.
3. model: on the shipped default model, for every K/V combination, the mean KL(p_f32 || p_kv) of the next
   token distribution over 256 generated tokens (teacher-forced on the f32 greedy continuation), how often
   the argmax agrees, and how many of 256 free-running greedy tokens equal the f32 ones before the first
   difference.

    python bench/tq3_accuracy.py [--prompts 4] [--tokens 256] [--contexts 1024,8192,32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.engine.kvcache import KVCache  # noqa: E402
from services.engine.layers import masked_attention  # noqa: E402
from services.engine.quants import legacy, tq3  # noqa: E402

BOUND_3BIT = float(np.sqrt(3) * np.pi / 2 * 4.0 ** -3)
LLOYD_MAX_3BIT = 0.03454
ATTN_COMBOS = [("f16", "f16"), ("q8_0", "q8_0"), ("f16", "tq3_0"), ("q8_0", "tq3_0"), ("tq3_0", "f16"),
               ("tq3_0", "tq3_0")]
MODEL_COMBOS = [("f16", "f16"), ("q8_0", "q8_0"), ("f16", "tq3_0"), ("q8_0", "tq3_0"), ("tq3_0", "q8_0"),
                ("tq3_0", "tq3_0")]


def group_nmse(x: np.ndarray, y: np.ndarray, g: int) -> float:
    xg, yg = x.reshape(-1, g).astype(np.float64), y.reshape(-1, g).astype(np.float64)
    keep = (xg ** 2).sum(1) > 0
    return float((((xg - yg) ** 2).sum(1)[keep] / (xg ** 2).sum(1)[keep]).mean())


def round_trip(vectors: dict[str, np.ndarray]) -> list[dict]:
    rows = []
    for name, x in vectors.items():
        g = tq3.group_size(x.shape[-1])
        t = group_nmse(x, tq3.dequantize_tq3_0(tq3.quantize_tq3_0(x)), g)
        q8 = group_nmse(x, legacy.dequantize_q8_0(legacy.quantize_q8_0(x.reshape(-1, 32))).reshape(x.shape), g)
        rows.append({"vectors": name, "dim": x.shape[-1], "group": g, "tq3_nmse": t, "tq3_over_bound": t / BOUND_3BIT,
                     "tq3_over_lloyd_max": t / LLOYD_MAX_3BIT, "q8_0_nmse": q8})
    return rows


def synthetic_kv(rng: np.random.Generator, n: int, hkv: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys with a per-channel scale (log-normal, 4 channels x8) and a shared offset, as RoPE'd real keys
    have; values Gaussian; the channel scale is what makes q.k peaked and K error costly."""
    scale = np.exp(0.5 * rng.standard_normal(d)).astype(np.float32)
    scale[rng.choice(d, 4, replace=False)] *= 8.0
    k = rng.standard_normal((n, hkv, d)).astype(np.float32) * scale + 0.5 * scale * rng.standard_normal(d)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    return k.astype(np.float32), v, scale


def attention_errors(contexts: list[int], ratios: list[int], score_std: float, hkv: int = 2, d: int = 128,
                     queries: int = 4, seed: int = 0) -> list[dict]:
    rows = []
    for n in contexts:
        rng = np.random.default_rng(seed + n)
        k, v, scale = synthetic_kv(rng, n, hkv, d)
        stores = {}
        for t in {t for combo in ATTN_COMBOS for t in combo} | {"f32"}:
            c = KVCache.allocate(n, hkv, d, t, t)
            c.write(0, k, v)
            stores[t] = c
        for g in ratios:
            h = g * hkv
            # queries along the keys' channel structure, scaled to the asked score spread: std 3 lets a few
            # keys dominate (the output error is then about one V row's), std 1 spreads attention wide
            q = rng.standard_normal((queries, h, d)).astype(np.float32) * scale
            dots = (q[:, :1] * k[:64, 0][None]).sum(-1)
            q *= np.float32(score_std * np.sqrt(d) / float((dots - dots.mean(1, keepdims=True)).std()))
            vis = np.ones((queries, n), bool)
            ref = masked_attention(q, k, v, vis)
            for kt, vt in ATTN_COMBOS:
                cache = KVCache(stores[kt].k, stores[vt].v)
                out = cache.attend(q, n, vis)
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                rows.append({"context": n, "gqa": g, "score_std": score_std, "k": kt, "v": vt, "rel_err": err})
    return rows


def model_agreement(n_prompts: int, n_tokens: int) -> list[dict]:
    from services.engine.default_model import default_model_paths, heldout_prompts
    from services.engine.generate import generate
    from services.engine.loader import load_target

    target = load_target(default_model_paths()[0])
    model, tok = target.model, target.tokenizer
    prompts = [tok.encode(p)[-192:] for p in heldout_prompts()[:n_prompts]]

    def teacher_forced(ids: list[int], n_prompt: int, types: tuple[str, str]) -> np.ndarray:
        state = model.new_state(len(ids) + 1, *types)
        out = model.forward(state, ids, logits="all").logits
        return out[n_prompt - 1: len(ids) - 1].astype(np.float64)       # predicting each generated token

    def logp(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    refs = []
    for p in prompts:
        model.set_kv_cache_types("f32", "f32")
        gen = generate(model, p, n_tokens).token_ids
        seq = p + gen
        refs.append((p, gen, logp(teacher_forced(seq, len(p), ("f32", "f32")))))
    rows = []
    for types in MODEL_COMBOS:
        kls, agree, prefix = [], [], []
        model.set_kv_cache_types(*types)
        for p, gen, lp_ref in refs:
            lp = logp(teacher_forced(p + gen, len(p), types))
            kls.append((np.exp(lp_ref) * (lp_ref - lp)).sum(-1))
            agree.append(lp.argmax(-1) == lp_ref.argmax(-1))
            free = generate(model, p, n_tokens).token_ids
            same = next((i for i, (a, b) in enumerate(zip(free, gen)) if a != b), min(len(free), len(gen)))
            prefix.append(same)
        model.set_kv_cache_types("f32", "f32")
        kl = np.concatenate(kls)
        rows.append({"k": types[0], "v": types[1], "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),
                     "top1_agreement": float(np.concatenate(agree).mean()),
                     "identical_prefix_mean": float(np.mean(prefix)), "identical_prefix_min": int(min(prefix)),
                     "identical_prefix": [int(x) for x in prefix],
                     "prompts": len(refs), "tokens": n_tokens})
    return rows


def real_kv_rows() -> dict[str, np.ndarray]:
    """K and V rows of the default model's attention layers over a held-out prompt (head_dim 64)."""
    from services.engine.default_model import default_model_paths, heldout_prompts
    from services.engine.loader import load_target

    target = load_target(default_model_paths()[0])
    ids = target.tokenizer.encode("\n".join(heldout_prompts()[:3]))[:1024]
    state = target.model.new_state(len(ids), "f32", "f32")
    target.model.forward(state, ids, logits="none")
    k = np.concatenate([c.k.read(len(ids)) for c in state.kv.values()]).reshape(-1, target.cfg.head_dim)
    v = np.concatenate([c.v.read(len(ids)) for c in state.kv.values()]).reshape(-1, target.cfg.head_dim)
    return {"default model K (d=64)": k, "default model V (d=64)": v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts for the model table")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--gqa", default="1,2,6")
    ap.add_argument("--json", help="also write all rows here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((20000, 128)).astype(np.float32)
    outl = gauss.copy()
    outl[:, [5, 37, 70, 101]] *= 20.0
    vectors = {"Gaussian": gauss, "Student-t df=3": rng.standard_t(3, (20000, 128)).astype(np.float32),
               "Gaussian, 4 channels x20": outl, **real_kv_rows()}
    rt = round_trip(vectors)
    # the 64-group choice: sqrt(2)-scaled midpoints vs TheTom's unscaled N(0, 1/128) ones
    g64 = rng.standard_normal((20000, 64)).astype(np.float32)
    scaled = group_nmse(g64, tq3.dequantize_tq3_0(tq3.quantize_tq3_0(g64)), 64)
    saved = tq3._MIDS[64]
    tq3._MIDS[64] = tq3.MIDPOINTS
    try:
        unscaled = group_nmse(g64, tq3.dequantize_tq3_0(tq3.quantize_tq3_0(g64)), 64)
    finally:
        tq3._MIDS[64] = saved
    print(f"TurboQuant_mse bound (3 bits): {BOUND_3BIT:.4f}; Lloyd-Max Gaussian optimum: {LLOYD_MAX_3BIT}")
    print("| vectors | dim | group | TQ3_0 NMSE | / bound | / Lloyd-Max | q8_0 NMSE |")
    print("|---|---|---|---|---|---|---|")
    for r in rt:
        print(f"| {r['vectors']} | {r['dim']} | {r['group']} | {r['tq3_nmse']:.4f} | {r['tq3_over_bound']:.2f} | "
              f"{r['tq3_over_lloyd_max']:.2f} | {r['q8_0_nmse']:.2e} |")
    print(f"| Gaussian, 64-groups, unscaled (1/128) midpoints | 64 | 64 | {unscaled:.4f} | "
          f"{unscaled / BOUND_3BIT:.2f} | {unscaled / LLOYD_MAX_3BIT:.2f} | - |")
    print(f"| Gaussian, 64-groups, sqrt(2)-scaled midpoints (used) | 64 | 64 | {scaled:.4f} | "
          f"{scaled / BOUND_3BIT:.2f} | {scaled / LLOYD_MAX_3BIT:.2f} | - |")
    print(f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr)

    contexts = [int(c) for c in args.contexts.split(",")]
    ratios = [int(g) for g in args.gqa.split(",")]
    at = []
    for std in (3.0, 1.0):
        rows = attention_errors(contexts, ratios, std)
        at += rows
        print(f"\nattention output relative error vs f32 KV (head_dim 128, 2 KV heads, 4 decode queries, "
              f"score std {std:g})")
        print("| K / V | " + " | ".join(f"{c // 1024}K gqa {g}" for c in contexts for g in ratios) + " |")
        print("|---|" + "---|" * (len(contexts) * len(ratios)))
        for kt, vt in ATTN_COMBOS:
            cells = [next(r["rel_err"] for r in rows if (r["k"], r["v"], r["context"], r["gqa"]) == (kt, vt, c, g))
                     for c in contexts for g in ratios]
            print(f"| {kt} / {vt} | " + " | ".join(f"{e:.4f}" for e in cells) + " |")
    print(f"[{time.perf_counter() - t0:.0f} s]", file=sys.stderr)

    md = model_agreement(args.prompts, args.tokens)
    print(f"\ndefault model ({args.prompts} held-out prompts x {args.tokens} generated tokens, greedy f32 reference)")
    print("| K / V | mean KL | p99 KL | top-1 agreement | identical greedy prefix (mean / min of "
          f"{args.tokens}) |")
    print("|---|---|---|---|---|")
    for r in md:
        print(f"| {r['k']} / {r['v']} | {r['mean_kl']:.2e} | {r['p99_kl']:.2e} | {r['top1_agreement']:.4f} | "
              f"{r['identical_prefix_mean']:.0f} / {r['identical_prefix_min']} |")
    print(f"[total {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"round_trip": rt, "attention": at, "model": md,
                       "g64_unscaled": unscaled, "g64_scaled": scaled}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
