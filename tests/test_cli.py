"""`specsplit generate` / `convert` as a user runs them: separate processes, JSON output, clear errors."""

import json
import subprocess
import sys

import pytest

from services.engine.generate import generate
from services.engine.loader import load_target


def run_cli(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "services", *args], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {p.stderr}")
    return p


def test_generate_json_plain_and_speculative(tiny_pair):
    hf, gguf, drafter = tiny_pair
    plain = json.loads(run_cli("generate", "--model", gguf, "--prompt", "def add(a, b):", "--max-tokens", "12",
                               "--ignore-eos", "--json").stdout)
    assert set(plain) >= {"token_ids", "text", "timings"}
    assert len(plain["token_ids"]) == 12
    target = load_target(gguf)
    assert plain["token_ids"] == generate(target.model, plain["prompt_ids"], 12).token_ids
    assert plain["text"] == target.tokenizer.decode(plain["token_ids"])
    assert plain["timings"]["predicted_n"] == 12

    for extra in (["--budget", "7"], ["--chain"]):
        spec = json.loads(run_cli("generate", "--model", gguf, "--prompt", "def add(a, b):", "--max-tokens", "12",
                                  "--ignore-eos", "--json", "--draft", drafter, *extra).stdout)
        assert spec["token_ids"] == plain["token_ids"]
        assert set(spec["spec"]) >= {"steps", "accepted", "mean_acceptance_length", "per_position"}
        assert spec["spec"]["steps"] >= 1


def test_generate_prompt_ids_and_hf_folder(tiny_pair):
    hf, gguf, _ = tiny_pair
    a = json.loads(run_cli("generate", "--model", hf, "--prompt-ids", "5,6,7", "--max-tokens", "6",
                           "--ignore-eos", "--json").stdout)
    b = json.loads(run_cli("generate", "--model", gguf, "--prompt-ids", "5,6,7", "--max-tokens", "6",
                           "--ignore-eos", "--json").stdout)
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize("content,expect", [
    (b"", "expected"),
    (b"GGUF\x03\x00\x00\x00", "expected"),
    (b"not a model at all, just text", "GGUF"),
])
def test_bad_model_file_is_one_clear_error(tmp_path, content, expect):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    p = run_cli("generate", "--model", str(bad), "--prompt-ids", "1", "--json", check=False)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert str(bad) in p.stderr and expect in p.stderr


def test_bad_arguments(tiny_pair):
    _, gguf, drafter = tiny_pair
    p = run_cli("generate", "--model", gguf, "--prompt-ids", "1", "--temperature", "-1", check=False)
    assert p.returncode == 2 and "temperature" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("generate", "--model", gguf, "--prompt-ids", "1", "--draft", drafter, "--budget", "65",
                check=False)
    assert p.returncode == 2 and "budget" in p.stderr
    p = run_cli("generate", "--model", gguf, "--prompt-ids", "99999", check=False)
    assert p.returncode == 2 and "vocabulary" in p.stderr


def test_convert_cli(tiny_pair, tmp_path):
    hf, _, _ = tiny_pair
    out = tmp_path / "q8.gguf"
    info = json.loads(run_cli("convert", hf, str(out), "--outtype", "q8_0").stdout)
    assert info["arch"] == "qwen35" and out.exists()
    g = json.loads(run_cli("generate", "--model", str(out), "--prompt", "for i in", "--max-tokens", "4",
                           "--json").stdout)
    assert len(g["token_ids"]) >= 1
