"""One GPU-machine call for the Gated DeltaNet kernels: run their GPU tests, then time them at Qwen3.6-27B shapes.

    python3 bench/gpu_deltanet_check.py            # from the repository root; logs and JSON under $OUT

Shapes: 48 DeltaNet layers, 16 key heads, 48 value heads, dk = dv = 128, conv kernel 4, conv_dim 10240. Each
timing is a CUDA graph of one launch per layer (48 launches, every layer with its own state, checkpoints and conv
window, as in a real step, so the L2 cache does not hold a layer's state from one replay to the next) replayed
under CUDA events; the median per-layer time is reported. Roofline: measured device-to-device copy bandwidth;
"floor" = the bytes a kernel must move (state read, checkpoint / state writes, inputs read once, outputs written
once) / that bandwidth; "x floor" = time / floor (1.0 = at the copy bandwidth). Prefill of 4096 tokens is timed
for the recurrent kernel against the chunked WY form (layers.gated_delta_rule_chunked) run as a torch program on
the same GPU (captured in a CUDA graph), fp32 with TF32 off and on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

L, HK, HV, DK, DV, KW = 48, 16, 48, 128, 128, 4
KD = HK * DK
CONV_DIM = 2 * KD + HV * DV
STATE = HV * DK * DV * 4  # bytes of one layer's state / one checkpoint slot
PREFILL = 4096
TREE_SIZES = (1, 16, 23, 41)
# (cols_per_warp, warps per block, depth = tokens in flight; 1 = gdr_tree_kernel, else gdr_tree_staged_kernel)
VARIANTS = ((8, 2, 1), (8, 4, 8), (8, 2, 8), (8, 1, 8), (4, 1, 8), (8, 2, 4), (8, 2, 16))
OUT = Path(os.environ.get("OUT") or "/tmp/gpu_deltanet_out")


def log(msg: str) -> None:
    print(msg, flush=True)
    with open(OUT / "gpu_deltanet.log", "a") as f:
        f.write(msg + "\n")


def run_tests() -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_kernels_deltanet.py"]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (OUT / "pytest.log").write_text(done.stdout + done.stderr)
    tail = (done.stdout + done.stderr).strip().splitlines()
    failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    log(f"== pytest tests/test_kernels_deltanet.py: exit {done.returncode} in {time.time() - t0:.0f} s")
    for line in failures[:20] + tail[-3:]:
        log("   " + line)
    return done.returncode


def graph_time(cupy, launches, reps: int = 20) -> float:
    """Median seconds of one replay of a graph holding `launches()` (called once, under capture)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launches()  # eager once: compile, check errors
        stream.synchronize()
        stream.begin_capture()
        launches()
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
    return float(np.median(times))


