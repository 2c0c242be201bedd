"""Draft trees from a block drafter's per-position distributions (DDTree), and walking them after verify.

A tree is a list of nodes in topological order under an implicit root (the last committed-but-unverified
token). Node i has a token, a parent (-1 = the root) and a depth (1 = first drafted position).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class DraftTree:
    tokens: np.ndarray      # (N,) int64
    parents: np.ndarray     # (N,) int64, -1 = root, else an earlier node index
    depths: np.ndarray      # (N,) int64, 1-based
    logw: np.ndarray        # (N,) cumulative draft log-probability of the path to the node

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: itself a tree (parents precede children), and for a best-first tree exactly
        the tree a budget of n would have built."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.logw[:n])

    def verify_batch(self, root_token: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and parents of the target pass: the root at index 0, node i at index i + 1."""
        tokens = np.concatenate([[root_token], self.tokens]).astype(np.int64)
        parents = np.concatenate([[-1], np.where(self.parents < 0, 0, self.parents + 1)]).astype(np.int64)
        return tokens, parents

    def children(self) -> list[dict[int, int]]:
        """For each verify-batch index, {token: child's verify-batch index}."""
        kids: list[dict[int, int]] = [dict() for _ in range(len(self) + 1)]
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            kids[0 if p < 0 else p + 1][int(t)] = i + 1
        return kids


def topk_logprobs(logits: np.ndarray, k: int, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the k best token ids and their log-probabilities (log-softmax at `temperature`), best first.

    Ties rank the lower id first, at the cut too (every id tied with the k-th value is a candidate).
    """
    logp = np.true_divide(logits, max(temperature, 1e-6), dtype=np.float64)
    logp -= logp.max(axis=-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    rows, n = logp.shape
    k = min(k, n)
    if k == 1:
        ids = np.argmax(logp, axis=-1)[:, None].astype(np.int64)            # the lowest id among tied bests
        return ids, np.take_along_axis(logp, ids, axis=-1)
    # the k-th best value per row (selecting index n-k from below is cheaper than index k-1 of -logp)
    kth = np.partition(logp, n - k, axis=-1)[:, n - k:n - k + 1]
    keep = logp >= kth
    flat = np.flatnonzero(keep)
    if len(flat) == rows * k:                                                # no ties at the cut: k ids per row
        cand = flat.reshape(rows, k) - (np.arange(rows) * n)[:, None]        # ascending ids within each row
        vals = np.take_along_axis(logp, cand, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")                    # higher first, lower id on ties
        return np.take_along_axis(cand, order, axis=-1), np.take_along_axis(vals, order, axis=-1)
    out_ids = np.empty((rows, k), np.int64)
    out_lp = np.empty((rows, k))
    for r in range(rows):
        cand = np.flatnonzero(keep[r])
        order = np.lexsort((cand, -logp[r, cand]))[:k]    # higher log-prob first, lower id on ties
        out_ids[r], out_lp[r] = cand[order], logp[r, cand[order]]
    return out_ids, out_lp


def build_chain(top_ids: np.ndarray, top_logp: np.ndarray, length: int) -> DraftTree:
    n = min(length, len(top_ids))
    return DraftTree(tokens=top_ids[:n, 0].copy(), parents=np.arange(-1, n - 1), depths=np.arange(1, n + 1),
                     logw=np.cumsum(top_logp[:n, 0]))


def build_ddtree(top_ids: np.ndarray, top_logp: np.ndarray, budget: int, chain_seed: bool = True) -> DraftTree:
    """Best-first tree by cumulative draft log-probability with `budget` non-root nodes.

    top_ids/top_logp: (L, K) per drafted position, best first. With `chain_seed` the top-1 chain is
    inserted first (it rescues deep chains that pure best-first would cut), then the heap fills the rest.
    """
    L, K = top_ids.shape
    if budget <= 0 or L == 0:
        return DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    # Python lists and floats: indexing NumPy scalars cost more than the heap itself (a 64-node tree is built every
    # step of `--budget auto`, on the host, between two device passes); float64 sums also for float32 inputs
    ids = np.asarray(top_ids).tolist()
    lp = np.asarray(top_logp, dtype=np.float64).tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    logws: list[float] = []
    # candidates not taken yet: (-logw, insertion order, depth, rank, parent)
    heap: list[tuple[float, int, int, int, int]] = []
    push, pop, counter = heapq.heappush, heapq.heappop, 0

    def add(depth: int, rank: int, parent: int, logw: float) -> int:
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        logws.append(logw)
        return len(tokens) - 1

    if chain_seed:
        prev, logw = -1, 0.0
        for d in range(1, min(L, budget) + 1):
            row = lp[d - 1]
            if K > 1:
                push(heap, (-(logw + row[1]), counter, d, 1, prev))
                counter += 1
            logw += row[0]
            prev = add(d, 0, prev, logw)
    else:
        push(heap, (-lp[0][0], 0, 1, 0, -1))
        counter = 1
    while heap and len(tokens) < budget:
        neg, _, depth, rank, parent = pop(heap)
        logw = -neg
        node = add(depth, rank, parent, logw)
        row = lp[depth - 1]
        if rank + 1 < K:
            push(heap, (-(logw - row[rank] + row[rank + 1]), counter, depth, rank + 1, parent))
            counter += 1
        if depth < L:
            push(heap, (-(logw + lp[depth][0]), counter, depth + 1, 0, node))
            counter += 1
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.array(depths, np.int64),
                     np.array(logws))
