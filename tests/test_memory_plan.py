"""Start-up memory planning (services/engine/memory_plan.py): arithmetic, refusals, devices, --plan-only."""

import json

import numpy as np
import pytest

from services.cli import main
from services.engine import memory_plan as M
from services.engine import synthetic as S

GiB = 1 << 30
MiB = 1 << 20
STATE_27B = 48 * 128 * 128 * 4            # one Gated DeltaNet state: H_v x d_k x d_v float32


@pytest.fixture(scope="module")
def q27():
    """Qwen3.6-27B config, its Q4_K_M weight bytes and the DFlash drafter shape, from the synthetic plan."""
    sh = S.get_shape("qwen3.6-27b")
    w = M.WeightBytes.of({s.name: s for s in S.target_tensors(sh.target)})
    d = sh.drafter
    ds = M.drafter_shape_of(d, M.WeightBytes.of({s.name: s for s in S.drafter_tensors(d)}))
    assert (ds.n_layer, ds.block_size, ds.n_features, ds.sliding_window, ds.n_causal) == (5, 16, 25600, 2048, 4)
    return sh.target, w, ds


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return S.make_synthetic("tiny", str(tmp_path_factory.mktemp("plan")), seed=2, quiet=True)


GPU = M.Device("cuda", 0)


def _plan(q27, free_gib=80.0, **kw):
    cfg, w, ds = q27
    s = M.PlanSettings(**{"max_ctx": 262144, "device": GPU, **kw})
    return M.build_plan(cfg, w, s, ds, free={"cuda:0": (int(free_gib * GiB), 80 * GiB)})


def test_kv_bytes_per_token_by_hand(q27):
    cfg = q27[0]
    # 16 attention layers x 4 KV heads x 256 values, K and V
    assert M.kv_bytes_per_token(cfg, "f16", "f16") == 16 * 4 * 256 * 2 * 2 == 65536
    assert M.kv_bytes_per_token(cfg, "tq3_0", "tq3_0") == 16 * 4 * 256 * 2 * 14 / 32 == 14336
    assert M.kv_bytes_per_token(cfg, "q8_0", "tq3_0") == 16 * 4 * 256 * (34 + 14) / 32 == 24576
    assert M.kv_bytes_per_token(cfg, "f32", "f32") == 131072
    assert _plan(q27, cache_type_k="f16", cache_type_v="f16").devices[0].get("KV cache") == 17_179_869_184
    assert _plan(q27, cache_type_k="tq3_0", cache_type_v="tq3_0").devices[0].get("KV cache") == 3_758_096_384
    with pytest.raises(M.MemoryPlanError, match="unknown KV cache type 'q4'"):
        M.kv_bytes_per_token(cfg, "q4", "f16")


