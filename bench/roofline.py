"""Roofline of the GPU quant matmul kernels (kernels/quant_matmul.cu, kernels/quant_gemv.cu), run on the GPU machine.

    python bench/roofline.py            # writes $OUT/roofline.json when OUT is set
    python bench/roofline.py --quick    # small shapes: a smoke run of the script itself
    python bench/roofline.py --widths 1,16,64 --kernels v2,v1 --sweep --launch
    python bench/roofline.py --precompile-only   # build every kernel the tests and this script use, in parallel
    python bench/roofline.py --precompile-only --kernels gemv,v2 --widths 1,2   # only what that run needs

--kernels: which kernels to time (v2 = qmv_kernel, the default; v1 = qmm_kernel, the first version; gemv =
gemv_kernel of quant_gemv.cu on the v2 layout, one block per 16-row tile, widths <= 16, and with it gemvp = its
persistent variant gemv_persist_kernel (quantized types; also selectable alone); wide = qmw_kernel (kernels/
quant_wide.py: x staged once per block for many row tiles, stream-K; any width <= 64); auto = QuantMatrix.matmul's
own choice per width). With gemv / gemvp / wide / auto and v2 listed, a table of their time ratios to v2 in the same
run follows
(and gemvp / gemv when both ran).
--gemv-sweep: gemv warps per block (k_warps 1..8) at T = 1, 2, 4, 8, per matrix.
--persist-sweep: gemvp launch shapes (k_warps 2, 4, 8 x blocks per SM 1, 2, all that fit x prefetch depth 1, 2) at
T = 1, 2 on the Q4_K / Q6_K / Q8_0 ffn matrices, next to the per-tile kernel's time.
--split-sweep: the split-K gemv (gemv_splitk_kernel) at splits 2, 3, 4, 6, 8 x k_warps 1, 2, 4 at T = 1, 2 on the 27B
matrices of few row tiles (ssm_out / attn_output 5120x6144, ffn_down 5120x17408, attn_v 1024x5120), next to the
per-tile kernel (splits=1) and the automatic choice (quant_gemv.choose_split). `--types none` skips the main table.
--step-ab MODEL.gguf: load the model (bench/gpu_bench.load_gpu_model), commit --context tokens (512), then capture and
replay the width-1 decode step with the split-K dispatch off and under several choose_split knob settings (median
of 30 replays each; "off" first and last, to see drift).
--wide-step MODEL.gguf: load the model, commit --context tokens (512), then per verify width (--step-widths, default
1,16,23,32,41,48,64; trees shaped as bench/step_profile.py's) capture and replay the step with the wide kernel's
dispatch off (v2 above gemv's widths) and on (median of 20 replays each): issue 5's step ratios.
--sweep: v2 launch shapes (m16 tiles per warp x warps per block x stages) at a few widths, per matrix.
--wide-sweep: wide launch shapes (m16 tiles per warp 1, 2 x warps per block 4, 8 x stages 2, 3, 4 x blocks per SM 1,
2, all that fit) at T = 16, 23, 32, 41, 64 on the 27B matrices (WIDE_SWEEP_SHAPES), next to the default shape.
With gemv and wide timed, a last table gives each matrix's wide time at 16, 23, 41, 64 tokens over the gemv time at
T=1 (issue 5's targets: T=23 <= 1.15x, T=41 <= 1.4x, T=64 <= 2x), with v2's and the best swept shape's beside it.
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
GEMV_TEST_WIDTHS = tuple(range(1, 17))  # tests/test_kernels_quant_gemv.py builds every width
GEMV_PORTABLE_WIDTHS = (1, 3)
GEMV_SWEEP_WIDTHS = (1, 2, 4, 8)
PERSIST_SWEEP_WIDTHS = (1, 2)
PERSIST_SWEEP_SHAPES = (("Q4_K", "ffn_up"), ("Q4_K", "ffn_down"), ("Q6_K", "ffn_up"), ("Q6_K", "ffn_down"),
                        ("Q8_0", "ffn_up"), ("Q8_0", "ffn_down"))  # fmt: skip
PERSIST_TEST_WIDTHS = (1, 2, 5)  # tests/test_kernels_quant_gemv.py's persistent cases (prefetch 1 and 2)
GEMV_SWEEP_SHAPES = (("Q4_K", "ffn_up"), ("Q4_K", "ffn_down"), ("Q6_K", "ffn_up"), ("Q6_K", "ffn_down"),
                     ("Q6_K", "output"), ("Q8_0", "ffn_up"), ("Q8_0", "ffn_down"))  # fmt: skip
SPLIT_SWEEP_SHAPES = (("Q4_K", "ssm_out"), ("Q6_K", "ssm_out"), ("Q4_K", "ffn_down"), ("Q6_K", "ffn_down"),
                      ("Q8_0", "ffn_down"), ("Q6_K", "attn_v"), ("Q4_K", "attn_v"), ("F16", "attn_v"))  # fmt: skip
SPLIT_SWEEP_WIDTHS = (1, 2)
SPLIT_TEST_WIDTHS = (1, 2, 5)  # tests/test_kernels_quant_gemv.py's split-K cases
SPLIT_PORTABLE_WIDTHS = (1, 2)
SWEEP_WIDTHS = (1, 23, 41)
WIDE_TEST_TILES = tuple(range(1, 9))  # tests/test_kernels_quant_wide.py runs every token-tile count
WIDE_PORTABLE_TILES = (2, 3)
WIDE_SWEEP_WIDTHS = (16, 23, 32, 41, 64)
WIDE_SWEEP_SHAPES = (("Q4_K", "ffn_up"), ("Q4_K", "ffn_down"), ("Q4_K", "ssm_out"), ("Q6_K", "ffn_up"),
                     ("Q6_K", "ffn_down"), ("Q6_K", "output"), ("Q6_K", "ssm_out"), ("Q8_0", "ffn_up"),
                     ("Q8_0", "ffn_down"), ("F16", "ffn_up"), ("F16", "ffn_down"))  # fmt: skip
WIDE_TARGETS = {23: 1.15, 41: 1.4, 64: 2.0}  # issue 5: wide time / gemv time at T=1, per matrix
SWEEP_SHAPES = (("Q4_K", "ffn_up"), ("Q4_K", "ffn_down"), ("Q6_K", "ffn_down"), ("Q6_K", "output"), ("Q8_0", "ffn_up"))
SHAPES = {"ffn_up": (17408, 5120), "ffn_down": (5120, 17408), "output": (248320, 5120), "ssm_out": (5120, 6144),
          "attn_v": (1024, 5120)}  # (out, in)
QUICK_SHAPES = {"ffn_up": (256, 512), "ffn_down": (128, 1024), "output": (384, 256), "ssm_out": (96, 1536),
                "attn_v": (64, 1280)}  # --quick: a smoke run
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
    if kind == "gemv":
        from kernels import quant_gemv

        quant_gemv.gemv_function(*args)
    elif kind == "gemvp":
        from kernels import quant_gemv

        quant_gemv.persist_function(*args)
    elif kind == "gemvs":
        from kernels import quant_gemv

        quant_gemv.split_function(*args)
    elif kind == "v2":
        qm.qmv_function(*args)
    elif kind == "wide":
        from kernels import quant_wide

        quant_wide.wide_function(*args)
    elif kind == "v1":
        qm.qmm_function(*args)
    else:
        qm.pack_function(*args)
    return str(job)


def compile_jobs(qm, widths, sweep: bool, kernels, full: bool = True) -> list[tuple]:
    """Kernel builds for this run; full: also what tests/test_kernels_quant_matmul.py uses (tiles 1, 3, 6, 8 and
    the portable builds), for every storage type the GPU tests take (the newer ones too: the suite would otherwise
    build theirs one at a time mid-test)."""
    tiles = sorted({(t + 7) // 8 for t in widths} | ({1, 3, 6, 8} if full else set()))
    types = (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16)
    if full:
        types += (qm.Q5_K, qm.IQ4_XS, qm.Q3_K, qm.Q4_0, qm.IQ4_NL)
    jobs: list[tuple] = [("pack", f32, portable) for f32 in (False, True) for portable in (False, True)]
    for q in types:
        for portable in (False, True) if full else (False,):
            for nt in tiles if not portable else (1, 3):
                if "v2" in kernels:
                    mts = (1, 2) if (sweep or portable is False) and not portable else (qm.default_m_tiles(nt),)
                    jobs += [("v2", q, nt, mt, 0, portable) for mt in mts]
                if "v1" in kernels and q in qm.V1_QTYPES:
                    jobs.append(("v1", q, nt, portable))
        if any(k.startswith("gemv") or k == "auto" for k in kernels):
            from kernels import quant_gemv

            gw = sorted({t for t in widths if t <= quant_gemv.MAX_TOKENS} | set(GEMV_TEST_WIDTHS))
            jobs += [("gemv", q, t, False) for t in gw]
            jobs += [("gemv", q, t, True) for t in GEMV_PORTABLE_WIDTHS]
            if q in quant_gemv.PERSISTENT_TYPES:
                pw = sorted({t for t in widths if t <= 2} | set(PERSIST_TEST_WIDTHS))
                jobs += [("gemvp", q, t, pd, False) for t in pw for pd in (1, 2)]
            sw = sorted({t for t in widths if t <= 2} | set(SPLIT_TEST_WIDTHS))
            jobs += [("gemvs", q, t, False) for t in sw]
            jobs += [("gemvs", q, t, True) for t in SPLIT_PORTABLE_WIDTHS]
        if "wide" in kernels or "auto" in kernels or (full and "v2" in kernels):  # matmul() dispatches to it
            from kernels import quant_wide

            wt = sorted({(t + 7) // 8 for t in widths} | (set(WIDE_TEST_TILES) if full else set()))
            mts = (1, 2) if sweep else (quant_wide.M_TILES,)
            jobs += [("wide", q, nt, mt, False) for nt in wt for mt in mts]
            if full:
                jobs += [("wide", q, nt, 2, True) for nt in WIDE_PORTABLE_TILES]
    return jobs


def precompile(jobs: list[tuple], workers: int) -> float:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    # heaviest first (many token tiles), so the pool does not end on one long build
    jobs = sorted(jobs, key=lambda j: -(j[2] if j[0] in ("v1", "v2", "gemv", "gemvp", "gemvs", "wide") else 0))
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for _ in pool.map(_compile_job, jobs):
            pass
    return time.time() - t0


def launch_overhead(cupy, qm, W, packed, out, calls: int = 200, **how) -> dict:
    """Per-call microseconds of `calls` back-to-back launches: eager (events around the Python loop) and as
    one CUDA-graph replay of the same launches."""
    stream = cupy.cuda.Stream(non_blocking=True)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    with stream:
        for _ in range(3):
            W.matmul(packed, out=out, **how)
        stream.synchronize()
        eager = []
        for _ in range(5):
            e0.record(stream)
            for _ in range(calls):
                W.matmul(packed, out=out, **how)
            e1.record(stream)
            e1.synchronize()
            eager.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / calls)
        replay = []
        try:
            stream.begin_capture()
            try:
                for _ in range(calls):
                    W.matmul(packed, out=out, **how)
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
    fp16_fields = {qm.Q8_0: (0,), qm.Q4_K: (0, 2), qm.Q5_K: (0, 2), qm.Q6_K: (208,), qm.IQ4_XS: (0,), qm.Q3_K: (108,),
                   qm.Q4_0: (0,), qm.IQ4_NL: (0,)}
    if qtype == qm.F16:
        raw = (cupy.random.standard_normal(n_out * k, dtype=cupy.float32) * 0.5).astype(cupy.float16).view(cupy.uint8)
    else:
        per, size = qm.block_geometry(qtype)
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


def random_io(cupy, qm, tokens: int, n_out: int, k: int) -> tuple:
    """(packed random fp16 x of `tokens` rows, an fp32 output [tokens, n_out]) for timing products."""
    x = (cupy.random.standard_normal((tokens, k), dtype=cupy.float32) * 0.5).astype(cupy.float16)
    return qm.pack_activations(x), cupy.empty((tokens, n_out), dtype=cupy.float32)


def sweep_shapes(cupy, qm, mats, per_graph: int, tokens: int, shape_name: str) -> list[dict]:
    """Time every v2 launch shape (m16 tiles per warp, warps per block, stages; no K splits) at one width."""
    W0 = mats[0]
    n_out, k = W0.shape
    packed, out = random_io(cupy, qm, tokens, n_out, k)
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


def matmul_kwargs(qg, kernel: str) -> dict:
    """QuantMatrix.matmul arguments that run `kernel` (a --kernels name)."""
    if kernel == "auto":
        return {}
    if kernel in ("gemv", "gemvp"):
        return {"kernel": "gemv", "config": qg.GemvConfig(persistent=kernel == "gemvp")}
    return {"kernel": kernel}


def gemv_runs(qg, qtype: int, k: int, tokens: int, persistent: bool = False) -> bool:
    """Whether the gemv kernel (or its persistent variant) takes this width (<= 16 tokens, staged x within shared
    memory; the persistent one quantized types only)."""
    if persistent and qtype not in qg.PERSISTENT_TYPES:
        return False
    smem = qg.smem_bytes(qtype, k, tokens, qg.MAX_K_WARPS, persistent)
    return tokens <= qg.MAX_TOKENS and smem <= qg.SMEM_LIMIT


def wide_launch(qw, W, tokens: int, cfg=None) -> list:
    """What a wide launch of W at this width runs as: [m_tiles, warps, stages, grid, registers]."""
    shape = qw.launch_shape(W, tokens, cfg)
    c = shape["config"]
    return [c.m_tiles, c.warps, c.stages, shape["blocks"], shape["regs"]]


def sweep_wide(cupy, qm, qw, mats, per_graph: int, tokens: int, shape_name: str) -> list[dict]:
    """Time the wide kernel's launch shapes at one width: m16 tiles per warp x warps per block x stages x blocks per
    SM (shapes that resolve to the same launch are timed once; the default shape is marked)."""
    W0 = mats[0]
    n_out, k = W0.shape
    packed, out = random_io(cupy, qm, tokens, n_out, k)
    copies = len(mats)
    default = tuple(wide_launch(qw, W0, tokens)[:4])
    found, seen = [], set()
    for mt in (1, 2):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                for bps in (1, 2, 0):  # 0: all that fit (registers, shared memory)
                    cfg = qw.WideConfig(mt, warps, stages, blocks_per_sm=bps)
                    full = qw.choose_config(W0.qtype, n_out, k, tokens, cfg)
                    if qw.smem_bytes(W0.qtype, packed.n_tiles, mt, warps, stages) > qw.SMEM_LIMIT or full != cfg:
                        continue
                    launch = wide_launch(qw, W0, tokens, cfg)
                    key = tuple(launch[:4])
                    if key in seen:
                        continue
                    seen.add(key)
                    calls = [
                        (lambda W=mats[i % copies], c=cfg: W.matmul(packed, out=out, kernel="wide", config=c))  # noqa: B023
                        for i in range(per_graph)
                    ]
                    us, _, _ = time_calls(cupy, calls)
                    found.append({"qtype": W0.type_name, "shape": shape_name, "tokens": tokens, "m_tiles": mt,
                                  "warps": warps, "stages": stages, "blocks_per_sm": bps, "grid": launch[3],
                                  "regs": launch[4], "default": key == default, "us": round(us, 2)})  # fmt: skip
    if found:
        best = min(found, key=lambda r: r["us"])
        print("wide sweep best:", json.dumps(best), flush=True)
    return found


def gemv_launch(qm, qg, W, tokens: int, persistent: bool, cfg=None) -> list:
    """What a gemv launch of W at this width runs as: [k_warps, registers] (+ [grid, prefetch] when persistent,
    + [splits] when the split-K kernel runs)."""
    cfg = cfg or qg.GemvConfig()
    n_out, k = W.shape
    kw = cfg.k_warps or qg.choose_k_warps(W.qtype, n_out, k, tokens, qm.sm_count())
    if not persistent:
        splits, skw = cfg.splits, cfg.k_warps
        if splits == 0 and cfg.k_warps == 0:
            splits, skw = qg.auto_split(W.qtype, n_out, k, tokens)
        if splits > 1:
            return [skw or 4, int(getattr(qg.split_function(W.qtype, tokens), "num_regs", 0) or 0), splits]
        return [kw, int(getattr(qg.gemv_function(W.qtype, tokens), "num_regs", 0) or 0)]
    pd = cfg.prefetch or qg.PREFETCH
    kern = qg.persist_function(W.qtype, tokens, pd)
    regs = int(getattr(kern, "num_regs", 0) or 255)
    smem = qg.smem_bytes(W.qtype, k, tokens, kw, True)
    return [kw, regs, qg.persist_grid(n_out, kw, smem, regs, qm.sm_count(), cfg.blocks_per_sm), pd]


def sweep_persist(cupy, qm, qg, mats, per_graph: int, tokens: int, shape_name: str) -> list[dict]:
    """Time the persistent gemv at k_warps 2 / 4 / 8 x blocks per SM 1 / 2 / all x prefetch 1 / 2 at one width (launch
    shapes that come out the same grid are timed once), and the per-tile kernel at its own k_warps for reference."""
    W0 = mats[0]
    n_out, k = W0.shape
    packed, out = random_io(cupy, qm, tokens, n_out, k)
    copies = len(mats)

    def timed(cfg) -> float:
        calls = [
            (lambda W=mats[i % copies], c=cfg: W.matmul(packed, out=out, kernel="gemv", config=c))  # noqa: B023
            for i in range(per_graph)
        ]
        return time_calls(cupy, calls)[0]

    tile_us = timed(qg.GemvConfig(persistent=False))
    found, seen = [], set()
    for pd in (1, 2):
        for kw in (2, 4, 8):
            if qg.smem_bytes(W0.qtype, k, tokens, kw, True) > qg.SMEM_LIMIT or kw > W0.n_chunks():
                continue
            for bps in (1, 2, 0):
                cfg = qg.GemvConfig(k_warps=kw, persistent=True, blocks_per_sm=bps, prefetch=pd)
                launch = gemv_launch(qm, qg, W0, tokens, True, cfg)
                if (kw, pd, launch[2]) in seen:
                    continue
                seen.add((kw, pd, launch[2]))
                us = timed(cfg)
                found.append({"qtype": W0.type_name, "shape": shape_name, "tokens": tokens, "k_warps": kw,
                              "blocks_per_sm": bps, "prefetch": pd, "grid": launch[2], "regs": launch[1],
                              "us": round(us, 2), "per_tile_us": round(tile_us, 2)})  # fmt: skip
    if found:
        best = min(found, key=lambda r: r["us"])
        print("persist sweep best:", json.dumps(best), flush=True)
    return found


def sweep_gemv(cupy, qm, qg, mats, per_graph: int, tokens: int, shape_name: str) -> list[dict]:
    """Time the gemv kernel at every k_warps (1..8) at one width; the row marked auto is choose_k_warps'."""
    W0 = mats[0]
    n_out, k = W0.shape
    packed, out = random_io(cupy, qm, tokens, n_out, k)
    copies = len(mats)
    found = []
    regs = int(getattr(qg.gemv_function(W0.qtype, tokens), "num_regs", 0) or 0)
    auto = qg.choose_k_warps(W0.qtype, n_out, k, tokens, qm.sm_count())
    for kw in range(1, qg.MAX_K_WARPS + 1):
        if qg.smem_bytes(W0.qtype, k, tokens, kw) > qg.SMEM_LIMIT or kw > W0.n_chunks():
            continue
        cfg = qg.GemvConfig(k_warps=kw)
        calls = [
            (lambda W=mats[i % copies], c=cfg: W.matmul(packed, out=out, kernel="gemv", config=c))  # noqa: B023
            for i in range(per_graph)
        ]
        us, _, _ = time_calls(cupy, calls)
        found.append({"qtype": W0.type_name, "shape": shape_name, "tokens": tokens, "k_warps": kw, "auto": kw == auto,
                      "regs": regs, "us": round(us, 2)})  # fmt: skip
    best = min(found, key=lambda r: r["us"])
    print("gemv sweep best:", json.dumps(best), "auto:", json.dumps([r for r in found if r["auto"]]), flush=True)
    return found


