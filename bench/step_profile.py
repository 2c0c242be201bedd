"""Per-kernel GPU time of single steps of the GPU engine (models/qwen35_gpu.py): a width-1 decode step and a
tree verify (width 23, or --tree-widths), every launch timed with CUDA events, grouped by kernel, layer part and matrix.

    python3 bench/step_profile.py --make-synthetic DIR [--json OUT]     # writes the synthetic 27B first
    python3 bench/step_profile.py --model PATH.gguf [--context 512] [--compare-persistent] [--json OUT]

Method. The step runs eagerly (model.use_graphs off) with kernels.loader's launch hook on: every kernel launch of
kernels/ is enqueued between two events (start, end). Work that is not such a launch (CuPy elementwise ops, copies,
memsets) lands between one launch's end event and the next one's start event, timed as that launch's `gap`. The
host enqueues slower than the GPU runs, so a spin kernel (it waits on %globaltimer, sized from the host's measured
time per launch) is enqueued before every GROUP launches: the queue then stays ahead of the GPU and an interval
holds GPU time only, not launch latency (the spins sit outside every interval). Events cost a little themselves:
`calibration` times empty launches the same way (interval and gap of a kernel that does nothing).

Groups: by kernel (name without template arguments), by layer part (embed, deltanet = the DeltaNet mixer,
attention = the gated-attention mixer, ffn = the rest of a block: norm packs, gate/up, SwiGLU pack, down; head =
final norm, LM head, argmax) and by matrix role (QuantMatrix.matmul calls: weight bytes per launch of the product
kernel, GB/s and the ratio to the device copy bandwidth). The same step shape is then captured as a CUDA graph and
replayed (`replay_us`: median of event-timed replays), to compare with the sum of the eager kernel times.
--compare-persistent: the width-1 step again with gemv's persistent variant for every quantized type
(quant_gemv.PERSISTENT_UP_TO), profile and replay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_bench import add_model_source, device_name, json_saver, load_gpu_model  # noqa: E402

GROUP = 24          # launches enqueued behind one spin kernel
SPIN_MIN_US = 300   # shortest spin
TREE_WIDTH = 23

SPIN_SOURCE = r"""
extern "C" __global__ void step_profile_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


def tree_parents(width: int) -> list[int]:
    """A verify tree of `width` nodes: a chain of about half of them from the root, the rest one branch each off
    the chain's first nodes (the shape of a DDTree's top-1 chain with side branches)."""
    chain = (width + 1) // 2
    par = [-1] + list(range(chain - 1))
    par += [i % max(1, chain - 1) for i in range(width - chain)]
    return par


class Recorder:
    """The launch hook: events around every launch, the context (layer part, layer, matrix) it ran in."""

    def __init__(self, cupy, spin, spin_ns: int):
        self.cp, self.spin, self.spin_ns = cupy, spin, int(spin_ns)
        self.records: list[dict[str, Any]] = []
        # per launch: (the event before its start: the previous end or a mark after a spin, start, end)
        self.events: list[tuple[Any, Any, Any]] = []
        self.part, self.layer = "embed", -1
        self.matrix: dict[str, Any] | None = None
        self.prev = None
        self.count = 0

    def __call__(self, name: str, launch) -> Any:
        cp = self.cp
        if self.count % GROUP == 0:   # keep the queue ahead of the GPU (see the module docstring)
            self.spin((1,), (1,), (np.uint64(self.spin_ns),))
            self.prev = cp.cuda.Event()
            self.prev.record()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        out = launch()
        end.record()
        base = name.split("<")[0]
        rec = {"kernel": base, "name": name, "part": self.part, "layer": self.layer}
        m = self.matrix
        if m is not None:
            rec["matrix"] = m["role"]
            if base.startswith(("gemv", "qmv", "qmm")):   # the product kernel: it streams the weights once
                rec["bytes"] = m["bytes"]
                rec["qtype"] = m["qtype"]
        self.records.append(rec)
        self.events.append((self.prev, start, end))
        self.prev = end
        self.count += 1
        return out

    def finish(self) -> list[dict[str, Any]]:
        self.cp.cuda.get_current_stream().synchronize()
        for rec, (prev, start, end) in zip(self.records, self.events):
            rec["us"] = self.cp.cuda.get_elapsed_time(start, end) * 1e3
            rec["gap_us"] = self.cp.cuda.get_elapsed_time(prev, start) * 1e3
        return self.records


