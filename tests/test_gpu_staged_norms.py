"""Staged norms in the qwen35 GPU step (models/qwen35_gpu.py STAGE_NORMS): at 1..3 tokens the product that writes the
residual stream stages the next RMSNorm for the ring gemv that reads it (kernels.quant_matmul.StagedNorm), so no
pack launch runs between them. On a synthetic model whose widths let every boundary stage (n_embd 512, Q4_K_M
types), the GPU step with staging is checked against the NumPy engine and against the GPU step without it.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else. Tolerance: the staged path drops the fp16
rounding of the normalised row (its int16 staging is finer), so it differs from the packed path by rounding only;
both are compared teacher-forced (the same tokens fed to every path) in units of the logits' spread.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kernels import loader
from kernels import quant_wide as qw

_REASON = loader.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"GPU staged-norm tests skipped: {_REASON}", allow_module_level=True)

from services.engine import synthetic as S  # noqa: E402
from services.engine.config import ModelConfig  # noqa: E402
from services.engine.loader import load_target  # noqa: E402
from services.engine.models import qwen35_gpu as q35  # noqa: E402
from services.engine.models.dflash import DrafterConfig  # noqa: E402
from services.engine.models.qwen35_gpu import load_gpu_target  # noqa: E402

pytestmark = pytest.mark.gpu

REL_TOL = 0.02   # max |a - b| / std(logits of the row), GPU vs NumPy (the packed path: ~3e-3 of the spread)


def _stage_shape() -> S.SyntheticShape:
    # 3 DeltaNet layers and one attention layer; every product K >= 512 (two ring warps to stage with)
    target = ModelConfig(
        arch="qwen35", n_layer=4, n_embd=512, n_ff=1024, n_vocab=512, n_head=4, n_head_kv=1, head_dim=128,
        rms_eps=1e-6, rope_theta=1e7, n_rot=32, context_length=4096,
        recurrent_layers=[(i + 1) % 4 != 0 for i in range(4)], full_attention_interval=4, ssm_conv_kernel=4,
        ssm_head_k_dim=64, ssm_n_k_heads=4, ssm_n_v_heads=4, ssm_inner_size=512,
        name="specsplit staged-norm test (synthetic)")
    drafter = DrafterConfig(
        n_layer=1, n_embd=512, n_ff=1024, n_head=4, n_head_kv=1, head_dim=128, rms_eps=1e-6, rope_theta=1e7,
        block_size=16, mask_token_id=500, target_layer_ids=[1], layer_causal=[True], sliding_window=64, n_vocab=512)
    return S.SyntheticShape(target, drafter, first_special=472, rope_sections=[6, 5, 5, 0], size_label="stage",
                            type_layers=4)


@functools.lru_cache(maxsize=1)
def models(tmp: str):
    S.SHAPES["stage-test"] = _stage_shape
    try:
        res = S.make_synthetic("stage-test", tmp, seed=11, draft=False, quiet=True)
    finally:
        S.SHAPES.pop("stage-test", None)
    return load_target(res.target_path).model, load_gpu_target(res.target_path, 0, with_tokenizer=False).model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return models(str(tmp_path_factory.mktemp("staged")))


WIDTHS = (1, 2, 3, 1, 3, 2, 1)   # chain steps of 1..3 tokens: every staged width


def _run(model, ids: list[int], steps: list[int], graphs: bool, widths: tuple[int, ...] = WIDTHS) -> list[np.ndarray]:
    """Prefill ids, then chains of `widths` tokens from steps (teacher-forced): every logits row of every step."""
    if hasattr(model, "use_graphs"):
        model.use_graphs = graphs
    st = model.new_state(256)
    model.forward(st, ids, logits="last")
    st.commit(range(len(ids)))
    out, j = [], 0
    for w in widths:
        r = model.forward(st, steps[j:j + w], logits="all")
        st.commit(range(w))
        out.extend(np.asarray(r.logits, np.float64).reshape(w, -1))
        j += w
    return out


def _tokens(seed: int, widths: tuple[int, ...] = WIDTHS) -> tuple[list[int], list[int]]:
    """A 40-token prompt and the tokens of the steps of `widths`."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 400, 40)], [int(t) for t in rng.integers(0, 400, sum(widths))]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.std(b))


