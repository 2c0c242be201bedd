"""Files in the storage types the GPU kernels learnt last, on the GPU engine: a Q5_K_M file (`make-synthetic --quant
q5_k_m`: Q5_K matrices, Q6_K on the LM head and the "more bits" layers, a Q5_K token table the device cannot decode),
an IQ4_XS one (`--quant iq4_xs`), and Q3_K / Q4_0 / IQ4_NL ones (`--quant q3_k_m` / `q4_0` / `iq4_nl`; the engine
takes them natively since they left quant_matmul.UNPROVEN_QTYPES; the test lifts that for a type still there): every
matrix goes up in its stored type (none as F16), and the GPU step's logits follow the NumPy engine's at prompt and
verify widths, teacher-forced (each width on the kernel the dispatch picks: gemv / ring, v2, wide; v2 at every width
for a type still in UNPROVEN_QTYPES).

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else. Tolerance: max |GPU - NumPy| over the row's logits
spread, 0.07 as for tests/test_kernels_quant_wide.py's 64-token chain: on these random tiny models the fp16
activations drift along a teacher-forced run (Q5_K_M's first run on an H200: 0.012-0.027 on the prompt's first rows,
0.045 at most, in the 41-token step; the Q4_K_M staged-norm model's rows sit at 0.012-0.015). The products themselves
are held to 2e-3 of float64 by tests/test_kernels_quant_matmul.py's test_newer_types_on_v2_at_every_width; a wrong
dequantization would move every row by the spread itself.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from kernels import loader

_REASON = loader.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"GPU tests of the new storage types skipped: {_REASON}", allow_module_level=True)

from services.engine import synthetic as S  # noqa: E402
from services.engine.loader import load_target  # noqa: E402
from services.engine.models.qwen35_gpu import load_gpu_target  # noqa: E402

pytestmark = pytest.mark.gpu

REL_TOL = 0.07


MIXES = {"q5_k_m": gguf.GGMLQuantizationType.Q5_K, "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS,
         "q3_k_m": gguf.GGMLQuantizationType.Q3_K, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL}


@pytest.mark.parametrize("quant", list(MIXES))
def test_new_type_files_run_on_the_gpu_in_their_stored_types(quant, tmp_path, monkeypatch):
    from kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "SUPPORTED_QTYPES", qm.SUPPORTED_QTYPES | {int(MIXES[quant])})
    res = S.make_synthetic("tiny", str(tmp_path), quant=quant, seed=5, draft=False, quiet=True)
    cpu, gpu = load_target(res.target_path), load_gpu_target(res.target_path, 0, with_tokenizer=False)
    types = {t.qtype for t in cpu.file.tensors.values()}
    assert MIXES[quant] in types
    assert gpu.model.fallback_weights == []          # no matrix dequantized to F16 on the way up
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(0, 400, 40)]
    worst = {}
    for model in (cpu.model, gpu.model):
        st = model.new_state(256)
        r = model.forward(st, prompt, logits="all")
        rows = list(np.asarray(r.logits, np.float64).reshape(len(prompt), -1))
        st.commit(range(len(prompt)))
        for w in (1, 3, 8, 23, 41):
            toks = [int(t) for t in np.random.default_rng(w).integers(0, 400, w)]
            r = model.forward(st, toks, logits="all")
            rows.extend(np.asarray(r.logits, np.float64).reshape(w, -1))
            st.commit(range(w))
        worst[model is gpu.model] = rows
    rel = [float(np.max(np.abs(a - b)) / np.std(b)) for a, b in zip(worst[True], worst[False])]
    assert len(rel) == 40 + 1 + 3 + 8 + 23 + 41
    assert max(rel) < REL_TOL, f"{quant}: max |GPU - NumPy| / spread {max(rel):.4f} at row {int(np.argmax(rel))}"
