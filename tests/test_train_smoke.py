"""The training tools (tools/train) end to end at toy scale on the CPU, checked against the engine.

One pipeline run (a few standard-library packages as the corpus, vocab 300, a 2-layer hidden-32 target
for 20 steps, a 1-layer drafter for 20 steps) is shared by the tests. The key check: the drafter's
training forward is the function the engine's DFlashDrafter computes.
"""

from __future__ import annotations

import email
import hashlib
import json
import os

import numpy as np
import pytest
import torch

from services.engine.convert import convert_hf_to_gguf
from services.engine.generate import generate
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.sampling import SamplingParams
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate
from tools.train import drafter as dr
from tools.train.corpus import DOC_SEP, build_corpus, read_docs
from tools.train.pipeline import run, toy_config

ROOTS = [os.path.dirname(json.__file__), os.path.dirname(email.__file__)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_toy")
    summary = run(toy_config(str(out), ROOTS, seed=0))
    return out, summary


@pytest.fixture(scope="module")
def engine_pair(toy):
    out, _ = toy
    lt = load_target(str(out / "target.gguf"))
    return lt, load_drafter(str(out / "drafter"), lt.model)


def _engine_tables(target):
    """The engine target's token table (V, E) and lm head (V, E) as dense float32 tensors."""
    V, E = target.cfg.n_vocab, target.cfg.n_embd
    embed = target.be.embed(target.tok_embd, np.arange(V))
    head = np.asarray(target.be.linear(np.eye(E, dtype=np.float32), target.output), np.float32).T
    return torch.from_numpy(np.ascontiguousarray(embed)), torch.from_numpy(np.ascontiguousarray(head))


def _compare_blocks(tdrafter, edrafter, feats: np.ndarray, tokens: np.ndarray, anchors: list[int],
                    embed, head) -> float:
    """Max relative error between the training forward and the engine, block by block."""
    t = torch.from_numpy(tokens).long()[None]
    a = torch.tensor([anchors])
    ids, _ = dr.block_inputs(t, a, tdrafter.spec.block_size, edrafter.mask_token_id)
    with torch.no_grad():
        logits = (tdrafter(torch.from_numpy(feats)[None], ids, a, embed) @ head.T)[0].numpy()
    worst = 0.0
    for b, start in enumerate(anchors):
        s = edrafter.new_session()
        ref = edrafter.draft(s, feats[:start] if start else None, int(ids[0, b, 0]), start)
        worst = max(worst, float(np.abs(logits[b, 1:] - ref).max() / np.abs(ref).max()))
        s = edrafter.new_session()
        edrafter.append_context(s, feats[:start], start)
        ref_all = edrafter.block_logits(s, ids[0, b].numpy(), start)
        worst = max(worst, float(np.abs(logits[b] - ref_all).max() / np.abs(ref_all).max()))
    return worst


def test_outputs(toy):
    out, summary = toy
    for name in ("target.gguf", "drafter.gguf", "drafter/config.json", "drafter/model.safetensors",
                 "MODEL_CARD.md", "SHA256SUMS", "summary.json"):
        assert (out / name).is_file(), name
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    card = (out / "MODEL_CARD.md").read_text()
    assert "perplexity" in card and "--target-steps 20" in card and "<!-- eval:begin -->" in card
    ho = summary["target"]["heldout"]
    assert np.isfinite(ho["loss"]) and ho["ppl"] == pytest.approx(np.exp(ho["loss"]))
    assert summary["target"]["steps"] == 20 and summary["drafter"]["steps"] == 20
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["sliding_window"] is None
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}


def test_corpus_is_deterministic_and_split_by_file(tmp_path, toy):
    out, _ = toy
    m = build_corpus(tmp_path, ROOTS, train_mb=0.4, heldout_frac=0.25, heldout_mb=0.1)
    assert m["train_sha256"] == json.loads((out / "work/corpus/corpus.json").read_text())["train_sha256"]
    train, held = read_docs(tmp_path / "train.txt"), read_docs(tmp_path / "heldout.txt")
    assert train and held and not set(train) & set(held)
    assert all(DOC_SEP not in d for d in train)