def sweep_split(cupy, qm, qg, qtype: int, shape_name: str, shape: tuple[int, int], copy_bw: float,
                quick: bool) -> list[dict]:
    """Time the split-K gemv over (splits, k_warps) at T = 1, 2 on one matrix, next to the per-tile kernel (splits=1,
    its own k_warps) and the automatic choice; rows carry us and the roof ratio (weight bytes / copy bandwidth)."""
    n_out, k = shape
    probe_bytes = n_out * k * qm.bytes_per_weight(qtype)
    copies = max(1, min(8, math.ceil(ROTATE_BYTES / probe_bytes)))
    per_graph = copies * math.ceil(MIN_CALLS / copies)
    mats = [random_matrix(cupy, qm, qtype, shape) for _ in range(copies)]
    nch = mats[0].n_chunks()
    found = []
    for tokens in SPLIT_SWEEP_WIDTHS if not quick else (1,):
        packed, out = random_io(cupy, qm, tokens, n_out, k)

        def timed(cfg) -> float:
            calls = [
                (lambda W=mats[i % copies], c=cfg: W.matmul(packed, out=out, kernel="gemv", config=c))  # noqa: B023
                for i in range(per_graph)
            ]
            return time_calls(cupy, calls)[0]

        auto = qg.auto_split(qtype, n_out, k, tokens)
        cfgs = [("tile", qg.GemvConfig(splits=1)), ("auto", qg.GemvConfig())]
        for splits in (2, 3, 4, 6, 8):
            for kw in (1, 2, 4):
                if splits * kw <= 2 * nch:
                    cfgs.append((f"{splits}x{kw}", qg.GemvConfig(k_warps=kw, splits=splits)))
        for label, cfg in cfgs:
            us = timed(cfg)
            gbs = mats[0].nbytes / (us * 1e-6) / 1e9
            found.append({"qtype": qm.type_name(qtype), "shape": shape_name, "out": n_out, "in": k, "tokens": tokens,
                          "config": label, "auto": list(auto), "us": round(us, 2),
                          "roof_copy": round(gbs / copy_bw, 3)})  # fmt: skip
        sel = [r for r in found if r["tokens"] == tokens]
        best = min(sel, key=lambda r: r["us"])
        print(f"split sweep {qm.type_name(qtype)} {shape_name} T={tokens}: tile {sel[0]['us']:.1f}, auto {auto} "
              f"{sel[1]['us']:.1f}, best {best['config']} {best['us']:.1f}", flush=True)  # fmt: skip
    mats.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    return found


