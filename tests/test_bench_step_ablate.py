"""bench/step_ablate.py's piece removal without a GPU: each piece replaces attributes the kernels modules really
have, the originals come back afterwards (also after an error), a skipped pack launches once per shape and then
hands back its first result, and the stand-in outputs have the launchers' shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_ablate  # noqa: E402


class _Cupy:
    float32 = np.float32

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype)


@pytest.mark.parametrize("piece", ["deltanet core", "attention chain", "norm packs", "SwiGLU pack", "norm-gate pack"])
def test_each_piece_patches_real_attributes_and_restores_them(piece: str) -> None:
    assert piece in step_ablate.PIECES
    patches = step_ablate._patches(piece, _Cupy)
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]   # AttributeError if one is gone
    with pytest.raises(RuntimeError):
        with step_ablate.without(piece, _Cupy):
            for obj, name, orig in originals:
                assert getattr(obj, name) is not orig
            raise RuntimeError("a capture failed")
    for obj, name, orig in originals:
        assert getattr(obj, name) is orig


def test_stand_in_outputs_have_the_launchers_shapes() -> None:
    patches = {name: fn for _, name, fn in step_ablate._patches("deltanet core", _Cupy)}
    s0 = np.zeros((6, 16, 8), np.float32)
    one = patches["decode_step"](np.zeros((1, 100)), None, None, None, None, None, None, s0, n_k_heads=2)
    assert one.shape == (1, 6, 8) and one.dtype == np.float32
    assert patches["decode_step"](np.zeros((1, 100)), *[None] * 6, s0) is one   # reused, not reallocated
    q = np.zeros((23, 32), np.float32)
    assert patches["gated_delta_tree"](q, q, q, None, None, s0).shape == (23, 6, 8)
    att = {name: fn for _, name, fn in step_ablate._patches("attention chain", _Cupy)}
    assert att["attention"](np.zeros((3, 4, 64)), None).shape == (3, 4, 64)
    k = object()
    assert att["qk_norm_rope"](q, k, None, None)[1] is k


def test_a_skipped_pack_launches_once_per_shape() -> None:
    calls = []

    def pack(x, **kw):
        calls.append((x.shape, sorted(kw)))
        return object()

    key = step_ablate._pack_key("silu_up")
    stale = step_ablate._stale(pack, key)
    a, b = np.zeros((1, 8)), np.zeros((2, 8))
    first = stale(a, silu_up=a)
    assert stale(a, silu_up=a) is first and len(calls) == 1
    stale(b, silu_up=b)
    stale(a, rms_weight=a)                     # another kind of pack: always launched
    stale(a, rms_weight=a)
    assert len(calls) == 4
    norm = step_ablate._pack_key("norm")
    assert norm((a,), {"rms_weight": a}) == ("norm", (1, 8), False)
    assert norm((a,), {"rms_weight": a, "residual": a}) == ("norm", (1, 8), True)
    assert norm((a,), {"rms_weight": a, "gate": a}) is None   # the norm-gate pack is its own piece
    assert step_ablate._pack_key("gate")((a,), {"rms_weight": a, "gate": a}) is not None


def test_the_command_line_needs_a_model_and_skips_without_a_gpu(capsys) -> None:
    from kernels import loader

    with pytest.raises(SystemExit):
        step_ablate.main([])                       # --model is required
    if loader.unavailable_reason() is None:
        pytest.skip("a GPU is here: the run itself is a device benchmark")
    assert step_ablate.main(["--model", "absent.gguf", "--widths", "1"]) == 0
    assert "skipped" in capsys.readouterr().out
