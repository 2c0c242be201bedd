"""Kernels a GPU server loads during requests after its start-up (issue 5: no request pays an NVRTC build, 0.4-0.5 s
each on a cold cache, nor a CUDA-graph capture of a shape it could have known).

    python3 bench/warm_check.py [--device cuda:0] [--model M --draft D] [--max-ctx 1024] [--json PATH]

In this (fresh) process: the target and its GPU drafter loaded, reserve_serving, the `--budget auto` calibration and
the warm-up generation as the verifier runs them; then requests with prompts of several lengths (each token-tile
class, past 64, past a prefill chunk), decoded plainly and with auto (a request's own fixed budget captures its
width once per state). Prints what was loaded during the requests: kernels fetched through kernels/loader.py, CuPy
modules compiled or read from its disk cache (its own elementwise kernels too), and graphs captured (target steps,
drafter passes, commits: graphs are per 512 / 1024 / ... bucket of the context, and start-up captures the first
bucket's). Exit status 1 when any kernel was loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_LENGTHS = (5, 37, 53, 100, 300, 700)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--max-ctx", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import cupy
    import numpy as np
    from cupy.cuda import compiler

    from kernels import loader
    from services.engine.budget import BudgetTuner
    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.logprobs import MAX_TOP_LOGPROBS
    from services.engine.placement import load_drafter_on, load_target_on, reserve_serving
    from services.engine.speculative import AUTO_MAX_BUDGET, SpecConfig, speculative_generate, speculative_stream

    modules = {"n": 0, "serving": False, "sources": []}
    real = compiler._compile_with_cache_cuda

    def counted(source, *a, **kw):   # every CuPy module this process loads: NVRTC build or its disk cache
        modules["n"] += 1
        if modules["serving"]:
            modules["sources"].append(" ".join(str(source).split())[:300])
        return real(source, *a, **kw)

    compiler._compile_with_cache_cuda = counted
    model_path, draft_path = (args.model, args.draft) if args.model else default_model_paths()
    t0 = time.perf_counter()
    target = load_target_on(model_path, args.device, with_tokenizer=False)
    placed = load_drafter_on(draft_path, target.model, args.device)
    g, dr = target.model, placed.drafter
    layers = tuple(dr.target_layer_ids)
    width = reserve_serving(g, dr, 1, args.max_ctx, AUTO_MAX_BUDGET, True, len(layers), args.device)
    tuner = BudgetTuner.measure(g, min(AUTO_MAX_BUDGET, width - 1), capture=layers, states=1)
    # the verifier's warm-up generation (services/verifier/service.py WARMUP_TOKENS)
    for _ in speculative_stream(g, placed.new_proposer(), [1, 2, 3, 4], 2, spec=SpecConfig.auto(tuner),
                                max_ctx=args.max_ctx):
        pass
    for _ in speculative_stream(g, placed.new_proposer(), [1, 2, 3, 4], 3, spec=SpecConfig.auto(tuner),
                                max_ctx=args.max_ctx, top_logprobs=MAX_TOP_LOGPROBS,
                                prompt_logprobs=MAX_TOP_LOGPROBS):   # and one with logprobs (the verifier's too)
        pass
    modules["serving"] = True
    start = {"s": round(time.perf_counter() - t0, 2), "loader": loader.functions_loaded(), "modules": modules["n"]}
    names = set(loader.function_names())
    counts = lambda: (g.graph_stats["captures"], dr.graph_stats["captures"],  # noqa: E731
                      sum(len(st.commit_graphs) for st in g._state_pool))
    c0 = counts()
    rng = np.random.default_rng(0)
    runs = []
    for n in PROMPT_LENGTHS:
        if n + 40 >= args.max_ctx:
            continue
        prompt = [int(t) for t in rng.integers(0, g.cfg.n_vocab, n)]
        m0, f0, k0 = modules["n"], loader.functions_loaded(), counts()
        generate(g, prompt, 8)
        speculative_generate(g, placed.new_proposer(), prompt, 24, spec=SpecConfig.auto(tuner))
        # requests asking for logprobs: plain (steps that read their rows) and speculative (a verify's path rows)
        generate(g, prompt, 4, top_logprobs=n % 21)
        speculative_generate(g, placed.new_proposer(), prompt, 12, spec=SpecConfig.auto(tuner), top_logprobs=2)
        generate(g, prompt, 0, prompt_logprobs=1)      # a scored prompt (OpenAI echo): its chunks' every row
        cupy.cuda.get_current_stream().synchronize()
        k1 = counts()
        runs.append({"prompt": n, "loader": loader.functions_loaded() - f0, "modules": modules["n"] - m0,
                     "captures": [b - a for a, b in zip(k0, k1)]})
    c1 = counts()
    rep = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "start_up": start, "requests": runs,
           "loaded_during_requests": sorted(set(loader.function_names()) - names),
           "cupy_sources_during_requests": modules["sources"],
           "captured_during_requests": {"target_steps": c1[0] - c0[0], "drafter_passes": c1[1] - c0[1],
                                        "commits_pooled": c1[2] - c0[2]}}
    print(json.dumps(rep, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 1 if rep["loaded_during_requests"] or any(r["modules"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
