"""One command from nothing to a shipped default model: corpus -> tokenizer -> target -> drafter -> export -> eval.

    python -m tools.train.pipeline --out DIR [--device cuda] [--minutes 12] [--seed 0]

    python -m tools.train.pipeline --out DIR --init-target OLD/target.gguf --target-only [--seed 1]
        continue an existing target's training (fresh warmup + cosine over the new steps) and stop after it

Writes into DIR (with --target-only: target.gguf, MODEL_CARD.md, SHA256SUMS, summary.json, work/):
    target.gguf        the qwen35 target, Q8_0, tokenizer and chat template inside
    drafter/           the DFlash drafter, z-lab layout (config.json + model.safetensors, bf16)
    drafter.gguf       the same drafter as a `dflash-draft` GGUF
    MODEL_CARD.md      data, sizes, command, seed, held-out loss/perplexity, measured numbers
    SHA256SUMS         of the four model files (sha256sum -c compatible)
    summary.json       everything the run measured
    work/              corpus, tokenizer, the target's HF folder (float32), not shipped

`--minutes` is the wall-clock budget of the whole run: corpus and tokenizer take what they take, eval
and export get a reserve, the target gets ~55% of the rest and the drafter (data + training) the
remainder; each training loop times its first steps and fixes its step count to fit. The step counts it
chose are printed and written to the card: pass them back (--target-steps, --gen-seqs, --drafter-steps)
to rerun the same schedule exactly (up to CUDA's own non-determinism).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .common import log, seed_everything, sha256_file, write_json
from .drafter import DataConfig, DraftSpec, DraftTrainConfig
from .target import TargetConfig, TrainConfig


@dataclass
class EvalConfig:
    enabled: bool = True
    prompts: int = 16
    prompt_tokens: int = 96
    max_tokens: int = 96
    seconds: float = 60.0
    short_prompts: bool = True


@dataclass
class PipelineConfig:
    out: str
    device: str = "auto"
    minutes: float | None = 12.0
    seed: int = 0
    roots: list[str] | None = None          # corpus folders (default: stdlib + site-packages)
    train_mb: float = 150.0
    heldout_frac: float = 0.02
    heldout_mb: float = 4.0
    max_files: int | None = None
    vocab: int = 4096
    tok_sample_mb: float = 16.0
    target: TargetConfig = field(default_factory=TargetConfig)
    target_train: TrainConfig = field(default_factory=TrainConfig)
    draft: DraftSpec = field(default_factory=DraftSpec)
    data: DataConfig = field(default_factory=DataConfig)
    draft_train: DraftTrainConfig = field(default_factory=DraftTrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    target_gguf: str | None = None          # train only a drafter, for this shipped qwen35 target
    init_target: str | None = None          # continue training this qwen35 GGUF instead of random weights
    target_only: bool = False               # stop after the target (no drafter, no engine eval)
    synthetic_cycle: bool = False           # write the cycle corpus into the first root first
    init_drafter: str | None = None         # continue training this drafter folder (z-lab layout)
    target_gguf_type: str = "q8_0"
    drafter_gguf_type: str = "q8_0"
    drafter_dtype: str = "bfloat16"
    target_share: float = 0.5               # of the time left after corpus + tokenizer (minus the reserve)
    gen_share: float = 0.35                 # of the time left for the drafter stage (capped by feature memory)
    reserve_seconds: float = 45.0           # export, saving, model card (eval's own seconds come on top)
    command: str = ""


def toy_config(out: str, roots: list[str] | None = None, seed: int = 0) -> PipelineConfig:
    """Seconds-scale settings for the CPU smoke test: every stage runs, nothing is learnt."""
    return PipelineConfig(
        out=out, device="cpu", minutes=None, seed=seed, roots=roots, train_mb=0.4, heldout_frac=0.25,
        heldout_mb=0.1, vocab=300, tok_sample_mb=0.4,
        target=TargetConfig(hidden_size=32, num_hidden_layers=2, full_attention_interval=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                            linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=64,
                            max_position_embeddings=512),
        target_train=TrainConfig(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5, seconds=None, steps=20,
                                 eval_seqs=4, log_every=10),
        draft=DraftSpec(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=64, n_features=2, rope_theta=10000.0),
        data=DataConfig(seq_len=64, prompt_min=16, prompt_max=32, gen_batch=8, seconds=None, max_seqs=16,
                        feature_batch=8),
        draft_train=DraftTrainConfig(batch_size=4, anchors=8, lr=3e-3, warmup_steps=5, seconds=None, steps=20,
                                     log_every=10, eval_frac=0.125),
        eval=EvalConfig(prompts=2, prompt_tokens=24, max_tokens=24, seconds=60.0, short_prompts=False),
        drafter_gguf_type="f32", drafter_dtype="float32",
    )


def cycle_config(out: str, seed: int = 0) -> PipelineConfig:
    """The known-good pair: the toy model sizes trained on the synthetic cycle corpus (corpus.write_cycle_corpus)
    long enough that the target continues the cycle and the drafter predicts whole blocks of it."""
    cfg = toy_config(out, [str(Path(out) / "work" / "cycle_src")], seed)
    cfg.synthetic_cycle = True
    cfg.train_mb = 1.0
    cfg.target_train.steps = 300
    cfg.target_train.seq_len = 128
    # the drafter must see the relative distances decoding will (RoPE): sequences of 192, prompts 16-64
    cfg.data.seq_len, cfg.data.prompt_min, cfg.data.prompt_max, cfg.data.max_seqs = 192, 16, 64, 64
    cfg.draft_train.steps = 600
    return cfg


def _mb(path: Path) -> float:
    return path.stat().st_size / 1e6


def run(cfg: PipelineConfig) -> dict:
    """Run every stage; returns the summary (also written to out/summary.json)."""
    import torch

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return _run(cfg)
    finally:  # seed_everything switched deterministic kernels on for the process: put it back
        torch.use_deterministic_algorithms(was_deterministic)


def _run(cfg: PipelineConfig) -> dict:
    import numpy as np
    import torch

    from services.engine.convert import convert_hf_to_gguf
    from services.engine.formats import open_model_file
    from services.engine.models.dflash import convert_drafter_to_gguf

    from . import drafter as dr
    from . import target as tg
    from .common import pick_device
    from .corpus import build_corpus, read_docs
    from .tokenizer import EOT, MASK, encode_docs, save_tokenizer, tokenizer_from_gguf, train_tokenizer

    if cfg.init_target and cfg.target_gguf:
        raise SystemExit("--init-target continues a target, --target-gguf keeps one as it is: pass one of them")
    if cfg.target_only and (cfg.target_gguf or cfg.init_drafter):
        raise SystemExit("--target-only trains no drafter: it goes with neither --target-gguf nor --init-drafter")
    if cfg.target_only:
        cfg.eval.enabled = False      # the engine eval measures the pair; the target's held-out loss stays
    t_run = time.perf_counter()
    total_s = cfg.minutes * 60 if cfg.minutes else None

    def left() -> float:
        return float("inf") if total_s is None else total_s - (time.perf_counter() - t_run)

    out = Path(cfg.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    seed_everything(cfg.seed)
    timings: dict[str, float] = {}
    summary: dict = {"command": cfg.command, "seed": cfg.seed, "device": device,
                     "torch": torch.__version__, "python": sys.version.split()[0]}
    if device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"pipeline: out {out}, device {device}, budget {cfg.minutes} min, seed {cfg.seed}")

    # 1. corpus -------------------------------------------------------------------------------------
    t = time.perf_counter()
    if cfg.synthetic_cycle:
        from .corpus import write_cycle_corpus

        write_cycle_corpus(cfg.roots[0], seed=cfg.seed)
    manifest = build_corpus(work / "corpus", cfg.roots, cfg.train_mb, cfg.heldout_frac, cfg.heldout_mb,
                            max_files=cfg.max_files)
    timings["corpus"] = time.perf_counter() - t

    # 2. tokenizer + token streams ------------------------------------------------------------------
    t = time.perf_counter()
    docs = read_docs(work / "corpus" / "train.txt")
    held_docs = read_docs(work / "corpus" / "heldout.txt")
    if cfg.target_gguf:          # drafter-only run: the target's own token ids
        tok = tokenizer_from_gguf(cfg.target_gguf)
    else:
        tok = train_tokenizer(docs, cfg.vocab, cfg.tok_sample_mb)
        if cfg.init_target:      # the continued weights only mean something under their own token ids
            _check_init_tokenizer(tok, cfg, manifest)
    special = save_tokenizer(tok, work / "tokenizer")
    vocab = tok.get_vocab_size()
    eot, mask_id = special[EOT], special[MASK]
    train_tokens = encode_docs(tok, docs, eot)
    held_tokens = encode_docs(tok, held_docs, eot)
    held_bytes = sum(len(d.encode("utf-8")) for d in held_docs)
    bpt = held_bytes / max(1, len(held_tokens) - len(held_docs))   # bytes per token (EOTs excluded)
    del docs
    timings["tokenizer"] = time.perf_counter() - t
    log(f"tokenizer: vocab {vocab}, train {len(train_tokens) / 1e6:.2f}M tokens, held-out "
        f"{len(held_tokens) / 1e3:.1f}k tokens, {bpt:.2f} bytes/token")

    # 3. target ---------------------------------------------------------------------------------------
    t = time.perf_counter()
    tt = cfg.target_train
    eos_ids = [special["<|im_end|>"], eot]
    if cfg.target_gguf:
        model, cfg.target = tg.load_gguf_target(cfg.target_gguf, eos_ids=eos_ids, pad_id=eot)
        model.to(device)
        # The target's own training record (kept beside a shipped GGUF) goes into this run's card.
        prev = _previous_summary(Path(cfg.target_gguf).parent)
        tstats = dict(prev.get("target") or {})
        tstats.pop("config", None)
        tstats.update({"source": cfg.target_gguf, "params": tg.n_params(model),
                       "heldout": tg.evaluate(model, held_tokens, tt.seq_len, device, tt.eval_seqs)})
        tstats["heldout"]["bits_per_byte"] = tstats["heldout"]["loss"] / math.log(2) / bpt
        # the command that trained the target: a drafter-only predecessor passes its own record on
        target_repro = prev.get("target_reproduce") or prev.get("reproduce")
        if target_repro:
            summary["target_reproduce"] = target_repro
        if prev.get("init_target_reproduce"):
            summary["init_target_reproduce"] = prev["init_target_reproduce"]
        if Path(cfg.target_gguf).resolve() != (out / "target.gguf").resolve():
            shutil.copyfile(cfg.target_gguf, out / "target.gguf")
        log(f"target: {cfg.target_gguf} (not retrained), held-out ppl {tstats['heldout']['ppl']:.3f}")
    else:
        init = None
        if cfg.init_target:
            model, cfg.target = tg.load_gguf_target(cfg.init_target, eos_ids=eos_ids, pad_id=eot)
            init = _init_record(cfg.init_target, model, held_tokens, tt, device, bpt)
            prev = _previous_summary(Path(cfg.init_target).parent)
            # the command that trained the start weights, for the card (a drafter-only summary carries it)
            init_repro = prev.get("target_reproduce") or prev.get("reproduce")
            if init_repro:
                summary["init_target_reproduce"] = init_repro
            log(f"target: continuing {cfg.init_target} ({init['steps'] or '?'} steps so far), start held-out "
                f"loss {init['heldout']['loss']:.4f}")
        if tt.steps is None and total_s is not None:
            avail = left() - cfg.reserve_seconds - (cfg.eval.seconds if cfg.eval.enabled else 0)
            tt.seconds = max(10.0, avail * (1.0 if cfg.target_only else cfg.target_share))
        seed_everything(cfg.seed)
        if init is None:
            model = tg.build_model(cfg.target, vocab, cfg.seed, eos_ids=eos_ids, pad_id=eot)
        tstats = tg.train(model, train_tokens, held_tokens, tt, device, cfg.seed, bytes_per_token=bpt)
        if init is not None:
            tstats["init"] = init
            known = init["steps"] is not None and init["tokens_seen"] is not None
            tstats["total_steps"] = init["steps"] + tstats["steps"] if known else None
            tstats["total_tokens_seen"] = init["tokens_seen"] + tstats["tokens_seen"] if known else None
        hf_dir = work / "target_hf"
        tg.save_hf(model, hf_dir, work / "tokenizer")
        convert_hf_to_gguf(str(hf_dir), str(out / "target.gguf"), cfg.target_gguf_type)
    timings["target"] = time.perf_counter() - t
    log(f"target: wrote {out / 'target.gguf'} ({_mb(out / 'target.gguf'):.1f} MB, {cfg.target_gguf_type})")
    summary.update({
        "corpus": {k: manifest[k] for k in ("python", "files_seen", "unique_docs", "train", "heldout",
                                            "train_sha256", "heldout_sha256")},
        "tokenizer": {"vocab": vocab, "train_tokens": int(len(train_tokens)), "heldout_tokens": int(len(held_tokens)),
                      "heldout_bytes_per_token": round(bpt, 3), "special_ids": special},
        "target": {"config": asdict(cfg.target), **tstats},
    })
    if cfg.target_only:
        del model
        return _finish(cfg, summary, ["target.gguf"], timings, t_run, tstats["steps"], None, None)

    # 4. drafter --------------------------------------------------------------------------------------
    t = time.perf_counter()
    # the command behind a continued drafter: its summary lies beside its folder (the target's may be elsewhere)
    init_drafter_repro = _previous_summary(Path(cfg.init_drafter).parent).get("reproduce") if cfg.init_drafter \
        else None
    if init_drafter_repro:
        summary["init_drafter_reproduce"] = init_drafter_repro
    spec = cfg.draft
    n_tl = cfg.target.num_hidden_layers
    if not spec.target_layer_ids:
        spec.target_layer_ids = dr.feature_layer_ids(n_tl, spec.n_features)
    model.to(device)
    if device.startswith("cuda"):
        model.to(torch.bfloat16)          # frozen from here on: bf16 is enough for data and features
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    dc, dtc = cfg.data, cfg.draft_train
    reserve = cfg.reserve_seconds + (cfg.eval.seconds if cfg.eval.enabled else 0)
    if dc.max_seqs is None and total_s is not None:
        dc.seconds = max(5.0, (left() - reserve) * cfg.gen_share)
    data = dr.make_dataset(model, train_tokens, spec.target_layer_ids, dc, device, cfg.seed)
    data_stats = data["stats"]
    # The drafter borrows the token table and lm head the engine will use: the shipped GGUF's.
    mf = open_model_file(str(out / "target.gguf"))
    embed = torch.from_numpy(np.asarray(mf.tensors["token_embd.weight"].dequantize(), np.float32)).to(device)
    lm_head = torch.from_numpy(np.asarray(mf.tensors["output.weight"].dequantize(), np.float32)).to(device)
    if not dc.features_on_the_fly:     # else the frozen target computes each batch's features
        del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if dtc.steps is None and total_s is not None:
        dtc.seconds = max(5.0, left() - reserve)
    seed_everything(cfg.seed)
    if cfg.init_drafter:
        # Continue an earlier drafter (new data from this run's seed); its shape decides, not --drafter-*.
        drafter = dr.load_drafter_torch(cfg.init_drafter).train()
        if drafter.spec.target_layer_ids != spec.target_layer_ids or drafter.hidden != cfg.target.hidden_size:
            raise SystemExit(f"{cfg.init_drafter}: drafter reads layers {drafter.spec.target_layer_ids} at hidden "
                             f"{drafter.hidden}; this target needs {spec.target_layer_ids} at {cfg.target.hidden_size}")
    else:
        drafter = dr.DFlashDraftModel(spec, cfg.target.hidden_size)
    dstats = dr.train_drafter(drafter, data, embed, lm_head, mask_id, dtc, device, cfg.seed)
    del data
    dcfg = dr.save_drafter(drafter, out / "drafter", vocab, n_tl, mask_id, cfg.drafter_dtype)
    convert_drafter_to_gguf(str(out / "drafter"), str(out / "drafter.gguf"), cfg.drafter_gguf_type)
    timings["drafter"] = time.perf_counter() - t
    log(f"drafter: wrote {out / 'drafter'} and drafter.gguf ({_mb(out / 'drafter.gguf'):.1f} MB)")

    # 5. eval -----------------------------------------------------------------------------------------
    ev = None
    if cfg.eval.enabled:
        from .eval import evaluate

        t = time.perf_counter()
        ec = cfg.eval
        seconds = ec.seconds if total_s is None else max(20.0, min(ec.seconds, left() - 15))
        ev = evaluate(str(out / "target.gguf"), str(out / "drafter"), work / "corpus" / "heldout.txt",
                      ec.prompts, ec.prompt_tokens, ec.max_tokens, seconds=seconds, seed=cfg.seed,
                      short_prompts=ec.short_prompts)
        timings["eval"] = time.perf_counter() - t

    # 6. card, sums, summary --------------------------------------------------------------------------
    summary.update({"drafter": {"params": dr.param_count(drafter), "config": dcfg, "data_config": asdict(dc),
                                "data": data_stats, **dstats},
                    "eval": ev})
    shipped = ["target.gguf", "drafter.gguf", "drafter/config.json", "drafter/model.safetensors"]
    return _finish(cfg, summary, shipped, timings, t_run, None if cfg.target_gguf else tstats["steps"],
                   data_stats["seqs"], dstats["steps"])


def _finish(cfg: PipelineConfig, summary: dict, shipped: list[str], timings: dict[str, float], t_run: float,
            target_steps: int | None, gen_seqs: int | None, drafter_steps: int | None) -> dict:
    """SHA256SUMS, the card and summary.json of the files this run ships."""
    from .card import write_card

    out = Path(cfg.out)
    sums = {name: sha256_file(out / name) for name in shipped}
    (out / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    sizes = {name: round(_mb(out / name), 2) for name in shipped}
    timings["total"] = time.perf_counter() - t_run
    summary.update({"sizes_mb": sizes, "total_mb": round(sum(sizes.values()), 2), "sha256": sums,
                    "timings_s": {k: round(v, 1) for k, v in timings.items()}})
    summary["reproduce"] = _repro_command(cfg, target_steps, gen_seqs, drafter_steps)
    write_card(out / "MODEL_CARD.md", summary, cfg)
    write_json(out / "summary.json", summary)
    log(f"pipeline: done in {timings['total']:.0f}s; shipped {summary['total_mb']} MB")
    return summary


def _check_init_tokenizer(tok, cfg: PipelineConfig, manifest: dict) -> None:
    """Refuse an --init-target whose tokenizer is not the one this corpus and --vocab give."""
    from .tokenizer import tokenizer_difference

    why = tokenizer_difference(tok, cfg.init_target)
    if why is None:
        return
    prev = _previous_summary(Path(cfg.init_target).parent).get("corpus") or {}
    digests = (f"; its run's training corpus digest was {prev['train_sha256'][:16]}…, this one's is "
               f"{manifest['train_sha256'][:16]}…" if prev.get("train_sha256") else "")
    raise SystemExit(f"--init-target {cfg.init_target}: its tokenizer is not the one this corpus and --vocab "
                     f"{cfg.vocab} give ({why}){digests}. Continue it on the corpus it was trained on: the same "
                     "installed packages (or --root folders) and --vocab; a larger --train-mb keeps the tokenizer.")


def _init_record(path: str, model, held_tokens, tt, device: str, bpt: float) -> dict:
    """What a continued target starts from: the file, its digest, its training so far, its held-out loss."""
    from . import target as tg

    prev = _previous_summary(Path(path).parent).get("target") or {}
    heldout = tg.evaluate(model.to(device), held_tokens, tt.seq_len, device, tt.eval_seqs)
    heldout["bits_per_byte"] = heldout["loss"] / math.log(2) / bpt
    return {"path": path, "sha256": sha256_file(path),
            # a continued target's record counts all its steps in total_*; a first run's in steps/tokens_seen
            "steps": prev.get("total_steps", prev.get("steps")),
            "tokens_seen": prev.get("total_tokens_seen", prev.get("tokens_seen")),
            "heldout_before": (prev.get("heldout") or {}).get("loss"), "heldout": heldout}


def _previous_summary(folder: Path) -> dict:
    """The pipeline summary that produced a shipped target, if it lies beside it."""
    for name in ("summary.json", "training_summary.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return {}


def _repro_command(cfg: PipelineConfig, target_steps: int | None, gen_seqs: int | None,
                   drafter_steps: int | None) -> str:
    """The run's command with the step counts it chose pinned (later flags win in argparse)."""
    base = cfg.command or f"python -m tools.train.pipeline --out {shlex.quote(cfg.out)}"
    pinned = f" --target-steps {target_steps}" if target_steps is not None else ""
    if gen_seqs is not None:
        pinned += f" --gen-seqs {gen_seqs}"
    if drafter_steps is not None:
        pinned += f" --drafter-steps {drafter_steps}"
    return base + pinned


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    ap.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget of the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-mb", type=float, default=150.0, help="training corpus cap")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--root", action="append", help="corpus folder (repeatable; default stdlib + site-packages)")
    ap.add_argument("--target-steps", type=int, help="fixed target step count (default: fit the budget)")
    ap.add_argument("--drafter-steps", type=int, help="fixed drafter step count (default: fit the budget)")
    ap.add_argument("--gen-seqs", type=int, help="fixed number of generated drafter sequences")
    ap.add_argument("--target-batch", type=int, help="sequences of 512 tokens per target step (default 128)")
    ap.add_argument("--target-lr", type=float)
    ap.add_argument("--drafter-layers", type=int)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-seconds", type=float, default=60.0)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--preset", choices=("default", "toy", "cycle"), default="default",
                    help="toy: seconds-scale smoke run; cycle: the known-good pair on a synthetic cycle corpus")
    ap.add_argument("--target-gguf", help="train only a drafter for this qwen35 GGUF (its tokenizer must be the "
                    "one this corpus/seed/--vocab give, e.g. the shipped default target)")
    ap.add_argument("--drafter-lr", type=float)
    ap.add_argument("--features-on-the-fly", action="store_true",
                    help="compute target features per drafter batch (more generated data than fits cached)")
    ap.add_argument("--gen-share", type=float, help="share of the drafter stage spent generating data")
    ap.add_argument("--init-drafter", help="continue training this drafter folder (e.g. the shipped one) on "
                    "new data instead of starting from random weights (use another --seed for new data)")
    ap.add_argument("--init-target", metavar="GGUF", help="continue training this qwen35 target (its config and "
                    "Q8_0 weights; its tokenizer must be the one this corpus/--vocab give) with a fresh warmup + "
                    "cosine over the new steps (use another --seed for a new data order)")
    ap.add_argument("--target-only", action="store_true", help="stop after the target (export + held-out "
                    "loss), all of --minutes for it; train its drafter later with --target-gguf OUT/target.gguf")
    a = ap.parse_args(argv)

    if a.preset in ("toy", "cycle"):
        cfg = toy_config(a.out, a.root, a.seed) if a.preset == "toy" else cycle_config(a.out, a.seed)
        cfg.device = a.device if a.device != "auto" else "cpu"
    else:
        cfg = PipelineConfig(out=a.out, device=a.device, minutes=a.minutes, seed=a.seed, roots=a.root,
                             train_mb=a.train_mb, vocab=a.vocab)
    cfg.command = "python -m tools.train.pipeline " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    if a.target_steps:
        cfg.target_train.steps = a.target_steps
    if a.drafter_steps:
        cfg.draft_train.steps = a.drafter_steps
    if a.gen_seqs:
        cfg.data.max_seqs = a.gen_seqs
    if a.target_batch:
        cfg.target_train.batch_size = a.target_batch
    if a.target_lr:
        cfg.target_train.lr = a.target_lr
    if a.drafter_layers:
        cfg.draft.num_hidden_layers = a.drafter_layers
    if a.drafter_lr:
        cfg.draft_train.lr = a.drafter_lr
    cfg.target_gguf = a.target_gguf
    cfg.data.features_on_the_fly = a.features_on_the_fly
    cfg.init_drafter = a.init_drafter
    cfg.init_target = a.init_target
    cfg.target_only = a.target_only
    if a.gen_share:
        cfg.gen_share = a.gen_share
    cfg.eval.prompts = a.eval_prompts
    cfg.eval.seconds = a.eval_seconds
    cfg.eval.enabled = not a.no_eval
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    summary = run(cfg)
    short = {k: v for k, v in summary.items() if k != "drafter"}
    if "drafter" in summary:
        short["drafter"] = {k: summary["drafter"][k] for k in ("params", "steps", "eval", "train_seconds")}
    print(json.dumps(short, indent=1))


if __name__ == "__main__":
    main()
