"""Tree attention at verify widths, old vs new, in one GPU run: precompile, GPU tests, then timings (issue 5).

    python3 bench/attn_verify_bench.py            # precompile, tests/test_kernels_ops.py, old vs new, sweep
    python3 bench/attn_verify_bench.py --no-tests --no-sweep
    python3 bench/attn_verify_bench.py --quick    # small shapes: a smoke run of the script itself

"old" is the attention kernel and launcher of another revision (ATTN_BASELINE_DIR: a folder holding its attention.py
and attention.cu, e.g. written here by `git show REV:kernels/attention.py` and carried to the GPU machine; without it,
`git show $ATTN_BASELINE_REV` (default 1607152, the kernel before the session-5 rewrite) where git history exists;
neither: "new" alone), loaded as a package of its own next to a copy of kernels/loader.py and norm_rope.py; "new" is
kernels/attention.py. Both run on the same
caches (the cache layout did not change), Qwen3.6-27B shape (24 query heads, 4 KV heads, head dim 256, f16 q,
f16 out, one layer), KV f16/f16 and the auto kinds K q8_0 / V tq3_0, S = 512, 2048, 4096, 32768 committed rows
x T = 1, 16, 23, 41 new tokens (a chain mask: the kernels' cost does not depend on the tree's shape). Splits
come from each launcher's own choose_splits with the engine's graph hint (models/qwen35_gpu.py: S + T rounded
up to a power of two from 512, minus T). Time per call: median of CUDA-graph replays of several calls rotating
among copies of the cache so that L2 (50 MB) cannot hold them (bench/roofline.py's method): partial + combine
kernels and the boundary between them, as inside the engine's step graph.
--sweep (default on): the new kernel at forced (kw, splits) for S = 512 / 4096, T = 23 / 41, to check the
split policy. Details: $OUT/attn_verify.json; the compact table is printed last.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import roofline  # noqa: E402  (bench/roofline.py: graph timing)

from kernels import loader  # noqa: E402

H, HKV, D = 24, 4, 256
ROTATE_BYTES = 256 * 2**20
KINDS = (("f16", "f16"), ("q8_0", "tq3_0"))
BASE_COMMIT = "1607152"


def load_baseline():
    """The baseline's attention.{py,cu} as package `attn_base` (its own loader, so its own module cache), or None."""
    pkg = Path(tempfile.mkdtemp(prefix="attn_base_")) / "attn_base"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("loader.py", "norm_rope.py"):
        shutil.copy(ROOT / "kernels" / name, pkg / name)
    for header in (ROOT / "kernels").glob("*.cuh"):  # the headers loader.py pastes in (this tree's)
        shutil.copy(header, pkg / header.name)
    src = os.environ.get("ATTN_BASELINE_DIR")
    rev = os.environ.get("ATTN_BASELINE_REV", BASE_COMMIT)
    for name in ("attention.py", "attention.cu"):
        if src:
            shutil.copy(Path(src) / name, pkg / name)
            continue
        got = subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode != 0:
            print(f"attn_verify_bench: no baseline ({rev} not in git here, ATTN_BASELINE_DIR unset): new kernel only")
            return None
        (pkg / name).write_text(got.stdout)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("attn_base.attention")


def s_hint_of(S: int, T: int) -> int:
    b = 512
    while b < S + T:
        b *= 2
    return b - T


def run_tests(out_dir: Path | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=5",
           "tests/test_kernels_ops.py"]  # fmt: skip
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if out_dir:
        (out_dir / "attn_tests.log").write_text(log)
    print(log[-4000:], flush=True)
    print(f"tests: exit {done.returncode} in {time.time() - t0:.0f} s", flush=True)
    return done.returncode


