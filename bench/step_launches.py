"""Launches and time of one GPU decode step with and without the fused launches (model.fused_launches, the
SPECSPLIT_FUSED_LAUNCHES switch of models/qwen35_gpu.py): captured-graph nodes by type, eager kernel launches,
width-1 step and replay time, and whether both modes give the same logits for the same tokens.

    python3 bench/step_launches.py MODEL.gguf [--context 128] [--steps 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset"}  # CUgraphNodeType; the rest counted as "other"


def graph_nodes(graph: Any) -> dict[str, int]:
    """Node counts of a captured cupy.cuda.Graph by type (driver API on its cudaGraph_t)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(int(graph.graph))
    n = ctypes.c_size_t(0)
    if cuda.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        raise RuntimeError("cuGraphGetNodes failed")
    nodes = (ctypes.c_void_p * n.value)()
    cuda.cuGraphGetNodes(handle, nodes, ctypes.byref(n))
    out: Counter[str] = Counter()
    for node in nodes:
        t = ctypes.c_int(-1)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        out[NODE_TYPES.get(t.value, "other")] += 1
    out["total"] = int(n.value)
    return dict(out)


class _Counted:
    """A compiled kernel that counts its launches (kernels.loader.get_function wrapped while counting)."""

    def __init__(self, fn: Any, counts: Counter, name: str):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_counts", counts)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kw):
        self._counts[self._name.split("<")[0]] += 1
        return self._fn(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


def eager_launches(model, state, token: int) -> Counter:
    """RawKernel launches of one eager width-1 forward, by kernel (CuPy's own elementwise ops not included)."""
    from kernels import loader

    counts: Counter[str] = Counter()
    real = loader.get_function
    loader.get_function = lambda source, name, *a, **k: _Counted(real(source, name, *a, **k), counts, name)
    graphs, model.use_graphs = model.use_graphs, False
    try:
        model.forward(state, [token], logits="all")
        state.commit([0])
    finally:
        loader.get_function = real
        model.use_graphs = graphs
    return counts


def run_mode(model, fused: bool, context: np.ndarray, steps: np.ndarray, cupy) -> tuple[dict[str, Any], list]:
    model.fused_launches = fused
    model.use_graphs = True
    st = model.new_state(len(context) + len(steps) + 64)
    model.forward(st, context, logits="none")
    st.commit(list(range(len(context))))
    res: dict[str, Any] = {"fused": fused}
    counts = eager_launches(model, st, int(steps[0]))
    res["eager_kernel_launches"] = sum(counts.values())
    res["eager_by_kernel"] = dict(counts.most_common())
    times, rows = [], []
    for tok in steps[1:]:
        t0 = time.perf_counter()
        out = model.forward(st, [int(tok)], logits="all")
        times.append(time.perf_counter() - t0)
        rows.append(np.asarray(out.logits[0], np.float32))
        st.commit([0])
    res["step_ms_median"] = round(statistics.median(times[2:]) * 1e3, 3)   # the first two: warm-up and capture
    res["decode_tps"] = round(1.0 / statistics.median(times[2:]), 2)
    g = next((g for k, g in st.graphs.items() if k[0] == 1), None)
    if g is not None:
        try:
            res["graph_nodes"] = graph_nodes(g.graph)
        except Exception as e:  # noqa: BLE001 - report, keep the timings
            res["graph_nodes_error"] = f"{type(e).__name__}: {e}"
        stream = cupy.cuda.get_current_stream()
        reps = []
        for _ in range(20):
            stream.synchronize()
            t0 = time.perf_counter()
            g.graph.launch(stream)
            stream.synchronize()
            reps.append(time.perf_counter() - t0)
        res["replay_ms_median"] = round(statistics.median(reps) * 1e3, 3)
    res["graph_stats"] = dict(model.graph_stats)
    res["graph_blocker"] = model.graph_blocker
    return res, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a qwen35 GGUF (e.g. bench/decode.py --make-synthetic's file)")
    ap.add_argument("--context", type=int, default=128, help="committed tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import cupy

    from services.engine import loader as ld
    from services.engine.backend import CupyBackend
    from services.engine.models.qwen35_gpu import Qwen35GpuModel

    t0 = time.perf_counter()
    mf = ld.open_model_file(args.model)
    emb = mf.tensors["token_embd.weight"]
    model = Qwen35GpuModel(ld.config_from_gguf(mf.metadata, n_vocab=emb.shape[0], path=mf.path), mf.tensors,
                           CupyBackend(0), source=mf.path)
    rep: dict[str, Any] = {"model": args.model, "load_s": round(time.perf_counter() - t0, 1),
                           "n_layer": model.cfg.n_layer}
    rng = np.random.default_rng(0)
    context = rng.integers(0, model.cfg.n_vocab, size=args.context)
    steps = rng.integers(0, model.cfg.n_vocab, size=args.steps + 1)
    rows = {}
    for fused in (False, True):
        name = "fused" if fused else "separate"
        rep[name], rows[name] = run_mode(model, fused, context, steps, cupy)
        print(name, json.dumps(rep[name]), flush=True)
    a, b = np.stack(rows["separate"]), np.stack(rows["fused"])
    rep["logits_max_abs_diff"] = float(np.abs(a - b).max())
    rep["logits_scale"] = float(np.abs(a).max())
    rep["argmax_equal"] = bool((a.argmax(-1) == b.argmax(-1)).all())
    print({k: rep[k] for k in ("logits_max_abs_diff", "logits_scale", "argmax_equal")}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
