"""kernels/loader.py's on-disk cache of arch-specific cubins (sm_90a modules, which CuPy's cache does not hold): its
size bound and pruning, on the CPU (the cache is files; no GPU needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kernels import loader


def _entry(folder: Path, stem: str, size: int, age_s: float) -> None:
    """A cache entry (cubin + names) last used age_s seconds ago."""
    t = time.time() - age_s
    for suffix, n in ((".cubin", size), (".json", 10)):
        f = folder / f"{stem}{suffix}"
        f.write_bytes(b"x" * n)
        os.utime(f, (t, t))


def test_prune_drops_least_recently_used_entries_whole(tmp_path: Path) -> None:
    for i, age in enumerate((500, 400, 300, 200, 100)):  # entry e0 is the oldest
        _entry(tmp_path, f"e{i}", 1000, age)
    (tmp_path / "notes.txt").write_text("not the cache's")
    assert loader.prune_arch_cache(tmp_path, 0) == 0  # no bound: everything stays
    removed = loader.prune_arch_cache(tmp_path, 3 * 1010, keep="e0")  # e0 just written: kept though oldest
    left = sorted(p.name for p in tmp_path.iterdir())
    assert removed == 2 * 1010
    assert left == ["e0.cubin", "e0.json", "e3.cubin", "e3.json", "e4.cubin", "e4.json", "notes.txt"]
    assert loader.prune_arch_cache(tmp_path, 3 * 1010) == 0  # within the bound now


def test_prune_refreshes_on_use_and_removes_stale_temporaries(tmp_path: Path) -> None:
    _entry(tmp_path, "old", 1000, 900)
    _entry(tmp_path, "new", 1000, 100)
    os.utime(tmp_path / "old.cubin")  # a hit (the loader touches the cubin it loads)
    stale, fresh = tmp_path / "a.cubin.123.tmp", tmp_path / "b.cubin.456.tmp"
    stale.write_bytes(b"y" * 50)
    fresh.write_bytes(b"y" * 50)
    past = time.time() - loader.STALE_TMP_S - 10
    os.utime(stale, (past, past))
    assert loader.prune_arch_cache(tmp_path, 1010) == 50 + 1010
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.cubin.456.tmp", "old.cubin", "old.json"]
    assert loader.prune_arch_cache(tmp_path / "missing", 1) == 0  # (no folder yet: nothing to do)


def test_cache_limit_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SPECSPLIT_KERNEL_CACHE_MB", raising=False)
    assert loader.arch_cache_limit() == loader.ARCH_CACHE_MB << 20 == 256 << 20
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE_MB", " 64 ")
    assert loader.arch_cache_limit() == 64 << 20
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE_MB", "0")
    assert loader.arch_cache_limit() == 0
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE_MB", bad)
        with pytest.raises(ValueError, match="SPECSPLIT_KERNEL_CACHE_MB"):
            loader.arch_cache_limit()
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE", str(Path("/tmp/elsewhere")))
    assert loader.arch_cache_dir() == Path("/tmp/elsewhere")


class _FakeCupy:
    """Just what _ArchModule touches of CuPy: an NVRTC program that counts compiles and a RawModule that loads a
    cubin from its path when a function is first asked for (as CuPy's does)."""

    def __init__(self) -> None:
        import types

        fake = self
        self.compiles = 0
        self.loads: list[str] = []

        class Program:
            def __init__(self, code, name, name_expressions, method):
                self.names = name_expressions

            def compile(self, opts):
                fake.compiles += 1
                return b"cubin of " + repr(opts).encode(), {n: f"_lowered_{n}" for n in self.names}

        class RawModule:
            def __init__(self, path: str):
                self.path = path

            def get_function(self, lowered: str):
                fake.loads.append(Path(self.path).read_bytes().decode())  # (a vanished file raises here)
                return lowered

        compiler = types.SimpleNamespace(_NVRTCProgram=Program, _get_nvrtc_version=lambda: (13, 0))
        self.cuda = types.SimpleNamespace(compiler=compiler)
        self.RawModule = RawModule
        self.module = types.ModuleType("cupy")
        self.module.cuda = types.ModuleType("cupy.cuda")
        self.module.cuda.compiler = compiler


def test_arch_module_cache_hits_rebuilds_and_bound(tmp_path: Path, monkeypatch) -> None:
    """A miss compiles and writes the entry whole, a hit loads it without compiling and refreshes its time, an entry
    pruned by another process between the check and the load is built again, a new entry prunes the folder to its
    bound (never itself), and an unwritable cache still serves the module from a file of its own."""
    import sys

    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.module.cuda)
    monkeypatch.setattr(loader, "require", lambda: fake)
    monkeypatch.setattr(loader, "compute_capability", lambda: 90)
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE_MB", "1")
    names = ("k<1>", "k<2>")

    m = loader._ArchModule("code A", ("-std=c++17",), names)
    assert fake.compiles == 1 and m.get_function("k<2>") == "_lowered_k<2>"
    cubins = sorted((tmp_path / "cache").glob("*.cubin"))
    assert len(cubins) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    os.utime(cubins[0], (1, 1))
    loader._ArchModule("code A", ("-std=c++17",), names)
    assert fake.compiles == 1 and cubins[0].stat().st_mtime > time.time() - 60  # a hit, refreshed

    real_utime = os.utime

    def vanish(path, *a, **kw):  # another process prunes the entry right after this one found it
        real_utime(path, *a, **kw)
        Path(path).unlink()

    monkeypatch.setattr(loader.os, "utime", vanish)
    loader._ArchModule("code A", ("-std=c++17",), names)
    monkeypatch.setattr(loader.os, "utime", real_utime)
    assert fake.compiles == 2 and cubins[0].is_file()

    # a bound of 1 MiB: big old entries go when a new one is written, the new one stays
    _entry(tmp_path / "cache", "old", 900 << 10, 1000)
    _entry(tmp_path / "cache", "older", 900 << 10, 2000)
    loader._ArchModule("code B", ("-std=c++17",), names)
    left = {p.stem for p in (tmp_path / "cache").iterdir()}
    assert fake.compiles == 3 and "older" not in left and len(left) == 3 and "old" in left

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPECSPLIT_KERNEL_CACHE", str(blocked / "cache"))
    loader._ArchModule("code C", ("-std=c++17",), names)
    assert fake.compiles == 4 and fake.loads[-1].startswith("cubin of")
