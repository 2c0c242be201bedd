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


# What one SM holds (sm_80 / sm_90): registers, warps, blocks; registers are allocated per warp in units of 256
# within each of the SM's 4 sub-partitions, so a warp's registers must fit what one sub-partition has left
REGS_PER_SM, SUB_PARTITIONS, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 4, 64, 32


def resident_warps(regs: int) -> int:
    """Warps of `regs` registers per thread one SM holds at once, counted as the CUDA occupancy calculator does
    (cuda_occupancy.h): per sub-partition, so 136 registers give 12 warps, not 65536 // 4352 = 15."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(WARPS_PER_SM, (REGS_PER_SM // SUB_PARTITIONS) // per_warp * SUB_PARTITIONS)


def resident_blocks(warps: int, regs: int, smem: int, smem_per_sm: int) -> int:
    """Blocks of `warps` warps of `regs` registers and `smem` bytes of dynamic shared memory one SM holds at once
    (each block also reserves 1 KiB); at least 1."""
    return max(1, min(BLOCKS_PER_SM, resident_warps(regs) // max(warps, 1), smem_per_sm // (smem + 1024)))


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


# Defines whose code needs the device's arch-specific target (sm_90a: wgmma), which CuPy's own compile never asks for
# (it appends -arch=sm_<cc>); such modules are compiled here through NVRTC and loaded from the cubin.
ARCH_SPECIFIC_DEFINES = frozenset({"SPECSPLIT_QMW_WG"})


_arch_specific: dict[int, bool] = {}


def arch_specific_available() -> bool:
    """Whether this device has an arch-specific target (sm_90a: an sm_90 device, CUDA, not HIP) and this CuPy the NVRTC
    program class and version query the compile goes through (per device, asked once)."""
    cupy = require()
    device = int(cupy.cuda.runtime.getDevice())
    if device not in _arch_specific:
        from cupy.cuda import compiler

        _arch_specific[device] = (not getattr(cupy.cuda.runtime, "is_hip", False) and compute_capability() == 90
                                  and hasattr(compiler, "_NVRTCProgram") and hasattr(compiler, "_get_nvrtc_version"))
    return _arch_specific[device]


def arch_cache_dir() -> Path:
    """Where arch-specific cubins are kept between processes (CuPy's own cache does not see them):
    SPECSPLIT_KERNEL_CACHE, else ~/.cache/specsplit/kernels."""
    return Path(os.environ.get("SPECSPLIT_KERNEL_CACHE") or Path.home() / ".cache" / "specsplit" / "kernels")


# The arch-specific cache's bound: every source version adds its own entries (a cubin and its names a module), so
# without one it would grow with each upgrade. SPECSPLIT_KERNEL_CACHE_MB overrides; 0 keeps everything.
ARCH_CACHE_MB = 256
STALE_TMP_S = 3600  # a writer's temporary file older than this was left by a process that died mid-write


def arch_cache_limit() -> int:
    """The arch-specific cache's size bound in bytes (0: none): SPECSPLIT_KERNEL_CACHE_MB, else ARCH_CACHE_MB; a value
    that is not a whole number of MiB >= 0 is an error naming the variable."""
    raw = os.environ.get("SPECSPLIT_KERNEL_CACHE_MB", "").strip()
    try:
        mb = int(raw) if raw else ARCH_CACHE_MB
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"SPECSPLIT_KERNEL_CACHE_MB must be a whole number of MiB >= 0 (0: no bound), not {raw!r}")
    return mb << 20


def prune_arch_cache(folder: Path, limit: int, keep: str = "") -> int:
    """Remove the least recently used entries of an arch-specific cache folder (a module's .cubin and .json share a
    name; a hit refreshes its time) until the rest fit in `limit` bytes, never the entry named `keep` (the one just
    written); and temporary files older than STALE_TMP_S. Another process may prune at the same time: files already
    gone are skipped. Returns the bytes removed."""
    import time

    entries: dict[str, list] = {}
    removed = 0
    try:
        files = list(folder.iterdir())
    except OSError:
        return 0
    now = time.time()
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        if f.suffix == ".tmp":
            if now - st.st_mtime > STALE_TMP_S:
                removed += _unlink(f, st.st_size)
            continue
        if f.suffix not in (".cubin", ".json"):
            continue  # (not ours)
        e = entries.setdefault(f.stem, [0.0, 0, []])
        e[0], e[1] = max(e[0], st.st_mtime), e[1] + st.st_size
        e[2].append((f, st.st_size))
    total = sum(e[1] for e in entries.values())
    if not limit or total <= limit:
        return removed
    for stem, (_, size, paths) in sorted(entries.items(), key=lambda kv: kv[1][0]):
        if total <= limit:
            break
        if stem == keep:
            continue
        for f, fsize in paths:
            removed += _unlink(f, fsize)
        total -= size
    return removed


def _unlink(f: Path, size: int) -> int:
    try:
        f.unlink()
        return size
    except OSError:
        return 0


class _ArchModule:
    """A module compiled for sm_<cc>a (NVRTC, cached on disk by a hash of the code, options, names and NVRTC
    version): RawModule-like get_function(name expression)."""

    def __init__(self, code: str, options: tuple[str, ...], names: tuple[str, ...]):
        import hashlib
        import json

        cupy = require()
        from cupy.cuda import compiler

        limit = arch_cache_limit()  # (a bad SPECSPLIT_KERNEL_CACHE_MB fails before the compile)
        opts = tuple(options) + (f"-arch=sm_{compute_capability()}a",)
        ident = json.dumps([code, opts, names, list(compiler._get_nvrtc_version())])
        digest = hashlib.sha256(ident.encode()).hexdigest()[:32]
        folder = arch_cache_dir()
        path, names_path = folder / f"{digest}.cubin", folder / f"{digest}.json"
        try:
            mapping = json.loads(names_path.read_text())
            cached = path.is_file() and all(n in mapping for n in names)
        except (OSError, ValueError):
            cached = False
        if cached:
            try:  # a hit: the entry is recently used (prune_arch_cache drops the least recently used first)
                os.utime(path)
            except OSError:
                pass
        while True:
            if not cached:
                path, mapping = self._build(code, opts, names, path, names_path)
            try:
                self._mod = cupy.RawModule(path=str(path))
                self._lowered = mapping
                for name in names:  # loaded now, while the file is surely there
                    self.get_function(name)
                break
            except Exception:
                if not cached:
                    raise
                cached = False  # pruned by another process between the check and the load: built again
        if path.parent == folder and not cached:  # a new entry: the cache stays within its bound
            prune_arch_cache(folder, limit, keep=digest)

    @staticmethod
    def _build(code: str, opts: tuple[str, ...], names: tuple[str, ...], path: Path, names_path: Path) -> tuple:
        """Compile and write the cache entry whole (each file under a temporary name, then renamed: a reader never
        sees half a file); (the cubin's path, the names' lowered forms). No writable cache: a file of this process."""
        import json

        from cupy.cuda import compiler

        prog = compiler._NVRTCProgram(code, "specsplit_arch.cu", name_expressions=list(names), method="cubin")
        cubin, mapping = prog.compile(opts)
        mapping = dict(mapping)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for dst, data in ((path, cubin), (names_path, json.dumps(mapping).encode())):
                tmp = dst.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, dst)
        except OSError:  # (RawModule loads from a path)
            import tempfile

            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(cubin)
            path = Path(f.name)
        return path, mapping

    def get_function(self, name: str) -> Any:
        return self._mod.get_function(self._lowered[name])


def get_module(source: str, name_expressions: tuple[str, ...], defines: tuple[str, ...] = ()) -> Any:
    """A compiled cupy.RawModule for kernels/<source> holding `name_expressions` (cached per device); with one of
    ARCH_SPECIFIC_DEFINES, compiled for the arch-specific target (sm_90a)."""
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
            if ARCH_SPECIFIC_DEFINES.intersection(d.split("=")[0] for d in defines):
                if not arch_specific_available():
                    raise KernelCompileError(f"{defines} need an sm_90 CUDA device (sm_90a: wgmma) and CuPy's NVRTC")
                mod = _ArchModule(code, options, tuple(name_expressions))
            else:
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


def get_function(source: str, name: str, defines: tuple[str, ...] = (), pdl: bool = False) -> Any:
    """One kernel (a cupy.RawKernel) by its name expression, e.g. 'qmm_kernel<12, 3>'; while a launch hook is set
    (set_launch_hook), the kernel wrapped so that its launches go through the hook. pdl=True (only for kernels whose
    source waits with SS_GRID_WAIT() before reading anything an earlier kernel writes): launches may use programmatic
    dependent launch (`pdl_mode`)."""
    cupy = require()
    device = int(cupy.cuda.runtime.getDevice())
    key = (source, name, tuple(defines), device)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(source, (name,), defines).get_function(name)
        _functions[key] = fn
    if pdl and pdl_mode() != "off":
        fn = _PdlKernel(fn, pdl_mode() == "always")
    hook = _launch_hook
    return fn if hook is None else _HookedKernel(fn, name, hook)


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with the attribute may start while the previous
# kernel on its stream still runs: its blocks take the SMs that the previous kernel's last wave leaves idle and do
# their prologue (the matmuls request their first weights) before `griddepcontrol.wait` holds them until that kernel
# has finished. Inside a captured CUDA graph this becomes a programmatic edge, which is where it pays (a decode step
# is ~750 kernels, many of them 5-30 us). CuPy launches have no launch attributes, so these go through the driver's
# cuLaunchKernelEx (ctypes). SPECSPLIT_PDL: "capture" (default: PDL for launches into a graph being captured, plain
# launches otherwise, where host launch cost dominates anyway), "always", or "0" / "off".
PDL_ENV = "SPECSPLIT_PDL"
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_pdl_state: dict[int, Any] = {}


def pdl_requested() -> str:
    """'off', 'capture' or 'always' as SPECSPLIT_PDL asks ("1" / "on" mean capture)."""
    want = os.environ.get(PDL_ENV, "capture").strip().lower()
    if want in ("0", "off", "false", "no"):
        return "off"
    if want not in ("capture", "always", "1", "on"):
        raise ValueError(f"{PDL_ENV} must be capture, always or off, not {want!r}")
    return "always" if want == "always" else "capture"


def pdl_mode() -> str:
    """pdl_requested(), or 'off' where the device or driver cannot do it (HIP, before sm_90)."""
    want = pdl_requested()
    return want if want == "off" or _pdl_driver() is not None else "off"


def _pdl_driver() -> Any:
    """The driver entry point cuLaunchKernelEx for the current device, or None (HIP, before sm_90, no such symbol)."""
    cupy = require()
    device = int(cupy.cuda.runtime.getDevice())
    if device not in _pdl_state:
        fn = None
        if not getattr(cupy.cuda.runtime, "is_hip", False) and compute_capability() >= 90:
            import ctypes

            try:
                lib = ctypes.CDLL("libcuda.so.1")
                fn = lib.cuLaunchKernelEx
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _pdl_state[device] = fn
    return _pdl_state[device]


def _pdl_structs() -> tuple[Any, Any]:
    import ctypes

    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                    ("value_pad", ctypes.c_char * 60)]

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]

    assert ctypes.sizeof(LaunchAttribute) == 72 and ctypes.sizeof(LaunchConfig) == 56
    return LaunchAttribute, LaunchConfig


def _ctype_arg(a: Any) -> Any:
    """One kernel argument as the ctypes value whose address cuLaunchKernelEx takes (CuPy arrays by device pointer,
    NumPy scalars by their own type, as CuPy's own launch passes them)."""
    import ctypes

    import numpy as np

    data = getattr(a, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return ctypes.c_void_p(int(data.ptr))
    if isinstance(getattr(a, "ptr", None), int):  # a cupy.cuda.MemoryPointer
        return ctypes.c_void_p(int(a.ptr))
    if isinstance(a, bool):  # Python scalars as CuPy's own launch passes them
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    if isinstance(a, np.generic):
        ct = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
              np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
              np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}.get(a.dtype)
        if ct is not None:
            return ct(a.item())
    raise TypeError(f"a PDL kernel launch takes CuPy arrays and NumPy int32/int64/uint32/uint64/float32/float64 "
                    f"scalars, not {type(a).__name__}")


def _dims(d: Any) -> tuple[int, int, int]:
    t = tuple(int(v) for v in (d if isinstance(d, tuple) else (d,)))
    return (t + (1, 1, 1))[:3]


class _PdlKernel:
    """A compiled kernel whose launches carry the programmatic-stream-serialization attribute (see PDL_ENV);
    attributes read and write through to the kernel."""

    __slots__ = ("_fn", "_always")

    def __init__(self, fn: Any, always: bool):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_always", always)

    def __call__(self, grid: Any, block: Any, args: tuple, shared_mem: int = 0, **kwargs: Any) -> Any:
        cupy = require()
        stream = cupy.cuda.get_current_stream()
        if kwargs or not (self._always or stream.is_capturing()):
            return self._fn(grid, block, args, shared_mem=shared_mem, **kwargs)
        import ctypes

        LaunchAttribute, LaunchConfig = _PDL_STRUCTS
        attr = LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        g, b = _dims(grid), _dims(block)
        cfg = LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem), ctypes.c_void_p(int(stream.ptr)),
                           ctypes.pointer(attr), 1)
        vals = [_ctype_arg(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        rc = _pdl_driver()(ctypes.byref(cfg), ctypes.c_void_p(int(self._fn.kernel.ptr)), params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed with CUresult {rc}; set "
                               f"{PDL_ENV}=0 to launch without it")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._fn, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._fn, attr, value)


_PDL_STRUCTS = _pdl_structs()


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


def functions_loaded() -> int:
    """How many kernels this process has fetched (each built by NVRTC or read from CuPy's disk cache once): a count
    that does not grow once every kernel a server launches has been fetched."""
    with _lock:
        return len(_functions)


def function_names() -> list[str]:
    """The kernels fetched so far, as 'source:name expression' strings."""
    with _lock:
        return [f"{k[0]}:{k[1]}" for k in _functions]


def clear_cache() -> None:
    with _lock:
        _modules.clear()
        _functions.clear()
        _pdl_state.clear()
