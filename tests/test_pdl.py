"""Programmatic dependent launch (kernels/loader.py, kernels/pdl.cuh): what runs without a GPU (the SPECSPLIT_PDL
switch, argument marshalling, that every kernel launched with it waits for its predecessor in its source), and on a
GPU that a CUDA graph of PDL launches (the one-token packs and the gemv ring kernel) computes bitwise what plain eager
launches compute, replay after replay on new inputs."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from kernels import loader

KERNELS = Path(loader.__file__).resolve().parent


def test_switch_values(monkeypatch) -> None:
    for value, want in (("0", "off"), ("off", "off"), ("capture", "capture"), ("1", "capture"), ("on", "capture"),
                        ("always", "always"), (" Always ", "always")):
        monkeypatch.setenv(loader.PDL_ENV, value)
        assert loader.pdl_requested() == want, value
    monkeypatch.delenv(loader.PDL_ENV)
    assert loader.pdl_requested() == "capture"
    monkeypatch.setenv(loader.PDL_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECSPLIT_PDL"):
        loader.pdl_requested()


def test_a_bad_switch_stops_the_model_load(monkeypatch) -> None:
    """The GPU models read their launch switches when they are made (graphs_default), so a bad SPECSPLIT_PDL is an
    error at load with its message, not a failed capture in the middle of a request."""
    from services.engine.models import qwen35_gpu

    monkeypatch.setenv(loader.PDL_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECSPLIT_PDL must be capture, always or off"):
        qwen35_gpu.graphs_default()
    monkeypatch.setenv(loader.PDL_ENV, "off")
    assert qwen35_gpu.graphs_default() in (True, False)


def test_argument_marshalling() -> None:
    class Ptr:
        ptr = 0x7F00_0000_1000

    class DeviceArray:
        data = Ptr()

    assert loader._ctype_arg(DeviceArray()).value == Ptr.ptr
    for v, ct in ((np.int32(-3), ctypes.c_int32), (np.int64(1 << 40), ctypes.c_int64), (np.uint32(7), ctypes.c_uint32),
                  (np.float32(0.5), ctypes.c_float), (np.float64(-2.25), ctypes.c_double)):
        got = loader._ctype_arg(v)
        assert isinstance(got, ct) and got.value == v.item()
    # Python scalars as CuPy's own launch passes them: int as int64, float as double, bool as bool
    for v, ct in ((3, ctypes.c_int64), (1.5, ctypes.c_double), (True, ctypes.c_bool)):
        got = loader._ctype_arg(v)
        assert isinstance(got, ct) and got.value == v
    for bad in (np.float16(1), np.zeros(2), "x"):  # no C type to guess: refuse
        with pytest.raises(TypeError):
            loader._ctype_arg(bad)
    assert loader._dims(7) == (7, 1, 1) and loader._dims((2, 3)) == (2, 3, 1)


def _pdl_kernels() -> dict[str, set[str]]:
    """{source file: kernel names its launchers may fetch with pdl (True or a condition)}, read from the launchers."""
    found: dict[str, set[str]] = {}
    for py in KERNELS.glob("*.py"):
        text = py.read_text()
        src = re.search(r'^SOURCE = "([\w.]+)"', text, re.MULTILINE)
        for call in re.finditer(r"get_function\((?:[^()]|\([^()]*\))*\)", text):
            if "pdl=" in call.group(0) and "pdl=False" not in call.group(0):
                name = re.search(r'f?"(\w+)<', call.group(0))
                if name is None and "pdl=pdl" in call.group(0) and "def _fn(" in text:
                    continue  # the module's fetch helper passing pdl through: its callers are read below
                assert src and name, f"{py.name}: cannot read {call.group(0)!r}"
                # the portable build compiles the wait out (pdl.cuh): such a launch must never take PDL
                assert "not portable" in call.group(0), f"{py.name}: {call.group(0)!r} may launch a portable build"
                found.setdefault(src.group(1), set()).add(name.group(1))
        # a module's own fetch helper (kernels/deltanet.py's _fn) passes pdl= through to get_function
        for call in re.finditer(r"\b_fn\((?:[^()]|\([^()]*\))*\)", text):
            if "pdl=" in call.group(0) and "pdl=False" not in call.group(0):
                helper = re.search(r"def _fn\(.*?\n(?:    .*\n)+", text)
                assert helper and "not portable" in helper.group(0), f"{py.name}: _fn may launch a portable build"
                name = re.search(r'f?"(\w+)<', call.group(0))
                assert src and name, f"{py.name}: cannot read {call.group(0)!r}"
                found.setdefault(src.group(1), set()).add(name.group(1))
    return found


def _body(code: str, kernel: str, device: bool = False) -> str:
    """A kernel's body; for a kernel that does not wait itself but calls a shared *_body function (gemv_ring_kernel,
    gemv_ring_pair_kernel): that function's body."""
    m = re.search((r"__device__" if device else r"__global__") + r"[^;{]*?\b" + kernel + r"\s*\(", code)
    assert m, kernel
    start = code.index("{", m.end())
    depth, i = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
        if depth == 0:
            body = code[start:i]
            waits = "SS_GRID_WAIT();" in body or "SS_PDL_ENTRY();" in body
            shared = None if device or waits else re.search(r"\b(\w+_body)<", body)
            return _body(code, shared.group(1), device=True) if shared else body


