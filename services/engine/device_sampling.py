"""Sampled draws from a GPU model's logits rows without fetching them: kernels/sampling.py `sample` applies
sampling.target_distribution on the device and returns only token ids; the request's generator still draws every
uniform here, one `random()` per draw as sample_from does, so a seeded request draws the same sequence on either
engine (up to float rounding of the logits). A row the device cannot sample (NaN / inf logits) is fetched and
handed to the NumPy path, which then decides exactly as it would have on the CPU engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels import sampling as ks

from .sampling import SamplingParams, sample


class _FixedUniform:
    """A generator stand-in whose one draw is the uniform the device used."""

    def __init__(self, u: float):
        self.u = float(u)

    def random(self) -> float:
        return self.u


def draw_rows(dev_rows: Any, rows: Sequence[int], params: SamplingParams, us: Sequence[float],
              history: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None) -> np.ndarray:
    """int64 tokens: row rows[i] of the device logits (rows, vocab) float32, drawn with uniform us[i] (unused when
    greedy) from target_distribution with the penalty window history + paths[i] (paths: None = none of its own) and
    the request's logit bias."""
    toks = ks.sample(dev_rows, rows, us, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                     min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                     presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                     history=history, paths=paths, last_n=params.repeat_last_n if params.penalized else 0,
                     logit_bias=params.logit_bias)
    for i in np.flatnonzero(toks < 0):
        cp = ks.loader.require()
        window = list(history or ()) + list(paths[i] if paths is not None else ())
        toks[i] = sample(cp.asnumpy(dev_rows[int(rows[i])]), params, _FixedUniform(us[i]), window)
    return toks
