"""One device run for the GPU engine slice: its tests, then GPU vs NumPy numbers on the embedded default model.

    python3 bench/gpu_engine_check.py [--out DIR] [--skip-tests]

Runs tests/test_gpu_backend.py (pytest in a subprocess), then measures on the default model (8 layers, hidden
384, Q8_0): logits difference GPU vs NumPy (prefill + 16 decode steps), plain greedy decode tok/s on the GPU and
on the NumPy CPU path, target verify time at widths 1/16/23/41/65 relative to width 1 (GPU and CPU), speculative
greedy on the GPU (CPU drafter) vs plain, and `specsplit generate --device cuda:0` plain and speculative; also
what keeping the logits on the device saves at a 248320-token vocabulary (full rows to pageable host memory vs
the on-device argmax and its T ids through pinned memory), and TQ3_0 KV (tq3_0/tq3_0, q8_0/tq3_0) against the
NumPy engine with the same types. A
17 M-parameter model is launch-bound on a GPU (~18 MB of weights stream in a few microseconds; a step is
hundreds of eager kernel launches), so these ratios say nothing about bandwidth: that is bench/decode.py's job
on a synthetic full-size model. Prints a compact table last; details go to DIR/gpu_engine_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _err() -> str:
    """The current exception's traceback tail (the table shows where a step failed)."""
    import traceback

    return traceback.format_exc()[-1200:]


