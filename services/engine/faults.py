"""Failures injected on purpose, to test error paths end to end through a real server process (off unless armed).

SPECSPLIT_INJECT_OOM=POINT:N (POINT: `forward`, a target forward pass) makes the N-th call of check(POINT) after
arm() raise an allocation failure, once. The verifier arms it when it is ready (after its warm-up), so N counts the
forward passes of served requests. Nothing is armed unless the variable is set, and check() is then one dict test.
"""

from __future__ import annotations

import os
import threading

ENV = "SPECSPLIT_INJECT_OOM"
POINTS = ("forward",)

_lock = threading.Lock()
_armed: dict[str, int] = {}       # point -> calls left until it fires


def parse(spec: str) -> tuple[str, int]:
    """'POINT:N' -> (point, n); ValueError for anything else."""
    point, _, n = spec.strip().partition(":")
    if point not in POINTS or not n.strip().isdigit() or int(n) < 1:
        raise ValueError(f"{ENV} must be POINT:N with POINT one of {', '.join(POINTS)} and N >= 1, not {spec!r}")
    return point, int(n)


def arm(spec: str | None = None) -> str | None:
    """Arm the failure `spec` names (default: the environment's); returns what was armed, or None."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    if not spec.strip():
        return None
    point, n = parse(spec)
    with _lock:
        _armed[point] = n
    return f"{point}:{n}"


def disarm() -> None:
    with _lock:
        _armed.clear()


def check(point: str) -> None:
    """Raise MemoryError when an armed failure at `point` is due (what a failed allocation raises on the host; the
    engine reports CuPy's device failures the same way: errors.is_out_of_memory)."""
    if not _armed:
        return
    with _lock:
        left = _armed.get(point)
        if left is None:
            return
        if left > 1:
            _armed[point] = left - 1
            return
        del _armed[point]
    raise MemoryError(f"injected allocation failure at {point} ({ENV})")
