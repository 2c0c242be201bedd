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