def run_tests(out_dir: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_gpu_backend.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(out_dir, "pytest_gpu_backend.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    last = [ln for ln in p.stdout.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    return {"rc": p.returncode, "summary": last[0], "seconds": round(time.perf_counter() - t0, 1)}


def decode_tps(model, ids, n: int) -> tuple[float, list[int]]:
    from services.engine.generate import generate

    generate(model, ids, 4)  # warm: kernels compiled, allocations made
    res = generate(model, ids, n)
    return res.timings()["predicted_per_second"], res.token_ids


def logits_transfer(widths=(1, 23, 41, 64), vocab: int = 248320, reps: int = 20) -> dict:
    """ms per step of getting T rows of logits to the host: every row (cp.asnumpy, pageable, what forward did
    before DeviceLogits) vs the per-row argmax on the device plus its T ids through pinned memory (what greedy
    acceptance reads now). Median of `reps`, each ending in a sync."""
    import cupy as cp

    from kernels import sampling as smp

    out = {}
    for t in widths:
        x = cp.random.standard_normal((t, vocab), dtype=cp.float32)
        ids = np.ndarray((t,), np.int32, buffer=cp.cuda.alloc_pinned_memory(4 * t))

        def full() -> None:
            cp.asnumpy(x)  # noqa: B023

        def device() -> None:
            idx, _ = smp.argmax(x)  # noqa: B023
            cp.asnumpy(idx, out=ids, blocking=False)  # noqa: B023
            cp.cuda.get_current_stream().synchronize()

        row = {}
        for name, fn in (("full_rows_ms", full), ("device_argmax_ms", device)):
            fn()
            ts = []
            for _ in range(reps):
                cp.cuda.get_current_stream().synchronize()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            row[name] = round(float(np.median(ts)) * 1e3, 3)
        assert np.array_equal(ids, cp.asnumpy(x).argmax(axis=-1)), "device argmax != np.argmax"
        row["saved_x"] = round(row["full_rows_ms"] / row["device_argmax_ms"], 1)
        out[t] = row
    return out


def teacher_forced_diff(cpu, gpu, ids, kv: tuple[str, str] | None = None, steps: int = 16) -> tuple[float, float]:
    """Max |NumPy - GPU| logit difference over a prefill and `steps` decode steps fed the NumPy argmax (both
    engines see the same inputs), and the largest |logit| seen; `kv`: the KV types of both states."""
    cs, gs = cpu.new_state(256, *(kv or ())), gpu.new_state(256, *(kv or ()))
    feed, diffs = list(ids), []
    for step in range(steps + 1):
        rows = "all" if step == 0 else "last"
        a, b = cpu.forward(cs, feed, logits=rows), gpu.forward(gs, feed, logits=rows)
        cs.commit(range(len(feed)))
        gs.commit(range(len(feed)))
        diffs.append(float(np.abs(a.logits - np.asarray(b.logits)).max()))
        feed = [int(np.argmax(a.logits[-1]))]
    return max(diffs), float(np.abs(a.logits).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_engine_check")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget-s", type=float, default=220.0, help="seconds the whole run may take (tests get the rest)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason:
        print(f"no GPU here: {reason}")
        return 1
    import cupy

    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rep: dict = {"device": dev}
    t_start = time.perf_counter()

    def save() -> None:
        with open(os.path.join(args.out, "gpu_engine_check.json"), "w") as f:
            json.dump(rep, f, indent=1)

    from services.engine.backend import NumpyBackend
    from services.engine.budget import measure_verify_costs
    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter
    from services.engine.models.qwen35_gpu import load_gpu_target
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    tpath, dpath = default_model_paths()
    cpu_t = load_target(tpath)
    t0 = time.perf_counter()
    gpu = load_gpu_target(tpath, 0, with_tokenizer=False).model
    rep["gpu_load_s"] = round(time.perf_counter() - t0, 2)
    rep["fallback_weights"] = gpu.fallback_weights
    cpu = cpu_t.model
    ids = cpu_t.tokenizer.encode(PROMPT)
    try:
        rep["logits_transfer"] = logits_transfer()
    except Exception:
        rep["logits_transfer_error"] = _err()
    save()

    # logits vs NumPy (f32 KV on the CPU, f16 KV on the GPU), teacher-forced by the NumPy argmax
    try:
        t0 = time.perf_counter()
        rep["logit_max_abs_diff"], rep["logit_range"] = teacher_forced_diff(cpu, gpu, ids)
        rep["logit_check_s"] = round(time.perf_counter() - t0, 2)
    except Exception:  # keep measuring: the table says what failed
        rep["logit_error"] = _err()
    for kk, kv in (("tq3_0", "tq3_0"), ("q8_0", "tq3_0")):  # the same quantized KV types on both engines
        try:
            rep[f"kv_{kk}_{kv}_logit_max_abs_diff"] = teacher_forced_diff(cpu, gpu, ids, (kk, kv))[0]
        except Exception:
            rep[f"kv_{kk}_{kv}_error"] = _err()
    try:  # a 150-token chain (attention in blocks of 64) and a random 65-node tree (the CuPy attention fallback)
        rng = np.random.default_rng(5)
        cs, gs = cpu.new_state(400), gpu.new_state(400)
        chain = rng.integers(0, cpu.cfg.n_vocab, size=150)
        a, b = cpu.forward(cs, chain), gpu.forward(gs, chain)
        rep["chain150_max_abs_diff"] = float(np.abs(a.logits - np.asarray(b.logits)).max())
        cs.commit(range(150))
        gs.commit(range(150))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 65)]
        toks = rng.integers(0, cpu.cfg.n_vocab, size=65)
        a, b = cpu.forward(cs, toks, parents, checkpoints=True), gpu.forward(gs, toks, parents, checkpoints=True)
        rep["tree65_max_abs_diff"] = float(np.abs(a.logits - np.asarray(b.logits)).max())
    except Exception:
        rep["wide_error"] = _err()
    save()

    try:
        rep["gpu_decode_tps"], g_tok = decode_tps(gpu, ids, 64)
        rep["cpu_decode_tps"], c_tok = decode_tps(cpu, ids, 64)
        rep["greedy64_identical"] = g_tok == c_tok
        gpu.set_kv_cache_types("tq3_0", "tq3_0")
        try:
            rep["gpu_decode_tps_tq3"], _ = decode_tps(gpu, ids, 64)
        finally:
            gpu.set_kv_cache_types("f16", "f16")
    except Exception:
        rep["decode_error"] = _err()
    save()

    widths = (1, 16, 23, 41, 65)
    for name, model in (("gpu", gpu), ("cpu", cpu)):
        try:
            c = measure_verify_costs(model, widths, context=64, reps=5)
            rep[f"{name}_verify_ms"] = {w: round(c[w] * 1e3, 3) for w in widths}
            rep[f"{name}_verify_rel"] = {w: round(c[w] / c[1], 2) for w in widths}
        except Exception:
            rep[f"{name}_verify_error"] = _err()
        save()

    try:
        plain = generate(gpu, ids, 64)
        for budget in (None, 22):
            drafter = load_drafter(dpath, gpu.host_head(), NumpyBackend())
            res = speculative_generate(gpu, LocalProposer(drafter), ids, 64, spec=SpecConfig(budget=budget))
            key = "chain" if budget is None else f"tree{budget}"
            rep[f"spec_{key}"] = {"identical_to_plain": res.token_ids == plain.token_ids,
                                  "tps": res.timings()["predicted_per_second"],
                                  "mean_acceptance_length": res.spec["mean_acceptance_length"],
                                  "draft_ms": res.spec["draft_ms"], "verify_ms": res.spec["verify_ms"]}
    except Exception:
        rep["spec_error"] = _err()
    save()

    for label, extra in (("plain", ["--no-draft"]), ("spec", [])):
        # `specsplit generate` itself; the service sub-commands are left out of the parser so that a machine
        # without grpc_health (the GPU box) can still build it
        argv = ["generate", "--device", "cuda:0", "--prompt", "def fibonacci(n):", "--max-tokens", "48", "--json",
                *extra]
        code = f"import sys, services.cli as c; c._SERVICE_CLIS[:] = []; sys.exit(c.main({argv!r}))"
        cmd = [sys.executable, "-c", code]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
            obj = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
            rep[f"cli_{label}"] = {"rc": p.returncode, "stderr": p.stderr[-600:],
                                   "token_ids": obj and obj["token_ids"],
                                   "tps": obj and obj["timings"]["predicted_per_second"]}
        except Exception:
            rep[f"cli_{label}"] = {"error": _err()}
        save()
    if rep.get("cli_plain", {}).get("token_ids") is not None:
        rep["cli_spec_equals_plain"] = rep["cli_plain"]["token_ids"] == rep.get("cli_spec", {}).get("token_ids")

    if not args.skip_tests:
        try:
            rep["tests"] = run_tests(args.out, max(30.0, args.budget_s - (time.perf_counter() - t_start)))
        except subprocess.TimeoutExpired:
            rep["tests"] = {"summary": "pytest timed out (see pytest_gpu_backend.txt if written)"}
    rep["total_s"] = round(time.perf_counter() - t_start, 1)
    save()

    print(json.dumps(rep, indent=1, default=str)[:6000])
    print(f"\n== GPU engine check on {dev} (default model; eager launches: launch-bound, not a bandwidth result)")
    rows = [("tests", rep.get("tests", {}).get("summary")),
            ("logits max|GPU-NumPy| (prefill+16 decode)", rep.get("logit_max_abs_diff", rep.get("logit_error"))),
            ("max|GPU-NumPy| chain150 / tree65", f"{rep.get('chain150_max_abs_diff')} / "
                                                 f"{rep.get('tree65_max_abs_diff')}"),
            ("greedy 64 identical", rep.get("greedy64_identical", rep.get("decode_error"))),
            ("plain decode tok/s GPU | NumPy CPU", f"{rep.get('gpu_decode_tps')} | {rep.get('cpu_decode_tps')}"),
            ("plain decode tok/s GPU, tq3_0 KV", rep.get("gpu_decode_tps_tq3")),
            ("max|GPU-NumPy| KV tq3/tq3 | q8/tq3", f"{rep.get('kv_tq3_0_tq3_0_logit_max_abs_diff')} | "
                                                  f"{rep.get('kv_q8_0_tq3_0_logit_max_abs_diff')}"),
            ("logits to host ms, V=248320: full | argmax, T=1/23/41/64",
             " ".join(f"{r['full_rows_ms']}|{r['device_argmax_ms']}" for r in rep.get("logits_transfer", {}).values())
             or rep.get("logits_transfer_error")),
            ("verify ms GPU w=1/16/23/41/65", rep.get("gpu_verify_ms", rep.get("gpu_verify_error"))),
            ("verify rel GPU (to w=1)", rep.get("gpu_verify_rel")),
            ("verify rel CPU (to w=1)", rep.get("cpu_verify_rel", rep.get("cpu_verify_error"))),
            ("spec chain / tree22 == plain", f"{rep.get('spec_chain', {}).get('identical_to_plain')} / "
                                             f"{rep.get('spec_tree22', {}).get('identical_to_plain')}"
             if "spec_error" not in rep else rep["spec_error"]),
            ("spec tree22 tok/s, accept len", f"{rep.get('spec_tree22', {}).get('tps')}, "
                                              f"{rep.get('spec_tree22', {}).get('mean_acceptance_length')}"),
            ("CLI --device cuda:0 plain rc / spec rc / equal",
             f"{rep.get('cli_plain', {}).get('rc')} / {rep.get('cli_spec', {}).get('rc')} / "
             f"{rep.get('cli_spec_equals_plain')}")]
    for k, v in rows:
        print(f"{k:48s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
