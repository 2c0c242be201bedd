"""Host-side pieces of the GPU speculative loop (models/qwen35_gpu.py): the per-step tree shape (positions and the
attention's ancestor mask) computed without att.tree_mask's per-node loop, and the Q4_K token rows decoded on the
device (equal to the host dequantization bit for bit). The shape tests run anywhere; the device test skips without
CuPy and a CUDA GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import attention as att
from kernels import loader
from services.engine.models import qwen35_gpu as QG

_REASON = loader.unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU loop tests skipped: {_REASON}")


def _random_tree(rng: np.random.Generator, T: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, T)], dtype=np.int64)


@pytest.mark.parametrize("T", [1, 2, 23, 64, 65])
def test_tree_shape_matches_tree_mask_and_depths(T):
    rng = np.random.default_rng(T)
    for par in (np.arange(-1, T - 1), _random_tree(rng, T), _random_tree(rng, T)):
        chain = bool(np.array_equal(par, np.arange(-1, T - 1)))
        depth, mask = QG._tree_shape(par, chain, T)
        want = np.zeros(T, np.int64)
        for i, p in enumerate(par):
            want[i] = 0 if p < 0 else want[p] + 1
        assert np.array_equal(depth, want)
        if T <= att.MAX_TOKENS:
            assert mask.dtype == np.uint64 and np.array_equal(mask, att.tree_mask(par))
        else:
            assert mask is None


@needs_gpu
@pytest.mark.parametrize("qtype", [0, 1, 8, 12], ids=["F32", "F16", "Q8_0", "Q4_K"])
def test_table_rows_decoded_on_the_device_equal_the_host_rows(qtype: int):
    """quant_matmul.embed_rows (the step's token rows, one launch) bit for bit the NumPy engine's rows, with the
    device's own fp16 conversion and float32 rounding (the CPU simulation runs the portable path)."""
    import cupy

    from kernels import quant_matmul as qm
    from services.engine.quants import dequantize
    from tests.quant_twins import random_table

    rng = np.random.default_rng(5 + qtype)
    rows, cols = 300, 512
    table = random_table(qtype, rows, cols, rng)
    ids = rng.integers(0, rows, size=23)
    got = cupy.asnumpy(qm.embed_rows(cupy.asarray(table), qtype, cols, cupy.asarray(ids.astype(np.int32))))
    want = (table.view(np.float32)[ids] if qtype == 0
            else dequantize(table[ids], qtype, (len(ids), cols)).astype(np.float32))
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_gpu
def test_embed_rows_refusals():
    import cupy

    from kernels import quant_matmul as qm

    table = cupy.zeros((4, 144), cupy.uint8)
    ids = cupy.zeros(2, cupy.int32)
    with pytest.raises(ValueError, match="decodes"):
        qm.embed_rows(cupy.zeros((4, 210), cupy.uint8), qm.Q6_K, 256, ids)
    with pytest.raises(ValueError, match="is 288 bytes, not 144"):
        qm.embed_rows(table, qm.Q4_K, 512, ids)
    with pytest.raises(ValueError, match="int32"):
        qm.embed_rows(table, qm.Q4_K, 256, ids.astype(cupy.int64))
    out = qm.embed_rows(table, qm.Q4_K, 256, cupy.asarray(np.array([-1, 4], np.int32)))  # outside: zeros
    assert not cupy.asnumpy(out).any()


def test_commit_values_go_up_only_when_they_change(monkeypatch):
    """A commit's values (accepted node, swap, rows moved) are uploaded unless the device holds the same already and
    no rows move: consecutive one-token commits send once. (CPU: NumPy stands in for device memory.)"""
    from types import SimpleNamespace

    fake = SimpleNamespace(zeros=lambda n, dt: np.zeros(n, dt), uint8=np.uint8,
                           cuda=SimpleNamespace(alloc_pinned_memory=bytearray))
    sent = []
    monkeypatch.setattr(QG, "_upload", lambda cp, dst, src: sent.append(src.copy()) or dst.__setitem__(..., src))
    cs = QG._CommitValues(fake, 8)
    for accepted, swap, moved, n_sent in [(3, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 2), (0, 0, 0, 2), (0, 1, 0, 3),
                                          (2, 1, 2, 4), (2, 1, 2, 5), (2, 1, 0, 6), (2, 1, 0, 6)]:
        cs.stage(accepted, swap, moved)
        if moved:
            cs.h_dst[:moved], cs.h_src[:moved] = [10, 11], [12, 13]
        cs.upload()
        assert len(sent) == n_sent
        assert (int(cs.accepted[0]), int(cs.swap[0]), int(cs.moved[0])) == (accepted, swap, moved)
        if moved:
            assert cs.dst[:moved].tolist() == [10, 11] and cs.src[:moved].tolist() == [12, 13]


def test_plain_decoding_runs_ahead_only_when_greedy_and_closes_early():
    """generate's plain loop and the speculative loop without a drafter hand greedy, unpenalized decoding to a target
    that can decode ahead (the GPU model's decode_ahead), with the tokens left to make, and close it when a stop id
    ends the request (decode_ahead then lets the step it enqueued after that token end); other sampling decodes one
    step at a time."""
    from services.engine.generate import generate
    from services.engine.sampling import SamplingParams
    from services.engine.speculative import speculative_generate
    from tests.dflash_models import make_tiny_target

    target = make_tiny_target()
    script = [5, 9, 2, 7, 7, 1, 4, 8, 3, 6, 0, 2]
    log = []

    def decode_ahead(state, token, limit):
        log.append(("start", token, limit))
        try:
            yield from script[:limit]
        finally:
            log.append(("closed",))

    target.can_decode_ahead = lambda state: True
    target.decode_ahead = decode_ahead
    prompt = [1, 2, 3]
    first = generate(target, prompt, 1).token_ids[0]
    res = generate(target, prompt, 6)
    assert res.token_ids == [first] + script[:5] and res.finish_reason == "length"
    assert log == [("start", first, 5), ("closed",)]
    log.clear()
    res = generate(target, prompt, 10, stop_ids=[7])
    assert res.token_ids == [first] + script[:4] and res.finish_reason == "stop"
    assert log == [("start", first, 9), ("closed",)]
    log.clear()
    res = speculative_generate(target, None, prompt, 10, stop_ids=[7])
    assert res.token_ids == [first] + script[:4] and log == [("start", first, 9), ("closed",)]
    log.clear()
    sampled = generate(target, prompt, 6, SamplingParams(temperature=0.8, seed=1))
    penalized = generate(target, prompt, 6, SamplingParams(repetition_penalty=1.3))
    assert log == [] and len(sampled.token_ids) == len(penalized.token_ids) == 6