def test_every_boundary_stages_at_narrow_widths(pair, monkeypatch) -> None:
    _, gpu = pair
    n = gpu.cfg.n_layer
    monkeypatch.setattr(q35, "STAGE_UP_TO", {"post": 3, "next": 3})
    no, yes = (False,) * n, (True,) * n
    monkeypatch.setattr(q35, "FUSE_SWIGLU_WIDTHS", (1, 2, 3))
    monkeypatch.setattr(q35, "SWIGLU_PAIR_WIDTHS", ())
    ones, twos = (1,) * n, (2,) * n  # swi: the tile-pair blocks, the cluster pairs
    for T in (1, 2, 3):
        post, nxt, swi = gpu._norm_plan(T, "all")
        assert post == (False,) + (True,) * (n - 1), T   # layer 0 keeps its pack (the step's input rows)
        assert nxt == yes and swi == ones, T
    monkeypatch.setattr(q35, "SWIGLU_PAIR_WIDTHS", (2,))
    pairs = q35.qm.quant_gemv.clusters_available()
    assert gpu._norm_plan(2, "all")[2] == (twos if pairs else ones)
    assert gpu._norm_plan(1, "all")[2] == ones
    monkeypatch.setattr(q35, "SWIGLU_PAIR_WIDTHS", ())
    post, nxt, _ = gpu._norm_plan(2, "last")
    assert nxt[-1] is False and all(nxt[:-1])   # a staged output norm covers every row: not for the last only
    assert gpu._norm_plan(4, "all") == (no, no, no)   # v2 from 4 tokens: packs
    monkeypatch.setattr(q35, "STAGE_UP_TO", {"post": 1, "next": 3})
    assert gpu._norm_plan(2, "all") == (no, yes, yes)
    monkeypatch.setattr(q35, "STAGE_NORMS", False)
    assert gpu._norm_plan(1, "all") == (no, no, yes)
    monkeypatch.setattr(q35, "FUSE_SWIGLU_WIDTHS", (2,))
    assert gpu._norm_plan(1, "all")[2] == (0,) * n and gpu._norm_plan(2, "all")[2] == ones


@pytest.mark.parametrize("graphs", [False, True])
def test_staged_step_matches_numpy_and_the_packed_step(pair, graphs: bool, monkeypatch) -> None:
    cpu, gpu = pair
    monkeypatch.setattr(q35, "STAGE_UP_TO", {"post": 3, "next": 3})
    ids, steps = _tokens(5)
    want = _run(cpu, ids, steps, graphs)
    staged = _run(gpu, ids, steps, graphs)
    monkeypatch.setattr(q35, "STAGE_NORMS", False)
    packed = _run(gpu, ids, steps, graphs)
    for i, (w, s, p) in enumerate(zip(want, staged, packed)):
        assert _rel(s, w) < REL_TOL, (i, _rel(s, w), _rel(p, w))
        assert _rel(p, w) < REL_TOL, (i, _rel(p, w))
        assert _rel(s, p) < REL_TOL, (i, _rel(s, p))
        assert not np.array_equal(s, p)   # the staged path did run (it rounds differently)


@pytest.mark.parametrize("graphs", [False, True])
def test_stagings_without_packs_are_the_same_step(pair, graphs: bool, monkeypatch) -> None:
    """ffn_gate_up's ring staging SwiGLU for ffn_down (FUSE_SWIGLU_WIDTHS, here at every width it can run), the
    attention writing attn_output's staging (ATTN_STAGE_UP_TO) and a decode token's DeltaNet layer writing ssm_out's
    (FUSE_DECODE_NORM: the one-token steps) give the same logits, bit for bit, as the packs (with and without staged
    norms, eager and captured), and within the tolerance of the NumPy engine."""
    cpu, gpu = pair
    rec = next(w for i, w in enumerate(gpu.layers) if gpu.cfg.recurrent_layers[i])
    assert q35.reads_staging(rec["ssm_out"], 1) and q35.dn.norm_stages(gpu.cfg.ssm_n_v_heads, gpu.cfg.ssm_head_v_dim)
    monkeypatch.setattr(q35, "STAGE_UP_TO", {"post": 3, "next": 3})
    ids, steps = _tokens(6)
    want = _run(cpu, ids, steps, graphs)
    for stage in (True, False):
        monkeypatch.setattr(q35, "STAGE_NORMS", stage)
        monkeypatch.setattr(q35, "FUSE_SWIGLU_WIDTHS", (1, 2, 3))
        monkeypatch.setattr(q35, "ATTN_STAGE_UP_TO", 3)
        monkeypatch.setattr(q35, "FUSE_DECODE_NORM", True)
        fused = _run(gpu, ids, steps, graphs)
        monkeypatch.setattr(q35, "FUSE_SWIGLU_WIDTHS", ())
        monkeypatch.setattr(q35, "ATTN_STAGE_UP_TO", 0)
        monkeypatch.setattr(q35, "FUSE_DECODE_NORM", False)
        packed = _run(gpu, ids, steps, graphs)
        for i, (w, a, b) in enumerate(zip(want, fused, packed)):
            assert np.array_equal(a, b), (stage, i)
            assert _rel(a, w) < REL_TOL, (stage, i, _rel(a, w))


