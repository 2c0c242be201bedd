"""bench/step_ablate.py without a GPU: each piece replaces attributes the kernels modules really have, the originals
come back afterwards (also after an error), a skipped pack launches once per shape and then hands back its first
result, the stand-in outputs have the launchers' shapes, and main() run on a stand-in step (whose graphs last as
long as the pieces they were captured with) reports each piece's own cost at every width."""

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


@pytest.mark.parametrize("piece", ["deltanet core", "attention chain", "norm packs", "SwiGLU pack", "norm-gate pack",
                                   "KV store", "q/k norm + RoPE", "attention kernels"])
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
    # left out alone, the norm hands attention contiguous rows of q's and k's shapes (no copy kernel appears)
    nr = {name: fn for _, name, fn in step_ablate._patches("q/k norm + RoPE", _Cupy)}
    qv, kv = np.zeros((2, 4, 16), np.float32)[:, :, ::2], np.zeros((2, 1, 8), np.float32)
    qo, ko = nr["qk_norm_rope"](qv, kv, None, None)
    assert qo.shape == (2, 4, 8) and ko.shape == (2, 1, 8) and qo.flags.c_contiguous
    assert nr["qk_norm_rope"](qv, kv, None, None)[0] is qo


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


# The pieces' costs a stand-in step "takes" (us): its graph lasts a base time plus each piece that was in place
# (its launcher not replaced) when the graph was captured.
_BASE_US = {1: 6000.0, 23: 11000.0}
_PIECE_US = {"deltanet core": 300.0, "attention chain": 150.0, "norm packs": 40.0, "SwiGLU pack": 180.0,
             "norm-gate pack": 170.0}


class _StandInStep:
    """forward() captures a graph whose replay time says which pieces it launched, read off the very attributes
    step_ablate replaces (so a piece wrongly attributed, or a patch left in place afterwards, changes the times)."""

    cfg = type("Cfg", (), {"n_vocab": 50})

    def __init__(self):
        from kernels import attention as att
        from kernels import deltanet as dn
        from kernels import norm_rope as nr
        from kernels import quant_matmul as qm

        self.mods = (att, dn, nr, qm)
        self.originals = {"decode_step": dn.decode_step, "gated_delta_tree": dn.gated_delta_tree,
                          "attention": att.attention, "qk_norm_rope": nr.qk_norm_rope,
                          "store": att.KVCacheLayer.store, "pack": qm.pack_activations}
        self.x = np.zeros((1, 16), np.float32)

    def _in_place(self) -> dict[str, bool]:
        att, dn, nr, qm = self.mods
        o = self.originals
        pack = qm.pack_activations
        if pack is not o["pack"]:  # a wrapped pack: which kind does it skip? (a second call gives the first result)
            kinds = {"norm packs": {"rms_weight": self.x}, "SwiGLU pack": {"silu_up": self.x},
                     "norm-gate pack": {"rms_weight": self.x, "gate": self.x}}
            skipped = set()
            for name, kw in kinds.items():
                a, b = pack(self.x, **kw), pack(self.x, **kw)
                if a is b:
                    skipped.add(name)
        else:
            skipped = set()
        return {"deltanet core": dn.decode_step is o["decode_step"] and dn.gated_delta_tree is o["gated_delta_tree"],
                "attention chain": att.attention is o["attention"] and nr.qk_norm_rope is o["qk_norm_rope"]
                and att.KVCacheLayer.store is o["store"],
                "norm packs": "norm packs" not in skipped, "SwiGLU pack": "SwiGLU pack" not in skipped,
                "norm-gate pack": "norm-gate pack" not in skipped}

    def forward(self, state, toks, parents=None, checkpoints=False, logits="all"):
        T = len(toks)
        us = _BASE_US[T] + sum(c for p, c in _PIECE_US.items() if self._in_place()[p])
        state.graphs[(T, logits)] = type("Entry", (), {"graph": _Graph(us, state.clock)})()


class _Clock:
    def __init__(self):
        self.now_us = 0.0


class _Graph:
    def __init__(self, us: float, clock: _Clock):
        self.us, self.clock = us, clock

    def launch(self, stream) -> None:
        self.clock.now_us += self.us


class _Event:
    def __init__(self, clock: _Clock):
        self.clock, self.t = clock, 0.0

    def record(self, stream=None) -> None:
        self.t = self.clock.now_us

    def synchronize(self) -> None:
        pass


def test_main_attributes_each_piece_its_cost(monkeypatch, tmp_path) -> None:
    """step_ablate.main end to end on a stand-in step: every piece's cost comes out as the step's time less the step's
    without it, per width, and every patched launcher is back afterwards."""
    import json
    from types import SimpleNamespace

    from kernels import loader
    from kernels import quant_matmul as qm

    # the stand-in's pack stands in for the real one (which needs a GPU): it returns a fresh object per call
    monkeypatch.setattr(qm, "pack_activations", lambda x, **kw: object())
    model = _StandInStep()
    clock = _Clock()
    state = SimpleNamespace(graphs={}, pending=None, clock=clock)
    cupy = SimpleNamespace(float32=np.float32, empty=lambda shape, dtype: np.empty(shape, dtype),
                           cuda=SimpleNamespace(get_current_stream=lambda: None, Event=lambda: _Event(clock),
                                                get_elapsed_time=lambda a, b: (b.t - a.t) / 1e3))
    monkeypatch.setattr(loader, "unavailable_reason", lambda: None)
    monkeypatch.setattr(loader, "require", lambda: cupy)
    monkeypatch.setattr(step_ablate, "model_at_context", lambda path, ctx: (model, state, np.random.default_rng(0)))
    monkeypatch.setattr(step_ablate, "device_name", lambda cp: "stand-in")
    out = tmp_path / "ablate.json"
    assert step_ablate.main(["--model", "m.gguf", "--widths", "1", "23", "--rounds", "2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    for width in (1, 23):
        rows = rep["widths"][str(width)]
        assert rows["step_us"] == pytest.approx(_BASE_US[width] + sum(_PIECE_US.values()))
        for piece, cost in _PIECE_US.items():
            assert rows[piece]["cost_us"] == pytest.approx(cost), (width, piece)
    assert all(v for v in model._in_place().values()), "a launcher was left patched"
    assert 0 <= rep["elapsed_s"] < 600   # the run's own seconds (a wall clock minus perf_counter once gave -1.8e9)
