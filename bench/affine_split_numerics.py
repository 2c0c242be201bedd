"""Numerics of the affine dequantization split (docs/gpu_quant_matmul.md "Next: the affine dequantization split"),
CPU only: relative error against float64 of the wide kernel's per-weight form fp16(q s + m) and of the split
fp16(q s) x + m sum(x) per sub-block, the sum as one fp16 value or as two (hi + lo), on Q4_K / Q6_K rows quantized
from Gaussian weights. `python3 bench/affine_split_numerics.py` (seconds)."""
import numpy as np

f16 = np.float16


def q4k_rows(w):  # w [n, k] -> (s [n, k/32] fp16, m [n, k/32] fp16 (= -dmin*mn), q [n, k] ints)
    n, k = w.shape
    g = w.reshape(n, k // 256, 8, 32)
    lo, hi = np.minimum(g.min(-1), 0), g.max(-1)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(f16).astype(np.float64)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(f16).astype(np.float64)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)), 0, 63)
    mn = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin)), 0, 63)
    s64, m64 = d * sc, -dmin * mn
    q = np.clip(np.round((g - m64[..., None]) / np.where(s64 == 0, 1, s64)[..., None]), 0, 15)
    s = (sc.astype(f16) * d.astype(f16)).astype(f16)          # prep2: fp16(sc * d)
    m = (mn.astype(f16) * (-dmin).astype(f16)).astype(f16)    # fp16(mn * -dmin)
    w64 = (s64[..., None] * q + m64[..., None]).reshape(n, k)   # the stored codes, exactly (float64)
    return s.reshape(n, -1), m.reshape(n, -1), q.reshape(n, k), w64, 32


def q6k_rows(w):
    n, k = w.shape
    g = w.reshape(n, k // 256, 16, 16)
    amax = np.abs(g).max(-1)
    scale = amax / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(f16).astype(np.float64)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)), -128, 127)
    s64 = d * sc
    q = np.clip(np.round(g / np.where(s64 == 0, 1, s64)[..., None]), -32, 31) + 32
    s = (sc.astype(f16) * d.astype(f16)).astype(f16)
    m = (np.float16(-32) * s).astype(f16)                      # exact: -32 s
    w64 = (s64[..., None] * (q - 32)).reshape(n, k)
    return s.reshape(n, -1), m.reshape(n, -1), q.reshape(n, k), w64, 16


def products(rows, x):
    s, m, q, w64, G = rows
    n, k = q.shape
    S, M = np.repeat(s, G, 1).astype(np.float64), np.repeat(m, G, 1).astype(np.float64)
    x64 = x.astype(np.float64)
    truth = x64 @ w64.T
    cur = (q * S + M).astype(f16).astype(np.float64)              # fp16(q s + m): one rounding (HFMA2)
    y_cur = x64 @ cur.T
    a = (q * S).astype(f16).astype(np.float64)                   # fp16(q s): one rounding (HFMA2 with -1024 s)
    xs = x.astype(np.float32).reshape(x.shape[0], k // G, G).sum(-1).astype(f16).astype(np.float64)
    y_split = x64 @ a.T + xs @ m.astype(np.float64).T
    xs32 = x.astype(np.float32).reshape(x.shape[0], k // G, G).sum(-1)
    hi = xs32.astype(f16)
    lo = (xs32 - hi.astype(np.float32)).astype(f16)
    y_hilo = x64 @ a.T + (hi.astype(np.float64) + lo.astype(np.float64)) @ m.astype(np.float64).T

    def rel(y):
        return float(np.linalg.norm(y - truth) / np.linalg.norm(truth))

    return rel(y_cur), rel(y_split), rel(y_hilo)


def main() -> None:
    rng = np.random.default_rng(0)
    print("relative error against float64: current fp16(q s + m) / split, one fp16 sum / split, hi + lo sums")
    for name, make in (("Q4_K", q4k_rows), ("Q6_K", q6k_rows)):
        for shift in (0.0, 0.02):  # weights centred, and offset (a Q4_K min far from zero)
            rows = make(rng.standard_normal((512, 4096)) * 0.02 + shift)
            for kind in ("gauss", "positive"):
                x = rng.standard_normal((23, 4096))
                if kind == "positive":
                    x = np.abs(x) * 2 + 0.5  # every sub-block sum large: the split's worst case
                r = products(rows, x.astype(f16))
                print(f"{name} weights + {shift}, x {kind}: {r[0]:.2e} / {r[1]:.2e} ({r[1] / r[0]:.2f}x) / "
                      f"{r[2]:.2e} ({r[2] / r[0]:.2f}x)")


if __name__ == "__main__":
    main()
