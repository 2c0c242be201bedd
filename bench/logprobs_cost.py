"""What OpenAI `logprobs` cost a GPU request, as ratios measured in one process: greedy decoding (plain and
speculative) with top_logprobs against without, and a prompt scored (echo: every row of every chunk) against a plain
prefill.

    python3 bench/logprobs_cost.py [--model M --draft D] [--device cuda:0|cpu] [--tokens 128] [--prompt 512] [--top 5]

Plain greedy decoding without logprobs runs a step ahead of the host (decode_ahead); with them every step reads its
row, so that ratio also holds the lost overlap. Speculative steps compute their path rows' values after the walk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import numpy as np

    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.placement import load_drafter_on, load_target_on, reserve_serving
    from services.engine.speculative import SpecConfig, speculative_generate

    model_path, draft_path = (args.model, args.draft) if args.model else default_model_paths()
    target = load_target_on(model_path, args.device, with_tokenizer=False)
    placed = load_drafter_on(draft_path, target.model, args.device) if draft_path else None
    g = target.model
    ctx = 1 << (args.prompt + args.tokens + 64).bit_length()
    reserve_serving(g, placed.drafter if placed else None, 1, ctx, 22 if placed else None, bool(placed),
                    len(placed.drafter.target_layer_ids) if placed else 0, args.device)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, g.cfg.n_vocab, args.prompt)]
    short = prompt[:16]

    def best(fn) -> float:
        fn()                                   # warm: graphs, kernels
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    n, k = args.tokens, args.top
    rows = {}
    rows["plain"] = best(lambda: generate(g, short, n, max_ctx=ctx))
    rows["plain_logprobs"] = best(lambda: generate(g, short, n, max_ctx=ctx, top_logprobs=k))
    if placed:
        spec = SpecConfig(budget=22)
        rows["spec"] = best(lambda: speculative_generate(g, placed.new_proposer(), short, n, spec=spec, max_ctx=ctx))
        rows["spec_logprobs"] = best(lambda: speculative_generate(g, placed.new_proposer(), short, n, spec=spec,
                                                                   max_ctx=ctx, top_logprobs=k))
    rows["prefill"] = best(lambda: generate(g, prompt, 1, max_ctx=ctx))
    rows["prefill_scored"] = best(lambda: generate(g, prompt, 1, max_ctx=ctx, prompt_logprobs=k))
    device = args.device
    if device.startswith("cuda"):
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rep = {"device": device, "model": os.path.basename(model_path),
           "n_vocab": g.cfg.n_vocab, "tokens": n, "prompt": args.prompt, "top_logprobs": k,
           "seconds": {key: round(v, 4) for key, v in rows.items()},
           "ratios": {"plain": round(rows["plain_logprobs"] / rows["plain"], 3),
                      "prompt_scored": round(rows["prefill_scored"] / rows["prefill"], 3)}}
    if placed:
        rep["ratios"]["speculative"] = round(rows["spec_logprobs"] / rows["spec"], 3)
    print(json.dumps(rep, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