def test_27b_items_by_hand(q27):
    """The GPU plan of Qwen3.6-27B Q4_K_M, item by item, as the GPU engine allocates (per slot: a pooled state and a
    drafter session of the whole context; per device: one graph arena, the eager scratch, a request's copies)."""
    plan = _plan(q27, budget=22, cache_type_k="q8_0", cache_type_v="tq3_0")
    d = plan.devices[0]
    assert plan.width == 23 and plan.state_width == 64     # a state also holds a prompt's 64-token graph steps
    # stored Q4_K_M bytes on the GPU, plus the matmul kernel's 1 KiB read slack after each of the 289 device
    # matrices (the file's 497 stacked as the engine uploads them: 4 per DeltaNet layer, qkv|gate|beta|alpha,
    # gate|up, ssm_out, ffn_down; 4 per attention layer, q|k|v, output, gate|up, down; one more on each of the 32
    # more-bits layers, whose Q6_K qkv or v is a run of its own; the head), and CuPy's 512-byte units around
    # ssm_a and ssm_dt (48 floats each); no row count needs padding to 16
    assert d.get("target weights") == 16_536_406_016 + 289 * 1024 + 48 * 2 * (512 - 192)
    assert d.get("KV cache") == 262144 * 16 * 4 * (272 + 112)        # q8_0 / tq3_0 rows of 256 values
    assert d.get("recurrent state") == 2 * 48 * STATE_27B            # the ping-pong pair
    # no per-node states on the GPU (a commit replays the accepted path): per node its conv output row + g, beta,
    # for 64 nodes (a prompt's last chunk is a checkpointed chain padded up to 64 tokens)
    assert d.get("recurrent checkpoints") == 0
    assert d.get("recurrent replay inputs") == 48 * 64 * (10240 + 2 * 48) * 4 + 64 * 4
    assert d.get("conv windows") == 48 * (3 + 512) * 10240 * 4        # a prefill chunk's raw rows
    # 64 logits rows, argmax ids + maxima, 5 captured layers of 64 rows; step values (256-byte spans: tokens,
    # positions, parents, s_len, swap, mask) + commit rows
    assert d.get("step outputs") == 64 * 248320 * 4 + 2 * 64 * 4 + 64 * 5 * 5120 * 4 + (3 * 256 + 2 * 256 + 512) + (
        16 + 2 * 8 * 64)
    assert d.get("graph arena") == M.graph_arena_bytes(q27[0], 64, "q8_0", "tq3_0", q27[2], 132)
    # the device sampler draws the verify's 23 rows
    assert d.get("device sampler") == M.gpu_sampler_bytes(23, 248320, 262144)
    assert 40 * M.MiB < d.get("graph arena") < 128 * M.MiB
    assert d.get("CUDA graphs") == 64 * (16 * 64 + 40 + 4 * 16 + 4) * 8192
    # 26 device matrices (per layer q, k|v, output, gate|up, down; fc) and the block's two attention masks
    assert d.get("drafter weights") == 1_838_535_680 + 26 * 1024 + 2 * 512
    # 262144 + 16 rows in whole 32-row tiles, f16 K and V, every layer (also the sliding ones)
    assert d.get("drafter context cache") == 262176 * 5 * 2 * 8 * 128 * 2
    # pass values and 64 appended feature rows (the sliding layers read their window in the context cache)
    assert d.get("drafter session buffers") == 512 + 64 * 25600 * 4
    assert d.get("workspace reserve") == M.RESERVE_BYTES["cuda"]
    assert d.total == sum(i.bytes for i in d.items) and plan.fits
    # a chain verifies block_size tokens, a small tree still plans a chain (a request may ask for one); no drafter: 1
    assert _plan(q27, budget=None).width == 16 and _plan(q27, budget=5).width == 16
    assert _plan(q27, budget=None).devices[0].get("recurrent replay inputs") == 48 * 64 * (10240 + 96) * 4 + 64 * 4
    # the GPU verifies at most 64 tokens (the attention kernel's mask); the NumPy engine the whole tree
    assert _plan(q27, budget=64).width == 64
    cfg, w, ds = q27
    assert M.build_plan(cfg, w, M.PlanSettings(max_ctx=4096, budget=64), ds, free={"cpu": (GiB, GiB)}).width == 65
    # the NumPy engine still counts one checkpoint per node: budget + 1, a chain block_size
    cpu = M.build_plan(cfg, w, M.PlanSettings(max_ctx=4096, budget=22), ds, free={"cpu": (1 << 40, 1 << 40)})
    assert cpu.devices[0].get("recurrent checkpoints") == 48 * 23 * STATE_27B == 3_472_883_712
    assert cpu.devices[0].get("recurrent replay inputs") == 0
    plain = M.build_plan(cfg, w, M.PlanSettings(max_ctx=4096, device=GPU, speculative=False), None,
                         free={"cuda:0": (80 * GiB, 80 * GiB)})
    assert plain.width == 1 and plain.state_width == 64 and plain.devices[0].get("drafter weights") == 0
    # plain decoding's prompts are graph steps of 64 tokens too (~0.2 GB a slot: the replay inputs and logits rows)
    assert plain.devices[0].get("step outputs") == 64 * 248320 * 4 + 2 * 64 * 4 + (3 * 256 + 2 * 256 + 512) + (
        16 + 2 * 8 * 64)
    assert plain.devices[0].get("recurrent replay inputs") == d.get("recurrent replay inputs")
    assert plain.devices[0].get("device sampler") == M.gpu_sampler_bytes(1, 248320, 4096)
    assert "widest verify 1 tokens (prompt steps 64)" in plain.table() and plain.as_dict()["state_width"] == 64
    # two slots double every per-slot item; the weights and what the steps share (one at a time) stay once
    two = _plan(q27, slots=2).devices[0]
    one = _plan(q27).devices[0]
    for name in ("KV cache", "recurrent checkpoints", "conv windows", "step outputs", "CUDA graphs",
                 "drafter context cache", "drafter CUDA graphs"):
        assert two.get(name) == 2 * one.get(name), name
    for name in ("target weights", "graph arena", "eager pass scratch", "request copies", "drafter weights"):
        assert two.get(name) == one.get(name), name