def matrix_role(name: str) -> str:
    """'blk.3.ffn_gate.weight+blk.3.ffn_up.weight' -> 'ffn_gate+ffn_up'; 'output.weight' -> 'output'."""
    parts = []
    for n in str(name).split("+"):
        bits = n.split(".")
        if len(bits) > 2 and bits[0] == "blk":
            bits = bits[2:]
        if bits and bits[-1] == "weight":
            bits = bits[:-1]
        parts.append(".".join(bits))
    return "+".join(parts)


class Instrument:
    """Context for the hook: layer part from the model's own methods, matrix from QuantMatrix.matmul (patched on
    the class and the model instance while active, restored after)."""

    def __init__(self, model, qm_module, rec: Recorder):
        self.model, self.qm, self.rec = model, qm_module, rec

    def __enter__(self) -> Instrument:
        from kernels import loader

        model, rec = self.model, self.rec
        blk, dnet, attn = model._block, model._deltanet, model._gated_attention

        def block(i, *a, **k):
            rec.part, rec.layer = "ffn", i
            try:
                return blk(i, *a, **k)
            finally:
                rec.part = "head"   # what runs after the last block

        def mixer(fn, part):
            def run(i, *a, **k):
                rec.part = part
                try:
                    return fn(i, *a, **k)
                finally:
                    rec.part = "ffn"
            return run

        model._block, model._deltanet = block, mixer(dnet, "deltanet")
        model._gated_attention = mixer(attn, "attention")
        cls = self.qm.QuantMatrix
        self._matmul = real = cls.matmul

        def matmul(W, *a, **k):
            outer = rec.matrix
            rec.matrix = {"role": matrix_role(getattr(W, "name", "?")), "bytes": int(W.nbytes), "qtype": int(W.qtype)}
            try:
                return real(W, *a, **k)
            finally:
                rec.matrix = outer

        cls.matmul = matmul
        self._hook = loader.set_launch_hook(rec)
        return self

    def __exit__(self, *exc) -> None:
        from kernels import loader

        loader.set_launch_hook(self._hook)
        self.qm.QuantMatrix.matmul = self._matmul
        for attr in ("_block", "_deltanet", "_gated_attention"):
            self.model.__dict__.pop(attr, None)


def summarize(records: list[dict[str, Any]], copy_gbps: float | None) -> dict[str, Any]:
    """Totals by kernel, part and matrix role: launches, kernel us, gap us (non-kernel work before a launch), share
    of the step (kernel + gap), weight bytes and GB/s of the product kernels."""
    total = sum(r["us"] + r["gap_us"] for r in records) or 1.0

    def group(key) -> list[dict[str, Any]]:
        acc: dict[str, dict[str, Any]] = defaultdict(lambda: {"launches": 0, "us": 0.0, "gap_us": 0.0, "bytes": 0,
                                                              "bytes_us": 0.0})  # fmt: skip
        for r in records:
            k = key(r)
            if k is None:
                continue
            a = acc[k]
            a["launches"] += 1
            a["us"] += r["us"]
            a["gap_us"] += r["gap_us"]
            if r.get("bytes"):
                a["bytes"] += r["bytes"]
                a["bytes_us"] += r["us"]
        rows = []
        for k, a in sorted(acc.items(), key=lambda kv: -(kv[1]["us"] + kv[1]["gap_us"])):
            row = {"group": k, "launches": a["launches"], "us": round(a["us"], 1), "gap_us": round(a["gap_us"], 1),
                   "share": round((a["us"] + a["gap_us"]) / total, 4)}  # fmt: skip
            if a["bytes"]:
                gbs = a["bytes"] / (a["bytes_us"] * 1e-6) / 1e9
                row.update(weight_MB=round(a["bytes"] / 1e6, 1), GBps=round(gbs, 1))
                if copy_gbps:
                    row["roof"] = round(gbs / copy_gbps, 3)
            rows.append(row)
        return rows

    def part_kind(r):
        return r["part"] + (" matmul" if r.get("bytes") else " other")

    return {
        "kernel_us": round(sum(r["us"] for r in records), 1),
        "gap_us": round(sum(r["gap_us"] for r in records), 1),
        "launches": len(records),
        "weight_MB": round(sum(r.get("bytes", 0) for r in records) / 1e6, 1),
        "by_part": group(lambda r: r["part"]),
        "by_part_kind": group(part_kind),
        "by_kernel": group(lambda r: r["kernel"]),
        "by_matrix": group(lambda r: r.get("matrix") if r.get("bytes") else None),
    }


