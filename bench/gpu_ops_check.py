"""One GPU run for the attention / norm / RoPE / gate / sampling kernels: tests, then timings vs the roofline.

    python bench/gpu_ops_check.py            # tests/test_kernels_ops.py, then the timings; $OUT/gpu_ops.json
    python bench/gpu_ops_check.py --no-tests
    python bench/gpu_ops_check.py --quick    # small shapes: a smoke run of the script itself
    python bench/gpu_ops_check.py --tq3      # TQ3_0 KV only: the GPU tests, then TQ3_0 vs f16 attention at 4K-128K

Timings at Qwen3.6-27B shapes (24 query heads, 4 KV heads, head_dim 256, hidden 5120, ffn 17408, DeltaNet
48 x 128 value heads, vocabulary 248320): per call, median over CUDA-graph replays of several calls that
rotate among copies of the data so the 50 MB L2 cannot hold it (bench/roofline.py's method). The roofline
is the measured device copy bandwidth (bytes read + written by a large device-to-device copy); "roof" =
(bytes the kernel must move / time) / copy bandwidth, so 1.0 is the memory limit. Attention moves the K
and V rows of the context once (plus q and o); its partial-output workspace is extra traffic, not counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import roofline  # noqa: E402  (bench/roofline.py: copy/read bandwidth and graph timing)

from kernels import loader  # noqa: E402

H, HKV, D, HIDDEN, FFN, HV, DV, VOCAB = 24, 4, 256, 5120, 17408, 48, 128, 248320
ROTATE_BYTES = 256 * 2**20


def run_tests(out_dir: Path | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=5",
           "tests/test_kernels_ops.py"]  # fmt: skip
    try:
        import pytest  # noqa: F401
    except ImportError:
        cmd = [sys.executable, "bench/mini_pytest.py", "tests/test_kernels_ops.py"]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if out_dir:
        (out_dir / "gpu_ops_tests.log").write_text(log)
    print(log[-6000:], flush=True)
    print(f"tests: exit {done.returncode} in {time.time() - t0:.0f} s", flush=True)
    return done.returncode


def timed(cupy, make_call, copies: int, min_calls: int = 8):
    """us per call over a graph of calls rotating among `copies` data sets (make_call(i) -> callable)."""
    calls = [make_call(i % copies) for i in range(copies * math.ceil(min_calls / copies))]
    us, best, how = roofline.time_calls(cupy, calls)
    return us, best, how


def time_attention(cupy, at, caches: list, T: int, S: int, splits: int) -> tuple[float, float, str]:
    """One chain of T queries (Qwen3.6 heads) over S committed rows, timed rotating among `caches` copies."""
    import numpy as np

    q = cupy.random.standard_normal((T, H, D), dtype=cupy.float32).astype(cupy.float16)
    mask = cupy.asarray(at.tree_mask(list(range(-1, T - 1))))
    s_dev = cupy.asarray([S], dtype=cupy.int32)
    ws = at.make_workspace(H, T, D, splits)
    out = cupy.empty((T, H, D), cupy.float16)
    calls = [partial(at.attention, q, c, s_dev, mask, splits=splits, workspace=ws, out=out, out_dtype=np.float16)
             for c in caches]
    return timed(cupy, lambda i: calls[i], len(caches))


def bench_attention(cupy, copy_bw: float, quick: bool) -> list[dict]:

    from kernels import attention as at

    rows = []
    contexts = (256, 1024) if quick else (4096, 32768)
    widths = (1, 16) if quick else (1, 16, 23, 41)
    for kind in ("f16", "q8_0"):
        for S in contexts:
            probe = at.KVCacheLayer(HKV, D, S + 64, kind)
            copies = max(1, min(8, math.ceil(ROTATE_BYTES / probe.nbytes)))
            del probe
            caches = []
            for _ in range(copies):
                c = at.KVCacheLayer(HKV, D, S + 64, kind)
                for start in range(0, S + 64, 4096):  # random rows, quantized by the store kernel
                    n = min(4096, S + 64 - start)
                    kv = cupy.random.standard_normal((2, n, HKV, D), dtype=cupy.float32)
                    c.store(kv[0], kv[1], start)
                caches.append(c)
            cupy.cuda.Device().synchronize()
            t1 = None
            for T in widths:
                splits = at.choose_splits(H, HKV, D, T, S, kind)
                us, best, how = time_attention(cupy, at, caches, T, S, splits)
                t1 = us if t1 is None else t1
                kv_bytes = 2 * HKV * (S + T) * at.row_bytes(kind, D)
                nbytes = kv_bytes + T * H * D * 4
                gbs = nbytes / (us * 1e-6) / 1e9
                row = {
                    "kernel": "attention", "kv": kind, "S": S, "T": T, "splits": splits, "us": round(us, 2),
                    "best_us": round(best, 2), "MB": round(nbytes / 1e6, 2), "GBps": round(gbs, 1),
                    "roof": round(gbs / copy_bw, 3), "x_T1": round(us / t1, 3),
                    "TFLOPs": round(4 * H * T * (S + T) * D / (us * 1e-6) / 1e12, 2), "timing": how,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del caches
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def fill_cache(cupy, cache, rows: int) -> None:
    """Random rows 0 .. rows-1, written (and quantized) by the store kernel 4096 rows at a time."""
    for start in range(0, rows, 4096):
        n = min(4096, rows - start)
        kv = cupy.random.standard_normal((2, n, cache.n_kv_heads, cache.head_dim), dtype=cupy.float32)
        cache.store(kv[0], kv[1], start)


def bench_tq3(cupy, copy_bw: float, quick: bool) -> list[dict]:
    """Attention over TQ3_0 (K and V, and the 6:1 default K q8_0 + V tq3_0) vs f16 KV, Qwen3.6-27B shape;
    plus the store kernel (quantizing T new rows) per call."""

    from kernels import attention as at

    rows = []
    contexts = (1024, 4096) if quick else (4096, 32768, 131072)
    pairs = (("f16", "f16"), ("tq3_0", "tq3_0"), ("q8_0", "tq3_0"), ("q8_0", "q8_0"))
    base: dict[tuple[int, int], float] = {}
    for S in contexts:
        for kk, kv in pairs:
            probe = at.KVCacheLayer(HKV, D, S + 64, kk, kv)
            # enough copies that L2 cannot hold them (a 4K TQ3_0 layer is 3.7 MB)
            copies = max(1, min(64, math.ceil(ROTATE_BYTES / probe.nbytes)))
            del probe
            caches = []
            for _ in range(copies):
                c = at.KVCacheLayer(HKV, D, S + 64, kk, kv)
                fill_cache(cupy, c, S + 64)
                caches.append(c)
            cupy.cuda.Device().synchronize()
            for T in (1, 23):
                splits = at.choose_splits(H, HKV, D, T, S, kk, kv)
                us, best, how = time_attention(cupy, at, caches, T, S, splits)
                if kk == "f16" and kv == "f16":
                    base[(S, T)] = us
                kv_bytes = HKV * (S + T) * (at.row_bytes(kk, D) + at.row_bytes(kv, D))
                nbytes = kv_bytes + T * H * D * 4
                gbs = nbytes / (us * 1e-6) / 1e9
                row = {
                    "kernel": "attention", "kv": f"{kk}/{kv}", "S": S, "T": T, "splits": splits, "us": round(us, 2),
                    "best_us": round(best, 2), "MB": round(nbytes / 1e6, 2), "GBps": round(gbs, 1),
                    "roof": round(gbs / copy_bw, 3), "x_f16": round(us / base[(S, T)], 3),
                    "bytes_x_f16": round(kv_bytes / (HKV * (S + T) * 4 * D), 3), "timing": how,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
                if S == contexts[0] and kv == "tq3_0":  # the store of T new rows (K and V of all KV heads)
                    src = cupy.random.standard_normal((2, T, HKV, D), dtype=cupy.float32).astype(cupy.float16)
                    s_dev = cupy.asarray([S], dtype=cupy.int32)
                    st = [partial(c.store, src[0], src[1], s_dev) for c in caches]
                    sus, sbest, show = timed(cupy, lambda i, st=st: st[i], copies)
                    srow = {"kernel": "kv_store", "kv": f"{kk}/{kv}", "T": T, "us": round(sus, 2),
                            "best_us": round(sbest, 2), "timing": show}  # fmt: skip
                    rows.append(srow)
                    print(json.dumps(srow), flush=True)
            del caches
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_small(cupy, copy_bw: float, quick: bool) -> list[dict]:
    import numpy as np

    from kernels import norm_rope as nr
    from kernels import sampling as sp

    rows = []
    rnd = cupy.random.standard_normal
    f16 = np.float16

    def record(name: str, shape: str, nbytes: int, calls: list) -> None:
        us, best, how = timed(cupy, lambda i: calls[i], len(calls))
        gbs = nbytes / (us * 1e-6) / 1e9
        row = {
            "kernel": name,
            "shape": shape,
            "us": round(us, 2),
            "best_us": round(best, 2),
            "MB": round(nbytes / 1e6, 3),
            "GBps": round(gbs, 1),
            "roof": round(gbs / copy_bw, 3),
            "timing": how,
        }
        rows.append(row)  # fmt: skip
        print(json.dumps(row), flush=True)

    hidden, vocab = (512, 4096) if quick else (HIDDEN, VOCAB)
    for T in (1, 23):
        x, r = rnd((T, hidden), dtype=cupy.float32), rnd((T, hidden), dtype=cupy.float32)
        w = cupy.ones(hidden, cupy.float32)
        y, s = cupy.empty((T, hidden), cupy.float16), cupy.empty((T, hidden), cupy.float32)
        call = partial(nr.rms_norm, x, w, 1e-6, residual=r, out=y, sum_out=s, out_dtype=f16)
        record("rms_norm+res", f"T={T} n={hidden} f32->f16", T * hidden * 14, [call])

        qg, k = rnd((T, H, 2 * D), dtype=cupy.float32), rnd((T, HKV, D), dtype=cupy.float32)
        pos = cupy.arange(T, dtype=cupy.int32) + 30000
        wq, wk = cupy.ones(D, cupy.float32), cupy.ones(D, cupy.float32)
        qo, ko = cupy.empty((T, H, D), cupy.float16), cupy.empty((T, HKV, D), cupy.float16)
        call = partial(nr.qk_norm_rope, qg[..., :D], k, wq, wk, pos, 64, 1.0e7, 1e-6, q_out=qo, k_out=ko, out_dtype=f16)
        record("qk_norm_rope", f"T={T} {H}+{HKV}x{D} rot 64", T * (H + HKV) * D * 6, [call])

    T = 23
    ffn = 2048 if quick else FFN
    gu = rnd((T, 2 * ffn), dtype=cupy.float32)
    h = cupy.empty((T, ffn), cupy.float16)
    call = partial(nr.silu_mul, gu[:, :ffn], gu[:, ffn:], out=h, out_dtype=f16)
    record("silu_mul", f"T={T} n={ffn} f32->f16", T * ffn * 10, [call])
    o, z = rnd((T, HV, DV), dtype=cupy.float32), rnd((T, HV, DV), dtype=cupy.float32)
    og = cupy.empty((T, HV, DV), cupy.float16)
    call = partial(nr.norm_gate, o, z, cupy.ones(DV, cupy.float32), 1e-6, out=og, out_dtype=f16)
    record("norm_gate", f"T={T} {HV}x{DV}", T * HV * DV * 10, [call])
    qg = rnd((T, H, 2 * D), dtype=cupy.float32)
    xa = rnd((T, H, D), dtype=cupy.float32)
    ga = cupy.empty((T, H, D), cupy.float16)
    record("gate_mul", f"T={T} {H}x{D}", T * H * D * 10, [partial(nr.gate_mul, xa, qg[..., D:], out=ga, out_dtype=f16)])

    for R in (1, 23):
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / (R * vocab * 4))))
        logits = [rnd((R, vocab), dtype=cupy.float32) for _ in range(copies)]
        nch = sp.chunks_for(R, vocab)
        part = sp.make_argmax_workspace(R, nch)
        res = (cupy.empty(R, cupy.int32), cupy.empty(R, cupy.float32))
        calls = [partial(sp.argmax, L, chunks=nch, workspace=part, out=res) for L in logits]
        record("argmax", f"rows={R} V={vocab}", R * vocab * 4, calls)
        k = 8
        ws = sp.make_topk_workspace(R, nch, k)
        res_k = (cupy.empty((R, k), cupy.int32), cupy.empty((R, k), cupy.float32))
        calls = [partial(sp.topk_logprobs, L, k, chunks=nch, workspace=ws, out=res_k) for L in logits]
        record("topk8+logsoftmax", f"rows={R} V={vocab}", R * vocab * 4, calls)
        del logits, calls
    return rows


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    if quick:
        roofline.REPS, roofline.WARM = 3, 1
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    tq3_only = "--tq3" in argv
    status = 0 if "--no-tests" in argv else run_tests(out_dir)
    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"gpu_ops_check: timings skipped: {reason}")
        return status
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = int(dev.attributes["MultiProcessorCount"])
    info = {"device": name, "sm_count": sms, "cupy": cupy.__version__, "commit": os.environ.get("COMMIT", "?"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    print("gpu_ops_check:", json.dumps(info), flush=True)
    buf = 2**24 if quick else 2 * 2**30
    copy_bw = roofline.copy_bandwidth(cupy, buf)
    read_bw = roofline.read_bandwidth(cupy, buf, sms)
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"copy bandwidth {copy_bw:.1f} GB/s, streaming read {read_bw:.1f} GB/s", flush=True)

    t0 = time.time()
    small = [] if tq3_only else bench_small(cupy, copy_bw, quick)
    attn = [] if tq3_only else bench_attention(cupy, copy_bw, quick)
    tq3 = bench_tq3(cupy, copy_bw, quick)
    result = {**info, "copy_GBps": round(copy_bw, 1), "read_GBps": round(read_bw, 1), "tests_exit": status,
              "attention": attn, "small": small, "tq3": tq3, "bench_seconds": round(time.time() - t0, 1)}  # fmt: skip
    if out_dir:
        (out_dir / "gpu_ops.json").write_text(json.dumps(result, indent=1))

    print()
    print(f"{name} ({info['date']}, commit {info['commit']}): copy {copy_bw:.0f} GB/s, read {read_bw:.0f} GB/s; "
          "roof = bytes moved per second / copy bandwidth")  # fmt: skip
    print(f"{'kernel':18} {'shape':28} {'us':>8} {'MB':>8} {'GB/s':>7} {'roof':>6}")
    for r in small:
        print(f"{r['kernel']:18} {r['shape']:28} {r['us']:8.2f} {r['MB']:8.3f} {r['GBps']:7.0f} {r['roof']:6.2f}")
    print(f"{'attention':9} {'kv':5} {'S':>6} {'T':>3} {'splits':>6} {'us':>8} {'MB':>7} {'roof':>6} {'xT1':>6} "
          f"{'TFLOP/s':>8}")  # fmt: skip
    for r in attn:
        print(f"{'':9} {r['kv']:5} {r['S']:6} {r['T']:3} {r['splits']:6} {r['us']:8.1f} {r['MB']:7.1f} "
              f"{r['roof']:6.2f} {r['x_T1']:6.2f} {r['TFLOPs']:8.1f}")  # fmt: skip
    print(f"{'TQ3_0 KV':9} {'K/V':12} {'S':>6} {'T':>3} {'splits':>6} {'us':>8} {'MB':>7} {'roof':>6} {'x_f16':>6} "
          f"{'bytes':>6}")  # fmt: skip
    for r in tq3:
        if r["kernel"] == "attention":
            print(f"{'':9} {r['kv']:12} {r['S']:6} {r['T']:3} {r['splits']:6} {r['us']:8.1f} {r['MB']:7.1f} "
                  f"{r['roof']:6.2f} {r['x_f16']:6.2f} {r['bytes_x_f16']:6.3f}")  # fmt: skip
        else:
            print(f"{'kv_store':9} {r['kv']:12} {'':6} {r['T']:3} {'':6} {r['us']:8.1f}")
    print(f"gpu_ops_check: tests exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
