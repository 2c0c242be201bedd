"""One GPU-machine call for the Gated DeltaNet kernels: their GPU tests, then timings at Qwen3.6-27B shapes.

    python3 bench/gpu_deltanet_check.py [--skip-tests] [--torch] [--precompile N]   # from the repository root
    python3 bench/gpu_deltanet_check.py --precompile-only            # fill CuPy's kernel cache in parallel

Shapes: 48 DeltaNet layers, 16 key heads, 48 value heads, dk = dv = 128, conv kernel 4, conv_dim 10240. Each
timing is a CUDA graph replayed under CUDA events (median): the tree steps are one launch per layer (48, every layer
with its own state, its own conv output rows and gates, as in the GPU model's state), so the L2 cache does not
hold a layer's state from one replay to the next; commits are one launch for all 48 layers.

First (issue 5, docs/gpu_deltanet.md): a verify step of T tokens on bench/step_profile's tree shape (a chain of half
the nodes, one side branch off each of its first nodes), the tree walk (gdr_tree_plan_kernel once,
gdr_tree_walk_kernel writing outputs only), plus the commit of its deepest node by replay (gdr_commit_kernel over
the accepted path), at T = 1, 16, 23, 41, 64. (The per-node checkpoint kernels it was measured against are gone;
their numbers stay in docs/gpu_deltanet.md.) Then: walk and commit layouts, the commit against the path's length,
decode and the 4096-token prefill (chains through the walk kernel), the plan kernel alone, conv / norm; --torch adds
the chunked WY prefill as a torch program. Roofline: "floor" = the bytes a kernel must move (state read, state
written, inputs read once, outputs written once) / the measured device-to-device copy bandwidth; "x floor" =
time / floor.
"""

from __future__ import annotations

import argparse
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
STATE = HV * DK * DV * 4  # bytes of one layer's state
PREFILL = 4096
T_MAX = 64
STEP_SIZES = (1, 16, 23, 41, 64)
# (cols_per_warp, warps per block, depth = tokens in flight)
WALK_VARIANTS = ((8, 2, 8), (8, 1, 8), (8, 4, 8), (4, 2, 8), (4, 4, 8), (8, 2, 4), (8, 2, 16))
COMMIT_VARIANTS = ((8, 2, 8), (8, 1, 8), (8, 4, 8), (4, 2, 8), (4, 4, 8), (8, 2, 4), (8, 2, 16))
PATH_LENGTHS = (1, 4, 8, 12, 16, 32, 64)
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


def kernel_names() -> list[tuple[str, tuple[str, ...]]]:
    """(name expression, defines) of every deltanet kernel the GPU tests and this script build."""
    jobs = []
    portable = ("SPECSPLIT_PORTABLE",)
    for t in ("float", "unsigned short"):
        names = [f"conv_silu_kernel<{t}, 4>", f"conv_silu_rows_kernel<{t}, 4>", f"conv_commit_kernel<{t}, 4>",
                 f"qk_norm_gate_kernel<{t}, 128>", f"qk_norm_gate_kernel<{t}, 64>",
                 f"gdr_tree_walk_kernel<{t}, 64, 8, 8>", f"gdr_commit_kernel<{t}, 64, 8, 8>"]  # fmt: skip
        for d in (2, 4, 8, 16):
            names += [f"gdr_tree_walk_kernel<{t}, 128, {cw}, {d}>" for cw in (4, 8)]
            names += [f"gdr_commit_kernel<{t}, 128, {cw}, {d}>" for cw in (4, 8)]
        jobs += [(n, ()) for n in names]
        both = [f"conv_silu_kernel<{t}, 4>", f"qk_norm_gate_kernel<{t}, 128>", f"qk_norm_gate_kernel<{t}, 64>",
                f"gdr_tree_walk_kernel<{t}, 128, 8, 8>", f"gdr_commit_kernel<{t}, 128, 8, 8>",
                f"conv_commit_kernel<{t}, 4>"]  # fmt: skip
        jobs += [(n, portable) for n in both]
    for d in ((), portable):
        jobs.append(("gdr_tree_plan_kernel", d))
    return jobs