def test_gpu_scratch_grows_with_width_and_splits(q27):
    """The step scratch the arena is planned for: monotone in the width; the attention's partials follow the SMs."""
    cfg = q27[0]
    steps = [M.gpu_step_scratch(cfg, t, 132) for t in (1, 8, 16, 23, 41, 64)]
    assert steps == sorted(steps) and steps[0] < 8 * M.MiB and steps[-1] < 64 * M.MiB
    assert M.attention_splits_bound(24, 4, 1, 132) == 99      # decode: KW 4 on dims, one block row, 3 blocks per SM
    assert M.attention_splits_bound(24, 4, 64, 132) == 11
    assert M.gpu_step_scratch(cfg, 64, 264) > M.gpu_step_scratch(cfg, 64, 132)
    # a remote drafter (no shape): the target still keeps 5 captured layers per step
    p = M.build_plan(cfg, q27[1], M.PlanSettings(max_ctx=8192, device=GPU), None,
                     free={"cuda:0": (80 * GiB, 80 * GiB)}, sms=132)
    st = M.gpu_state_bytes(cfg, 8192, "f16", "f16", 64, 5)
    assert p.devices[0].get("step outputs") == st["step outputs"] + st["step values"]
    assert st["step outputs"] - M.gpu_state_bytes(cfg, 8192, "f16", "f16", 64, 0)["step outputs"] == 64 * 5 * 5120 * 4
    assert p.devices[0].get("drafter weights") == 0


def test_attention_split_bound_holds_for_the_kernel_policy(monkeypatch):
    """The arena's attention partials are planned at attention_splits_bound: never below what
    kernels.attention.choose_splits picks for any context (the graph's s_hint is a bucket up to the context), and
    equal to it once the context is long."""
    from kernels import attention as att

    for sms in (78, 132):
        monkeypatch.setattr(att, "_sm_count_now", lambda sms=sms: sms)
        for H, Hkv, D in ((24, 4, 256), (4, 2, 64), (32, 8, 128), (16, 16, 128)):
            for T in (1, 2, 5, 16, 23, 33, 64):
                bound = M.attention_splits_bound(H, Hkv, T, sms, D)
                picks = [att.choose_splits(H, Hkv, D, T, s) for s in (0, 31, 100, 511, 4096, 65536, 1 << 20)]
                assert max(picks) <= bound == picks[-1], (H, Hkv, D, T, sms, picks, bound)
                # attention()'s own warps a tile at short contexts (default_kw) give no more splits
                for s in (0, 31, 100, 511, 1024 - T, 2048 - T, 4096 - T, 4096):
                    for f16 in (False, True):
                        kw = att.default_kw(H, Hkv, T, s + T, f16=f16)
                        assert att.choose_splits(H, Hkv, D, T, s, kw=kw) <= bound
                assert bound * H * T * (D + 2) * 4 <= max(att.WS_CAP_BYTES, H * T * (D + 2) * 4)


