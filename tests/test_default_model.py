"""The shipped default pair: checksums match the card, both files load, speculation is lossless on it."""

import re

from services.engine.default_model import HERE, default_model_paths, heldout_prompts, verify_checksums
from services.engine.generate import generate
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate


def test_checksums_match_files_and_card():
    sums = verify_checksums()
    assert sums and all(sums.values()), sums
    card = (HERE / "MODEL_CARD.md").read_text()
    for line in (HERE / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        assert re.search(rf"`{re.escape(name.lstrip('*'))}`.*`{digest[:16]}", card), name


def test_default_pair_is_lossless_and_accepts_drafts():
    tpath, dpath = default_model_paths()
    target = load_target(tpath)
    drafter = load_drafter(dpath, target.model)
    gguf_drafter = load_drafter(str(HERE / "drafter.gguf"), target.model)
    accepted = 0
    for prompt in heldout_prompts()[:3]:
        ids = target.tokenizer.encode(prompt)
        plain = generate(target.model, ids, 24).token_ids
        for d, spec in ((drafter, SpecConfig(budget=None)), (gguf_drafter, SpecConfig(budget=22))):
            res = speculative_generate(target.model, LocalProposer(d), ids, 24, spec=spec)
            assert res.token_ids == plain
            accepted += res.spec["accepted"]
    assert accepted > 0


def test_short_code_prompts_complete_to_valid_python_more_often_than_not():
    """The issue's bar, measured as the model card states it: the 40 hand-written prompts of tools/train/eval.py,
    each opening a function or class, completed with the sampling the target declares (greedy with llama.cpp's
    repetition penalty 1.1 over 64 tokens), 128 new tokens, cut where the completion returns to module level
    (else at its last complete line), then ast.parse. Measured 25 of 40 (2026-11-21); must stay above half."""
    from services.engine.sampling import resolve_sampling
    from tools.train.eval import SHORT_PROMPTS, SHORT_PROMPTS_MORE, completion_unit, valid_python

    lt = load_target(default_model_paths()[0])
    params = resolve_sampling({}, lt.sampling_defaults)
    assert params.penalized, "the embedded target declares its repetition penalty (general.sampling.*)"
    stop = sorted(lt.tokenizer.eos_ids)
    prompts = SHORT_PROMPTS + SHORT_PROMPTS_MORE
    good = 0
    for p in prompts:
        r = generate(lt.model, lt.tokenizer.encode(p), 128, params, stop_ids=stop)
        ended = r.finish_reason == "stop"
        text = lt.tokenizer.decode(r.token_ids[:-1] if ended else r.token_ids)
        good += valid_python(completion_unit(p, text, ended))
    print(f"{good} of {len(prompts)} short prompts complete to valid Python")
    assert good * 2 > len(prompts), f"{good} of {len(prompts)}"
