"""The `specsplit` command line: generate, convert (serve and the services come with their modules)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

from .cliargs import KV_CACHE_HELP, add_device_arguments, kv_cache_type
from .engine.errors import InvalidRequestError, SpecsplitError


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got '{text}'") from None


def _add_sampling(p: argparse.ArgumentParser) -> None:
    # default None: an option not given takes the model file's declared value (GGUF general.sampling.*), else
    # the engine's (greedy, filters and penalties off, penalty window 64)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None, dest="repetition_penalty",
                   help="divide the logits of recent tokens (llama.cpp / HF repetition penalty; 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=None, help="OpenAI presence penalty (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI frequency penalty (0 = off)")
    p.add_argument("--repeat-last-n", type=int, default=None,
                   help="how many recent tokens the penalties look at (-1 = all; default 64)")
    p.add_argument("--logit-bias", action="append", type=_bias_pair, default=None, metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit before sampling (OpenAI logit_bias; repeatable)")


def _bias_pair(text: str) -> tuple[int, float]:
    try:
        tok, value = text.split("=")
        return int(tok), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS (e.g. 198=-100), got '{text}'") from None


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "repeat_last_n", "logit_bias")


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine.generate import generate
    from .engine.placement import is_gpu, load_drafter_on, load_target_on
    from .engine.sampling import normalize_logit_bias, resolve_sampling

    if args.model is None:
        from .engine.default_model import default_model_paths

        args.model, default_draft = default_model_paths()
        if args.draft is None and not args.no_draft:
            args.draft = default_draft
    _check_draft_device(args)
    if not _start_plan(args):
        return 0
    if args.prompt is None and args.prompt_ids is None:
        raise SpecsplitError("generate needs --prompt or --prompt-ids")
    t0 = time.perf_counter()
    gpu = is_gpu(args.device)
    target = load_target_on(args.model, args.device)
    load_ms = (time.perf_counter() - t0) * 1e3
    try:
        cache_k, cache_v = target.model.set_kv_cache_types(args.cache_type_k, args.cache_type_v)
    except ValueError as e:
        raise InvalidRequestError(f"{args.model}: {e}", param="cache_type") from None
    if gpu:
        from .engine.kvcache import resolve_cache_types

        asked = resolve_cache_types(target.cfg, args.cache_type_k, args.cache_type_v)
        if asked != (cache_k, cache_v):   # the GPU keeps f32 KV as f16: say so, never silently
            print(f"specsplit: KV cache {asked[0]}/{asked[1]} is stored as {cache_k}/{cache_v} on the GPU",
                  file=sys.stderr)
    tok = target.tokenizer
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
    else:
        if tok is None:
            raise SpecsplitError(f"{args.model} carries no tokenizer; pass --prompt-ids instead of --prompt")
        if args.chat:
            text = target.chat_template.render([{"role": "user", "content": args.prompt}],
                                               add_generation_prompt=True, enable_thinking=args.thinking)
        else:
            text = args.prompt
        prompt_ids = tok.encode(text)
    given = {k: getattr(args, k) for k in SAMPLING_OPTIONS}
    given["logit_bias"] = normalize_logit_bias(args.logit_bias) if args.logit_bias else None
    params = resolve_sampling(given, target.sampling_defaults)
    stop = sorted(tok.eos_ids) if tok is not None and not args.ignore_eos else []
    from .engine.memory_plan import serving_width, state_width

    if args.draft:
        from .engine.speculative import AUTO_MAX_BUDGET, SpecConfig, speculative_generate

        loaded = load_drafter_on(args.draft, target.model, args.draft_device)
        proposer = loaded.new_proposer()
        chain = args.chain or args.budget is None
        budget = None if chain else (AUTO_MAX_BUDGET if args.budget == "auto" else args.budget)
        width = serving_width(True, budget, loaded.drafter.block_size, "cuda" if gpu else "numpy")
        if gpu:   # the widest step the memory plan counted: this verify width, or a prompt's graph steps
            target.model.max_tree = state_width(True, budget, loaded.drafter.block_size, "cuda")
        if chain:
            spec = SpecConfig(budget=None)
        elif args.budget == "auto":
            from .engine.budget import BudgetTuner

            spec = SpecConfig.auto(BudgetTuner.measure(target.model, min(AUTO_MAX_BUDGET, width - 1),
                                                       capture=loaded.drafter.target_layer_ids))
        else:
            spec = SpecConfig(budget=args.budget)
        res = speculative_generate(target.model, proposer, prompt_ids, args.max_tokens, params, spec,
                                   stop_ids=stop, max_ctx=args.max_ctx, top_logprobs=args.logprobs,
                                   prompt_logprobs=args.prompt_logprobs)
    else:
        if gpu:
            target.model.max_tree = state_width(False, None, 1, "cuda")   # a prompt's graph steps
        res = generate(target.model, prompt_ids, args.max_tokens, params, stop_ids=stop, max_ctx=args.max_ctx,
                       top_logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    out_ids = res.token_ids
    text_ids = out_ids[:-1] if res.finish_reason == "stop" else out_ids
    text = tok.decode(text_ids) if tok is not None else None
    if args.json:
        obj = {"model": target.name, "prompt_ids": list(map(int, prompt_ids)), "token_ids": out_ids,
               "text": text, "finish_reason": res.finish_reason,
               "timings": {"load_ms": round(load_ms, 3), **res.timings()}}
        if res.spec is not None:
            obj["spec"] = res.spec
        for key in ("logprobs", "prompt_logprobs"):
            if getattr(res, key) is not None:
                obj[key] = [{"token_id": lp.token, "logprob": lp.logprob, "top": [list(p) for p in lp.top]}
                            for lp in getattr(res, key)]
        from .engine.kvcache import kv_info

        obj["kv_cache"] = kv_info(target.cfg, cache_k, cache_v, len(prompt_ids) + len(out_ids))
        print(json.dumps(obj))
    else:
        print(text if text is not None else " ".join(map(str, out_ids)))
        t = res.timings()
        extra = (f", mean acceptance length {res.spec['mean_acceptance_length']:.2f}"
                 if res.spec is not None else "")
        print(f"[{t['prompt_n']} prompt tokens, {t['predicted_n']} generated, "
              f"{t['predicted_per_second']:.1f} tok/s{extra}]", file=sys.stderr)
        for lp in (res.prompt_logprobs or []) + (res.logprobs or []):
            def show(i: int) -> str:
                return repr(tok.decode([i])) if tok is not None else str(i)
            alts = "  ".join(f"{show(i)} {v:.4f}" for i, v in lp.top)
            print(f"{lp.logprob:10.4f}  {show(lp.token)}" + (f"  | {alts}" if alts else ""), file=sys.stderr)
    return 0


def _budget(text: str) -> int | str | None:
    from .cliargs import parse_budget
    from .engine.speculative import AUTO_MAX_BUDGET

    b = parse_budget(text)
    if isinstance(b, int) and not 1 <= b <= AUTO_MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"--budget must be in 1..{AUTO_MAX_BUDGET}, 'chain' or 'auto', got {b}")
    return b


def _check_draft_device(args: argparse.Namespace) -> None:
    """--draft-device: default the target's device; a GPU drafter runs beside a GPU target on the same device."""
    from .engine.placement import check_devices

    args.draft_device = check_devices(args.device, args.draft_device)


