"""Lossless speculative decoding: draft a block, build a chain or DDTree, verify it in one target pass,
accept along the tree, commit the accepted branch without a second pass.

Acceptance draws every committed token from the target's own (processed) distribution at its node: the
tree only decides how many of those draws one target pass can serve. So greedy output equals plain greedy
output, and sampled output is distributed exactly as plain sampling (with the same generator it is even
the same sequence, up to float rounding between batched and single-token logits).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .budget import BudgetTuner
from .ddtree import DraftTree, build_chain, build_ddtree, topk_logprobs
from .errors import SpecsplitError
from .generate import GenerationResult, check_request, plain_tokens, prefill
from .logprobs import TokenLogprob, check_top_logprobs, row_logprobs
from .models.base import TargetModel
from .sampling import SamplingParams, make_rng, sample, sample_row

TREE_TOPK = 8


class DrafterUnavailableError(SpecsplitError):
    """The drafter could not answer (process gone, timeout); the request continues with plain decoding."""


class Proposer(Protocol):
    """Anything that drafts a block: an in-process DFlash drafter, or a client of a remote drafter service."""

    block_size: int
    target_layer_ids: list[int]

    def propose(self, new_features: np.ndarray | None, last_token: int, start: int,
                k: int) -> tuple[np.ndarray, np.ndarray]:
        """Append the committed tokens' features, draft the block after `last_token` (at position `start`).

        Returns per drafted position (block_size - 1 rows) the top-k token ids and log-probabilities.
        """
        ...

    def close(self) -> None: ...

    # optional: append_features(features, start) appends committed tokens' features ahead of the next propose (a
    # prompt's, as its chunks commit: speculative_stream hands them over in appends of PROMPT_APPEND_ROWS or more,
    # so a drafter beside a GPU target takes them from the device and no request holds a whole prompt's features)


PROMPT_APPEND_ROWS = 256      # dflash_gpu.append_context's chunk: fewer rows an append would cost more launches


PendingDraft = Callable[[], tuple[np.ndarray, np.ndarray]]


def begin_propose(proposer: Proposer, new_features, last_token: int, start: int, k: int) -> PendingDraft:
    """Start drafting the next block; the returned callable waits for it and gives propose()'s answer.

    A proposer with propose_begin (the GPU drafter: its pass and the top-k's copy queued on the device ahead of the
    step's commit; the drafter service: the exchange in flight) drafts while the caller commits the step, so the
    host's tree building overlaps the commit's device work. Any other drafts when the answer is asked for."""
    begin = getattr(proposer, "propose_begin", None)
    if begin is None:
        return lambda: proposer.propose(new_features, last_token, start, k)
    return begin(new_features, last_token, start, k)


class LocalProposer:
    """A DFlash drafter in this process, with its per-request context cache."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.session = drafter.new_session()
        self.block_size = drafter.block_size
        self.target_layer_ids = list(drafter.target_layer_ids)

    def propose(self, new_features, last_token, start, k):
        logits = self.drafter.draft(self.session, new_features, int(last_token), int(start))
        return topk_logprobs(logits, k)

    def append_features(self, new_features, start: int) -> None:
        self.drafter.append_context(self.session, new_features, int(start))

    def close(self) -> None:
        self.session = None


AUTO_MAX_BUDGET = 64


@dataclass(frozen=True)
class SpecConfig:
    budget: int | None = 22          # DDTree non-root nodes; None = chain of block_size - 1
    chain_seed: bool = True
    # `--budget auto`: the tuner picks each step's tree size (a best-first prefix of a `budget`-node tree)
    tuner: BudgetTuner | None = None

    @property
    def chain(self) -> bool:
        return self.budget is None

    @classmethod
    def auto(cls, tuner: BudgetTuner, chain_seed: bool = True) -> SpecConfig:
        return cls(budget=tuner.max_budget, chain_seed=chain_seed, tuner=tuner)


@dataclass
class StepInfo:
    """One draft/verify/accept round, for traces and metrics."""

    index: int
    budget: int
    tree_size: int
    accepted: int                    # drafted tokens accepted (the bonus token not counted)
    draft_ms: float
    verify_ms: float
    accept_ms: float
    drafter_ms: float | None = None  # a drafter service's own time of this draft (draft_ms: what the step waited)


@dataclass
class SpecStats:
    block_size: int = 16
    budget: int | None = None
    steps: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)   # accepted count at depth 1, 2, ...
    histogram: list[int] = field(default_factory=list)      # steps that committed 1, 2, ... tokens
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accept_ms: float = 0.0
    drafter_ms: float = 0.0                                 # a drafter service's own time of its drafts
    fallback: bool = False
    fallback_reason: str = ""
    auto: bool = False                                      # budget chosen per step (`--budget auto`)
    plain_steps: int = 0                                    # steps without a draft: auto found it not paying
    tuner: dict | None = None                               # the tuner's view at the end of the request

    def __post_init__(self):
        self.per_position = [0] * (self.block_size - 1)
        self.histogram = [0] * self.block_size

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify pass, counting the bonus token (vLLM / SGLang convention)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def record(self, info: StepInfo) -> None:
        self.steps += 1
        self.draft_tokens += info.tree_size
        self.accepted += info.accepted
        for d in range(info.accepted):
            self.per_position[d] += 1
        self.histogram[min(info.accepted, len(self.histogram) - 1)] += 1
        self.draft_ms += info.draft_ms
        self.verify_ms += info.verify_ms
        self.accept_ms += info.accept_ms
        self.drafter_ms += info.drafter_ms or 0.0

    def as_dict(self) -> dict:
        budget = self.budget
        if self.auto and self.steps:        # auto: the mean tree size actually verified
            budget = round(self.draft_tokens / self.steps)
        return {
            "mode": "chain" if self.budget is None else "ddtree",
            "budget": budget,
            "budget_mode": "auto" if self.auto else "fixed",
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "per_position": self.per_position,
            "histogram": self.histogram,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "accept_ms": round(self.accept_ms, 3),
            "drafter_ms": round(self.drafter_ms, 3),
            "fallback": self.fallback,
            "plain_steps": self.plain_steps,
            **({"fallback_reason": self.fallback_reason} if self.fallback else {}),
            **({"tuner": self.tuner} if self.tuner is not None else {}),
        }


