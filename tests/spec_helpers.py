"""Test proposers: an autoregressive draft model of the target's architecture (a perturbed copy)."""

from __future__ import annotations

import numpy as np

from services.engine.ddtree import topk_logprobs
from services.engine.loader import load_target


class ModelProposer:
    """Drafts block_size - 1 tokens greedily with a small target-architecture model (classic draft model)."""

    def __init__(self, model, block_size: int = 16, fail_after: int | None = None):
        self.model = model
        self.block_size = block_size
        self.target_layer_ids: list[int] = []
        self.tokens: list[int] = []
        self.calls = 0
        self.fail_after = fail_after

    def set_prompt(self, prompt):
        self.tokens = list(prompt)

    def propose(self, new_features, last_token, start, k):
        from services.engine.speculative import DrafterUnavailableError

        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise DrafterUnavailableError("drafter went away (test)")
        # committed context is tokens[:start]; re-run it (tiny models, tests only)
        state = self.model.new_state(start + self.block_size + 2)
        hist = self.known[:start] + [last_token]
        out = self.model.forward(state, hist, logits="last")
        state.commit(range(len(hist)))
        rows = []
        logits = out.logits[-1]
        for _ in range(self.block_size - 1):
            rows.append(logits)
            t = int(np.argmax(logits))
            out = self.model.forward(state, [t], logits="last")
            state.commit([0])
            logits = out.logits[-1]
        return topk_logprobs(np.stack(rows), k)

    def close(self):
        pass


class TrackingProposer(ModelProposer):
    """Knows the committed tokens by reading the generation result as it grows (test-only plumbing)."""

    def __init__(self, model, prompt, result, **kw):
        super().__init__(model, **kw)
        self.prompt = list(prompt)
        self.result = result

    @property
    def known(self):
        return self.prompt + self.result.token_ids


def perturbed_copy(path: str, noise: float, seed: int = 0):
    """Load the target again and add relative noise to every weight (a draft model that is often right)."""
    m = load_target(path, with_tokenizer=False).model
    rng = np.random.default_rng(seed)
    for layer in m.layers:
        for k, w in layer.items():
            layer[k] = (w * (1 + noise * rng.standard_normal(w.shape))).astype(np.float32)
    return m
