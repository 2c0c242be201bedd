"""`--budget auto`: pick each step's DDTree size from the measured verify cost and the running acceptance.

A best-first DDTree grows in order of draft path probability, so the tree for budget b is the first b
nodes of the tree for any larger budget. Node i is accepted with probability about kappa * p_i (p_i: its
draft path probability; kappa: the running ratio of accepted tokens to the drafter's own prediction), so a
step that keeps b nodes commits 1 + sum_{i<b} min(1, kappa p_i) tokens in expectation and costs
draft + verify(b + 1). The tuner keeps the b that maximises their ratio. verify(w) comes from timing the
target at a few widths once (then follows the times it observes), so the choice follows the hardware: a
CPU whose small matrix products get dearer with width picks small trees; a GPU whose verify is nearly flat
picks large ones.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .ddtree import DraftTree
from .sampling import SamplingParams, greedy_tokens, sample_row

# 12 and 20 as well: on the CPU a verify's cost steps at multiples of 4 and 8 (layers.padded_rows), which
# interpolating between 8, 16 and 24 alone would smooth over
CALIBRATION_WIDTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 65)


# Depth of the calibration trees' chain: a DFlash block of 16 drafts 15 tokens after the root (calibration_parents)
CALIBRATION_DEPTH = 15

# Committed tokens before the calibration's steps (less when a pooled state has no room for them)
CALIBRATION_CONTEXT = 64
PLAIN_REPS = 4

# Logits rows a greedy walk reads per verify, for calibration: the accepted tokens plus one (the embedded pair
# accepts 2.4-3.3 drafted tokens a step); on the NumPy engine each read row is computed when read (RowLogits).
CALIBRATION_ROWS_READ = 4
GREEDY = SamplingParams()


@contextmanager
def _scratch_states(target, n_ctx: int, n: int = 1):
    """States for a measurement: from the target's pool when it keeps one (a GPU target: no state beyond the ones
    the memory plan counts, and the graphs captured here serve requests later; `n` at once, so each is another
    pooled state), else one new state (no graphs to warm: one measurement is enough)."""
    acquire = getattr(target, "acquire_state", None)
    if acquire is None:
        yield [target.new_state(n_ctx)]
        return
    states = []
    try:
        for _ in range(n):
            states.append(acquire(n_ctx))
        yield states
    finally:
        for state in states:
            target.release_state(state)


def measure_verify_costs(target, widths=CALIBRATION_WIDTHS, context: int = CALIBRATION_CONTEXT, reps: int = 3,
                         capture: Sequence[int] = (), states: int = 1) -> dict[int, float]:
    """Seconds per verify at each width: a target pass over a DDTree-shaped batch (calibration_parents) with
    checkpoints (after `context` committed tokens), capturing the `capture` layers a drafter reads, and the greedy
    reads of its first CALIBRATION_ROWS_READ logits rows, as a step's walk does; the best of `reps` rounds over all
    widths (rounds, so a burst of load elsewhere hits every width alike) on each of `states` scratch states (a GPU
    target's pooled states: each then holds the graphs of these steps and of their commits, which requests of the
    serving loop replay instead of capturing them); nothing is kept."""
    ws = sorted(set(int(x) for x in widths))
    out = {w: float("inf") for w in ws}
    with _scratch_states(target, context + max(ws) + len(ws) + 1, states) as sts:
        for state in sts:
            for w, s in _verify_costs(target, state, ws, context, reps, list(capture)).items():
                out[w] = min(out[w], s)
    return out


def calibration_parents(width: int, depth: int = CALIBRATION_DEPTH) -> np.ndarray:
    """Parents of a verify batch shaped as `--budget auto`'s trees are: the root and the drafter's top-1 chain of
    `depth` tokens first (a DDTree seeded with its chain; any narrower prefix is a chain), then alternatives hung
    along the chain. The shape decides what a step costs and, on a GPU, which graph it replays (chain or tree)."""
    par = np.arange(-1, width - 1)
    for i in range(depth + 1, width):
        par[i] = (i - depth - 1) % depth
    return par


def _verify_costs(target, state, ws: list[int], context: int, reps: int, capture: list[int]) -> dict[int, float]:
    n_vocab = target.cfg.n_vocab
    ids = np.arange(context + max(ws)) % max(1, n_vocab - 1)
    target.forward(state, ids[:context], logits="none")
    state.commit(list(range(context)))
    out = {w: float("inf") for w in ws}
    parents = {w: calibration_parents(w) for w in ws}
    for r in range(reps + 1):                            # round 0 warms caches and allocations (GPU: captures)
        for w in ws:
            t0 = time.perf_counter()
            res = target.forward(state, ids[context:context + w], parents[w], capture=capture, checkpoints=True,
                                 logits="rows")
            for row in range(min(w, CALIBRATION_ROWS_READ)):    # what a greedy walk reads
                sample_row(res.logits, row, GREEDY, None)
            if r:
                out[w] = min(out[w], time.perf_counter() - t0)
                state.pending = None
            else:       # commit once: on a GPU the commit of this step's shape is captured now, not mid-request
                state.commit([0])
            res = None
    return out


def measure_plain_step(target, context: int = CALIBRATION_CONTEXT, reps: int = PLAIN_REPS, capture: Sequence[int] = (),
                       states: int = 1) -> float:
    """Seconds of one plain decode step as the speculative loop takes one while its drafter pauses (width-1
    forward capturing the `capture` layers, logits of the last row, commit), the best of `reps` on each of
    `states` scratch states."""
    with _scratch_states(target, context + reps + 2, states) as sts:
        return min(_plain_step(target, state, context, reps, list(capture)) for state in sts)


def _plain_step(target, state, context: int, reps: int, capture: list[int]) -> float:
    n_vocab = target.cfg.n_vocab
    ids = np.arange(context) % max(1, n_vocab - 1)
    target.forward(state, ids, logits="none")
    state.commit(list(range(context)))
    best, tok = float("inf"), 1
    for r in range(reps + 1):                            # round 0 warms (on a GPU: the graph's capture)
        t0 = time.perf_counter()
        res = target.forward(state, [tok], capture=capture, logits="last")
        state.commit([0])
        tok = int(greedy_tokens(res.logits)[-1])
        res = None
        if r:
            best = min(best, time.perf_counter() - t0)
    return best


# A running time (drafter pass, plain step, verify drift) is the lower median of its last WINDOW observations:
# latencies only ever add, and one slow step (a CUDA-graph capture on a request's first draft, a page fault, a
# burst of load) must not steer the next dozens of choices, as it did through an exponential average seeded by it.
WINDOW = 16

# After a drafted step that did not pay, plain steps before the drafter is tried again: PAUSE_PER_LOST_STEP times the
# plain steps that step lost (its time in plain steps minus the tokens it committed), doubling while each re-measuring
# draft still does not pay, at most PLAIN_PAUSE_MAX. Scaled by the loss, a probe of a drafter that does not pay costs
# a third of the plain run after it (less as pauses double) on any hardware: a drafted step of the embedded pair costs
# ~3 plain steps on the CPU (pauses of ~7) and ~1.7 on a GPU (pauses of ~2), where a fixed 8 kept the drafter idle
# through stretches it would have paid in. Replayed over the 32 held-out prompts (bench/spec_replay.py,
# docs/benchmarks.md): at the CPU's costs within 1 % of the fixed 8 -> 16 it replaces, at an H100's +5 %.
PAUSE_PER_LOST_STEP = 3.0
PLAIN_PAUSE_MAX = 16


@dataclass
class BudgetTuner:
    """Chooses how many best-first nodes of a drafted tree to verify; learns from every step it sees."""

    verify_costs: dict[int, float]          # width -> seconds (measured, then tracked)
    max_budget: int = 64
    kappa: float = 1.0                      # accepted tokens / predicted (sum of path probabilities)
    draft_s: float = 0.0                    # running drafter time per step
    ema: float = 0.05
    scale: float = 1.0                      # observed / measured verify time (running)
    chosen: dict[int, int] = field(default_factory=dict)    # budget -> steps (for stats)
    # seconds of a plain decode step (measured, then tracked); 0 = unknown: always speculate
    plain_s: float = 0.0
    plain_steps: int = 0                    # steps decoded without the drafter because it did not pay (stats)
    # whether the last chosen tree was expected to beat a plain step, and whether the last observed step did (both
    # False: the caller pauses the drafter); what the last step lost against plain steps, in plain steps (<= 0: none)
    drafting_pays: bool = True
    step_paid: bool = True
    step_loss: float = 0.0
    # verify widths (nodes + root) the target prefers, e.g. a GPU model's graph buckets (each distinct width is a CUDA
    # graph captured per pooled state); None: any width
    widths: tuple[int, ...] | None = None
    _pred: float = 0.0
    _acc: float = 0.0

    def __post_init__(self):
        if not self.verify_costs:
            raise ValueError("BudgetTuner needs at least one measured verify width")
        self._widths = np.array(sorted(self.verify_costs), dtype=np.float64)
        # the start-up measurements seed the windows (they were the best of a few warm repetitions)
        self._draft_obs: deque[float] = deque([self.draft_s] if self.draft_s > 0 else [], maxlen=WINDOW)
        self._plain_obs: deque[float] = deque([self.plain_s] if self.plain_s > 0 else [], maxlen=WINDOW)
        self._scale_obs: deque[float] = deque([self.scale], maxlen=WINDOW)
        # the measured curve at every width a choice can ask for (choose runs on the host between two device passes)
        self._ys = np.maximum.accumulate(np.array([self.verify_costs[int(w)] for w in self._widths]))
        self._table = self._base_cost(np.arange(self.max_budget + 2))
        self._allowed = (np.isin(np.arange(1, self.max_budget + 1) + 1, np.asarray(self.widths))
                         if self.widths else None)

    @classmethod
    def measure(cls, target, max_budget: int = 64, capture: Sequence[int] = (), states: int = 1) -> BudgetTuner:
        """A tuner from the target's measured verify curve (trees of up to max_budget nodes), the steps measured as
        the speculative loop runs them: capturing the drafter's `capture` layers, on `states` of a GPU target's
        pooled states (a serving process's slots: then no request captures a verify width the tuner may choose,
        which cost ~10 ms a width on the embedded pair). A target with preferred widths (a GPU model's graph
        buckets) keeps its trees within the widest of them: a wider verify runs outside the captured steps (eager
        chunks: a 65-token verify of the embedded pair took 12.9 ms on an H100 against 0.63 at 48), so it is
        neither measured nor chosen."""
        preferred = getattr(target, "verify_widths", None)
        if preferred:
            max_budget = min(max_budget, max(preferred) - 1)
        # a pooled state must hold the calibration (its context, the widest verify, one commit a width): a state
        # made beyond the pool would hold more rows than the memory plan counts (a --max-ctx of ~140 or less)
        room = target.pooled_ctx() if hasattr(target, "pooled_ctx") else None
        context = CALIBRATION_CONTEXT
        if room:
            max_budget = max(1, min(max_budget, room - len(CALIBRATION_WIDTHS) - 4))
        widths = tuple(w for w in CALIBRATION_WIDTHS if w <= max_budget + 1) + (max_budget + 1,)
        if room:
            context = max(1, min(context, room - max(widths) - len(set(widths)) - 1, room - PLAIN_REPS - 2))
        return cls(measure_verify_costs(target, widths, context=context, capture=capture, states=states),
                   max_budget=max_budget, plain_s=measure_plain_step(target, context=context, capture=capture,
                                                                     states=states),
                   widths=tuple(preferred) if preferred else None)

    def observe_plain(self, seconds: float) -> None:
        """Fold in the time of a plain step taken instead of a speculative one."""
        self.plain_steps += 1
        if seconds > 0:
            self._plain_obs.append(seconds)
            self.plain_s = statistics.median_low(self._plain_obs)

    def cost(self, width: int | np.ndarray) -> np.ndarray:
        """Verify seconds at `width` tokens: the measured curve times the observed drift."""
        return self.scale * self._base_cost(width)

    def _base_cost(self, width: int | np.ndarray) -> np.ndarray:
        """Piecewise linear between measured widths, linear beyond."""
        xs, ys = self._widths, self._ys     # ys: a wider verify never costs less (timing noise must not say so)
        w = np.asarray(width, dtype=np.float64)
        if len(xs) == 1:
            return ys[0] * np.maximum(w, 1) / xs[0]
        inside = np.interp(w, xs, ys)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return np.where(w > xs[-1], ys[-1] + slope * (w - xs[-1]), inside)

    def choose(self, tree: DraftTree) -> int:
        """How many of the tree's nodes (a prefix in insertion order) to verify: at least 1."""
        n = min(len(tree), self.max_budget)
        if n <= 1:
            return n
        p = np.minimum(1.0, self.kappa * np.exp(tree.logw[:n]))
        gain = 1.0 + np.cumsum(p)                         # expected tokens committed with b = 1..n nodes
        b = np.arange(1, n + 1)
        if self._allowed is not None:
            # only the preferred widths (a prefix of the best-first tree stays a valid tree at any size); a tree
            # narrower than every one of them is verified whole
            ok = self._allowed[:n].copy()
            ok[-1] = True
            gain, b = gain[ok], b[ok]
        rate = gain / (self.draft_s + self.scale * self._table[b + 1])
        best = int(np.argmax(rate))
        # A drafter not accepted for enough to pay for itself and the wider verify: the caller takes plain steps
        # for a while (this tree is verified anyway: its draft is paid for), then drafts again to re-measure.
        self.drafting_pays = not (self.plain_s > 0 and rate[best] * self.plain_s < 1.0)
        return int(b[best])

    def observe(self, tree: DraftTree, kept: int, accepted: int, verify_s: float, draft_s: float) -> None:
        """Fold one step in: accepted drafted tokens vs predicted, and the times it took; `step_paid` says whether
        this step committed its tokens faster than plain steps would have."""
        self.step_loss = (verify_s + draft_s) / self.plain_s - (accepted + 1) if self.plain_s > 0 else 0.0
        self.step_paid = self.step_loss <= 0
        predicted = float(np.exp(tree.logw[:kept]).sum()) if kept else 0.0
        a = self.ema
        self._pred = (1 - a) * self._pred + a * predicted
        self._acc = (1 - a) * self._acc + a * accepted
        if self._pred > 1e-6:
            self.kappa = float(np.clip(self._acc / self._pred, 0.05, 20.0))
        if draft_s > 0:
            self._draft_obs.append(draft_s)
            self.draft_s = statistics.median_low(self._draft_obs)
        # drift (contention, clocks, longer contexts) scales the whole measured curve
        predicted_s = float(self._table[kept + 1]) if kept + 1 < len(self._table) else float(self._base_cost(kept + 1))
        if predicted_s > 0 and verify_s > 0:
            self._scale_obs.append(float(np.clip(verify_s / predicted_s, 0.1, 10.0)))
            self.scale = statistics.median_low(self._scale_obs)
        self.chosen[kept] = self.chosen.get(kept, 0) + 1

    def pause_after_step(self, last: int) -> int:
        """After a drafted step (choose, then observe): the plain steps to take now (0: none), which the caller passes
        as `last` after its next drafted step. `last`: the pause taken before this step (0: none). A step pays when
        its tree was expected to (drafter confidence) or it did (the tokens it committed); one that did not pauses
        the drafter for PAUSE_PER_LOST_STEP times the plain steps it lost, or twice the last pause, at most
        PLAIN_PAUSE_MAX."""
        if self.drafting_pays or self.step_paid:
            return 0
        return min(PLAIN_PAUSE_MAX, max(int(round(PAUSE_PER_LOST_STEP * self.step_loss)), 2 * last))

    def snapshot(self) -> dict:
        return {"kappa": round(self.kappa, 4), "draft_ms": round(self.draft_s * 1e3, 3),
                "verify_ms": {int(w): round(s * 1e3, 3) for w, s in sorted(self.verify_costs.items())},
                "verify_scale": round(self.scale, 4), "plain_ms": round(self.plain_s * 1e3, 3),
                "plain_steps": self.plain_steps,
                "chosen_budgets": dict(sorted(self.chosen.items()))}
