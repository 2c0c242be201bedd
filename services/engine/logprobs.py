"""Log-probabilities of generated tokens (OpenAI `logprobs` / `top_logprobs`): the chosen token's and the best
alternatives' at each position, read off the logits rows the sampler drew from.

They are the log-softmax of the model's own logits (vLLM's default "raw" logprobs): before repetition penalties,
temperature and the top-k / top-p / min-p cut, so the numbers describe the model and not the request's sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20       # OpenAI's limit for chat `top_logprobs` (vLLM's default max_logprobs is 20 too)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the `top_logprobs` best (id, log-probability) pairs
    at its position, best first (lower id on ties)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_top_logprobs(n: int | None, param: str = "top_logprobs") -> int | None:
    """None (no logprobs) or an int in 0..MAX_TOP_LOGPROBS; anything else is a 400 naming `param`."""
    if n is None:
        return None
    if isinstance(n, bool) or int(n) != n or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"{param} must be an integer in 0..{MAX_TOP_LOGPROBS}, got {n}", param=param)
    return int(n)


def logprobs_of_row(x: np.ndarray, token: int, n: int) -> TokenLogprob:
    """The NumPy reference: log-softmax of one logits row (in float64), the token's value and the n best."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    m = float(np.max(x))
    logz = m + float(np.log(np.sum(np.exp(x - m))))
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        n = min(n, x.size)
        cut = np.partition(x, x.size - n)[x.size - n]      # the n-th largest value
        cand = np.flatnonzero(x >= cut)                      # every tie at the cut, in id order
        best = cand[np.lexsort((cand, -x[cand]))][:n]        # larger value first, then the lower id
        top = tuple((int(i), float(x[i] - logz)) for i in best)
    return TokenLogprob(int(token), float(x[int(token)] - logz), top)


def row_logprobs(logits: Any, rows: Sequence[int], tokens: Sequence[int], n: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] drawn from row rows[i] of `logits`: a 1-D row (rows ignored), a (rows, vocab)
    array, the NumPy engine's RowLogits (only those rows are computed) or a GPU model's DeviceLogits (computed on
    the device: `logprobs`, only the results cross to the host)."""
    if len(tokens) == 0:
        return []
    on_device = getattr(logits, "logprobs", None)
    if on_device is not None:
        return on_device(rows, tokens, n)
    if np.ndim(logits) == 1:
        return [logprobs_of_row(logits, t, n) for t in tokens]
    return [logprobs_of_row(logits[int(r)], t, n) for r, t in zip(rows, tokens)]
