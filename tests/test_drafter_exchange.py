"""The host side of a drafter service's step, without a GPU: feature rows through a registered (page-locked)
shared-memory segment (the client's device rows written into its segment by the device, DeviceRows.copy_into; the
service handing a GPU drafter rows in place, HostRows) with stand-in registrations (the bookkeeping, the fallbacks,
the order of unregistering and unmapping; on a GPU with CUDA's own in tests/test_gpu_pinned.py), and the cache of
host token rows a GPU drafter service embeds its block's first token from."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

from kernels.loader import unavailable_reason
from services.drafter import client as C
from services.drafter.service import FeatureReader
from services.engine.pinned import HostRows, PinnedHost, buffer_address, pin_host
from services.wire import pb


class FakeCupy:
    """Records hostUnregister calls (and the device each was made under) in place of cupy.cuda."""

    def __init__(self, log: list):
        outer = self

        class Runtime:
            @staticmethod
            def hostUnregister(address):
                log.append(("unregister", address, outer.device))

        class Device:
            def __init__(self, i=None):
                self.i = i

            def __enter__(self):
                outer.device = self.i

            def __exit__(self, *exc):
                outer.device = None

        class Cuda:
            runtime = Runtime
        Cuda.Device = Device
        self.cuda = Cuda
        self.device = None


def fake_pin(log: list, refuse: bool = False):
    def pin(buf, read_only=False, device=None):
        if refuse:
            log.append(("refused",))
            return None
        addr = buffer_address(buf)
        log.append(("register", addr, len(buf) if not isinstance(buf, memoryview) else buf.nbytes, read_only))
        return PinnedHost(addr, log[-1][2], FakeCupy(log), 0 if device is None else device)
    return pin


def test_pin_host_without_a_gpu_is_none_else_a_registration():
    """pin_host is best effort: no GPU or CuPy -> None (the callers copy as before); with one, a registration that
    releases once."""
    buf = bytearray(1 << 16)
    got = pin_host(buf)
    if unavailable_reason() is not None:
        assert got is None
    else:
        assert isinstance(got, PinnedHost) and got.address == buffer_address(buf) and got.nbytes == len(buf)
        got.release()
        got.release()
        assert got.released
    assert pin_host(bytearray()) is None


def test_host_rows_copy_out_and_refuse_past_the_segment():
    log: list = []
    seg = shared_memory.SharedMemory(create=True, size=4096)
    try:
        a = np.arange(24, dtype=np.float32).reshape(3, 8)
        np.ndarray(a.shape, a.dtype, buffer=seg.buf, offset=64)[...] = a
        pin = fake_pin(log)(seg.buf)
        rows = HostRows(pin, 64, 3, 8, np.float32)
        assert len(rows) == 3 and rows.shape == (3, 8) and rows.nbytes == a.nbytes
        np.testing.assert_array_equal(np.asarray(rows), a)
        assert np.asarray(rows, dtype=np.float64).dtype == np.float64
        with pytest.raises(ValueError, match="outside"):
            HostRows(pin, 4096 - 64, 3, 8, np.float32)
        pin.release()
        assert log[-1][0] == "unregister"
        with pytest.raises(RuntimeError, match="unmapped"):
            np.asarray(rows)
        del rows
    finally:
        seg.close()
        seg.unlink()


def _segment(a: np.ndarray) -> shared_memory.SharedMemory:
    seg = shared_memory.SharedMemory(name=f"specsplit-test{np.random.randint(1 << 30)}", create=True,
                                     size=max(a.nbytes, 4096))
    np.ndarray(a.shape, a.dtype, buffer=seg.buf)[...] = a
    return seg


def test_a_gpu_drafter_registers_a_mapping_read_only_on_its_device(monkeypatch):
    from types import SimpleNamespace

    from services.engine.models import dflash_gpu as DG

    calls = []
    monkeypatch.setattr(DG, "pin_host", lambda buf, read_only=False, device=None: calls.append((read_only, device)))
    DG.DFlashGpuDrafter.pin_host_rows(SimpleNamespace(be=SimpleNamespace(device=3)), bytearray(16))
    assert calls == [(True, 3)]


def test_feature_reader_hands_a_pinned_segments_rows_in_place():
    """With a drafter's pin function the reader registers each segment it maps (read-only), hands its rows over as
    HostRows (no copy), and unregisters a segment before it unmaps it (on a switch and on close); a refusal, or no
    pin function, gives the copies as before."""
    log: list = []
    a = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float16)
    b = a[:3].astype(np.float32)
    s1, s2 = _segment(a), _segment(b)
    try:
        reader = FeatureReader(8, keep_f16=True, pin=fake_pin(log))
        got = reader.read(pb.Features(rows=5, width=8, dtype="f16", shm_name=s1.name))
        assert isinstance(got, HostRows) and got.dtype == np.float16 and got.shape == (5, 8)
        np.testing.assert_array_equal(np.asarray(got), a)
        assert [e[0] for e in log] == ["register"]
        again = reader.read(pb.Features(rows=2, width=8, dtype="f16", shm_name=s1.name, shm_offset=16))
        np.testing.assert_array_equal(np.asarray(again), a[1:3])
        assert len(log) == 1                                                    # the mapping stays registered
        got = reader.read(pb.Features(rows=3, width=8, dtype="f32", shm_name=s2.name))
        np.testing.assert_array_equal(np.asarray(got), b)
        assert [e[0] for e in log] == ["register", "unregister", "register"] and log[1][1] == log[0][1]
        reader.close()
        assert [e[0] for e in log][-1] == "unregister" and log[-1][1] == log[2][1]
        # a refused registration: copies, as without a pin function
        log.clear()
        reader = FeatureReader(8, keep_f16=True, pin=fake_pin(log, refuse=True))
        got = reader.read(pb.Features(rows=5, width=8, dtype="f16", shm_name=s1.name))
        assert isinstance(got, np.ndarray) and got.dtype == np.float16
        np.testing.assert_array_equal(got, a)
        reader.close()
        assert log == [("refused",)]
        # past the segment: still a bad request
        reader = FeatureReader(8, keep_f16=True, pin=fake_pin(log))
        from services.drafter.service import BadRequest

        with pytest.raises(BadRequest, match="shared memory"):
            reader.read(pb.Features(rows=1000, width=8, dtype="f32", shm_name=s1.name))
        reader.close()
    finally:
        for s in (s1, s2):
            s.close()
            s.unlink()


class FakeDeviceRows:
    """What DrafterClient knows of a GPU target's rows: shape, copy_into (the device's write) and to_host."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.shape = a.shape
        self.copies: list = []

    def __len__(self):
        return self.shape[0]

    def copy_into(self, dst: np.ndarray) -> None:
        self.copies.append(dst.dtype)
        dst[...] = np.clip(self.a.reshape(dst.shape), -C.F16_MAX, C.F16_MAX).astype(dst.dtype)

    def to_host(self, dtype=np.float32) -> np.ndarray:
        return np.clip(self.a, -C.F16_MAX, C.F16_MAX).astype(dtype)


