"""Replay speculative-decoding policies over measured per-position acceptance, at given step costs (no timing noise).

    python bench/spec_replay.py --collect curves.npz [--first 0 --n-prompts 32 --max-tokens 96]
    python bench/spec_replay.py --replay curves.npz [--costs tuner.json] [--json out.json]

`--collect` decodes each held-out prompt of the embedded pair greedily and, at every position of the output, drafts
one block, builds the 64-node DDTree, verifies it and keeps how many drafted tokens a tree of its first b nodes
would commit, for every b (a best-first tree's prefix is the tree a smaller budget builds, and greedy acceptance in
a prefix is the longest start of the full tree's accepted path that lies in it), with the drafter's path
log-probabilities. Greedy output does not depend on the policy, so these curves say what any policy would commit
at any step.

`--replay` then walks each prompt's positions under each policy: fixed budgets and chain, `--budget auto` (the
engine's BudgetTuner and its pause rule, fed the replayed times), and an oracle that knows every step's acceptance
(dynamic programming over positions: the best any scheduler of this drafter can do at these costs). Costs: the
tuner's calibration on this machine (verify at each width, a plain step; the drafter pass and top-k timed here),
or `--costs` a JSON object with "verify_ms" {width: ms}, "draft_ms" and "plain_ms" (the `auto:` line that
bench/spec_cpu.py prints has that form: the tuner's in-loop view), optionally "widths" (a GPU target's graph
widths, `verify_widths`, which `auto` keeps to). `--verify-scale`/`--draft-scale` multiply them
(what-if: how cheap must a verify or a draft be for 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.engine.budget import BudgetTuner  # noqa: E402
from services.engine.ddtree import DraftTree, build_ddtree  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from services.engine.speculative import TREE_TOPK, LocalProposer, walk_tree  # noqa: E402

MAX_BUDGET = 64


def collect(target, drafter, prompts: list[list[int]], max_tokens: int, budget: int = MAX_BUDGET) -> dict:
    """Per prompt: accepted drafted tokens for every prefix size 0..budget at every position, and path log-probs."""
    from services.engine.generate import generate, prefill

    acc, logw, starts = [], [], [0]
    for ids in prompts:
        out = generate(target, ids, max_tokens).token_ids
        state = target.new_state(len(ids) + max_tokens + budget + 8)
        _, feats = prefill(target, state, ids, capture=drafter.target_layer_ids)
        prop = LocalProposer(drafter)
        for root in out[:-1]:
            top_ids, top_lp = prop.propose(feats, root, state.n_past, TREE_TOPK)
            tree = build_ddtree(top_ids, top_lp, budget)
            tokens, parents = tree.verify_batch(root)
            res = target.forward(state, tokens, parents, checkpoints=True, logits="rows")
            path, _ = walk_tree(tree, res.logits, SamplingParams(), np.random.default_rng(0))
            state.pending = None
            nodes = np.array(path[1:], np.int64) - 1                 # tree indices along the accepted path
            b = np.arange(budget + 1)
            # accepted in the prefix of b nodes: the leading path nodes with index < b (indices grow along a path)
            acc.append(np.searchsorted(nodes, b, side="left") if len(nodes) else np.zeros(budget + 1, np.int64))
            lw = np.full(budget, -np.inf)
            lw[:len(tree)] = tree.logw
            logw.append(lw)
            step = target.forward(state, [root], capture=drafter.target_layer_ids, logits="none")
            state.commit([0])
            feats = step.captured
        starts.append(len(acc))
    return {"acc": np.array(acc, np.int16), "logw": np.array(logw, np.float32), "starts": np.array(starts)}


class Costs:
    def __init__(self, verify_ms: dict, draft_ms: float, plain_ms: float, widths=None):
        self.verify_ms = {int(w): float(v) for w, v in verify_ms.items()}
        self.draft_ms, self.plain_ms = float(draft_ms), float(plain_ms)
        self.widths = tuple(int(w) for w in widths) if widths else None     # a GPU target's graph widths
        xs = np.array(sorted(self.verify_ms), np.float64)
        self._xs, self._ys = xs, np.maximum.accumulate(np.array([self.verify_ms[int(x)] for x in xs]))

    def verify(self, width: int) -> float:
        return float(np.interp(width, self._xs, self._ys))

    def scaled(self, verify: float = 1.0, draft: float = 1.0) -> Costs:
        return Costs({w: v * verify for w, v in self.verify_ms.items()}, self.draft_ms * draft, self.plain_ms,
                     self.widths)


def measure_costs(target, drafter, prompts: list[list[int]], max_tokens: int) -> Costs:
    """The tuner's in-loop view after `--budget auto` decodes the prompts: its calibrated verify curve times the
    drift it observed, the running drafter pass (append, block, logits) and plain step."""
    from services.engine.speculative import SpecConfig, speculative_generate

    tuner = BudgetTuner.measure(target, capture=drafter.target_layer_ids)
    for ids in prompts:
        speculative_generate(target, LocalProposer(drafter), ids, max_tokens, spec=SpecConfig.auto(tuner))
    snap = tuner.snapshot()
    return Costs({w: v * snap["verify_scale"] for w, v in snap["verify_ms"].items()}, snap["draft_ms"],
                 snap["plain_ms"])


def _prompts(curves: dict):
    s = curves["starts"]
    return [(curves["acc"][a:b], curves["logw"][a:b]) for a, b in zip(s[:-1], s[1:])]


def replay_fixed(curves: dict, costs: Costs, budget: int) -> float:
    """Plain time / policy time over all prompts: a tree of `budget` nodes every step (15 = the chain)."""
    t = n = 0.0
    for acc, _ in _prompts(curves):
        i = 0
        while i < len(acc):
            t += costs.draft_ms + costs.verify(budget + 1)
            i += int(acc[i][budget]) + 1
        n += len(acc)
    return n * costs.plain_ms / t


def replay_auto(curves: dict, costs: Costs) -> float:
    """`--budget auto` as speculative.py runs it: BudgetTuner.choose, observe and pause_after_step; one tuner per
    prompt, each starting from the costs (bench/spec_cpu.py shares one across its prompts)."""
    t = n = 0.0
    for acc, logw in _prompts(curves):
        tuner = BudgetTuner({w: v / 1e3 for w, v in costs.verify_ms.items()}, max_budget=MAX_BUDGET,
                            plain_s=costs.plain_ms / 1e3, widths=costs.widths)
        i, plain_left, pause = 0, 0, 0
        while i < len(acc):
            if plain_left > 0:
                plain_left -= 1
                t += costs.plain_ms
                tuner.observe_plain(costs.plain_ms / 1e3)
                i += 1
                continue
            lw = logw[i][np.isfinite(logw[i])]
            tree = DraftTree(np.zeros(len(lw), np.int64), np.zeros(len(lw), np.int64), np.zeros(len(lw), np.int64), lw)
            b = tuner.choose(tree)
            a = int(acc[i][b])
            v = costs.verify(b + 1)
            t += costs.draft_ms + v
            tuner.observe(tree, b, a, verify_s=v / 1e3, draft_s=costs.draft_ms / 1e3)
            plain_left = pause = tuner.pause_after_step(pause)
            i += a + 1
        n += len(acc)
    return n * costs.plain_ms / t


def replay_oracle(curves: dict, costs: Costs) -> float:
    """The fastest schedule knowing every step's acceptance: per position, plain or draft with the best budget."""
    t = n = 0.0
    step_cost = costs.draft_ms + np.array([costs.verify(b + 1) for b in range(MAX_BUDGET + 1)])
    for acc, _ in _prompts(curves):
        m = len(acc)
        best = np.zeros(m + MAX_BUDGET + 2)
        for i in range(m - 1, -1, -1):
            nxt = np.minimum(i + acc[i][1:].astype(np.int64) + 1, m)
            best[i] = min(costs.plain_ms + best[i + 1], float(np.min(step_cost[1:] + best[nxt])))
        t += best[0]
        n += m
    return n * costs.plain_ms / t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", help="write per-position acceptance curves here (.npz)")
    ap.add_argument("--replay", help="replay policies over these curves (.npz)")
    ap.add_argument("--first", type=int, default=0, help="first held-out prompt (--collect)")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--costs", help="JSON with verify_ms, draft_ms, plain_ms (default: measured here)")
    ap.add_argument("--verify-scale", type=float, default=1.0)
    ap.add_argument("--draft-scale", type=float, default=1.0)
    ap.add_argument("--sets", type=int, default=1, help="report the replay over this many equal prompt sets too")
    ap.add_argument("--json", help="write the replay results here")
    args = ap.parse_args()
    if not (args.collect or args.replay):
        ap.error("give --collect or --replay")
    from services.engine.default_model import default_model_paths, heldout_prompts
    from services.engine.placement import load_drafter_on, load_target_on

    target = drafter = None
    if args.collect or not args.costs:
        model, draft = default_model_paths()
        lt = load_target_on(model, "cpu")
        target, drafter = lt.model, load_drafter_on(draft, lt.model, "cpu").drafter
        prompts = [lt.tokenizer.encode(p) for p in heldout_prompts()[args.first:args.first + args.n_prompts]]
    if args.collect:
        t0 = time.perf_counter()
        curves = collect(target, drafter, prompts, args.max_tokens)
        np.savez(args.collect, **curves)
        print(f"{len(curves['acc'])} positions of {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s "
              f"-> {args.collect}")
    if not args.replay:
        return 0
    curves = dict(np.load(args.replay))
    if args.costs:
        with open(args.costs) as f:
            c = json.load(f)
        costs = Costs(c["verify_ms"], c["draft_ms"], c["plain_ms"], c.get("widths"))
    else:
        costs = measure_costs(target, drafter, prompts[:4], args.max_tokens)
    costs = costs.scaled(args.verify_scale, args.draft_scale)
    print(f"costs (ms): plain {costs.plain_ms:.2f}, draft {costs.draft_ms:.2f}, verify "
          + " ".join(f"{w}:{v:.2f}" for w, v in sorted(costs.verify_ms.items())))
    n_prompts = len(curves["starts"]) - 1
    groups = [(0, n_prompts)]
    if args.sets > 1:
        size = n_prompts // args.sets
        groups += [(k * size, (k + 1) * size) for k in range(args.sets)]
    policies = {"chain": lambda c: replay_fixed(c, costs, 15),
                **{f"ddtree-{b}": (lambda c, b=b: replay_fixed(c, costs, b)) for b in (8, 16, 22, 32)},
                "auto": lambda c: replay_auto(c, costs), "oracle": lambda c: replay_oracle(c, costs)}
    rows = {}
    for name, fn in policies.items():
        rows[name] = []
        for a, b in groups:
            s = curves["starts"]
            sub = {"acc": curves["acc"][s[a]:s[b]], "logw": curves["logw"][s[a]:s[b]], "starts": s[a:b + 1] - s[a]}
            rows[name].append(fn(sub))
    head = "all prompts" + "".join(f"  set {k + 1}" for k in range(len(groups) - 1))
    print(f"{'policy':>10}  speed-up over plain ({head})")
    for name, vals in rows.items():
        print(f"{name:>10}  " + "  ".join(f"{v:.2f}x" for v in vals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": {"verify_ms": costs.verify_ms, "draft_ms": costs.draft_ms, "plain_ms": costs.plain_ms},
                       "groups": groups, "speedup": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