# quant_gemv knob settings of --step-ab: "off" (per-tile kernel everywhere, first and last: drift), the rule at T=1
# for the quantized types, and the settings of the first H100 run (docs/gpu_quant_matmul.md, "gemv: split-K").
_ON = {"SPLIT_UP_TO": {8: 1, 12: 1, 14: 1}}
STEP_AB_PRESETS = (
    ("off", {"SPLIT_UP_TO": {}}),
    ("rule", _ON),
    ("every few-tile matrix", {**_ON, "SPLIT_MIN_TILE_CHUNKS": 0, "SPLIT_MIN_CHUNKS": 2}),
    ("few-tile, kw 4", {**_ON, "SPLIT_MIN_TILE_CHUNKS": 0, "SPLIT_MIN_CHUNKS": 2, "SPLIT_WARPS": (4,)}),
    ("attn_v only", {**_ON, "SPLIT_MIN_TILE_CHUNKS": 10**6}),
    ("off", {"SPLIT_UP_TO": {}}),
)


def step_ab(cupy, qg, path: str, context: int) -> list[dict]:
    """Width-1 decode step of a model, captured and replayed under each STEP_AB_PRESETS setting of quant_gemv's
    split-K knobs (median us of 30 event-timed replays)."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bench import load_gpu_model

    t0 = time.time()
    model, _, _ = load_gpu_model(path)
    print(f"step-ab: loaded {path} in {time.time() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    state = model.new_state(context + 64)
    ids = rng.integers(0, model.cfg.n_vocab, size=context)
    model.forward(state, ids, logits="none")
    state.commit(list(range(len(ids))))
    tok = [int(rng.integers(0, model.cfg.n_vocab))]
    names = ("SPLIT_UP_TO", "SPLIT_WARPS", "SPLIT_WAVES", "SPLIT_FILL", "SPLIT_MIN_CHUNKS", "SPLIT_MIN_TILE_CHUNKS")
    saved = {n: getattr(qg, n) for n in names}
    rows = []
    try:
        for label, knobs in STEP_AB_PRESETS:
            for n in names:
                setattr(qg, n, knobs.get(n, saved[n]))
            model.use_graphs = True
            state.graphs.clear()
            for _ in range(2):  # warm-up + capture
                model.forward(state, tok, parents=None, checkpoints=False, logits="all")
                state.pending = None
            g = next(iter(state.graphs.values()), None)
            if g is None:
                rows.append({"preset": label, "error": str(model.graph_blocker)})
                print(f"step-ab {label}: no graph ({model.graph_blocker})", flush=True)
                continue
            stream = cupy.cuda.get_current_stream()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            times = []
            for _ in range(32):
                stream.synchronize()
                e0.record(stream)
                g.graph.launch(stream)
                e1.record(stream)
                e1.synchronize()
                times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3)
            us = statistics.median(times[2:])
            chosen = {key: v for key, v in ((f"{k[0]}:{k[1]}x{k[2]}", v) for k, v in qg._auto_split.items()
                      if k[3] == 1 and k[6:] == (qg.SPLIT_FILL, qg.SPLIT_WARPS, qg.SPLIT_MIN_CHUNKS, qg.SPLIT_WAVES,
                                                 qg.SPLIT_UP_TO.get(k[0], 0), qg.SPLIT_MIN_TILE_CHUNKS))}  # fmt: skip
            rows.append({"preset": label, "knobs": {k: str(v) for k, v in knobs.items()}, "replay_us": round(us, 1),
                         "min_us": round(min(times[2:]), 1), "chosen": {k: list(v) for k, v in chosen.items()}})
            print(f"step-ab {label}: replay {us:.1f} us (min {min(times[2:]):.1f}); splits {chosen}", flush=True)
    finally:
        for n in names:
            setattr(qg, n, saved[n])
    return rows


def step_wide(cupy, qw, path: str, context: int, widths: tuple[int, ...]) -> list[dict]:
    """The model's step at each width (a decode step at 1, a verify tree above), captured and replayed with the wide
    dispatch off (CROSSOVER past 64: v2) and on (as shipped); median us of 20 event-timed replays."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bench import load_gpu_model
    from step_profile import replay_us, tree_parents

    t0 = time.time()
    model, _, _ = load_gpu_model(path)
    print(f"wide-step: loaded {path} in {time.time() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)
    state = model.new_state(context + 2 * max(widths) + 8)
    ids = rng.integers(0, model.cfg.n_vocab, size=context)
    model.forward(state, ids, logits="none")
    state.commit(list(range(len(ids))))
    shipped = dict(qw.CROSSOVER)
    rows = []
    try:
        for w in widths:
            toks = [int(t) for t in rng.integers(0, model.cfg.n_vocab, size=w)]
            par = tree_parents(w) if w > 1 else None
            kw = dict(parents=par, checkpoints=par is not None, logits="all")
            row = {"width": w}
            for label, table in (("off", {q: qw.MAX_TOKENS + 1 for q in shipped}), ("on", shipped)):
                if w == 1 and label == "on":
                    continue  # gemv's width either way
                qw.CROSSOVER.clear()
                qw.CROSSOVER.update(table)
                model.use_graphs = True
                state.graphs.clear()
                for _ in range(2):  # warm-up + capture
                    model.forward(state, toks, **kw)
                    state.pending = None
                g = next(iter(state.graphs.values()), None)
                if g is None:
                    row[label] = None
                    row["error"] = str(model.graph_blocker)
                    continue
                row[label] = round(replay_us(cupy, g.graph), 1)
            rows.append(row)
            print(f"wide-step width {w}: v2 {row.get('off')} us, wide {row.get('on')} us", flush=True)
    finally:
        qw.CROSSOVER.clear()
        qw.CROSSOVER.update(shipped)
        state.graphs.clear()
    return rows


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

    known = (*qm.KERNELS, "gemv", "gemvp", "wide", "auto")
    bad = [k for k in kernels if k not in known]
    if bad:
        raise SystemExit(f"--kernels: unknown {bad} (choose from {known})")
    if "gemv" in kernels and "gemvp" not in kernels:  # the per-tile kernel shows with its persistent variant
        i = kernels.index("gemv")
        kernels = (*kernels[: i + 1], "gemvp", *kernels[i + 1 :])
    t_start = time.time()
    workers = int(_arg(argv, "--precompile", "0") or 0)
    full = "--precompile-only" in argv
    if "--precompile-only" in argv:
        workers = workers or 16
        if "--kernels" in argv:  # just what a run with these kernels and widths needs (and the gemv tests)
            full = False
        else:
            kernels = (*qm.KERNELS, "gemv", "gemvp", "wide")
    if workers:
        jobs = compile_jobs(qm, widths, sweep_on or full, kernels, full)
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
        (qm.Q4_K, "ssm_out"),
        (qm.Q6_K, "ssm_out"),
        (qm.Q4_K, "attn_v"),  # deep (k >= 2 n_out) and small: the wide kernel's DEEP_CROSSOVER applies
        (qm.Q6_K, "attn_v"),
        (qm.Q5_K, "ffn_up"),  # a Q5_K_M file's (and IQ4_XS's): Q4_K's dispatch since session 40
        (qm.Q5_K, "ffn_down"),
        (qm.Q5_K, "ssm_out"),
        (qm.IQ4_XS, "ffn_up"),
        (qm.IQ4_XS, "ffn_down"),
        (qm.IQ4_XS, "ssm_out"),
        (qm.Q3_K, "ffn_up"),  # a Q3_K_M file's (session 41)
        (qm.Q3_K, "ffn_down"),
        (qm.Q3_K, "ssm_out"),
        (qm.Q4_0, "ffn_up"),  # a Q4_0 / IQ4_NL file's (session 41)
        (qm.Q4_0, "ffn_down"),
        (qm.Q4_0, "ssm_out"),
        (qm.IQ4_NL, "ffn_up"),
        (qm.IQ4_NL, "ffn_down"),
        (qm.IQ4_NL, "ssm_out"),
    ]
    if "--types" in argv:
        keep = set(_arg(argv, "--types").split(","))
        configs = [c for c in configs if qm.type_name(c[0]) in keep]
    from kernels import quant_gemv as qg
    from kernels import quant_wide as qw

    rows, sweep, pack_rows, launch_rows, gsweep, psweep, wsweep = [], [], [], [], [], [], []
    for qtype, shape_name in configs:
        shape = shapes[shape_name]
        n_out, k = shape
        probe_bytes = n_out * k * qm.bytes_per_weight(qtype)
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / probe_bytes)))
        per_graph = copies * math.ceil(MIN_CALLS / copies)
        layouts: dict[str, list] = {}  # gemv, v2 and auto share the v2 layout: one set of copies
        for kernel in kernels:
            if kernel == "v1" and qtype not in qm.V1_QTYPES:
                continue  # (v2's layout only: Q5_K, IQ4_XS, Q3_K)
            layout = "v1" if kernel == "v1" else "v2"
            if layout not in layouts:
                layouts.clear()
                cupy.get_default_memory_pool().free_all_blocks()
                layouts[layout] = [random_matrix(cupy, qm, qtype, shape, layout) for _ in range(copies)]
            mats = layouts[layout]
            nbytes = mats[0].nbytes
            how_kw = matmul_kwargs(qg, kernel)
            t1 = None
            for tokens in widths:
                if kernel.startswith("gemv") and not gemv_runs(qg, qtype, k, tokens, kernel == "gemvp"):
                    continue  # wider than the kernel takes, x does not fit in shared memory, or F16 (gemvp)
                x = (cupy.random.standard_normal((tokens, k), dtype=cupy.float32) * 0.5).astype(cupy.float16)
                packed = qm.pack_activations(x)  # (x is timed below: the pack itself)
                out = cupy.empty((tokens, n_out), dtype=cupy.float32)
                calls = [
                    (lambda W=mats[i % copies], p=packed, o=out: W.matmul(p, out=o, **how_kw))  # noqa: B023
                    for i in range(per_graph)
                ]
                us, best, how = time_calls(cupy, calls)
                t1 = us if t1 is None else t1
                gbs = nbytes / (us * 1e-6) / 1e9
                ran = kernel
                if kernel == "auto":
                    ran = "wide" if qw.prefer_wide(qtype, tokens, n_out, k) else "v2"
                    ran = "gemv" if qg.prefer_gemv(qtype, k, tokens, tokens <= qm.Q16_TOKENS) else ran
                    if ran == "gemv" and qg.prefer_persistent(qtype, tokens):
                        ran = "gemvp"
                cfg = mats[0].choose_config(tokens) if ran == "v2" else None
                if ran in ("gemv", "gemvp"):
                    config = gemv_launch(qm, qg, mats[0], tokens, ran == "gemvp")
                elif ran == "wide":
                    config = wide_launch(qw, mats[0], tokens)
                else:
                    config = [cfg.m_tiles, cfg.k_warps, cfg.stages, cfg.splits] if cfg else None
                row = {
                    "kernel": kernel,
                    "ran": ran,
                    "qtype": qm.type_name(qtype),
                    "shape": shape_name,
                    "out": n_out,
                    "in": k,
                    "tokens": tokens,
                    "splits": mats[0].choose_splits(tokens) if ran in ("v1", "v2") else 1,
                    # v2: (m_tiles, k_warps, stages, splits); gemv: (k_warps, registers); gemvp: + (grid, prefetch)
                    "config": config,
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
                lo.update(launch_overhead(cupy, qm, mats[0], packed, out, calls=4 if quick else 200, **how_kw))
                launch_rows.append(lo)
                print(json.dumps(lo), flush=True)
            if "--wide-sweep" in argv and kernel == "wide" and (qm.type_name(qtype), shape_name) in WIDE_SWEEP_SHAPES:
                for tokens in WIDE_SWEEP_WIDTHS if not quick else widths[-2:]:
                    wsweep += sweep_wide(cupy, qm, qw, mats, per_graph, tokens, shape_name)
            if sweep_on and kernel == "v2" and (qm.type_name(qtype), shape_name) in SWEEP_SHAPES:
                for tokens in SWEEP_WIDTHS if not quick else widths[:2]:
                    sweep += sweep_shapes(cupy, qm, mats, per_graph, tokens, shape_name)
            if "--gemv-sweep" in argv and kernel == "gemv" and (qm.type_name(qtype), shape_name) in GEMV_SWEEP_SHAPES:
                for tokens in GEMV_SWEEP_WIDTHS if not quick else widths[:2]:
                    if gemv_runs(qg, qtype, k, tokens):
                        gsweep += sweep_gemv(cupy, qm, qg, mats, per_graph, tokens, shape_name)
            in_psweep = (qm.type_name(qtype), shape_name) in PERSIST_SWEEP_SHAPES
            if "--persist-sweep" in argv and kernel == "gemvp" and in_psweep:
                for tokens in PERSIST_SWEEP_WIDTHS if not quick else widths[:2]:
                    if gemv_runs(qg, qtype, k, tokens, True):
                        psweep += sweep_persist(cupy, qm, qg, mats, per_graph, tokens, shape_name)
        del mats
        layouts.clear()
        cupy.get_default_memory_pool().free_all_blocks()

    by_name = {qm.type_name(q): q for q in (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16)}
    ssweep: list[dict] = []
    if "--split-sweep" in argv:
        for qt, sn in SPLIT_SWEEP_SHAPES:
            try:
                ssweep += sweep_split(cupy, qm, qg, by_name[qt], sn, shapes[sn], copy_bw, quick)
            except Exception as e:  # noqa: BLE001 - one matrix failing leaves the others' numbers
                print(f"split sweep {qt} {sn}: {type(e).__name__}: {e}", flush=True)

    result = {
        **info,
        "copy_GBps": round(copy_bw, 1),
        "read_GBps": round(read_bw, 1),
        "rows": rows,
        "sweep": sweep,
        "launch": launch_rows,
        "gemv_sweep": gsweep,
        "persist_sweep": psweep,
        "split_sweep": ssweep,
        "wide_sweep": wsweep,
        "pack": pack_rows,
        "seconds": round(time.time() - t_start, 1),
    }
    out_dir = os.environ.get("OUT")

    def save() -> None:
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "roofline.json").write_text(json.dumps(result, indent=1))

    save()
    if "--wide-step" in argv:
        try:
            sw = tuple(int(w) for w in _arg(argv, "--step-widths", "1,16,23,32,41,48,64").split(","))
            ctx = int(_arg(argv, "--context", "512"))
            result["wide_step"] = step_wide(cupy, qw, _arg(argv, "--wide-step"), ctx, sw)
        except Exception as e:  # noqa: BLE001 - the kernel numbers above stay
            result["wide_step_error"] = f"{type(e).__name__}: {e}"
            print(f"wide-step failed: {result['wide_step_error']}", flush=True)
        result["seconds"] = round(time.time() - t_start, 1)
        save()
    if "--step-ab" in argv:
        try:
            result["step_ab"] = step_ab(cupy, qg, _arg(argv, "--step-ab"), int(_arg(argv, "--context", "512")))
        except Exception as e:  # noqa: BLE001 - the kernel numbers above stay
            result["step_ab_error"] = f"{type(e).__name__}: {e}"
            print(f"step-ab failed: {result['step_ab_error']}", flush=True)
        result["seconds"] = round(time.time() - t_start, 1)
        save()

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
    def cells(sel: list[dict], key: str, fmt: str) -> str:
        by_t = {r["tokens"]: r for r in sel}
        return " ".join(format(by_t[t][key], fmt) if t in by_t else f"{'-':>7}" for t in widths)

    print(f"{'kern':12} {'type':5} {'shape':8} {'out x in':>12} " + " ".join(f"{'T=' + str(t):>7}" for t in widths))
    for kernel in kernels:
        for qtype, shape_name in configs:
            sel = [r for r in rows if r["qtype"] == qm.type_name(qtype) and r["shape"] == shape_name
                   and r["kernel"] == kernel]  # fmt: skip
            if not sel:
                continue
            dims = f"{sel[0]['out']}x{sel[0]['in']}"
            head_ = f"{kernel:12} {sel[0]['qtype']:5} {shape_name:8} {dims:>12} "
            print(head_ + cells(sel, "us", "7.1f") + "  us")
            print(" " * len(head_) + cells(sel, "roof_copy", "7.2f") + "  roof (vs copy)")
            print(" " * len(head_) + cells(sel, "x_t1", "7.2f") + "  x T=1")
    others = [k for k in kernels if k in ("gemv", "gemvp", "wide", "auto")]
    if "v2" in kernels and others:
        print("time ratio to v2 of the same run (< 1: faster than v2):")
        for kernel in others:
            for qtype, shape_name in configs:
                mine = {r["tokens"]: r["us"] for r in rows if r["kernel"] == kernel and r["shape"] == shape_name
                        and r["qtype"] == qm.type_name(qtype)}  # fmt: skip
                ref = {r["tokens"]: r["us"] for r in rows if r["kernel"] == "v2" and r["shape"] == shape_name
                       and r["qtype"] == qm.type_name(qtype)}  # fmt: skip
                if not mine:
                    continue
                line = " ".join(f"{mine[t] / ref[t]:7.2f}" if t in mine and t in ref else f"{'-':>7}" for t in widths)
                print(f"{kernel + '/v2':12} {qm.type_name(qtype):5} {shape_name:8} {'':>12} " + line)
    if "gemv" in kernels and "gemvp" in kernels:
        print("time ratio persistent / per-tile gemv (< 1: persistent faster):")
        for qtype, shape_name in configs:
            sel = {(r["kernel"], r["tokens"]): r["us"] for r in rows if r["shape"] == shape_name
                   and r["qtype"] == qm.type_name(qtype)}  # fmt: skip
            cells_ = [sel[("gemvp", t)] / sel[("gemv", t)] if ("gemvp", t) in sel and ("gemv", t) in sel else None
                      for t in widths]  # fmt: skip
            if any(c is not None for c in cells_):
                line = " ".join(f"{c:7.2f}" if c is not None else f"{'-':>7}" for c in cells_)
                print(f"{'gemvp/gemv':12} {qm.type_name(qtype):5} {shape_name:8} {'':>12} " + line)
    if gsweep:
        print("gemv k_warps sweep (us per k_warps 1..8; * = choose_k_warps):")
        for qt, sn in GEMV_SWEEP_SHAPES:
            for tokens in sorted({r["tokens"] for r in gsweep}):
                sel = [r for r in gsweep if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens]
                if sel:
                    times = " ".join(f"{r['k_warps']}{'*' if r['auto'] else ''}:{r['us']:.1f}" for r in sel)
                    print(f"  {qt} {sn} T={tokens}: {times}")
    if psweep:
        print("persistent gemv sweep (us per k_warps/blocks per SM (0: all that fit)/prefetch -> grid; per-tile gemv):")
        for qt, sn in PERSIST_SWEEP_SHAPES:
            for tokens in sorted({r["tokens"] for r in psweep}):
                sel = [r for r in psweep if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens]
                if sel:
                    times = " ".join(f"{r['k_warps']}/{r['blocks_per_sm']}/{r['prefetch']}->{r['grid']}:{r['us']:.1f}"
                                     for r in sorted(sel, key=lambda r: r["us"]))  # fmt: skip
                    print(f"  {qt} {sn} T={tokens}: {times}; per-tile {sel[0]['per_tile_us']:.1f}")
    if ssweep:
        print("split-K gemv sweep (us; tile = one block per tile, auto = choose_split's (splits, k_warps); "
              "SxK = splits x k_warps; roof vs copy):")  # fmt: skip
        for qt, sn in SPLIT_SWEEP_SHAPES:
            for tokens in SPLIT_SWEEP_WIDTHS:
                sel = [r for r in ssweep if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens]
                if sel:
                    top = sorted(sel[2:], key=lambda r: r["us"])[:4]
                    print(f"  {qt} {sn} {sel[0]['out']}x{sel[0]['in']} T={tokens}: tile {sel[0]['us']:.1f} "
                          f"({sel[0]['roof_copy']:.2f}), auto {tuple(sel[1]['auto'])} {sel[1]['us']:.1f} "
                          f"({sel[1]['roof_copy']:.2f}); best " + ", ".join(
                              f"{r['config']} {r['us']:.1f} ({r['roof_copy']:.2f})" for r in top))  # fmt: skip
    for r in result.get("step_ab", []):
        print(f"step-ab {r['preset']}: replay {r.get('replay_us')} us (min {r.get('min_us')})")
    steps = result.get("wide_step", [])
    base = next((r.get("off") for r in steps if r["width"] == 1), None)
    if steps:
        print("step graph replay (us; x = / width-1 step; issue 5: width 23 <= 1.3x, 41 <= 1.6x):")
        for r in steps:
            def x(v):
                return f"{v:9.1f} ({v / base:4.2f}x)" if v and base else f"{'-':>17}"
            print(f"  width {r['width']:3d}: v2 {x(r.get('off'))}  wide {x(r.get('on'))}")
    if wsweep:
        print("wide launch-shape sweep, best (m_tiles, warps, stages, blocks per SM -> grid) per matrix and width, us "
              "(default shape us):")  # fmt: skip
        for qt, sn in WIDE_SWEEP_SHAPES:
            for tokens in sorted({r["tokens"] for r in wsweep}):
                sel = [r for r in wsweep if r["qtype"] == qt and r["shape"] == sn and r["tokens"] == tokens]
                if sel:
                    top = sorted(sel, key=lambda r: r["us"])[:3]
                    auto = [r["us"] for r in sel if r["default"]]
                    print(f"  {qt} {sn} T={tokens}: " + ", ".join(
                        f"({r['m_tiles']},{r['warps']},{r['stages']},{r['blocks_per_sm']}->{r['grid']}) {r['us']:.1f}"
                        for r in top) + (f"; default {auto[0]:.1f}" if auto else ""))  # fmt: skip
    if "wide" in kernels and ("gemv" in kernels or "auto" in kernels):
        print_wide_targets(rows, wsweep, configs, qm)
    return 0