def test_client_writes_device_rows_into_its_registered_segment(monkeypatch):
    """Device rows go straight into the stream's segment (registered on their first write, once, unregistered before
    the segment is unlinked or replaced by a bigger one); host rows and a refused registration take the host copy."""
    log: list = []
    monkeypatch.setattr(C, "pin_host", fake_pin(log))
    rows = FakeDeviceRows(np.random.default_rng(1).standard_normal((4, 2, 8)).astype(np.float32) * 1e5)
    seg = C._Segment()
    name = seg.write_device(rows, np.float16)
    assert name == seg.shm.name and seg.pinned and rows.copies == [np.float16]
    got = np.ndarray((4, 16), np.float16, buffer=seg.shm.buf).copy()
    np.testing.assert_array_equal(got, np.clip(rows.a.reshape(4, 16), -C.F16_MAX, C.F16_MAX).astype(np.float16))
    assert seg.write_device(rows, np.float32) == name and [e[0] for e in log] == ["register"]
    big = FakeDeviceRows(np.zeros((4096, 2, 8), np.float32))
    name2 = seg.write_device(big, np.float32)                   # outgrows it: a new segment, the old one released
    assert name2 != name and [e[0] for e in log] == ["register", "unregister", "register"]
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    seg.close()
    assert [e[0] for e in log][-1] == "unregister"
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name2)
    # refused once: None (the client copies through the host), and never asked again for this segment
    log.clear()
    monkeypatch.setattr(C, "pin_host", fake_pin(log, refuse=True))
    seg = C._Segment()
    assert seg.write_device(rows, np.float32) is None and seg.write_device(rows, np.float32) is None
    assert log == [("refused",)] and not seg.pinned
    seg.close()