def copy_bandwidth(cupy) -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second: the better of cudaMemcpyAsync and
    cupy.copyto (an elementwise kernel)."""
    n = 1 << 30
    src = cupy.random.random(n // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    rt = cupy.cuda.runtime

    def memcpy():
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, rt.memcpyDeviceToDevice, cupy.cuda.get_current_stream().ptr)

    t_memcpy = graph_time(cupy, memcpy, reps=10)
    t_kernel = graph_time(cupy, lambda: cupy.copyto(dst, src), reps=10)
    log(f"   copy 1 GiB: cudaMemcpyAsync {2 * n / t_memcpy / 1e9:.0f} GB/s, "
        f"cupy.copyto {2 * n / t_kernel / 1e9:.0f} GB/s")  # fmt: skip
    return 2 * n / min(t_memcpy, t_kernel)


class Bench:
    """Timings at Qwen3.6-27B shapes; each section logs its rows and survives the failure of another."""

    def __init__(self, cupy, dn, random_tree):
        self.cupy, self.dn, self.random_tree = cupy, dn, random_tree
        self.rng = np.random.default_rng(0)
        self.rows: list[dict] = []
        self.bw = copy_bandwidth(cupy)
        log(f"== copy bandwidth {self.bw / 1e9:.0f} GB/s (device-to-device, 1 GiB, read + write)")
        cupy_, rng, t_max = cupy, self.rng, 64
        self.t_max = t_max
        # step inputs shared by the layers (produced just before by the projections in a real step: L2-warm)
        self.mixed = self.rnd((t_max, CONV_DIM))
        self.g = cupy_.asarray((-np.abs(rng.standard_normal((t_max, HV))) * 0.3).astype(np.float32))
        self.beta = cupy_.asarray((1 / (1 + np.exp(-rng.standard_normal((t_max, HV))))).astype(np.float32))
        self.alpha_p, self.b_p = self.rnd((t_max, HV)), self.rnd((t_max, HV))
        self.ssm_a = cupy_.asarray(-np.exp(rng.standard_normal(HV)).astype(np.float32))
        self.dt_bias = self.rnd((HV,))
        dn.qk_norm_gate(self.mixed, self.alpha_p, self.b_p, self.ssm_a, self.dt_bias, n_k_heads=HK, head_k_dim=DK)
        self.states = [self.rnd((HV, DK, DV), scale=0.1) for _ in range(L)]
        self.out = cupy_.empty((t_max, HV * DV), cupy_.float32)
        dn.warmup()

    def rnd(self, shape, dtype=np.float32, scale=1.0):
        return self.cupy.asarray((self.rng.standard_normal(shape) * scale).astype(dtype))

    def tree_parents(self, T: int):
        return self.cupy.asarray(self.random_tree(T, self.rng).astype(np.int32))

    def record(self, name: str, t: float, nbytes: float, note: str = "") -> None:
        floor = nbytes / self.bw
        self.rows.append(dict(kernel=name, us=t * 1e6, floor_us=floor * 1e6, x_floor=t / floor,
                              gbps=nbytes / t / 1e9, note=note))  # fmt: skip
        log(f"   {name:<36} {t * 1e6:9.1f} us  floor {floor * 1e6:8.1f} us  x{t / floor:5.2f}  {note}")

    def tree(self) -> None:
        log("== tree step (gdr_tree_kernel), per layer; graph of 48 layers")
        cupy, dn = self.cupy, self.dn
        m = self.mixed
        for T in TREE_SIZES:
            parents = self.tree_parents(T)
            n_tok = cupy.asarray(np.array([T], np.int32))
            ckpts = [cupy.empty((T, HV, DK, DV), cupy.float32) for _ in range(L)]
            q, k, v = m[:T, :KD], m[:T, KD : 2 * KD], m[:T, 2 * KD :]
            g, beta, out = self.g[:T], self.beta[:T], self.out[:T]

            def step(cw, nw, d, parents=parents, n_tok=n_tok, ckpts=ckpts, q=q, k=k, v=v, g=g, beta=beta, out=out):
                for i in range(L):
                    dn.gated_delta_tree(q, k, v, g, beta, self.states[i], parents=parents, n_tokens=n_tok,
                                        checkpoints=ckpts[i], out=out, cols_per_warp=cw, warps=nw, depth=d)  # fmt: skip

            nbytes = STATE * (1 + T) + T * (2 * KD + 2 * HV * DV + 2 * HV) * 4
            for cw, nw, d in VARIANTS:
                t = graph_time(cupy, lambda step=step, cw=cw, nw=nw, d=d: step(cw, nw, d)) / L
                self.record(f"tree T={T} (+ckpt) cw={cw} w={nw} d={d}", t, nbytes)

        def decode(cw, nw, d):
            for i in range(L):
                dn.gated_delta_tree(m[:1, :KD], m[:1, KD : 2 * KD], m[:1, 2 * KD :], self.g[:1], self.beta[:1],
                                    self.states[i], final_state=self.states[i], out=self.out[:1], cols_per_warp=cw,
                                    warps=nw, depth=d)  # fmt: skip

        nbytes = 2 * STATE + (2 * KD + 2 * HV * DV) * 4
        for cw, nw, d in VARIANTS:
            t = graph_time(cupy, lambda cw=cw, nw=nw, d=d: decode(cw, nw, d)) / L
            self.record(f"decode T=1 in place cw={cw} w={nw} d={d}", t, nbytes, "no checkpoint")

    def conv_norm(self) -> None:
        log("== causal conv + SiLU (conv_silu_kernel) and q/k norm + gates, per layer")
        cupy, dn = self.cupy, self.dn
        windows = [self.rnd((KW - 1, CONV_DIM)) for _ in range(L)]
        weights = [self.rnd((CONV_DIM, KW), scale=0.5) for _ in range(L)]
        raws = [self.rnd((self.t_max, CONV_DIM)) for _ in range(L)]
        for T in (1, 23, 41):
            parents = self.tree_parents(T)
            outs = [cupy.empty((T, CONV_DIM), cupy.float32) for _ in range(L)]

            def conv(parents=parents, outs=outs, T=T):
                for i in range(L):
                    dn.conv_silu(raws[i][:T], windows[i], weights[i], parents=parents, out=outs[i])

            nbytes = (2 * T + KW - 1 + KW) * CONV_DIM * 4
            self.record(f"conv T={T}", graph_time(cupy, conv) / L, nbytes, "raw + window + weights in, out")

            def norm(outs=outs, T=T):
                for i in range(L):
                    dn.qk_norm_gate(outs[i], self.alpha_p[:T], self.b_p[:T], self.ssm_a, self.dt_bias, n_k_heads=HK,
                                    head_k_dim=DK, g=self.g[:T], beta=self.beta[:T])  # fmt: skip

            self.record(f"qk norm + gates T={T}", graph_time(cupy, norm) / L, T * (4 * KD + 4 * HV) * 4, "in place")

    def commit(self) -> None:
        log("== commit: ssm_commit_kernel over 48 layers in one launch, conv_commit_kernel likewise")
        cupy, dn = self.cupy, self.dn
        T = 23
        ckpt = cupy.full((L, T, HV, DK, DV), 0.5, cupy.float32)
        state = cupy.empty((L, HV, DK, DV), cupy.float32)
        window = self.rnd((L, KW - 1, CONV_DIM))
        raw = self.rnd((L, T, CONV_DIM))
        parents = self.tree_parents(T)
        acc = cupy.asarray(np.array([T - 1], np.int32))
        t = graph_time(cupy, lambda: dn.commit_state(acc, ckpt, state))
        self.record("commit state, 48 layers (total)", t, 2 * STATE * L)
        t = graph_time(cupy, lambda: dn.commit_conv(acc, parents, raw, window))
        self.record("commit conv window, 48 layers", t, L * 3 * (KW - 1) * CONV_DIM * 4)

    def prefill(self) -> None:
        log(f"== prefill, {PREFILL} tokens, one layer: recurrent kernel vs the chunked WY form in torch")
        cupy, dn = self.cupy, self.dn
        P = PREFILL
        pm = self.rnd((P, CONV_DIM))
        pa, pb = self.rnd((P, HV)), self.rnd((P, HV))
        pg, pbeta = dn.qk_norm_gate(pm, pa, pb, self.ssm_a, self.dt_bias, n_k_heads=HK, head_k_dim=DK)
        s_init = self.rnd((HV, DK, DV), scale=0.1)
        s_work = cupy.empty_like(s_init)
        p_out = cupy.empty((P, HV * DV), cupy.float32)

        def run(cw, nw, d):
            cupy.copyto(s_work, s_init)
            dn.gated_delta_tree(pm[:, :KD], pm[:, KD : 2 * KD], pm[:, 2 * KD :], pg, pbeta, s_work,
                                final_state=s_work, out=p_out, cols_per_warp=cw, warps=nw, depth=d)  # fmt: skip

        nbytes = P * (2 * KD + 2 * HV * DV + 2 * HV) * 4 + 2 * STATE
        times = {}
        for cw, nw, d in VARIANTS:
            times[cw, nw, d] = graph_time(cupy, lambda cw=cw, nw=nw, d=d: run(cw, nw, d), reps=5)
            self.record(f"prefill {P} recurrent cw={cw} w={nw} d={d}", times[cw, nw, d], nbytes, "state in place")
        best = min(times, key=times.get)
        t_rec = times[best]
        graph_time(cupy, lambda: run(*best), reps=1)  # p_out / s_work: the fastest variant's result
        rec_out = cupy.asnumpy(p_out).reshape(P, HV, DV)
        rec_state = cupy.asnumpy(s_work)
        self.rows += torch_chunked(pm, pg, pbeta, s_init, rec_out, rec_state, nbytes, t_rec)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_deltanet.log").write_text("")
    git = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip() or "?"
    log(f"== gpu_deltanet_check {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.node()}, "
        f"commit {commit} (+ working tree)")  # fmt: skip
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)  # fmt: skip
    log("   " + (smi.stdout.strip() or smi.stderr.strip()))
    status = run_tests()

    import cupy
    from test_kernels_deltanet_sim import random_tree

    from kernels import deltanet as dn

    log(f"   cupy {cupy.__version__}, runtime {cupy.cuda.runtime.runtimeGetVersion()}")
    bench = Bench(cupy, dn, random_tree)
    for section in (bench.tree, bench.conv_norm, bench.commit, bench.prefill):
        try:
            section()
        except Exception:
            log(f"!! section {section.__name__} failed:\n{traceback.format_exc()}")
            status = status or 1
        cupy.get_default_memory_pool().free_all_blocks()

    rows = bench.rows
    log("")
    log(f"{'kernel':<38}{'us':>10}{'floor us':>10}{'x floor':>9}{'GB/s':>8}  note")
    for r in rows:
        log(f"{r['kernel']:<38}{r['us']:>10.1f}{r['floor_us']:>10.1f}{r['x_floor']:>9.2f}{r['gbps']:>8.0f}  "
            f"{r['note']}")  # fmt: skip
    best: dict[str, float] = {}
    for r in rows:
        if r["kernel"].startswith("tree "):
            t = r["kernel"].split()[1]
            best[t] = min(best.get(t, float("inf")), r["us"])
    log("48 layers, delta rule + checkpoints, best variant, ms per step: "
        + ", ".join(f"{t}: {L * us / 1e3:.2f}" for t, us in best.items()))  # fmt: skip
    result = dict(copy_gbps=bench.bw / 1e9, commit=commit, rows=rows, tests_exit=status)
    (OUT / "deltanet_bench.json").write_text(json.dumps(result, indent=1))
    log(f"== exit status {status}")
    return status


def chunked_program(torch, mixed, g, beta, s0, chunk: int = 64):
    """layers.gated_delta_rule_chunked in torch on (tokens, conv_dim) conv output rows (q / k normalised) and
    (tokens, Hv) gates: returns run() -> (out (tokens, Hv, dv), final state (Hv, dk, dv))."""
    P, C = int(mixed.shape[0]), chunk
    N = P // C
    dev = mixed.device
    tiled = torch.arange(HV, device=dev) % HK

    def heads(x, n_heads, d, index=None):
        x = x.reshape(P, n_heads, d)
        x = x[:, index] if index is not None else x
        return x.permute(1, 0, 2).reshape(HV, N, C, d).contiguous()

    q, k = heads(mixed[:, :KD], HK, DK, tiled), heads(mixed[:, KD : 2 * KD], HK, DK, tiled)
    v = heads(mixed[:, 2 * KD :], HV, DV)
    g, b = g.T.reshape(HV, N, C).contiguous(), beta.T.reshape(HV, N, C).contiguous()
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    eye = torch.eye(C, device=dev)

    def run():
        gam = torch.cumsum(g, -1)
        diff = gam[..., :, None] - gam[..., None, :]
        decay = torch.where(lower, torch.exp(torch.where(lower, diff, torch.zeros_like(diff))), 0.0)
        eg = torch.exp(gam)
        eg_last = torch.exp(gam[..., -1:] - gam)
        g_last = torch.exp(gam[..., -1])
        kk = (k * b[..., None]) @ k.transpose(-1, -2)
        A = eye + torch.where(strict, kk * decay, 0.0)
        Tm = torch.linalg.solve_triangular(A, eye.expand_as(A).contiguous(), upper=False, unitriangular=True)
        U = Tm @ (v * b[..., None])
        W = Tm @ (k * (b * eg)[..., None])
        qk = (q @ k.transpose(-1, -2)) * decay
        s = s0.clone()
        outs = []
        for n in range(N):
            v_new = U[:, n] - W[:, n] @ s
            outs.append((q[:, n] * eg[:, n, :, None]) @ s + qk[:, n] @ v_new)
            s = g_last[:, n, None, None] * s + (k[:, n] * eg_last[:, n, :, None]).transpose(-1, -2) @ v_new
        out = torch.stack(outs, 1)  # (HV, N, C, DV)
        return out.permute(1, 2, 0, 3).reshape(P, HV, DV), s

    return run


def torch_chunked(pm, pg, pbeta, s_init, rec_out, rec_state, nbytes, t_rec) -> list[dict]:
    """The chunked WY form (chunk 64) as a graph-captured torch program; its output is checked against the kernel."""
    try:
        import torch
    except Exception as e:
        log(f"   torch unavailable ({e}): chunked comparison skipped")
        return []
    run = chunked_program(torch, torch.from_dlpack(pm), torch.from_dlpack(pg), torch.from_dlpack(pbeta),
                          torch.from_dlpack(s_init).clone())  # fmt: skip
    torch.cuda.synchronize()
    rows = []
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, s_fin = run()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3)
        tc = float(np.median(times))
        err = float(np.abs(out.cpu().numpy() - rec_out).max() / np.abs(rec_out).max())
        serr = float(np.abs(s_fin.cpu().numpy() - rec_state).max() / np.abs(rec_state).max())
        name = f"prefill {int(pm.shape[0])} chunked torch{' tf32' if tf32 else ' fp32'}"
        note = f"recurrent/chunked = {t_rec / tc:.2f}; vs recurrent: out {err:.1e}, state {serr:.1e}"
        rows.append(dict(kernel=name, us=tc * 1e6, floor_us=float("nan"), x_floor=float("nan"),
                         gbps=nbytes / tc / 1e9, note=note))  # fmt: skip
        log(f"   {name:<36} {tc * 1e6:9.1f} us  {note}")
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    sys.exit(main())