def _start_plan(args: argparse.Namespace) -> bool:
    """Plan memory before loading (services.engine.memory_plan); False when --plan-only printed it."""
    from .engine.memory_plan import plan_from_args, print_plan

    plan = plan_from_args(args, args.model, args.draft)
    if args.plan_only:
        print_plan(plan, args.json)
        return False
    if plan.shrunk_from:
        print(f"specsplit: max_ctx {plan.shrunk_from} does not fit; using {plan.settings.max_ctx} "
              "(pass --max-ctx to choose)", file=sys.stderr)
        args.max_ctx = plan.settings.max_ctx
    return True


def cmd_make_synthetic(args: argparse.Namespace) -> int:
    from .engine.synthetic import make_synthetic

    res = make_synthetic(args.shape, args.out, quant=args.quant, seed=args.seed, ctx=args.ctx, layers=args.layers,
                         draft=not args.no_draft, draft_quant=args.draft_quant)
    print(json.dumps(res.as_dict()))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .engine.convert import convert_hf_to_gguf

    info = convert_hf_to_gguf(args.src, args.out, args.outtype)
    print(json.dumps(info))
    return 0


def _sampling_assignment(text: str) -> tuple[str, float | int]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE (e.g. repetition_penalty=1.1), got '{text}'")
    try:
        return name, int(value) if name in ("top_k", "repeat_last_n") else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: '{value}' is not a number") from None


