"""Speculative vs plain decoding on the CPU (NumPy backend) or a GPU (`--device cuda:N`), measured in one run.

Prints, per mode (chain, DDTree budgets), the wall-time ratio spec_tok/s / plain_tok/s (whole requests, the
prompt's prefill included, and decode only) and the mean acceptance length over the same prompts; greedy, so the
outputs are also checked to be identical. Plain and the modes run in turn prompt by prompt, so that a burst of
load elsewhere does not land on one mode only.

    python bench/spec_cpu.py [--model target.gguf --draft drafter] [--prompts file.txt] [--max-tokens 64]
    python bench/spec_cpu.py --pair cycle        # the known-good pair (tests/data/cycle_pair)
    python bench/spec_cpu.py --device cuda:0 [--draft-device cpu]   # target (and drafter) on a GPU
    python bench/spec_cpu.py --feature-dtype f16   # the drafter sees features rounded as a remote one's wire would

`--budgets` takes numbers, `chain` and `auto` (the budget tuner, measured on this machine at start).

    python bench/spec_cpu.py --costs [--widths 2,4,8,16,24]

prints instead what each piece of a speculative step costs next to a plain step (process CPU time, the
minimum over interleaved rounds, so load elsewhere on the machine mostly cancels; with several BLAS threads
their spinning counts too, so OPENBLAS_NUM_THREADS=1 gives the cleanest figures), and from them how many
tokens each verify width must commit per step for speculative decoding to reach 2x plain.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.engine.budget import CALIBRATION_ROWS_READ, BudgetTuner  # noqa: E402
from services.engine.ddtree import build_ddtree, topk_logprobs  # noqa: E402
from services.engine.generate import generate, prefill  # noqa: E402
from services.engine.placement import check_devices, load_drafter_on, load_target_on  # noqa: E402
from services.engine.speculative import TREE_TOPK, LocalProposer, SpecConfig, speculative_generate  # noqa: E402


def piece_costs(model, drafter, prompt_ids: list[int], widths: list[int], rounds: int = 20) -> dict[str, float]:
    """Seconds of process CPU time per piece (plain step, drafter pass, top-k, verify + commit at each width, the
    verify reading the logits rows a walk reads), each the minimum over `rounds` interleaved rounds; the sequence
    state is restored after every piece."""
    state = model.new_state(len(prompt_ids) + max(widths) + 8)
    _, feats = prefill(model, state, prompt_ids, capture=drafter.target_layer_ids)
    proposer = LocalProposer(drafter)
    root = int(prompt_ids[-1])
    top_ids, top_lp = proposer.propose(feats, root, state.n_past, TREE_TOPK)
    draft_logits = drafter.draft(proposer.session, None, root, state.n_past)

    def step(tokens, parents, path, read_rows=0, **kw):
        def run():
            ssm, conv, n_past = dict(state.ssm), dict(state.conv), state.n_past
            out = model.forward(state, tokens, parents, **kw)
            for row in range(read_rows):            # the logits rows a walk reads (computed when read)
                out.logits[row]
            state.commit(path)
            state.ssm, state.conv, state.n_past = ssm, conv, n_past
        return run

    pieces = {"plain": step([root], None, [0], logits="last"),
              "draft": lambda: drafter.draft(proposer.session, None, root, state.n_past),
              "topk": lambda: topk_logprobs(draft_logits, TREE_TOPK)}
    for w in widths:
        tokens, parents = build_ddtree(top_ids, top_lp, w - 1).verify_batch(root)
        pieces[f"verify{w}"] = step(tokens, parents, [0, 1] if w > 1 else [0], min(w, CALIBRATION_ROWS_READ),
                                    capture=drafter.target_layer_ids, checkpoints=True, logits="rows")
    best = {k: float("inf") for k in pieces}
    for r in range(rounds + 1):                          # round 0 warms caches and allocations
        for k, fn in pieces.items():
            t0 = time.process_time()
            fn()
            if r:
                best[k] = min(best[k], time.process_time() - t0)
    return best


class WireRounded:
    """A proposer whose features are rounded to the wire's dtype first, as a drafter service's client sends them
    (`--draft-features f16`): the drafter's acceptance with what a remote drafter would see."""

    def __init__(self, inner, dtype):
        self.inner, self.dtype = inner, dtype
        self.block_size, self.target_layer_ids = inner.block_size, inner.target_layer_ids

    def _round(self, features):
        return None if features is None else np.asarray(features).astype(self.dtype).astype(np.float32)

    def propose(self, new_features, last_token, start, k):
        return self.inner.propose(self._round(new_features), last_token, start, k)

    def append_features(self, new_features, start: int) -> None:
        self.inner.append_features(self._round(new_features), start)

    def close(self) -> None:
        self.inner.close()