def make_caches(cupy, at, kk: str, kv: str, S: int, max_ctx: int) -> list:
    probe = at.KVCacheLayer(HKV, D, max_ctx, kk, kv)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / probe.nbytes)))
    del probe
    caches = []
    for _ in range(copies):
        c = at.KVCacheLayer(HKV, D, max_ctx, kk, kv)
        for start in range(0, S + 64, 4096):  # random rows, quantized by the store kernel
            n = min(4096, S + 64 - start)
            rows = cupy.random.standard_normal((2, n, HKV, D), dtype=cupy.float32)
            c.store(rows[0], rows[1], start)
        caches.append(c)
    cupy.cuda.Device().synchronize()
    return caches


def time_one(cupy, mod, caches, T: int, S: int, splits: int, kw: int | None = None) -> tuple[float, float]:
    """(median, best) us per call of `mod`.attention over T chain tokens at S, rotating among `caches`."""
    import numpy as np

    q = (cupy.random.standard_normal((T, H, D), dtype=cupy.float32) * 0.5).astype(cupy.float16)
    mask = cupy.asarray(mod.tree_mask(list(range(-1, T - 1))))
    s_dev = cupy.asarray([S], dtype=cupy.int32)
    ws = mod.make_workspace(H, T, D, splits)
    out = cupy.empty((T, H, D), cupy.float16)
    extra = {} if kw is None else {"kw": kw}
    calls = [partial(mod.attention, q, c, s_dev, mask, splits=splits, workspace=ws, out=out, out_dtype=np.float16,
                     **extra) for c in caches]  # fmt: skip
    reps = max(1, math.ceil(8 / len(calls)))
    us, best, _how = roofline.time_calls(cupy, calls * reps)
    return us, best


