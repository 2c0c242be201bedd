"""Planned vs measured GPU memory of the engine (services/engine/memory_plan.py against what a run holds).

    python3 bench/memory_check.py --default-model [--max-ctx N] [--slots N] [--budget B] [--json OUT]
    python3 bench/memory_check.py --model T.gguf [--draft D.gguf] [--remote-drafter] [--budget 63] [--json OUT]

Loads the target (and a GPU drafter) on cuda:0 as the verifier does, plans with the verifier's settings, takes
what serving needs (placement.reserve_serving: pooled states and drafter sessions of the serving context, the graph
arena at its planned size), then runs (1) requests of many shapes - plain, chains, trees of several budgets, prompts
of 1..700 tokens (a prefill chunk and a half), every other one sampled with repetition penalties (the device
sampler), two at a time when there are two slots - and (2) on one pooled state, a decode step and a verify step (a
random tree with checkpoints, captured layers, all logits, committed) at every width of --widths. After each
request or step it reads the CuPy pool (used and held bytes), the graph arena, quant_gemv's split scratch (the wide
kernel's partials) and the device's memGetInfo.

Compared with the plan: the weights (the pool right after loading: the bytes it holds, so blocks it cannot give
back count too); the split scratch of all streams; the pool's largest holding against the planned bytes that live
in it (every item but the CUDA graphs, the split scratch and the reserve); each pooled state and session against
its planned bytes (exact); the arena against its planned size (reserved once, never grown while serving) and the
largest capture's need; what the device holds outside the pool (instantiated graphs, kernel modules) against the
planned graphs plus the reserve, with the bytes per kernel node it implies; the matrices the models hold against
the planned ones. Prints a table last ("within the plan" when every row is); --json writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB, MiB = 1 << 30, 1 << 20
OUTSIDE_POOL = ("CUDA graphs", "drafter CUDA graphs", "workspace reserve", "split-K scratch")


def _gib(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if abs(n) >= 0.1 * GiB else f"{n / MiB:.1f} MiB"


class Meter:
    """Device memory by holder, sampled after every request or step; keeps the largest of each."""

    def __init__(self, cp: Any):
        from kernels import quant_gemv

        self.cp, self.qg = cp, quant_gemv
        self.pool = cp.get_default_memory_pool()
        free, self.total = cp.cuda.runtime.memGetInfo()
        self.base = self.total - free          # the CUDA context (and anything before the model)
        self.max: dict[str, int] = {}
        self.samples: list[dict[str, Any]] = []

    def read(self, label: str, model: Any = None, drafter: Any = None) -> dict[str, Any]:
        self.cp.cuda.Device().synchronize()
        free, _ = self.cp.cuda.runtime.memGetInfo()
        r = {"label": label, "device_used": self.total - free - self.base, "pool_total": int(self.pool.total_bytes()),
             "pool_used": int(self.pool.used_bytes()), "split_scratch": self.qg.split_scratch_bytes()}
        r["outside_pool"] = r["device_used"] - r["pool_total"] - r["split_scratch"]
        if model is not None:
            from services.engine.models.qwen35_gpu import graph_arena

            a = graph_arena(self.cp)
            states = list(model._state_pool)
            r.update(arena=a.nbytes, arena_need=a.need, arena_grown=a.grown,
                     step_graphs=sum(len(s.graphs) for s in states),
                     commit_graphs=sum(len(s.commit_graphs) for s in states),
                     step_graphs_max=max((len(s.graphs) for s in states), default=0))
        if drafter is not None and hasattr(drafter, "_pool"):
            r["draft_graphs"] = sum(len(s.graphs) for s in drafter._pool)
        for k, v in r.items():
            if isinstance(v, int):
                self.max[k] = max(self.max.get(k, v), v)
        self.samples.append(r)
        return r


def _load(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.default_model:
        from services.engine.default_model import default_model_paths

        t, d = default_model_paths()
        return t, (None if args.no_draft else d)
    return args.model, args.draft


def _requests(model: Any, drafter: Any, new_proposer: Any, slots: int, max_ctx: int, n: int, meter: Meter,
              rng: np.random.Generator) -> int:
    """n requests of assorted shapes through speculative_stream / generate_stream, `slots` at a time (their steps
    interleaved, as the verifier's slots take turns under its engine lock)."""
    from services.engine.generate import generate_stream
    from services.engine.sampling import SamplingParams
    from services.engine.speculative import SpecConfig, speculative_stream

    lengths = [1, 5, 19, 64, 65, 200, 512, 513, 700]
    modes = ["plain", "chain", 22, 5, 1, 12, 63]
    # every other request draws sampled tokens with repetition penalties (the device sampler's workspace and its
    # float32 copy of the penalised rows), the others greedy
    sampled = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=7)
    tokens = 0
    queue = []
    for i in range(n):
        length = min(lengths[i % len(lengths)], max_ctx - 48)
        mode = modes[i % len(modes)] if new_proposer is not None else "plain"
        params = sampled if i % 2 else SamplingParams()
        prompt = rng.integers(0, model.cfg.n_vocab, size=length).tolist()
        max_tokens = int(rng.integers(8, 40))
        if mode == "plain":
            gen = generate_stream(model, prompt, max_tokens, params, max_ctx=max_ctx)
        else:
            spec = SpecConfig(budget=None if mode == "chain" else int(mode))
            gen = speculative_stream(model, new_proposer(), prompt, max_tokens, params, spec=spec, max_ctx=max_ctx)
        queue.append((f"request {i}: prompt {length}, {mode}{', sampled' if i % 2 else ''}", gen))
    while queue:
        batch, queue = queue[:slots], queue[slots:]
        live = list(batch)
        while live:
            for item in list(live):
                try:
                    tokens += len(next(item[1]))
                except StopIteration:
                    live.remove(item)
                    meter.read(item[0], model, drafter)
    return tokens


