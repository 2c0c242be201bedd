"""bench/logprobs_cost.py runs on the CPU engine too (the embedded pair) and reports every ratio it promises."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_logprobs_cost_reports_its_ratios(tmp_path):
    spec = importlib.util.spec_from_file_location("logprobs_cost", ROOT / "bench" / "logprobs_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "lp.json"
    assert mod.main(["--device", "cpu", "--tokens", "4", "--prompt", "24", "--reps", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["n_vocab"] > 0
    assert set(rep["ratios"]) == {"plain", "speculative", "prompt_scored"}
    assert all(v > 0 for v in rep["seconds"].values())
