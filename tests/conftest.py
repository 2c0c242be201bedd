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
