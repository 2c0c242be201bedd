"""Token sampling as pure functions: logits -> the distribution we sample from -> one token.

Speculative decoding reuses `target_distribution(s)` for exact acceptance and `sample_from` to redo draws.

Order of the filters (HF transformers / vLLM order): the temperature scales the logits first, then
top-k, top-p and min-p are applied in that order to the softmax of the scaled logits, each on the
distribution the previous one left (renormalised). llama.cpp's default chain applies the temperature
last instead, so its top-p / min-p cut-offs differ from ours when temperature != 1.
Ties at a cut-off are broken towards the lower token id, so the kept set is always exactly determined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. temperature <= 0 is greedy; top_k=0, top_p=1, min_p=0 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self) -> SamplingParams:
        """Raise InvalidRequestError naming the field that is out of range; return self for chaining."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", param="temperature"
            )
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k}", param="top_k")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed}", param="seed")
        return self


def make_rng(seed: int | None) -> np.random.Generator:
    """A generator for one request; None draws fresh entropy. Any int works (OpenAI seeds may be negative)."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def _keep_top_n(values: np.ndarray, n: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Mask of the n[r] largest entries per row, given each row's n-th largest value; ties -> lower ids."""
    thr = thresholds[:, None]
    above = values > thr
    tie = values == thr
    room = n - above.sum(axis=-1)
    return above | (tie & (np.cumsum(tie, axis=-1) <= room[:, None]))


def _top_p_counts(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row: how many of the largest probabilities top-p keeps, and the smallest kept value."""
    rows, vocab = probs.shape
    m = min(vocab, 256)
    while True:
        # Only the head of each row matters; a partial partition avoids sorting the whole vocabulary.
        head = np.partition(probs, vocab - m, axis=-1)[:, vocab - m :] if m < vocab else probs.copy()
        head = -np.sort(-head, axis=-1)
        before = np.zeros_like(head)  # mass strictly before each position
        np.cumsum(head[:, :-1], axis=-1, out=before[:, 1:])
        # Keep the smallest prefix whose mass reaches top_p: every position whose preceding mass is < top_p.
        n = (before < top_p).sum(axis=-1)
        if m == vocab or np.all(n < m):
            n = np.maximum(n, 1)
            return n, head[np.arange(rows), n - 1]
        m = min(vocab, m * 8)


def target_distributions(logits_2d: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Row-wise `target_distribution`: float64 (rows, vocab), each row summing to 1."""
    logits = np.asarray(logits_2d, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"expected (rows, vocab) logits, got shape {logits.shape}")
    rows, vocab = logits.shape
    if params.greedy:
        out = np.zeros_like(logits)
        out[np.arange(rows), np.argmax(logits, axis=-1)] = 1.0  # argmax takes the lowest id on ties
        return out

    z = logits / params.temperature
    zmax = z.max(axis=-1, keepdims=True)
    if not np.all(np.isfinite(zmax)):
        raise ValueError("a row of logits has no finite maximum (all -inf, or +inf/NaN present)")
    probs = np.exp(z - zmax)

    if 0 < params.top_k < vocab:
        k = params.top_k
        kth = -np.partition(-z, k - 1, axis=-1)[:, k - 1]
        probs *= _keep_top_n(z, np.full(rows, k), kth)
    probs /= probs.sum(axis=-1, keepdims=True)

    if params.top_p < 1.0:
        n, thr = _top_p_counts(probs, params.top_p)
        probs *= _keep_top_n(probs, n, thr)
        probs /= probs.sum(axis=-1, keepdims=True)

    if params.min_p > 0.0:
        pmax = probs.max(axis=-1, keepdims=True)
        probs *= probs >= params.min_p * pmax
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `sample` draws from, as float64 probabilities over the vocabulary.

    Greedy gives a one-hot vector at the argmax (lowest id on ties).
    """
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError(f"expected (vocab,) logits, got shape {logits.shape}")
    return target_distributions(logits[None, :], params)[0]


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw with exactly one `rng.random()`; never returns a zero-probability id."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    # side="right": the first id whose cumulative mass exceeds u, which skips ids of zero mass.
    i = int(np.searchsorted(cdf, u, side="right"))
    if i >= len(cdf):  # u rounded up to the total: take the last id that has mass
        i = int(np.flatnonzero(probs)[-1])
    return i


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token. Greedy is argmax and consumes no randomness; otherwise one uniform from `rng`."""
    logits = np.asarray(logits)
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from(target_distribution(logits, params), rng)


def greedy_tokens(logits) -> np.ndarray:
    """int64 argmax of every row of (rows, vocab) logits, lowest id on ties. A GPU model's logits object
    (models/qwen35_gpu.DeviceLogits) has them already (argmax_rows): no vocabulary-sized row crosses to the host."""
    rows = getattr(logits, "argmax_rows", None)
    if rows is not None:
        return rows()
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def sample_row(logits, row: int, params: SamplingParams, rng: np.random.Generator) -> int:
    """`sample` of row `row` of (rows, vocab) logits (a 1-D array is the row itself). Greedy on a logits object
    with argmax_rows reads that; otherwise only that row is read (fetched, for a GPU model's rows)."""
    if np.ndim(logits) == 1:
        return sample(logits, params, rng)
    if params.greedy and hasattr(logits, "argmax_rows"):
        return int(logits.argmax_rows()[row])
    return sample(logits[row], params, rng)
