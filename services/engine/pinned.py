"""Host memory the GPU copies straight to and from: a drafter stream's shared-memory segment registered with CUDA
(page-locked), and the feature rows a GPU drafter uploads from such a segment.

A pageable copy goes through the driver's bounce buffer (and CuPy's asarray through a pinned staging copy of its own):
on the H200 host that was ~0.1-0.3 ms a step each way for a few feature rows, about a tenth of a draft. Registered,
the device reads or writes the segment itself. Registration is best effort: without CuPy, a GPU or the driver's
consent (a read-only mapping on a device without read-only registration), the callers keep their copying path.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_PORTABLE = 1       # cudaHostRegisterPortable: page-locked for every device's context, not only the current one
_READ_ONLY = 8      # cudaHostRegisterReadOnly: device reads only (the one way to register a PROT_READ mapping)

_warned = threading.Event()


def buffer_address(buf: Any) -> int:
    """The address of a buffer (an mmap, a SharedMemory's memoryview), read-only ones included; no export is kept,
    so the buffer can be closed later (the address is valid as long as it is mapped)."""
    view = np.frombuffer(buf, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


class PinnedHost:
    """A registered host range; release() (idempotent) unregisters it, and must come before the range is unmapped."""

    def __init__(self, address: int, nbytes: int, cupy: Any, device: int):
        self.address = address
        self.nbytes = nbytes
        self.device = device    # whose context registered it (and unregisters it: no other device's context is made)
        self._cupy = cupy
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = True
        try:
            with self._cupy.cuda.Device(self.device):
                self._cupy.cuda.runtime.hostUnregister(self.address)
        except Exception:       # the context may be gone at interpreter exit; the pages go with the mapping anyway
            log.debug("hostUnregister failed", exc_info=True)


def pin_host(buf: Any, read_only: bool = False, device: int | None = None) -> PinnedHost | None:
    """Register `buf` (a whole mapping) with CUDA in `device`'s context (None: the thread's current device), or None
    when it cannot be (no GPU, no CuPy, the driver refused, SPECSPLIT_PIN_FEATURES=0): the caller then copies as
    before. One warning per process says why the first refusal happened."""
    from kernels.loader import KernelUnavailableError, require

    if os.environ.get("SPECSPLIT_PIN_FEATURES", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        cp = require()
    except KernelUnavailableError:
        return None
    nbytes = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if nbytes == 0:
        return None
    address = buffer_address(buf)
    dev = int(cp.cuda.Device().id) if device is None else int(device)
    try:
        with cp.cuda.Device(dev):
            cp.cuda.runtime.hostRegister(address, nbytes, _PORTABLE | (_READ_ONLY if read_only else 0))
    except Exception as e:      # CUDARuntimeError (not sticky: the context stays usable)
        if not _warned.is_set():
            _warned.set()
            log.warning("cannot page-lock a %s shared-memory segment for direct copies (%s: %s); features take the "
                        "copying path", "read-only" if read_only else "writable", type(e).__name__, e)
        return None
    return PinnedHost(address, nbytes, cp, dev)


class HostRows:
    """(rows, width) feature rows in a registered mapping (`pin` keeps it registered): what a drafter service hands a
    GPU drafter, which copies them to the device in one direct transfer (upload()). np.asarray(rows) copies them to
    private host memory for anything else. Valid until the stream's next request (the client rewrites the segment
    only after this one is answered)."""

    ndim = 2

    def __init__(self, pin: PinnedHost, offset: int, rows: int, width: int, dtype: Any):
        self.pin = pin
        self.offset = offset
        self.dtype = np.dtype(dtype)
        self.shape = (int(rows), int(width))
        self.nbytes = self.shape[0] * self.shape[1] * self.dtype.itemsize
        if offset < 0 or offset + self.nbytes > pin.nbytes:
            raise ValueError(f"rows [{offset}, {offset + self.nbytes}) lie outside the {pin.nbytes}-byte segment")

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"HostRows(shape={self.shape}, dtype={self.dtype})"

    def upload(self, xp: Any) -> Any:
        """A new device array of the rows (on xp's current device), copied synchronously: the segment is free for the
        client's next write as soon as this returns."""
        if self.pin.released:
            raise RuntimeError("the shared-memory segment of these rows was unmapped")
        out = xp.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            xp.cuda.runtime.memcpy(out.data.ptr, self.pin.address + self.offset, self.nbytes,
                                   xp.cuda.runtime.memcpyHostToDevice)
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self.pin.released:
            raise RuntimeError("the shared-memory segment of these rows was unmapped")
        import ctypes

        raw = (ctypes.c_char * self.nbytes).from_address(self.pin.address + self.offset)
        a = np.frombuffer(raw, dtype=self.dtype).reshape(self.shape).copy()
        return a if dtype is None else a.astype(dtype, copy=False)
