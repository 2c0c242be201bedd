"""MODEL_CARD.md of a pipeline run (the eval section is filled by tools/train/eval.py, or left open)."""

from __future__ import annotations

from pathlib import Path

from .eval import CARD_BEGIN, CARD_END, card_section


def _fmt(x, nd: int = 4) -> str:
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _target_training(s: dict) -> str:
    tr = s["target"]
    if "steps" not in tr:
        return f"Training: not part of this run; the target was loaded from `{tr.get('source')}`."
    # a drafter-only run carries the target's own record: say so, the numbers below are that run's
    head = (f"Not retrained in this run (loaded from `{tr['source']}`); its training:\n" if tr.get("source") else "")
    init = tr.get("init")
    if init:
        before = (f"{init['steps']} steps, {init['tokens_seen'] / 1e6:.1f}M tokens before"
                  if init.get("steps") is not None and init.get("tokens_seen") is not None
                  else "its earlier training is not recorded beside it")
        head += (f"Continued (`--init-target`) from `{init['path']}` (sha256 `{init['sha256'][:16]}…`; {before});\n"
                 "optimizer state and schedule fresh: ")
    text = (f"{'Training: ' if not init else ''}{tr['steps']} AdamW steps of {tr['train_config']['batch_size']} x "
            f"{tr['train_config']['seq_len']}\ntokens ({tr['tokens_seen'] / 1e6:.1f}M tokens, {tr['epochs']} epochs), "
            f"peak lr {tr['train_config']['lr']},\nwarmup + cosine, "
            f"{'bf16 autocast' if s['device'].startswith('cuda') else 'float32'}, {tr['train_seconds']} s\n"
            f"({tr['tokens_per_second'] / 1e3:.1f}k tokens/s).")
    if init and tr.get("total_steps") is not None:
        text += f" In all: {tr['total_steps']} steps, {tr['total_tokens_seen'] / 1e6:.1f}M tokens."
    return head + text


def _heldout_table(tr: dict) -> str:
    """Held-out metrics; for a continued target the start weights' beside the final ones."""
    ho, init = tr["heldout"], (tr.get("init") or {}).get("heldout")
    rows = [("loss (nats/token)", "loss", 4), ("perplexity", "ppl", 2), ("bits per byte", "bits_per_byte", 3)]
    if not init:
        return "\n".join([f"| held-out (by file, {ho['tokens']} tokens) | value |", "| --- | --- |"]
                         + [f"| {label} | {_fmt(ho.get(k), nd)} |" for label, k, nd in rows])
    return "\n".join([f"| held-out (by file, {ho['tokens']} tokens) | start (`--init-target` weights) | this target |",
                      "| --- | --- | --- |"]
                     + [f"| {label} | {_fmt(init.get(k), nd)} | {_fmt(ho.get(k), nd)} |" for label, k, nd in rows])


def _target_repro(s: dict) -> str:
    text = ""
    if s.get("target_reproduce"):
        text += f"""
This run trained the drafter only (`--target-gguf`); the target came from this earlier run, whose
`target.gguf` the command above reads:

    {s['target_reproduce']}
"""
    if s.get("init_drafter_reproduce"):
        text += f"""
The drafter it continued (`--init-drafter`) came from this one (run it first, into the folder the command
above names):

    {s['init_drafter_reproduce']}
"""
    if s.get("init_target_reproduce"):
        text += f"""
The target continued (`--init-target`) the one this earlier run trained (run it first, into the folder
whose `target.gguf` the target's command reads):

    {s['init_target_reproduce']}
"""
    return text


def _drafter_section(s: dict, cfg) -> str:
    dr = s.get("drafter")
    if not dr:
        return ("Not part of this run (`--target-only`). Train one for this target with\n"
                "`python -m tools.train.pipeline --out DIR --target-gguf THIS/target.gguf` (and\n"
                "`--init-drafter OLD/drafter` to continue an earlier drafter).")
    dc = dr["config"]
    return f"""DFlash (z-lab `DFlashDraftModel` layout, `model_type qwen3`), {dr['params'] / 1e6:.2f}M parameters,
block size {dc['block_size']}, {dc['num_hidden_layers']} layers ({', '.join(sorted(set(dc['layer_types'])))}), heads
{dc['num_attention_heads']} / {dc['num_key_value_heads']} KV x {dc['head_dim']}, MLP {dc['intermediate_size']},
RoPE theta {dc['rope_theta']:g}, mask token id {dc['dflash_config']['mask_token_id']} (`<|MASK|>`), target
features from layers {dc['dflash_config']['target_layer_ids']}. Embeddings and lm head are the target's.
`drafter/` holds the safetensors ({cfg.drafter_dtype}); `drafter.gguf` is `dflash-draft`,
{cfg.drafter_gguf_type}.

Training (dflash.md §5): {dr['data']['seqs']} sequences of {dr['data']['seq_len']} tokens, each a corpus prompt
continued by the target ({dr['data']['generated_tokens'] / 1e6:.2f}M generated tokens; temperatures cycled
over batches: {sorted(set(dr['data']['temperatures']))}); random anchors in the generated part
({dr['train_config']['anchors']} per sequence), loss weights exp(-(k-1)/{dr['train_config']['gamma']}); {dr['steps']}
steps of {dr['train_config']['batch_size']} sequences, peak lr {dr['train_config']['lr']}, {dr['train_seconds']} s.
On {dr['eval_seqs']} generated sequences kept out of training: loss {_fmt(dr['eval']['loss'])}, top-1
{_fmt(dr['eval']['top1'], 3)}, accepted length per block with uniform anchors {_fmt(dr['eval']['acc_len'], 2)};
greedy chain decoding replayed on {dr['eval'].get('chain_seqs')} of them (greedy ones):
{_fmt(dr['eval'].get('chain_acceptance_length'), 2)} tokens per verify step (bonus included), the number that
decoding sees."""


