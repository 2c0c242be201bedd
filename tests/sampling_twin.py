"""The exact sampler's NumPy twin (services/engine/sampling.py target_distribution + sample_from with a given u) and
random logits rows that exercise its cuts; shared by the CPU simulation (tests/test_kernels_sampling_sim.py) and
the GPU tests (tests/test_kernels_sampling.py)."""

from __future__ import annotations

import itertools

import numpy as np

from services.engine.sampling import SamplingParams, sample_from, target_distribution


class FixedUniform:
    """Stands in for a generator: `random()` returns the given u (sample_from's one draw)."""

    def __init__(self, u: float):
        self.u = float(u)

    def random(self) -> float:
        return self.u


def twin_probs(row: np.ndarray, params: SamplingParams, window=None) -> np.ndarray:
    return target_distribution(np.asarray(row, np.float32), params, list(window) if window is not None else None)


def twin_token(probs: np.ndarray, u: float) -> int:
    return sample_from(probs, FixedUniform(u))


def near_boundary(probs: np.ndarray, u: float, rel: float = 1e-12) -> bool:
    """Whether u * total lies within `rel` (relative) of a CDF step: there a float sum in another order may
    pick the neighbouring token."""
    cdf = np.cumsum(probs)
    x = u * cdf[-1]
    steps = cdf[probs > 0]
    return bool(np.min(np.abs(steps - x)) <= rel * cdf[-1])


FILTERS = [  # (temperature, top_k, top_p, min_p): every combination of the cuts
    (t, k, p, m)
    for t, k, p, m in itertools.product((0.7, 1.6), (0, 1, 9, 300), (1.0, 0.9, 0.35), (0.0, 0.02))
]


def make_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows with the shapes that matter: LLM-like heavy head, flat (large kept sets), ties at cut positions across
    chunks, a run of equal maxima, -inf entries."""
    rows = []
    r = (rng.standard_normal(n) * 2.5).astype(np.float32)
    r[rng.choice(n, 12, replace=False)] += np.float32(9.0)         # a head of a dozen likely tokens
    rows.append(r)
    rows.append((rng.standard_normal(n) * 0.3).astype(np.float32))  # flat: top-p keeps thousands
    q = np.round(rng.standard_normal(n) * 2, 0).astype(np.float32)  # few distinct values: ties at every cut
    rows.append(q)
    e = (rng.standard_normal(n) * 2).astype(np.float32)
    e[[n - 1, 3, n // 2, 4097 % n]] = np.float32(7.5)               # equal maxima in different chunks
    e[rng.choice(n, n // 10, replace=False)] = -np.inf
    rows.append(e)
    return np.stack(rows)


def twin_draw_rows(x: np.ndarray, rows, params: SamplingParams, us, history=None, paths=None) -> np.ndarray:
    """What DeviceLogits.sample_rows returns, by the NumPy path: services.engine.sampling.sample of each row with
    the given uniform and the penalty window history + paths[i]."""
    from services.engine.sampling import sample

    out = []
    for i, r in enumerate(rows):
        window = list(history or ()) + list(paths[i] if paths is not None else ())
        out.append(sample(np.asarray(x[int(r)]), params, FixedUniform(us[i]), window))
    return np.array(out, np.int64)


class TwinDeviceLogits:
    """A stand-in for models/qwen35_gpu.DeviceLogits whose draws are twin_draw_rows (no GPU needed); counts the
    rows fetched through indexing."""

    ndim = 2

    def __init__(self, x: np.ndarray):
        self.x = np.asarray(x, np.float32)
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, key):
        self.fetched += 1
        return self.x[key].copy()

    def sample_rows(self, rows, params, us, history=None, paths=None) -> np.ndarray:
        return twin_draw_rows(self.x, rows, params, us, history, paths)
