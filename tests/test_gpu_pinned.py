"""Feature rows through page-locked shared memory on a GPU (services/engine/pinned.py): the client's device rows
written into its registered segment by the device, a drafter service's read-only mapping registered and uploaded
from in place, and a GPU drafter fed such rows drafting what it drafts from host arrays. Skips without a GPU."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

from kernels import loader

_REASON = loader.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"no GPU backend: {_REASON}")]


def _device_rows(a: np.ndarray):
    import cupy as cp

    from services.engine.models.qwen35_gpu import DeviceRows

    return DeviceRows(cp.asarray(a))


def test_device_rows_into_a_registered_segment_equal_to_host():
    """DeviceRows.copy_into a registered segment gives to_host's values, f32 exactly and f16 saturated, and the
    segment is unregistered before it is unlinked."""
    from services.drafter.client import _Segment

    a = np.random.default_rng(0).standard_normal((7, 3, 64)).astype(np.float32)
    a[0, 0, :5] = [1e6, -1e6, 7e4, -7e4, np.nan]    # past f16: saturates at +-65504 (NaN stays NaN), as to_host does
    rows = _device_rows(a)
    seg = _Segment()
    try:
        for dt in (np.float32, np.float16):
            name = seg.write_device(rows, dt)
            assert name == seg.shm.name and seg.pinned
            got = np.ndarray((7, 192), dt, buffer=seg.shm.buf).copy()
            want = a.reshape(7, 192).copy()
            if dt == np.float16:                # saturated, then NumPy's rounding to nearest even
                want = np.clip(want, -65504, 65504).astype(dt)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(rows.to_host(dt).reshape(7, 192), want)
        assert list(got[0, :4]) == [65504, -65504, 65504, -65504] and np.isnan(got[0, 4])
    finally:
        seg.close()


def test_a_read_only_mapping_registered_and_uploaded_in_place():
    """The service's side: the client's segment mapped read-only (as FeatureReader maps it), registered read-only,
    its rows uploaded with one direct copy; unregistered before unmapping."""
    import cupy as cp

    from services.drafter.service import FeatureReader
    from services.engine.pinned import HostRows, pin_host
    from services.wire import pb

    a = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float16)
    seg = shared_memory.SharedMemory(name="specsplit-gputest-ro", create=True, size=1 << 16)
    try:
        np.ndarray(a.shape, a.dtype, buffer=seg.buf, offset=256)[...] = a
        pins = []

        def pin(buf):
            p = pin_host(buf, read_only=True, device=0)
            pins.append(p)
            return p

        reader = FeatureReader(96, keep_f16=True, pin=pin)
        got = reader.read(pb.Features(rows=5, width=96, dtype="f16", shm_name=seg.name, shm_offset=256))
        assert pins[0] is not None, "the driver refused to register a read-only mapping"
        assert isinstance(got, HostRows)
        dev = got.upload(cp)
        assert dev.dtype == cp.float16 and dev.shape == (5, 96)
        np.testing.assert_array_equal(cp.asnumpy(dev), a)
        reader.close()
        assert pins[0].released
    finally:
        seg.close()
        seg.unlink()


def _drafts(dr, toks, rows_of) -> list:
    """A prompt's append of 30 rows, then drafts appending 1, 4, 3 and 2 rows: their top-k."""
    s = dr.new_session()
    dr.append_context(s, rows_of(0, 30), 30)
    start, got = 30, []
    for n in (1, 4, 3, 2):
        start += n
        got.append(dr.draft_topk(s, rows_of(start - n, start), toks[start - 1], start, 8))
    return got


def test_a_gpu_drafter_fed_registered_rows_drafts_as_from_host_arrays():
    """Through FeatureReader with the drafter's own pin function: a prompt's append and drafts of a few rows each
    give the same top-k, bit for bit, as the same rows handed over as host arrays (f32 and f16)."""
    from services.drafter.service import FeatureReader
    from services.engine.pinned import HostRows
    from services.wire import pb
    from tests.test_gpu_drafter import _features, _pair

    _, dr = _pair()
    feats, toks = _features(40)
    flat = feats.reshape(len(feats), -1)
    dr.use_graphs = False                  # eager both ways: the same launches, so the same bits
    for dt, name in ((np.float32, "f32"), (np.float16, "f16")):
        rows = flat.astype(dt)
        seg = shared_memory.SharedMemory(name=f"specsplit-gputest-{name}", create=True, size=rows.nbytes)
        reader = FeatureReader(flat.shape[1], keep_f16=True, pin=dr.pin_host_rows)
        read = []

        def through_segment(lo, hi, rows=rows, dt=dt, name=name, seg=seg, reader=reader, read=read):
            np.ndarray((hi - lo, rows.shape[1]), dt, buffer=seg.buf)[...] = rows[lo:hi]
            got = reader.read(pb.Features(rows=hi - lo, width=rows.shape[1], dtype=name, shm_name=seg.name))
            read.append(isinstance(got, HostRows))
            return got

        try:
            want = _drafts(dr, toks, lambda lo, hi, rows=rows: rows[lo:hi])
            got = _drafts(dr, toks, through_segment)
            assert read and all(read), "the drafter's pin function did not register the mapping"
            for (i0, l0), (i1, l1) in zip(want, got):
                assert np.array_equal(i0, i1) and np.array_equal(l0, l1)
        finally:
            reader.close()
            seg.close()
            seg.unlink()
