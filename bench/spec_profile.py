"""Host-side costs of the speculative loop (services/engine/speculative.py) against plain decoding, under cProfile:
where the Python time of a request goes when the model is small enough that the device (or BLAS) waits on it.

    python3 bench/spec_profile.py [--device cuda:0] [--budget 22|chain|auto] [--n-prompts 4] [--max-tokens 64]

The embedded pair (or --model / --draft) on --device; after a warm-up, the same prompts are decoded plainly and
speculatively, each under its own profiler; prints wall time per generated token and per step, and the functions
with the most own time and cumulative time of each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.engine.budget import BudgetTuner  # noqa: E402
from services.engine.generate import generate  # noqa: E402
from services.engine.placement import load_drafter_on, load_target_on  # noqa: E402
from services.engine.speculative import SpecConfig, speculative_generate  # noqa: E402


def profiled(fn, top: int) -> tuple[float, str]:
    """(wall seconds, the profile's top functions by own time and by cumulative time) of fn()."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return wall, out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget", default="22", help="a DDTree budget, chain or auto")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if not args.model:
        from services.engine.default_model import default_model_paths

        args.model, args.draft = default_model_paths()
    from services.engine.default_model import heldout_prompts

    target = load_target_on(args.model, args.device)
    placed = load_drafter_on(args.draft, target.model, args.device)
    tok = target.tokenizer
    prompts = [tok.encode(p) for p in heldout_prompts()[: args.n_prompts]]
    if args.budget == "auto":
        spec = SpecConfig.auto(BudgetTuner.measure(target.model, capture=placed.drafter.target_layer_ids))
    else:
        spec = SpecConfig(budget=None if args.budget == "chain" else int(args.budget))
    for p in prompts[:2]:  # warm-up: kernel builds, graph captures
        generate(target.model, p, args.max_tokens)
        speculative_generate(target.model, placed.new_proposer(), p, args.max_tokens, spec=spec)
    outs: dict[str, list] = {"plain": [], "spec": []}

    def plain() -> None:
        outs["plain"] = [generate(target.model, p, args.max_tokens) for p in prompts]

    def spec_run() -> None:
        outs["spec"] = [speculative_generate(target.model, placed.new_proposer(), p, args.max_tokens, spec=spec)
                        for p in prompts]

    t_plain, prof_plain = profiled(plain, args.top)
    t_spec, prof_spec = profiled(spec_run, args.top)
    n_plain = sum(len(r.token_ids) for r in outs["plain"])
    n_spec = sum(len(r.token_ids) for r in outs["spec"])
    steps = sum(r.spec["steps"] for r in outs["spec"])
    acc = sum(r.spec["accepted"] for r in outs["spec"])
    print(f"plain: {n_plain} tokens in {t_plain * 1e3:.1f} ms under the profiler ({t_plain / n_plain * 1e3:.3f} ms a "
          f"token)")
    print(f"spec (budget {args.budget}): {n_spec} tokens, {steps} steps, {(acc + steps) / max(steps, 1):.2f} tokens a "
          f"step, {t_spec * 1e3:.1f} ms ({t_spec / max(steps, 1) * 1e3:.3f} ms a step); identical: "
          f"{all(a.token_ids == b.token_ids for a, b in zip(outs['spec'], outs['plain']))}")
    print("\n== plain decoding\n" + prof_plain)
    print("\n== speculative decoding\n" + prof_spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