def test_wide_kernel_split_scratch_is_planned(q27):
    """The wide kernel's stream-K partials (kernels/quant_gemv.split_scratch, dispatched from quant_wide.CROSSOVER
    tokens): quant_wide.scratch_need bounds what a launch takes whatever its registers, and the plan holds one buffer
    of the largest need per stream (27B: the LM head at 57..64 tokens, 132 blocks (1 per SM by shared memory) of 8
    warps x two m16 tiles x 64 tokens; two streams: 34,734,080 bytes, 33.1 MiB; 29.0 MiB, as an H100 held on
    2026-11-26, before the LM head took two m16 tiles a warp)."""
    from kernels import quant_gemv as qg
    from kernels import quant_wide as qw

    cfg, w, ds = q27
    for qtype, n_out, k in sorted(w.mats | ds.weights.mats):
        first = next(t for t in range(1, 65) if qw.prefer_wide(qtype, t, n_out, k))  # a deep / tall matrix's own
        for tokens in sorted({first, qw.CROSSOVER[qtype], 32, 41, 64}):
            part, counters = qw.scratch_need(qtype, n_out, k, tokens, 132)
            c = qw.choose_config(qtype, n_out, k, tokens)
            smem = qw.smem_bytes(qtype, (tokens + 7) // 8, c.m_tiles, c.warps, c.stages)
            for regs in (64, 128, 168, 255):
                blocks = qw.grid(n_out, k, c, regs, smem, 132)
                assert qw.scratch_floats(blocks, (tokens + 7) // 8, c.m_tiles, c.warps) <= part
            assert counters == qw.row_blocks(n_out, c.m_tiles, c.warps) * c.warps
    assert M.split_scratch_need(w.mats, 132) == (2 * 132 * 8 * 2 * 16 * 64, 15520)
    assert M.split_scratch_bytes(w.mats, 2, 132) == 2 * 4 * (4_325_376 + qg.SCRATCH_FIRST[1]) == 34_734_080
    remote = M.build_plan(cfg, w, M.PlanSettings(max_ctx=8192, budget=63, device=GPU), None,
                          free={"cuda:0": (80 * GiB, 80 * GiB)}, sms=132).devices[0]
    assert remote.get("split-K scratch") == 34_734_080
    local = _plan(q27, max_ctx=8192).devices[0]
    assert local.get("split-K scratch") == M.split_scratch_bytes(w.mats | ds.weights.mats, 3, 132)


def test_device_sampler_is_planned_per_slot(q27, monkeypatch):
    """kernels/sampling.SampleWorkspace, made for the planned width with its penalised rows and the upload of the
    longest penalty window, allocates exactly gpu_sampler_bytes (every array in CuPy's 512-byte units)."""
    import types

    import numpy as np

    from kernels import loader
    from kernels import sampling as smp

    made = []

    def alloc(fn):
        def make(*a, **k):
            arr = fn(*a, **k)
            made.append(arr.nbytes)
            return arr
        return make

    stream = types.SimpleNamespace(record=lambda: types.SimpleNamespace(synchronize=lambda: None))
    cuda = types.SimpleNamespace(alloc_pinned_memory=lambda n: bytearray(n), get_current_stream=lambda: stream,
                                 runtime=types.SimpleNamespace(getDevice=lambda: 0))
    cp = types.SimpleNamespace(zeros=alloc(np.zeros), empty=alloc(np.empty), uint8=np.uint8, uint32=np.uint32,
                               uint64=np.uint64, int32=np.int32, float32=np.float32, float64=np.float64, cuda=cuda)
    monkeypatch.setattr(loader, "require", lambda: cp)
    rows, vocab, window = 23, 5000, 300
    ws = smp.SampleWorkspace(rows, vocab)
    ws.penalised_rows()
    rin, tok = smp.penalty_windows(np.arange(rows), list(range(window)), [list(range(rows))] * rows, -1)
    ws.upload(np.zeros(rows), rin, tok)
    assert sum(M._pool(n) for n in made) == M.gpu_sampler_bytes(rows, vocab, window)
    cfg, w, ds = q27
    p = _plan(q27, max_ctx=8192, budget=22, slots=2).devices[0]
    assert p.get("device sampler") == 2 * M.gpu_sampler_bytes(23, cfg.n_vocab, 8192)
    assert 2 * 23 * cfg.n_vocab * 4 < p.get("device sampler") < 2 * 23 * cfg.n_vocab * 4 + 4 * M.MiB


def test_gpu_weights_count_matrices_vectors_and_fallbacks(q27):
    cfg, w, _ = q27
    sh = S.get_shape("qwen3.6-27b")
    specs = S.target_tensors(sh.target)
    mats = [t for t in specs if len(t.shape) == 2 and t.name != "token_embd.weight" and "conv1d" not in t.name]
    assert len(mats) == 497 and w.gpu == w.stored + 289 * 1024 + 48 * 2 * 320 and not w.embd_on_host
    assert len(w.mats) == 11 and w.head == (S.Q.Q6_K, 248320, 5120)
    # a matrix type the kernels lack (BF16) goes up as F16; a token table they cannot decode stays on the host
    Q = S.Q
    odd = {t.name: t for t in specs}
    odd["output.weight"] = S.TensorSpec("output.weight", (248320, 5120), Q.BF16, "matrix")
    odd["token_embd.weight"] = S.TensorSpec("token_embd.weight", (248320, 5120), Q.Q6_K, "embedding")
    w2 = M.WeightBytes.of(odd)
    assert w2.embd_on_host and w2.embd_gpu == 0
    q4 = next(t for t in specs if t.name == "token_embd.weight").nbytes
    q6 = next(t for t in specs if t.name == "output.weight").nbytes
    assert w2.gpu == w.gpu - q4 - q6 + 248320 * 5120 * 2
    # Q5_K goes up as it is stored (v2 takes it): 176 bytes a 256 values, padded like every matrix
    odd["output.weight"] = S.TensorSpec("output.weight", (248320, 5120), Q.Q5_K, "matrix")
    w3 = M.WeightBytes.of(odd)
    assert w3.head == (Q.Q5_K, 248320, 5120)
    assert w3.gpu == w2.gpu - 248320 * 5120 * 2 + 248320 * 5120 // 256 * 176


def test_gpu_matrices_go_up_as_stored_only_where_a_gpu_run_proved_the_kernel(monkeypatch):
    """backend.GpuMatrix.of: Q5_K, IQ4_XS, Q3_K, Q4_0 and IQ4_NL as stored (their kernels ran on a GPU: sessions 40
    and 41); a type whose v2 dequantization has run only in the CPU simulation (quant_matmul.UNPROVEN_QTYPES, empty
    now: as IQ4_XS stood before session 40, Q3_K and Q4_0 before session 41) and a type without a kernel (BF16) as F16,
    as the plan counts."""
    from kernels import quant_matmul as qm
    from services.engine.backend import GpuMatrix
    from services.engine.formats import RawTensor
    from tests.quant_twins import random_weights

    rng = np.random.default_rng(0)
    assert {qm.Q5_K, qm.IQ4_XS, qm.Q3_K, qm.Q4_0, qm.IQ4_NL} <= qm.SUPPORTED_QTYPES and not qm.UNPROVEN_QTYPES
    raws = {q: random_weights(q, 32, 512, rng) for q in (qm.Q5_K, qm.IQ4_XS, qm.Q3_K, qm.Q4_0)}
    for unproven in (qm.UNPROVEN_QTYPES, frozenset((qm.IQ4_XS, qm.Q3_K, qm.Q4_0))):
        monkeypatch.setattr(qm, "SUPPORTED_QTYPES", frozenset(qm._TYPES) - unproven)
        for qtype, raw in raws.items():
            m = GpuMatrix.of(RawTensor("w", qtype, (32, 512), raw, "test"))
            native = qtype not in unproven
            assert (m.qtype, m.fallback) == ((qtype, False) if native else (qm.F16, True)), qtype
            if not native:
                want = RawTensor("w", qtype, (32, 512), raw, "test").dequantize().astype(np.float16)
                assert np.array_equal(m.rows.view(np.float16), want)
    blocks = np.zeros((32 * 512, 2), np.uint8)
    assert GpuMatrix.of(RawTensor("w", 30, (32, 512), blocks, "test")).fallback      # BF16: no kernel at all


def test_bf16_and_f32_matrices_go_up_as_f16_or_are_refused_by_name():
    """backend.GpuMatrix.of: a BF16 matrix goes up as F16 (the same bytes; bf16's 8 mantissa bits fit f16's 11), but a
    value past F16's range would become an infinity in every product: refused, naming the file, tensor and value."""
    from services.engine.backend import F16_MAX, GpuMatrix
    from services.engine.errors import UnsupportedModelError
    from services.engine.formats import RawTensor
    from services.engine.quants import quantize

    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (16, 64)).astype(np.float32)
    bf16 = quantize(w, 30)
    m = GpuMatrix.of(RawTensor("blk.0.ffn_up.weight", 30, (16, 64), bf16, "model.gguf"))
    want = RawTensor("w", 30, (16, 64), bf16, "x").dequantize()
    assert m.fallback and m.qtype == 1
    assert np.array_equal(m.rows.view(np.float16).astype(np.float32), want)   # exact: no bf16 value rounds
    w[3, 7] = 3.0e5
    with pytest.raises(UnsupportedModelError, match=r"model.gguf: tensor 'blk.0.ffn_up.weight'.*BF16.*2.99e\+05"):
        GpuMatrix.of(RawTensor("blk.0.ffn_up.weight", 30, (16, 64), quantize(w, 30), "model.gguf"))
    w[3, 7] = F16_MAX          # the largest finite f16 still goes up
    assert GpuMatrix.of(w, name="dense").fallback
    w[3, 7] = np.nan
    with pytest.raises(UnsupportedModelError, match="dense.*non-finite"):
        GpuMatrix.of(w, name="dense")


def test_gpu_table_types_are_those_the_device_decodes():
    from kernels import quant_matmul as qm

    assert set(M.GPU_TABLE_TYPES) == set(qm.EMBED_TYPES)


def test_numpy_weights_are_float32(q27):
    cfg, w, _ = q27
    n_params = w.f32 // 4
    assert 26.8e9 < n_params < 27.0e9
    # everything float32 but the packed Q4_K token_embd (248320 x 5120)
    assert w.resident("numpy") == 4 * (n_params - 248320 * 5120) + 248320 * 5120 // 256 * 144


def test_separate_draft_device(q27):
    cfg, w, ds = q27
    s = M.PlanSettings(max_ctx=65536, device=GPU, draft_device=M.Device("cuda", 1))
    plan = M.build_plan(cfg, w, s, ds, free={"cuda:0": (80 * GiB, 80 * GiB), "cuda:1": (80 * GiB, 80 * GiB)})
    t, d = plan.devices
    assert (t.device, d.device) == ("cuda:0", "cuda:1")
    assert t.get("drafter weights") == 0 and d.get("drafter weights") == 1_838_535_680 + 26 * 1024 + 2 * 512
    # the drafter needs its own copy of token_embd (Q4_K) and output (Q6_K)
    assert d.get("target embedding + head copy") == 248320 * 5120 // 256 * (144 + 210)
    assert d.get("workspace reserve") == t.get("workspace reserve") == M.RESERVE_BYTES["cuda"]


def test_refusal_names_what_fits(q27):
    cfg, w, ds = q27
    s = M.PlanSettings(max_ctx=262144, budget=22, cache_type_k="f16", cache_type_v="f16", device=GPU)
    free = {"cuda:0": (40 * GiB, 80 * GiB)}
    with pytest.raises(M.MemoryPlanError) as e:
        M.plan_memory(cfg, w, s, ds, free=free)
    msg = str(e.value)
    need = M.build_plan(cfg, w, s, ds, free).devices[0].total
    assert "does not fit" in msg and f"cuda:0 needs {need / GiB:.2f} GiB" in msg and "40.00 GiB free" in msg
    ctx = int(msg.split("--max-ctx ")[1].split(";")[0])
    assert ctx % 256 == 0
    assert M.build_plan(cfg, w, M.replace(s, max_ctx=ctx), ds, free).fits
    assert not M.build_plan(cfg, w, M.replace(s, max_ctx=ctx + 256), ds, free).fits
    assert "--cache-type-k q8_0 --cache-type-v q8_0" in msg
    # a tighter device where a smaller budget saves the day (on the GPU a budget moves only the device sampler's
    # rows, ~1 MB a node at a 248k vocabulary: a state holds a prompt's 64-token steps whatever the budget)
    s2 = M.replace(s, max_ctx=8192, budget=64)
    need = M.build_plan(cfg, w, s2, ds, free).devices[0].total
    tight = {"cuda:0": (need - 16 * MiB, 80 * GiB)}
    with pytest.raises(M.MemoryPlanError, match=r"--budget \d+") as e2:
        M.plan_memory(cfg, w, s2, ds, free=tight)
    b = int(str(e2.value).split("--budget ")[1].split(";")[0].split(".")[0])
    assert 1 <= b < 64 and M.build_plan(cfg, w, M.replace(s2, budget=b), ds, tight).fits
    # nothing helps: the weights alone are too big
    floor = r"even at max_ctx 1 it needs cuda:0 \d+\.\d\d GiB \(weights 17\.11 GiB"    # target + drafter
    with pytest.raises(M.MemoryPlanError, match=floor):
        M.plan_memory(cfg, w, s, ds, free={"cuda:0": (10 * GiB, 16 * GiB)})


def test_a_file_the_gpu_kernels_cannot_read_says_so(q27, monkeypatch):
    """A Q3_K 27B (a Q3_K_M-sized file of ~12 GB a 16 GB card would run) goes up as stored; as it did before the kernels
    read Q3_K (session 41; as a type without a kernel would now: quant_matmul.SUPPORTED_QTYPES without it), its
    matrices go up as F16, ~4.7x their bytes. The plan says so (--plan-only's note, the start-up log's warning), and a
    refusal names the cause and a file in the kernels' types instead of "a smaller quantization"; a Q4_K_M file plans
    no such note."""
    from kernels import quant_matmul as qm

    cfg, w, ds = q27
    assert w.f16_fallback == {} and _plan(q27).warnings == []
    sh = S.get_shape("qwen3.6-27b")
    iq = {}
    for t in S.target_tensors(sh.target):
        q = S.Q.Q3_K if t.qtype in (S.Q.Q4_K, S.Q.Q6_K) and t.name != "token_embd.weight" else t.qtype
        iq[t.name] = S.TensorSpec(t.name, t.shape, q, t.kind)
    native = M.WeightBytes.of(iq)
    assert native.f16_fallback == {} and native.gpu < 1.01 * native.stored < 12 * GiB
    monkeypatch.setattr(qm, "SUPPORTED_QTYPES", qm.SUPPORTED_QTYPES - {qm.Q3_K})
    wi = M.WeightBytes.of(iq)
    stored, gpu = wi.f16_fallback["Q3_K"]
    assert list(wi.f16_fallback) == ["Q3_K"] and 4.6 < gpu / stored < 4.7 and stored < 11 * GiB < 45 * GiB < gpu
    s = M.PlanSettings(max_ctx=4096, budget=22, device=GPU)
    plan = M.build_plan(cfg, wi, s, ds, free={"cuda:0": (140 * GiB, 141 * GiB)})
    assert plan.fits and len(plan.warnings) == 1 and plan.warnings[0].startswith("target: the Q3_K matrices")
    assert "dequantized to F16" in plan.warnings[0] and "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS" in plan.warnings[0]
    assert "note: target: the Q3_K matrices" in plan.table()
    with pytest.raises(M.MemoryPlanError) as e:
        M.plan_memory(cfg, wi, s, ds, free={"cuda:0": (22 * GiB, 24 * GiB)})
    msg = str(e.value)
    assert "use a file in the types the GPU kernels read" in msg and "a smaller quantization" not in msg
    assert "Note: target: the Q3_K matrices" in msg


def test_shrink_without_explicit_ctx(q27):
    cfg, w, ds = q27
    s = M.PlanSettings(max_ctx=262144, cache_type_k="f16", cache_type_v="f16", device=GPU)
    plan = M.plan_memory(cfg, w, s, ds, free={"cuda:0": (40 * GiB, 80 * GiB)}, shrink_ctx=True)
    assert plan.fits and plan.shrunk_from == 262144 and plan.settings.max_ctx % 256 == 0
    assert 100_000 < plan.settings.max_ctx < 262144


def test_devices_and_free_memory(tmp_path, monkeypatch):
    assert str(M.parse_device("CUDA")) == "cuda:0" and str(M.parse_device("cuda:3")) == "cuda:3"
    assert M.parse_device("cpu") == M.Device("cpu")
    for bad in ("gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ValueError, match="expected a device"):
            M.parse_device(bad)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert M.cpu_memory(str(meminfo)) == (20_000_000 * 1024, 24_000_000 * 1024)
    from kernels import loader

    monkeypatch.setattr(loader, "unavailable_reason", lambda: "no CUDA GPU is visible (test)")
    with pytest.raises(M.MemoryPlanError, match=r"GPU backend not available: no CUDA GPU is visible \(test\)"):
        M.check_device(M.Device("cuda", 0))
    M.check_device(M.Device("cpu"))


def test_plan_only_json(tiny, capsys):
    rc = main(["verifier", "--model", tiny.target_path, "--draft", tiny.drafter_path, "--cache-type-k", "f16",
               "--cache-type-v", "tq3_0", "--max-ctx", "1024", "--slots", "2", "--plan-only", "--json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["max_ctx"] == 1024 and plan["width"] == 65 and plan["slots"] == 2   # auto: its largest tree
    items = {i["name"]: i["bytes"] for i in plan["devices"][0]["items"]}
    # tiny: 1 attention layer x 1 KV head x 128 values; K f16 2 B, V tq3_0 14/32 B; 2 slots
    assert items["KV cache"] == 2 * 1024 * 128 * (2 + 14 / 32)
    assert items["recurrent checkpoints"] == 2 * 3 * 65 * 4 * 64 * 64 * 4
    assert plan["devices"][0]["device"] == "cpu" and plan["fits"] is True
    assert plan["total_bytes"] == sum(items.values())

    assert main(["generate", "--model", tiny.target_path, "--plan-only", "--chain"]) == 0
    text = capsys.readouterr().out
    assert "memory plan (max_ctx 4096, budget chain (no drafter)" in text and "KV cache" in text


def test_gpu_device_refused_clearly(tiny, capsys, monkeypatch):
    from kernels import loader

    monkeypatch.setattr(loader, "unavailable_reason", lambda: "CuPy is not importable (test)")
    for cmd in (["generate", "--model", tiny.target_path, "--prompt", "x"],
                ["verifier", "--model", tiny.target_path],
                ["serve", "--model", tiny.target_path, "--port", "0"]):
        assert main([*cmd, "--device", "cuda:0"]) == 2
        assert "GPU backend not available: CuPy is not importable (test)" in capsys.readouterr().err
    assert main(["verifier", "--model", tiny.target_path, "--device", "cuda:1", "--draft-device", "cuda:1",
                 "--plan-only"]) == 2
    assert "GPU backend not available" in capsys.readouterr().err
    # a GPU drafter beside a CPU target is refused before anything loads, naming both flags
    assert main(["verifier", "--model", tiny.target_path, "--draft-device", "cuda:1", "--plan-only"]) == 2
    err = capsys.readouterr().err
    assert "--draft-device cuda:1" in err and "--device cpu" in err


def test_refusal_through_the_cli(tiny, capsys, monkeypatch):
    monkeypatch.setattr(M, "cpu_memory", lambda *a: (300 * (1 << 20), 1 << 30))
    rc = main(["verifier", "--model", tiny.target_path, "--max-ctx", "4096", "--plan-only"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and "needs" in err and "--max-ctx" not in err
    assert "even at max_ctx 1 it needs cpu" in err and "reserve 0.50 GiB" in err


def test_drafter_service_items_by_hand(q27):
    """`specsplit drafter --device cuda:N`: the drafter's weights, the target's table and head copied to its GPU,
    its sessions at the serving context, graphs, arena and split scratch, the device reserve."""
    cfg, w, ds = q27
    items = {i.name: i.bytes for i in M.drafter_service_items(cfg, w, ds, 4, 8192, 132)}
    ses = M.gpu_session_bytes(ds, 8192 + ds.block_size)
    assert items["drafter context cache"] == 4 * ses["drafter context cache"]
    assert items["drafter session buffers"] == 4 * ses["drafter session buffers"]
    assert items["target embedding + head copy"] == 248320 * 5120 // 256 * (144 + 210)
    assert items["graph arena"] == M.graph_arena_bytes(cfg, 1, "f16", "f16", ds, 132)
    assert items["workspace reserve"] == M.RESERVE_BYTES["cuda"]
    assert set(items) >= {"drafter weights", "drafter CUDA graphs"}


def test_drafter_service_plan_fits_shrinks_or_names_the_fix(tiny, monkeypatch):
    monkeypatch.setattr(M, "check_device", lambda device: None)   # no GPU here: the plan reads headers only
    dev = M.Device("cuda", 1)

    def plan(free, sessions=4, max_ctx=None):
        return M.plan_drafter_service(tiny.target_path, tiny.drafter_path, dev, sessions, max_ctx,
                                      free=(free, 80 * GiB), sms=132)

    p, shape = plan(80 * GiB)
    ctx = p.settings.max_ctx
    assert p.fits and p.shrunk_from is None and p.devices[0].device == "cuda:1" and p.settings.slots == 4
    need = p.devices[0].total
    assert ctx >= 2 * M.CTX_STEP
    # without --max-ctx: shrunk to a multiple of 256 that fits (the tiny model's 4096 is the usual floor itself)
    monkeypatch.setattr(M, "MIN_AUTO_CTX", 1024)
    p2, _ = plan(need - 1)
    assert p2.fits and p2.shrunk_from == ctx and p2.settings.max_ctx % M.CTX_STEP == 0 and p2.settings.max_ctx < ctx
    # an explicit --max-ctx that does not fit: refused, naming a context and a session count that do
    with pytest.raises(M.MemoryPlanError) as e:
        plan(need - 1, max_ctx=ctx)
    msg = str(e.value)
    assert "the drafter does not fit" in msg and "--max-sessions 3" in msg
    # nothing fits: the weights and the reserve alone are more than the device has
    with pytest.raises(M.MemoryPlanError, match="run the drafter on the CPU"):
        plan(M.RESERVE_BYTES["cuda"] // 2)
