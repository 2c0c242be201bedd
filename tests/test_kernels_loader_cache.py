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
