"""Run a pytest-style test module on a machine without pytest (the GPU machine may not have it).

    python bench/mini_pytest.py tests/test_kernels_quant_matmul.py

Supports what the GPU tests use: pytest.skip (also module level), pytest.mark.parametrize (stacked),
pytest.mark.skipif on functions, pytest.raises(match=...), and marks as plain attributes. Prints one
"N passed, N failed, N skipped" line last and exits 1 when a test failed.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
import time
import traceback
import types
from pathlib import Path


class _Skipped(Exception):
    pass


def _skip(reason: str = "", *, allow_module_level: bool = False) -> None:
    raise _Skipped(reason)


class _Raises:
    def __init__(self, exc, match: str | None = None):
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(et, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(ev)):
            raise AssertionError(f"{et.__name__}({ev!s}) does not match {self.match!r}")
        return True


class _Mark:
    def parametrize(self, names, values, ids=None):
        def deco(fn):
            fn.__dict__.setdefault("_mini_params", []).insert(0, (names, list(values), ids))
            return fn

        return deco

    def skipif(self, condition, reason: str = ""):
        def deco(fn):
            if condition:
                fn._mini_skip = reason
            return fn

        return deco

    def __getattr__(self, name):
        def mark(*args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]
            return lambda fn: fn

        return mark


def _install_shim() -> None:
    shim = types.ModuleType("pytest")
    shim.skip = _skip
    shim.raises = _Raises
    shim.mark = _Mark()
    shim.fixture = lambda *a, **k: a[0] if a and callable(a[0]) else (lambda fn: fn)
    sys.modules["pytest"] = shim


def _cases(fn):
    params = getattr(fn, "_mini_params", [])
    if not params:
        yield "", {}
        return
    expanded = []
    for names, values, ids in params:
        keys = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for v in values:
            vals = tuple(v) if len(keys) > 1 else (v,)
            try:
                label = "-".join(str(ids(x) if callable(ids) else x) for x in vals)
            except Exception:
                label = "-".join(str(x) for x in vals)
            rows.append((label, dict(zip(keys, vals))))
        expanded.append(rows)
    for combo in itertools.product(*expanded):
        label = "-".join(c[0] for c in combo)
        kwargs = {}
        for _, kw in combo:
            kwargs.update(kw)
        yield f"[{label}]", kwargs


def main(path: str) -> int:
    _install_shim()
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    t0 = time.time()
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except _Skipped as e:
        print(f"SKIPPED (module): {e}")
        print(f"0 passed, 0 failed, 1 skipped in {time.time() - t0:.1f}s")
        return 0
    passed = failed = skipped = 0
    for name, fn in list(vars(module).items()):
        if not (name.startswith("test_") and callable(fn)):
            continue
        for label, kwargs in _cases(fn):
            test_id = f"{path}::{name}{label}"
            if getattr(fn, "_mini_skip", None) is not None:
                skipped += 1
                print(f"SKIPPED {test_id}: {fn._mini_skip}", flush=True)
                continue
            t1 = time.time()
            try:
                fn(**kwargs)
            except _Skipped as e:
                skipped += 1
                print(f"SKIPPED {test_id}: {e}", flush=True)
            except Exception:
                failed += 1
                print(f"FAILED {test_id}\n{traceback.format_exc()}", flush=True)
            else:
                passed += 1
                print(f"PASSED {test_id} ({time.time() - t1:.1f}s)", flush=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped in {time.time() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/mini_pytest.py TEST_FILE")
    sys.exit(main(sys.argv[1]))