def check_same(cupy, old, new, caches, T: int, S: int) -> float:
    """Relative difference of the two implementations' outputs on one cache (both ~1e-3 from the twin)."""
    q = (cupy.random.standard_normal((T, H, D), dtype=cupy.float32) * 0.5).astype(cupy.float16)
    mask = cupy.asarray(new.tree_mask(list(range(-1, T - 1))))
    a = old.attention(q, caches[0], S, mask, s_hint=s_hint_of(S, T))
    b = new.attention(q, caches[0], S, mask, s_hint=s_hint_of(S, T))
    return float(cupy.linalg.norm(a - b) / max(float(cupy.linalg.norm(a)), 1e-30))


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    if quick:
        roofline.REPS, roofline.WARM = 3, 1
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"attn_verify_bench: no GPU: {reason}")
        return 0 if "--no-tests" in argv else run_tests(out_dir)
    import cupy

    from kernels import attention as new

    old = load_baseline()
    contexts = (512, 2048) if quick else (512, 2048, 4096, 32768)
    widths = (1, 23) if quick else (1, 16, 23, 41)

    # precompile every kernel the timings use (NVRTC, one module per instantiation), old and new
    t0 = time.time()
    for kk, kv in KINDS:
        c = new.KVCacheLayer(HKV, D, 256, kk, kv)
        for T in widths:
            q = cupy.zeros((T, H, D), cupy.float16)
            m = new.tree_mask(list(range(-1, T - 1)))
            for mod in (m for m in (old, new) if m is not None):
                mod.attention(q, c, 100, m, out_dtype=cupy.float16)
                mod.attention(q, c, 100, m)  # f32 out: check_same's
    cupy.cuda.Device().synchronize()
    print(f"precompiled in {time.time() - t0:.0f} s", flush=True)

    status = 0 if "--no-tests" in argv else run_tests(out_dir)

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info = {"device": name, "sm_count": int(dev.attributes["MultiProcessorCount"]), "cupy": cupy.__version__,
            "commit": os.environ.get("COMMIT", "?"),
            "baseline": None if old is None else os.environ.get("ATTN_BASELINE_DIR") or os.environ.get(
                "ATTN_BASELINE_REV", BASE_COMMIT),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    print("attn_verify_bench:", json.dumps(info), flush=True)

    rows, sweep = [], []
    t0 = time.time()
    for kk, kv in KINDS:
        for S in contexts:
            max_ctx = max(S + 64, s_hint_of(S, max(widths)) + max(widths))
            caches = make_caches(cupy, new, kk, kv, S, max_ctx)
            for T in widths:
                hint = s_hint_of(S, T)
                r = {"kv": f"{kk}/{kv}", "S": S, "T": T, "s_hint": hint, "copies": len(caches)}
                for tag, mod in (("old", old), ("new", new)):
                    if mod is None:
                        r["old_splits"], r["old_us"], r["old_best"] = 0, float("nan"), float("nan")
                        continue
                    splits = mod.choose_splits(H, HKV, D, T, hint, kk, kv)
                    us, best = time_one(cupy, mod, caches, T, S, splits)
                    r[f"{tag}_splits"], r[f"{tag}_us"], r[f"{tag}_best"] = splits, round(us, 2), round(best, 2)
                r["speedup"] = round(r["old_us"] / r["new_us"], 2)
                r["rel_diff"] = round(check_same(cupy, old, new, caches, T, S), 6) if old is not None else float("nan")
                rows.append(r)
                print(json.dumps(r), flush=True)
            if "--no-sweep" not in argv and S in ((512, 2048) if quick else (512, 4096)):
                for T in (23, 41) if not quick else (23,):
                    for kw in (1, 2):
                        gx, _ = new.grid_rows(H, HKV, T, kw)
                        tiles = math.ceil((s_hint_of(S, T) + T) / new.KT)
                        for splits in sorted({1, 2, 4, 8, 16, 32, 64} & set(range(1, tiles + 1))):
                            us, best = time_one(cupy, new, caches, T, S, splits, kw=kw)
                            sw = {"kv": f"{kk}/{kv}", "S": S, "T": T, "kw": kw, "gx": gx, "splits": splits,
                                  "us": round(us, 2), "best": round(best, 2)}  # fmt: skip
                            sweep.append(sw)
                            print(json.dumps(sw), flush=True)
            del caches
            cupy.get_default_memory_pool().free_all_blocks()
    result = {**info, "tests_exit": status, "rows": rows, "sweep": sweep, "bench_seconds": round(time.time() - t0, 1)}
    (out_dir / "attn_verify.json").write_text(json.dumps(result, indent=1))

    print()
    if sweep:
        print("sweep (new kernel, forced kw / splits): best per (kv, S, T), then the launcher's choice")
        keys = sorted({(s["kv"], s["S"], s["T"]) for s in sweep})
        for k in keys:
            cand = [s for s in sweep if (s["kv"], s["S"], s["T"]) == k]
            b = min(cand, key=lambda s: s["us"])
            chosen = next(r for r in rows if (r["kv"], r["S"], r["T"]) == k)
            print(f"  {k[0]:12} S={k[1]:6} T={k[2]:3}: best kw={b['kw']} splits={b['splits']:3} {b['us']:7.1f} us;"
                  f" launcher splits={chosen['new_splits']:3} {chosen['new_us']:7.1f} us")  # fmt: skip
    print(f"{name} ({info['date']}, commit {info['commit']} vs {BASE_COMMIT}): attention, one layer of "
          f"Qwen3.6-27B (24 q / 4 KV heads, D 256), us per call (partial + combine), graph replays")  # fmt: skip
    print(f"{'K/V':12} {'S':>6} {'T':>3} {'old us':>8} {'new us':>8} {'x':>5} {'splits o/n':>10} {'new/T1':>7}"
          f" {'rel diff':>9}")  # fmt: skip
    t1 = {}
    for r in rows:
        if r["T"] == 1:
            t1[(r["kv"], r["S"])] = r["new_us"]
        ratio = r["new_us"] / t1.get((r["kv"], r["S"]), r["new_us"])
        print(f"{r['kv']:12} {r['S']:6} {r['T']:3} {r['old_us']:8.1f} {r['new_us']:8.1f} {r['speedup']:5.2f} "
              f"{r['old_splits']:>4}/{r['new_splits']:<5} {ratio:7.2f} {r['rel_diff']:9.1e}")  # fmt: skip
    print(f"attn_verify_bench: tests exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
