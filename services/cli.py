"""The `specsplit` command line: generate, convert (serve and the services come with their modules)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

from .engine.errors import InvalidRequestError, SpecsplitError


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got '{text}'") from None


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine.generate import generate
    from .engine.loader import load_target
    from .engine.sampling import SamplingParams

    if args.model is None:
        from .engine.default_model import default_model_paths

        args.model, default_draft = default_model_paths()
        if args.draft is None and not args.no_draft:
            args.draft = default_draft
    t0 = time.perf_counter()
    target = load_target(args.model)
    load_ms = (time.perf_counter() - t0) * 1e3
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
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed).validate()
    if args.draft and not args.chain and not 1 <= args.budget <= 64:
        raise InvalidRequestError("--budget must be between 1 and 64", param="budget")
    stop = sorted(tok.eos_ids) if tok is not None and not args.ignore_eos else []
    if args.draft:
        from .engine.models.dflash import load_drafter
        from .engine.speculative import LocalProposer, SpecConfig, speculative_generate

        proposer = LocalProposer(load_drafter(args.draft, target.model))
        spec = SpecConfig(budget=None if args.chain else args.budget)
        res = speculative_generate(target.model, proposer, prompt_ids, args.max_tokens, params, spec,
                                   stop_ids=stop, max_ctx=args.max_ctx)
    else:
        res = generate(target.model, prompt_ids, args.max_tokens, params, stop_ids=stop, max_ctx=args.max_ctx)
    out_ids = res.token_ids
    text_ids = out_ids[:-1] if res.finish_reason == "stop" else out_ids
    text = tok.decode(text_ids) if tok is not None else None
    if args.json:
        obj = {"model": target.name, "prompt_ids": list(map(int, prompt_ids)), "token_ids": out_ids,
               "text": text, "finish_reason": res.finish_reason,
               "timings": {"load_ms": round(load_ms, 3), **res.timings()}}
        if res.spec is not None:
            obj["spec"] = res.spec
        print(json.dumps(obj))
    else:
        print(text if text is not None else " ".join(map(str, out_ids)))
        t = res.timings()
        extra = (f", mean acceptance length {res.spec['mean_acceptance_length']:.2f}"
                 if res.spec is not None else "")
        print(f"[{t['prompt_n']} prompt tokens, {t['predicted_n']} generated, "
              f"{t['predicted_per_second']:.1f} tok/s{extra}]", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .engine.convert import convert_hf_to_gguf

    info = convert_hf_to_gguf(args.src, args.out, args.outtype)
    print(json.dumps(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specsplit", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (no server)")
    g.add_argument("--model", help="GGUF file or Hugging Face safetensors folder (default: the embedded model "
                   "and its drafter)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--thinking", action="store_true", help="with --chat: enable_thinking=true")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--max-ctx", type=int, default=None, help="context size (default: the model's)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--draft", help="DFlash drafter (z-lab safetensors folder or GGUF): speculative decoding")
    g.add_argument("--no-draft", action="store_true", help="plain decoding even with the embedded default model")
    tree = g.add_mutually_exclusive_group()
    tree.add_argument("--budget", type=int, default=22, help="DDTree budget: non-root tree nodes, 1..64 (default 22)")
    tree.add_argument("--chain", action="store_true", help="verify the drafter's top-1 block as a chain")
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a Hugging Face safetensors folder to GGUF")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0", "q4_0"])
    c.set_defaults(func=cmd_convert)
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