def test_every_pdl_kernel_waits_for_its_predecessor() -> None:
    """A kernel launched with PDL may start before the previous kernel ends: it must hold at the grid dependency wait
    before it reads anything an earlier kernel wrote. The launchers opt in per kernel; each such kernel waits once."""
    found = _pdl_kernels()
    assert found.get("quant_gemv.cu") == {"gemv_ring_kernel", "gemv_ring_pair_kernel"}
    assert found.get("quant_matmul.cu") == {"pack_x_kernel", "pack_rms_kernel", "pack_silu_kernel", "qmv_kernel",
                                            "qmw_kernel"}
    assert found.get("deltanet.cu") == {"conv_silu_kernel", "conv_silu_rows_kernel", "qk_norm_gate_kernel",
                                        "conv_qk_norm_gate_kernel", "gdr_tree_walk_kernel", "gdr_decode_kernel"}
    assert found.get("attention.cu") == {"kv_store_kernel", "attn_partial_kernel", "attn_combine_kernel",
                                         "attn_decode_kernel"}
    assert found.get("norm_rope.cu") == {"head_norm_kernel"}
    assert "#define SS_GRID_WAIT()" in (KERNELS / "pdl.cuh").read_text()
    for source, names in found.items():
        code = (KERNELS / source).read_text()
        assert '#include "pdl.cuh"' in code, source
        for name in names:
            body = _body(code, name)
            waits = body.count("SS_GRID_WAIT();") + body.count("SS_PDL_ENTRY();")
            # qmw_kernel's producer warp waits on its own path (after its early weight copies), the other warps
            # after it: once for every thread
            want = 2 if name == "qmw_kernel" else 1
            assert waits == want, f"{source}: {name} must wait exactly once on every thread's path"


# ---- on a GPU ------------------------------------------------------------------------------------------------

def _gpu():
    reason = loader.unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs a GPU: {reason}")
    import cupy

    if loader.pdl_mode() == "off" and loader.pdl_requested() != "off":
        pytest.skip("this device or driver has no programmatic dependent launch (before sm_90, or HIP)")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["off", "capture"])
@pytest.mark.parametrize("tokens", [1, 23])
def test_graph_of_pdl_launches_equals_eager(mode: str, tokens: int, monkeypatch) -> None:
    """A decode-like chain (norm pack -> gate|up gemv -> SwiGLU pack -> down gemv adding into the residual, one token:
    the packs write the int16 staging and the products run on the gemv ring kernel) captured with PDL and replayed on
    fresh inputs equals the same chain launched eagerly without PDL, bit for bit. The matrices are large enough (tens
    of us per kernel) that a consumer starting early would read stale values. At 23 tokens (a verify) with every
    wide-step PDL switch on (quant_wide.PDL, quant_matmul.V2_PDL and PACK_PDL_WIDE): the chain twice, its products on
    the wide kernel (whose producer warp copies weights before the wait) and on v2, the residual adds of both."""
    cupy = _gpu()
    from kernels import quant_matmul as qm
    from kernels import quant_wide
    from tests.quant_twins import random_weights

    if tokens > 1:
        monkeypatch.setattr(quant_wide, "PDL", True)
        monkeypatch.setattr(qm, "V2_PDL", True)
        monkeypatch.setattr(qm, "PACK_PDL_WIDE", {"x": 4, "rms": 4, "silu": 4})

    rng = np.random.default_rng(7)
    d, f = 4096, 11008
    up = qm.QuantMatrix(qm.Q4_K, random_weights(qm.Q4_K, 2 * f, d, rng), (2 * f, d), name="gate|up")
    down = qm.QuantMatrix(qm.Q6_K, random_weights(qm.Q6_K, d, f, rng), (d, f), name="down")
    # small norm weights: random quants give |gate|, |up| in the thousands at unit scale, and silu(g) * u past fp16
    norm_w = cupy.asarray((0.01 * rng.standard_normal(d)).astype(np.float32))
    x = cupy.empty((tokens, d), dtype=cupy.float32)
    gu = cupy.empty((tokens, 2 * f), dtype=cupy.float32)

    from kernels import quant_gemv as qg

    assert qg.prefer_ring(qm.Q4_K, 1) and qg.prefer_ring(qm.Q6_K, 1) and qm.Q16_TOKENS >= 1  # the chain PDL serves

    keep: list = []  # the packs' buffers of the captured chain stay allocated for the graph's lifetime
    kernels = [("gemv", "gemv")] if tokens == 1 else [("wide", "v2"), ("v2", "wide")]

    def chain() -> None:
        for k_up, k_down in kernels:
            px = qm.pack_activations(x, rms_weight=norm_w)
            up.matmul(px, out=gu, kernel=k_up)
            ps = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:])
            down.matmul(ps, out=x, accumulate=True, kernel=k_down)
            keep.extend((px, ps))

    def eager(x0: np.ndarray) -> np.ndarray:
        monkeypatch.setenv(loader.PDL_ENV, "off")
        x[...] = cupy.asarray(x0)
        chain()
        cupy.cuda.Device().synchronize()
        return cupy.asnumpy(x)

    inputs = [rng.standard_normal((tokens, d)).astype(np.float32) for _ in range(6)]
    want = [eager(x0) for x0 in inputs]
    assert all(np.isfinite(w).all() for w in want), "the reference chain overflowed: the comparison would mean nothing"
    monkeypatch.setenv(loader.PDL_ENV, mode)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x[...] = cupy.asarray(inputs[0])
        chain()  # compile and configure outside the capture
        stream.synchronize()
        stream.begin_capture()
        chain()
        graph = stream.end_capture()
        for i, (x0, w) in enumerate(zip(inputs, want)):
            x[...] = cupy.asarray(x0)
            graph.launch(stream)
            stream.synchronize()
            got = cupy.asnumpy(x)
            bad = np.flatnonzero(got != w)
            assert bad.size == 0, (f"replay {i}: {bad.size} of {w.size} values differ, first at {bad[:5]}, max "
                                   f"|diff| {np.abs(got - w).max():.3e}")
