"""Compile the CUDA C++ sources in kernels/ at run time through CuPy (NVRTC) and cache the modules.

Nothing here imports CuPy at module import time: `available()` answers False (and
`unavailable_reason()` says why) on a machine without CuPy, without a CUDA driver or without a GPU.

Compile options: `-std=c++17` plus any `-D` defines. CuPy appends `-arch=sm_<cc>` of the current device
itself (it builds a cubin for that exact architecture; see cupy.cuda.compiler), so it is not added again
here. Sources that `#include` toolkit headers (e.g. <mma.h>) also get `-I<toolkit>/include` when a CUDA
toolkit is found (CUDA_PATH / CUDA_HOME, `nvcc` on PATH, /usr/local/cuda): the headers that pip-installed
CUDA wheels ship lack some of what those headers pull in (crt/mma.h). The kernels in this folder include
nothing, so they compile with NVRTC alone.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

SOURCE_DIR = Path(__file__).resolve().parent

_INCLUDE = re.compile(r"^\s*#\s*include\b", re.MULTILINE)
_lock = threading.Lock()
_modules: dict[tuple, Any] = {}
_functions: dict[tuple, Any] = {}


class KernelUnavailableError(RuntimeError):
    """CuPy, a CUDA driver or a GPU is missing, so GPU kernels cannot run here."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log and the options used."""


def _import_cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        raise KernelUnavailableError(
            f"CuPy is not importable ({type(e).__name__}: {e}); install the CuPy build for your CUDA "
            "version (e.g. `pip install cupy-cuda13x`) to use the GPU kernels"
        ) from e
    return cupy


def unavailable_reason() -> str | None:
    """None when the GPU kernels can run; otherwise one line saying what is missing (CuPy, driver, GPU)."""
    try:
        cupy = _import_cupy()
    except KernelUnavailableError as e:
        return str(e)
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:
        return f"no usable CUDA GPU: the CUDA runtime reports {type(e).__name__}: {e}"
    if n <= 0:
        return "no CUDA GPU is visible (getDeviceCount() == 0)"
    return None


def available() -> bool:
    """True when CuPy imports and at least one CUDA GPU is visible."""
    return unavailable_reason() is None


_cupy_ok: Any = None


def require() -> Any:
    """The cupy module, or KernelUnavailableError saying what is missing (checked once, then cached)."""
    global _cupy_ok
    if _cupy_ok is None:
        reason = unavailable_reason()
        if reason is not None:
            raise KernelUnavailableError(reason)
        _cupy_ok = _import_cupy()
    return _cupy_ok


def toolkit_include_dir() -> str | None:
    """The include folder of a full CUDA toolkit (one with crt/), or None when none is found."""
    candidates: list[Path] = []
    for var in ("CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"):
        value = os.environ.get(var)
        if value:
            candidates.append(Path(value) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        resolved = Path(nvcc).resolve()
        candidates.append(resolved.parent.parent / "include")
        # /usr/local/bin/nvcc may be a wrapper script: also try the folder it was found in
        candidates.append(Path(nvcc).parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for inc in candidates:
        if (inc / "cuda_runtime.h").is_file() and (inc / "crt").is_dir():
            return str(inc)
    return None


def compute_capability() -> int:
    """Compute capability of the current device as an int (90 for an H100)."""
    cupy = require()
    return int(cupy.cuda.Device().compute_capability)


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def read_source(name: str) -> str:
    """A kernel source with its #include "x.cuh" of files in this folder pasted in (once each): what is compiled is
    then all in the code string, so CuPy's compile cache (keyed on it) sees a change to a shared header too."""
    seen: set[str] = set()

    def paste(m: re.Match) -> str:
        inc = m.group(1)
        if inc in seen or not (SOURCE_DIR / inc).is_file():
            return "" if inc in seen else m.group(0)
        seen.add(inc)
        return _LOCAL_INCLUDE.sub(paste, (SOURCE_DIR / inc).read_text())

    return _LOCAL_INCLUDE.sub(paste, (SOURCE_DIR / name).read_text())


def has_includes(code: str) -> bool:
    """Whether a source has an #include directive (comments mentioning one do not count)."""
    return _INCLUDE.search(code) is not None


def compile_options(code: str, defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    options = ["-std=c++17"]
    options += [f"-D{d}" for d in defines]
    if has_includes(code):
        inc = toolkit_include_dir()
        if inc is not None:
            options.append(f"-I{inc}")
    return tuple(options)


def get_module(source: str, name_expressions: tuple[str, ...], defines: tuple[str, ...] = ()) -> Any:
    """A compiled cupy.RawModule for kernels/<source> holding `name_expressions` (cached per device)."""
    cupy = require()
    device = int(cupy.cuda.runtime.getDevice())
    key = (source, tuple(name_expressions), tuple(defines), device)
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        code = read_source(source)
        options = compile_options(code, tuple(defines))
        try:
            mod = cupy.RawModule(code=code, options=options, name_expressions=list(name_expressions))
            for name in name_expressions:  # compile now, so errors surface here with their context
                mod.get_function(name)
        except Exception as e:
            hint = ""
            if has_includes(code) and toolkit_include_dir() is None:
                hint = (
                    " (no CUDA toolkit include folder was found: set CUDA_PATH to a toolkit whose include/ "
                    "has crt/, or put its nvcc on PATH)"
                )
            raise KernelCompileError(
                f"compiling kernels/{source} for sm_{compute_capability()} with options {options} failed{hint}:\n{e}"
            ) from e
        _modules[key] = mod
        return mod


def get_function(source: str, name: str, defines: tuple[str, ...] = ()) -> Any:
    """One kernel (a cupy.RawKernel) by its name expression, e.g. 'qmm_kernel<12, 3>'; while a launch hook is set
    (set_launch_hook), the kernel wrapped so that its launches go through the hook."""
    cupy = require()
    device = int(cupy.cuda.runtime.getDevice())
    key = (source, name, tuple(defines), device)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(source, (name,), defines).get_function(name)
        _functions[key] = fn
    hook = _launch_hook
    return fn if hook is None else _HookedKernel(fn, name, hook)


# Profiling (bench/step_profile.py): off unless a hook is set. The kernel modules call get_function at every launch,
# so wrapping what it returns reaches every kernel launch of kernels/ without touching the call sites.
_launch_hook: Callable[[str, Callable[[], Any]], Any] | None = None


class _HookedKernel:
    """A compiled kernel whose calls run as hook(name, launch); attributes read and write through to the kernel."""

    __slots__ = ("_fn", "_name", "_hook")

    def __init__(self, fn: Any, name: str, hook: Callable[[str, Callable[[], Any]], Any]):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_hook", hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(self._name, lambda: self._fn(*args, **kwargs))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._fn, attr, value)


def set_launch_hook(hook: Callable[[str, Callable[[], Any]], Any] | None) -> Callable | None:
    """Route every kernel launch of kernels/ through hook(name expression, launch), where launch() enqueues the
    kernel and returns what it returns (a profiler records events around it); None turns it off. Returns the hook
    that was set before. Kernels fetched before the call keep their old behaviour."""
    global _launch_hook
    previous, _launch_hook = _launch_hook, hook
    return previous


def clear_cache() -> None:
    with _lock:
        _modules.clear()
        _functions.clear()
