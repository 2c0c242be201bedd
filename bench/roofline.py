"""Roofline of the GPU quant matmul kernels (kernels/quant_matmul.cu), run on the GPU machine.

    python bench/roofline.py            # writes $OUT/roofline.json when OUT is set
    python bench/roofline.py --quick    # small shapes: a smoke run of the script itself
    python bench/roofline.py --widths 1,16,64 --kernels v2,v1 --sweep --launch
    python bench/roofline.py --precompile-only   # build every kernel the tests and this script use, in parallel

--kernels: which kernels to time (v2 = qmv_kernel, the default; v1 = qmm_kernel, the first version).
--sweep: v2 launch shapes (m16 tiles per warp x warps per block x stages) at a few widths, per matrix.
--launch: launch overhead: 200 back-to-back calls timed with events, eager vs one CUDA-graph replay.
--precompile N: compile the kernels in N processes first (NVRTC builds one kernel at a time; CuPy's disk
cache then serves the later loads, also those of the GPU tests run after this in bench/gpu_check.sh).

1. Device copy bandwidth: a large device-to-device copy (bytes read + written), CUDA events,
   median of 20 after 3 warm-ups. 2. Streaming-read bandwidth: a kernel that only reads (16-byte loads).
3. y = x @ W^T for each storage type at Qwen3.6-27B shapes (ffn_up 5120->17408, ffn_down 17408->5120,
   output 5120->248320 for Q6_K) and widths T = 1..64: time per call (median over CUDA-graph replays of
   several calls, rotating among weight copies so the 50 MB L2 cannot hold them), achieved weight
   bandwidth, its ratio to the copy and read bandwidths (the roofline ratio), and time relative to T=1.
   x is packed once per width (pack_activations, shared by the matrices that read it), so a call is the
   matmul kernel plus, with split-K, a memset of y. Prints a compact table last.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import loader  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 23, 32, 41, 64)
SWEEP_WIDTHS = (1, 23, 41)
SWEEP_SHAPES = (("Q4_K", "ffn_up"), ("Q4_K", "ffn_down"), ("Q6_K", "ffn_down"), ("Q6_K", "output"), ("Q8_0", "ffn_up"))
SHAPES = {"ffn_up": (17408, 5120), "ffn_down": (5120, 17408), "output": (248320, 5120)}  # (out, in)
QUICK_SHAPES = {"ffn_up": (256, 512), "ffn_down": (128, 1024), "output": (384, 256)}  # --quick: a smoke run
ROTATE_BYTES = 256 * 2**20  # weight copies per config add up to at least this (L2 is 50 MB)
REPS, WARM = 20, 3
MIN_CALLS = 8  # calls per timed graph


def _median_ms(cupy, run, reps: int = REPS, warm: int = WARM) -> tuple[float, float]:
    stream = cupy.cuda.get_current_stream()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(warm + reps):
        e0.record(stream)
        run()
        e1.record(stream)
        e1.synchronize()
        if i >= warm:
            times.append(cupy.cuda.get_elapsed_time(e0, e1))
    return statistics.median(times), min(times)


def time_calls(cupy, calls) -> tuple[float, float, str]:
    """Median and best microseconds per call of `calls` (callables enqueuing GPU work), via a CUDA graph."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for c in calls:  # warm-up: compiles, sets kernel attributes, caches device properties
            c()
        stream.synchronize()
        graph, how = None, "graph"
        try:
            stream.begin_capture()
            try:
                for c in calls:
                    c()
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        except Exception as e:  # fall back to eager launches (adds launch gaps to small kernels)
            graph, how = None, f"eager ({type(e).__name__})"

        def run():
            if graph is not None:
                graph.launch(stream)
            else:
                for c in calls:
                    c()

        med, best = _median_ms(cupy, run)
    n = len(calls)
    return med * 1e3 / n, best * 1e3 / n, how


