"""`--budget auto`: best-first trees truncate to smaller budgets exactly, the tuner follows the cost curve and
the acceptance it observes, and auto-budget speculative decoding stays lossless."""

import numpy as np
import pytest

from services.engine import budget as B
from services.engine.budget import CALIBRATION_WIDTHS, BudgetTuner, measure_verify_costs
from services.engine.ddtree import build_ddtree
from services.engine.generate import generate
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate


def _random_top(rng, L=15, K=8, sharp=1.0):
    logits = rng.standard_normal((L, 64)) * sharp
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=1)[:, :K]
    return ids, np.take_along_axis(logp, ids, 1)


@pytest.mark.parametrize("chain_seed", [True, False])
def test_best_first_prefix_is_the_smaller_budget_tree(chain_seed):
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids, lp = _random_top(rng, sharp=float(rng.uniform(0.5, 4)))
        big = build_ddtree(ids, lp, 64, chain_seed)
        for b in (1, 2, 5, 14, 15, 16, 22, 40, 63):
            small = build_ddtree(ids, lp, b, chain_seed)
            pre = big.prefix(b)
            for a, c in ((small.tokens, pre.tokens), (small.parents, pre.parents), (small.depths, pre.depths)):
                np.testing.assert_array_equal(a, c)


def _tree(rng, sharp):
    ids, lp = _random_top(rng, sharp=sharp)
    return build_ddtree(ids, lp, 64, True)


