"""bench/spec_cpu.py's `--feature-dtype f16` (the acceptance a remote drafter has with f16 features on the wire) on
the known-good pair, and bench/drafter_transport.py's f16 appends row: both run on the CPU in a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_wire_rounded_features_keep_greedy_output(tmp_path):
    rows = {}
    for dtype in ("f32", "f16"):
        _run("bench/spec_cpu.py", "--pair", "cycle", "--n-prompts", "2", "--max-tokens", "16", "--budgets", "chain,8",
             "--feature-dtype", dtype, "--json", str(tmp_path / f"{dtype}.json"))
        rows[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["rows"]
    for dtype, rs in rows.items():
        assert [r["mode"] for r in rs] == ["chain", "8"] and all(r["identical_to_plain"] for r in rs), dtype
        assert all(r["mean_acceptance_length"] > 1.5 for r in rs), dtype


def test_wire_rounded_proposer_sees_f16_values():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import spec_cpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    got = []

    class Inner:
        block_size, target_layer_ids = 16, [1]

        def propose(self, f, last, start, k):
            got.append(f)
            return "ids", "logp"

        def append_features(self, f, start):
            got.append(f)

        def close(self):
            got.append("closed")

    p = spec_cpu.WireRounded(Inner(), np.float16)
    x = np.array([[0.1, 1.0 / 3.0, 1000.123]], np.float32)
    assert p.propose(x, 1, 2, 3) == ("ids", "logp")
    p.append_features(x, 1)
    assert p.propose(None, 1, 2, 3) == ("ids", "logp")
    p.close()
    want = x.astype(np.float16).astype(np.float32)
    assert not np.array_equal(want, x)
    for f in got[:2]:
        assert f.dtype == np.float32 and np.array_equal(f, want)
    assert got[2:] == [None, "closed"]


def test_transport_bench_times_f16_appends():
    out = _run("bench/drafter_transport.py", "--steps", "3", "--rounds", "1", "--rows", "4", "--width", "512",
               "--prompt", "300", "--prompt-rounds", "1")
    assert "inline appends as f16 on the wire" in out and "shm    appends as f16 on the wire" in out
    assert "f16 / f32" in out