def print_table(title: str, rows: list[dict[str, Any]], total_us: float) -> None:
    head = f"{'n':>5} {'kernel us':>10} {'gap us':>8} {'share':>6} {'weight MB':>10} {'GB/s':>7} {'roof':>5}"
    print(f"  {title:28} {head}")
    for r in rows:
        wb = f"{r['weight_MB']:10.1f} {r['GBps']:7.0f} {r.get('roof', 0):5.2f}" if "weight_MB" in r else ""
        print(f"  {r['group'][:28]:28} {r['launches']:5d} {r['us']:10.1f} {r['gap_us']:8.1f} {r['share']:6.1%} {wb}")
    print(f"  {'total':28} {'':5} {total_us:10.1f}")


def replay_us(cp, graph, reps: int = 20) -> float:
    """Median event-timed replay of a captured step graph (device idle before each)."""
    stream = cp.cuda.get_current_stream()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps + 2):
        stream.synchronize()
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(times[2:])


def calibrate(cp, spin, n: int = 200) -> dict[str, float]:
    """Interval and gap of an empty launch timed like the step's launches (what the events alone cost)."""
    rec = Recorder(cp, spin, 2_000_000)
    for _ in range(n):
        rec("empty", lambda: spin((1,), (1,), (np.uint64(0),)))
    recs = rec.finish()
    inner = [r for i, r in enumerate(recs) if i % GROUP]   # not the first launch behind a spin
    return {"empty_launch_us": round(statistics.median(r["us"] for r in inner), 2),
            "empty_gap_us": round(statistics.median(r["gap_us"] for r in inner), 2)}


def profile_step(model, cp, spin, state, tokens, parents, label: str, copy_gbps: float | None) -> dict[str, Any]:
    """Eager warm-up (kernel builds, host time per launch), the profiled eager step, then graph capture + replay.
    A tree (parents given) is a verify step (checkpoints=True: any node committable, the DeltaNet layers keep
    their replay inputs); a width-1 step is a plain decode step."""
    from kernels import loader
    from kernels import quant_matmul as qm

    T = len(tokens)
    kw = dict(parents=parents, checkpoints=parents is not None, logits="all")
    model.use_graphs = False
    counter = {"n": 0}

    def count(name, launch):
        counter["n"] += 1
        return launch()

    model.forward(state, tokens, **kw)   # builds every kernel of the step
    state.pending = None
    prev = loader.set_launch_hook(count)
    try:
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        model.forward(state, tokens, **kw)
        eager_wall = time.perf_counter() - t0
    finally:
        loader.set_launch_hook(prev)
    state.pending = None
    host_us = eager_wall * 1e6 / max(1, counter["n"])
    spin_ns = int(max(SPIN_MIN_US, 2.5 * GROUP * host_us) * 1e3)
    rec = Recorder(cp, spin, spin_ns)
    with Instrument(model, qm, rec):
        model.forward(state, tokens, **kw)
    records = rec.finish()
    state.pending = None
    res: dict[str, Any] = {"label": label, "tokens": T, "eager_wall_us": round(eager_wall * 1e6, 1),
                           "host_us_per_launch": round(host_us, 1), "spin_us": spin_ns / 1e3}  # fmt: skip
    res.update(summarize(records, copy_gbps))
    model.use_graphs = True
    state.graphs.clear()
    for _ in range(2):   # warm-up + capture, then one replay through forward()
        model.forward(state, tokens, **kw)
        state.pending = None
    graph = next(iter(state.graphs.values()), None)
    if graph is not None:
        res["replay_us"] = round(replay_us(cp, graph.graph), 1)
    else:
        res["replay_us"] = None
        res["graph_blocker"] = model.graph_blocker
    res["records"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in records]
    return res


