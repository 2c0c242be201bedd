"""bench/gemv_ab.py's step A/B table without a GPU: every knob a mode sets names an attribute its module really has
(a typo would add one nothing reads and the A/B would compare two equal steps), the set that is saved and restored
around a run is every knob any mode sets, a mode's flags are all knobs or all switches, and every printed ratio
names two of its modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gemv_ab  # noqa: E402


def test_every_knob_is_a_real_attribute() -> None:
    names = gemv_ab.step_knobs()
    assert "q35.SWIGLU_PAIR_WIDTHS" in names and "att.SHORT_KW_ROWS" in names and "RING_STAGES" in names
    for name in names:
        mod, attr = gemv_ab.knob_owner(name)
        assert hasattr(mod, attr), name
    with pytest.raises(ValueError, match="no attribute"):
        gemv_ab.knob_owner("q35.SWIGLU_PAIR_WIDTH")
    with pytest.raises(ValueError, match="no module"):
        gemv_ab.knob_owner("xx.STAGE_NORMS")


def test_modes_and_ratios_are_consistent() -> None:
    for ab, (modes, widths, ratios) in gemv_ab.STEP_ABS.items():
        kinds = {isinstance(m[4], dict) for m in modes}
        assert len(kinds) == 1, ab  # all knob modes or all switches (step() dispatches on the flag's type)
        names = [m[0] for m in modes]
        assert len(set(names)) == len(names), ab
        for a, b in ratios:
            assert a in names and b in names, (ab, a, b)
        assert widths and all(1 <= w <= 64 for w in widths), ab
