"""One GPU run for the exact sampler (kernels/sampling.py `sample`): build the kernels, run the GPU tests, then time
a draw at the Qwen3.6-27B vocabulary (248320) against fetching the row and sampling it with NumPy.

    python3 bench/gpu_sampling_check.py              # tests, then timings; $OUT/gpu_sampling.json (+ the test log)
    python3 bench/gpu_sampling_check.py --no-tests
    python3 bench/gpu_sampling_check.py --quick      # fewer repetitions: a smoke run of the script itself

Per filter combination and batch of rows (1: plain decoding or one visited node; 16 / 65: every node of a chain /
a 64-node tree, as speculative.walk_tree draws them in one batch):
  dev_ms    wall time of sample() (upload of uniforms + windows, the launches, copy of the tokens, sync), median;
  gpu_ms    device time per call of back-to-back sample_async() calls (CUDA events), mean;
  host_ms   per row: copy the row to the host (pageable, as DeviceLogits[i] does) + services.engine.sampling.sample,
            median (what the engine did before);
  x_host    host_ms * rows / dev_ms (for 16 / 65 rows: if the host walk had visited every row; it visits the
            accepted path only, so also seq_ms: a walk of 4 visited nodes with one device draw and sync each).
Rows are LLM-like (a dozen likely tokens over a normal spread) or `flat` (top-p keeps ~100k tokens: the worst
case of the select passes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import loader  # noqa: E402

VOCAB = 248320
KERNELS = ("sample_prep_kernel", "sample_select_kernel<0>", "sample_select_kernel<1>", "sample_draw_sum_kernel",
           "sample_draw_scan_kernel", "sample_probs_kernel")
TESTS = ["tests/test_kernels_sampling.py", "tests/test_device_walk.py",
         "tests/test_gpu_backend.py::test_sampled_speculative_runs_on_gpu",
         "tests/test_gpu_backend.py::test_greedy_reads_device_argmax_and_sampling_draws_on_the_device"]
PEN = {"repetition_penalty": 1.1, "repeat_last_n": 64}
COMBOS = [  # (label, SamplingParams fields, row kind)
    ("T=0.7", {"temperature": 0.7}, "llm"),
    ("T=0.7 min_p=0.05", {"temperature": 0.7, "min_p": 0.05}, "llm"),
    ("T=0.7 top_k=20", {"temperature": 0.7, "top_k": 20}, "llm"),
    ("T=0.7 top_p=0.95", {"temperature": 0.7, "top_p": 0.95}, "llm"),
    ("T=0.6 k=20 p=0.95 (Qwen)", {"temperature": 0.6, "top_k": 20, "top_p": 0.95}, "llm"),
    ("T=0.8 k=50 p=0.9 min_p rep", {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05, **PEN}, "llm"),
    ("greedy rep=1.1", {"temperature": 0.0, **PEN}, "llm"),
    ("T=1.0 top_p=0.95 flat", {"temperature": 1.0, "top_p": 0.95}, "flat"),
]


def run_tests(out_dir: Path | None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=8", *TESTS]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if out_dir:
        (out_dir / "gpu_sampling_tests.log").write_text(log)
    print(log[-6000:], flush=True)
    print(f"tests: exit {done.returncode} in {time.time() - t0:.0f} s", flush=True)
    return done.returncode


def precompile() -> None:
    t0 = time.time()
    for name in KERNELS:
        loader.get_function("sampling.cu", name)
    print(f"compiled {len(KERNELS)} sampler kernels in {time.time() - t0:.1f} s", flush=True)


def make_rows(kind: str, rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "flat":
        return (rng.standard_normal((rows, VOCAB)) * 0.3).astype(np.float32)
    x = (rng.standard_normal((rows, VOCAB)) * 2.5).astype(np.float32)
    for r in range(rows):
        x[r, rng.choice(VOCAB, 12, replace=False)] += np.float32(9.0)
    return x


def kernel_kwargs(params) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                last_n=params.repeat_last_n if params.penalized else 0)


def time_combo(cupy, ks, label: str, fields: dict, kind: str, n_rows: int, reps: int) -> dict:
    from services.engine.sampling import SamplingParams, make_rng, sample

    params = SamplingParams(**fields).validate()
    x = make_rows(kind, n_rows, seed=n_rows)
    dev = cupy.asarray(x)
    rng = np.random.default_rng(1)
    hist = [int(t) for t in rng.integers(0, VOCAB, size=200)]
    paths = [[int(t) for t in rng.integers(0, VOCAB, size=min(r, 15))] for r in range(n_rows)]
    rows = np.arange(n_rows)
    kw = kernel_kwargs(params)
    ks.sample(dev, rows, rng.random(n_rows), history=hist, paths=paths, **kw)     # warm: workspace, kernels
    walls = []
    for _ in range(reps):
        us = rng.random(n_rows)
        t0 = time.perf_counter()
        ks.sample(dev, rows, us, history=hist, paths=paths, **kw)
        walls.append(time.perf_counter() - t0)
    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        ks.sample_async(dev, rows, rng.random(n_rows), history=hist, paths=paths, **kw)
    end.record(stream)
    end.synchronize()
    gpu_ms = cupy.cuda.get_elapsed_time(start, end) / reps
    seq = []     # a host walk of 4 visited nodes, one device draw (and sync) each
    for _ in range(max(3, reps // 4)):
        t0 = time.perf_counter()
        for r in range(4):
            ks.sample(dev, [r % n_rows], rng.random(1), history=hist, paths=[paths[r % n_rows]], **kw)
        seq.append(time.perf_counter() - t0)
    host = []
    req = make_rng(3)
    for i in range(max(3, reps // 5)):
        r = i % n_rows
        t0 = time.perf_counter()
        row = cupy.asnumpy(dev[r])
        sample(row, params, req, hist + paths[r])
        host.append(time.perf_counter() - t0)
    dev_ms = 1e3 * float(np.median(walls))
    host_ms = 1e3 * float(np.median(host))
    out = {"combo": label, "kind": kind, "rows": n_rows, "dev_ms": round(dev_ms, 4), "gpu_ms": round(gpu_ms, 4),
           "seq4_ms": round(1e3 * float(np.median(seq)), 4), "host_ms_per_row": round(host_ms, 3),
           "x_host": round(host_ms * n_rows / dev_ms, 1),
           "passes": len(ks.select_passes(*ks.kernel_filters(params.temperature, params.top_k, params.top_p,
                                                               params.min_p, VOCAB)[1:3]))}
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    reason = loader.unavailable_reason()
    if reason is None:
        precompile()
    status = 0 if "--no-tests" in argv else run_tests(out_dir)
    if reason is not None:
        print(f"gpu_sampling_check: timings skipped: {reason}")
        return status
    import cupy

    from kernels import sampling as ks

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info = {"device": name, "cupy": cupy.__version__, "commit": os.environ.get("COMMIT", "?"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "vocab": VOCAB}
    print("gpu_sampling_check:", json.dumps(info), flush=True)
    reps = 5 if quick else 40
    t0 = time.time()
    results = []
    for label, fields, kind in COMBOS:
        for n_rows in ((1,) if quick else (1, 16, 65)):
            results.append(time_combo(cupy, ks, label, fields, kind, n_rows, reps))
    (out_dir / "gpu_sampling.json").write_text(json.dumps({**info, "tests_exit": status, "timings": results,
                                                           "bench_seconds": round(time.time() - t0, 1)}, indent=1))
    print()
    print(f"{name} ({info['date']}, commit {info['commit']}), vocabulary {VOCAB}; ms per call")
    print(f"{'filters':30} {'rows':>4} {'sel':>3} {'dev_ms':>8} {'gpu_ms':>8} {'seq4_ms':>8} {'host/row':>9} "
          f"{'x_host':>7}")
    for r in results:
        print(f"{r['combo']:30} {r['rows']:4} {r['passes']:3} {r['dev_ms']:8.3f} {r['gpu_ms']:8.3f} "
              f"{r['seq4_ms']:8.3f} {r['host_ms_per_row']:9.3f} {r['x_host']:7.1f}")
    print(f"gpu_sampling_check: tests exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
