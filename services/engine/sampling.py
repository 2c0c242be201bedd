"""Token sampling as pure functions: logits -> the distribution we sample from -> one token.

Speculative decoding reuses `target_distribution(s)` for exact acceptance and `sample_from` to redo draws.

Order of the filters (HF transformers / vLLM order): the temperature scales the logits first, then
top-k, top-p and min-p are applied in that order to the softmax of the scaled logits, each on the
distribution the previous one left (renormalised). llama.cpp's default chain applies the temperature
last instead, so its top-p / min-p cut-offs differ from ours when temperature != 1.
Ties at a cut-off are broken towards the lower token id, so the kept set is always exactly determined.

A logit bias (OpenAI `logit_bias`: token id -> a value in [-100, 100] added to its logit) comes first, as
llama.cpp's `logit-bias` sampler heads its chain. Repetition penalties come next, as in llama.cpp's `penalties`
sampler: over the last `repeat_last_n` tokens of the sequence (prompt and output; -1 = all of it, 0 = none), a
token seen c times has its logit divided by `repetition_penalty` when positive (multiplied when negative: HF /
vLLM / llama.cpp semantics), then lowered by c * frequency_penalty + presence_penalty (OpenAI's formula). They need
the sequence so far (`history`); a speculative tree hands each node its own path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from services.engine.errors import InvalidRequestError

MAX_LOGIT_BIAS = 1024    # a request's logit_bias entries (kernels/sampling.py indexes them with 16 bits)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. temperature <= 0 is greedy; top_k=0, top_p=1, min_p=0 are off, and so
    are repetition_penalty=1, presence_penalty=0, frequency_penalty=0. repeat_last_n: the penalties' window
    (llama.cpp's penalty_last_n, default 64; -1 = the whole sequence). logit_bias: (token id, value) pairs added to
    those logits first (ids unique, in increasing order)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def shifted(self) -> bool:
        """Whether the logits are changed before the filters (a bias or penalties): then a greedy draw is not the
        raw logits' argmax."""
        return self.penalized or bool(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Whether the distribution depends on the tokens so far (then samplers need `history`)."""
        return self.repeat_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

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
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got "
                                      f"{self.repetition_penalty}", param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:       # OpenAI's range; also rejects NaN
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}", param=name)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                      param="logit_bias")
        ids = [i for i, _ in self.logit_bias]
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids) or \
                len(set(ids)) != len(ids):
            raise InvalidRequestError("logit_bias keys must be distinct token ids >= 0", param="logit_bias")
        bad = [v for _, v in self.logit_bias if not (isinstance(v, (int, float, np.floating)) and -100 <= v <= 100)]
        if bad:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {bad[0]!r}",
                                      param="logit_bias")
        n = self.repeat_last_n
        if isinstance(n, bool) or int(n) != n or n < -1:
            raise InvalidRequestError(f"repeat_last_n must be an integer >= -1 (-1: the whole sequence), got {n}",
                                      param="repeat_last_n")
        return self


# GGUF metadata keys (gguf-py Keys.General.SAMPLING_*) through which a model file declares the sampling it was
# made for; llama.cpp reads them as defaults, and so does specsplit for every field a request leaves unset.
GGUF_SAMPLING_KEYS = {
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
    "repeat_last_n": "general.sampling.penalty_last_n",
}


def model_sampling_defaults(metadata: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a model file declares (GGUF_SAMPLING_KEYS), as SamplingParams keyword arguments."""
    out: dict[str, Any] = {}
    for name, key in GGUF_SAMPLING_KEYS.items():
        if key in metadata:
            v = metadata[key]
            # float32 in the file: 1.1 is stored as 1.100000023841858; keep the written decimal
            out[name] = int(v) if name in ("top_k", "repeat_last_n") else float(f"{float(v):.7g}")
    return out


# Hugging Face generation_config.json fields specsplit reads as defaults (vLLM's `--generation-config auto` reads
# the same); HF applies repetition_penalty over the whole sequence, hence repeat_last_n -1 with it.
HF_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def hf_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling a Hugging Face generation_config.json declares, as SamplingParams keyword arguments. With
    do_sample false (HF: greedy) only the repetition penalty is kept."""
    out: dict[str, Any] = {}
    sampling = generation_config.get("do_sample") is not False
    for name in HF_SAMPLING_FIELDS:
        v = generation_config.get(name)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if name != "repetition_penalty" and not sampling:
            continue
        out[name] = int(v) if name == "top_k" else float(v)
    if "repetition_penalty" in out:
        out["repeat_last_n"] = -1
    return out


def sampling_metadata(fields_: dict[str, Any]) -> dict[str, Any]:
    """GGUF metadata declaring sampling defaults, from SamplingParams field values (validated first)."""
    unknown = set(fields_) - set(GGUF_SAMPLING_KEYS)
    if unknown:
        raise InvalidRequestError(f"a model file cannot declare {', '.join(sorted(unknown))} (it can: "
                                  f"{', '.join(GGUF_SAMPLING_KEYS)})", param=sorted(unknown)[0])
    SamplingParams(**fields_).validate()
    return {GGUF_SAMPLING_KEYS[k]: v for k, v in fields_.items()}


def resolve_sampling(given: dict[str, Any], defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from the fields a request set (`given`); the others from the model's declared defaults,
    then the engine's. Raises InvalidRequestError for unknown fields or values out of range."""
    names = {f.name for f in fields(SamplingParams)}
    unknown = set(given) - names
    if unknown:
        raise InvalidRequestError(f"unknown sampling field(s): {', '.join(sorted(unknown))}",
                                  param=sorted(unknown)[0])
    merged = {k: v for k, v in (defaults or {}).items() if k in names}
    merged.update({k: v for k, v in given.items() if v is not None})
    return SamplingParams(**merged).validate()


def normalize_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias from a {token id: value} mapping (OpenAI's keys are strings) or pairs: sorted by
    id; bias 0 entries dropped. Raises InvalidRequestError for keys that are not integers."""
    items = bias.items() if isinstance(bias, dict) else (bias or ())
    out = {}
    for k, v in items:
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            key = int(k)
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            key = int(k)
        else:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidRequestError(f"logit_bias values must be numbers, got {v!r}", param="logit_bias")
        out[key] = float(v)
    return tuple(sorted((k, v) for k, v in out.items() if v != 0.0))


def apply_penalties(logits: np.ndarray, history: Sequence[int] | None, params: SamplingParams) -> np.ndarray:
    """float64 copy of one row of logits with the logit bias of `params` added, then its repetition penalties
    applied for `history` (needed only when params are penalized)."""
    row = np.array(logits, dtype=np.float64).reshape(-1)
    if params.logit_bias:
        ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
        keep = ids < row.shape[0]
        row[ids[keep]] += np.array([v for _, v in params.logit_bias], dtype=np.float64)[keep]
    if not params.penalized:
        return row
    history = _need_history(history)
    window = history if params.repeat_last_n < 0 else history[max(0, len(history) - params.repeat_last_n):]
    if len(window) == 0:
        return row
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < row.shape[0])
    ids, counts = ids[keep], counts[keep]
    v = row[ids]
    rp = params.repetition_penalty
    if rp != 1.0:
        v = np.where(v > 0, v / rp, v * rp)
    row[ids] = v - counts * params.frequency_penalty - params.presence_penalty
    return row


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


def target_distribution(logits: np.ndarray, params: SamplingParams,
                        history: Sequence[int] | None = None) -> np.ndarray:
    """The distribution `sample` draws from, as float64 probabilities over the vocabulary.

    Greedy gives a one-hot vector at the argmax (lowest id on ties). `history`: the sequence so far, which
    penalized params need.
    """
    logits = np.asarray(logits)
    if logits.ndim != 1:
        raise ValueError(f"expected (vocab,) logits, got shape {logits.shape}")
    if params.shifted:
        logits = apply_penalties(logits, history, params)
    return target_distributions(logits[None, :], params)[0]


def _need_history(history: Sequence[int] | None) -> Sequence[int]:
    if history is None:
        raise ValueError("repetition penalties need the sequence so far (history)")
    return history


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


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           history: Sequence[int] | None = None) -> int:
    """One token. Greedy is argmax and consumes no randomness; otherwise one uniform from `rng`. `history`: the
    sequence so far (prompt and output), needed when params are penalized."""
    logits = np.asarray(logits)
    if params.shifted:
        logits = apply_penalties(logits, history, params)
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from(target_distributions(logits[None, :], params)[0], rng)


def greedy_tokens(logits) -> np.ndarray:
    """int64 argmax of every row of (rows, vocab) logits, lowest id on ties. A GPU model's logits object
    (models/qwen35_gpu.DeviceLogits) has them already (argmax_rows): no vocabulary-sized row crosses to the host."""
    rows = getattr(logits, "argmax_rows", None)
    if rows is not None:
        return rows()
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def sample_row(logits, row: int, params: SamplingParams, rng: np.random.Generator,
               history: Sequence[int] | None = None) -> int:
    """`sample` of row `row` of (rows, vocab) logits (a 1-D array is the row itself). Greedy without penalties on
    a logits object with argmax_rows reads that; a GPU model's rows otherwise draw on the device (sample_rows:
    the same distribution and the same one `rng.random()`, only the token crosses); else only that row is read."""
    if np.ndim(logits) == 1:
        return sample(logits, params, rng, history)
    if params.greedy and not params.shifted and hasattr(logits, "argmax_rows"):
        return int(logits.argmax_rows()[row])
    if hasattr(logits, "sample_rows"):
        u = 0.0 if params.greedy else rng.random()
        return int(logits.sample_rows([row % len(logits)], params, [u], history)[0])
    return sample(logits[row], params, rng, history)