def test_tokenizer_and_chat_template(toy, engine_pair):
    lt, _ = engine_pair
    tok = lt.tokenizer
    ids = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>",
                                         "<think>", "</think>")}
    assert None not in ids.values() and lt.cfg.n_vocab == 300
    assert {ids["<|endoftext|>"], ids["<|im_end|>"]} <= set(tok.eos_ids)
    text = "def f(x):\n    return x  # café\n"
    assert tok.decode(tok.encode(text)) == text
    prompt = lt.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_drafter_training_forward_equals_engine(toy, engine_pair):
    """The most important check: what we train is what the engine runs (float32, < 1e-4 relative)."""
    out, _ = toy
    lt, edrafter = engine_pair
    target = lt.model
    tdrafter = dr.load_drafter_torch(out / "drafter")
    embed, head = _engine_tables(target)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 290, 48)
    st = target.new_state(64)
    feats = target.forward(st, tokens, capture=edrafter.target_layer_ids, logits="none").captured
    feats = feats.reshape(len(tokens), -1)
    assert _compare_blocks(tdrafter, edrafter, feats, tokens, [0, 1, 7, 20, 40], embed, head) < 1e-4

    # sliding (causal, windowed) layers too, with random norms so a wrong norm convention shows
    spec = dr.DraftSpec(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, rope_theta=1e4, target_layer_ids=list(edrafter.target_layer_ids),
                        layer_types=[dr.SLIDING, dr.FULL], sliding_window=5)
    torch.manual_seed(1)
    model = dr.DFlashDraftModel(spec, target.cfg.n_embd)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3 / p.shape[-1] ** 0.5)
    folder = out / "work" / "sliding_drafter"
    dr.save_drafter(model, folder, target.cfg.n_vocab, target.cfg.n_layer, edrafter.mask_token_id, "float32")
    swa = load_drafter(str(folder), target)
    assert swa.cfg.layer_causal == [True, False] and swa.cfg.sliding_window == 5
    assert _compare_blocks(model.eval(), swa, feats, tokens, [0, 3, 12, 33], embed, head) < 1e-4