def test_cost_curve_interpolates_and_extrapolates():
    t = BudgetTuner({1: 1.0, 9: 2.0, 17: 4.0}, max_budget=64)
    np.testing.assert_allclose(t.cost(np.array([1, 5, 9, 13, 17, 25])), [1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    noisy = BudgetTuner({1: 1.0, 32: 3.0, 48: 2.0, 65: 4.0})     # a timing hiccup made 48 look cheap
    assert noisy.cost(48) == 3.0 and noisy.cost(40) == 3.0


def test_choice_follows_the_cost_curve_and_the_acceptance():
    rng = np.random.default_rng(1)
    tree = _tree(rng, sharp=6.0)                          # confident drafts: deep likely chain
    flat = BudgetTuner({1: 1.0, 65: 1.05}, max_budget=64)                 # GPU-like: width nearly free
    steep = BudgetTuner({1: 1.0, 2: 2.0, 65: 65.0}, max_budget=64)         # cost grows with every token
    assert flat.choose(tree) >= 32
    assert steep.choose(tree) <= 4
    # a drafter that is never accepted drives kappa down and the budget with it
    lazy = BudgetTuner({1: 1.0, 17: 1.6, 65: 3.0}, max_budget=64)
    before = lazy.choose(tree)
    for _ in range(200):
        lazy.observe(tree, before, accepted=0, verify_s=1.3, draft_s=0.2)
    assert lazy.kappa <= 0.06 and lazy.choose(tree) < before
    # and one that is always fully accepted drives it up (bounded)
    eager = BudgetTuner({1: 1.0, 17: 1.6, 65: 3.0}, max_budget=64)
    for _ in range(200):
        eager.observe(tree, 15, accepted=15, verify_s=1.3, draft_s=0.2)
    assert eager.kappa >= 1.0 and eager.choose(tree) >= 15
    snap = eager.snapshot()
    assert snap["chosen_budgets"] == {15: 200}
    assert abs(snap["verify_scale"] - 1.3 / eager._base_cost(16)) < 0.01      # observed 1.3 s vs 1.075 s curve


def test_auto_budget_is_lossless_and_reports_its_choices(tiny_pair):
    _, gguf, drafter_dir = tiny_pair
    lt = load_target(gguf)
    drafter = load_drafter(drafter_dir, lt.model)
    costs = measure_verify_costs(lt.model, widths=(1, 4, 16, 65), context=8, reps=1)
    assert sorted(costs) == [1, 4, 16, 65] and all(c > 0 for c in costs.values())
    tuner = BudgetTuner(costs)
    for seed, n in ((0, 5), (1, 17), (2, 30)):
        prompt = np.random.default_rng(seed).integers(0, lt.cfg.n_vocab - 8, n).tolist()
        plain = generate(lt.model, prompt, 24)
        spec = speculative_generate(lt.model, LocalProposer(drafter), prompt, 24, spec=SpecConfig.auto(tuner))
        assert spec.token_ids == plain.token_ids
        assert spec.spec["budget_mode"] == "auto" and 1 <= spec.spec["budget"] <= 64
        assert sum(spec.spec["tuner"]["chosen_budgets"].values()) >= spec.spec["steps"]


def test_the_tuner_says_when_drafting_does_not_pay():
    rng = np.random.default_rng(3)
    tree = _tree(rng, sharp=0.5)                       # flat drafts: little expected acceptance
    t = BudgetTuner({1: 1.0, 65: 1.1}, max_budget=64, draft_s=5.0, plain_s=1.0)
    t.choose(tree)                                     # (1 + E) / (5 + ~1) tokens/s < 1 / 1: plain is faster
    assert not t.drafting_pays
    t.draft_s, t.kappa = 0.01, 20.0                    # a cheap drafter that is accepted: it pays
    t.choose(tree)
    assert t.drafting_pays
    unknown = BudgetTuner({1: 1.0, 65: 1.1}, draft_s=5.0)   # plain step time unknown: always drafts
    unknown.choose(tree)
    assert unknown.drafting_pays
    t.observe_plain(0.5)          # the lower median of the seed (1.0) and this step
    assert t.plain_steps == 1 and t.plain_s == 0.5 and t.snapshot()["plain_steps"] == 1


def test_the_tuner_says_whether_a_step_paid():
    """A step pays when its committed tokens would have taken plain steps at least as long as it took."""
    rng = np.random.default_rng(4)
    tree = _tree(rng, sharp=0.5)
    t = BudgetTuner({1: 1.0, 65: 1.1}, max_budget=64, plain_s=1.0)
    t.observe(tree, 4, accepted=2, verify_s=2.0, draft_s=1.0)        # 3 tokens in 3 s: as fast as plain
    assert t.step_paid
    t.observe(tree, 4, accepted=1, verify_s=2.0, draft_s=1.0)        # 2 tokens in 3 s
    assert not t.step_paid
    unknown = BudgetTuner({1: 1.0, 65: 1.1})                          # plain step time unknown: it pays
    unknown.observe(tree, 4, accepted=0, verify_s=2.0, draft_s=1.0)
    assert unknown.step_paid


def test_a_step_that_did_not_pay_pauses_for_what_it_lost():
    """The pause after a drafted step that did not pay: PAUSE_PER_LOST_STEP times the plain steps it lost, doubling
    while the next drafts still do not pay, at most PLAIN_PAUSE_MAX; none after a step that paid or was expected to,
    or that lost too little to count."""
    rng = np.random.default_rng(6)
    tree = _tree(rng, sharp=0.5)
    t = BudgetTuner({1: 1.0, 65: 1.1}, max_budget=64, plain_s=1.0)
    t.drafting_pays = False
    t.observe(tree, 4, accepted=0, verify_s=1.0, draft_s=1.0)         # 2 plain steps' time for 1 token: lost 1
    assert not t.step_paid and t.step_loss == pytest.approx(1.0)
    assert t.pause_after_step(0) == round(B.PAUSE_PER_LOST_STEP)
    assert t.pause_after_step(5) == 10                          # the next one after a pause: doubled
    assert t.pause_after_step(12) == B.PLAIN_PAUSE_MAX
    t.observe(tree, 4, accepted=0, verify_s=0.6, draft_s=0.5)         # lost 0.1 plain steps: not worth a pause
    assert t.pause_after_step(0) == 0
    t.observe(tree, 4, accepted=0, verify_s=4.0, draft_s=1.0)         # lost 4: 12 plain steps
    assert t.pause_after_step(0) == 12
    t.drafting_pays = True                                            # expected to pay: no pause, and reset
    assert t.pause_after_step(12) == 0
    t.drafting_pays = False
    t.observe(tree, 4, accepted=2, verify_s=1.0, draft_s=1.0)         # 3 tokens in 2 plain steps' time: paid
    assert t.step_paid and t.step_loss < 0 and t.pause_after_step(8) == 0


def test_one_slow_step_does_not_steer_the_tuner():
    """A request's first draft may capture CUDA graphs (tens of times a replay); an average seeded by it kept the
    drafter looking too dear for dozens of steps. The running times are medians of recent steps: the next
    ordinary steps set them, and a burst of slow steps does move them once it lasts."""
    rng = np.random.default_rng(5)
    tree = _tree(rng, sharp=3.0)
    t = BudgetTuner({1: 1.0, 65: 1.2}, max_budget=64, plain_s=1.0)
    t.observe(tree, 4, 3, verify_s=1.0, draft_s=50.0)          # the capture
    for _ in range(2):
        t.observe(tree, 4, 3, verify_s=1.0, draft_s=0.2)
    assert t.draft_s == 0.2
    t.choose(tree)
    assert t.drafting_pays
    t.observe(tree, 4, 3, verify_s=30.0, draft_s=0.2)           # one slow verify: the drift stays ~1
    assert t.scale < 1.5
    for _ in range(20):                                          # sustained contention: followed
        t.observe(tree, 4, 3, verify_s=3.0, draft_s=0.6)
    assert t.draft_s == 0.6 and 2.0 < t.scale < 3.5
    for s in (9.0, 1.1, 1.0):
        t.observe_plain(s)
    assert t.plain_s == 1.0


def test_plain_pauses_stay_lossless_and_keep_the_drafter_context(tiny_pair):
    """With plain steps between drafts the output is still the plain output, and the drafter (whose context must
    receive every committed token's features, also those of plain steps) keeps drafting: append_context checks
    that its context reaches the block's position."""
    _, gguf, drafter_dir = tiny_pair
    lt = load_target(gguf)
    drafter = load_drafter(drafter_dir, lt.model)
    tuner = BudgetTuner({1: 1.0, 65: 1.0}, draft_s=100.0, plain_s=1e-6)   # every draft looks too dear, and is
    prompt = np.random.default_rng(5).integers(0, lt.cfg.n_vocab - 8, 9).tolist()
    plain = generate(lt.model, prompt, 40)
    spec = speculative_generate(lt.model, LocalProposer(drafter), prompt, 40, spec=SpecConfig.auto(tuner))
    assert spec.token_ids == plain.token_ids
    s = spec.spec
    # drafted once, paused 16 plain steps (the most: each draft loses ~1e8 plain steps), drafted again, ...
    assert s["steps"] >= 2 and s["plain_steps"] >= 8 + 16 and s["tuner"]["plain_steps"] == s["plain_steps"]
    assert s["steps"] + s["plain_steps"] < len(plain.token_ids)        # and drafts still committed > 1 token
    # a second request starts by drafting again (its own pause), on the same tuner
    again = speculative_generate(lt.model, LocalProposer(drafter), prompt, 12, spec=SpecConfig.auto(tuner))
    assert again.token_ids == plain.token_ids[:12] and again.spec["steps"] >= 1


def test_preferred_widths_limit_the_choice():
    """A GPU target's graph buckets: the tuner verifies only prefixes whose width (nodes + root) is one of them, still
    the best of those by expected tokens per second; a tree narrower than all of them is verified whole."""
    rng = np.random.default_rng(3)
    costs = {1: 1.0, 2: 1.0, 8: 1.02, 16: 1.05, 24: 1.08, 32: 1.2, 64: 1.5}
    free = BudgetTuner(dict(costs), max_budget=63, draft_s=0.3)
    bucketed = BudgetTuner(dict(costs), max_budget=63, draft_s=0.3, widths=(2, 8, 16, 24, 32, 64))
    picked = set()
    for _ in range(50):
        tree = _tree(rng, sharp=float(rng.uniform(0.5, 6)))
        n = min(len(tree), 63)
        b = bucketed.choose(tree)
        assert b + 1 in bucketed.widths or b == n
        ok = [w - 1 for w in bucketed.widths if w - 1 < n] + [n]
        p = np.minimum(1.0, np.exp(tree.logw[:n]))
        rate = [(1 + p[:k].sum()) / (0.3 + float(bucketed.cost(k + 1))) for k in ok]
        assert b == ok[int(np.argmax(rate))]
        picked.add(b)
        assert 1 <= free.choose(tree) <= n
    assert len(picked) > 1                                  # the choice still follows the drafts
    ids, lp = _random_top(rng)
    small = build_ddtree(ids, lp, 5, True)                  # narrower than every width but 2: whole or one node
    assert bucketed.choose(small) in (1, len(small))


def test_measure_keeps_trees_within_the_preferred_widths(monkeypatch):
    """A GPU model's graph buckets end at 64 tokens: the tuner is measured and chooses within them (a 65-token
    verify would run as eager chunks, ~20x the time), whatever budget the caller allows."""
    seen = {}

    def fake_costs(target, widths, **kw):
        seen["widths"] = tuple(widths)
        return {w: 1e-3 * (1 + w / 64) for w in widths}

    monkeypatch.setattr(B, "measure_verify_costs", fake_costs)
    monkeypatch.setattr(B, "measure_plain_step", lambda target, **kw: 1e-3)

    class GpuLike:
        verify_widths = (2, 4, 8, 12, 16, 20, 24, 32, 48, 64)

    t = BudgetTuner.measure(GpuLike(), max_budget=64)
    assert t.max_budget == 63 and max(seen["widths"]) == 64 and t.widths == GpuLike.verify_widths
    t = BudgetTuner.measure(object(), max_budget=64)          # no preferred widths: as asked
    assert t.max_budget == 64 and max(seen["widths"]) == 65 and t.widths is None


@pytest.mark.parametrize("room", [200, 141, 100, 40])
def test_calibration_fits_the_pooled_states(tiny_pair, room):
    """On a target with pooled states of `room` rows (a GPU server's slots at its --max-ctx), the calibration asks for
    no state larger than they are (one made beyond the pool would hold more than the memory plan counts): a shorter
    context first, then a smaller budget when even the widest verify does not fit."""
    _, gguf, _ = tiny_pair
    model = load_target(gguf).model
    asked = []

    class Pooled:
        cfg = model.cfg

        def pooled_ctx(self):
            return room

        def acquire_state(self, n_ctx):
            asked.append(n_ctx)
            return model.new_state(n_ctx)

        def release_state(self, st):
            pass

        def forward(self, *a, **kw):
            return model.forward(*a, **kw)

    t = BudgetTuner.measure(Pooled(), max_budget=64)
    assert asked and max(asked) <= room, (room, asked)
    assert t.max_budget == min(64, room - len(CALIBRATION_WIDTHS) - 4)
    assert max(t.verify_costs) == t.max_budget + 1 and t.plain_s > 0


def test_calibration_runs_the_loops_steps_on_every_pooled_state(tiny_pair):
    """The tuner measures the steps the speculative loop takes (DDTree-shaped, capturing the drafter's layers: on a
    GPU each is another graph than a chain or a step without them), on as many pooled states as the target hands
    out at once (a serving process's slots, so that every slot's state holds the graphs of the widths the tuner may
    choose), each given back; a target without a pool is measured once on a new state."""
    _, gguf, drafter_dir = tiny_pair
    lt = load_target(gguf)
    layers = list(load_drafter(drafter_dir, lt.model).target_layer_ids)

    class Pooled:       # a GPU target's pool of `n` states (an acquired state starts empty, as there)
        def __init__(self, model, n):
            self.model, self.cfg = model, model.cfg
            self.pool, self.slot_of, self.seen, self.commits = list(range(n)), {}, [], []

        def acquire_state(self, n_ctx):
            st = self.model.new_state(n_ctx)
            self.slot_of[id(st)] = self.pool.pop()
            return st

        def release_state(self, st):
            self.pool.append(self.slot_of.pop(id(st)))

        def forward(self, state, tokens, parents=None, capture=(), checkpoints=False, logits="all"):
            chain = parents is None or list(parents) == list(range(-1, len(tokens) - 1))
            self.seen.append((self.slot_of.get(id(state), id(state)), len(tokens), tuple(capture), chain))
            res = self.model.forward(state, tokens, parents, capture=capture, checkpoints=checkpoints, logits=logits)
            commit = state.commit

            def counted(path):   # a commit of this step (on a GPU: its shape's commit graph captured)
                self.commits.append((self.slot_of.get(id(state), id(state)), len(tokens)))
                state.commit = commit
                commit(path)

            state.commit = counted
            return res

    target = Pooled(lt.model, 2)
    t = BudgetTuner.measure(target, max_budget=16, capture=layers, states=2)
    assert sorted(target.pool) == [0, 1] and not target.slot_of         # every state given back
    steps = [s for s in target.seen if s[1] < 64]                       # (the 64-token contexts before them)
    assert {s[0] for s in steps} == {0, 1}                              # both pooled states measured
    assert all(s[2] == tuple(layers) for s in steps)                    # with the drafter's layers
    assert {s[1] for s in steps} >= {1, 2, 4, 8, 16, 17} and t.plain_s > 0 and t.max_budget == 16
    # shaped as auto's trees: a prefix of up to the drafter's chain (16 with the root) is a chain, wider ones trees
    assert all(s[3] == (s[1] <= 16) for s in steps)
    # every width's step committed once on each state (its commit graph, on a GPU), the plain step's every time
    spec_commits = [c for c in target.commits if c[1] < 64 and c[1] > 1]
    assert sorted(spec_commits) == sorted({(s[0], s[1]) for s in steps if s[1] > 1})

    class Unpooled:
        cfg = lt.cfg

        def __init__(self):
            self.made, self.seen, self.slot_of, self.commits = 0, [], {}, []

        def new_state(self, n_ctx):
            self.made += 1
            return lt.model.new_state(n_ctx)

        forward = Pooled.forward
        model = lt.model

    plain = Unpooled()
    measure_verify_costs(plain, widths=(1, 4), context=8, reps=1, capture=layers, states=3)
    assert plain.made == 1 and len({s[0] for s in plain.seen}) == 1
