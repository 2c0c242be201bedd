"""Shared fixtures: the tiny target + drafter pair on disk (built once per test session)."""

import os

import pytest

# as the CLI does: small matrices, shared cores (subprocesses inherit it)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(hf_folder, target_gguf, drafter_folder) of a tiny qwen35 target with tokenizer and a DFlash drafter."""
    from tests.tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def source(tiny_pair):
    """The gateway's tokenizer source (tokenizer, chat template, name) of the tiny pair's target."""
    from services.gateway.core import load_tokenizer_source

    return load_tokenizer_source(tiny_pair[1])


SMALL_VOCAB = 12


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """(target model, DFlash drafter) over a 12-token vocabulary: small enough to enumerate the exact joint
    distribution of a few generated tokens (the sampled-decoding tests)."""
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter
    from tests.dflash_models import make_zlab_drafter
    from tests.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("small_vocab_pair")
    make_hf_model("qwen35", d / "t", seed=4, vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    target = load_target(str(d / "t"), with_tokenizer=False).model
    make_zlab_drafter(d / "d", target.cfg, n_layer=1, block_size=4, target_layer_ids=[0, 1], seed=5,
                      mask_token_id=SMALL_VOCAB - 1)
    return target, load_drafter(str(d / "d"), target)