def copy_bandwidth(cupy, nbytes: int) -> float:
    rt = cupy.cuda.runtime
    a = cupy.empty(nbytes, dtype=cupy.uint8)
    b = cupy.empty(nbytes, dtype=cupy.uint8)
    a.fill(7)
    b.fill(0)
    stream = cupy.cuda.get_current_stream()

    def run():
        rt.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)

    med, _ = _median_ms(cupy, run)
    return 2 * nbytes / (med * 1e-3) / 1e9


def read_bandwidth(cupy, nbytes: int, sms: int) -> float:
    import numpy as np

    kern = loader.get_function("quant_matmul.cu", "stream_read_kernel")
    a = cupy.empty(nbytes, dtype=cupy.uint8)
    a.fill(3)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    n16 = nbytes // 16

    def run():
        kern((sms * 4,), (512,), (a, np.int64(n16), sink))

    med, _ = _median_ms(cupy, run)
    return nbytes / (med * 1e-3) / 1e9


def _compile_job(job: tuple) -> str:
    """One kernel build in a worker process (fills CuPy's on-disk kernel cache)."""
    from kernels import quant_matmul as qm

    kind, *args = job
    if kind == "v2":
        qm.qmv_function(*args)
    elif kind == "v1":
        qm.qmm_function(*args)
    else:
        qm.pack_function(*args)
    return str(job)


def compile_jobs(qm, widths, sweep: bool, kernels) -> list[tuple]:
    tiles = sorted({(t + 7) // 8 for t in widths} | {1, 3, 6, 8})
    types = (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16)
    jobs: list[tuple] = [("pack", f32, portable) for f32 in (False, True) for portable in (False, True)]
    for q in types:
        for portable in (False, True):
            for nt in tiles if not portable else (1, 3):
                if "v2" in kernels:
                    mts = (1, 2) if (sweep or portable is False) and not portable else (qm.default_m_tiles(nt),)
                    jobs += [("v2", q, nt, mt, 0, portable) for mt in mts]
                if "v1" in kernels:
                    jobs.append(("v1", q, nt, portable))
    return jobs


def precompile(jobs: list[tuple], workers: int) -> float:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    # heaviest first (many token tiles), so the pool does not end on one long build
    jobs = sorted(jobs, key=lambda j: -(j[2] if j[0] in ("v1", "v2") else 0))
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for _ in pool.map(_compile_job, jobs):
            pass
    return time.time() - t0


def launch_overhead(cupy, qm, W, packed, out, calls: int = 200) -> dict:
    """Per-call microseconds of `calls` back-to-back launches: eager (events around the Python loop) and as
    one CUDA-graph replay of the same launches."""
    stream = cupy.cuda.Stream(non_blocking=True)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    with stream:
        for _ in range(3):
            W.matmul(packed, out=out)
        stream.synchronize()
        eager = []
        for _ in range(5):
            e0.record(stream)
            for _ in range(calls):
                W.matmul(packed, out=out)
            e1.record(stream)
            e1.synchronize()
            eager.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / calls)
        replay = []
        try:
            stream.begin_capture()
            try:
                for _ in range(calls):
                    W.matmul(packed, out=out)
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            for _ in range(5):
                e0.record(stream)
                graph.launch(stream)
                e1.record(stream)
                e1.synchronize()
                replay.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / calls)
        except Exception as e:  # no graph capture here: report the eager number alone
            print(f"launch overhead: no graph replay ({type(e).__name__}: {e})", flush=True)
    graph_us = round(statistics.median(replay), 2) if replay else None
    return {"eager_us": round(statistics.median(eager), 2), "graph_us": graph_us}