WIDE_WIDTHS = (25, 41, 32, 64, 52)   # chain steps where this model's ffn_gate_up (2048 x 512 Q4_K) runs on the wide
SWIGLU_WIDTHS = (25, 41, 32, 52)     # kernel, and as its SwiGLU launch (quant_wide.SWIGLU_TILES: up to 7 token tiles,
#                                      not 8; the 40-token prompt's chain takes it at 5)
# GPU vs NumPy at these widths: fp16 x into the wide products (and fp16 silu(g) u), max |a - b| / std 0.021 on an H100
# for the step with the pack and with the SwiGLU launch alike on the first rows, growing along the chain: 0.0486 on
# row 124 (the 64-token step's 19th, 106 rows in; the packed and the fused step give the same bits there, so it is the
# fp16 rounding's drift against float64, not the launch); 0.07: ~1.5x that, a wrong product gives O(1)
WIDE_REL_TOL = 0.07


@pytest.mark.parametrize("graphs", [False, True])
def test_wide_swiglu_launch_matches_the_pack(pair, graphs: bool, monkeypatch) -> None:
    """Where ffn_gate_up runs on the wide kernel (at SWIGLU_TILES' token tiles), its SwiGLU launch
    (FUSE_WIDE_SWIGLU: fp16(silu(g) u) written as ffn_down's packed x) runs instead of the product and the SwiGLU
    pack: within the tolerance of the NumPy engine and of the packed step (its split row blocks' sums round where its
    own split puts them), the same bits eager and captured; wider steps keep the pack."""
    cpu, gpu = pair
    w = next(iter(gpu.layers))
    assert [T for T in WIDE_WIDTHS if q35.can_wide_swiglu(w["ffn_gate_up"], w["ffn_down"], T)] == list(SWIGLU_WIDTHS)
    ids, steps = _tokens(8, WIDE_WIDTHS)
    want = _run(cpu, ids, steps, graphs, WIDE_WIDTHS)
    calls: list[int] = []
    real = qw.wide_swiglu
    monkeypatch.setattr(qw, "wide_swiglu", lambda *a, **kw: calls.append(a[1].tokens) or real(*a, **kw))
    fused = _run(gpu, ids, steps, graphs, WIDE_WIDTHS)
    # (the prompt's chain too where it runs at its own width, eagerly; as a graph step it is padded to a 64-token
    # checkpointed chain, 8 token tiles: qwen35_gpu.PROMPT_GRAPHS)
    assert set(calls) == set(SWIGLU_WIDTHS) | (set() if graphs and q35.PROMPT_GRAPHS else {len(ids)})
    monkeypatch.setattr(q35, "FUSE_WIDE_SWIGLU", False)
    calls.clear()
    packed = _run(gpu, ids, steps, graphs, WIDE_WIDTHS)
    assert not calls
    for i, (ref, a, b) in enumerate(zip(want, fused, packed)):
        assert _rel(a, ref) < WIDE_REL_TOL, (i, _rel(a, ref), _rel(b, ref))
        assert _rel(a, b) < REL_TOL, (i, _rel(a, b))
    if graphs:
        monkeypatch.setattr(q35, "FUSE_WIDE_SWIGLU", True)
        eager = _run(gpu, ids, steps, False, WIDE_WIDTHS)
        assert all(np.array_equal(a, e) for a, e in zip(fused, eager))
