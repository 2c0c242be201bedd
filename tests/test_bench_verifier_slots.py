"""bench/verifier_slots.py against a real verifier process (the embedded pair on the CPU): every concurrency row is
measured and reported relative to the first, requests run their whole max_tokens, and nothing falls back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_verifier_service import VerifierProcess

ROOT = Path(__file__).resolve().parents[1]


def test_concurrent_requests_are_reported_against_one(tmp_path):
    from services.engine.default_model import default_model_paths

    target, drafter = default_model_paths()
    v = VerifierProcess(tmp_path / "v.sock", ["--model", str(target), "--draft", str(drafter), "--slots", "2",
                                              "--max-ctx", "256"])
    try:
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "verifier_slots.py"), "--verifier",
                              f"unix://{tmp_path / 'v.sock'}", "--concurrency", "1", "2", "--max-tokens", "8",
                              "--prompt-len", "8", "--rounds", "1", "--budget", "4", "--json",
                              str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    finally:
        v.stop()
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 and "1.000x of 1" in rows[0] and "fallbacks 0" in rows[1]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["slots"] == 2 and set(res["rows"]) == {"1", "2"}
    two = res["rows"]["2"]["rounds"][0]
    assert two["tokens"] == 16 and len(two["acceptance"]) == 2 and not any(two["fallback"])
