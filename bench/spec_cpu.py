"""Speculative vs plain decoding on the CPU (NumPy backend), measured in one run.

Prints, per mode (chain, DDTree budgets), the wall-time ratio spec_tok/s / plain_tok/s and the mean
acceptance length over the same prompts; greedy, so the outputs are also checked to be identical.

    python bench/spec_cpu.py [--model target.gguf --draft drafter] [--prompts file.txt] [--max-tokens 64]
    python bench/spec_cpu.py --pair cycle        # the known-good pair (tests/data/cycle_pair)

`--budgets` takes numbers, `chain` and `auto` (the budget tuner, measured on this machine at start).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.engine.budget import BudgetTuner  # noqa: E402
from services.engine.generate import generate  # noqa: E402
from services.engine.loader import load_target  # noqa: E402
from services.engine.models.dflash import load_drafter  # noqa: E402
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="file with one prompt per line (\\n escapes allowed)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="chain,8,22")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--pair", choices=("default", "cycle"), default="default",
                    help="without --model: the embedded default pair, or the known-good cycle pair")
    args = ap.parse_args()
    if not args.model and args.pair == "cycle":
        pair = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                            "cycle_pair")
        args.model, args.draft = os.path.join(pair, "target.gguf"), os.path.join(pair, "drafter")
        args.prompts = args.prompts or os.path.join(pair, "prompts.txt")
    if not args.model:
        from services.engine.default_model import default_model_paths

        args.model, args.draft = default_model_paths()
    target = load_target(args.model)
    drafter = load_drafter(args.draft, target.model)
    tok = target.tokenizer
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    else:
        from services.engine.default_model import heldout_prompts

        prompts = heldout_prompts()
    prompts = prompts[: args.n_prompts]
    ids = [tok.encode(p) for p in prompts]

    def timed(fn):
        t0 = time.perf_counter()
        outs = [fn(p) for p in ids]
        return outs, time.perf_counter() - t0

    generate(target.model, ids[0], 4)      # warm-up
    plain, t_plain = timed(lambda p: generate(target.model, p, args.max_tokens))
    n_plain = sum(len(r.token_ids) for r in plain)
    rows = []
    tuner = None
    for b in args.budgets.split(","):
        if b == "auto":
            tuner = tuner or BudgetTuner.measure(target.model)
            spec = SpecConfig.auto(tuner)
        else:
            spec = SpecConfig(budget=None if b == "chain" else int(b))
        outs, t = timed(lambda p, spec=spec: speculative_generate(target.model, LocalProposer(drafter), p,
                                                                  args.max_tokens, spec=spec))
        same = all(o.token_ids == r.token_ids for o, r in zip(outs, plain))
        steps = sum(o.spec["steps"] for o in outs)
        acc = sum(o.spec["accepted"] for o in outs)
        n = sum(len(o.token_ids) for o in outs)
        nodes = sum(o.spec["draft_tokens"] for o in outs)
        rows.append({"mode": b, "speedup": (n / t) / (n_plain / t_plain), "mean_acceptance_length":
                     (acc + steps) / max(steps, 1), "mean_tree_nodes": nodes / max(steps, 1),
                     "identical_to_plain": same})
    print(f"plain: {n_plain} tokens over {len(ids)} prompts, {n_plain / t_plain:.1f} tok/s (baseline, this run)")
    print(f"{'mode':>8} {'spec/plain speed':>17} {'mean accept len':>16} {'tree nodes':>11} {'identical':>10}")
    for r in rows:
        print(f"{r['mode']:>8} {r['speedup']:>16.2f}x {r['mean_acceptance_length']:>16.2f} "
              f"{r['mean_tree_nodes']:>11.1f} {str(r['identical_to_plain']):>10}")
    if tuner is not None:
        print(f"auto: {json.dumps(tuner.snapshot())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain_tok_s": n_plain / t_plain, "rows": rows}, f, indent=1)
    return 0 if all(r["identical_to_plain"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
