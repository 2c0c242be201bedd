"""A NumPy stand-in for the CuPy calls the GPU engine's buffers and host copies go through (nothing launches): CPU
tests of the GPU model's bookkeeping (tests/test_gpu_memory.py, tests/test_prompt_graphs.py)."""

from __future__ import annotations

import types

import numpy as np


def fake_cupy() -> types.SimpleNamespace:
    def asnumpy(a, out=None, blocking=True):
        if out is None:
            return np.array(a)
        out[...] = a
        return out

    cuda = types.SimpleNamespace(alloc_pinned_memory=lambda n: bytearray(n),
                                 Device=lambda *a: types.SimpleNamespace(id=0),
                                 get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None))
    return types.SimpleNamespace(zeros=np.zeros, empty=np.empty, full=np.full, asarray=np.asarray, arange=np.arange,
                                 asnumpy=asnumpy, clip=np.clip, float32=np.float32, float16=np.float16, int32=np.int32,
                                 int64=np.int64, uint8=np.uint8, uint32=np.uint32, uint64=np.uint64, cuda=cuda)
