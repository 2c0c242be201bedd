"""Shared helpers of the training tools: timestamped logging, seeding, devices, time budgets."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """One progress line: wall clock, seconds since the process started, message (stderr, flushed)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed Python, NumPy and torch; ask CUDA for deterministic kernels where it has them."""
    random.seed(seed)
    np.random.seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # warn_only: a few ops (index_add and friends on CUDA) have no deterministic kernel
        torch.use_deterministic_algorithms(True, warn_only=True)


def pick_device(name: str | None) -> str:
    import torch

    if name in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device")
    return name


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class Budget:
    """A wall-clock budget in seconds (None: unlimited)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


class StepPlanner:
    """Turns a wall-clock budget into a step count for the lr schedule.

    The steps after the first `skip` (compilation, allocator warm-up) are timed; at `first` steps the
    total is set to what fits the time left, and re-estimated at `second` steps from the longer average
    (the schedule stretches or shrinks a little then). `margin` keeps a few percent in hand.
    """

    def __init__(self, budget: Budget, steps: int | None, first: int = 23, second: int = 200, skip: int = 3,
                 margin: float = 0.97):
        self.budget, self.fixed = budget, steps
        self.total: int | None = steps
        self.first, self.second, self.skip, self.margin = first, second, skip, margin
        self.t_skip: float | None = None
        self.ms_per_step: float | None = None

    def done(self, step: int) -> bool:
        if self.fixed is not None:
            return step >= self.fixed
        return (self.total is not None and step >= self.total) or self.budget.left <= 0

    def after_step(self, step: int, device: str) -> bool:
        """Call after each step (step = steps done); True when the total was (re)set."""
        if self.fixed is not None:
            return False
        if step == self.skip:
            sync(device)
            self.t_skip = time.perf_counter()
        elif step in (self.first, self.second) and self.t_skip is not None:
            sync(device)
            dt = (time.perf_counter() - self.t_skip) / (step - self.skip)
            self.ms_per_step = dt * 1e3
            self.total = max(step + 1, int(step + self.margin * self.budget.left / dt))
            return True
        return False


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine down to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + np.cos(np.pi * t)))