def random_matrix(cupy, qm, qtype: int, shape: tuple[int, int], kernel: str = "v2"):
    """A QuantMatrix of valid random blocks (small finite fp16 scales), built on the GPU."""
    n_out, k = shape
    fp16_fields = {qm.Q8_0: (0,), qm.Q4_K: (0, 2), qm.Q6_K: (208,)}
    if qtype == qm.F16:
        raw = (cupy.random.standard_normal(n_out * k, dtype=cupy.float32) * 0.5).astype(cupy.float16).view(cupy.uint8)
    else:
        per, size = {qm.Q8_0: (32, 34), qm.Q4_K: (256, 144), qm.Q6_K: (256, 210)}[qtype]
        n_blocks = n_out * k // per
        raw = cupy.empty(n_blocks * size, dtype=cupy.uint8)
        step = 1 << 26
        for start in range(0, raw.size, step):
            stop = min(raw.size, start + step)
            raw[start:stop] = cupy.random.randint(0, 256, size=stop - start, dtype=cupy.int32).astype(cupy.uint8)
        blocks = raw.reshape(n_blocks, size)
        for off in fp16_fields[qtype]:
            scales = (cupy.random.standard_normal(n_blocks, dtype=cupy.float32) * 0.05).astype(cupy.float16)
            blocks[:, off : off + 2] = scales.view(cupy.uint8).reshape(n_blocks, 2)
    W = qm.QuantMatrix(qtype, raw, shape, kernel=kernel)
    del raw
    return W