def _widths(model: Any, widths: list[int], capture: list[int], meter: Meter, rng: np.random.Generator,
            max_ctx: int, drafter: Any) -> None:
    """On one pooled state: a prompt, then per width a plain decode step and a verify of a random tree."""
    state = model.acquire_state(max_ctx, max_ctx)
    try:
        V = model.cfg.n_vocab
        prompt = rng.integers(0, V, size=min(600, max_ctx // 2)).tolist()
        for s in range(0, len(prompt), 512):
            part = prompt[s:s + 512]
            model.forward(state, part, capture=capture, logits="last")
            state.commit(list(range(len(part))))
        meter.read("widths: prompt", model, drafter)
        for w in widths:
            if state.n_past + w + 2 > state.max_ctx:
                break
            r = model.forward(state, [int(rng.integers(0, V))], capture=capture, logits="last")
            state.commit([0])
            parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, w)]
            r = model.forward(state, rng.integers(0, V, size=w), parents, capture=capture, checkpoints=True)
            ids = r.logits.argmax_rows()
            path, node = [0], 0
            for i in range(1, w):           # the first child of each node on the way down
                if parents[i] == node:
                    path.append(i)
                    node = i
            state.commit(path)
            del r, ids
            meter.read(f"widths: verify {w}", model, drafter)
    finally:
        model.release_state(state)


