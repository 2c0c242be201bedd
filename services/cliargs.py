"""Flags that can also come from SPECSPLIT_* environment variables; argparse value types the service commands share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "SPECSPLIT_"


def env_name(flag: str) -> str:
    """--max-queue -> SPECSPLIT_MAX_QUEUE."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def add_env_argument(parser: argparse.ArgumentParser | Any, flag: str, **kw: Any) -> None:
    """parser.add_argument(flag, ...) whose default comes from SPECSPLIT_<FLAG> when that is set.

    argparse runs `type` over string defaults, so the variable is parsed exactly like the flag would be;
    a variable also satisfies `required=True`. Boolean switches (action="store_true") read 1/true/yes/on.
    """
    env = env_name(flag)
    val = os.environ.get(env)
    if val is not None and val != "":
        if kw.get("action") in ("store_true", "store_false"):
            on = val.strip().lower() in ("1", "true", "yes", "on")
            kw["default"] = on if kw["action"] == "store_true" else not on
        else:
            kw["default"] = val
        kw["required"] = False
    kw["help"] = f"{kw.get('help', '')} [env {env}]".strip()
    parser.add_argument(flag, **kw)


def _convert(text: str, kind: Callable[[str], Any], what: str) -> Any:
    """kind(text), or an ArgumentTypeError 'expected <what>, got ...'."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum."""
    def parse(text: str) -> int:
        n = _convert(text, int, "a whole number")
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {n}")
        return n

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0."""
    x = _convert(text, float, "a number of seconds")
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {x}")
    return x


def port(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    n = _convert(text, int, "a port number")
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {n}")
    return n


def address(text: str) -> str:
    """An argparse type: a service address services.rpc.parse_address accepts, returned as given."""
    from services.rpc import parse_address

    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def kv_cache_type(text: str) -> str:
    """An argparse type: a KV cache type for --cache-type-k / --cache-type-v (auto, f16, q8_0, tq3_0, f32)."""
    from services.engine.kvcache import CACHE_TYPE_CHOICES

    t = str(text).strip().lower()
    if t not in CACHE_TYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CACHE_TYPE_CHOICES)}, got {text!r}")
    return t


KV_CACHE_HELP = ("KV cache type of the attention {side}: auto, f16, q8_0, tq3_0 or f32 (default auto: tq3_0 for V; "
                 "for K q8_0 when query heads per KV head >= 6, else tq3_0; f32 where head_dim is not a "
                 "multiple of 64)")


def device(text: str) -> str:
    """An argparse type: a compute device, `cpu`, `cuda` or `cuda:N`, returned normalised (cuda -> cuda:0)."""
    from services.engine.memory_plan import parse_device

    try:
        return str(parse_device(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_device_arguments(parser: argparse.ArgumentParser | Any, env: bool = True) -> None:
    """--device, --draft-device and --plan-only (memory planning at start-up, services.engine.memory_plan)."""
    add = (lambda flag, **kw: add_env_argument(parser, flag, **kw)) if env else parser.add_argument
    add("--device", type=device, default="cpu",
        help="where the target runs: cpu or cuda:N (default cpu; cuda needs the GPU backend)")
    add("--draft-device", type=device, default=None,
        help="where the in-process drafter runs (default: the target's device)")
    add("--plan-only", action="store_true",
        help="print the start-up memory plan (JSON with --json) and exit without loading the weights")


MAX_BUDGET = 1024            # a DDTree budget beyond this is a typo, not a tuning choice


def parse_budget(text: str) -> int | str | None:
    """An argparse type for --budget: `chain` -> None, `auto` -> "auto", N -> N (1..MAX_BUDGET)."""
    t = str(text).strip().lower()
    if t == "chain":
        return None
    if t == "auto":
        return "auto"
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes a number, 'chain' or 'auto', got {text!r}") from None
    if not 1 <= n <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"--budget must be in 1..{MAX_BUDGET}, got {n}")
    return n