def sweep_shapes(cupy, qm, mats, per_graph: int, tokens: int, shape_name: str) -> list[dict]:
    """Time every v2 launch shape (m16 tiles per warp, warps per block, stages; no K splits) at one width."""
    W0 = mats[0]
    n_out, k = W0.shape
    x = (cupy.random.standard_normal((tokens, k), dtype=cupy.float32) * 0.5).astype(cupy.float16)
    packed = qm.pack_activations(x)
    out = cupy.empty((tokens, n_out), dtype=cupy.float32)
    found, copies = [], len(mats)
    for mt in (1, 2):
        for kw in (1, 2, 4, 8):
            for st in (2, 3, 4):
                cfg = qm.QmvConfig(mt, kw, st, 1)
                if cfg.smem_bytes(W0.qtype, packed.n_tiles) > qm.SMEM_LIMIT or kw > max(1, W0.n_chunks() // 2):
                    continue
                calls = [
                    (lambda W=mats[i % copies], c=cfg: W.matmul(packed, out=out, config=c))  # noqa: B023
                    for i in range(per_graph)
                ]
                us, _, _ = time_calls(cupy, calls)
                found.append(
                    {"qtype": W0.type_name, "shape": shape_name, "tokens": tokens, "m_tiles": mt, "k_warps": kw,
                     "stages": st, "us": round(us, 2)}
                )  # fmt: skip
    best = min(found, key=lambda r: r["us"])
    print("sweep best:", json.dumps(best), flush=True)
    return found


def _arg(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> int:
    global REPS, WARM, MIN_CALLS, ROTATE_BYTES
    quick = "--quick" in argv
    shapes = QUICK_SHAPES if quick else SHAPES
    widths = tuple(int(w) for w in _arg(argv, "--widths", ",".join(map(str, WIDTHS))).split(","))
    kernels = tuple(_arg(argv, "--kernels", "v2").split(","))
    sweep_on = "--sweep" in argv
    if quick:
        REPS, WARM, MIN_CALLS, ROTATE_BYTES = 3, 1, 1, 1
    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"roofline: skipped: {reason}")
        return 0
    import cupy

    from kernels import quant_matmul as qm

    bad = [k for k in kernels if k not in qm.KERNELS]
    if bad:
        raise SystemExit(f"--kernels: unknown {bad} (choose from {qm.KERNELS})")
    t_start = time.time()
    workers = int(_arg(argv, "--precompile", "0") or 0)
    if "--precompile-only" in argv:
        workers = workers or 16
        kernels = tuple(qm.KERNELS)
    if workers:
        jobs = compile_jobs(qm, widths, sweep_on or "--precompile-only" in argv, kernels)
        secs = precompile(jobs, workers)
        print(f"precompiled {len(jobs)} kernels in {secs:.0f} s with {workers} processes", flush=True)
        if "--precompile-only" in argv:
            return 0

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = qm.sm_count()
    free, total = cupy.cuda.runtime.memGetInfo()
    info = {
        "device": name,
        "sm_count": sms,
        "compute_capability": dev.compute_capability,
        "memory_GiB": round(total / 2**30, 1),
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "driver": cupy.cuda.runtime.driverGetVersion(),
    }
    print("roofline:", json.dumps(info), flush=True)

    buf = 4 * 2**30 if free > 12 * 2**30 else 2**30
    if quick:
        buf = 2**24
    copy_bw = copy_bandwidth(cupy, buf)
    read_bw = read_bandwidth(cupy, buf, sms)
    cupy.get_default_memory_pool().free_all_blocks()
    print(f"copy bandwidth {copy_bw:.1f} GB/s (read+write of {buf / 2**30:.0f} GiB); "
          f"streaming read {read_bw:.1f} GB/s", flush=True)  # fmt: skip

    configs = [
        (qm.Q4_K, "ffn_up"),
        (qm.Q4_K, "ffn_down"),
        (qm.Q6_K, "ffn_up"),
        (qm.Q6_K, "ffn_down"),
        (qm.Q6_K, "output"),
        (qm.Q8_0, "ffn_up"),
        (qm.Q8_0, "ffn_down"),
        (qm.F16, "ffn_up"),
        (qm.F16, "ffn_down"),
    ]
    if "--types" in argv:
        keep = set(_arg(argv, "--types").split(","))
        configs = [c for c in configs if qm.type_name(c[0]) in keep]
    rows, sweep, pack_rows, launch_rows = [], [], [], []
    for qtype, shape_name in configs:
        shape = shapes[shape_name]
        n_out, k = shape
        probe_bytes = n_out * k * qm.bytes_per_weight(qtype)
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / probe_bytes)))
        per_graph = copies * math.ceil(MIN_CALLS / copies)
        for kernel in kernels:
            mats = [random_matrix(cupy, qm, qtype, shape, kernel) for _ in range(copies)]
            nbytes = mats[0].nbytes
            t1 = None
            for tokens in widths:
                x = (cupy.random.standard_normal((tokens, k), dtype=cupy.float32) * 0.5).astype(cupy.float16)
                packed = qm.pack_activations(x)
                out = cupy.empty((tokens, n_out), dtype=cupy.float32)
                calls = [
                    (lambda W=mats[i % copies], p=packed, o=out: W.matmul(p, out=o))  # noqa: B023
                    for i in range(per_graph)
                ]
                us, best, how = time_calls(cupy, calls)
                t1 = us if t1 is None else t1
                gbs = nbytes / (us * 1e-6) / 1e9
                cfg = mats[0].choose_config(tokens) if kernel == "v2" else None
                row = {
                    "kernel": kernel,
                    "qtype": qm.type_name(qtype),
                    "shape": shape_name,
                    "out": n_out,
                    "in": k,
                    "tokens": tokens,
                    "splits": mats[0].choose_splits(tokens),
                    "config": [cfg.m_tiles, cfg.k_warps, cfg.stages, cfg.splits] if cfg else None,
                    "us": round(us, 2),
                    "best_us": round(best, 2),
                    "weight_GBps": round(gbs, 1),
                    "roof_copy": round(gbs / copy_bw, 3),
                    "roof_read": round(gbs / read_bw, 3),
                    "x_t1": round(us / t1, 3),  # relative to the first width (T=1 by default)
                    "TFLOPs": round(2 * tokens * n_out * k / (us * 1e-6) / 1e12, 2),
                    "timing": how,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                if tokens == widths[-1] and shape_name != "output" and kernel == kernels[0]:
                    pus, _, _ = time_calls(cupy, [lambda x=x, p=packed: qm.pack_activations(x, out=p.data)] * 8)
                    pack_rows.append({"in": k, "tokens": tokens, "pack_us": round(pus, 2)})
            if "--launch" in argv and qtype == qm.Q4_K and shape_name == "ffn_up":
                x = (cupy.random.standard_normal((1, k), dtype=cupy.float32) * 0.5).astype(cupy.float16)
                packed = qm.pack_activations(x)
                out = cupy.empty((1, n_out), dtype=cupy.float32)
                lo = {"kernel": kernel, "matrix": f"{qm.type_name(qtype)} {shape_name}", "tokens": 1}
                lo.update(launch_overhead(cupy, qm, mats[0], packed, out, calls=4 if quick else 200))
                launch_rows.append(lo)
                print(json.dumps(lo), flush=True)
            if sweep_on and kernel == "v2" and (qm.type_name(qtype), shape_name) in SWEEP_SHAPES:
                for tokens in SWEEP_WIDTHS if not quick else widths[:2]:
                    sweep += sweep_shapes(cupy, qm, mats, per_graph, tokens, shape_name)
            del mats
            cupy.get_default_memory_pool().free_all_blocks()

    result = {
        **info,
        "copy_GBps": round(copy_bw, 1),
        "read_GBps": round(read_bw, 1),
        "rows": rows,
        "sweep": sweep,
        "launch": launch_rows,
        "pack": pack_rows,
        "seconds": round(time.time() - t_start, 1),
    }
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "roofline.json").write_text(json.dumps(result, indent=1))

    print()
    print(f"{name}: copy {copy_bw:.0f} GB/s, streaming read {read_bw:.0f} GB/s; "
          f"roof = weight bytes per second / copy bandwidth")  # fmt: skip
    if sweep:
        print("v2 launch-shape sweep, best (m_tiles, k_warps, stages) per matrix and width, us (auto-chosen us):")
        for qt, sn in SWEEP_SHAPES:
            for tokens in sorted({r["tokens"] for r in sweep}):
                sel = [r for r in sweep if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens]
                if not sel:
                    continue
                auto = [r for r in rows if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens
                        and r["kernel"] == "v2"]  # fmt: skip
                top = sorted(sel, key=lambda r: r["us"])[:3]
                print(f"  {qt} {sn} T={tokens}: " + ", ".join(
                    f"({r['m_tiles']},{r['k_warps']},{r['stages']}) {r['us']:.1f}" for r in top)
                    + (f"; auto {auto[0]['config']} {auto[0]['us']:.1f}" if auto else ""))  # fmt: skip
    for lo in launch_rows:
        print(f"launch overhead {lo['kernel']} {lo['matrix']} T=1: eager {lo['eager_us']:.1f} us/call, "
              f"graph replay {lo['graph_us']} us/call")  # fmt: skip
    if pack_rows:
        packs = ", ".join(f"in={p['in']}: {p['pack_us']:.1f}" for p in pack_rows)
        print(f"pack_activations T={widths[-1]} (us): {packs}")
    print(f"{'kern':4} {'type':5} {'shape':8} {'out x in':>12} " + " ".join(f"{'T=' + str(t):>7}" for t in widths))
    for kernel in kernels:
        for qtype, shape_name in configs:
            sel = [r for r in rows if r["qtype"] == qm.type_name(qtype) and r["shape"] == shape_name
                   and r["kernel"] == kernel]  # fmt: skip
            if not sel:
                continue
            dims = f"{sel[0]['out']}x{sel[0]['in']}"
            head_ = f"{kernel:4} {sel[0]['qtype']:5} {shape_name:8} {dims:>12} "
            print(head_ + " ".join(f"{r['us']:7.1f}" for r in sel) + "  us")
            print(" " * len(head_) + " ".join(f"{r['roof_copy']:7.2f}" for r in sel) + "  roof (vs copy)")
            print(" " * len(head_) + " ".join(f"{r['x_t1']:7.2f}" for r in sel) + "  x T=1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