def walk_tree(tree: DraftTree, logits: np.ndarray, params: SamplingParams,
              rng: np.random.Generator, history: Sequence[int] | None = None) -> tuple[list[int], int]:
    """Follow the target through the verified tree.

    At each node draw the next token from the target's distribution there (argmax when greedy); descend
    while the draw is a child. Returns the accepted verify-batch indices (root first) and the bonus token.
    Only the rows visited are read: on a GPU model greedy reads the argmax computed there (sample_row).
    `history` (the sequence up to and including the root; penalized params need it): each node is judged
    with its own path appended, so penalties see exactly what plain decoding would have seen.
    """
    kids = tree.children()
    if hasattr(logits, "sample_rows") and not (params.greedy and not params.shifted):
        return _walk_on_device(tree, kids, logits, params, rng, history)
    path = [0]
    seq = None
    if params.penalized:
        n = params.repeat_last_n
        seq = list(history[-n:] if n > 0 else history) if history is not None else None
    while True:
        tok = sample_row(logits, path[-1], params, rng, seq)
        nxt = kids[path[-1]].get(tok)
        if nxt is None:
            return path, tok
        path.append(nxt)
        if seq is not None:
            seq.append(tok)


def _walk_on_device(tree: DraftTree, kids: list[dict[int, int]], logits, params: SamplingParams,
                    rng: np.random.Generator, history: Sequence[int] | None) -> tuple[list[int], int]:
    """walk_tree on a GPU model's logits: every node's draw at once on the device (one launch sequence, one copy
    of the tokens back), then the host follows them. The walk's d-th draw is the generator's d-th uniform, so a
    node at depth d takes it; afterwards the generator advances by the draws the walk made, as walk_tree's."""
    depth = np.concatenate([[0], tree.depths]).astype(np.int64)
    us = np.zeros(len(depth))
    if not params.greedy:
        saved = rng.bit_generator.state
        ahead = rng.random(int(depth.max()) + 1)
        rng.bit_generator.state = saved
        us = ahead[depth]
    paths = None
    if params.penalized:        # each node's own tokens after the root: its penalty window past `history`
        paths = [[]]
        for t, p in zip(tree.tokens, tree.parents):
            paths.append(paths[0 if p < 0 else p + 1] + [int(t)])
    toks = logits.sample_rows(np.arange(len(depth)), params, us, history, paths)
    path = [0]
    while (nxt := kids[path[-1]].get(int(toks[path[-1]]))) is not None:
        path.append(nxt)
    if not params.greedy:
        rng.random(len(path))
    return path, int(toks[path[-1]])


