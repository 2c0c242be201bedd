"""What every target model shares: the forward driver over a token tree, capture of layer outputs, logits.

An architecture file supplies its blocks (`_block`) and how to read its weights; the driver handles
positions, the ancestor mask, pending state and which rows get logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import faults
from ..backend import NumpyBackend, default_backend
from ..config import ModelConfig
from ..errors import ModelFormatError
from ..formats import RawTensor
from ..kvcache import resolve_cache_types
from ..layers import ancestor_matrix, rms_norm
from ..state import PendingStep, SequenceState


@dataclass
class ForwardResult:
    # (rows, n_vocab) float32 for the requested rows: an ndarray on the NumPy engine; the GPU model returns an
    # object that keeps them on the device (qwen35_gpu.DeviceLogits: x[i] and np.asarray(x) copy to the host,
    # argmax_rows() gives each row's argmax); sampling.sample_row / greedy_tokens read either
    logits: Any
    logit_rows: np.ndarray             # which of the T tokens the logits rows belong to
    captured: np.ndarray | None        # (T, len(capture), n_embd): outputs of the captured layers


class RowLogits:
    """Logits of a forward's T rows, each row computed when first read (`logits="rows"`): a verify's tree walk
    reads only the rows along the path it takes (about the acceptance length of a tree's 16-24 rows), and one
    row is a matrix-vector product with the LM head where all rows are a GEMM that repacks its 6 MB (the
    embedded model) whatever the row count. Reads like the (T, n_vocab) float32 array of logits="all": `x[i]`
    gives row i (the norm and product of that row alone, as a plain decode step computes its one row);
    np.asarray(x) and any other index compute every row in one product, as logits="all" does."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, model: TargetModel, x: np.ndarray):
        self._model, self._x = model, x
        self._rows: dict[int, np.ndarray] = {}
        self._all: np.ndarray | None = None
        self.shape = (int(x.shape[0]), int(model.output.shape[0]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, (int, np.integer)) and self._all is None:
            i = int(key) + (self.shape[0] if key < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {key} of {self.shape[0]}")
            row = self._rows.get(i)
            if row is None:
                m = self._model
                h = rms_norm(self._x[i:i + 1], m.output_norm, m.cfg.rms_eps)
                row = self._rows[i] = m.be.linear(h, m.output)[0]
            return row
        return np.asarray(self)[key]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self._all is None:
            m = self._model
            self._all = m.be.linear(rms_norm(self._x, m.output_norm, m.cfg.rms_eps), m.output)
        return self._all if dtype is None else self._all.astype(dtype, copy=False)


@dataclass
class StepContext:
    """Per-forward values every block needs."""

    state: SequenceState
    pending: PendingStep
    positions: np.ndarray
    parents: np.ndarray
    visible: np.ndarray                # (T, n_past + T) attention visibility
    is_chain: bool
    checkpoints: bool


def check_step(tokens: Sequence[int], parents: Sequence[int] | None,
               n_vocab: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """A forward's token ids and parent list, checked: (tokens, parents, whether they form a plain chain)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    if T == 0:
        raise ValueError("forward() needs at least one token")
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ValueError(f"token id out of range [0, {n_vocab})")
    chain = np.arange(-1, T - 1)
    par = chain if parents is None else np.asarray(parents, dtype=np.int64)
    if len(par) != T or np.any(par >= np.arange(T)) or np.any(par < -1):
        raise ValueError("parents must be topologically ordered: -1 <= parents[i] < i")
    return tokens, par, bool(np.array_equal(par, chain))


class TargetModel(ABC):
    arch = ""

    def __init__(self, cfg: ModelConfig, tensors: Mapping[str, RawTensor | np.ndarray],
                 backend: NumpyBackend | None = None, source: str = "<model>"):
        self.cfg = cfg
        self.be = backend or default_backend()
        self.source = source
        self._tensors = tensors
        self.tok_embd = self.be.embedding(self._need("token_embd.weight"))
        self.output_norm = self.be.weight(self._need("output_norm.weight"))
        out = tensors.get("output.weight")
        self.output = self.be.weight(out if out is not None else self._need("token_embd.weight"))
        self.layers = [self._load_layer(i) for i in range(cfg.n_layer)]
        self._tensors = None  # the backend holds what it needs now

    # -- weights ------------------------------------------------------------------------------
    def _need(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelFormatError(self.source, f"tensor '{name}' ({self.arch})",
                                   f"it missing ({len(self._tensors)} tensors in the file)")
        return t

    def _w(self, name: str):
        return self.be.weight(self._need(name))

    @abstractmethod
    def _load_layer(self, i: int) -> dict:
        """The layer's weights, by short name, through the backend."""

    # -- inference ----------------------------------------------------------------------------
    # KV types new_state() uses when not told: exact f32 unless set_kv_cache_types() chose others
    kv_cache_types: tuple[str, str] = ("f32", "f32")

    def set_kv_cache_types(self, cache_type_k: str = "auto", cache_type_v: str = "auto") -> tuple[str, str]:
        """Resolve (`auto` included) and keep the KV types of every later state; ValueError if unusable."""
        self.kv_cache_types = resolve_cache_types(self.cfg, cache_type_k, cache_type_v)
        return self.kv_cache_types

    def new_state(self, max_ctx: int | None = None, cache_type_k: str | None = None,
                  cache_type_v: str | None = None) -> SequenceState:
        k, v = resolve_cache_types(self.cfg, cache_type_k or self.kv_cache_types[0],
                                   cache_type_v or self.kv_cache_types[1])
        return SequenceState.allocate(self.cfg, max_ctx or self.cfg.context_length, cache_type_k=k, cache_type_v=v)

    def forward(self, state: SequenceState, tokens: Sequence[int], parents: Sequence[int] | None = None,
                capture: Sequence[int] = (), checkpoints: bool = False,
                logits: str = "all") -> ForwardResult:
        """Run T new tokens after the committed context.

        parents[i] is the index of token i's parent among the new tokens (-1: the committed context), so a
        chain is [-1, 0, 1, ...] and a draft tree is any topologically ordered parent list. Token i sits at
        position n_past + depth(i) and attends to the committed context plus its own ancestors. With
        `checkpoints` every recurrent layer keeps its state after each token, so any root-to-node path can
        be committed; a chain without checkpoints can only be committed whole (prefill, plain decode).
        logits: "all", "last", "none", or "rows": every row, each computed when read (RowLogits; a verify).
        """
        if logits not in ("all", "last", "none", "rows"):
            raise ValueError(f"logits must be 'all', 'last', 'none' or 'rows', not {logits!r}")
        tokens, par, is_chain = check_step(tokens, parents, self.cfg.n_vocab)
        faults.check("forward")
        T = len(tokens)
        state.check_room(T)
        depth = np.zeros(T, dtype=np.int64)
        for i in range(T):
            depth[i] = 0 if par[i] < 0 else depth[par[i]] + 1
        anc = ancestor_matrix(par)
        visible = np.concatenate([np.ones((T, state.n_past), dtype=bool), anc], axis=1)
        pending = PendingStep(n_tokens=T, parents=par, ssm_per_token=checkpoints or not is_chain)
        ctx = StepContext(state=state, pending=pending, positions=state.n_past + depth, parents=par,
                          visible=visible, is_chain=is_chain, checkpoints=pending.ssm_per_token)

        capture = list(capture)
        for lid in capture:
            if not 0 <= lid < self.cfg.n_layer:
                raise ValueError(f"capture layer {lid} outside the model's {self.cfg.n_layer} layers")
        captured = np.empty((T, len(capture), self.cfg.n_embd), np.float32) if capture else None

        x = self.be.embed(self.tok_embd, tokens)
        for i, layer in enumerate(self.layers):
            x = self._block(i, layer, x, ctx)
            for slot, lid in enumerate(capture):
                if lid == i:
                    captured[:, slot] = x
        state.pending = pending

        if logits == "rows":
            return ForwardResult(logits=RowLogits(self, x), logit_rows=np.arange(T), captured=captured)
        rows = {"all": np.arange(T), "last": np.array([T - 1]), "none": np.array([], dtype=np.int64)}[logits]
        out = None
        if len(rows):
            h = rms_norm(x[rows], self.output_norm, self.cfg.rms_eps)
            out = self.be.linear(h, self.output)
        return ForwardResult(logits=out, logit_rows=rows, captured=captured)

    @abstractmethod
    def _block(self, i: int, layer: dict, x: np.ndarray, ctx: StepContext) -> np.ndarray:
        """One decoder block over the step's T tokens: (T, n_embd) -> (T, n_embd)."""

    # -- shared block pieces -------------------------------------------------------------------
    def _kv_attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, ctx: StepContext):
        """Write this step's K/V rows after the committed ones and attend over context + ancestors."""
        st = ctx.state
        n0, T = st.n_past, q.shape[0]
        cache = st.kv[i]
        cache.write(n0, k, v)
        return cache.attend(q, n0 + T, ctx.visible)