def _compile(job: tuple[str, tuple[str, ...]]) -> str:
    """One kernel build in a worker process (fills CuPy's on-disk kernel cache for the tests and the timings)."""
    from kernels import loader

    loader.get_function("deltanet.cu", job[0], job[1])
    return job[0]


def precompile(workers: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    jobs = kernel_names()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile, jobs))
    log(f"== precompiled {len(jobs)} deltanet kernels in {time.time() - t0:.0f} s with {workers} processes")


def graph_time(cupy, launches, reps: int = 20, before=None) -> float:
    """Median seconds of one replay of a graph holding `launches()` (called once eagerly, once under capture).
    before(): run (outside the graph and the timing) ahead of each replay, e.g. to reset a state."""
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
            if before is not None:
                before()
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


def tree_parents(width: int) -> list[int]:
    """bench/step_profile.py's verify tree: a chain of about half the nodes from the root, the rest one branch
    each off the chain's first nodes (a DDTree's top-1 chain with side branches)."""
    chain = (width + 1) // 2
    par = [-1] + list(range(chain - 1))
    par += [i % max(1, chain - 1) for i in range(width - chain)]
    return par[:width]


def deepest(parents: list[int]) -> tuple[int, int]:
    """(node, path length) of the tree's deepest node (lowest index on ties)."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    d = max(depth)
    return depth.index(d), d


class Bench:
    """Timings at Qwen3.6-27B shapes; each section logs its rows and survives the failure of another."""

    def __init__(self, cupy, dn):
        self.cupy, self.dn = cupy, dn
        self.rng = np.random.default_rng(0)
        self.rows: list[dict] = []
        self.step_rows: list[dict] = []
        self.bw = copy_bandwidth(cupy)
        log(f"== copy bandwidth {self.bw / 1e9:.0f} GB/s (device-to-device, 1 GiB, read + write)")
        rng = self.rng
        # per layer, as a GpuSequenceState keeps them: conv output rows (q | k | v, normalised) and gates
        self.mixed = self.rnd((L, T_MAX, CONV_DIM))
        self.gates = cupy.empty((L, 2, T_MAX, HV), cupy.float32)
        self.alpha_p, self.b_p = self.rnd((T_MAX, HV)), self.rnd((T_MAX, HV))
        self.ssm_a = cupy.asarray(-np.exp(rng.standard_normal(HV)).astype(np.float32))
        self.dt_bias = self.rnd((HV,))
        for i in range(L):
            dn.qk_norm_gate(self.mixed[i], self.alpha_p, self.b_p, self.ssm_a, self.dt_bias, n_k_heads=HK,
                            head_k_dim=DK, g=self.gates[i, 0], beta=self.gates[i, 1])  # fmt: skip
        self.state = self.rnd((L, HV, DK, DV), scale=0.1)
        self.state0 = self.state.copy()
        self.out = cupy.empty((T_MAX, HV * DV), cupy.float32)
        dn.warmup()

    def rnd(self, shape, dtype=np.float32, scale=1.0):
        return self.cupy.asarray((self.rng.standard_normal(shape) * scale).astype(dtype))

    def qkv(self, i: int, T: int):
        m = self.mixed[i, :T]
        return m[:, :KD], m[:, KD : 2 * KD], m[:, 2 * KD :], self.gates[i, 0, :T], self.gates[i, 1, :T]

    def replay_inputs(self, T: int):
        m = self.mixed[:, :T]
        return m[:, :, KD : 2 * KD], m[:, :, 2 * KD :], self.gates[:, 0, :T], self.gates[:, 1, :T]

    def record(self, name: str, t: float, nbytes: float, note: str = "") -> None:
        floor = nbytes / self.bw
        self.rows.append(dict(kernel=name, us=t * 1e6, floor_us=floor * 1e6, x_floor=t / floor,
                              gbps=nbytes / t / 1e9, note=note))  # fmt: skip
        log(f"   {name:<44} {t * 1e6:9.1f} us  floor {floor * 1e6:8.1f} us  x{t / floor:5.2f}  {note}")

    def reset_state(self) -> None:
        self.cupy.copyto(self.state, self.state0)

    # ------------------------------------------------------------------ verify step + commit
    def tree_steps(self) -> None:
        log("== tree walk + commit by replay, 48 layers, step_profile's tree, commit of its deepest node")
        cupy, dn = self.cupy, self.dn
        in_bytes = lambda T: T * (2 * KD + 2 * HV * DV + 2 * HV) * 4  # noqa: E731 - q, k, v, g, beta in; out
        for T in STEP_SIZES:
            par = tree_parents(T)
            node, d = deepest(par)
            par_d = cupy.asarray(np.array(par, np.int32))
            acc = cupy.asarray(np.array([node], np.int32))
            plan = cupy.empty(T, cupy.int32)

            def step(T=T, par_d=par_d, plan=plan):
                dn.tree_plan(par_d, out=plan)
                for i in range(L):
                    dn.gated_delta_tree(*self.qkv(i, T), self.state[i], plan=plan, out=self.out[:T])

            def commit(acc=acc, par_d=par_d, T=T):
                dn.commit_replay(acc, par_d, *self.replay_inputs(T), self.state)

            t_step = graph_time(cupy, step)
            t_commit = graph_time(cupy, commit, before=self.reset_state)
            self.record(f"walk T={T} (+plan) per layer", t_step / L, STATE + in_bytes(T), "plan launch included")
            self.record(f"commit (replay {d} tokens), 48 layers", t_commit, 2 * STATE * L + L * d * 4 * (KD + HV * DV))
            row = dict(T=T, path=d, step_ms=t_step * 1e3, commit_ms=t_commit * 1e3)
            row["total_ms"] = row["step_ms"] + row["commit_ms"]
            self.step_rows.append(row)
            log(f"   T={T}: {row['total_ms']:.3f} ms (step {row['step_ms']:.3f} + commit {row['commit_ms']:.3f})")

    def walk_variants(self) -> None:
        log("== tree walk layouts (cols_per_warp, warps, depth), per layer, step_profile's tree")
        cupy, dn = self.cupy, self.dn
        for T in (23, 64):
            par_d = cupy.asarray(np.array(tree_parents(T), np.int32))
            plan = dn.tree_plan(par_d)
            for cw, nw, d in WALK_VARIANTS:

                def step(T=T, plan=plan, cw=cw, nw=nw, d=d):
                    for i in range(L):
                        dn.gated_delta_tree(*self.qkv(i, T), self.state[i], plan=plan, out=self.out[:T],
                                            cols_per_warp=cw, warps=nw, depth=d)  # fmt: skip

                t = graph_time(cupy, step) / L
                self.record(f"walk T={T} cw={cw} w={nw} d={d}", t, STATE + T * (2 * KD + 2 * HV * DV + 2 * HV) * 4)

    def commit_paths(self) -> None:
        log("== commit by replay against the path length (a chain of 64: path 0..a), 48 layers in one launch")
        cupy, dn = self.cupy, self.dn
        for n in PATH_LENGTHS:
            acc = cupy.asarray(np.array([n - 1], np.int32))
            for cw, nw, d in COMMIT_VARIANTS if n in (4, 16) else COMMIT_VARIANTS[:1]:
                t = graph_time(cupy, lambda acc=acc, cw=cw, nw=nw, d=d: dn.commit_replay(
                    acc, None, *self.replay_inputs(T_MAX), self.state, cols_per_warp=cw, warps=nw, depth=d),
                               before=self.reset_state)  # fmt: skip
                self.record(f"commit replay {n} tokens cw={cw} w={nw} d={d}", t,
                            2 * STATE * L + L * n * 4 * (KD + HV * DV))  # fmt: skip

    def chains(self) -> None:
        log("== chains through the walk kernel (decode T=1 in place, prefill 4096 tokens), per layer")
        cupy, dn = self.cupy, self.dn

        def decode():  # gdr_tree_walk_kernel without a plan
            for i in range(L):
                dn.gated_delta_tree(*self.qkv(i, 1), self.state[i], final_state=self.state[i], out=self.out[:1])

        nbytes = 2 * STATE + (2 * KD + 2 * HV * DV) * 4
        self.record("decode T=1 in place", graph_time(cupy, decode) / L, nbytes)
        P = PREFILL
        pm = self.rnd((P, CONV_DIM))
        pg, pbeta = dn.qk_norm_gate(pm, self.rnd((P, HV)), self.rnd((P, HV)), self.ssm_a, self.dt_bias, n_k_heads=HK,
                                    head_k_dim=DK)  # fmt: skip
        s_init = self.rnd((HV, DK, DV), scale=0.1)
        s_work = cupy.empty_like(s_init)
        p_out = cupy.empty((P, HV * DV), cupy.float32)
        self.prefill_inputs = (pm, pg, pbeta, s_init, s_work, p_out)

        def run():
            cupy.copyto(s_work, s_init)
            dn.gated_delta_tree(pm[:, :KD], pm[:, KD : 2 * KD], pm[:, 2 * KD :], pg, pbeta, s_work, final_state=s_work,
                                out=p_out)  # fmt: skip

        nbytes = P * (2 * KD + 2 * HV * DV + 2 * HV) * 4 + 2 * STATE
        self.t_prefill = graph_time(cupy, run, reps=5)
        self.record(f"prefill {P} recurrent", self.t_prefill, nbytes, "state in place")

    def plan_alone(self) -> None:
        log("== gdr_tree_plan_kernel alone (once per verify step)")
        cupy, dn = self.cupy, self.dn
        for T, par in ((23, tree_parents(23)), (41, tree_parents(41)), (65, tree_parents(65))):
            par_d = cupy.asarray(np.array(par, np.int32))
            plan = cupy.empty(T, cupy.int32)
            self.record(f"plan T={T}", graph_time(cupy, lambda par_d=par_d, plan=plan: dn.tree_plan(par_d, out=plan)),
                        8 * T, "latency-bound: one warp")  # fmt: skip

    def conv_norm(self) -> None:
        log("== causal conv + SiLU (conv_silu_kernel) and q/k norm + gates, per layer")
        cupy, dn = self.cupy, self.dn
        windows = [self.rnd((KW - 1, CONV_DIM)) for _ in range(L)]
        weights = [self.rnd((CONV_DIM, KW), scale=0.5) for _ in range(L)]
        raws = [self.rnd((T_MAX, CONV_DIM)) for _ in range(L)]
        outs = cupy.empty((L, T_MAX, CONV_DIM), cupy.float32)
        g, beta = cupy.empty((T_MAX, HV), cupy.float32), cupy.empty((T_MAX, HV), cupy.float32)
        for T in (1, 23, 41):
            parents = cupy.asarray(np.array(tree_parents(T), np.int32))

            def conv(parents=parents, T=T):
                for i in range(L):
                    dn.conv_silu(raws[i][:T], windows[i], weights[i], parents=parents, out=outs[i, :T])

            nbytes = (2 * T + KW - 1 + KW) * CONV_DIM * 4
            self.record(f"conv T={T}", graph_time(cupy, conv) / L, nbytes, "raw + window + weights in, out")

            def norm(T=T):
                for i in range(L):
                    dn.qk_norm_gate(outs[i, :T], self.alpha_p[:T], self.b_p[:T], self.ssm_a, self.dt_bias,
                                    n_k_heads=HK, head_k_dim=DK, g=g[:T], beta=beta[:T])  # fmt: skip

            self.record(f"qk norm + gates T={T}", graph_time(cupy, norm) / L, T * (4 * KD + 4 * HV) * 4, "in place")

    def torch_prefill(self) -> None:
        pm, pg, pbeta, s_init, s_work, p_out = self.prefill_inputs
        self.cupy.copyto(s_work, s_init)
        self.dn.gated_delta_tree(pm[:, :KD], pm[:, KD : 2 * KD], pm[:, 2 * KD :], pg, pbeta, s_work, final_state=s_work,
                                 out=p_out)  # fmt: skip
        self.cupy.cuda.get_current_stream().synchronize()
        rec_out = self.cupy.asnumpy(p_out).reshape(PREFILL, HV, DV)
        rec_state = self.cupy.asnumpy(s_work)
        nbytes = PREFILL * (2 * KD + 2 * HV * DV + 2 * HV) * 4 + 2 * STATE
        self.rows += torch_chunked(pm, pg, pbeta, s_init, rec_out, rec_state, nbytes, self.t_prefill)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true", help="timings only (the tests ran before)")
    ap.add_argument("--torch", action="store_true", help="also the chunked WY prefill as a torch program")
    ap.add_argument("--precompile", type=int, default=0, metavar="N", help="build every kernel in N processes first")
    ap.add_argument("--precompile-only", action="store_true", help="only that (with N = 16 unless given)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.precompile or args.precompile_only:
        precompile(args.precompile or 16)
        if args.precompile_only:
            return 0
    (OUT / "gpu_deltanet.log").write_text("")
    git = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip() or "?"
    log(f"== gpu_deltanet_check {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.node()}, "
        f"commit {commit} (+ working tree)")  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True)  # fmt: skip
        log("   " + (smi.stdout.strip() or smi.stderr.strip()))
    except OSError as e:
        log(f"   nvidia-smi: {e}")
    status = 0 if args.skip_tests else run_tests()

    import cupy

    from kernels import deltanet as dn

    log(f"   cupy {cupy.__version__}, runtime {cupy.cuda.runtime.runtimeGetVersion()}")
    bench = Bench(cupy, dn)
    sections = [bench.tree_steps, bench.walk_variants, bench.commit_paths, bench.chains, bench.plan_alone,
                bench.conv_norm] + ([bench.torch_prefill] if args.torch else [])  # fmt: skip
    for section in sections:
        try:
            section()
        except Exception:
            log(f"!! section {section.__name__} failed:\n{traceback.format_exc()}")
            status = status or 1
        cupy.get_default_memory_pool().free_all_blocks()

    rows = bench.rows
    log("")
    log(f"{'kernel':<46}{'us':>10}{'floor us':>10}{'x floor':>9}{'GB/s':>8}  note")
    for r in rows:
        log(f"{r['kernel']:<46}{r['us']:>10.1f}{r['floor_us']:>10.1f}{r['x_floor']:>9.2f}{r['gbps']:>8.0f}  "
            f"{r['note']}")  # fmt: skip
    result = dict(copy_gbps=bench.bw / 1e9, commit=commit, rows=rows, tree_steps=bench.step_rows, tests_exit=status)
    (OUT / "deltanet_bench.json").write_text(json.dumps(result, indent=1))
    log("")
    log("48 DeltaNet layers per verify step (tree walk + plan) + commit of the deepest node by replay (ms)")
    log(f"{'T':>4}{'path':>6}{'step':>10}{'commit':>10}{'total':>10}")
    for r in bench.step_rows:
        log(f"{r['T']:>4}{r['path']:>6}{r['step_ms']:>10.3f}{r['commit_ms']:>10.3f}{r['total_ms']:>10.3f}")
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
