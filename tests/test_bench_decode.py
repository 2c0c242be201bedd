"""bench/decode.py's width curve on a stand-in model (no GPU): the per-width medians of the pass through the API and
each width's captured verify graph replayed alone, the replays reported beside the passes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _decode_module():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Graph:
    def __init__(self, width: int, log: list[int]):
        self.width, self.log = width, log

    def launch(self, stream) -> None:
        self.log.append(self.width)


class _Model:
    """forward() captures a graph per (width, logits) as the GPU model keys them: (T, is_chain, per_token, logits,
    capture, s_hint)."""

    cfg = SimpleNamespace(n_vocab=50)

    def __init__(self):
        self.replayed: list[int] = []

    def new_state(self, n: int):
        return SimpleNamespace(graphs={}, pending=None, commit=lambda ids: None)

    def forward(self, state, toks, checkpoints=False, logits="last"):
        key = (len(toks), True, False, logits, (), 512)
        state.graphs.setdefault(key, SimpleNamespace(graph=_Graph(len(toks), self.replayed)))


class _Timer:
    """Seconds a call "takes": 1 ms per token of the last forward / replay, plus 5 ms of host time for a pass."""

    def __init__(self, model: _Model):
        self.model = model
        self.cupy = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: None))

    def __call__(self, fn):
        before = len(self.model.replayed)
        toks = []
        orig = self.model.forward

        def forward(state, t, **kw):
            toks.append(len(t))
            return orig(state, t, **kw)

        self.model.forward = forward
        try:
            r = fn()
        finally:
            self.model.forward = orig
        if toks:
            return 5e-3 + 1e-3 * toks[0], r
        return 1e-3 * self.model.replayed[before], r


def test_width_curve_reports_graph_replays_beside_the_passes() -> None:
    decode = _decode_module()
    model = _Model()
    wc = decode.width_curve(model, _Timer(model), context=8, reps=2, widths=(1, 4, 23), deadline=float("inf"))
    assert wc["rounds"] == 2
    assert wc["verify_s"] == pytest.approx({1: 6e-3, 4: 9e-3, 23: 28e-3})  # host time included
    assert wc["replay_s"] == pytest.approx({1: 1e-3, 4: 4e-3, 23: 23e-3})  # the device's part alone
    assert model.replayed.count(23) == decode.REPLAYS  # only the logits="all" graph of each width is replayed


def test_width_curve_without_graphs_has_no_replays() -> None:
    decode = _decode_module()

    class _Eager(_Model):
        def forward(self, state, toks, checkpoints=False, logits="last"):
            return None

    model = _Eager()
    wc = decode.width_curve(model, _Timer(model), context=8, reps=1, widths=(1, 2), deadline=float("inf"))
    assert wc["replay_s"] == {} and set(wc["verify_s"]) == {1, 2}


def test_plain_decode_reports_what_the_model_has():
    """plain_decode on a NumPy model: the served rate only (no decode-ahead switch to turn, no graphs to replay)."""
    from tests.dflash_models import make_tiny_target

    d = _decode_module().plain_decode(make_tiny_target(), 6, 5, rounds=2)
    assert d["tokens"] == 6 and d["rounds"] == 2 and d["tps"] > 0
    assert "step_tps" not in d and "replay_tps" not in d


def test_long_context_drafter_ratio_divides_by_a_verify_at_the_same_context() -> None:
    decode = _decode_module()
    model = _Model()
    contexts = []
    new_state = model.new_state
    model.new_state = lambda n: contexts.append(n) or new_state(n)
    lc = {"pass_replay_ms": 2.3}
    decode.long_context_ratios(model, _Timer(model), lc, context=2600, reps=2, scale=1.0, deadline=float("inf"))
    assert contexts and contexts[0] >= 2600 + decode.SPEC_WIDTH      # the verify's state holds the long context
    assert lc["verify23_at_ctx_ms"] == pytest.approx(28.0)            # the pass through the API (host time in)
    assert lc["verify23_replay_at_ctx_ms"] == pytest.approx(23.0)     # its graph alone
    assert lc["ratio_to_verify23_at_ctx"] == pytest.approx(2.3 / 28.0, abs=1e-4)
    assert lc["ratio_to_verify23_replay_at_ctx"] == pytest.approx(0.1)


def test_table_reports_both_loop_orders_and_their_outside_share(capsys) -> None:
    mod = _decode_module()
    row = {"draft_ms": 1.5, "tree_ms": 0.2, "verify_ms": 0.1, "accept_ms": 10.9, "commit_replay_ms": 0.17,
           "step_ms": 14.0, "tps": 142.9}
    serial = dict(row, outside_kernels_ms=0.84)
    ahead = dict(row, outside_kernels_ms=0.7, step_ms=13.86)
    rep = {"device": "test", "modes": {"graphs": {"drafter": {"spec_loop": {2: ahead}, "spec_loop_serial": {2: serial}},
                                                  "graph_stats": {"captures": 1, "replays": 2, "eager": 0}}}}
    mod.print_table(rep, "x.json")
    out = capsys.readouterr().out
    assert "the next draft before the commit" in out and "serial" in out
    assert "0.7 (5.1 %)" in out and "0.84 (6.0 %)" in out


PROMPT_GRAPHS = True   # the knob a GPU model's module has (qwen35_gpu.PROMPT_GRAPHS); _GraphModel's module is this


class _GraphModel:
    """The tiny NumPy target behind a GPU model's prompt knob: records each forward's length and the knob's value."""

    use_graphs = True

    def __init__(self, inner):
        self.inner, self.cfg, self.seen, self.states = inner, inner.cfg, [], []

    def new_state(self, n):
        self.states.append(self.inner.new_state(n))
        return self.states[-1]

    def forward(self, state, ids, **kw):
        self.seen.append((len(ids), sys.modules[__name__].PROMPT_GRAPHS))
        return self.inner.forward(state, ids, **kw)