def test_features_and_continuations_match_engine(toy):
    """HF-side features (forward hooks) and the cached decode loop are the engine's, on a float32 export."""
    from transformers import Qwen3_5ForCausalLM

    out, _ = toy
    hf_dir = out / "work" / "target_hf"
    f32 = out / "work" / "target_f32.gguf"
    convert_hf_to_gguf(str(hf_dir), str(f32), "f32")
    target = load_target(str(f32), with_tokenizer=False).model
    model = Qwen3_5ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    layer_ids = json.loads((out / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    tokens = np.random.default_rng(2).integers(0, 290, 40)
    hf = dr.target_features(model, torch.from_numpy(tokens)[None], layer_ids)[0].numpy()
    eng = target.forward(target.new_state(64), tokens, capture=layer_ids, logits="none").captured
    eng = eng.reshape(len(tokens), -1)
    assert np.abs(hf - eng).max() / np.abs(eng).max() < 1e-4
    # = HF hidden_states[lid + 1], except for the last layer, whose entry transformers gives after the final
    # norm (the engine, like z-lab, captures the raw layer output: hooks, not hidden_states)
    E = model.config.hidden_size
    with torch.no_grad():
        hs = model(torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states
    for j, lid in enumerate(layer_ids):
        same = np.allclose(hs[lid + 1][0].numpy(), hf[:, j * E:(j + 1) * E], atol=1e-5)
        assert same == (lid < model.config.num_hidden_layers - 1), lid

    prompt = [int(t) for t in tokens[:12]]
    cont = dr.continue_greedy_or_sampled(model, torch.tensor([prompt]), 20, 0.0, None)[0, 12:].tolist()
    assert cont == generate(target, prompt, 20, SamplingParams()).token_ids


def test_greedy_speculative_equals_plain(toy, engine_pair):
    out, summary = toy
    ev = summary["eval"]
    assert ev["chain"]["lossless_mismatches"] == 0 and ev["ddtree22"]["lossless_mismatches"] == 0
    assert ev["chain"]["mean_acceptance_length"] >= 1.0
    lt, edrafter = engine_pair
    gguf_drafter = load_drafter(str(out / "drafter.gguf"), lt.model)
    prompt = lt.tokenizer.encode("def add(a, b):\n    return")
    plain = generate(lt.model, prompt, 40, SamplingParams()).token_ids
    for d in (edrafter, gguf_drafter):
        for budget in (None, 22):
            res = speculative_generate(lt.model, LocalProposer(d), prompt, 40, SamplingParams(),
                                       SpecConfig(budget=budget))
            assert res.token_ids == plain
            assert res.spec["steps"] > 0


def test_anchor_sampling_and_labels():
    gen = torch.Generator().manual_seed(0)
    plen = torch.tensor([5, 10])
    a = dr.sample_anchors(plen, 30, 8, gen)
    assert a.shape == (2, 8) and bool((a[:, 1:] > a[:, :-1]).all())
    assert bool((a >= (plen[:, None] - 1)).all()) and bool((a <= 28).all())
    tokens = torch.arange(30)[None]
    ids, labels = dr.block_inputs(tokens, torch.tensor([[3, 20]]), 16, 99)
    assert ids[0, 0].tolist() == [3] + [99] * 15
    assert labels[0, 0].tolist() == [-100] + list(range(4, 19))
    assert labels[0, 1].tolist() == [-100] + list(range(21, 30)) + [-100] * 6
    w = dr.slot_weights(16, 7.0, "cpu")
    assert w[0] == 0 and w[1] == 1 and float(w[15]) == pytest.approx(np.exp(-2.0))


def test_chain_walk_matches_engine_acceptance(toy, engine_pair):
    """The training-side replay of greedy chain decoding takes the engine's steps, one for one."""
    from services.engine.speculative import speculative_stream

    out, _ = toy
    lt, edrafter = engine_pair
    target = lt.model
    tdrafter = dr.load_drafter_torch(out / "drafter")
    embed, head = _engine_tables(target)
    prompt = lt.tokenizer.encode("import os\n\n\ndef main():\n")
    plain = generate(target, prompt, 80, SamplingParams()).token_ids
    seq = np.array(prompt + plain)
    feats = target.forward(target.new_state(len(seq) + 1), seq, capture=edrafter.target_layer_ids,
                           logits="none").captured.reshape(len(seq), -1)
    walk = dr.chain_walk(tdrafter, torch.from_numpy(seq), torch.from_numpy(feats), len(prompt), embed, head,
                         edrafter.mask_token_id, amp=False)
    steps = []
    for _ in speculative_stream(target, LocalProposer(edrafter), prompt, len(plain), SamplingParams(),
                                SpecConfig(budget=None), on_step=lambda info: steps.append(info.accepted)):
        pass
    # the replay only takes blocks that end inside the sequence: compare those steps
    assert walk and steps[:len(walk)] == walk


def test_drafter_only_run_on_a_shipped_target(toy, tmp_path):
    """--target-gguf: the target GGUF is reused bit for bit (not retrained), its training record is carried
    into the card, the drafter trains on features computed per batch, and it loads against the target."""
    out, summary = toy
    cfg = toy_config(str(tmp_path / "run2"), ROOTS, seed=0)
    cfg.target_gguf = str(out / "target.gguf")
    cfg.data.features_on_the_fly = True                # and the drafter's features computed per batch
    s2 = run(cfg)
    assert (tmp_path / "run2" / "target.gguf").read_bytes() == (out / "target.gguf").read_bytes()
    assert s2["target"]["source"] == str(out / "target.gguf")
    assert s2["target"]["steps"] == summary["target"]["steps"]          # from out/summary.json
    assert abs(s2["target"]["heldout"]["loss"] - summary["target"]["heldout"]["loss"]) < 0.05
    card = (tmp_path / "run2" / "MODEL_CARD.md").read_text()
    assert "--target-gguf" in card and summary["reproduce"] in card
    assert "--target-steps" not in s2["reproduce"]
    assert s2["drafter"]["steps"] == cfg.draft_train.steps
    lt = load_target(str(tmp_path / "run2" / "target.gguf"))
    load_drafter(str(tmp_path / "run2" / "drafter"), lt.model)
    # and a third run continues that drafter (--init-drafter) instead of starting from random weights
    cfg3 = toy_config(str(tmp_path / "run3"), ROOTS, seed=1)
    cfg3.target_gguf, cfg3.init_drafter = str(out / "target.gguf"), str(tmp_path / "run2" / "drafter")
    cfg3.draft_train.steps = 1
    cfg3.draft_train.lr = 1e-9                        # one step at ~zero lr: the weights stay the loaded ones
    run(cfg3)
    a, b = (dr.load_drafter_torch(tmp_path / r / "drafter") for r in ("run2", "run3"))
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-2), n



def test_tokenizer_rebuilt_from_gguf_encodes_like_the_trained_one(toy):
    from tokenizers import Tokenizer

    from tools.train.tokenizer import tokenizer_from_gguf

    out, _ = toy
    trained = Tokenizer.from_file(str(out / "work" / "tokenizer" / "tokenizer.json"))
    rebuilt = tokenizer_from_gguf(out / "target.gguf")
    text = (out / "work" / "corpus" / "heldout.txt").read_text()[:20000] + "<|im_start|>user\n<think>hi<|im_end|>"
    assert rebuilt.encode(text).ids == trained.encode(text).ids
    assert rebuilt.decode(trained.encode(text).ids) == trained.decode(trained.encode(text).ids)


def _toy_args(out, *extra: str) -> list[str]:
    return ["--preset", "toy", "--out", str(out), *(a for r in ROOTS for a in ("--root", r)), *extra]


def test_target_only_then_continued_target_then_its_drafter(toy, tmp_path):
    """--target-only stops after the target; --init-target continues that GGUF (start = its held-out loss up to
    Q8_0 rounding, steps and tokens added up); a drafter run on the result carries the whole record."""
    from tools.train.pipeline import main

    first, second = tmp_path / "first", tmp_path / "second"
    main(_toy_args(first, "--target-only", "--target-steps", "6"))
    assert sorted(p.name for p in first.iterdir()) == ["MODEL_CARD.md", "SHA256SUMS", "summary.json", "target.gguf",
                                                      "work"]
    s1 = json.loads((first / "summary.json").read_text())
    assert "drafter" not in s1 and s1["target"]["steps"] == 6 and "init" not in s1["target"]
    assert s1["reproduce"].endswith("--target-steps 6") and "--gen-seqs" not in s1["reproduce"]   # nothing else
    assert "Not part of this run (`--target-only`)" in (first / "MODEL_CARD.md").read_text()

    main(_toy_args(second, "--target-only", "--target-steps", "6", "--seed", "1",
                   "--init-target", str(first / "target.gguf")))
    s2 = json.loads((second / "summary.json").read_text())
    t1, t2 = s1["target"], s2["target"]
    init = t2["init"]
    assert init["path"] == str(first / "target.gguf") and init["steps"] == 6
    assert init["sha256"] == hashlib.sha256((first / "target.gguf").read_bytes()).hexdigest()
    assert abs(init["heldout"]["loss"] - t1["heldout"]["loss"]) < 0.01      # Q8_0 rounding only
    assert init["heldout"]["loss"] < np.log(300) - 0.1                        # not random weights again
    assert t2["heldout"]["loss"] < init["heldout"]["loss"]                    # and it kept learning
    assert t2["steps"] == 6 and t2["total_steps"] == 12
    assert t2["total_tokens_seen"] == t1["tokens_seen"] + t2["tokens_seen"] == 2 * 6 * 8 * 64
    assert t2["config"] == t1["config"]                                       # read back from the GGUF
    assert s2["init_target_reproduce"] == s1["reproduce"]
    card = (second / "MODEL_CARD.md").read_text()
    assert f"Continued (`--init-target`) from `{first / 'target.gguf'}`" in card and "In all: 12 steps" in card
    assert f"| {init['heldout']['loss']:.4f} | {t2['heldout']['loss']:.4f} |" in card

    # the recipe's second run: a drafter for the continued target, continuing the toy drafter
    cfg = toy_config(str(tmp_path / "third"), ROOTS, seed=2)
    cfg.target_gguf, cfg.init_drafter = str(second / "target.gguf"), str(toy[0] / "drafter")
    cfg.draft_train.steps, cfg.data.max_seqs, cfg.eval.enabled = 2, 8, False
    s3 = run(cfg)
    assert s3["target"]["init"] == init and s3["target"]["total_steps"] == 12
    assert s3["target_reproduce"] == s2["reproduce"] and s3["init_target_reproduce"] == s1["reproduce"]
    assert s3["init_drafter_reproduce"] == toy[1]["reproduce"]
    card = (tmp_path / "third" / "MODEL_CARD.md").read_text()
    assert "Continued (`--init-target`)" in card and s1["reproduce"] in card and toy[1]["reproduce"] in card


def test_init_target_refuses_another_tokenizer(toy, tmp_path):
    out, _ = toy
    cfg = toy_config(str(tmp_path / "run"), ROOTS, seed=0)
    cfg.vocab, cfg.init_target, cfg.target_only = 280, str(out / "target.gguf"), True
    with pytest.raises(SystemExit, match=r"its tokenizer is not the one this corpus and --vocab 280 give "
                                         r"\(its vocabulary has 300 tokens, this one 280\)"):
        run(cfg)
    assert not (tmp_path / "run" / "target.gguf").exists()
    cfg.vocab, cfg.target_gguf = 300, str(out / "target.gguf")
    with pytest.raises(SystemExit, match="pass one of them"):
        run(cfg)
