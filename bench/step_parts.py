"""Where a captured width-1 step of a qwen35 model goes: the step's graph against graphs of parts of it, built from
the same weights and the same product / pack launches (one process, replays interleaved).

    python3 bench/step_parts.py --model PATH.gguf [--context 512] [--json OUT]

Parts: every product with its packs (the step less the mixers' own chains: conv, q/k norm, walk, attention, the
embedding and the argmax), the packs alone (each product's output replaced by zeros), the FFN's products, the
gate|up or the down product alone, the mixers' products, their input or output projections alone. Each row prints
its replay time, the weight bytes it streams and the fraction of the copy roofline (bytes / copy bandwidth / time);
a part's products are its time less its packs' share. H100 results: docs/gpu_quant_matmul.md, "gemv: few row tiles
a SM" (the step's parts).

The parts are rebuilt the way session 13's step ran: a pack launch before every product. Since then the step stages
its norms in the products that write and read the residual stream (qwen35_gpu STAGE_NORMS) and the attention's
combine stages attn_output's input (ATTN_STAGE_UP_TO), so "step" here runs without those packs while "products +
packs" keeps them; the products' own rows still measure what they did.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def parts(model: Any, x0: Any, cupy: Any) -> dict[str, Any]:
    """name -> launches() building that part of a width-1 step (what the graphs capture)."""
    from kernels import quant_matmul as qm

    c = model.cfg
    eps = c.rms_eps
    cd, hv, hd = c.ssm_conv_dim, c.ssm_n_v_heads * c.ssm_head_v_dim, c.n_head * c.head_dim

    def part(head=True, mixers=True, ffn=True, inproj=True, outproj=True, gate_up=True, down=True, products=True):
        def mm(w: Any, px: Any, on: bool = True, **kw: Any) -> Any:
            if products and on:
                return w.matmul(px, **kw)
            return kw["out"] if kw.get("out") is not None else cupy.zeros((1, w.shape[0]), cupy.float32)

        def launches() -> Any:
            y = x0.copy()
            for i, w in enumerate(model.layers):
                if mixers:
                    h = qm.pack_activations(y, rms_weight=w["attn_norm"], eps=eps)
                    if c.recurrent_layers[i]:
                        proj = mm(w["ssm_in"], h, inproj)
                        pk = qm.pack_activations(proj[:, :hv], rms_weight=w["ssm_norm"], eps=eps,
                                                 gate=proj[:, cd:cd + hv])
                        o = mm(w["ssm_out"], pk, outproj)
                    else:
                        o = mm(w["attn_output"], qm.pack_activations(mm(w["attn_qkv"], h, inproj)[:, :hd]), outproj)
                    px = qm.pack_activations(o, rms_weight=w["post_attention_norm"], eps=eps, residual=y)
                    y = px.residual
                else:
                    px = qm.pack_activations(y, rms_weight=w["post_attention_norm"], eps=eps)
                if ffn:
                    gu = mm(w["ffn_gate_up"], px, gate_up)
                    f = gu.shape[1] // 2
                    pd = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:])
                    if down:
                        mm(w["ffn_down"], pd, out=y, accumulate=True)
            if head:
                return mm(model.output, qm.pack_activations(y, rms_weight=model.output_norm, eps=eps))
            return y
        return launches

    return {"products + packs": part(), "packs only": part(products=False),
            "ffn": part(head=False, mixers=False), "ffn gate|up": part(head=False, mixers=False, down=False),
            "ffn down": part(head=False, mixers=False, gate_up=False),
            "mixer products": part(head=False, ffn=False),
            "mixer input projections": part(head=False, ffn=False, outproj=False),
            "mixer output projections": part(head=False, ffn=False, inproj=False)}


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes each part's products stream in one step (the LM head as 'head')."""
    from services.engine.backend import GpuStack

    def nbytes(m: Any) -> int:
        mats = m.mats if isinstance(m, GpuStack) else [m]
        return sum(int(mm.q.nbytes) for mm in mats)

    by: dict[str, int] = {"head": nbytes(model.output)}
    for i, w in enumerate(model.layers):
        rec = model.cfg.recurrent_layers[i]
        for key, part in (("ffn_gate_up", "gate_up"), ("ffn_down", "down"), ("ssm_in" if rec else "attn_qkv", "in"),
                          ("ssm_out" if rec else "attn_output", "out")):
            by[part] = by.get(part, 0) + nbytes(w[key])
    return by


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from kernels import loader

    reason = loader.unavailable_reason()
    if reason is not None:
        print(f"step_parts: skipped: {reason}")
        return 0
    cupy = loader.require()
    import roofline
    from gpu_bench import json_saver, model_at_context
    from step_profile import replay_us

    from services.engine.models.qwen35_gpu import _GraphHeap, _record, graph_arena

    t_start = time.perf_counter()
    copy_gbps = roofline.copy_bandwidth(cupy, 1 << 30)
    model, state, rng = model_at_context(args.model, args.context)
    x0 = cupy.asarray((rng.standard_normal((1, model.cfg.n_embd)) * 0.05).astype(np.float32))

    def graph_of(launches: Any) -> Any:
        probe = _GraphHeap(cupy, None)
        with cupy.cuda.using_allocator(probe.malloc):
            launches()
        graph, _ = _record(cupy.cuda.Stream(non_blocking=True), graph_arena(cupy).heap_for(probe.peak), launches)
        return graph

    tok = [int(rng.integers(0, model.cfg.n_vocab))]
    for _ in range(2):   # eager warm-up, then the capture
        model.forward(state, tok, logits="all")
        state.pending = None
    graphs = {"step": next(iter(state.graphs.values())).graph}
    graphs.update({name: graph_of(fn) for name, fn in parts(model, x0, cupy).items()})
    runs: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            runs[name].append(replay_us(cupy, g))
    us = {n: statistics.median(v) for n, v in runs.items()}
    wb = weight_bytes(model)
    total = sum(wb.values())
    streams = {"step": total, "products + packs": total, "packs only": 0, "ffn": wb["gate_up"] + wb["down"],
               "ffn gate|up": wb["gate_up"], "ffn down": wb["down"], "mixer products": wb["in"] + wb["out"],
               "mixer input projections": wb["in"], "mixer output projections": wb["out"]}
    # packs a part launches per layer (and the head's): its packs' share of "packs only"
    packs = {"step": 5, "products + packs": 5, "packs only": 5, "ffn": 2, "ffn gate|up": 2, "ffn down": 2,
             "mixer products": 3, "mixer input projections": 3, "mixer output projections": 3}
    per_pack = us["packs only"] / (5 * len(model.layers) + 1)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; weights {total / 1e9:.3f} GB a step "
          f"({total / copy_gbps / 1e3:.1f} us at copy bandwidth); a pack {per_pack:.2f} us")
    rows = []
    for name, t in us.items():
        b = streams[name]
        pk = per_pack * packs[name] * len(model.layers)
        row = {"part": name, "us": round(t, 1), "GB": round(b / 1e9, 3),
               "roof": round(b / (copy_gbps * 1e3) / t, 3) if b else None,
               "products_roof": round(b / (copy_gbps * 1e3) / (t - pk), 3) if b and name != "step" else None}
        rows.append(row)
        extra = f", {row['roof']:.3f} of the roofline" if b else ""
        extra += f"; less its packs ({pk:.0f} us) {row['products_roof']:.3f}" if row["products_roof"] else ""
        print(f"{name:26s} {t:8.1f} us (runs {[round(v) for v in runs[name]]}), {b / 1e9:6.3f} GB{extra}", flush=True)
    if args.json:
        rep = {"copy_GBps": round(copy_gbps, 1), "parts": rows, "pack_us": round(per_pack, 2)}
        json_saver(rep, args.json, t_start)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