def speculative_stream(target: TargetModel, proposer: Proposer | None, prompt_ids: Sequence[int],
                       max_tokens: int, params: SamplingParams = SamplingParams(),
                       spec: SpecConfig = SpecConfig(), stop_ids: Sequence[int] = (),
                       max_ctx: int | None = None, result: GenerationResult | None = None,
                       on_step: Callable[[StepInfo], None] | None = None,
                       top_logprobs: int | None = None, prompt_logprobs: int | None = None) -> Iterator[list[int]]:
    """Yield the committed tokens of each round. Falls back to plain decoding if the drafter fails.
    top_logprobs set (0..20): result.logprobs gets each committed token's log-probability and that many alternatives,
    read off the rows its draw came from (the verify's rows along the accepted path). prompt_logprobs set:
    result.prompt_logprobs the prompt's tokens' (OpenAI `echo`), and max_tokens may be 0 (the prompt scored only)."""
    params.validate()
    top_logprobs = check_top_logprobs(top_logprobs)
    prompt_logprobs = check_top_logprobs(prompt_logprobs, "prompt_logprobs")
    max_ctx = max_ctx or target.cfg.context_length
    check_request(target, prompt_ids, max_tokens, max_ctx, scoring=prompt_logprobs is not None, params=params)
    res = result if result is not None else GenerationResult()
    res.prompt_tokens = len(prompt_ids)
    res.logprobs = [] if top_logprobs is not None else None
    res.prompt_logprobs = [] if prompt_logprobs is not None else None
    block = proposer.block_size if proposer is not None else 16
    stats = SpecStats(block_size=block, budget=spec.budget, auto=spec.tuner is not None)
    res.spec = stats.as_dict()
    budget_cap = block - 1 if spec.chain else spec.budget
    need = min(max_ctx, len(prompt_ids) + max_tokens + budget_cap + 1)
    # a GPU target hands out pooled states (their captured graphs outlive the request); released at the end
    acquire = getattr(target, "acquire_state", None)
    state = acquire(need, max_ctx) if acquire is not None else target.new_state(need)
    try:
        yield from _spec_loop(target, proposer, prompt_ids, max_tokens, params, spec, stop_ids, res, on_step,
                              state, stats, block, budget_cap, top_logprobs, prompt_logprobs)
    finally:
        release = getattr(target, "release_state", None)
        if release is not None:
            release(state)