def print_costs(costs: dict[str, float]) -> None:
    p = costs["plain"]
    print(f"plain step {p * 1e3:.2f} ms CPU; each piece as a multiple of it:")
    print("  " + "  ".join(f"{k} {v / p:.2f}" for k, v in costs.items()))
    over = costs["draft"] + costs["topk"]
    for k, v in costs.items():
        if k.startswith("verify"):
            print(f"  width {k[6:]:>3}: a step costs {(over + v) / p:.2f} plain steps; 2x plain needs "
                  f"{2 * (over + v) / p:.2f} tokens committed per step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="file with one prompt per line (\\n escapes allowed)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="chain,8,22")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--costs", action="store_true", help="print the CPU cost of each piece of a step and exit")
    ap.add_argument("--widths", default="2,4,8,12,16,24", help="verify widths for --costs")
    ap.add_argument("--pair", choices=("default", "cycle"), default="default",
                    help="without --model: the embedded default pair, or the known-good cycle pair")
    ap.add_argument("--device", default="cpu", help="where the target runs: cpu or cuda:N (wall time either way)")
    ap.add_argument("--draft-device", default=None, help="the drafter's device (default: the target's)")
    ap.add_argument("--feature-dtype", choices=("f32", "f16"), default="f32",
                    help="round the features the drafter sees to this dtype (f16: what `--draft-features f16` sends a "
                         "remote drafter); greedy outputs stay identical, the acceptance length shows the cost")
    ap.add_argument("--warm-up", type=int, default=None,
                    help="untimed prompts run through every mode first (other prompts than the timed ones where there "
                         "are enough; default: 4 on a GPU, where each new step shape is a CUDA-graph capture that a "
                         "serving process pays once, 0 on the CPU)")
    args = ap.parse_args()
    draft_device = check_devices(args.device, args.draft_device)
    if args.costs and args.device != "cpu":
        ap.error("--costs measures process CPU time: it needs --device cpu")
    if not args.model and args.pair == "cycle":
        pair = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                            "cycle_pair")
        args.model, args.draft = os.path.join(pair, "target.gguf"), os.path.join(pair, "drafter")
        args.prompts = args.prompts or os.path.join(pair, "prompts.txt")
    if not args.model:
        from services.engine.default_model import default_model_paths

        args.model, args.draft = default_model_paths()
    target = load_target_on(args.model, args.device)
    placed = load_drafter_on(args.draft, target.model, draft_device)
    drafter = placed.drafter

    def new_proposer():
        p = placed.new_proposer()
        return p if args.feature_dtype == "f32" else WireRounded(p, np.float16)
    tok = target.tokenizer
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    else:
        from services.engine.default_model import heldout_prompts

        prompts = heldout_prompts()
    n_warm = args.warm_up if args.warm_up is not None else (0 if args.device == "cpu" else 4)
    spare = prompts[args.n_prompts:]
    warm = (spare if len(spare) >= n_warm else prompts)[:n_warm]
    prompts = prompts[: args.n_prompts]
    ids = [tok.encode(p) for p in prompts]
    if args.costs:
        print_costs(piece_costs(target.model, drafter, ids[0], [int(w) for w in args.widths.split(",")]))
        return 0

    # Prompt by prompt, plain and every mode in turn: load elsewhere on the machine then falls on all modes
    # alike instead of on whichever mode happened to run during a busy minute.
    modes = args.budgets.split(",")
    tuner = BudgetTuner.measure(target.model, capture=drafter.target_layer_ids) if "auto" in modes else None
    def make_specs(t):
        return {b: SpecConfig.auto(t) if b == "auto" else SpecConfig(budget=None if b == "chain" else int(b))
                for b in modes}

    generate(target.model, ids[0], 4)      # warm-up
    if warm:
        # the timed runs start from the tuner as calibrated (a copy): what it learns here is not carried over
        specs = make_specs(copy.deepcopy(tuner))
        for p in (tok.encode(w) for w in warm):
            generate(target.model, p, args.max_tokens)
            for spec in specs.values():
                speculative_generate(target.model, new_proposer(), p, args.max_tokens, spec=spec)
    specs = make_specs(tuner)
    plain, t_plain = [], 0.0
    runs = {b: ([], 0.0) for b in modes}
    for p in ids:
        t0 = time.perf_counter()
        plain.append(generate(target.model, p, args.max_tokens))
        t_plain += time.perf_counter() - t0
        for b, spec in specs.items():
            t0 = time.perf_counter()
            out = speculative_generate(target.model, new_proposer(), p, args.max_tokens, spec=spec)
            runs[b] = (runs[b][0] + [out], runs[b][1] + time.perf_counter() - t0)
    n_plain = sum(len(r.token_ids) for r in plain)
    dec_plain = sum(r.decode_ms for r in plain)          # without the prompt's prefill, which both modes share
    rows = []
    for b in modes:
        outs, t = runs[b]
        same = all(o.token_ids == r.token_ids for o, r in zip(outs, plain))
        steps = sum(o.spec["steps"] for o in outs)
        acc = sum(o.spec["accepted"] for o in outs)
        n = sum(len(o.token_ids) for o in outs)
        nodes = sum(o.spec["draft_tokens"] for o in outs)
        dec = sum(o.decode_ms for o in outs)
        rows.append({"mode": b, "speedup": (n / t) / (n_plain / t_plain),
                     "decode_speedup": (n / dec) / (n_plain / dec_plain), "mean_acceptance_length":
                     (acc + steps) / max(steps, 1), "mean_tree_nodes": nodes / max(steps, 1),
                     "identical_to_plain": same})
    print(f"plain ({args.device}, drafter on {draft_device}): {n_plain} tokens over {len(ids)} prompts, "
          f"{n_plain / t_plain:.1f} tok/s (baseline, this run)")
    print(f"{'mode':>8} {'spec/plain speed':>17} {'decode only':>12} {'mean accept len':>16} {'tree nodes':>11} "
          f"{'identical':>10}")
    for r in rows:
        print(f"{r['mode']:>8} {r['speedup']:>16.2f}x {r['decode_speedup']:>11.2f}x "
              f"{r['mean_acceptance_length']:>16.2f} {r['mean_tree_nodes']:>11.1f} {str(r['identical_to_plain']):>10}")
    if tuner is not None:
        print(f"auto: {json.dumps(tuner.snapshot())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "draft_device": draft_device, "plain_tok_s": n_plain / t_plain,
                       "rows": rows}, f, indent=1)
    return 0 if all(r["identical_to_plain"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