def _node_counts(states: list[Any], sessions: list[Any]) -> dict[str, Any]:
    """Kernel nodes of the graphs alive at the end (bench/step_launches.graph_nodes: the driver's count)."""
    try:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from step_launches import graph_nodes as count
    except Exception as e:  # noqa: BLE001 - a report without node counts
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        step = [count(g.graph)["total"] for st in states for g in st.graphs.values() if g is not None]
        commit = [count(g)["total"] for st in states for g in st.commit_graphs.values()]
        draft = [count(g.graph)["total"] for s in sessions for g in s.graphs.values()]
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return {"step_max": max(step, default=0), "commit_max": max(commit, default=0), "draft_max": max(draft, default=0),
            "total": sum(step) + sum(commit) + sum(draft)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="target GGUF")
    src.add_argument("--default-model", action="store_true", help="the embedded default pair")
    ap.add_argument("--draft", help="an in-process drafter, on the GPU beside the target")
    ap.add_argument("--no-draft", action="store_true", help="with --default-model: no drafter")
    ap.add_argument("--remote-drafter", action="store_true",
                    help="plan and capture as for a remote drafter (speculative verifies, 5 captured layers)")
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--budget", default="22", help="a DDTree budget, chain, or auto")
    ap.add_argument("--cache-type-k", default="auto")
    ap.add_argument("--cache-type-v", default="auto")
    ap.add_argument("--requests", type=int, default=14, help="requests of assorted shapes (0: none)")
    ap.add_argument("--widths", default="1-64", help="verify widths of the widths phase: A-B or a comma list")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    import cupy as cp

    from services.engine import memory_plan as mp
    from services.engine.placement import gpu_matrices, load_drafter_on, load_target_on, reserve_serving
    from services.engine.speculative import AUTO_MAX_BUDGET

    t_start = time.perf_counter()
    meter = Meter(cp)
    target_path, draft_path = _load(args)
    budget: int | None = None if args.budget == "chain" else (AUTO_MAX_BUDGET if args.budget == "auto"
                                                               else int(args.budget))
    device = "cuda:0"
    settings = mp.PlanSettings(max_ctx=args.max_ctx, budget=budget, slots=args.slots,
                               cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                               device=mp.Device("cuda", 0))
    plan, cfg = mp.plan_for_files(target_path, draft_path, settings, remote_drafter=args.remote_drafter)
    planned = {i.name: i.bytes for i in plan.devices[0].items}
    print(plan.table(), flush=True)

    t0 = time.perf_counter()
    target = load_target_on(target_path, device, with_tokenizer=False)
    model = target.model
    model.set_kv_cache_types(args.cache_type_k, args.cache_type_v)
    loaded = meter.read("weights", model)
    drafter, new_proposer = None, None
    if draft_path:
        ld = load_drafter_on(draft_path, model, device)
        drafter, new_proposer = ld.drafter, ld.new_proposer
    cp.get_default_memory_pool().free_all_blocks()      # the upload's temporaries (reserve_serving does it too)
    weights = meter.read("weights + drafter", model)
    load_s = time.perf_counter() - t0
    n_capture = len(drafter.target_layer_ids) if drafter is not None else (
        mp.DEFAULT_CAPTURE_LAYERS if args.remote_drafter else 0)
    speculative = drafter is not None or args.remote_drafter
    width = reserve_serving(model, drafter, args.slots, plan.settings.max_ctx, budget, speculative, n_capture, device)
    assert width == plan.width and model.max_tree == plan.state_width, (width, model.max_tree, plan)
    reserved = meter.read("reserved", model, drafter)
    grown0 = reserved["arena_grown"]
    kv_k, kv_v = model.kv_cache_types
    st_planned = sum(mp.gpu_state_bytes(cfg, plan.settings.max_ctx, kv_k, kv_v, model.max_tree,
                                        n_capture, model._host_table).values())
    ses_planned = 0
    if drafter is not None and hasattr(drafter, "_pool"):
        ses_planned = sum(mp.gpu_session_bytes(mp.drafter_shape_of(drafter.cfg), plan.settings.max_ctx
                                               + drafter.block_size, drafter._host_table).values())

    rng = np.random.default_rng(args.seed)
    t1 = time.perf_counter()
    tokens = _requests(model, drafter, new_proposer, args.slots, plan.settings.max_ctx, args.requests, meter, rng)
    req_s = time.perf_counter() - t1
    if "-" in args.widths:
        a, b = (int(x) for x in args.widths.split("-"))
        widths = list(range(a, b + 1))
    else:
        widths = [int(x) for x in args.widths.split(",")]
    widths = [w for w in widths if w <= model.max_tree]     # every step a state holds (a prompt's, a verify's)
    capture = list(drafter.target_layer_ids) if drafter is not None else (
        list(range(0, cfg.n_layer, max(1, cfg.n_layer // n_capture)))[:n_capture] if n_capture else [])
    t2 = time.perf_counter()
    _widths(model, widths, capture, meter, rng, plan.settings.max_ctx, drafter)
    widths_s = time.perf_counter() - t2
    end = meter.read("end", model, drafter)

    states = list(model._state_pool)
    sessions = list(getattr(drafter, "_pool", []) or [])
    held_mats = gpu_matrices(model, drafter if hasattr(drafter, "_pool") else None)
    planned_mats = mp.WeightBytes.of(mp.read_model_header(target_path)[1]).mats
    if hasattr(drafter, "_pool"):
        planned_mats |= mp.drafter_shape(draft_path, cfg).weights.mats
    mats_ok = held_mats == planned_mats
    nodes = _node_counts(states, sessions)
    graphs_new = (end["step_graphs"] + end["commit_graphs"] + end.get("draft_graphs", 0)
                  - reserved["step_graphs"] - reserved["commit_graphs"] - reserved.get("draft_graphs", 0))
    outside_growth = end["outside_pool"] - reserved["outside_pool"]
    pool_resident = sum(b for n, b in planned.items() if n not in OUTSIDE_POOL)
    outside_planned = sum(b for n, b in planned.items() if n in OUTSIDE_POOL)
    rep = {
        "model": target_path, "draft": draft_path, "device": cp.cuda.runtime.getDeviceProperties(0)["name"],
        "settings": plan.as_dict() | {"devices": None}, "width": width, "planned": planned,
        "planned_total": plan.devices[0].total,
        "pool_resident_items": [n for n in planned if n not in OUTSIDE_POOL],
        # the pool right after loading, less the graph arena the models reserve when they load
        # (pool_total: what the device holds for the pool; pool_used less: blocks CuPy keeps and cannot give back)
        "weights": {"measured": weights["pool_total"] - weights["arena"],
                    "planned": planned.get("target weights", 0) + planned.get("drafter weights", 0),
                    "used": weights["pool_used"] - weights["arena"],
                    "target_only": loaded["pool_total"] - loaded["arena"]},
        "matrices": {"as_planned": mats_ok, "held": sorted(held_mats), "planned": sorted(planned_mats)},
        "states": {"count": len(states), "bytes_each": [s.nbytes for s in states][0] if states else 0,
                   "planned_each": st_planned},
        "sessions": {"count": len(sessions), "bytes_each": sessions[0].nbytes if sessions else 0,
                     "planned_each": ses_planned},
        "arena": {"bytes": end["arena"], "need": meter.max.get("arena_need", 0),
                  "grown_while_serving": end["arena_grown"] - grown0},
        "pool": {"max_total": meter.max["pool_total"], "max_used": meter.max["pool_used"],
                 "after_reserve": reserved["pool_total"]},
        "planned_pool_resident": pool_resident,
        "outside_pool": {"max": meter.max["outside_pool"], "after_reserve": reserved["outside_pool"],
                         "planned": outside_planned, "new_graphs": graphs_new,
                         "bytes_per_graph": outside_growth / graphs_new if graphs_new else None,
                         "bytes_per_node": outside_growth / nodes["total"] if nodes.get("total") else None},
        "graph_nodes": nodes,
        "graphs": {"step": end["step_graphs"], "commit": end["commit_graphs"], "draft": end.get("draft_graphs", 0),
                   "step_max_per_state": meter.max.get("step_graphs_max", 0)},
        "graph_stats": dict(model.graph_stats), "pool_stats": dict(model.pool_stats),
        "drafter_graph_stats": dict(getattr(drafter, "graph_stats", {}) or {}),
        "device_used_max": meter.max["device_used"], "tokens": tokens,
        "seconds": {"load": round(load_s, 1), "requests": round(req_s, 1), "widths": round(widths_s, 1),
                    "all": round(time.perf_counter() - t_start, 1)},
        "samples": meter.samples,
    }
    rep["planned"]["pool_resident"] = pool_resident
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)

    planned_nodes = mp.graph_nodes(cfg, mp.drafter_shape_of(drafter.cfg) if hasattr(drafter, "_pool") else None)
    print(f"\n{os.path.basename(target_path)}: width {width}, slots {args.slots}, ctx {plan.settings.max_ctx}, "
          f"KV {kv_k}/{kv_v}; {tokens} tokens in {args.requests} requests ({req_s:.1f} s), widths "
          f"{widths[0] if widths else '-'}..{widths[-1] if widths else '-'} ({widths_s:.1f} s); graphs "
          f"{model.graph_stats}")
    rows = [
        ("weights (target + drafter)", rep["weights"]["planned"], rep["weights"]["measured"]),
        ("split scratch (wide kernel), all streams", planned.get("split-K scratch", 0), meter.max["split_scratch"]),
        ("state, each (exact)", st_planned, rep["states"]["bytes_each"]),
        ("drafter session, each (exact)", ses_planned, rep["sessions"]["bytes_each"]),
        ("graph arena (reserved)", planned.get("graph arena", 0), rep["arena"]["bytes"]),
        ("largest capture's need", planned.get("graph arena", 0), rep["arena"]["need"]),
        ("CuPy pool, most held", pool_resident, rep["pool"]["max_total"]),
        ("outside the pool (graphs, modules)", outside_planned, rep["outside_pool"]["max"]),
        ("device total (memGetInfo, less context)", plan.devices[0].total, rep["device_used_max"]),
    ]
    print(f"{'':42} {'planned':>14} {'measured':>14}  ok")
    for name, p, m in rows:
        print(f"{name:42} {_gib(p):>14} {_gib(m):>14}  {'yes' if m <= p else 'NO'}")
    per, per_node = rep["outside_pool"]["bytes_per_graph"], rep["outside_pool"]["bytes_per_node"]
    print(f"graphs alive: {rep['graphs']}; kernel nodes, most per step / commit / pass: measured "
          f"{nodes.get('step_max')} / {nodes.get('commit_max')} / {nodes.get('draft_max')}, planned {planned_nodes}; "
          f"outside-pool growth per graph {_gib(per) if per is not None else '-'}, per node "
          f"{f'{per_node / 1024:.1f} KiB' if per_node is not None else '-'} (planned {mp.GRAPH_NODE_BYTES >> 10} KiB); "
          f"arena grown while serving: {rep['arena']['grown_while_serving']}")
    print(f"matrices on the GPU as planned (split scratch sized by them): {'yes' if mats_ok else 'NO'}")
    ok = (rep["states"]["bytes_each"] == st_planned and rep["sessions"]["bytes_each"] == ses_planned
          and rep["arena"]["grown_while_serving"] == 0 and all(m <= p for _, p, m in rows) and mats_ok)
    print("within the plan" if ok else "NOT within the plan")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