def test_client_features_message_for_device_rows(monkeypatch):
    """DrafterClient._features: device rows through shared memory are written by the device (no to_host), with the
    rows and width of the flattened layers; inline, or when registration is refused, they come through to_host."""
    log: list = []
    monkeypatch.setattr(C, "pin_host", fake_pin(log))
    client = C.DrafterClient.__new__(C.DrafterClient)
    client._segment = C._Segment()
    client.feature_dtype = "f32"
    rows = FakeDeviceRows(np.random.default_rng(2).standard_normal((3, 2, 8)).astype(np.float32))
    seen = []
    monkeypatch.setattr(FakeDeviceRows, "to_host",
                        lambda self, dtype=np.float32: seen.append(dtype) or self.a.astype(dtype))
    try:
        f = client._features(rows)
        assert (f.rows, f.width, f.dtype, f.shm_name) == (3, 16, "f32", client._segment.shm.name) and not seen
        np.testing.assert_array_equal(np.ndarray((3, 16), np.float32, buffer=client._segment.shm.buf),
                                      rows.a.reshape(3, 16))
        monkeypatch.setattr(C, "pin_host", fake_pin(log, refuse=True))
        client._segment.close()
        client._segment = C._Segment()
        f = client._features(rows)
        assert f.shm_name == client._segment.shm.name and seen == [np.float32]
        client._segment.close()
        client._segment = None
        f = client._features(rows)
        assert f.data and not f.shm_name and len(seen) == 2
    finally:
        if client._segment is not None:
            client._segment.close()



def test_pinning_can_be_turned_off(monkeypatch):
    """SPECSPLIT_PIN_FEATURES=0: no registration is attempted (the copying path), GPU or not."""
    monkeypatch.setenv("SPECSPLIT_PIN_FEATURES", "0")
    assert pin_host(bytearray(1 << 16)) is None and pin_host(bytearray(1 << 16), read_only=True, device=0) is None


def test_host_row_cache_equals_the_tables_rows_and_stays_bounded():
    """backend.HostRowCache (a GPU model's host table, a drafter service's block row): the rows NumpyBackend.embed
    gives, each dequantized once while cached, the least recently used dropped past max_bytes."""
    import gguf

    from services.engine.backend import HostRowCache, NumpyBackend
    from services.engine.formats import RawTensor

    rng = np.random.default_rng(3)
    vals = rng.standard_normal((40, 256)).astype(np.float32)
    data = gguf.quantize(vals, gguf.GGMLQuantizationType.Q8_0)
    table = RawTensor("token_embd.weight", int(gguf.GGMLQuantizationType.Q8_0), (40, 256), data.reshape(-1), "t")
    calls = []
    embed = NumpyBackend.embed

    def counting(self, t, ids):
        calls.append(list(np.asarray(ids)))
        return embed(self, t, ids)

    cache = HostRowCache(table, 256, max_bytes=3 * 4 * 256)     # three rows
    NumpyBackend.embed = counting
    try:
        ids = [5, 7, 5, 9]
        got = cache.lookup(ids)
        np.testing.assert_array_equal(got, embed(NumpyBackend(), table, np.array(ids)))
        assert calls == [[5, 7, 5, 9]] and cache.stats == {"hits": 0, "misses": 4}
        out = np.zeros((2, 256), np.float32)
        assert cache.lookup([9, 7], out=out) is out and calls == [[5, 7, 5, 9]]
        np.testing.assert_array_equal(out, got[[3, 1]])
        cache.lookup([11])                      # a fourth row: the least recently used (5) goes
        assert calls[-1] == [11] and 5 not in cache._rows and len(cache._rows) == 3
        cache.lookup([5])
        assert calls[-1] == [5] and cache.stats["hits"] == 2
    finally:
        NumpyBackend.embed = embed