def write_card(path: str | Path, s: dict, cfg) -> None:
    tc = s["target"]["config"]
    tr = s["target"]
    c = s["corpus"]
    n_full = sum(1 for i in range(tc["num_hidden_layers"]) if (i + 1) % tc["full_attention_interval"] == 0)
    if s.get("eval"):
        measured = card_section(s["eval"])
    elif not s.get("drafter"):
        measured = "Nothing but the held-out loss above: the engine's measures are of a target with its drafter."
    else:
        measured = (f"{CARD_BEGIN}\n\nNot measured yet: run `python -m tools.train.eval --target target.gguf --drafter "
                    f"drafter --heldout work/corpus/heldout.txt --card MODEL_CARD.md`.\n\n{CARD_END}")
    sizes = "\n".join(f"| `{k}` | {v} MB | `{s['sha256'][k][:16]}…` |" for k, v in s["sizes_mb"].items())
    text = f"""# specsplit embedded default: a small code target and its DFlash drafter

A tiny Qwen3.5-style hybrid model (`qwen35`: Gated DeltaNet + gated full attention) trained from scratch on
Python source code, with a DFlash block-diffusion drafter trained for it. It exists so that specsplit runs
out of the box, with speculative decoding that actually accepts drafts; it is far too small to be a useful
assistant. It completes Python code; the chat template is there for the API's sake.

## Files

| file | size | sha256 |
| --- | --- | --- |
{sizes}

Total {s['total_mb']} MB. Full hashes in `SHA256SUMS` (`sha256sum -c SHA256SUMS`).

## Target

`qwen3_5` (transformers `Qwen3_5ForCausalLM`), {tr['params'] / 1e6:.2f}M parameters, exported to GGUF
`{cfg.target_gguf_type}` with `services.engine.convert`.
hidden {tc['hidden_size']}, {tc['num_hidden_layers']} layers ({n_full} gated full attention, one in every
{tc['full_attention_interval']}; the rest Gated DeltaNet), attention heads {tc['num_attention_heads']} /
{tc['num_key_value_heads']} KV x {tc['head_dim']}, partial RoPE {tc['partial_rotary_factor']} (theta
{tc['rope_theta']:g}), DeltaNet key heads {tc['linear_num_key_heads']} x {tc['linear_key_head_dim']}, value heads
{tc['linear_num_value_heads']} x {tc['linear_value_head_dim']}, conv {tc['linear_conv_kernel_dim']}, MLP
{tc['intermediate_size']}, vocabulary {s['tokenizer']['vocab']}, untied embeddings, context
{tc['max_position_embeddings']}.

{_target_training(s)}

{_heldout_table(tr)}

## Drafter

{_drafter_section(s, cfg)}

## Measured

{measured}

## Data

Python sources found on the training machine (Python {c['python']}): the standard library and the
installed site-packages, {c['files_seen']} files of 1-200 KB, {c['unique_docs']} after de-duplication by
content hash and filtering (strict UTF-8, code-like, no special-token text).
Held out by file ({cfg.heldout_frac:.0%} by content hash): {c['heldout']['docs']} files,
{c['heldout']['bytes'] / 1e6:.2f} MB. Training: {c['train']['docs']} files, {c['train']['bytes'] / 1e6:.1f} MB
(cap {c['train']['cap_mb']} MB, files in hash order), {s['tokenizer']['train_tokens'] / 1e6:.1f}M tokens.
Corpus digests: train `{c['train_sha256'][:16]}…`, held-out `{c['heldout_sha256'][:16]}…`
(they change with the installed packages).
The sources are under their packages' own open-source licences (PSF, BSD, MIT, Apache-2.0, ...).

Tokenizer: byte-level BPE trained on the corpus with the Qwen3.5 pre-tokenizer, {s['tokenizer']['vocab']}
tokens including `<|endoftext|>` (between files), `<|im_start|>`, `<|im_end|>`, `<|MASK|>` (specials)
and `<think>`, `</think>`; {s['tokenizer']['heldout_bytes_per_token']} bytes per token on held-out code.
Generation stops at `<|endoftext|>` or `<|im_end|>`.

## Reproduce

Run on {s.get('gpu', s['device'])}, torch {s['torch']}, Python {s['python']}, seed {s['seed']}:

    {s['command']}

The budget decided the step counts; this pins them (same data order and schedule; CUDA kernels may
still differ in the last bits):

    {s['reproduce']}
{_target_repro(s)}
Stage times (s): {', '.join(f'{k} {v}' for k, v in s['timings_s'].items())}.
"""
    Path(path).write_text(text)