def print_wide_targets(rows: list[dict], wsweep: list[dict], configs, qm) -> None:
    """Issue 5's per-matrix table: wide (and v2, and the best swept wide shape) at 16, 23, 41, 64 tokens over the
    gemv time at T=1 (auto's T=1 when gemv was not timed), targets marked."""
    print("wide vs gemv T=1 (us; x = time / gemv T=1; targets T=23 <= 1.15, T=41 <= 1.4, T=64 <= 2; "
          "* = target met; best = best swept shape):")  # fmt: skip
    widths = (16, 23, 41, 64)
    print(f"{'type':5} {'shape':8} {'gemv T1':>8} " + " ".join(f"{'T=' + str(t):>22}" for t in widths))
    for qtype, shape_name in configs:
        qt = qm.type_name(qtype)

        def us(kernel: str, tokens: int, qt: str = qt, shape_name: str = shape_name):
            sel = [r["us"] for r in rows if r["kernel"] == kernel and r["qtype"] == qt and r["shape"] == shape_name
                   and r["tokens"] == tokens]  # fmt: skip
            return sel[0] if sel else None

        base = us("gemv", 1) or us("auto", 1)
        if base is None or us("wide", 16) is None and us("wide", 23) is None:
            continue
        cells = []
        for t in widths:
            w, v2 = us("wide", t), us("v2", t)
            sw = [r["us"] for r in wsweep if r["qtype"] == qt and r["shape"] == shape_name and r["tokens"] == t]
            if w is None:
                cells.append(f"{'-':>22}")
                continue
            mark = "*" if t in WIDE_TARGETS and w / base <= WIDE_TARGETS[t] else " "
            cell = f"{w / base:.2f}{mark}"
            cell += f" v2 {v2 / base:.2f}" if v2 else ""
            cell += f" b {min(sw) / base:.2f}" if sw else ""
            cells.append(f"{cell:>22}")
        print(f"{qt:5} {shape_name:8} {base:8.1f} " + " ".join(cells))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
