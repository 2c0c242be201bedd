"""The known-good pair (tests/data/cycle_pair): where drafts are good, the speculative loop is faster than plain
decoding on the CPU, and still token-for-token identical to it (issue 3's wall-time requirement)."""

import hashlib
import time
from pathlib import Path

import pytest

from services.engine.generate import generate
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

PAIR = Path(__file__).resolve().parent / "data" / "cycle_pair"
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def pair():
    lt = load_target(str(PAIR / "target.gguf"))
    prompts = [line.replace("\\n", "\n") for line in (PAIR / "prompts.txt").read_text().splitlines() if line]
    return lt, load_drafter(str(PAIR / "drafter"), lt.model), [lt.tokenizer.encode(p) for p in prompts]


def test_checksums():
    for line in (PAIR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        assert hashlib.sha256((PAIR / name).read_bytes()).hexdigest() == digest, name


def test_drafts_are_accepted_and_lossless(pair):
    lt, drafter, prompts = pair
    steps = accepted = 0
    for ids in prompts:
        plain = generate(lt.model, ids, MAX_TOKENS)
        spec = speculative_generate(lt.model, LocalProposer(drafter), ids, MAX_TOKENS, spec=SpecConfig(budget=None))
        assert spec.token_ids == plain.token_ids
        steps, accepted = steps + spec.spec["steps"], accepted + spec.spec["accepted"]
    assert (accepted + steps) / steps >= 8.0          # measured 10.3 (chain): most blocks fully accepted


def test_speculative_beats_plain_in_cpu_time(pair):
    """CPU time of this process (robust to other jobs on the machine): measured ~2.5x, asserted > 1.3x."""
    lt, drafter, prompts = pair

    def cpu(fn):
        t0 = time.process_time()
        n = sum(len(fn(ids).token_ids) for ids in prompts)
        return n / (time.process_time() - t0)

    generate(lt.model, prompts[0], 8)                 # warm-up
    plain = cpu(lambda ids: generate(lt.model, ids, MAX_TOKENS))
    spec = cpu(lambda ids: speculative_generate(lt.model, LocalProposer(drafter), ids, MAX_TOKENS,
                                                spec=SpecConfig(budget=22)))
    assert spec / plain > 1.3, f"speculative {spec:.0f} tok/s vs plain {plain:.0f} tok/s"