def _spec_loop(target: TargetModel, proposer: Proposer | None, prompt_ids: Sequence[int], max_tokens: int,
               params: SamplingParams, spec: SpecConfig, stop_ids: Sequence[int], res: GenerationResult,
               on_step: Callable[[StepInfo], None] | None, state, stats: SpecStats, block: int,
               budget_cap: int, top_logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> Iterator[list[int]]:
    """speculative_stream's loop over a state it owns."""
    stop = {int(s) for s in stop_ids}
    rng = make_rng(params.seed)
    depth = block - 1
    layer_ids = list(proposer.target_layer_ids) if proposer is not None else []

    t0 = time.perf_counter()
    # a proposer that takes features ahead of a draft gets the prompt's as its chunks commit (where the target
    # keeps them: on the device beside a GPU drafter), in appends of PROMPT_APPEND_ROWS or more; the rows short of
    # one go with the first draft
    append = getattr(proposer, "append_features", None) if layer_ids else None
    held: Any = None
    lost: DrafterUnavailableError | None = None

    def to_drafter(rows: Any, n_past: int) -> None:
        nonlocal held, lost
        if lost is not None:
            return
        held = _append_rows(held, rows)
        if len(held) >= PROMPT_APPEND_ROWS:
            try:
                append(held, n_past)
            except DrafterUnavailableError as e:
                lost = e
            held = None

    logits, feats = prefill(target, state, prompt_ids, capture=layer_ids,
                            on_captured=to_drafter if append is not None else None,
                            prompt_logprobs=prompt_logprobs, logprobs_out=res.prompt_logprobs)
    if append is not None:
        feats, held = held, None
    if lost is not None:    # the drafter failed while the prompt ran: the request goes on with plain decoding
        stats.fallback, stats.fallback_reason = True, str(lost)
        proposer.close()
        proposer, feats = None, None
    res.prompt_ms = (time.perf_counter() - t0) * 1e3
    if max_tokens == 0:         # the prompt scored, nothing generated
        res.finish_reason = "length"
        if proposer is not None:
            proposer.close()
        return
    t1 = time.perf_counter()

    history = list(prompt_ids) if params.penalized else None   # what repetition penalties look back on

    def logprobs(logits, rows: Sequence[int], tokens: Sequence[int]) -> list[TokenLogprob] | None:
        return None if top_logprobs is None else row_logprobs(logits, rows, tokens, top_logprobs)

    def emit(tokens: list[int], lps: list[TokenLogprob] | None = None) -> tuple[list[int], bool]:
        """Append tokens (and their log-probabilities, when asked) to the result up to a stop id or max_tokens;
        report whether generation ended."""
        out = []
        for i, t in enumerate(tokens):
            out.append(int(t))
            res.token_ids.append(int(t))
            if lps is not None:
                res.logprobs.append(lps[i])
            if history is not None:
                history.append(int(t))
            if t in stop:
                res.finish_reason = "stop"
                return out, True
            if len(res.token_ids) >= max_tokens:
                res.finish_reason = "length"
                return out, True
        return out, False

    root = sample(logits, params, rng, history)
    chunk, done = emit([root], logprobs(logits, [-1], [root]))
    yield chunk
    step = 0
    # `--budget auto` pauses a drafter that does not pay for plain steps, per request, for as long as the step that
    # did not pay says (BudgetTuner.pause_after_step; `pause`: the last pause taken, 0 = none)
    plain_left, pause = 0, 0
    # a GPU state holds checkpoints for max_tree tokens (the verifier's planned width): no verify is wider
    widest = getattr(state, "max_tree", None)

    def room_at(n_past: int) -> int:
        """Tree nodes that still fit after the root with n_past tokens committed (< 0: the context is full)."""
        room = state.max_ctx - n_past - 1
        return room if widest is None or room < 0 else min(room, widest - 1)

    k = 1 if spec.chain or spec.budget <= depth else TREE_TOPK     # top-k a drafted position
    # the next block, drafting since before the last step's commit (begin_propose), and what starting it took
    pending: PendingDraft | None = None
    begin_ms = 0.0
    while not done:
        room = room_at(state.n_past)
        if room < 0:
            res.finish_reason = "length"
            break
        top = None
        drafting = proposer is not None and room > 0
        if drafting and plain_left > 0:
            plain_left -= 1
            # the tuner measured that the drafter does not pay now: a plain step that still captures the
            # features the drafter will need for these tokens when it drafts again
            tp = time.perf_counter()
            out = target.forward(state, [root], capture=layer_ids, logits="last")
            state.commit([0])
            if out.captured is not None:
                feats = _append_rows(feats, out.captured)
            root = sample_row(out.logits, -1, params, rng, history)
            lps = logprobs(out.logits, [-1], [root])
            out = None    # a GPU result still held when its graph replays next is copied first
            spec.tuner.observe_plain(time.perf_counter() - tp)
            stats.plain_steps += 1
            chunk, done = emit([root], lps)
            yield chunk
            continue
        if drafting:
            td = time.perf_counter()
            try:
                top = pending() if pending is not None else proposer.propose(feats, root, state.n_past, k)
            except DrafterUnavailableError as e:
                stats.fallback, stats.fallback_reason = True, str(e)
                proposer = None
            draft_ms = (time.perf_counter() - td) * 1e3 + begin_ms
            pending, begin_ms = None, 0.0
            # a drafter service says how long its own draft took (DrafterClient); in process there is no exchange
            drafter_ms = getattr(proposer, "last_draft_ms", None) if proposer is not None else None
        if proposer is None:    # no drafter (any more): the rest is plain decoding (a GPU target runs it ahead)
            lps: list[TokenLogprob] | None = [] if top_logprobs is not None else None
            rest = plain_tokens(target, state, root, max_tokens - len(res.token_ids), params, rng, history,
                                top_logprobs, lps)
            try:
                for root in rest:
                    chunk, done = emit([root], None if lps is None else [lps.pop(0)])
                    yield chunk
                    if done:
                        break
            finally:
                rest.close()
            if not done:        # the context is full
                res.finish_reason = "length"
            break
        if top is None:                                     # plain decoding step
            out = target.forward(state, [root], logits="last")
            state.commit([0])
            root = sample_row(out.logits, -1, params, rng, history)
            lps = logprobs(out.logits, [-1], [root])
            out = None
            chunk, done = emit([root], lps)
            yield chunk
            continue

        top_ids, top_logp = top
        if spec.chain:
            tree = build_chain(top_ids, top_logp, min(depth, room))
        else:
            tree = build_ddtree(top_ids, top_logp, min(spec.budget, room), spec.chain_seed)
            if spec.tuner is not None:
                full, tree = tree, tree.prefix(spec.tuner.choose(tree))
        tokens, parents = tree.verify_batch(root)
        tv = time.perf_counter()
        # logits="rows": the walk reads the rows along its path only; on the NumPy engine each is computed then
        out = target.forward(state, tokens, parents, capture=layer_ids, checkpoints=True, logits="rows")
        ta = time.perf_counter()
        path, bonus = walk_tree(tree, out.logits, params, rng, history)
        tw = time.perf_counter()        # the walk computed the logits rows it read: part of the verify's cost
        feats = out.captured[path] if out.captured is not None else None
        committed = [int(tokens[i]) for i in path[1:]] + [bonus]
        lps = logprobs(out.logits, path, committed)     # token j was drawn at row path[j]
        out = None
        chunk, done = emit(committed, lps)
        root = bonus
        if spec.tuner is not None:
            spec.tuner.observe(full, len(tree), len(path) - 1, verify_s=tw - tv, draft_s=draft_ms / 1e3)
            plain_left = pause = spec.tuner.pause_after_step(pause)
        n_next = state.n_past + len(path)
        if not done and proposer is not None and plain_left == 0 and room_at(n_next) > 0:
            # the next block drafts ahead of this commit: a GPU drafter's pass runs before the commit's replay on
            # the stream, and the next step's tree is built on the host while the commit runs
            tb = time.perf_counter()
            try:
                pending = begin_propose(proposer, feats, root, n_next, k)
            except DrafterUnavailableError as e:
                stats.fallback, stats.fallback_reason = True, str(e)
                proposer = None
            begin_ms = (time.perf_counter() - tb) * 1e3
        state.commit(path)
        accept_ms = (time.perf_counter() - ta) * 1e3 - begin_ms
        info = StepInfo(index=step, budget=budget_cap if spec.tuner is None else len(tree), tree_size=len(tree),
                        accepted=len(path) - 1, draft_ms=draft_ms, verify_ms=(ta - tv) * 1e3, accept_ms=accept_ms,
                        drafter_ms=drafter_ms)
        stats.record(info)
        step += 1
        if on_step is not None:
            on_step(info)
        yield chunk
    res.decode_ms = (time.perf_counter() - t1) * 1e3
    if spec.tuner is not None:
        stats.tuner = spec.tuner.snapshot()
    res.spec = stats.as_dict()
    if proposer is not None:
        proposer.close()


def _append_rows(feats, new):
    """Captured rows of one more committed token after those not yet sent to the drafter (on the device when
    the target keeps them there)."""
    if feats is None:
        return new
    if hasattr(feats, "concat"):
        return feats.concat(new)
    return np.concatenate([feats, np.asarray(new)], axis=0)


def speculative_generate(target: TargetModel, proposer: Proposer | None, prompt_ids: Sequence[int],
                         max_tokens: int, params: SamplingParams = SamplingParams(),
                         spec: SpecConfig = SpecConfig(), stop_ids: Sequence[int] = (),
                         max_ctx: int | None = None, top_logprobs: int | None = None,
                         prompt_logprobs: int | None = None) -> GenerationResult:
    res = GenerationResult()
    for _ in speculative_stream(target, proposer, prompt_ids, max_tokens, params, spec, stop_ids, max_ctx, res,
                                top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs):
        pass
    return res
