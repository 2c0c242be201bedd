"""bench/prompt_features.py on the CPU (the tiny pair, NumPy engine): both paths run a request to its first verify
and the report holds their medians and ratio (the GPU run is a device benchmark: docs/benchmarks.md "Session 38")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_prompt_features_bench_runs_both_paths(tiny_pair, capsys):
    _, gguf, drafter_dir = tiny_pair
    spec = importlib.util.spec_from_file_location("bench_prompt_features", ROOT / "bench" / "prompt_features.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--model", str(gguf), "--draft", str(drafter_dir), "--device", "cpu", "--prompts", "40", "300",
                    "--reps", "1"])
    assert list(out) == [40, 300]
    for v in out.values():
        assert v["appends_ms"] > 0 and v["first_draft_ms"] > 0
        assert abs(v["ratio"] - v["first_draft_ms"] / v["appends_ms"]) < 0.01
    text = capsys.readouterr().out
    assert "prompt 300: to the first verify" in text and "CPU (NumPy)" in text


def test_prompt_features_bench_against_a_drafter_service(tiny_pair, tmp_path, capsys):
    """--drafter ADDR: the same request with a drafter service, its features as f32 against f16 on the wire."""
    from tests.test_drafter_service import spawn_drafter, stop

    _, gguf, _ = tiny_pair
    spec = importlib.util.spec_from_file_location("bench_prompt_features", ROOT / "bench" / "prompt_features.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    proc, addr = spawn_drafter(tiny_pair, tmp_path / "d.sock", max_sessions=1)
    try:
        out = mod.main(["--model", str(gguf), "--drafter", addr, "--device", "cpu", "--prompts", "300", "--reps", "1"])
    finally:
        stop(proc)
    v = out[300]
    assert v["f32_ms"] > 0 and v["f16_ms"] > 0 and abs(v["ratio"] - v["f16_ms"] / v["f32_ms"]) < 0.01
    text = capsys.readouterr().out
    assert "with f32 features on the wire" in text and f"drafter service {addr}, shm" in text