def report(res: dict[str, Any]) -> None:
    tot = res["kernel_us"] + res["gap_us"]
    print(f"\n== {res['label']}: {res['launches']} launches; kernels {res['kernel_us']:.0f} us + gaps "
          f"{res['gap_us']:.0f} us = {tot:.0f} us eager on the GPU; graph replay {res['replay_us']} us; eager wall "
          f"{res['eager_wall_us']:.0f} us ({res['host_us_per_launch']} us host per launch); weights "
          f"{res['weight_MB']:.0f} MB")  # fmt: skip
    print_table("by layer part", res["by_part"], tot)
    print_table("by part, matmul / other", res["by_part_kind"], tot)
    print_table("by kernel", res["by_kernel"], tot)
    print_table("by matrix (product kernel)", res["by_matrix"], sum(r["us"] for r in res["by_matrix"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_source(ap, "the synthetic target")
    ap.add_argument("--context", type=int, default=512, help="committed tokens before the profiled steps")
    ap.add_argument("--compare-persistent", action="store_true",
                    help="also the width-1 step with gemv's persistent variant for every quantized type")
    ap.add_argument("--tree-widths", type=int, nargs="+", default=[TREE_WIDTH],
                    help="tree verify widths to profile after the width-1 step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason:
        print(f"step_profile: no GPU here: {reason}")
        return 1
    import cupy as cp

    t_start = time.perf_counter()
    rep: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else argv}
    rep["device"] = device_name(cp)

    save = json_saver(rep, args.json, t_start)

    path = args.model
    if args.make_synthetic:
        from services.engine.synthetic import make_synthetic

        r = make_synthetic(args.shape, args.make_synthetic, layers=args.layers, draft=False)
        path = r.target_path
        rep["synthetic"] = {"path": path, "bytes": r.target_bytes, "seconds": r.seconds}
    rep["model"] = path
    try:
        import roofline

        rep["copy_GBps"] = round(roofline.copy_bandwidth(cp, 1 << 30), 1)
        cp.get_default_memory_pool().free_all_blocks()
    except Exception as e:  # noqa: BLE001 - the table keeps its GB/s without the ratio
        rep["copy_error"] = f"{type(e).__name__}: {e}"
    copy = rep.get("copy_GBps")

    model, _, load = load_gpu_model(path)
    rep["load_s"] = load["header_s"] + load["load_s"]
    rep["n_layer"] = model.cfg.n_layer
    rep["fused_launches"] = model.fused_launches
    print(f"loaded {path} ({model.cfg.n_layer} blocks) in {rep['load_s']} s; copy bandwidth {copy} GB/s", flush=True)
    save()

    spin = cp.RawKernel(SPIN_SOURCE, "step_profile_spin")
    rep["calibration"] = calibrate(cp, spin)
    rng = np.random.default_rng(0)
    n_vocab = model.cfg.n_vocab
    state = model.new_state(args.context + 2 * max(args.tree_widths) + 8)
    ids = rng.integers(0, n_vocab, size=args.context)
    model.forward(state, ids, logits="none")
    state.commit(list(range(len(ids))))
    steps = [("width 1 (decode)", rng.integers(0, n_vocab, size=1), None)]
    steps += [(f"width {w} tree verify", rng.integers(0, n_vocab, size=w), tree_parents(w)) for w in args.tree_widths]
    rep["steps"] = []
    for label, toks, par in steps:
        res = profile_step(model, cp, spin, state, [int(t) for t in toks], par, label, copy)
        rep["steps"].append(res)
        report(res)
        save()
    if args.compare_persistent:
        from kernels import quant_gemv as qg

        saved = dict(qg.PERSISTENT_UP_TO)
        qg.PERSISTENT_UP_TO.update({q: max(1, saved.get(q, 0)) for q in qg.PERSISTENT_TYPES})
        try:
            res = profile_step(model, cp, spin, state, [int(steps[0][1][0])], None, "width 1, persistent gemv", copy)
        finally:
            qg.PERSISTENT_UP_TO.clear()
            qg.PERSISTENT_UP_TO.update(saved)
        rep["steps"].append(res)
        report(res)
        save()
    print(f"\ncalibration (events around an empty launch): {rep['calibration']}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