def cmd_set_sampling(args: argparse.Namespace) -> int:
    from .engine.formats import open_model_file
    from .engine.gguf_write import rewrite_metadata
    from .engine.sampling import GGUF_SAMPLING_KEYS, model_sampling_defaults, sampling_metadata

    mf = open_model_file(args.model)      # a clear error for a file that is not a readable GGUF
    if mf.kind != "gguf":
        raise SpecsplitError(f"{args.model}: set-sampling writes GGUF metadata; this is a {mf.kind} model")
    updates: dict = sampling_metadata(dict(args.fields))
    for name in args.clear:
        if name not in GGUF_SAMPLING_KEYS:
            raise SpecsplitError(f"--clear {name}: not a declarable field ({', '.join(GGUF_SAMPLING_KEYS)})")
        updates[GGUF_SAMPLING_KEYS[name]] = None
    out = args.out or mf.path
    rewrite_metadata(mf.path, out, updates)
    print(json.dumps({"model": out, "declared": model_sampling_defaults(open_model_file(out).metadata)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (no server)")
    g.add_argument("--model", help="GGUF file or Hugging Face safetensors folder (default: the embedded model "
                   "and its drafter)")
    src = g.add_mutually_exclusive_group()   # one is required unless --plan-only (checked in cmd_generate)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--thinking", action="store_true", help="with --chat: enable_thinking=true")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--max-ctx", type=int, default=None, help="context size (default: the model's)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each generated token's log-probability and its N best alternatives (0..20)")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="the prompt's tokens' log-probabilities too (after the first), with N alternatives; "
                        "--max-tokens may then be 0")
    g.add_argument("--draft", help="DFlash drafter (z-lab safetensors folder or GGUF): speculative decoding")
    g.add_argument("--no-draft", action="store_true", help="plain decoding even with the embedded default model")
    g.add_argument("--cache-type-k", type=kv_cache_type, default="auto", help=KV_CACHE_HELP.format(side="keys"))
    g.add_argument("--cache-type-v", type=kv_cache_type, default="auto", help=KV_CACHE_HELP.format(side="values"))
    tree = g.add_mutually_exclusive_group()
    tree.add_argument("--budget", type=_budget, default="auto",
                      help="DDTree budget: non-root tree nodes 1..64, 'chain', or 'auto' (default: tuned per step "
                           "from this machine's measured verify cost and the running acceptance)")
    tree.add_argument("--chain", action="store_true", help="verify the drafter's top-1 block as a chain")
    _add_sampling(g)
    add_device_arguments(g, env=False)
    g.set_defaults(func=cmd_generate)

    # names as in services.engine.synthetic (SHAPES, QUANTS, DRAFT_QUANTS), not imported: parsing stays light
    m = sub.add_parser("make-synthetic", help="write a random-weight GGUF of a real model's shapes (+ its drafter)",
                       description="Synthetic models for benchmarks: the real shapes, tensor types and metadata "
                       "with random valid weights, written streaming; see services/engine/synthetic.py.")
    m.add_argument("--shape", required=True, choices=["qwen3.6-27b", "tiny"])
    m.add_argument("--quant", default="q4_k_m", choices=["q4_k_m", "q5_k_m", "iq4_xs", "q4_0", "iq4_nl", "q3_k_m"],
                   help="tensor type mix (llama.cpp's Q4_K_M / Q5_K_M; iq4_xs, q4_0, iq4_nl, q3_k_m: Q4_K_M's with "
                   "IQ4_XS / Q4_0 / IQ4_NL / Q3_K for Q4_K)")
    m.add_argument("--out", required=True, help="folder to write the GGUF files into")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--ctx", type=int, default=None, help="context_length to store (default: the real model's)")
    m.add_argument("--layers", type=int, default=None, help="override the layer count (same widths), for tests")
    m.add_argument("--no-draft", action="store_true", help="skip the DFlash drafter")
    m.add_argument("--draft-quant", default="q8_0", choices=["f16", "q4_k", "q8_0"], help="drafter matrix type")
    m.set_defaults(func=cmd_make_synthetic)

    c = sub.add_parser("convert", help="convert a Hugging Face safetensors folder to GGUF")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0"])
    c.set_defaults(func=cmd_convert)
    s = sub.add_parser("set-sampling", help="declare a GGUF model's default sampling (general.sampling.* keys, "
                       "as llama.cpp reads them); requests that leave a field unset get it")
    s.add_argument("model", help="GGUF file (rewritten atomically unless --out)")
    s.add_argument("fields", nargs="*", type=_sampling_assignment, metavar="FIELD=VALUE",
                   help="temperature, top_k, top_p, min_p, repetition_penalty, repeat_last_n")
    s.add_argument("--clear", action="append", default=[], metavar="FIELD", help="remove a declared field")
    s.add_argument("--out", help="write the result here instead")
    s.set_defaults(func=cmd_set_sampling)
    for module in _SERVICE_CLIS:
        importlib.import_module(module).register(sub)
    return ap


# Each service package adds its own sub-commands (gateway, verifier, drafter, serve).
_SERVICE_CLIS = [m for m in ("services.drafter.cli", "services.verifier.cli", "services.gateway.cli", "services.serve")
                 if importlib.util.find_spec(m) is not None]


def main(argv: list[str] | None = None) -> int:
    # Decode-time matrices are small: BLAS worker threads cost more in spinning and oversubscription
    # (gRPC and engine threads share the cores) than they gain. Set before NumPy loads its BLAS.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ.get("SPECSPLIT_BLAS_THREADS", "1"))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecsplitError as e:
        print(f"specsplit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