def test_prompt_processing_times_the_served_prefill_and_eager_chunks() -> None:
    """pp n: every round commits the whole prompt on a fresh state as a request does; where the model has the prompt
    graph knob, the same prompt again in eager chunks with the knob off (and back on after), timed as enqueue + drain,
    with the ratio to the served time."""
    from tests.dflash_models import make_tiny_target

    decode = _decode_module()
    model = _GraphModel(make_tiny_target())
    waits = []
    pp = decode.prompt_processing(model, (5, 9), reps=2, deadline=float("inf"), sync=lambda: waits.append(1))
    assert set(pp) == {5, 9} and PROMPT_GRAPHS is True
    assert [s.n_past for s in model.states] == [5] * 6 + [9] * 6      # 2 lengths x 3 rounds x (served, eager)
    assert model.seen == [(5, True), (5, False)] * 3 + [(9, True), (9, False)] * 3
    assert len(waits) == 2 * 3 * 3                                     # before each run, after each enqueue
    for n, v in pp.items():
        assert v["tps"] == pytest.approx(n / (v["ms"] / 1e3), rel=0.01)
        assert v["eager_ms"] >= v["eager_host_ms"] > 0 and v["eager_drain_ms"] >= 0
        assert v["eager_over_served"] == pytest.approx(v["eager_ms"] / v["ms"], rel=0.05)
    plain = decode.prompt_processing(make_tiny_target(), (4,), reps=1, deadline=float("inf"), sync=lambda: None)
    assert set(plain[4]) == {"ms", "tps"}                               # no knob: the served prefill only


class _HostTimer:
    """bench/decode.py's Timer on the host: wall time of the call, a device that has nothing to wait for."""

    cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda: SimpleNamespace(synchronize=lambda: None)))

    def __call__(self, fn):
        import time

        t0 = time.perf_counter()
        r = fn()
        return time.perf_counter() - t0, r


def test_speculative_loop_through_a_drafter_service_process(tiny_pair, tmp_path, capsys) -> None:
    """--drafter-service: the forced-acceptance loop with a DrafterClient to a real `specsplit drafter` process as its
    proposer (the tiny NumPy pair here; a GPU target and a drafter on another GPU on the device), each acceptance
    length's rate set against the in-process drafter's of the same run, and the table's rows for it."""
    from services.engine.loader import load_target
    from tests.test_drafter_service import spawn_drafter, stop

    decode = _decode_module()
    decode.SERVICE_READY_S = 2.0
    model = load_target(tiny_pair[1], with_tokenizer=False).model
    proc, addr = spawn_drafter(tiny_pair, tmp_path / "d.sock")
    try:
        args = SimpleNamespace(drafter_service=[addr, "unix:///nonexistent/drafter.sock"], draft_features=["f16"],
                               context=12, spec_steps=2)
        local = {a: {"tps": 100.0} for a in decode.ACCEPT}
        r = {"drafter": {"spec_loop": local}}
        decode.spec_with_services(model, r, _HostTimer(), args, 1.0, float("inf"), lambda msg: None)
    finally:
        stop(proc)
    svc = r["drafter_services"][addr]
    assert "error" not in svc, svc.get("error")
    assert (svc["backend"], svc["transport"], svc["feature_dtype"]) == ("numpy", "shm", "f16")
    loop = svc["spec_loop"]
    assert list(loop) == list(decode.ACCEPT)
    for a, v in loop.items():
        assert v["step_ms"] > 0 and v["draft_ms"] > 0 and v["tps"] == pytest.approx(a / (v["step_ms"] / 1e3), rel=0.01)
        assert v["vs_in_process"] == pytest.approx(v["tps"] / 100.0, abs=1e-3)
        assert "outside_kernels_ms" not in v          # the drafter's passes are in another process: no graph here
        assert v["service_draft_ms"] > 0             # the service's own time of its drafts, as it answered
    # a drafter that is not there: an error for that address alone
    assert "error" in r["drafter_services"]["unix:///nonexistent/drafter.sock"]
    decode.print_table({"device": "test", "modes": {"graphs": dict(r, graph_stats={"captures": 0, "replays": 0,
                                                                                      "eager": 1})}}, "x.gguf")
    out = capsys.readouterr().out
    assert f"through the drafter service {addr} (numpy, shm, f16 features)" in out
    assert "drafter service unix:///nonexistent/drafter.sock error" in out
    # two wire types: the loop once with each, keyed by both
    args.drafter_service, args.draft_features, args.spec_steps = [addr], ["f32", "f16"], 1
    proc, addr2 = spawn_drafter(tiny_pair, tmp_path / "d.sock")
    try:
        decode.spec_with_services(model, r, _HostTimer(), args, 1.0, float("inf"), lambda msg: None)
    finally:
        stop(proc)
    assert list(r["drafter_services"]) == [f"{addr} f32", f"{addr} f16"]
    assert [v["feature_dtype"] for v in r["drafter_services"].values()] == ["f32", "f16"]
    assert all(list(v["spec_loop"]) == list(decode.ACCEPT) for v in r["drafter_services"].values())
